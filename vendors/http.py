"""``HttpJobVendor``: the async adapter workers use to submit, poll, cancel and download vendor jobs.

It speaks the protocol of ``vendors/simulator.py``, which mirrors real paid generation APIs. It only
classifies failures into ``vendors.errors`` types and never retries: Temporal's activity retry policy decides
what to repeat, and the reconciler decides what to look up first.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from decimal import Decimal
from email.utils import parsedate_to_datetime
from enum import StrEnum
from typing import Annotated, Any

import httpx
from pydantic import BaseModel, Field, ValidationError, ValidatorFunctionWrapHandler, field_validator

from vendors.errors import (
    ArtifactHashMismatch,
    VendorCannotTell,
    VendorConflict,
    VendorError,
    VendorNotFound,
    VendorRateLimited,
    VendorRejected,
    VendorUnavailable,
    VendorWaitTimeout,
)

DEFAULT_RETRY_AFTER = 1.0


class JobStatus(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self is not JobStatus.RUNNING


class FailureKind(StrEnum):
    TECHNICAL = "technical"  # worth retrying with the same input
    CONTENT_REJECTED = "content_rejected"  # the same input will be rejected again


class JobError(BaseModel, frozen=True):
    kind: FailureKind
    message: str


class MediaInfo(BaseModel, frozen=True):
    """What the vendor says the artifact is; every field optional, unknown fields ignored."""

    format: str | None = Field(default=None, max_length=32)
    duration_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    width: int | None = Field(default=None, ge=0)
    height: int | None = Field(default=None, ge=0)
    rights: dict[str, Annotated[str, Field(max_length=200)]] | None = Field(default=None, max_length=20)


class ArtifactInfo(BaseModel, frozen=True):
    url: str
    sha256: str
    size: int
    media: MediaInfo | None = None  # None: the vendor sent no media metadata (or none we could read)

    @field_validator("media", mode="wrap")
    @classmethod
    def _unreadable_media_is_none(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # Metadata that does not parse must not strand a paid artifact: it is reported as absent, and the
        # review's checks (rights, media bounds) judge an artifact without metadata.
        try:
            return handler(value)
        except ValidationError:
            return None


class VendorJob(BaseModel, frozen=True):
    """A vendor job as last reported by the vendor."""

    id: str
    status: JobStatus
    progress: float
    idempotency_key: str
    executor: str
    cost: Decimal
    error: JobError | None = None
    result: ArtifactInfo | None = None


class HttpJobVendor:
    """Async client of a "submit, then poll" generation vendor over HTTP.

    Args:
        base_url: The vendor's base URL, e.g. ``http://127.0.0.1:8700``.
        api_key: Sent as a bearer token; never logged nor put in exception messages.
        client: A shared client to use (left open by ``aclose``); by default the adapter owns one.
        timeout: Per-request timeout in seconds.
    """

    def __init__(
        self, base_url: str, api_key: str, *, client: httpx.AsyncClient | None = None, timeout: float = 10.0
    ) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        self._base_url = base_url.rstrip("/")
        self._api_key = api_key
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._timeout = timeout
        self._owns_client = client is None
        self._client = client if client is not None else httpx.AsyncClient(timeout=timeout)

    def __repr__(self) -> str:
        return f"HttpJobVendor(base_url={self._base_url!r})"

    async def __aenter__(self) -> HttpJobVendor:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def submit(
        self, *, operation_key: str, executor: str, input: dict[str, Any], estimate: Decimal
    ) -> VendorJob:
        """Submit a job under ``operation_key`` (the vendor's idempotency key).

        Raises:
            VendorUnavailable: The outcome is unknown; the job may exist and be charged. Use ``find_by_key``.
            VendorConflict: The key was already used with a different request.
        """
        body = {"executor": executor, "input": input, "estimate": str(estimate)}
        response = await self._request("POST", "/jobs", json=body, headers={"Idempotency-Key": operation_key})
        return self._job(response.json())

    async def get(self, job_id: str) -> VendorJob:
        return self._job((await self._request("GET", f"/jobs/{job_id}")).json())

    async def find_by_key(self, operation_key: str) -> list[VendorJob]:
        """Every job the vendor holds for ``operation_key``, oldest first.

        Raises:
            VendorCannotTell: The vendor cannot look jobs up by key.
        """
        response = await self._request(
            "GET", "/jobs", params={"idempotency_key": operation_key}, cannot_tell_on_501=True
        )
        return [self._job(job) for job in response.json()["jobs"]]

    async def cancel(self, job_id: str) -> VendorJob:
        """Cancel a job; a job that already finished is returned as it is (check its ``status``)."""
        try:
            response = await self._request("POST", f"/jobs/{job_id}/cancel")
        except VendorConflict:
            # 409 means the job already finished: too late to cancel is not an error for the caller.
            return await self.get(job_id)
        return self._job(response.json())

    async def fetch_result(self, job: VendorJob) -> bytes:
        """Download a succeeded job's artifact and check it against the advertised sha256.

        Raises:
            ArtifactHashMismatch: The bytes are not the ones the vendor advertised.
        """
        if job.result is None:
            raise ValueError(f"job {job.id} has no result (status {job.status})")
        content = (await self._request("GET", job.result.url)).content
        actual = hashlib.sha256(content).hexdigest()
        if actual != job.result.sha256:
            raise ArtifactHashMismatch(job.id, job.result.sha256, actual)
        return content

    async def wait(
        self,
        job_id: str,
        *,
        poll_interval: float,
        on_poll: Callable[[VendorJob], None] | None = None,
        timeout: float | None = None,
    ) -> VendorJob:
        """Poll until the job is terminal, calling ``on_poll`` after every poll (the worker heartbeats there).

        Raises:
            VendorWaitTimeout: ``timeout`` seconds passed and the job is still running.
        """
        started = time.monotonic()
        while True:
            job = await self.get(job_id)
            if on_poll is not None:
                on_poll(job)
            if job.status.terminal:
                return job
            waited = time.monotonic() - started
            if timeout is not None and waited >= timeout:
                raise VendorWaitTimeout(job_id, waited)
            pause = poll_interval if timeout is None else min(poll_interval, timeout - waited)
            await asyncio.sleep(pause)

    async def _request(
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str] | None = None,
        cannot_tell_on_501: bool = False,
        **kwargs: Any,
    ) -> httpx.Response:
        where = f"{method} {path}"
        try:
            response = await self._client.request(
                method,
                self._base_url + path,
                headers={**self._headers, **(headers or {})},
                timeout=self._timeout,
                **kwargs,
            )
        except httpx.TimeoutException as e:
            raise VendorUnavailable(f"{where}: timed out after {self._timeout}s") from e
        except httpx.TransportError as e:
            raise VendorUnavailable(f"{where}: {type(e).__name__}") from e
        if response.is_success:
            return response
        raise self._classify(where, response, cannot_tell_on_501)

    def _classify(self, where: str, response: httpx.Response, cannot_tell_on_501: bool) -> VendorError:
        status = response.status_code
        body = _json_or_none(response)
        detail = body.get("error", {}).get("message") if body else None
        # Scrubbed in case a vendor (or a proxy in front of it) echoes request headers into an error body.
        message = f"{where} -> {status}: {detail or response.reason_phrase}".replace(self._api_key, "***")
        if status == 429:
            return VendorRateLimited(_retry_after(response.headers.get("Retry-After")), message)
        if status == 501 and cannot_tell_on_501:
            return VendorCannotTell(message, status_code=status)
        if status >= 500:
            return VendorUnavailable(message, status_code=status)
        if status == 409:
            return VendorConflict(message, status_code=status)
        if status == 404:
            return VendorNotFound(message, status_code=status)
        return VendorRejected(message, status_code=status)

    @staticmethod
    def _job(data: Any) -> VendorJob:
        try:
            return VendorJob.model_validate(data)
        except ValidationError as e:
            raise VendorError(f"malformed job from vendor: {e.error_count()} validation errors") from e


def _json_or_none(response: httpx.Response) -> dict[str, Any] | None:
    try:
        body = response.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _retry_after(value: str | None) -> float:
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
