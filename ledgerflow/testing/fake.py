"""A fake of your vendor in a few dozen lines: declare its routes, and it misbehaves as the kit asks.

    fake = FakeVendorApp(price=Decimal("0.30"), latency_seconds=0.1, deduplicates=True)

    @fake.submit("POST", "/v2/renders", key=lambda call: call.headers.get("request-token"))
    async def create(call: Call) -> Any:
        job = call.create_job(output=png(64, 64), media_type="image/png")
        return {"render": {"id": job.id, "state": "queued"}}

    @fake.route("GET", "/v2/renders/{job_id}")
    async def read(call: Call) -> Any:
        job = fake.job(call.path_params["job_id"])  # 404 if the vendor has no such job
        return {"render": {"id": job.id, "state": "ready" if job.done else "rendering"}}

    with fake.serving():  # real HTTP (uvicorn) on a free port: fake.url
        ...

What the helper does so the fake need not: it keeps the jobs (a job is done ``latency_seconds`` after it was
created, billed when created — the vendor's own billing record, which is what the kit checks), deduplicates
submits by key when the vendor does (within the key's retention), serves each job's output at
``file_url(job)`` until it is purged, and wraps every ``submit`` handler in the habits the kit gives the
scenario's operation (``Habits``): the first call refused with a 500 or a 429 (``Retry-After: 1``), the
call billed and then its answer lost (502) or replaced by a gateway's 5xx, the job created only after the
client gave up (the request hangs; a resubmission of the key meanwhile answers 409 where the vendor
deduplicates), the key forgotten early, the output purged, the price multiplied. A ``FakeVendorApp`` is a
``FakeVendor``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from ledgerflow.testing.serving import served
from ledgerflow.testing.vendor import Charge, Habits

Handler = Callable[["Call"], Awaitable[Any]]


@dataclass
class FakeJob:
    """A job the fake vendor holds: billed when created, done ``seconds`` later, its output until purged."""

    id: str
    key: str | None
    request: Any
    output: bytes
    media_type: str
    cost: Decimal
    seconds: float
    created_at: float = field(default_factory=time.monotonic)
    purge_after: float | None = None
    cancelled: bool = False

    @property
    def done(self) -> bool:
        return self.cancelled or time.monotonic() >= self.created_at + self.seconds

    @property
    def progress(self) -> float:
        if self.seconds <= 0:
            return 1.0
        return min(1.0, (time.monotonic() - self.created_at) / self.seconds)

    @property
    def purged(self) -> bool:
        """Its output is gone: ``purge_after`` seconds after it was done."""
        if self.purge_after is None or not self.done:
            return False
        return time.monotonic() >= self.created_at + self.seconds + self.purge_after


@dataclass
class Call:
    """One request to the fake: what came, and the fake it came to."""

    fake: FakeVendorApp
    request: Request
    body: bytes
    key: str | None = None  # the submit's operation key (what ``key=`` read), else None

    @property
    def headers(self) -> Any:
        return self.request.headers

    @property
    def path_params(self) -> dict[str, Any]:
        return dict(self.request.path_params)

    @property
    def query(self) -> Any:
        return self.request.query_params

    @property
    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    def create_job(
        self, *, output: bytes, media_type: str, price: Decimal | None = None, seconds: float | None = None
    ) -> FakeJob:
        """The job this submit creates (and bills), or — the vendor deduplicating — the key's earlier one."""
        return self.fake.create_job(
            self.key, self.json, output=output, media_type=media_type, price=price, seconds=seconds
        )


