"""The ``queue`` dialect: a queue-style inference API modelled on fal.ai's Queue API (``vendors/queue.py``).

    POST /queue/submit[?fal_webhook=URL]  {model input}  → 202 {request_id, status: IN_QUEUE, queue_position,
                                                                 response_url, status_url, cancel_url}
    GET  /queue/requests/{id}/status      → {status: IN_QUEUE | IN_PROGRESS | COMPLETED | FAILED | CANCELLED,
                                             queue_position?, logs?, metrics?, error?, error_type?}
    GET  /queue/requests/{id}             → {output: {url, content_type, file_size},
                                             metrics: {inference_time}, cost}
                                            (400 while it runs; 422 {detail} if it failed)
    PUT  /queue/requests/{id}/cancel      → 202 {status: CANCELLATION_REQUESTED}
                                            | 400 {status: ALREADY_COMPLETED}
    GET  (CDN) /queue-files/{id}/output.EXT → the bytes, no key (fal.media serves outputs without one)

As fal's queue: no idempotency key and no client request id (the body is the model's input, nothing else), no
listing of requests, no billing API for the caller. Every POST that is not refused creates and bills a
request. One app is served: its calls draw from the executor profile ``APP`` (``"queue"``).

Which operation a request is for is known here only as the vendor knows it: by the ``fal_webhook`` URL the
client gave (its ``operation_key`` query parameter, else its last path segment), else by what was asked
(``anon:`` and a hash of the input). That label keys the fault draws and the billing record (``/charges``,
the harness's view); the API never returns it. The bill is ``profile.cost`` if set, else ``latency ×
PRICE_PER_SECOND``, times ``cost_multiplier``; it is reported as the result's ``cost`` (fal states none: a
fal route prices ``metrics.inference_time``), and ``metrics.inference_time`` is the latency.

Faults (``SimState.draw``): 429/408/5xx refusals before anything is accepted; ``late_accept`` (the request is
created and billed only after ``late_accept_seconds``); ``drop_response`` (created and billed, then a 502);
``gateway_error`` (created and billed, then a 503/504); ``slow``; ``purge_after_seconds`` (the CDN file is
gone); ``forget_after_seconds`` (the request's records answer 404); failures (technical, content) as
``FAILED`` with an error; ``hang``.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import weakref
from decimal import Decimal
from typing import Any, Final
from urllib.parse import parse_qsl, unquote, urlsplit

from vendors.simulator.outputs import Output
from vendors.simulator.predictions import input_urls
from vendors.simulator.state import Job, JobRequest, SimError, SimState, deliverable, money, refuse

APP: Final = "queue"  # the executor profile every call of this dialect draws from
PRICE_PER_SECOND: Final = Decimal(
    "0.30"
)  # what a second of compute bills where the profile sets no flat cost
PROTOCOL: Final = "queue"  # the billing record's protocol label


def label(body: dict[str, Any], webhook: str | None) -> str:
    """Which operation this is, as far as the vendor can know: see the module doc."""
    if webhook:
        parts = urlsplit(webhook)
        query = dict(parse_qsl(parts.query))
        return query.get("operation_key") or unquote(parts.path.rstrip("/").rsplit("/", 1)[-1])
    asked = json.dumps([APP, body], sort_keys=True)
    return "anon:" + hashlib.sha256(asked.encode()).hexdigest()[:24]


_APIS: weakref.WeakKeyDictionary[SimState, QueueApi] = weakref.WeakKeyDictionary()
_APIS_LOCK = threading.Lock()


class QueueApi:
    """The queue protocol over the simulator's shared state and billing: one per state (``of``), shared by
    the API and the CDN.

    Its requests live here, not in ``SimState``; they are dropped whenever the state was reset (a reset makes
    a new billing record, which is what is watched)."""

    @classmethod
    def of(cls, state: SimState) -> QueueApi:
        """The state's queue (made on first use)."""
        with _APIS_LOCK:
            api = _APIS.get(state)
            if api is None:
                api = _APIS[state] = cls(state)
            return api

    def __init__(self, state: SimState) -> None:
        self.state = state
        self._jobs: dict[str, Job] = {}
        self._record: object = state.charges_
        self._asked = 0

    def _requests(self) -> dict[str, Job]:
        """The requests since the last reset (the caller holds the lock)."""
        if self.state.charges_ is not self._record:
            self._jobs, self._record, self._asked = {}, self.state.charges_, 0
        return self._jobs

    # ── the API ───────────────────────────────────────────────────────────────────────────────────────
    def submit(self, body: dict[str, Any], webhook: str | None, base: str) -> dict[str, Any]:
        state = self.state
        with state.lock:
            jobs = self._requests()
            cfg, n = state.config, self._asked
            self._asked += 1
            key = label(body, webhook)
            attempt, profile, draw = state.draw(key, APP, counter=f"queue:{key}")
        refuse(draw)
        if draw.late:
            time.sleep(profile.late_accept_seconds)  # created (and billed) after the client may have given up
        fetches: list[tuple[str, str | None]] = [(url, None) for url in input_urls(body)]
        output, input_error = deliverable(APP, body, fetches, draw)
        rid = hashlib.sha256(f"{cfg.seed}:{key}:{attempt}:{n}".encode()).hexdigest()
        rid = f"{rid[:8]}-{rid[8:12]}-{rid[12:16]}-{rid[16:20]}-{rid[20:32]}"  # a UUID's shape, as fal's
        with state.lock:
            jobs = self._requests()
            now = time.monotonic()
            latency = profile.latency_seconds
            bill = (
                profile.cost
                if profile.cost is not None
                else PRICE_PER_SECOND * Decimal(str(round(latency, 3)))
            )
            cost = money(bill * profile.cost_multiplier)
            request = JobRequest(executor=APP, input=body, estimate=Decimal(0))
            job = Job(rid, key, request, cost, latency, draw, now, profile, output, input_error)
            job.extra.update(position=sum(1 for j in jobs.values() if j.state(now)[0] == "running"))
            jobs[rid] = job
            state.charge(key, rid, APP, cost, PROTOCOL)
            if draw.dropped:
                state.dropped += 1
            elif draw.gateway_error:
                state.gateway_errors += 1
        if draw.slow:
            time.sleep(profile.slow_seconds)
        if draw.dropped:
            raise SimError(502, "bad_gateway", "upstream connection reset")
        if draw.gateway_error:
            status = draw.gateway_error_status
            raise SimError(status, "gateway_error", f"upstream timed out ({status})")
        urls = _urls(base, rid)
        return {"request_id": rid, "status": "IN_QUEUE", "queue_position": job.extra["position"], **urls}

    def _job(self, rid: str, now: float) -> Job:
        job = self._requests().get(rid)
        if job is None or job.gone(now, job.profile.forget_after_seconds):
            raise SimError(404, "not_found", f"no request {rid}", detail="Request not found")
        return job

    def status(self, rid: str, base: str) -> dict[str, Any]:
        with self.state.lock:
            now = time.monotonic()
            job = self._job(rid, now)
            status, progress = job.state(now)
            view: dict[str, Any] = {"status": _word(job, status, progress, now), **_urls(base, rid)}
            if view["status"] == "IN_QUEUE":
                view["queue_position"] = job.extra["position"]
            if status != "running":
                view["metrics"] = {"inference_time": round(job.latency, 3)}
            if status == "failed":
                view["error"], view["error_type"] = _error(job)
            slow = job.draw.slow
        if slow:
            time.sleep(job.profile.slow_seconds)
        return view

    def result(self, rid: str) -> dict[str, Any]:
        with self.state.lock:
            now = time.monotonic()
            job = self._job(rid, now)
            status, _ = job.state(now)
            if status == "running":
                raise SimError(
                    400, "not_ready", f"request {rid} is still in progress", detail="Not completed"
                )
            if status == "failed":
                message, kind = _error(job)
                raise SimError(422, kind, message, detail=message, error_type=kind)
            if status == "cancelled":
                raise SimError(400, "cancelled", f"request {rid} was cancelled", detail="Request cancelled")
            body: dict[str, Any] = {
                "metrics": {"inference_time": round(job.latency, 3)},
                "cost": job.cost,
                "output": None,
            }
            if job.output is not None and not job.profile.no_result:
                ext = job.output.media.get("format") or "bin"
                body["output"] = {
                    "url": f"{self.state.cdn_base}/queue-files/{rid}/output.{ext}",
                    "content_type": job.output.content_type,
                    "file_size": len(job.output.data),
                }
            return body

    def cancel(self, rid: str) -> tuple[int, dict[str, Any]]:
        with self.state.lock:
            now = time.monotonic()
            job = self._job(rid, now)
            status, progress = job.state(now)
            if status != "running":
                return 400, {"status": "ALREADY_COMPLETED"}
            job.cancelled_progress = progress  # billed at acceptance: the charge stays
            return 202, {"status": "CANCELLATION_REQUESTED"}

    def file(self, rid: str, authorization: str | None) -> Output:
        """A request's output on the CDN (no key: fal.media serves outputs without one); a request that
        arrives carrying a credential is a leak (``/admin/leaks``)."""
        with self.state.lock:
            if authorization:
                self.state.leaks.append({"file": rid, "authorization": authorization[:12] + "…"})
            now = time.monotonic()
            job = self._requests().get(rid)
            if job is None or job.state(now)[0] != "succeeded" or job.output is None:
                raise SimError(404, "not_found", f"request {rid} has no output")
            if job.gone(now, job.profile.purge_after_seconds):
                raise SimError(404, "purged", f"the output of {rid} expired")
            out = job.output
        if job.draw.corrupt:
            return Output(out.data[:-1] + bytes([out.data[-1] ^ 1]), out.media, out.content_type)
        return out


def _urls(base: str, rid: str) -> dict[str, str]:
    return {
        "response_url": f"{base}/queue/requests/{rid}",
        "status_url": f"{base}/queue/requests/{rid}/status",
        "cancel_url": f"{base}/queue/requests/{rid}/cancel",
    }


def _word(job: Job, status: str, progress: float, now: float) -> str:
    if status == "running":
        return "IN_QUEUE" if now - job.accepted_at < job.latency * 0.1 or job.draw.hang else "IN_PROGRESS"
    return {"succeeded": "COMPLETED", "failed": "FAILED", "cancelled": "CANCELLED"}[status]


def _error(job: Job) -> tuple[str, str]:
    """A failed request's error message and type."""
    if job.input_error:
        return job.input_error, "file_download_error"
    if job.draw.failure == "technical":
        return "runner crashed while processing the request", "runner_server_error"
    return "the input violates the content policy", "content_policy_violation"
