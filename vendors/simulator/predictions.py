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
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from pydantic import BaseModel, ConfigDict, Field

from vendors.simulator.outputs import Output
from vendors.simulator.state import Job, JobRequest, SimError, SimState, deliverable, money, refuse

PAGE = 100  # Replicate: "It will return 100 records per page"
PRICE_PER_SECOND = Decimal("0.30")  # what a second of compute bills where the profile sets no flat cost


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

    def _view(self, job: Job, now: float, base: str) -> dict[str, Any]:
        status, _ = job.state(now)
        wire = _STATUS[status]
        if wire == "processing" and now - job.accepted_at < job.latency * 0.1:
            wire = "starting"
        purged = status == "succeeded" and job.gone(now, job.profile.purge_after_seconds)
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
            return self._view(job, now, base)

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


def _iso(t: datetime) -> str:
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _predict_time(job: Job) -> float:
    """What a finished prediction reports as its compute seconds: its latency, or the profile's odd figure."""
    override = job.profile.predict_time_override
    return float(override) if override is not None else round(job.latency, 3)
