"""Who is asking: login tokens, the session cookie, CSRF tokens and rate limits of the reviewer page.

A login token only says who a person is; it never lets anyone decide anything (every decision is signed in
the approver's browser with their own key, and the worker verifies it). Three ways to be identified, first
match wins:

* ``Authorization: Bearer <token>`` (the JSON API for other tools): no cookie, so no CSRF token needed;
* the ``trusted_header`` of ``create_app`` (an authenticating proxy, e.g. OIDC, puts the user's name in it);
* the session cookie set at login.

The session cookie is signed (itsdangerous) with ``LEDGERFLOW_REVIEW_SESSION_SECRET`` (``session_secret``):
the same secret on every replica, so a cookie one replica set is good on the others. Outside dev mode the page
does not start without it; in dev mode, unset, each process makes a random one (a restart logs everyone out).
Logging out records the session's id in the ledger (``review_logouts``, revision 0008), and a logged-in cookie
is good only while its id is not there: a copy of the cookie is refused afterwards by every replica, also
after a restart. That is one primary-key read per logged-in request (run where the request's other ledger
reads run: on the thread pool), remembered for the rest of the request; a replica that cannot reach the
ledger refuses the cookie (503) rather than guess. The CSRF check needs no read: it compares the token with
the cookie's own, and decides nobody's identity.

The cookie always carries a CSRF token, also before login, so the login form itself is protected; a
state-changing request identified by cookie or trusted header must echo that token (form field
``csrf_token`` or header ``X-CSRF-Token``).

A login sees only the tasks its approver's scopes cover (``*``, ``project:P``, ``episode:P/E``, ``task:T``,
as an approver key's; ``LEDGERFLOW_REVIEW_SCOPES``); without that setting every login sees every project.
"""

from __future__ import annotations

import hmac
import json
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Literal, Protocol

from itsdangerous import BadSignature, URLSafeTimedSerializer
from starlette.requests import Request
from starlette.responses import Response

from rules.approvers import ANY, SCOPE, covers_any
from runtime.settings import ConfigError, Settings

COOKIE: Final = "ledgerflow_review"
SESSION_SECONDS: Final = 12 * 3600
CSRF_HEADER: Final = "x-csrf-token"
CSRF_FIELD: Final = "csrf_token"
APPROVER: Final = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # rules.people's approver shape


