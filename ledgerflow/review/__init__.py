"""The reviewer page (``ledgerflow review``): the queue of open requests, each request's whole context
package with its media, and decisions signed in the approver's browser with their own Ed25519 key; the same
over a JSON API for other tools. See ``app`` for the routes and ``auth`` for who may see what.
"""

from __future__ import annotations

from ledgerflow.review.app import create_app
from runtime.settings import ConfigError, Settings

__all__ = ["create_app", "serve"]


def serve(settings: Settings, host: str, port: int) -> None:
    """Run the reviewer page with uvicorn until interrupted. ConfigError if no approver can log in."""
    import uvicorn

    if not settings.review_token_map():
        raise ConfigError(
            "no reviewer tokens: set LEDGERFLOW_REVIEW_TOKENS to a JSON object of approver name -> token"
        )
    uvicorn.run(create_app(settings), host=host, port=port, log_level="info", proxy_headers=False)
