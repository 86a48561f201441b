"""The reviewer page and its JSON API (FastAPI, server-rendered Jinja2, one hand-written script).

Pages: ``/login``, ``/queue``, ``/requests/{task_id}/{request_id}``, and ``/artifacts/{task_id}/{sha256}``
(the media the request page shows). API: ``GET /api/queue``, ``GET /api/requests/{task_id}/{request_id}``,
``POST /api/decisions/{task_id}``, ``POST /api/changes/{task_id}``. The page signs a decision, or a change to
the running task (pause, resume, skip, re-route, an edit, a waiver, a restore), in the browser
(``static/review.js``) and posts it to the same API; the server relays it to the task's workflow as it is
(``ledgerflow.views.people.relay``, ``send_change``) and answers with the worker's ruling. No private key ever
reaches the server. The queue offers one action for each group of open dead letters that share a systemic
cause (``ledgerflow dlq --groups``): the page signs a resume for each member and posts each to the same API.

Errors are one line: JSON ``{"error": ...}`` under ``/api/`` and for any request with an ``Authorization``
header (a tool), a small page otherwise; never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from functools import cache
from pathlib import Path
from typing import Any, Final, TypeVar

from anyio import to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from markupsafe import Markup
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from artifacts import ArtifactError, ArtifactMissing, ArtifactStore, open_store
from ledger.errors import LedgerError, LedgerUnavailable
from ledger.recorder import Recorder
from ledgerflow.client import ClientError, recorder
from ledgerflow.review import views
from ledgerflow.review.auth import (
    CSRF_FIELD,
    Auth,
    AuthError,
    Identity,
    RateLimiter,
    Session,
    client_of,
    session_secret,
)
from ledgerflow.views import people
from ledgerflow.views.queue import dead_letter_groups, dead_letters, group
from rules.changes import parse_change
from rules.people import parse_decision
from rules.plan import ID_PATTERN
from rules.projection import TaskState, fold
from runtime.settings import ConfigError, Settings

HERE: Final = Path(__file__).resolve().parent
MAX_BODY: Final = 16 * 1024  # a signed decision is well under 3 KB (the note is at most 2,000 characters)
_TASK_ID: Final = re.compile(ID_PATTERN)
_SHA256: Final = re.compile(r"[0-9a-f]{64}")
# Scripts, styles and media only from this origin; no inline script, no framing.
_CSP: Final = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; media-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'; object-src 'none'"
)


class LoginRequired(Exception):
    """A page was asked for without a login: redirect to the login form."""


def create_app(
    settings: Settings,
    *,
    tokens: dict[str, str] | None = None,
    trusted_header: str | None = None,
    relay_timeout: float = people.POLL_SECONDS,
    login_rate: tuple[int, float] = (5, 12.0),
    decision_rate: tuple[int, float] = (10, 6.0),
    scopes: Mapping[str, Sequence[str]] | None = None,
) -> FastAPI:
    """The reviewer app.

    ConfigError (one line) outside dev mode without ``LEDGERFLOW_REVIEW_SESSION_SECRET``: every replica signs
    and checks session cookies with it.

    Args:
        settings: Where the ledger, Temporal and the artifact store are, and the session secret.
        tokens: Approver name -> login token; default ``settings.review_token_map()``.
        trusted_header: For a deployment behind an authenticating proxy (OIDC, …): the request header in
            which the proxy passes the user's approver name, trusted as is. Only set it when the proxy strips
            that header from what clients send and nothing reaches the app except through the proxy. None
            (the default): tokens only.
        relay_timeout: How long a decision waits for the worker's ruling before it is answered "pending".
        login_rate: (burst, seconds per further attempt) of login attempts and bad bearer tokens, per client
            address.
        decision_rate: (burst, seconds per further decision) of decisions, per approver.
        scopes: Approver name -> the scopes their login may see (``*``, ``project:P``, ``episode:P/E``,
            ``task:T``, as an approver key's); an approver without an entry sees nothing. None (the default):
            every login sees every project.
    """

    auth = Auth(
        settings.review_token_map() if tokens is None else tokens,
        LedgerLogouts(settings),
        trusted_header,
        scopes,
        secret=session_secret(settings),  # shared by replicas; outside dev mode required (ConfigError)
    )
    logins = RateLimiter(*login_rate)
    decisions = RateLimiter(*decision_rate)
    templates = Jinja2Templates(directory=HERE / "templates")
    templates.env.filters["age"] = _age
    templates.env.filters["cents"] = _cents
    templates.env.filters["words"] = _words

    app = FastAPI(title="ledgerflow review", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    app.add_middleware(SecurityHeaders)

    @cache
    def store() -> ArtifactStore:
        return open_store(settings.store_location())

    # ── helpers ──────────────────────────────────────────────────────────────────────────────────────

    def render(
        request: Request,
        name: str,
        context: dict[str, Any],
        status: int = 200,
        identity: Identity | None = None,
    ) -> HTMLResponse:
        """A page, with the session's CSRF token; a first visit gets its (not yet logged-in) session."""
        session = auth.session(request)
        fresh = session is None
        if session is None:
            session = Session.new()
        response = templates.TemplateResponse(
            request,
            name,
            {
                "csrf": session.csrf,
                "approver": identity.approver if identity else None,
                "via": identity.via if identity else None,
                "root": request.scope.get("root_path", ""),
                **context,
            },
            status_code=status,
        )
        if fresh:
            auth.set_cookie(request, response, session)
        return response

    def page_identity(request: Request) -> Identity:
        identity = auth.identify(request, logins)
        if identity is None:
            raise LoginRequired
        return identity

    def api_identity(request: Request) -> Identity:
        identity = auth.identify(request, logins)
        if identity is None:
            raise AuthError(401, "not logged in: send Authorization: Bearer <token>")
        return identity

    def check_covers(identity: Identity, task_id: str) -> None:
        """AuthError 403 unless ``identity``'s scopes cover the task (blocking: a ledger read)."""
        if auth.sees_everything(identity.approver):
            return
        if not auth.covers(identity.approver, views.task_chain(settings, task_id)):
            scopes = ", ".join(auth.scopes(identity.approver)) or "none"
            raise AuthError(403, f"task {task_id} is outside {identity.approver}'s scopes ({scopes})")

    def visible_queue(identity: Identity) -> list[dict[str, Any]]:
        """The open requests of the tasks ``identity``'s scopes cover (blocking: ledger reads)."""
        groups = people.queue(settings)
        if not auth.sees_everything(identity.approver):
            tasks = {item.task_id for g in groups for item in g}
            chains = views.task_chains(settings, tasks)
            seen = {t for t, chain in chains.items() if auth.covers(identity.approver, chain)}
            items = [item for g in groups for item in g if item.task_id in seen]
            groups = group(items)
        return people.queue_json(groups)

    async def failure(
        request: Request, status: int, message: str, headers: dict[str, str] | None = None
    ) -> Response:
        if request.url.path.startswith("/api/") or "authorization" in request.headers:  # a tool, not a page
            return JSONResponse({"error": message}, status_code=status, headers=headers)

        def who() -> Identity | None:  # an error page shows who is logged in, if that can be known
            with contextlib.suppress(AuthError, LedgerError):
                return auth.identify(request, None)
            return None

        identity = await to_thread.run_sync(who)  # a cookie is looked up in the ledger's logouts
        response = render(request, "error.html", {"status": status, "message": message}, status, identity)
        response.headers.update(headers or {})
        return response

    # ── errors: one line, a proper status, never a traceback ─────────────────────────────────────────

    @app.exception_handler(LoginRequired)
    async def _login(request: Request, exc: LoginRequired) -> Response:
        return RedirectResponse(f"{request.scope.get('root_path', '')}/login", status_code=303)

    @app.exception_handler(AuthError)
    async def _auth(request: Request, exc: AuthError) -> Response:
        return await failure(request, exc.status, str(exc), exc.headers)

    @app.exception_handler(ClientError)
    async def _client(request: Request, exc: ClientError) -> Response:
        return await failure(request, client_status(str(exc)), str(exc))

    @app.exception_handler(ConfigError)
    async def _config(request: Request, exc: ConfigError) -> Response:
        return await failure(request, 503, str(exc))

    @app.exception_handler(LedgerUnavailable)
    async def _ledger(request: Request, exc: LedgerUnavailable) -> Response:
        return await failure(request, 503, str(exc).splitlines()[0][:300])

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else "bad request"
        if exc.status_code == 404 and message == "Not Found":
            message = f"no page {request.url.path[:200]}"
        return await failure(request, exc.status_code, message, dict(exc.headers or {}))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()))
        return await failure(request, 400, f"bad request: {where} {first.get('msg', '')}".strip())

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> Response:
        # Starlette raises the exception again once this answer is sent, so the server logs its traceback.
        message = f"internal error ({type(exc).__name__}); the server log has the details"
        return await failure(request, 500, message)

    # ── login ────────────────────────────────────────────────────────────────────────────────────────

    @app.get("/", include_in_schema=False)
    def home(request: Request) -> Response:
        root = request.scope.get("root_path", "")
        target = "/queue" if auth.identify(request, logins) else "/login"
        return RedirectResponse(root + target, status_code=303)

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> Response:
        return Response(status_code=204)  # browsers ask for one; a 404 would be noise in their console

    @app.get("/login")
    def login_form(request: Request) -> Response:
        identity = auth.identify(request, logins)
        return render(request, "login.html", {"error": None}, identity=identity)

    @app.post("/login")
    async def login(request: Request) -> Response:
        form = await request.form()
        csrf, token = form.get(CSRF_FIELD), form.get("token")
        auth.check_csrf(request, None, csrf if isinstance(csrf, str) else "")
        logins.check(f"login:{client_of(request)}", "login attempts")
        approver = auth.approver_for(token) if isinstance(token, str) and token else None
        if approver is None:
            return render(request, "login.html", {"error": "unknown token"}, 401)
        response = RedirectResponse(f"{request.scope.get('root_path', '')}/queue", status_code=303)
        auth.set_cookie(request, response, Session.new(approver))  # a new session and CSRF token at login
        return response

    @app.post("/logout")
    async def logout(request: Request) -> Response:
        form = await request.form()
        csrf = form.get(CSRF_FIELD)
        auth.check_csrf(request, None, csrf if isinstance(csrf, str) else "")
        session = auth.session(request)
        if session is not None:
            await to_thread.run_sync(auth.revoke, session)  # a copy of this cookie is refused from now on
        response = RedirectResponse(f"{request.scope.get('root_path', '')}/login", status_code=303)
        auth.set_cookie(request, response, Session.new())
        return response

    # ── pages ────────────────────────────────────────────────────────────────────────────────────────

    def shared_causes(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The open dead letters among ``rows`` (the visible queue) grouped by systemic cause as
        ``ledgerflow dlq --groups`` groups them (``dead_letter_groups``), only the groups of two or more: each
        with its share of the open dead letters shown, its cause in words and its members (blocking: reads
        the ledger, for the tasks with an open dead letter only)."""
        place = {r["id"]: i for i, r in enumerate(rows) if r["kind"] == "dead_letter"}
        shown = place.keys()
        if len(shown) < 2:
            return []
        rec = recorder(settings)
        try:
            entries: list[dict[str, Any]] = []
            for task_id in sorted({r["task_id"] for r in rows if r["id"] in shown}):
                events = rec.read_events(task_id)
                if events:
                    entries += dead_letters(fold(events), events)
        finally:
            rec.dispose()
        # Open now and in the queue the page shows (a dead letter resolved meanwhile is left out).
        entries = [e for e in entries if e["id"] in shown and e["status"] == "open"]
        out = []
        for g in dead_letter_groups(entries):
            if g["count"] < 2:
                continue
            kind, _, shape = g["cause"].partition(": ")
            members = []
            for global_id in sorted(g["ids"], key=place.__getitem__):  # in the queue's order
                task_id, request_id = people.parse_global_id(global_id)
                members.append({"id": global_id, "task_id": task_id, "request_id": request_id})
            what = _FAILURE_KINDS.get(kind, kind.replace("_", " "))
            out.append({**g, "of": len(entries), "what": what, "shape": shape, "members": members})
        return out

    @app.get("/queue")
    def queue_page(request: Request) -> Response:
        identity = page_identity(request)
        rows = visible_queue(identity)
        context = {"rows": rows, "groups": shared_causes(rows), "now": datetime.now(UTC)}
        return render(request, "queue.html", context, identity=identity)

    @app.get("/requests/{task_id}/{request_id:path}")
    def request_page(request: Request, task_id: str, request_id: str) -> Response:
        identity = page_identity(request)
        check_task_id(task_id)
        check_covers(identity, task_id)
        detail = people.request(settings, task_id, request_id)
        choices = views.budget_choices(settings, task_id, request_id)
        approvers = detail["approvers"]
        running = detail["task_state"] not in _TERMINAL
        context = {
            "d": detail,
            "ctx": detail["context_now"],
            "asked": detail["context_at_request"],
            "artifacts": [_shown(a) for a in detail["context_now"]["artifacts"]],
            "versions": [_shown(v) for v in detail["versions"]],
            "choices": choices,
            "open": detail["status"] == "open" and running,
            "running": running,
            "routes": views.route_names(settings) if running else [],
            "not_allowed": isinstance(approvers, list) and identity.approver not in approvers,
        }
        return render(request, "request.html", context, identity=identity)

    @app.get("/artifacts/{task_id}/{sha256}")
    def artifact(request: Request, task_id: str, sha256: str) -> Response:
        identity = api_identity(request)
        check_task_id(task_id)
        check_covers(identity, task_id)
        if not _SHA256.fullmatch(sha256):
            raise HTTPException(404, f"{sha256[:80]!r} is not an artifact's sha256")
        ref = views.find_artifact(settings, task_id, sha256)
        if ref is None:
            raise HTTPException(404, f"task {task_id} has no artifact {sha256[:16]}…")
        what = f"artifact {sha256[:16]}… of task {task_id}"
        if not views.in_store(store(), ref["uri"]):
            raise HTTPException(404, f"{what} is not in the configured artifact store")
        try:
            chunks = store().open_read(ref["uri"])
        except ArtifactMissing:
            raise HTTPException(404, f"artifact {sha256[:16]}… is missing from the store") from None
        except ArtifactError as e:
            raise HTTPException(404, str(e)) from None
        size = ref["size"] if isinstance(ref.get("size"), int) and ref["size"] > 0 else None
        content_type = views.media_type(ref)
        headers = {
            "Content-Disposition": "inline" if views.element(content_type) else "attachment",
            # What the bytes are was decided above: never let a browser guess (or run) anything else.
            "Content-Security-Policy": "sandbox; default-src 'none'",
            "Cache-Control": "private, max-age=3600",  # content-addressed: the bytes never change
        }
        if size is not None:
            headers["Content-Length"] = str(size)
        body = views.verified(chunks, sha256, size, f"{what} at {ref['uri']}")
        return StreamingResponse(body, media_type=content_type, headers=headers)

    # ── the JSON API ─────────────────────────────────────────────────────────────────────────────────

    @app.get("/api/queue")
    def api_queue(request: Request) -> Response:
        return JSONResponse(visible_queue(api_identity(request)))

    @app.get("/api/requests/{task_id}/{request_id:path}")
    def api_request(request: Request, task_id: str, request_id: str) -> Response:
        identity = api_identity(request)
        check_task_id(task_id)
        check_covers(identity, task_id)
        detail = people.request(settings, task_id, request_id)
        choices = views.budget_choices(settings, task_id, request_id)
        body = {**detail, "budget_scopes": choices.scopes, "default_scope": choices.default}
        return Response(json.dumps(body, default=str), media_type="application/json")

    async def signed_here(
        request: Request, task_id: str, what: str, parse: Callable[[Any], Any]
    ) -> dict[str, Any]:
        """A signed payload posted by a logged-in approver: their session, CSRF token and rate, its shape,
        their own signature (not someone else's), and their scope over the task; the payload, as posted."""
        identity = await to_thread.run_sync(api_identity, request)  # a cookie's logout is a ledger read
        auth.check_csrf(request, identity, None)
        decisions.check(f"decide:{identity.approver}", f"{what}s from {identity.approver}")
        check_task_id(task_id)
        payload: dict[str, Any] = await json_body(request)
        parsed = parse(payload)
        if isinstance(parsed, str):
            raise HTTPException(400, parsed)
        if parsed.approver != identity.approver:
            raise HTTPException(
                403, f"you are {identity.approver}: a {what} signed as {parsed.approver} is not yours to send"
            )
        await to_thread.run_sync(check_covers, identity, task_id)
        return payload

    def answered(sent: people.Sent, id_field: str) -> Response:
        body = {id_field: sent.decision_id, "status": sent.status, "detail": sent.detail, "line": sent.line}
        return JSONResponse(body, status_code=202 if sent.status == "pending" else 200)

    @app.post("/api/decisions/{task_id}")
    async def api_decide(request: Request, task_id: str) -> Response:
        payload = await signed_here(request, task_id, "decision", parse_decision)

        def relay() -> people.Sent:
            # relay reads the ledger synchronously (a fold, then polls): on a thread of its own, with its own
            # loop, so a slow or locked ledger never stalls the page's event loop for everyone else.
            return asyncio.run(people.relay(settings, task_id, payload, timeout=relay_timeout))

        return answered(await to_thread.run_sync(relay), "decision_id")

    @app.post("/api/changes/{task_id}")
    async def api_change(request: Request, task_id: str) -> Response:
        """A signed change to a running task (rules.changes), signed in the browser like a decision."""
        payload = await signed_here(request, task_id, "change", parse_change)

        def relay() -> people.Sent:
            return asyncio.run(people.send_change(settings, task_id, payload, timeout=relay_timeout))

        return answered(await to_thread.run_sync(relay), "change_id")

    return app


T = TypeVar("T")


class LedgerLogouts:
    """The reviewer page's logouts, in the ledger (``review_logouts``): one connection per call, as the page's
    views read the ledger."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings

    def log_out_session(self, session_id: str, until: datetime) -> None:
        self._with(lambda rec: rec.log_out_session(session_id, until))

    def session_logged_out(self, session_id: str) -> bool:
        return self._with(lambda rec: rec.session_logged_out(session_id))

    def _with(self, call: Callable[[Recorder], T]) -> T:
        rec = recorder(self._settings)
        try:
            return call(rec)
        finally:
            rec.dispose()


_TERMINAL: Final = frozenset({TaskState.COMPLETED.value, TaskState.FAILED.value})


def _shown(a: dict[str, Any]) -> dict[str, Any]:
    """An artifact as the page shows it: its content type and the element that shows it inline, if any."""
    content_type = views.media_type(a)
    element = views.element(content_type)
    if element is None and int(a.get("size") or 0) <= views.TEXT_INLINE_MAX:
        element = "text"  # a script, a storyboard, a lesson: read in the page (if it is text)
    return {**a, "content_type": content_type, "element": element}


def check_task_id(task_id: str) -> None:
    if not _TASK_ID.fullmatch(task_id):
        raise HTTPException(404, f"{task_id[:80]!r} is not a task id")


def client_status(message: str) -> int:
    """The HTTP status of a ClientError (one line, written for a person): what is missing is 404, a task
    that is over 409, an unreachable Temporal 503, anything else 400."""
    if message.startswith(("no request", "no task")) or "has no running workflow" in message:
        return 404
    if "nothing to decide" in message:
        return 409
    if message.startswith("cannot reach"):
        return 503
    return 400


async def json_body(request: Request) -> Any:
    """The request's JSON body; 413 if too big, 400 if not JSON."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise HTTPException(413, f"the body is larger than {MAX_BODY} bytes")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise HTTPException(413, f"the body is larger than {MAX_BODY} bytes")
    try:
        return json.loads(body)
    except ValueError:
        raise HTTPException(400, "the body is not JSON (expected the signed decision)") from None


class SecurityHeaders:
    """Headers on every response: the CSP above (unless the response set its own), no sniffing, no framing,
    no referrer (a request's URL names a task)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers.setdefault("Content-Security-Policy", _CSP)
                headers["X-Content-Type-Options"] = "nosniff"
                headers["X-Frame-Options"] = "DENY"
                headers["Referrer-Policy"] = "no-referrer"
            await send(message)

        await self.app(scope, receive, send_with_headers)


# A dead letter's failure kind (rules.events.FailureKind), as the group of dead letters it causes is named.
_FAILURE_KINDS: Final = {
    "technical": "technical failures (retries used up)",
    "stalled": "jobs that kept stalling",
    "content": "content the vendor refused",
    "invalid_output": "output that failed validation",
    "unknown_outcome": "jobs whose outcome is unknown",
    "unknown": "an unknown failure",
}


# Internal names as a person reads them (request kinds, task states, node states).
_WORDS: Final = {
    "dead_letter": "a failed step",
    "approval": "approval",
    "escalation": "escalation",
    "invalid_decision": "a question for a person",
    "WaitingHuman": "waiting for a person",
    "Running": "running",
    "Escalated": "waiting for a person with authority",
    "Compensating": "undoing what it made",
    "Completed": "completed",
    "Failed": "failed",
    "waiting_human": "waiting for a person",
    "leased": "about to start",
    "Pass": "passed",
    "SoftWarning": "passed with warnings",
    "QualityRework": "asks for rework",
    "ComplianceBlock": "blocked for compliance",
    "stale": "to be made again",
    "cancelled": "skipped",
}


def _words(name: Any) -> str:
    return _WORDS.get(str(name), str(name).replace("_", " "))


def _cents(amount: Any) -> Markup:
    """Money as a person reads it — to the cent — with the ledger's full figure on hover (1.25, not
    1.250000; 0.000088 shows 0.00 and says 0.000088)."""
    try:
        value = Decimal(str(amount))
    except (InvalidOperation, ValueError):
        return Markup.escape(str(amount))
    shown = value.quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)
    full = format(value.normalize(), "f") if value else "0"
    return Markup('<span class="money" title="{}">{}</span>').format(full, shown)


def _age(opened_at: str, now: datetime) -> str:
    """``"42s"``, ``"17m"``, ``"3h"``, ``"2d"``: how long ago an ISO timestamp was."""
    seconds = max(0, int((now - datetime.fromisoformat(opened_at)).total_seconds()))
    for unit, size, limit in (("s", 1, 120), ("m", 60, 7200), ("h", 3600, 172800)):
        if seconds < limit:
            return f"{seconds // size}{unit}"
    return f"{seconds // 86400}d"
