"""What every HTTP adapter shares: one request path, one error classification, safe result downloads.

* Status codes are classified once (``classify``) into ``vendors.errors``, by what they prove: a refusal
  (429, 408, 401/403, other 4xx, and the route's ``refused_statuses``: none unless its vendor documents
  them) means nothing was accepted; any other 5xx (a gateway's 503/504 may follow an accepted request), a
  timeout or a reset means the outcome is unknown.
* Result URLs may be relative or absolute (a CDN on another host). They are resolved against the route's
  base URL as URLs, never by string concatenation (``base + "@other.host/x"`` would make ``other.host`` the
  host and the base a user name), and the bearer key goes only to the route's own origin or a host on its
  ``allow_hosts`` list. Everything else is downloaded without credentials.
"""

from __future__ import annotations

import inspect
import re
import time
from collections.abc import Awaitable, Callable
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from vendors.adapter import VendorJob
from vendors.errors import (
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
from vendors.routes import RouteSpec

DEFAULT_RETRY_AFTER = 1.0
M = TypeVar("M", bound=BaseModel)


class HttpVendor:
    """An HTTP adapter's plumbing: the client, the credential, requests and downloads.

    Args:
        route: The route (base URL, timeouts, hosts that may receive the credential).
        base_url: The route's base URL, resolved (a route without one uses the deployment's vendor URL).
        api_key: Sent as a bearer token to the route's own origin only; never logged nor put in messages.
        client: A shared client (left open by ``aclose``); by default the adapter owns one.
    """

    def __init__(
        self, route: RouteSpec, base_url: str, api_key: str, *, client: httpx.AsyncClient | None = None
    ) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        self.route = route
        self._base = httpx.URL(base_url.rstrip("/") + "/")
        self._api_key = api_key
        self._auth = {"Authorization": f"Bearer {api_key}"}
        self._timeout = route.timeouts.request
        self._owns_client = client is None
        self._client = client if client is not None else httpx.AsyncClient(timeout=self._timeout)

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
        **kwargs: Any,
    ) -> httpx.Response:
        """One request to the route's own origin (``path`` relative to the base URL), classified."""
        url = self._base.join(path.lstrip("/"))
        where = f"{method} {url.path}"
        try:
            response = await self._client.request(
                method, url, headers={**self._auth, **(headers or {})}, timeout=self._timeout, **kwargs
            )
        except httpx.TimeoutException as e:
            raise VendorUnavailable(f"{where}: timed out after {self._timeout:g}s", timed_out=True) from e
        except httpx.TransportError as e:
            raise VendorUnavailable(f"{where}: {type(e).__name__}") from e
        if response.is_success:
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
        message = scrub(f"{where} -> {status}: {str(detail or response.reason_phrase)[:300]}", self._api_key)
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

    def parse(self, model: type[M], response: httpx.Response) -> M:
        """``model.model_validate`` of the JSON body, or VendorBadResponse (never a bare KeyError)."""
        try:
            return model.model_validate(response.json())
        except ValueError as e:  # pydantic's ValidationError and json's JSONDecodeError are both ValueErrors
            raise VendorBadResponse(f"malformed answer from the vendor: {type(e).__name__}") from e

    # ── downloads ─────────────────────────────────────────────────────────────────────────────────────
    def resolve(self, raw: str) -> tuple[httpx.URL, bool]:
        """The absolute URL of a result, and whether it may carry the credential (else UnsafeResultUrl)."""
        try:
            url = self._base.join(raw)
        except (httpx.InvalidURL, ValueError, TypeError) as e:
            raise UnsafeResultUrl(f"result URL {scrub(raw[:80])!r} cannot be parsed") from e
        if url.scheme not in ("http", "https") or not url.host:
            raise UnsafeResultUrl(f"result URL {scrub(raw[:80])!r} is not an http(s) URL")
        own = (url.scheme, url.host, url.port) == (self._base.scheme, self._base.host, self._base.port)
        return url, own or url.host in self.route.allow_hosts

    async def download(self, job: VendorJob, sink: Callable[[bytes], Awaitable[None] | None]) -> None:
        """Stream a succeeded job's output into ``sink`` (VendorNotFound if the job names none)."""
        if job.result is None:
            raise VendorNotFound(f"job {job.id} has no result (status {job.status})")
        await self.stream(job.result.url, sink)

    async def stream(self, raw_url: str, sink: Callable[[bytes], Awaitable[None] | None]) -> None:
        """Stream ``raw_url`` into ``sink``; the credential only where ``resolve`` allows it."""
        url, credentials = self.resolve(raw_url)
        where = f"GET {url.host}{url.path}"
        started = time.monotonic()
        try:
            async with self._client.stream(
                "GET", url, headers=self._auth if credentials else None, timeout=self._timeout
            ) as response:
                if not response.is_success:
                    await response.aread()
                    raise self.classify(where, response)
                async for chunk in response.aiter_bytes(1 << 20):
                    written = sink(chunk)
                    if inspect.isawaitable(written):
                        await written
                    if time.monotonic() - started > self.route.timeouts.download:
                        raise VendorUnavailable(
                            f"{where}: download exceeded {self.route.timeouts.download:g}s"
                        )
        except httpx.TimeoutException as e:
            raise VendorUnavailable(f"{where}: timed out after {self._timeout:g}s", timed_out=True) from e
        except httpx.TransportError as e:
            raise VendorUnavailable(f"{where}: {type(e).__name__}") from e


_QUERY = re.compile(r"(\w+://[^\s?#\"'<>]*)\?[^\s\"'<>]*")


def scrub(text: str, secret: str = "") -> str:
    """``text`` without the secret and without any URL's query string (where presigned signatures live)."""
    if secret:
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
