"""The webhook receiver (``ledgerflow webhooks serve``): vendors' callbacks, verified, recorded, and turned
into a wake-up for the worker waiting on the operation (``ledger.callbacks``). See ``app`` for the endpoint
and ``signatures`` for the schemes.

It runs apart from the reviewer page (its own process and port: vendors reach it, approvers reach the page)
and logs in to the ledger as ``lf_receiver``, which may insert a callback and nothing else.
"""

from __future__ import annotations

from ledgerflow.webhooks.app import create_app
from runtime.settings import ConfigError, Settings
from vendors.routes import deployment_table

__all__ = ["create_app", "serve"]


def serve(settings: Settings, host: str, port: int) -> None:
    """Run the receiver with uvicorn until interrupted. ConfigError if no route takes callbacks."""
    import uvicorn

    if not any(spec.callback is not None for spec in deployment_table(settings).routes.values()):
        raise ConfigError("no route takes callbacks: give a route of LEDGERFLOW_ROUTES_FILE a `callback:`")
    uvicorn.Server(
        uvicorn.Config(create_app(settings), host=host, port=port, log_level="info", proxy_headers=False)
    ).run()
