"""What every HTTP adapter shares: one request path, one error classification, safe result downloads.

* Status codes are classified once (``classify``) into ``vendors.errors``, by what they prove: a refusal
  (429, 408, 401/403, other 4xx, and the route's ``refused_statuses``: none unless its vendor documents
  them) means nothing was accepted; any other 5xx (a gateway's 503/504 may follow an accepted request), a
  timeout or a reset means the outcome is unknown.
* Result URLs may be relative or absolute (a CDN on another host). They are resolved against the route's
  base URL as URLs, never by string concatenation (``base + "@other.host/x"`` would make ``other.host`` the
  host and the base a user name), and the credential goes only to the route's own origin or an origin on its
  ``allow_hosts`` list (scheme, host and port all match: a bare host there means https on port 443).
  Everything else is downloaded without credentials.
* How the credential is sent is the route's ``auth`` (``vendors.auth``: bearer by default, an API-key
  header, basic, a query parameter, an OAuth2 client-credentials token, a signing hook); its ``headers`` go
  with every request to its own origin (never elsewhere), and its ``paths`` replace an adapter's default paths
  (``HttpVendor.path``). An API call never leaves the route's own origin, whatever a path or a hook says.
* After a 401, an adapter whose credential can be renewed (an OAuth2 token) resends the call once with a fresh
  one: the 401 proved nothing was accepted. Any other credential's 401 is the route's ``VendorAuthError``.
* A result URL resolving to a loopback, private, link-local or metadata address is refused before anything
  connects (``UnsafeResultUrl``), unless it is the route's own origin or on ``allow_hosts``/``allow_private``.
* Redirects are followed by hand, at most ``MAX_REDIRECTS``, each hop checked like the first; the key goes
  with a hop only while it stays on the route's own origin. A 401/403 (an expired presigned URL) or any other
  refusal of a download is ``ResultUnavailable``: that output fails, the route is not paused.
* One deadline (``timeouts.download``) covers a whole download, redirects included; a result is capped at the
  route's ``max_result_bytes`` and an API answer at its ``max_json_bytes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import ipaddress
import os
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from runtime.settings import ConfigError
from vendors.adapter import VendorJob
from vendors.auth import RequestAuth, build_auth
from vendors.errors import (
    ResultTooLarge,
    ResultUnavailable,
    UnsafeResultUrl,
    VendorAuthError,
    VendorBadResponse,
    VendorCannotTell,
    VendorConflict,
    VendorError,
    VendorNotFound,
    VendorOverloaded,
    VendorRateLimited,
    VendorRejected,
    VendorRequestTimeout,
    VendorUnavailable,
)
from vendors.routes import Origin, RouteError, RouteSpec, covers, default_port, origin

if TYPE_CHECKING:
    from vendors.plugins import AdapterContext

DEFAULT_RETRY_AFTER = 1.0
MAX_REDIRECTS = 5
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
M = TypeVar("M", bound=BaseModel)


class HttpVendor:
    """An HTTP adapter's plumbing: the client, the credential, requests and downloads.

    Args:
        route: The route (base URL, timeouts, hosts that may receive the credential, how it is sent).
        base_url: The route's base URL, resolved (a route without one uses the deployment's vendor URL).
        api_key: The route's credential (its ``credential_env``'s value), sent as its ``auth`` says to the
            route's own origin and its ``allow_hosts`` only; never logged nor put in messages.
        client: A shared client (left open by ``aclose``); by default the adapter owns one.
        credentials: Reads the other secrets the route's ``auth`` names (``*_env``: a basic user name, an
            OAuth2 client id); the worker's ``Settings.credential``. Default: the process environment.
    """

    # The adapter's request paths by name (``path``), which a route's ``paths`` may replace; an adapter with
    # none takes no ``paths``. ``ROUTE_SHAPE``: it reads the route's ``shape`` (the jobs protocol's words).
    ROUTE_PATHS: ClassVar[Mapping[str, str]] = {}
    ROUTE_SHAPE: ClassVar[bool] = False

    def __init__(
        self,
        route: RouteSpec,
        base_url: str,
        api_key: str,
        *,
        client: httpx.AsyncClient | None = None,
        credentials: Callable[[str], str] | None = None,
    ) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        self.route = route
        self._base = httpx.URL(base_url.rstrip("/") + "/")
        self._api_key = api_key
        self._timeout = route.timeouts.request
        self._owns_client = client is None
        self._client = client if client is not None else httpx.AsyncClient(timeout=self._timeout)
        self._own = url_origin(self._base)
        self._keyed = {origin(entry) for entry in route.allow_hosts}
        # A wildcard (*.example.com) receives the key on https, but never makes a private address acceptable.
        exact = {o for o in self._keyed if not o[1].startswith("*.")}
        self._private_ok = {self._own, *exact, *(origin(entry) for entry in route.allow_private)}
        self._headers = dict(route.headers)
        try:
            self._auth: RequestAuth = build_auth(
                route.auth,
                api_key,
                read=credentials or _environment,
                client=self._client,
                timeout=self._timeout,
            )
        except ValueError as e:  # a signing hook that cannot be loaded
            raise RouteError(f"auth: {e}") from None

    @classmethod
    def build(cls, context: AdapterContext) -> Self:
        """The plugin factory (``vendors.plugins``): ``cls(route, base_url, api_key, client=...,
        credentials=...)`` from the context. A subclass taking other arguments overrides it."""
        return cls(
            context.route,
            context.require_base_url(),
            context.api_key(),
            client=context.client,
            credentials=context.credential,
        )

    def path(self, name: str, **values: str) -> str:
        """The request path ``name`` (the route's ``paths``, else the adapter's ``ROUTE_PATHS``) with its
        ``{placeholders}`` filled in, each value percent-encoded (a vendor's job id cannot add a query)."""
        template = self.route.paths.get(name) or self.ROUTE_PATHS[name]
        path, mark, query = template.partition("?")
        for key, value in values.items():
            path = path.replace("{" + key + "}", quote(value, safe=_PATH_SAFE))
            query = query.replace("{" + key + "}", quote(value, safe=""))  # a query value: & = + encoded too
        return path + mark + query

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={str(self._base)!r})"

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ── requests ──────────────────────────────────────────────────────────────────────────────────────
    async def request(
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str] | None = None,
        cannot_tell_on_501: bool = False,
        params: Any = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """One request to the route's own origin (``path`` relative to the base URL, its own query kept and
        ``params`` added to it), with the route's headers and credential, classified."""
        url = self._base.join(path.lstrip("/"))
        if params:
            url = url.copy_merge_params(params)
        where = f"{method} {url.path}"
        if url_origin(url) != self._own:  # nothing is sent: a refusal of our own
            raise VendorRejected(f"{where}: not on the route's own origin; nothing was sent")
        cap = self.route.max_json_bytes
        for renewed in (False, True):
            try:
                sent = self._client.build_request(
                    method, url, headers={**self._headers, **(headers or {})}, timeout=self._timeout, **kwargs
                )
                used = await self._auth.apply(sent)
                if url_origin(sent.url) != self._own:  # a signing hook moved it
                    raise VendorRejected(f"{where}: signed off the route's own origin; nothing was sent")
                streamed = await self._client.send(sent, stream=True)
                try:
                    body, whole = await read_capped(streamed, cap)
                finally:
                    await streamed.aclose()
            except httpx.TimeoutException as e:
                raise VendorUnavailable(f"{where}: timed out after {self._timeout:g}s", timed_out=True) from e
            except httpx.TransportError as e:
                raise VendorUnavailable(f"{where}: {type(e).__name__}") from e
            # A 401 proves nothing was accepted: one resend, where a fresher credential may exist.
            if streamed.status_code != 401 or renewed or not await self._auth.renew(used):
                break
        response = buffered(streamed, body)
        if response.is_success:
            if not whole:  # an answer we cannot read whole may still have been accepted
                raise VendorBadResponse(f"{where}: the answer is larger than max_json_bytes ({cap})")
            return response
        raise self.classify(where, response, cannot_tell_on_501=cannot_tell_on_501)

    def classify(
        self, where: str, response: httpx.Response, *, cannot_tell_on_501: bool = False
    ) -> VendorError:
        status = response.status_code
        body = json_or_none(response)
        detail = None
        if body:
            error = body.get("error")
            detail = (
                error.get("message")
                if isinstance(error, dict)
                else (error if isinstance(error, str) else None)
            )
            detail = detail or (body.get("detail") if isinstance(body.get("detail"), str) else None)
        # Scrubbed in case a vendor (or a proxy in front of it) echoes request headers or the input URLs it
        # was given (presigned: credentials) into an error body. The message goes into Temporal's history.
        message = scrub(
            f"{where} -> {status}: {str(detail or response.reason_phrase)[:300]}", *self.secrets()
        )
        if status == 429:
            return VendorRateLimited(retry_after(response.headers.get("Retry-After")), message)
        if status == 408:
            return VendorRequestTimeout(message, status_code=status)
        if status in (401, 403):
            return VendorAuthError(message, status_code=status)
        if status == 501 and cannot_tell_on_501:
            return VendorCannotTell(message, status_code=status)
        if status in self.route.refused_statuses:
            return VendorOverloaded(message, status_code=status)
        if status >= 500:
            return VendorUnavailable(message, status_code=status)
        if status == 409:
            return VendorConflict(message, status_code=status)
        if status in (404, 410):
            return VendorNotFound(message, status_code=status)
        return VendorRejected(message, status_code=status)

    def secrets(self) -> tuple[str, ...]:
        """Every secret this adapter may send (its credential, a token): never in a message."""
        return (self._api_key, *self._auth.secrets())

    def parse(self, model: type[M], response: httpx.Response) -> M:
        """``model.model_validate`` of the JSON body, or VendorBadResponse (never a bare KeyError)."""
        try:
            return model.model_validate(response.json())
        except ValueError as e:  # pydantic's ValidationError and json's JSONDecodeError are both ValueErrors
            raise VendorBadResponse(f"malformed answer from the vendor: {type(e).__name__}") from e

    # ── downloads ─────────────────────────────────────────────────────────────────────────────────────
    def resolve(self, raw: str) -> tuple[httpx.URL, Origin, bool]:
        """The absolute URL of a result, its origin, and whether it may carry the credential (else
        UnsafeResultUrl)."""
        try:
            url = self._base.join(raw)
        except (httpx.InvalidURL, ValueError, TypeError) as e:
            raise UnsafeResultUrl(f"result URL {scrub(raw[:80])!r} cannot be parsed") from e
        if url.scheme not in ("http", "https") or not url.host:
            raise UnsafeResultUrl(f"result URL {scrub(raw[:80])!r} is not an http(s) URL")
        where = url_origin(url)
        return url, where, where == self._own or any(covers(entry, where) for entry in self._keyed)

    async def check_address(self, url: httpx.URL) -> None:
        """UnsafeResultUrl if ``url`` resolves to a loopback, private, link-local or metadata address and its
        origin is not allow-listed; checked before any connection (an IP literal is never even resolved)."""
        where = url_origin(url)
        if where in self._private_ok:
            return
        host = url.host
        try:
            addresses = [ipaddress.ip_address(host)]
        except ValueError:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, where[2], type=socket.SOCK_STREAM)
            except OSError as e:
                raise VendorUnavailable(f"result host {host} cannot be resolved ({type(e).__name__})") from e
            addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
        for address in addresses:
            if not public(address):
                raise UnsafeResultUrl(
                    f"result URL on {where[0]}://{host}:{where[2]} resolves to {address}, a loopback, "
                    "private, link-local or metadata address the route does not allow-list"
                )

    async def upload(self, data: bytes, *, filename: str, content_type: str) -> str:
        """POST one input file to the route's ``upload`` place (``inputs: upload``) and return the URL the
        vendor answered for it, to stand in the request where the file goes. Free, and sent before the
        operation's write-ahead marker: a lost answer is simply uploaded again."""
        spec = self.route.upload
        if spec is None:
            raise VendorRejected(
                "the route takes no uploads (no upload: in its route file); nothing was sent"
            )
        if len(data) > spec.max_bytes:
            raise VendorRejected(
                f"input {filename} is {len(data)} bytes, more than upload.max_bytes; not sent"
            )
        response = await self.request("POST", spec.path, files={spec.field: (filename, data, content_type)})
        found: Any = json_or_none(response)
        for part in spec.url_field.split("."):
            found = found.get(part) if isinstance(found, dict) else None
        if not isinstance(found, str) or not found.startswith(("https://", "http://")) or len(found) > 4000:
            raise VendorBadResponse(f"the upload's answer has no URL at {spec.url_field}")
        return found

    async def download(self, job: VendorJob, sink: Callable[[bytes], Awaitable[None] | None]) -> None:
        """Stream a succeeded job's output into ``sink`` (VendorNotFound if the job names none)."""
        if job.result is None:
            raise VendorNotFound(f"job {job.id} has no result (status {job.status})")
        await self.stream(job.result.url, sink)

    async def stream(self, raw_url: str, sink: Callable[[bytes], Awaitable[None] | None]) -> None:
        """Stream ``raw_url`` into ``sink``; the credential only where ``resolve`` allows it, redirects
        followed by hand (each hop checked), one deadline for the whole transfer, at most max_result_bytes."""
        url, _, credentials = self.resolve(raw_url)
        deadline, cap = self.route.timeouts.download, self.route.max_result_bytes
        where = f"GET {url.host}{url.path}"
        try:
            async with asyncio.timeout(deadline):
                for hop in range(MAX_REDIRECTS + 1):
                    where = f"GET {url.host}{url.path}"
                    await self.check_address(url)
                    own = url_origin(url) == self._own  # the route's headers go to its own origin only
                    request = self._client.build_request(
                        "GET", url, headers=self._headers if own else None, timeout=self._timeout
                    )
                    if credentials:
                        await self._auth.apply(request)
                    async with _closing(await self._client.send(request, stream=True)) as response:
                        if response.status_code in REDIRECT_STATUSES:
                            location = response.headers.get("Location")
                            if hop == MAX_REDIRECTS or not location:
                                why = f"more than {MAX_REDIRECTS} redirects" if location else "no Location"
                                status = response.status_code
                                raise ResultUnavailable(f"{where} -> {status}: {why}", status_code=status)
                            url, hop_origin, keyed = self.resolve(str(url.join(location)))
                            # The key goes on only while every hop stays on the vendor's own origin.
                            credentials = credentials and keyed and hop_origin == self._own
                            continue
                        if not response.is_success:
                            body, _ = await read_capped(response, self.route.max_json_bytes)
                            raise self.download_error(where, buffered(response, body))
                        declared = response.headers.get("Content-Length", "")
                        if declared.isdigit() and int(declared) > cap:
                            raise ResultTooLarge(f"{where}: {declared} bytes, above max_result_bytes ({cap})")
                        size = 0
                        async for chunk in response.aiter_bytes(1 << 20):
                            size += len(chunk)
                            if size > cap:
                                raise ResultTooLarge(f"{where}: more than max_result_bytes ({cap}) bytes")
                            written = sink(chunk)
                            if inspect.isawaitable(written):
                                await written
                        return
        except TimeoutError as e:
            raise VendorUnavailable(f"{where}: download exceeded {deadline:g}s", timed_out=True) from e
        except httpx.TimeoutException as e:
            raise VendorUnavailable(f"{where}: timed out after {self._timeout:g}s", timed_out=True) from e
        except httpx.TransportError as e:
            raise VendorUnavailable(f"{where}: {type(e).__name__}") from e

    def download_error(self, where: str, response: httpx.Response) -> VendorError:
        """A download's error answer: 404/410 the output is gone, 408/429/5xx try again later, and any other
        refusal (401/403 from a CDN: an expired presigned URL) fails that output, never the route."""
        error = self.classify(where, response)
        if isinstance(error, VendorAuthError | VendorRejected | VendorConflict):
            return ResultUnavailable(str(error), status_code=error.status_code)
        return error


