"""One adapter per route, built from the route table when a worker starts.

Each route's ``adapter`` names a plugin (``vendors.plugins``: the entry point group ``ledgerflow.adapters``,
where the four built-in adapters are registered too); its factory builds the adapter from an
``AdapterContext``. Credentials are resolved here, inside the worker: a route names the environment variables
that hold its secrets and ``credential`` reads them. Nothing built here ever goes into a workflow argument,
result or error.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

from artifacts.store import ArtifactStore
from vendors import plugins
from vendors.adapter import VendorAdapter
from vendors.plugins import AdapterContext
from vendors.routes import RouteTable
from vendors.traced import TracedAdapter


class Adapters:
    """The adapter of every route in ``table`` (built lazily, one per route, shared by every activity, each
    call a span).

    Every route's adapter is checked when this is made (installed once, importable, of this protocol
    version: ``vendors.plugins.check_table``), so a worker with an unusable plugin does not start.

    Args:
        table: The route table.
        vendor_url: The base URL of routes that name none (the embedded simulator), if any.
        credential: Reads the secret held by an environment variable name (raises if unset).
        client: The HTTP client every HTTP adapter shares.
        store_for: The artifact store that can read a URI (the local adapter reads its inputs through it).
    """

    def __init__(
        self,
        table: RouteTable,
        *,
        vendor_url: str | None,
        credential: Callable[[str], str],
        client: httpx.AsyncClient,
        store_for: Callable[[str], ArtifactStore],
    ) -> None:
        plugins.check_table(table)
        self.table = table
        self._vendor_url = vendor_url
        self._credential = credential
        self._client = client
        self._store_for = store_for
        self._built: dict[str, VendorAdapter] = {}

    def get(self, executor: str) -> VendorAdapter:
        """The route's adapter, built on first use, with a ``vendor.*`` span around each call
        (``vendors.traced``); the adapter itself is the wrapper's ``inner``."""
        adapter = self._built.get(executor)
        if adapter is None:
            adapter = self._built[executor] = TracedAdapter(self._build(executor))
        return adapter

    def context(self, executor: str) -> AdapterContext:
        """What the route's factory builds its adapter from."""
        route = self.table.route(executor)
        return AdapterContext(
            route_name=executor,
            route=route,
            base_url=route.base_url or self._vendor_url,
            credential=self._credential,
            client=self._client,
            store_for=self._store_for,
        )

    def _build(self, executor: str) -> VendorAdapter:
        return plugins.build(self.context(executor))

    async def aclose(self) -> None:
        for adapter in self._built.values():
            await adapter.aclose()
