"""Replicate's ``predictions`` protocol, as its published OpenAPI document describes it (a copy is kept in
``tests/vendors/schemas/replicate-openapi.json``; every answer here validates against it in the tests).

    POST /v1/predictions              {version, input, webhook?, webhook_events_filter?, stream?} → 201
    GET  /v1/predictions/{id}         → {id, model, version, input, output, error, status, data_removed,
                                         created_at, started_at?, completed_at?, metrics, urls, source, logs}
    GET  /v1/predictions?created_after=T&created_before=T  → {results: [newest first …], next: URL | null,
                                                              previous: null}  (100 a page)
    POST /v1/predictions/{id}/cancel  → prediction

Exactly what Replicate takes: any other field of the create body (``metadata``, an idempotency key) is a 422,
as ``additionalProperties: false`` says; no idempotency, no usage or billing listing. Statuses are
``starting`` → ``processing`` → ``succeeded`` | ``failed`` | ``canceled``. Every POST creates (and bills) a
prediction, so a retry of a lost POST pays again: a client finds its prediction by what it asked (version
and input in the listing). Inputs are URLs inside ``input`` (the vendor fetches every URL it is given; a
failed fetch fails the prediction). Outputs are absolute URLs on the CDN; once purged, ``data_removed``.

Which operation a prediction was made for is known here only as a vendor knows it: by the ``webhook`` URL
the client gave (its ``operation_key`` query parameter, else its last path segment), else by what was asked
(``anon:`` and a hash of version and input). That label keys the simulator's fault draws and its billing
record (the harness's view, ``/charges``); it is never returned by the API (Replicate returns no webhook).
The bill is ``profile.cost`` if set, else ``predict_time × prediction_price_per_second`` — no cost appears in
the body.

Callbacks (``SimConfig.webhooks``, off by default): when a prediction created with a ``webhook`` ends, the
prediction as ``GET`` shows it is POSTed there, signed as Replicate signs (Standard Webhooks), from a task on
the server's event loop (``WebhookSender``), retried at most twice with the same ``webhook-id``. Each
delivery attempt is recorded (``GET /admin/webhooks``). The habits a real sender has are drawn per
prediction: the callback dropped, replayed, forged, or a "succeeded" sent while the work still runs.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import hashlib
import hmac
import json
import time
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field

from vendors.simulator.config import WebhookFate, WebhookHabits
from vendors.simulator.outputs import Output
from vendors.simulator.state import Job, JobRequest, SimError, SimState, deliverable, money, refuse

PAGE = 100  # Replicate: "It will return 100 records per page"
PRICE_PER_SECOND = Decimal("0.30")  # what a second of compute bills where the profile sets no flat cost
WEBHOOK_TIMEOUT = 2.0  # seconds a receiver has to answer one delivery attempt
# Seconds before the second and third attempts of a failed delivery. Real senders back off for minutes to
# hours; the simulator keeps the shape (same webhook-id, a fresh timestamp and signature) at a test's pace.
WEBHOOK_RETRY_BACKOFF = (0.2, 0.5)


class PredictionRequest(BaseModel):
    """The create body, ``schemas_version_prediction_request``: nothing else is accepted."""

    model_config = ConfigDict(extra="forbid")

    version: str = Field(min_length=1, max_length=200)
    input: dict[str, Any]
    webhook: str | None = Field(default=None, max_length=2000)
    webhook_events_filter: list[Literal["start", "output", "logs", "completed"]] | None = None
    stream: bool | None = None  # deprecated by Replicate; accepted

    def label(self) -> str:
        """Which operation this is, as far as the vendor can know: see the module doc."""
        if self.webhook:
            parts = urlsplit(self.webhook)
            query = dict(parse_qsl(parts.query))
            return query.get("operation_key") or unquote(parts.path.rstrip("/").rsplit("/", 1)[-1])
        asked = json.dumps([self.version, self.input], sort_keys=True)
        return "anon:" + hashlib.sha256(asked.encode()).hexdigest()[:24]


def input_urls(value: Any) -> list[str]:
    """Every URL in a prediction's input, in order: what the vendor fetches."""
    if isinstance(value, str):
        return [value] if value.startswith(("http://", "https://", "file://")) else []
    if isinstance(value, dict):
        return [u for v in value.values() for u in input_urls(v)]
    if isinstance(value, list):
        return [u for v in value for u in input_urls(v)]
    return []


_STATUS = {"running": "processing", "succeeded": "succeeded", "failed": "failed", "cancelled": "canceled"}


