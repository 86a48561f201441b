"""The reviewer page (``ledgerflow review``): the queue of open requests, each request's whole context
package with its media, and decisions signed in the approver's browser with their own Ed25519 key; the same
over a JSON API for other tools. See ``app`` for the routes and ``auth`` for who may see what.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ledgerflow.review.app import create_app
from ledgerflow.review.auth import scopes_from
from runtime.settings import ConfigError, Settings

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

__all__ = ["create_app", "serve", "server_config"]


def serve(settings: Settings, host: str, port: int) -> None:
    """Run the reviewer page with uvicorn until interrupted. ConfigError if no approver can log in."""
    import uvicorn

    if not settings.review_token_map():
        raise ConfigError(
            "no reviewer tokens: set LEDGERFLOW_REVIEW_TOKENS to a JSON object of approver name -> token"
        )
    uvicorn.Server(server_config(settings, host, port)).run()


def server_config(
    settings: Settings,
    host: str,
    port: int,
    *,
    app: FastAPI | None = None,
    forwarded_allow_ips: str | None = None,
) -> uvicorn.Config:
    """How ``serve`` runs the page: ``app`` (default ``create_app(settings)`` with the token scopes of
    ``LEDGERFLOW_REVIEW_SCOPES``) on uvicorn.

    ``forwarded_allow_ips`` (default: uvicorn's ``FORWARDED_ALLOW_IPS`` variable, as its
    ``--forwarded-allow-ips`` option) lists the proxies whose ``X-Forwarded-For`` names the client: behind
    one, login limits are per client address, not one bucket for everyone behind the proxy. Unlike uvicorn,
    nothing is trusted by default (not even 127.0.0.1): a client's own header is never believed.
    """
    import uvicorn

    trusted = (
        os.environ.get("FORWARDED_ALLOW_IPS", "") if forwarded_allow_ips is None else forwarded_allow_ips
    )
    trusted = trusted.strip()
    return uvicorn.Config(
        app if app is not None else create_app(settings, scopes=scopes_from(settings)),
        host=host,
        port=port,
        log_level="info",
        proxy_headers=bool(trusted),
        forwarded_allow_ips=trusted or None,
    )
