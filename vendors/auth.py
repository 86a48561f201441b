"""How a route's credential goes on its HTTP requests: the route file's ``auth:`` and ``headers:``.

A route names its scheme; the secrets stay in the environment (``credential_env`` and the ``*_env`` names
here, read through the worker's credential reader, ``Settings.credential``), never in the route file, a log,
an error or a Temporal payload::

    auth: {scheme: bearer}                                   # the default: Authorization: Bearer KEY
    auth: {scheme: header, name: X-Api-Key}              # X-Api-Key: KEY (``prefix: "Token "``: Token KEY)
    auth: {scheme: basic, username_env: ACME_USER}           # Authorization: Basic user:KEY
    auth: {scheme: query, name: key}                         # ?key=KEY on every request
    auth: {scheme: oauth2_client_credentials, token_url: https://auth.acme.example/token,
           client_id_env: ACME_CLIENT_ID, scope: video}      # the KEY is the client secret; Bearer TOKEN
    auth: {scheme: signed, hook: "acme_sign:sign"}           # acme_sign.sign(request, KEY) adds its headers

The credential goes only where ``vendors.httpbase`` sends it: the route's own origin and its ``allow_hosts``
(and, for ``oauth2_client_credentials``, the client id and secret to ``token_url``). An OAuth2 token is
fetched once and shared by every call of the route, refreshed shortly before its ``expires_in`` and once after
a 401 (the 401 proved nothing was accepted: the call is resent once with a fresh token). A failure to get a
token is a refusal — nothing was sent to the vendor: ``VendorAuthError`` (the route pauses for a person) when
the token endpoint refuses the client, ``VendorRateLimited`` / ``VendorOverloaded`` when it is busy or down.

A ``signed`` hook is ``package.module:function`` taking the outgoing ``httpx.Request`` (its body already
encoded) and the credential, adding its signature headers (HMAC, SigV4 …); it may be async. It is imported
when the route file is loaded and when the adapter is built; it must not move the request to another origin.

``headers:`` are extra static headers for every request to the route's own origin (API calls, and result
downloads there; never another origin's): not secrets (they are in the route file), and never
``Authorization``, ``Cookie``, ``Host``, the framing headers or the ``Idempotency-Key`` the protocol sets.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import inspect
import re
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Final, Literal
from urllib.parse import quote, urlsplit

import httpx
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from vendors.errors import VendorAuthError, VendorOverloaded, VendorRateLimited, VendorRejected

ENV_NAME: Final = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,100}$")  # an HTTP field name (RFC 9110 token)
_HOOK = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_VALUE = re.compile(r"^[\t\x20-\x7e\x80-\xff]*$")  # a field value: no CR, LF or other control character
# Never set by a route: the credential's own headers, what the connection owns, and the protocol's key.
FORBIDDEN_HEADERS: Final = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "cookie",
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "te",
        "upgrade",
        "idempotency-key",
    }
)
# A ``signed`` route's hook: adds its signature headers to the outgoing request, given the credential.
Hook = Callable[[httpx.Request, str], Awaitable[None] | None]
SCHEMES: Final = ("bearer", "header", "basic", "query", "oauth2_client_credentials", "signed")
TOKEN_MARGIN_S: Final = 30.0  # a token is renewed this long (at most a tenth of its life) before it expires


def header_name(value: str, *, allow_authorization: bool = False) -> str:
    """``value`` if it may be a header a route sets, else ValueError naming why (one line)."""
    if not _TOKEN.match(value):
        raise ValueError(f"{value[:60]!r} is not a header name (letters, digits and !#$%&'*+-.^_`|~)")
    lower = value.lower()
    if lower in FORBIDDEN_HEADERS and not (allow_authorization and lower == "authorization"):
        raise ValueError(f"{value!r} may not be set by a route")
    return value


def static_headers(value: dict[str, str]) -> dict[str, str]:
    """The route's ``headers:``, validated (names are tokens, none forbidden, values one printable line)."""
    seen: set[str] = set()
    for name, text in value.items():
        header_name(name)
        if name.lower() in seen:
            raise ValueError(f"{name!r} is given twice")
        seen.add(name.lower())
        if len(text) > 1000 or not _VALUE.match(text):
            raise ValueError(f"{name!r}: the value must be one line of printable text (≤ 1000)")
    return value


def load_hook(path: str) -> Callable[..., Any]:
    """The function a ``signed`` route names (``package.module:function``); ValueError in one line if it
    cannot be imported or is not callable."""
    module_name, _, attr = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except Exception as e:  # whatever the hook's module raises while importing: one line, never a traceback
        raise ValueError(f"signing hook {path!r} cannot be loaded: {_one_line(e)}") from None
    if not callable(target):
        raise ValueError(f"signing hook {path!r} is not callable")
    return target  # type: ignore[no-any-return]


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


