"""The Replicate-style ``predictions`` protocol: no idempotency key, found again only by listing.

    POST /v1/predictions              {version, input, metadata?, input_urls?}   → 201 prediction
    GET  /v1/predictions/{id}         → {id, status, output, error, metrics: {predict_time}, metadata, …}
    GET  /v1/predictions?cursor=C     → {results: [newest first …], next: cursor | null}
    POST /v1/predictions/{id}/cancel  → prediction
    GET  /v1/usage?since=T&cursor=C   → {results: [{prediction_id, metadata, amount, created_at}], next}

Statuses are ``starting`` → ``processing`` → ``succeeded`` | ``failed`` | ``canceled``. Outputs are absolute
URLs on the CDN. Every POST creates (and bills) a prediction: a retry of a lost POST pays again, which is why
a client must find its prediction by listing (``metadata``) before resubmitting. The bill is
``profile.cost`` if set, else ``predict_time × prediction_price_per_second`` — no cost appears in the body.
"""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from vendors.simulator.outputs import Output
from vendors.simulator.state import Job, JobRequest, SimError, SimState, deliverable, money, refuse

PAGE = 20
PRICE_PER_SECOND = Decimal("0.30")  # what a second of compute bills where the profile sets no flat cost


class PredictionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: str = Field(min_length=1, max_length=200)
    input: dict[str, Any]
    metadata: dict[str, str] = Field(default_factory=dict)
    input_urls: dict[str, str] = Field(default_factory=dict)  # our extension: sha256 → a fetchable URL


_STATUS = {"running": "processing", "succeeded": "succeeded", "failed": "failed", "cancelled": "canceled"}


class PredictionsApi:
    """The predictions protocol over the simulator's shared state (jobs live in ``state.predictions``)."""

    def __init__(self, state: SimState) -> None:
        self.state = state

    def create(self, body: PredictionRequest) -> dict[str, Any]:
        state = self.state
        executor = body.version
        with state.lock:
            cfg, n = state.config, state.predictions_asked
            state.predictions_asked += 1
            key = body.metadata.get("operation_key") or f"anon-{n}"
            attempt, profile, draw = state.draw(key, executor, counter=f"pred:{key}")
        refuse(draw)
        if draw.late:
            time.sleep(profile.late_accept_seconds)  # created (and billed) after the client may have given up
        output, input_error = deliverable(executor, body.input, body.input_urls, draw)
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
            job.extra.update(metadata=dict(body.metadata), created=time.time(), version=body.version)
            state.predictions[pid] = job
            state.charge(key, pid, executor, cost, "predictions")
            view = self._view(job, now)
        if draw.slow:
            time.sleep(profile.slow_seconds)
        if draw.dropped:
            raise SimError(502, "bad_gateway", "upstream connection reset")
        return view

    def _job(self, pid: str) -> Job:
        job = self.state.predictions.get(pid)
        if job is None:
            raise SimError(404, "not_found", f"no prediction {pid}")
        return job

    def _view(self, job: Job, now: float) -> dict[str, Any]:
        status, _ = job.state(now)
        wire = _STATUS[status]
        if wire == "processing" and now - job.accepted_at < job.latency * 0.1:
            wire = "starting"
        output = None
        if status == "succeeded" and job.output is not None:
            ext = job.output.media.get("format") or "bin"
            output = f"{self.state.cdn_base}/predictions/{job.id}/output.{ext}"
        error = None
        if status == "failed":
            error = job.input_error or (
                "executor crashed"
                if job.draw.failure == "technical"
                else "NSFW content detected: input violates content policy"
            )
        created = datetime.fromtimestamp(job.extra["created"], UTC)
        return {
            "id": job.id,
            "version": job.extra["version"],
            "status": wire,
            "input": job.request.input,
            "output": output,
            "error": error,
            "metadata": job.extra["metadata"],
            "metrics": {"predict_time": _predict_time(job)} if status != "running" else {},
            "created_at": created.isoformat(),
            "completed_at": (created + timedelta(seconds=job.latency)).isoformat()
            if status != "running"
            else None,
            "urls": {"get": f"/v1/predictions/{job.id}", "cancel": f"/v1/predictions/{job.id}/cancel"},
        }

    def get(self, pid: str) -> dict[str, Any]:
        with self.state.lock:
            job, now = self._job(pid), time.monotonic()
            if job.gone(now, job.profile.forget_after_seconds):
                raise SimError(404, "not_found", f"no prediction {pid}")
            return self._view(job, now)

    def list(self, cursor: str | None) -> dict[str, Any]:
        with self.state.lock:
            now = time.monotonic()
            order = list(reversed(self.state.predictions.values()))
            start = int(cursor) if cursor and cursor.isdigit() else 0
            results = [self._view(job, now) for job in order[start : start + PAGE]]
        nxt = str(start + PAGE) if start + PAGE < len(order) else None
        return {"results": results, "next": nxt}

    def cancel(self, pid: str) -> dict[str, Any]:
        with self.state.lock:
            job, now = self._job(pid), time.monotonic()
            status, progress = job.state(now)
            if status == "running":
                job.cancelled_progress = progress  # billed at creation: the charge stays
            return self._view(job, now)

    def file(self, pid: str, authorization: str | None) -> Output:
        with self.state.lock:
            if authorization:
                self.state.leaks.append({"file": pid, "authorization": authorization[:12] + "…"})
            job, now = self._job(pid), time.monotonic()
            status, _ = job.state(now)
            if status != "succeeded" or job.output is None:
                raise SimError(404, "not_found", f"prediction {pid} has no output")
            if job.gone(now, job.profile.purge_after_seconds):
                raise SimError(404, "purged", f"the output of {pid} expired")
            return job.output


def _predict_time(job: Job) -> float:
    """What a finished prediction reports as its compute seconds: its latency, or the profile's odd figure."""
    override = job.profile.predict_time_override
    return float(override) if override is not None else round(job.latency, 3)