@dataclass(frozen=True, slots=True)
class Session:
    """What the cookie holds: the approver once logged in (None before), the session's CSRF token, and its
    id (what a logout revokes)."""

    approver: str | None
    csrf: str
    sid: str = ""

    @staticmethod
    def new(approver: str | None = None) -> Session:
        return Session(approver=approver, csrf=secrets.token_urlsafe(32), sid=secrets.token_urlsafe(16))


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a request comes from, and how that is known."""

    approver: str
    via: Literal["bearer", "header", "cookie"]

    @property
    def needs_csrf(self) -> bool:
        """Credentials a browser sends by itself (a cookie, a proxy's header) need a CSRF token as well."""
        return self.via != "bearer"


class Logouts(Protocol):
    """Where logouts are kept for every replica (the recorder's ``ApprovalStore``: ``review_logouts``)."""

    def log_out_session(self, session_id: str, until: datetime) -> None: ...

    def session_logged_out(self, session_id: str) -> bool: ...


class AuthError(Exception):
    """A request that is not allowed: ``status`` (401, 403, 429) and a one-line message."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})


class RateLimiter:
    """Token buckets by key: ``capacity`` requests at once, refilled at one per ``per_seconds``. In memory:
    one process serves the page, and a restart forgetting the buckets costs nothing."""

    MAX_KEYS: Final = 10_000

    def __init__(
        self, capacity: int, per_seconds: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.capacity = capacity
        self.per_seconds = per_seconds
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)
        self._lock = threading.Lock()  # sync endpoints run on a thread pool

    def take(self, key: str) -> float:
        """Take one token for ``key``: 0.0 if allowed, else the seconds until one is available."""
        with self._lock:
            now = self._clock()
            tokens, at = self._buckets.get(key, (float(self.capacity), now))
            tokens = min(float(self.capacity), tokens + (now - at) / self.per_seconds)
            if tokens < 1.0:
                self._buckets[key] = (tokens, now)
                return (1.0 - tokens) * self.per_seconds
            if len(self._buckets) >= self.MAX_KEYS:
                self._forget_full(now)
            self._buckets[key] = (tokens - 1.0, now)
            return 0.0

    def _forget_full(self, now: float) -> None:
        """Drop the buckets that have refilled (they are as good as new), so the map cannot grow forever."""
        full = [
            k for k, (t, at) in self._buckets.items() if t + (now - at) / self.per_seconds >= self.capacity
        ]
        for k in full:
            del self._buckets[k]

    def check(self, key: str, what: str) -> None:
        """AuthError 429 naming ``what`` was limited and how long to wait, if ``key``'s bucket is empty."""
        wait = self.take(key)
        if wait > 0:
            seconds = max(1, round(wait + 0.5))
            raise AuthError(
                429, f"too many {what}: try again in {seconds} s", headers={"Retry-After": str(seconds)}
            )


MIN_SECRET: Final = 32  # characters of LEDGERFLOW_REVIEW_SESSION_SECRET


def session_secret(settings: Settings) -> bytes:
    """The key session cookies are signed with: ``LEDGERFLOW_REVIEW_SESSION_SECRET`` (shared by replicas), or
    in dev mode, when unset, a random one for this process. ConfigError (one line, naming no secret) if it is
    unset outside dev mode or shorter than 32 characters."""
    if settings.review_session_secret is None:
        if settings.dev:
            return secrets.token_bytes(32)
        raise ConfigError(
            "LEDGERFLOW_REVIEW_SESSION_SECRET is not set: the reviewer page signs session cookies with it "
            f"({MIN_SECRET}+ random characters, the same on every replica; e.g. `openssl rand -base64 48`)"
        )
    secret = settings.review_session_secret.get_secret_value()
    if len(secret) < MIN_SECRET:
        raise ConfigError(f"LEDGERFLOW_REVIEW_SESSION_SECRET must be {MIN_SECRET}+ characters")
    return secret.encode()


class Auth:
    """Tokens, sessions and CSRF for one app. Cookies are signed with ``secret`` (``session_secret``: shared
    by replicas); None, a random one for this process only. ``logouts`` is where every replica records and
    looks up logged-out sessions (the ledger)."""

    def __init__(
        self,
        tokens: Mapping[str, str],
        logouts: Logouts,
        trusted_header: str | None = None,
        scopes: Mapping[str, Sequence[str]] | None = None,
        secret: bytes | None = None,
    ) -> None:
        self._tokens = dict(tokens)
        self.trusted_header = trusted_header.lower() if trusted_header else None
        key = secret if secret is not None else secrets.token_bytes(32)
        self._serializer = URLSafeTimedSerializer(key, salt="ledgerflow-review-session")
        # None: every approver sees everything. Else an approver without an entry sees nothing.
        self._scopes = None if scopes is None else {a: tuple(s) for a, s in scopes.items()}
        self._logouts = logouts

    # ── scopes ───────────────────────────────────────────────────────────────────────────────────────

    def scopes(self, approver: str) -> tuple[str, ...]:
        """What ``approver``'s login may see, as an approver key's scopes (``*``: everything)."""
        return (ANY,) if self._scopes is None else self._scopes.get(approver, ())

    def sees_everything(self, approver: str) -> bool:
        return ANY in self.scopes(approver)

    def covers(self, approver: str, chain: Sequence[str]) -> bool:
        """Whether ``approver``'s login covers a task whose budget scopes are ``chain`` (outermost first),
        as ``rules.approvers.covers_any`` decides for a key and the task's own scope."""
        return bool(chain) and covers_any(self.scopes(approver), chain[-1], chain)

    # ── logout ───────────────────────────────────────────────────────────────────────────────────────

    def revoke(self, session: Session) -> None:
        """Refuse ``session``'s cookie from now on, on every replica (until it would have expired anyway).
        A ledger write: call it off the event loop. LedgerUnavailable if the ledger cannot be reached."""
        if session.sid:
            until = datetime.now(UTC) + timedelta(seconds=SESSION_SECONDS)
            self._logouts.log_out_session(session.sid, until)

    def _logged_out(self, request: Request, sid: str) -> bool:
        """Whether ``sid`` was logged out (a ledger read, remembered for the rest of ``request``)."""
        known: dict[str, bool] = request.scope.setdefault("ledgerflow.logged_out", {})
        if sid not in known:
            known[sid] = self._logouts.session_logged_out(sid)
        return known[sid]

    def approver_for(self, token: str) -> str | None:
        """The approver whose token this is. Every token is compared (in constant time), not just until
        the first match, so the time taken says nothing about which tokens exist."""
        found = None
        for approver, expected in self._tokens.items():
            if hmac.compare_digest(token.encode(), expected.encode()):
                found = approver
        return found

    # ── the cookie ───────────────────────────────────────────────────────────────────────────────────

    def session(self, request: Request) -> Session | None:
        """The session the request's cookie holds, if its signature is good and it has not expired. Not
        whether it was logged out: that is ``identify``'s to decide (a ledger read)."""
        raw = request.cookies.get(COOKIE)
        if not raw:
            return None
        try:
            data: Any = self._serializer.loads(raw, max_age=SESSION_SECONDS)
        except BadSignature:  # also an expired one (SignatureExpired is a BadSignature)
            return None
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("c"), str)
            or not isinstance(data.get("s"), str)
        ):
            return None
        approver = data.get("a")
        return Session(
            approver=approver if isinstance(approver, str) else None, csrf=data["c"], sid=data["s"]
        )

    def set_cookie(self, request: Request, response: Response, session: Session) -> None:
        response.set_cookie(
            COOKIE,
            self._serializer.dumps({"a": session.approver, "c": session.csrf, "s": session.sid}),
            max_age=SESSION_SECONDS,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )

    # ── identification ───────────────────────────────────────────────────────────────────────────────

    def identify(self, request: Request, limiter: RateLimiter | None) -> Identity | None:
        """Who sent ``request`` (None: nobody logged in, or logged out). AuthError 401 for a bad bearer
        token, which counts as a failed login in ``limiter`` (429 once too many). A session cookie is looked
        up in the ledger's logouts (call it off the event loop); LedgerUnavailable if that cannot be done."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            approver = self.approver_for(token.strip())
            if approver is None:
                if limiter is not None:
                    limiter.check(f"login:{client_of(request)}", "failed logins")
                raise AuthError(401, "unknown bearer token", headers={"WWW-Authenticate": "Bearer"})
            return Identity(approver, "bearer")
        if self.trusted_header:
            name = request.headers.get(self.trusted_header, "").strip()
            if name:
                if not APPROVER.fullmatch(name):
                    raise AuthError(403, f"the {self.trusted_header} header does not name a valid approver")
                return Identity(name, "header")
        session = self.session(request)
        if session is not None and session.approver is not None:
            if self._logged_out(request, session.sid):
                return None
            return Identity(session.approver, "cookie")
        return None

    def check_csrf(self, request: Request, identity: Identity | None, sent: str | None) -> None:
        """AuthError 403 unless a cookie- or header-identified request echoes its session's CSRF token."""
        if identity is not None and not identity.needs_csrf:
            return
        session = self.session(request)
        token = sent if sent is not None else request.headers.get(CSRF_HEADER)
        if session is None or not token or not hmac.compare_digest(token.encode(), session.csrf.encode()):
            raise AuthError(403, "missing or wrong CSRF token: reload the page and try again")


