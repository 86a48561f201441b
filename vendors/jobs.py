"""The ``jobs`` adapter: a "submit, then poll" vendor that takes an ``Idempotency-Key`` header.

Wire protocol (``vendors/simulator``'s, and that of most paid generation APIs)::

    POST /jobs                      {executor, input, estimate}, Idempotency-Key: OP → 201 job (200: replay)
    GET  /jobs/{id}                 → job: {id, status, progress, idempotency_key, cost, error, result}
    GET  /jobs?idempotency_key=OP   → {jobs: [...]}   (501 where the vendor cannot look keys up)
    POST /jobs/{id}/cancel          → job             (409: already finished)
    GET  <result.url>               → the bytes       (relative, or absolute on a CDN)
    GET  /billing/charges?job_id=&idempotency_key=    → {charges: [{job_id, idempotency_key, amount}]}
    GET  /billing/charges?since=T&cursor=C            → {charges: [… created_at], next}: the account's listing

A jobs-like vendor with other paths and words needs no code: the route's ``paths`` replace these (by name:
``submit``, ``get``, ``cancel``, ``find``, ``charges``; each holding the placeholders of its default,
``ROUTE_PATHS``) and its ``shape`` names the job's id and status fields, the lookup's list and the status
words::

    paths: {submit: /v2/tasks, get: "/v2/tasks/{job_id}", cancel: "/v2/tasks/{job_id}:abort",
            find: "/v2/tasks?client_token={operation_key}"}
    shape: {id_field: task_id, status_field: state, list_field: tasks,
            statuses: {queued: running, working: running, done: succeeded, error: failed, aborted: cancelled}}

The rest of the protocol stays: the ``Idempotency-Key`` header, the body's ``progress``, ``cost``, ``error``
and ``result``, the billing's query parameters and fields.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from decimal import Decimal
from typing import Any, ClassVar

from pydantic import BaseModel, Field

from vendors.adapter import Capabilities, JobError, JobStatus, ResultFile, Sent, VendorCharge, VendorJob
from vendors.errors import (
    ArtifactHashMismatch,
    VendorBadResponse,
    VendorCannotTell,
    VendorConflict,
    VendorWaitTimeout,
)
from vendors.httpbase import HttpVendor
from vendors.routes import VendorMode

CHARGE_PAGE = 500
MAX_CHARGE_PAGES = 2000  # a billing listing is cut (VendorCannotTell) beyond a million charges


class _Charge(BaseModel):
    job_id: str
    idempotency_key: str | None = None
    amount: str


class _Charges(BaseModel):
    charges: list[_Charge] = Field(default_factory=list)


class _ListedCharge(_Charge):
    created_at: datetime | None = None


class _ChargePage(BaseModel):
    charges: list[_ListedCharge] = Field(default_factory=list)
    next: str | None = None


class _WireJob(BaseModel):
    """The jobs protocol's job body (what the vendor sends), before normalisation."""

    id: str
    status: JobStatus
    progress: Any = None
    idempotency_key: str | None = None
    executor: str | None = None
    cost: Any = None
    error: JobError | None = None
    result: ResultFile | None = None

    def normalised(self) -> VendorJob:
        return VendorJob(
            id=self.id,
            status=self.status,
            progress=self.progress,
            idempotency_key=self.idempotency_key,
            cost=self.cost,
            error=self.error,
            result=self.result,
        )