class FakeVendorApp:
    """A programmable fake vendor over real HTTP (see the module doc).

    Args:
        price: What a job is billed (before an overcharge).
        latency_seconds: How long a job runs.
        deduplicates: Whether a submit under a key the vendor holds returns that job instead of a new one.
        api_key: The credential every request must carry somewhere in its headers (the kit's, by default);
            a request without it is answered 401, as the vendor would.
    """

    def __init__(
        self,
        *,
        price: Decimal,
        latency_seconds: float = 0.1,
        deduplicates: bool = False,
        api_key: str | None = "sk-test-4f1c9e",
    ) -> None:
        self.price = price
        self.latency_seconds = latency_seconds
        self.deduplicates = deduplicates
        self.api_key = api_key
        self.app = FastAPI()
        self.app.add_api_route("/files/{job_id}", self._file, methods=["GET"])
        self.jobs: dict[str, FakeJob] = {}
        self.book: list[tuple[str | None, Charge]] = []  # (operation key, charge): the vendor's billing
        self._ids = itertools.count(1)
        self._calls: Counter[str | None] = Counter()
        self._pending: set[str | None] = set()  # keys whose late creation is on its way
        self._tasks: set[asyncio.Task[Any]] = set()
        self._habits: dict[str, Habits] = {}
        self._url: str | None = None

    # ── FakeVendor ────────────────────────────────────────────────────────────────────────────────────
    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the fake is not serving: use `with fake.serving():`")
        return self._url

    async def arrange(self, route: str, operation_key: str, habits: Habits) -> None:
        self.reset()
        self._habits[operation_key] = habits

    async def charges(self, operation_key: str) -> list[Charge]:
        return [charge for key, charge in self.book if key == operation_key]

    def reset(self) -> None:
        self.jobs.clear()
        self.book.clear()
        self._calls.clear()
        self._pending.clear()
        self._habits.clear()

    # ── declaring the vendor's routes ─────────────────────────────────────────────────────────────────
    def route(self, method: str, path: str) -> Callable[[Handler], Handler]:
        """A route of the vendor's API that creates nothing (reads, listings, cancel)."""
        return self._register(method, path, None)

    def submit(
        self, method: str, path: str, *, key: Callable[[Call], str | None]
    ) -> Callable[[Handler], Handler]:
        """The route that creates (and bills) a job; ``key`` reads the operation key from the call."""
        return self._register(method, path, key)

    def _register(
        self, method: str, path: str, key: Callable[[Call], str | None] | None
    ) -> Callable[[Handler], Handler]:
        def decorate(handler: Handler) -> Handler:
            async def endpoint(request: Request) -> Response:
                call = Call(self, request, await request.body())
                if self.api_key is not None and not any(self.api_key in v for v in request.headers.values()):
                    return JSONResponse({"error": "unauthorized"}, status_code=401)
                if key is None:
                    return _response(await handler(call))
                call.key = key(call)
                return await self._submit(call, handler)

            self.app.add_api_route(path, endpoint, methods=[method])
            return handler

        return decorate

    async def _submit(self, call: Call, handler: Handler) -> Response:
        key = call.key
        self._calls[key] += 1
        first = self._calls[key] == 1
        habits = self._habits.get(key or "", Habits())
        if habits.rate_limit_first and first:
            return JSONResponse({"error": "rate limited"}, status_code=429, headers={"Retry-After": "1"})
        if habits.server_error_first and first:
            return JSONResponse({"error": "internal error"}, status_code=500)
        if key in self._pending and self.deduplicates:
            return JSONResponse({"error": "a request with this key is in progress"}, status_code=409)
        if habits.late_accept_seconds is not None:
            # The job is created (and billed) only after the client gave up on this request.
            self._pending.add(key)
            task = asyncio.create_task(self._late(call, handler, habits.late_accept_seconds))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(habits.late_accept_seconds)
            return JSONResponse({"error": "upstream timed out"}, status_code=504)
        answer = _response(await handler(call))
        if habits.drop_response:
            return JSONResponse({"error": "upstream connection reset"}, status_code=502)
        if habits.gateway_status is not None:
            return JSONResponse({"error": "upstream timed out"}, status_code=habits.gateway_status)
        return answer

    async def _late(self, call: Call, handler: Handler, delay: float) -> None:
        await asyncio.sleep(delay)
        try:
            await handler(call)
        finally:
            self._pending.discard(call.key)

    # ── the vendor's jobs and billing ─────────────────────────────────────────────────────────────────
    def create_job(
        self,
        key: str | None,
        request: Any,
        *,
        output: bytes,
        media_type: str,
        price: Decimal | None = None,
        seconds: float | None = None,
    ) -> FakeJob:
        """A new job, billed now — or, where the vendor deduplicates, the key's job it still remembers."""
        habits = self._habits.get(key or "", Habits())
        if self.deduplicates and key is not None:
            retention = habits.key_retention_seconds
            for job in self.jobs_for(key):
                if retention is None or time.monotonic() < job.created_at + retention:
                    return job
        cost = (price if price is not None else self.price) * (habits.overcharge or 1)
        job = FakeJob(
            id=f"job_{next(self._ids):06d}",
            key=key,
            request=request,
            output=output,
            media_type=media_type,
            cost=cost,
            seconds=self.latency_seconds if seconds is None else seconds,
            purge_after=habits.purge_after_seconds,
        )
        self.jobs[job.id] = job
        self.book.append((key, Charge(job_id=job.id, amount=cost)))
        return job

    def job(self, job_id: str) -> FakeJob:
        """The job, or a 404 answer to the request that asked (raised: FastAPI answers it)."""
        job = self.jobs.get(job_id)
        if job is None:
            raise _NotFound(job_id)
        return job

    def jobs_for(self, key: str) -> list[FakeJob]:
        """The key's jobs, oldest first (what a listing by key finds: retention limits deduplication only)."""
        return [j for j in self.jobs.values() if j.key == key]

    def file_url(self, job: FakeJob) -> str:
        return f"{self.url}/files/{job.id}"

    async def _file(self, job_id: str) -> Response:
        job = self.jobs.get(job_id)
        if job is None or not job.done or job.purged or job.cancelled:
            return JSONResponse({"error": "no such file"}, status_code=404)
        return Response(job.output, media_type=job.media_type)

    # ── serving ───────────────────────────────────────────────────────────────────────────────────────
    @contextmanager
    def serving(self, host: str = "127.0.0.1") -> Iterator[FakeVendorApp]:
        """Serve the fake with uvicorn on a free port (a daemon thread) while the context lasts."""
        self.app.add_exception_handler(_NotFound, _not_found)
        with served(self.app, host=host) as url:
            self._url = url
            try:
                yield self
            finally:
                self._url = None


class _NotFound(Exception):
    def __init__(self, job_id: str) -> None:
        super().__init__(job_id)
        self.job_id = job_id


async def _not_found(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": f"no job {getattr(exc, 'job_id', '')}"}, status_code=404)


def _response(answer: Any) -> Response:
    if isinstance(answer, Response):
        return answer
    return JSONResponse(answer)