def client_of(request: Request) -> str:
    """The client's address: the peer's, or behind a trusted proxy the address the proxy forwarded (uvicorn
    rewrites the peer from X-Forwarded-For only when the peer is one of ``--forwarded-allow-ips``)."""
    return request.client.host if request.client is not None else "unknown"


def parse_scopes(text: str) -> dict[str, tuple[str, ...]]:
    """``LEDGERFLOW_REVIEW_SCOPES``: a JSON object of approver name -> list of scopes, each ``*``,
    ``project:P``, ``episode:P/E`` or ``task:T`` (an approver key's scopes). ConfigError (one line) if not."""
    problem = (
        "LEDGERFLOW_REVIEW_SCOPES must be a JSON object of approver name -> list of scopes "
        "(*, project:P, episode:P/E, task:T)"
    )
    try:
        data = json.loads(text)
    except ValueError:
        raise ConfigError(problem) from None
    if not isinstance(data, dict) or not all(
        isinstance(name, str)
        and APPROVER.fullmatch(name)
        and isinstance(scopes, list)
        and all(isinstance(s, str) and SCOPE.fullmatch(s) for s in scopes)
        for name, scopes in data.items()
    ):
        raise ConfigError(problem)
    return {name: tuple(scopes) for name, scopes in data.items()}


def scopes_from(settings: Settings) -> dict[str, tuple[str, ...]] | None:
    """The scopes ``LEDGERFLOW_REVIEW_SCOPES`` (``Settings.review_scopes``) gives each token's approver; None
    if it is not set (every token then sees every project, as before scopes)."""
    text = (settings.review_scopes or "").strip()
    return parse_scopes(text) if text else None