class PredictionsApi:
    """The predictions protocol over the simulator's shared state (jobs live in ``state.predictions``)."""

    def __init__(self, state: SimState) -> None:
        self.state = state
        self.webhooks = WebhookSender(self)

    def create(self, body: PredictionRequest, base: str) -> dict[str, Any]:
        state = self.state
        executor = body.version
        with state.lock:
            cfg, n = state.config, state.predictions_asked
            state.predictions_asked += 1
            key = body.label()
            attempt, profile, draw = state.draw(key, executor, counter=f"pred:{key}")
        refuse(draw)
        if draw.late:
            time.sleep(profile.late_accept_seconds)  # created (and billed) after the client may have given up
        fetches: list[tuple[str, str | None]] = [(url, None) for url in input_urls(body.input)]
        output, input_error = deliverable(executor, body.input, fetches, draw)
        pid = "pred_" + hashlib.sha256(f"{cfg.seed}:{key}:{attempt}:{n}".encode()).hexdigest()[:20]
        request = JobRequest(executor=executor, input=body.input, estimate=Decimal(0))
        with state.lock:
            now = time.monotonic()
            latency = profile.latency_seconds
            bill = (
                profile.cost
                if profile.cost is not None
                else PRICE_PER_SECOND * Decimal(str(round(latency, 3)))
            )
            cost = money(bill * profile.cost_multiplier)
            job = Job(pid, key, request, cost, latency, draw, now, profile, output, input_error)
            job.extra.update(created=time.time(), version=body.version)
            state.predictions[pid] = job
            state.charge(key, pid, executor, cost, "predictions")
            view = self._view(job, now, base)
            habits = cfg.webhooks
        # Only the completed event is ever sent (no start, output or logs): ledgerflow acts only on a
        # prediction's end, so the other events would exercise nothing. Scheduled before a slow or dropped
        # answer: the vendor calls back even when the client never learned the prediction's id.
        events = body.webhook_events_filter
        if body.webhook and habits is not None and (events is None or "completed" in events):
            fate = WebhookFate.for_prediction(cfg.seed, key, attempt, habits)
            self.webhooks.schedule(job, body.webhook, base, habits, fate)
        if draw.slow:
            time.sleep(profile.slow_seconds)
        if draw.dropped:
            raise SimError(502, "bad_gateway", "upstream connection reset")
        if draw.gateway_error:  # created and billed; the gateway in front answers that its upstream timed out
            status = draw.gateway_error_status
            raise SimError(status, "gateway_error", f"upstream timed out ({status})")
        return view

    def _job(self, pid: str) -> Job:
        job = self.state.predictions.get(pid)
        if job is None:
            raise SimError(404, "not_found", f"no prediction {pid}")
        return job

    def _view(self, job: Job, now: float, base: str) -> dict[str, Any]:
        status, _ = job.state(now)
        wire = _STATUS[status]
        if wire == "processing" and now - job.accepted_at < job.latency * 0.1:
            wire = "starting"
        purged = status == "succeeded" and job.gone(now, job.profile.purge_after_seconds)
        output = self._output_url(job) if status == "succeeded" else None
        error = None
        if status == "failed":
            error = job.input_error or (
                "executor crashed"
                if job.draw.failure == "technical"
                else "NSFW content detected: input violates content policy"
            )
        created = datetime.fromtimestamp(job.extra["created"], UTC)
        done = status != "running"
        view: dict[str, Any] = {
            "id": job.id,
            "model": f"simulator/{job.extra['version'].split(':', 1)[0]}",
            "version": job.extra["version"],
            "status": wire,
            "input": job.request.input,
            "output": output,
            "error": error,
            "logs": "",
            "data_removed": purged,
            "source": "api",
            "metrics": {"predict_time": _predict_time(job), "total_time": round(job.latency, 3)}
            if done
            else {},
            "created_at": _iso(created),
            "urls": {
                "web": f"{base}/p/{job.id}",
                "get": f"{base}/v1/predictions/{job.id}",
                "cancel": f"{base}/v1/predictions/{job.id}/cancel",
            },
        }
        if wire != "starting":
            view["started_at"] = _iso(created)
        if done:
            view["completed_at"] = _iso(created + timedelta(seconds=job.latency))
        return view

    def _output_url(self, job: Job) -> str | None:
        if job.output is None:
            return None
        ext = job.output.media.get("format") or "bin"
        return f"{self.state.cdn_base}/predictions/{job.id}/output.{ext}"

    def get(self, pid: str, base: str) -> dict[str, Any]:
        with self.state.lock:
            job, now = self._job(pid), time.monotonic()
            if job.gone(now, job.profile.forget_after_seconds):
                raise SimError(404, "not_found", f"no prediction {pid}")
            return self._view(job, now, base)

    def list(
        self, base: str, cursor: str | None, after: datetime | None, before: datetime | None
    ) -> dict[str, Any]:
        """A page of the account's predictions, newest first, created in [after, before)."""
        with self.state.lock:
            now = time.monotonic()
            order = [
                job
                for job in reversed(self.state.predictions.values())
                if (after is None or job.extra["created"] >= after.timestamp())
                and (before is None or job.extra["created"] < before.timestamp())
            ]
            start = int(cursor) if cursor and cursor.isdigit() else 0
            results = [self._view(job, now, base) for job in order[start : start + PAGE]]
        nxt = None
        if start + PAGE < len(order):
            query = {"cursor": str(start + PAGE)}
            if after is not None:
                query["created_after"] = _iso(after)
            if before is not None:
                query["created_before"] = _iso(before)
            nxt = f"{base}/v1/predictions?{urlencode(query)}"
        return {"results": results, "next": nxt, "previous": None}

    def cancel(self, pid: str, base: str) -> dict[str, Any]:
        with self.state.lock:
            job, now = self._job(pid), time.monotonic()
            status, progress = job.state(now)
            if status == "running":
                job.cancelled_progress = progress  # billed at creation: the charge stays
            view = self._view(job, now, base)
        self.webhooks.wake(pid)  # a canceled prediction has ended: its callback goes now
        return view

    def file(self, pid: str) -> Output:
        """A prediction's output file (the caller checked the token: Replicate's files need it)."""
        with self.state.lock:
            job, now = self._job(pid), time.monotonic()
            status, _ = job.state(now)
            if status != "succeeded" or job.output is None:
                raise SimError(404, "not_found", f"prediction {pid} has no output")
            if job.gone(now, job.profile.purge_after_seconds):
                raise SimError(404, "purged", f"the output of {pid} expired")
            return job.output


