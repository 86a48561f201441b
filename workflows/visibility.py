"""The task's custom search attributes (``workflows.contracts.SEARCH_ATTRIBUTES``) on the Temporal server.

A workflow that upserts an attribute the server does not know fails its workflow task again and again, so the
worker makes sure they exist before it polls: it registers the missing ones (the dev server, a self-hosted
cluster with operator rights), or stops with one line saying how to register them (a cluster it may not
change, e.g. Temporal Cloud: `tcld namespace search-attributes add`).
"""

from __future__ import annotations

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.service import RPCError

from runtime.settings import ConfigError
from workflows.contracts import SEARCH_ATTRIBUTES


async def ensure_search_attributes(client: Client) -> list[str]:
    """Register the missing search attributes in the client's namespace; the names it added. ConfigError if
    some are missing and the server refuses to add them."""
    namespace = client.namespace
    try:
        listed = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=namespace)
        )
    except RPCError as e:
        raise ConfigError(f"cannot list Temporal's search attributes: {e.message}") from None
    known = set(listed.custom_attributes) | set(listed.system_attributes)
    missing = {k.name: IndexedValueType.ValueType(k.indexed_value_type) for k in SEARCH_ATTRIBUTES}
    missing = {name: kind for name, kind in missing.items() if name not in known}
    if not missing:
        return []
    try:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=namespace, search_attributes=missing)
        )
    except RPCError as e:
        names = ", ".join(sorted(missing))
        raise ConfigError(
            f"the search attributes {names} are not registered in namespace {namespace} and the server"
            f" refused to add them ({e.message}): register them (README: the Temporal UI)"
        ) from None
    return sorted(missing)
