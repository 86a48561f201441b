"""One adapter per route, built from the route table when a worker starts.

Credentials are resolved here, inside the worker: a route names the environment variable that holds its key
and ``credential`` reads it. Nothing built here ever goes into a workflow argument, result or error.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

from artifacts.store import ArtifactStore
from vendors.adapter import VendorAdapter
from vendors.jobs import JobsAdapter
from vendors.local import LocalAdapter
from vendors.openai import OpenAIAdapter
from vendors.predictions import PredictionsAdapter
from vendors.routes import AdapterKind, RouteError, RouteTable
from vendors.traced import TracedAdapter


class Adapters:
    """The adapter of every route in ``table`` (built lazily, one per route, shared by every activity, each
    call a span).

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

    def _build(self, executor: str) -> VendorAdapter:
        route = self.table.route(executor)
        if route.adapter == AdapterKind.LOCAL:
            return LocalAdapter(route, self._store_for)
        base = route.base_url or self._vendor_url
        if not base:
            raise RouteError(f"route {executor!r}: no base_url, and no LEDGERFLOW_VENDOR_URL to default to")
        key = self._credential(route.credential_env)
        kinds: dict[AdapterKind, type[JobsAdapter] | type[PredictionsAdapter] | type[OpenAIAdapter]] = {
            AdapterKind.JOBS: JobsAdapter,
            AdapterKind.PREDICTIONS: PredictionsAdapter,
            AdapterKind.OPENAI: OpenAIAdapter,
        }
        return kinds[route.adapter](route, base, key, client=self._client)

    async def aclose(self) -> None:
        for adapter in self._built.values():
            await adapter.aclose()