class WebhookSender:
    """Calls predictions' webhooks back from tasks on the server's event loop, as ``WebhookHabits`` say.

    A prediction's status is computed from the clock when asked, so nothing "completes" on its own: the task
    is scheduled when the prediction is created, sleeps until the prediction's end (woken early by a cancel,
    or by a reset that drops it), then waits ``delay_seconds`` and sends the body computed at that moment.
    """

    def __init__(self, api: PredictionsApi) -> None:
        self.api = api
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, bound by its first create request
        self.pending: set[concurrent.futures.Future[None]] = set()
        self.wakers: dict[str, asyncio.Event] = {}
        self._client: httpx.AsyncClient | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def schedule(self, job: Job, url: str, base: str, habits: WebhookHabits, fate: WebhookFate) -> None:
        """Called from a request's worker thread: the task runs on the loop, never in the request."""
        if self.loop is None:
            return  # served without an event loop bound (no async create request yet): nobody to send
        coro = self._run(job, url, base, habits, fate)
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self.pending.add(future)
        future.add_done_callback(self.pending.discard)

    def wake(self, pid: str) -> None:
        """A prediction's status changed outside the clock (canceled): its task looks again."""
        waker = self.wakers.get(pid)
        if waker is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(waker.set)

    def wake_all(self) -> None:
        """After a reset: every waiting task finds its prediction gone and ends."""
        for pid in list(self.wakers):
            self.wake(pid)

    def _current(self, job: Job) -> bool:
        """Whether ``job`` is still the simulator's (a reset forgets it; the caller holds the lock)."""
        return self.api.state.predictions.get(job.id) is job

    async def _run(self, job: Job, url: str, base: str, habits: WebhookHabits, fate: WebhookFate) -> None:
        target = _rewrite(url, habits.rewrite_host)
        key = habits.key()
        if fate.forge:
            key = hashlib.sha256(b"forged:" + key).digest()  # a well-formed signature, by the wrong key
        wake = asyncio.Event()
        self.wakers[job.id] = wake
        try:
            if fate.early and job.latency > 0:
                # Halfway through, a body that says it is done: the receiver must check with the API.
                status = await self._wait(job, wake, until=job.accepted_at + job.latency / 2)
                if status == "running":
                    await self._deliver(job, target, base, key, fate.forge, early=True)
            status = await self._wait(job, wake, until=None)
            if status is None:
                return
            await asyncio.sleep(habits.delay_seconds)
            if not fate.drop:
                await self._deliver(job, target, base, key, fate.forge, duplicate=fate.duplicate)
        finally:
            if self.wakers.get(job.id) is wake:
                del self.wakers[job.id]

    async def _wait(self, job: Job, wake: asyncio.Event, until: float | None) -> str | None:
        """Sleep until the prediction stops running or ``until`` (monotonic) passes; its status then (None:
        the simulator was reset). A hanging prediction waits for a cancel or a reset."""
        state = self.api.state
        while True:
            with state.lock:
                if not self._current(job):
                    return None
                now = time.monotonic()
                status, _ = job.state(now)
                ends = None if job.draw.hang or status != "running" else job.finishes_at
            if status != "running" or (until is not None and now >= until):
                return status
            deadlines = [t for t in (until, ends) if t is not None]
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout)
            wake.clear()

    async def _deliver(
        self,
        job: Job,
        url: str,
        base: str,
        key: bytes,
        forged: bool,
        *,
        early: bool = False,
        duplicate: bool = False,
    ) -> None:
        with self.api.state.lock:
            if not self._current(job):
                return
            now = time.monotonic()
            view = self.api._view(job, now, base)  # exactly what GET /v1/predictions/{id} answers now
            if early:
                view = self._claimed_done(job, view, now)
        body = json.dumps(view, allow_nan=True).encode()
        webhook_id = f"msg_{uuid.uuid4().hex}"
        row = {"prediction_id": job.id, "early": early, "body_status": view["status"], "forged": forged}
        timestamp = int(time.time())
        for attempt, backoff in enumerate((0.0, *WEBHOOK_RETRY_BACKOFF)):
            await asyncio.sleep(backoff)
            timestamp = int(time.time())  # a retry is signed anew at its own time, under the same id
            if await self._post(job, url, webhook_id, timestamp, body, key, {**row, "attempt": attempt + 1}):
                break
        if duplicate:
            # A replay: the very same delivery again (id, timestamp, signature and body), as a sender that
            # lost the receiver's answer sends it.
            replay = {**row, "attempt": 1, "duplicate_of": webhook_id}
            await self._post(job, url, webhook_id, timestamp, body, key, replay)

    def _claimed_done(self, job: Job, view: dict[str, Any], now: float) -> dict[str, Any]:
        """A running prediction's body dressed as finished: the lie an early callback tells."""
        created = datetime.fromtimestamp(job.extra["created"], UTC)
        elapsed = round(now - job.accepted_at, 3)
        return {
            **view,
            "status": "succeeded",
            "output": self.api._output_url(job),  # a URL that answers 404 until the prediction ends
            "started_at": _iso(created),
            "completed_at": _iso(datetime.now(UTC)),
            "metrics": {"predict_time": elapsed, "total_time": elapsed},
        }

    async def _post(
        self,
        job: Job,
        url: str,
        webhook_id: str,
        timestamp: int,
        body: bytes,
        key: bytes,
        row: dict[str, Any],
    ) -> bool:
        """One delivery attempt, recorded; whether the receiver took it (2xx)."""
        headers = {
            "content-type": "application/json",
            "webhook-id": webhook_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(key, webhook_id, timestamp, body),
        }
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=WEBHOOK_TIMEOUT)
        status: int | None = None
        error: str | None = None
        try:
            response = await self._client.post(url, content=body, headers=headers)
            status = response.status_code
        except (httpx.HTTPError, httpx.InvalidURL) as e:  # the client's webhook may be no usable URL
            error = f"{type(e).__name__}: {e}"[:200]
        record = {
            "webhook_id": webhook_id,
            "url": url,
            "timestamp": timestamp,
            "status_code": status,
            "error": error,
            "duplicate_of": None,
            **row,
            "at": time.time(),
        }
        state = self.api.state
        with state.lock:
            if self._current(job):
                state.webhooks.append(record)
        return status is not None and 200 <= status < 300


def sign(key: bytes, webhook_id: str, timestamp: int, body: bytes) -> str:
    """The Standard Webhooks signature header: ``v1,`` and base64(HMAC-SHA256(key, "id.timestamp.body"))."""
    mac = hmac.new(key, f"{webhook_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def _rewrite(url: str, origin: str | None) -> str:
    """``url`` sent to ``origin`` (scheme, host and port) instead of its own; path and query kept."""
    if origin is None:
        return url
    new, old = urlsplit(origin), urlsplit(url)
    return urlunsplit((new.scheme, new.netloc, old.path, old.query, ""))


def _iso(t: datetime) -> str:
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _predict_time(job: Job) -> float:
    """What a finished prediction reports as its compute seconds: its latency, or the profile's odd figure."""
    override = job.profile.predict_time_override
    return float(override) if override is not None else round(job.latency, 3)