# ── the route file's ``auth:`` ─────────────────────────────────────────────────────────────────────────────
class _Scheme(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BearerAuth(_Scheme):
    """``Authorization: Bearer KEY`` (the default)."""

    scheme: Literal["bearer"] = "bearer"


class HeaderAuth(_Scheme):
    """``NAME: PREFIX KEY``: an API-key header (``X-Api-Key``), or ``Authorization`` with another prefix."""

    scheme: Literal["header"]
    name: str
    prefix: str = Field(default="", max_length=40)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return header_name(value, allow_authorization=True)

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not _VALUE.match(value):
            raise ValueError("must be printable text on one line")
        return value


class BasicAuth(_Scheme):
    """``Authorization: Basic`` of the user name in ``username_env`` and the credential as the password."""

    scheme: Literal["basic"]
    username_env: str = Field(pattern=ENV_NAME)


class QueryAuth(_Scheme):
    """The credential as the query parameter ``name`` of every request to the route's origin."""

    scheme: Literal["query"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.~-]{1,100}$")


class OAuth2ClientCredentials(_Scheme):
    """An OAuth2 client-credentials token from ``token_url`` (client id in ``client_id_env``, the credential
    as the client secret), sent as ``Authorization: Bearer TOKEN``. ``client_auth``: how the client proves
    itself to the token endpoint — HTTP Basic (RFC 6749 §2.3.1, the default) or the form body."""

    scheme: Literal["oauth2_client_credentials"]
    token_url: str = Field(max_length=1000)
    client_id_env: str = Field(pattern=ENV_NAME)
    scope: str | None = Field(default=None, max_length=1000, pattern=r"^[\x21\x23-\x5b\x5d-\x7e ]+$")
    client_auth: Literal["basic", "body"] = "basic"

    @field_validator("token_url")
    @classmethod
    def _url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http(s) URL, got {value[:60]!r}")
        if parts.username is not None or parts.password is not None or parts.fragment:
            raise ValueError("must hold no user, password or fragment (the secrets come from *_env names)")
        return value


class SignedAuth(_Scheme):
    """A hook (``package.module:function``) that signs each outgoing request with the credential."""

    scheme: Literal["signed"]
    hook: str = Field(max_length=300)

    @field_validator("hook")
    @classmethod
    def _hook(cls, value: str) -> str:
        if not _HOOK.match(value):
            raise ValueError(f"must be package.module:function, got {value[:60]!r}")
        return value


def _shorthand(value: Any) -> Any:
    """``auth: bearer`` is ``auth: {scheme: bearer}``."""
    return {"scheme": value} if isinstance(value, str) else value


AuthConfig = Annotated[
    BearerAuth | HeaderAuth | BasicAuth | QueryAuth | OAuth2ClientCredentials | SignedAuth,
    Field(discriminator="scheme"),
    BeforeValidator(_shorthand),
]


# ── on the wire ─────────────────────────────────────────────────────────────────────────────────────────
class RequestAuth:
    """Puts one route's credential on an outgoing request (only ever one to the route's own origin or its
    ``allow_hosts``: ``vendors.httpbase`` decides where, this decides how)."""

    async def apply(self, request: httpx.Request) -> object:
        """Add the credential to ``request``; returns what was used (handed back to ``renew``)."""
        raise NotImplementedError

    async def renew(self, used: object) -> bool:
        """After a 401 to a request that carried ``used``: whether one resend with fresh credentials may
        help (an OAuth2 token may have been revoked early); a static credential cannot get better."""
        return False

    def secrets(self) -> tuple[str, ...]:
        """Every secret string this may put on a request: scrubbed from error messages."""
        return ()


class HeaderCredential(RequestAuth):
    """One header carrying the credential (bearer, an API-key header, basic)."""

    def __init__(self, name: str, value: str, *secrets: str) -> None:
        self._name = name
        self._value = value
        self._secrets = tuple(s for s in (*secrets, value) if s)

    async def apply(self, request: httpx.Request) -> object:
        request.headers[self._name] = self._value
        return None

    def secrets(self) -> tuple[str, ...]:
        return self._secrets


class QueryCredential(RequestAuth):
    """The credential as a query parameter."""

    def __init__(self, name: str, credential: str) -> None:
        self._name = name
        self._credential = credential

    async def apply(self, request: httpx.Request) -> object:
        request.url = request.url.copy_merge_params({self._name: self._credential})
        return None

    def secrets(self) -> tuple[str, ...]:
        return (self._credential, quote(self._credential, safe=""), quote(self._credential))


class SignedRequest(RequestAuth):
    """A route's signing hook, called with each outgoing request and the credential."""

    def __init__(self, hook: Hook, path: str, credential: str) -> None:
        self._hook = hook
        self._path = path
        self._credential = credential

    async def apply(self, request: httpx.Request) -> object:
        try:
            signed = self._hook(request, self._credential)
            if inspect.isawaitable(signed):
                await signed
        except Exception as e:  # nothing was sent: a refusal of our own (the message scrubbed by the caller)
            raise VendorRejected(f"signing hook {self._path} failed: {_one_line(e)}") from None
        return None

    def secrets(self) -> tuple[str, ...]:
        return (self._credential,)


class OAuth2Token(RequestAuth):
    """A client-credentials token, fetched once for every call of the route and kept until shortly before
    it expires (or a 401 says it no longer works); one fetch at a time (an ``asyncio.Lock``)."""

    def __init__(
        self,
        config: OAuth2ClientCredentials,
        client_id: str,
        secret: str,
        *,
        client: httpx.AsyncClient,
        timeout: float,
    ) -> None:
        self._config = config
        self._client_id = client_id
        self._secret = secret
        self._client = client
        self._timeout = timeout
        self._lock = asyncio.Lock()
        self._token: str | None = None
        self._fresh_until = 0.0  # time.monotonic(); inf where the server states no expiry
        self.fetches = 0  # tokens fetched so far

    async def apply(self, request: httpx.Request) -> object:
        token = await self._current()
        request.headers["Authorization"] = f"Bearer {token}"
        return token

    async def renew(self, used: object) -> bool:
        async with self._lock:
            if self._token == used:  # another call may already have renewed it
                self._token = None
        return True

    def secrets(self) -> tuple[str, ...]:
        return tuple(s for s in (self._secret, self._token) if s)

    async def _current(self) -> str:
        async with self._lock:
            if self._token is None or time.monotonic() >= self._fresh_until:
                self._token, self._fresh_until = await self._fetch()
            return self._token

    async def _fetch(self) -> tuple[str, float]:
        config = self._config
        url = httpx.URL(config.token_url)
        where = f"token endpoint {url.host}{url.path}"
        data = {"grant_type": "client_credentials"}
        if config.scope:
            data["scope"] = config.scope
        headers = {"Accept": "application/json"}
        if config.client_auth == "basic":
            pair = f"{self._client_id}:{self._secret}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(pair).decode("ascii")
        else:
            data.update(client_id=self._client_id, client_secret=self._secret)
        started = time.monotonic()
        try:
            response = await self._client.post(
                config.token_url,
                data=data,
                headers=headers,
                timeout=self._timeout,
            )
        except httpx.TimeoutException:
            raise VendorOverloaded(f"{where}: timed out; nothing was sent to the vendor") from None
        except httpx.TransportError as e:
            raise VendorOverloaded(f"{where}: {type(e).__name__}; nothing was sent to the vendor") from None
        self.fetches += 1
        status = response.status_code
        if status == 429:
            raise VendorRateLimited(_retry_after(response), f"{where} -> 429; nothing was sent to the vendor")
        if status == 408 or status >= 500:
            raise VendorOverloaded(f"{where} -> {status}; nothing was sent to the vendor", status_code=status)
        if not response.is_success:
            # invalid_client, unauthorized_client, invalid_scope …: only a person can fix the credentials.
            raise VendorAuthError(f"{where} -> {status}: {_oauth_error(response)}", status_code=status)
        try:
            body = response.json()
        except ValueError:
            body = None
        token = body.get("access_token") if isinstance(body, dict) else None
        if not isinstance(token, str) or not token or not _VALUE.match(token):
            raise VendorAuthError(f"{where}: the answer holds no usable access_token", status_code=status)
        lifetime = _seconds(body.get("expires_in")) if isinstance(body, dict) else None
        if lifetime is None:
            return token, float("inf")  # no stated expiry: kept until a 401 says otherwise
        return token, started + lifetime - min(TOKEN_MARGIN_S, lifetime / 10)


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if 0 < number < 10**9 else None


def _retry_after(response: httpx.Response) -> float:
    return _seconds(response.headers.get("Retry-After")) or 1.0


def _oauth_error(response: httpx.Response) -> str:
    """The RFC 6749 ``error`` code of a refusal (a fixed vocabulary: never an echo of what we sent)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    code = body.get("error") if isinstance(body, dict) else None
    return code[:60] if isinstance(code, str) and re.fullmatch(r"[\w.-]+", code) else response.reason_phrase


def build_auth(
    config: AuthConfig,
    credential: str,
    *,
    read: Callable[[str], str],
    client: httpx.AsyncClient,
    timeout: float,
) -> RequestAuth:
    """The route's ``auth:`` on the wire, with ``credential`` (the value of its ``credential_env``) and
    ``read`` for the other ``*_env`` names (the worker's credential reader). Raises what ``read`` raises
    (ConfigError: a variable is not set) and ValueError where a signing hook cannot be loaded."""
    match config:
        case BearerAuth():
            return HeaderCredential("Authorization", f"Bearer {credential}", credential)
        case HeaderAuth(name=name, prefix=prefix):
            return HeaderCredential(name, f"{prefix}{credential}", credential)
        case BasicAuth(username_env=username_env):
            pair = f"{read(username_env)}:{credential}".encode()
            encoded = base64.b64encode(pair).decode("ascii")
            return HeaderCredential("Authorization", f"Basic {encoded}", credential, encoded)
        case QueryAuth(name=name):
            return QueryCredential(name, credential)
        case OAuth2ClientCredentials():
            client_id = read(config.client_id_env)
            return OAuth2Token(config, client_id, credential, client=client, timeout=timeout)
        case SignedAuth(hook=path):
            return SignedRequest(load_hook(path), path, credential)
    raise AssertionError(f"unknown auth scheme {config!r}")  # pragma: no cover