_PATH_SAFE = "/:@!$&'()*+,;=-._~"  # what a placeholder's value keeps as is (``?`` and ``#`` are encoded)


def _environment(name: str) -> str:
    """A secret from the process environment (where no credential reader is given)."""
    value = os.environ.get(name)
    if not value:
        raise ConfigError(f"the credential variable {name} (named by a route) is not set")
    return value


@contextlib.asynccontextmanager
async def _closing(response: httpx.Response) -> AsyncIterator[httpx.Response]:
    """A streamed response, closed when done with (what ``client.stream`` does, for a request built here)."""
    try:
        yield response
    finally:
        await response.aclose()


def url_origin(url: httpx.URL) -> Origin:
    """A URL's origin: scheme, host (lower case) and port (the scheme's default when it names none)."""
    return url.scheme, url.host.lower(), url.port or default_port(url.scheme)


def public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether an address is on the public internet (not loopback, private, link-local — the metadata address
    169.254.169.254 — multicast, reserved or unspecified; an IPv4-mapped IPv6 address as its IPv4)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


async def read_capped(response: httpx.Response, cap: int) -> tuple[bytes, bool]:
    """At most ``cap`` bytes of a streamed body, and whether that is all of it."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size > cap:
            return b"".join(chunks)[:cap], False
    return b"".join(chunks), True


def buffered(response: httpx.Response, body: bytes) -> httpx.Response:
    """A streamed response as a plain one holding ``body`` (already decoded)."""
    skip = {b"content-encoding", b"content-length", b"transfer-encoding"}
    headers = [(k, v) for k, v in response.headers.raw if k.lower() not in skip]
    return httpx.Response(response.status_code, headers=headers, content=body, request=response.request)


_QUERY = re.compile(r"(\w+://[^\s?#\"'<>]*)\?[^\s\"'<>]*")


def scrub(text: str, *secrets: str) -> str:
    """``text`` without the secrets and without any URL's query string (where presigned signatures live)."""
    for secret in sorted(filter(None, secrets), key=len, reverse=True):
        text = text.replace(secret, "***")
    return _QUERY.sub(r"\1?…", text)


def json_or_none(response: httpx.Response) -> dict[str, Any] | None:
    try:
        body = response.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def retry_after(value: str | None) -> float:
    """Seconds to wait from a ``Retry-After`` header: delta-seconds or an HTTP date."""
    if not value:
        return DEFAULT_RETRY_AFTER
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return DEFAULT_RETRY_AFTER
