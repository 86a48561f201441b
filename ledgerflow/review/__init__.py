"""The reviewer page (``ledgerflow review``): the queue of open requests, each request's whole context
package with its media, and decisions signed in the approver's browser with their own Ed25519 key; the same
over a JSON API for other tools. See ``app`` for the routes and ``auth`` for who may see what.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ledgerflow.review.app import create_app
from ledgerflow.review.auth import scopes_from
from runtime.settings import ConfigError, Settings

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

__all__ = ["create_app", "serve", "server_config"]


def serve(
    settings: Settings, host: str, port: int, *, tls_cert: Path | None = None, tls_key: Path | None = None
) -> None:
    """Run the reviewer page with uvicorn until interrupted (over TLS with ``tls_cert`` and ``tls_key``).
    ConfigError if no approver can log in, or a TLS file is missing."""
    import uvicorn

    if not settings.review_token_map():
        raise ConfigError(
            "no reviewer tokens: set LEDGERFLOW_REVIEW_TOKENS to a JSON object of approver name -> token"
        )
    uvicorn.Server(server_config(settings, host, port, tls_cert=tls_cert, tls_key=tls_key)).run()


def server_config(
    settings: Settings,
    host: str,
    port: int,
    *,
    app: FastAPI | None = None,
    forwarded_allow_ips: str | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
) -> uvicorn.Config:
    """How ``serve`` runs the page: ``app`` (default ``create_app(settings)`` with the token scopes of
    ``LEDGERFLOW_REVIEW_SCOPES``) on uvicorn.

    ``forwarded_allow_ips`` (default: uvicorn's ``FORWARDED_ALLOW_IPS`` variable, as its
    ``--forwarded-allow-ips`` option) lists the proxies whose ``X-Forwarded-For`` names the client: behind
    one, login limits are per client address, not one bucket for everyone behind the proxy. Unlike uvicorn,
    nothing is trusted by default (not even 127.0.0.1): a client's own header is never believed.

    ``tls_cert`` and ``tls_key`` (PEM files, both or neither): the page speaks only HTTPS (the deployment's
    reviewer service, with a certificate of its private CA or a real one). Its session cookie is ``Secure``
    either way behind a TLS proxy; served directly, TLS is what keeps tokens and cookies off the wire.
    """
    import uvicorn

    if (tls_cert is None) != (tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
    for name, path in (("--tls-cert", tls_cert), ("--tls-key", tls_key)):
        if path is not None and not path.is_file():
            raise ConfigError(f"{name} {path}: no such file")

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
        ssl_certfile=str(tls_cert) if tls_cert is not None else None,
        ssl_keyfile=str(tls_key) if tls_key is not None else None,
    )
