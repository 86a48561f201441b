"""The webhook receiver's app: ``POST /callbacks/{route}?operation_key=K`` and ``GET /healthz``.

A process of its own (``ledgerflow webhooks serve``), apart from the reviewer page: it is exposed to vendors,
the page to approvers. For each call: the route must be in the route table with a ``callback:``; the body is
read raw (at most ``MAX_BODY``); the signature is checked by the route's scheme with the secret its
``callback.secret_env`` names, read at each request (a rotated secret needs no restart); then the call is
recorded in the ledger, accepted or refused, with why (``ledger.callbacks.record_callback``), and an accepted
one wakes the worker waiting on its operation (NOTIFY). The body is kept for the record only: the worker reads
the job from the vendor.

Answers: accepted 204; replayed 200 ``{"verdict": "replayed"}`` (the vendor may stop retrying); forged or
stale 401; malformed 400 (413: a body over ``MAX_BODY``); unknown route 404; the secret unset or the ledger
unreachable 503 (the vendor retries later; an unset secret is logged, not recorded). No answer ever holds the
secret or the signature expected.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Final

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy import Engine

from ledger.callbacks import Verdict, open_engine, record_callback
from ledger.errors import LedgerError
from ledgerflow.webhooks.signatures import verify_hmac, verify_standard
from runtime.settings import ConfigError, Settings
from vendors.routes import CallbackSpec, deployment_table

MAX_BODY: Final = 1 << 20  # a prediction's callback is a few kB; its outputs are URLs
MAX_KEPT_BODY: Final = 64 << 10  # an accepted body larger than this is recorded by its hash only
MAX_OPERATION_KEY: Final = 200
MAX_ROUTE: Final = 200
_STATUS: Final[dict[str, int]] = {
    "accepted": 204,
    "replayed": 200,
    "forged": 401,
    "stale": 401,
    "malformed": 400,
    "unknown_route": 404,
}

log = logging.getLogger("ledgerflow.webhooks")


def create_app(settings: Settings, *, clock: Callable[[], float] = time.time) -> FastAPI:
    """The receiver. Reads the route table and the database URL now (ConfigError, one line, if either is
    unusable); opens its database engine at startup and disposes of it at shutdown. ``clock``: Unix seconds,
    for the Standard Webhooks timestamp check."""
    table = deployment_table(settings)
    url = settings.resolved_database_url()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.engine = open_engine(url)
        try:
            yield
        finally:
            app.state.engine.dispose()

    app = FastAPI(
        title="ledgerflow webhooks", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/callbacks/{route}")
    async def callback(route: str, request: Request) -> Response:
        engine: Engine = request.app.state.engine
        body, too_large = await _read_body(request)
        body_sha256 = hashlib.sha256(body).hexdigest()
        key = request.query_params.get("operation_key")
        claimed = _claimed_status(body)

        async def record(verdict: Verdict, reason: str, *, delivery_id: str = body_sha256) -> Response:
            try:
                final = await asyncio.to_thread(
                    record_callback,
                    engine,
                    route=route[:MAX_ROUTE],
                    operation_key=key[:MAX_OPERATION_KEY] if key is not None else None,
                    delivery_id=delivery_id,
                    verdict=verdict,
                    reason=reason,
                    body_sha256=body_sha256,
                    claimed_status=claimed,
                    body=_kept_body(body) if verdict == "accepted" else None,
                )
            except LedgerError as e:
                log.error("callback on route %.200r not recorded: %s", route, e)
                return JSONResponse({"error": "the ledger is unavailable: retry later"}, status_code=503)
            if final == "accepted":
                return Response(status_code=204)
            content: dict[str, str] = {"verdict": final}
            if final == "malformed":  # what is wrong with the request, for whoever integrates the vendor
                content["error"] = reason
            return JSONResponse(content, status_code=_STATUS[final])

        spec = table.routes.get(route)
        if spec is None or spec.callback is None:
            why = "no such route" if spec is None else "the route takes no callbacks (no callback:)"
            return await record("unknown_route", why)
        if too_large:
            response = await record(
                "malformed", f"the body is larger than {MAX_BODY} bytes (hash: its start)"
            )
            response.status_code = 413
            return response
        if not key or len(key) > MAX_OPERATION_KEY:
            return await record(
                "malformed", f"the operation_key query parameter is missing or over {MAX_OPERATION_KEY} chars"
            )
        secret = _secret(settings, route, spec.callback)
        if secret is None:
            return JSONResponse({"error": "callbacks of this route are not configured"}, status_code=503)
        try:
            if spec.callback.scheme == "standard":
                verdict = verify_standard(
                    secret, request.headers, body, clock(), tolerance=spec.callback.tolerance
                )
                delivery = request.headers.get("webhook-id", "").strip()
                delivery_id = delivery if verdict.kind != "malformed" else body_sha256
            else:
                verdict = verify_hmac(secret, request.headers.get(spec.callback.header), body)
                delivery_id = body_sha256
        except ValueError as e:  # the secret itself is unusable: the operator's to fix, not the vendor's
            log.error("callbacks of route %r refused: %s (%s)", route, e, spec.callback.secret_env)
            return JSONResponse({"error": "callbacks of this route are not configured"}, status_code=503)
        return await record(verdict.kind, verdict.reason, delivery_id=delivery_id)

    return app


async def _read_body(request: Request) -> tuple[bytes, bool]:
    """The raw body, and whether it was over ``MAX_BODY`` (then only its first ``MAX_BODY + 1`` bytes are
    read: a sender cannot make the receiver hold more)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_BODY:
            return b"".join(chunks)[: MAX_BODY + 1], True
    return b"".join(chunks), False


def _parsed(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def _claimed_status(body: bytes) -> str | None:
    """The body's top-level ``status``, as the vendor claims it (recorded, never acted on)."""
    parsed = _parsed(body) if len(body) <= MAX_BODY else None
    status = parsed.get("status") if isinstance(parsed, dict) else None
    return status[:40] if isinstance(status, str) else None


def _kept_body(body: bytes) -> Any:
    """What an accepted callback's row keeps of its body: the parsed JSON up to ``MAX_KEPT_BODY`` bytes, else
    nothing (its hash is kept either way). jsonb refuses a ``\\u0000`` escape: such a body is not kept."""
    if len(body) > MAX_KEPT_BODY or b"\\u0000" in body:
        return None
    parsed = _parsed(body)
    try:  # a lone surrogate (an escape such as \ud800 alone) is valid JSON text but not valid jsonb
        json.dumps(parsed, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return None
    return parsed


def _secret(settings: Settings, route: str, callback: CallbackSpec) -> str | None:
    """The route's callback secret, read now; None (logged, naming the variable, never its value) if unset."""
    try:
        return settings.credential(callback.secret_env)
    except ConfigError:
        log.error("callbacks of route %r refused: %s is not set", route, callback.secret_env)
        return None