class JobsAdapter(HttpVendor):
    """Async client of a "submit, then poll" vendor with idempotency keys (see the module doc)."""

    ROUTE_PATHS: ClassVar[Mapping[str, str]] = {
        "submit": "/jobs",
        "get": "/jobs/{job_id}",
        "cancel": "/jobs/{job_id}/cancel",
        "find": "/jobs?idempotency_key={operation_key}",
        "charges": "/billing/charges",
    }
    ROUTE_SHAPE: ClassVar[bool] = True

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            can_lookup=self.route.mode != VendorMode.NONE,
            can_cancel=True,
            synchronous=False,
            has_billing=True,
            # The key is always sent; whether the vendor deduplicates on it only the route can say.
            deduplicates=self.route.mode == VendorMode.IDEMPOTENT,
            can_list_charges=True,
        )

    async def submit(
        self,
        *,
        operation_key: str,
        executor: str,
        request: dict[str, Any],
        estimate: Decimal,
        files: dict[str, str] | None = None,
    ) -> VendorJob:
        """Submit a job under ``operation_key`` (the vendor's idempotency key).

        ``files`` (sha256 → a URL the vendor can fetch the input from) is sent beside the request, not in it:
        a presigned URL changes on every retry and must not make a resubmission look like another request.
        """
        body: dict[str, Any] = {"executor": executor, "input": request, "estimate": str(estimate)}
        if files:
            body["input_urls"] = files
        response = await self.request(
            "POST", self.path("submit"), json=body, headers={"Idempotency-Key": operation_key}
        )
        return self._job(response)

    async def get(self, job_id: str) -> VendorJob:
        return self._job(await self.request("GET", self.path("get", job_id=job_id)))

    async def find_by_key(
        self, operation_key: str, *, since: datetime | None = None, sent: Sent | None = None
    ) -> list[VendorJob]:
        path = self.path("find", operation_key=operation_key)
        response = await self.request("GET", path, cannot_tell_on_501=True)
        if self.route.shape is None:
            return [job.normalised() for job in self.parse(_WireJobs, response).jobs]
        try:
            body = response.json()
        except ValueError as e:
            raise VendorBadResponse(f"malformed answer from the vendor: {type(e).__name__}") from e
        listed = body.get(self.route.shape.list_field) if isinstance(body, dict) else body
        if not isinstance(listed, list):
            raise VendorBadResponse(f"the lookup's answer holds no {self.route.shape.list_field!r} list")
        return [self._wire(raw).normalised() for raw in listed]

    async def cancel(self, job_id: str) -> VendorJob:
        try:
            response = await self.request("POST", self.path("cancel", job_id=job_id))
        except VendorConflict:
            # 409 means the job already finished: too late to cancel is not an error for the caller.
            return await self.get(job_id)
        return self._job(response)

    async def fetch_result(self, job: VendorJob) -> bytes:
        """The whole artifact in memory, checked against the advertised sha256 (small results, tests)."""
        chunks: list[bytes] = []
        await self.download(job, chunks.append)
        content = b"".join(chunks)
        assert job.result is not None
        actual = hashlib.sha256(content).hexdigest()
        if job.result.sha256 is not None and actual != job.result.sha256:
            raise ArtifactHashMismatch(job.id, job.result.sha256, actual)
        return content

    async def charged(self, operation_key: str, job_id: str | None) -> str | None:
        params = {"idempotency_key": operation_key} if job_id is None else {"job_id": job_id}
        response = await self.request("GET", self.path("charges"), params=params)
        charges = self.parse(_Charges, response).charges
        if not charges:
            return None
        if len(charges) == 1:
            return charges[0].amount  # as the vendor wrote it: rules.money.vendor_amount makes it money
        try:
            return str(sum((Decimal(c.amount) for c in charges), Decimal(0)))
        except ArithmeticError:
            return " + ".join(c.amount for c in charges)  # unusable as a sum: counted at the estimate

    async def charges(self, since: datetime) -> list[VendorCharge]:
        """The account's billing listing since ``since``, page by page (every charge, whoever made it)."""
        out: list[VendorCharge] = []
        cursor: str | None = None
        for _ in range(MAX_CHARGE_PAGES):
            params = {"since": since.isoformat(), "limit": str(CHARGE_PAGE)}
            if cursor:
                params["cursor"] = cursor
            page: _ChargePage = self.parse(
                _ChargePage, await self.request("GET", self.path("charges"), params=params)
            )
            out.extend(
                VendorCharge(
                    job_id=c.job_id, operation_key=c.idempotency_key, amount=c.amount, at=c.created_at
                )
                for c in page.charges
            )
            if page.next is None:
                return out
            cursor = page.next
        raise VendorCannotTell(
            f"more than {MAX_CHARGE_PAGES * CHARGE_PAGE} charges since {since.isoformat()}"
        )

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

    def _job(self, response: Any) -> VendorJob:
        if self.route.shape is None:
            wire: _WireJob = self.parse(_WireJob, response)
            return wire.normalised()
        try:
            raw = response.json()
        except ValueError as e:
            raise VendorBadResponse(f"malformed answer from the vendor: {type(e).__name__}") from e
        return self._wire(raw).normalised()

    def _wire(self, raw: Any) -> _WireJob:
        """A job body in the route's ``shape`` (its id and status fields, its status words) read as ours."""
        shape = self.route.shape
        assert shape is not None
        if not isinstance(raw, dict):
            raise VendorBadResponse("malformed answer from the vendor: a job is not an object")
        body = {k: v for k, v in raw.items() if k not in ("id", "status")}
        ident = raw.get(shape.id_field)
        body["id"] = str(ident) if isinstance(ident, int) and not isinstance(ident, bool) else ident
        word = raw.get(shape.status_field)
        status = shape.statuses.get(word) if isinstance(word, str) else None
        if status is None:
            raise VendorBadResponse(f"job status {str(word)[:40]!r} is not in the route's shape.statuses")
        body["status"] = status
        try:
            return _WireJob.model_validate(body)
        except ValueError as e:
            raise VendorBadResponse(f"malformed answer from the vendor: {type(e).__name__}") from e


class _WireJobs(BaseModel):
    jobs: list[_WireJob]
