"""The simulator's state: jobs, the billing record, the CDN's log and chat counters, behind one lock.

Handlers run on uvicorn's thread pool. Anything slow (rendering a file, fetching the request's inputs,
sleeping for a late or slow answer) happens outside the lock, so other requests go on meanwhile.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import httpx
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from vendors.simulator.config import Draw, ExecutorProfile, SimConfig
from vendors.simulator.outputs import Output, render

QUANTUM = Decimal("0.0001")


class SimError(Exception):
    """An HTTP error answer with a JSON body ``{"error": {"code", "message"}, ...extra}``."""

    def __init__(
        self, status: int, code: str, message: str, *, headers: dict[str, str] | None = None, **extra: Any
    ):
        super().__init__(message)
        self.status, self.code, self.message, self.headers, self.extra = status, code, message, headers, extra

    def response(self) -> JSONResponse:
        body = {"error": {"code": self.code, "message": self.message}, **self.extra}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class JobRequest(BaseModel):
    """Body of ``POST /jobs``; two requests are "the same body" when executor, input and estimate are equal.

    ``input_urls`` (sha256 → a URL the vendor can fetch the input from) is transport, not identity: a
    presigned URL differs on every retry, and must not turn a resubmission into a conflict.
    """

    model_config = ConfigDict(extra="forbid")

    executor: str
    input: dict[str, Any]
    estimate: Decimal = Field(ge=0)
    input_urls: dict[str, str] = Field(default_factory=dict)

    def identity(self) -> tuple[str, str, Decimal]:
        return self.executor, json.dumps(self.input, sort_keys=True), self.estimate


def money(amount: Decimal) -> str:
    return str(amount.quantize(QUANTUM))


@dataclass
class Job:
    """One accepted (and charged) job; its status is a function of the monotonic clock."""

    id: str
    key: str
    request: JobRequest
    cost: str  # the figure reported and billed, exactly as the vendor states it
    latency: float
    draw: Draw
    accepted_at: float
    profile: ExecutorProfile
    output: Output | None = None  # None: the job never succeeds (it fails or hangs), nothing was rendered
    input_error: str | None = None  # an input could not be fetched or did not match its sha256
    cancelled_progress: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def finishes_at(self) -> float:
        failing = self.draw.failure or self.input_error
        return self.accepted_at + self.latency * (self.draw.fail_at if failing else 1.0)

    def state(self, now: float) -> tuple[str, float]:
        if self.cancelled_progress is not None:
            return "cancelled", self.cancelled_progress
        if self.draw.hang:
            return "running", 0.0
        if now < self.finishes_at:
            return "running", round((now - self.accepted_at) / self.latency, 4)
        if self.draw.failure or self.input_error:
            return "failed", round(self.draw.fail_at if self.latency else 0.0, 4)
        return "succeeded", 1.0

    def gone(self, now: float, after: float | None) -> bool:
        """Whether something purged ``after`` seconds past the job's end is gone by now."""
        status, _ = self.state(now)
        return after is not None and status != "running" and now > self.finishes_at + after

    def claimed_media(self) -> dict[str, Any] | None:
        if self.output is None:
            return None
        media = dict(self.output.media)
        if self.draw.false_claim and media.get("duration_s") is not None:
            media["duration_s"] = media["duration_s"] * 2  # the file is fine; the vendor's claim is not
        elif self.draw.false_claim and media.get("width") is not None:
            media["width"], media["height"] = media["width"] * 2, media["height"] * 2
        return media

    def view(self, now: float, result_url: str) -> dict[str, Any]:
        status, progress = self.state(now)
        error = None
        if status == "failed":
            if self.input_error:
                error = {"kind": "technical", "message": self.input_error}
            elif self.draw.failure == "technical":
                error = {"kind": "technical", "message": "executor crashed"}
            else:
                error = {"kind": "content_rejected", "message": "input violates content policy"}
        result = None
        if status == "succeeded" and self.output is not None and not self.profile.no_result:
            result = {
                "url": result_url,
                "sha256": hashlib.sha256(self.output.data).hexdigest(),
                "size": len(self.output.data),
                "media": self.claimed_media(),
            }
        return {
            "id": self.id,
            "status": status,
            "progress": progress,
            "idempotency_key": self.key,
            "executor": self.request.executor,
            "cost": self.cost,
            "error": error,
            "result": result,
        }


def reported_cost(profile: ExecutorProfile, estimate: Decimal) -> str:
    """The cost figure the vendor states (and bills): the profile's price, odd figures included."""
    if profile.cost_override is not None:
        return profile.cost_override
    base = profile.cost if profile.cost is not None else estimate
    cost = base * profile.cost_multiplier
    if profile.cost_decimals is not None:
        # Just under the round figure, at a precision finer than any ledger keeps (0.40 → 0.3999999).
        tick = Decimal(1).scaleb(-profile.cost_decimals)
        return str(max(Decimal(0), cost.quantize(tick) - tick) if cost > 0 else cost.quantize(tick))
    return money(cost)


# Files uploaded to the simulator (Replicate's Files API: POST /v1/files), by id: an input URL naming one is
# read from here (a vendor reads its own files; they are not on the outside web).
UPLOADS: dict[str, bytes] = {}
_UPLOAD_PATH = re.compile(r"/v1/files/([A-Za-z0-9_-]{1,64})$")


def deliverable(
    executor: str, request: dict[str, Any], inputs: list[tuple[str, str | None]], draw: Draw
) -> tuple[Output | None, str | None]:
    """What an accepted request will deliver, whatever the protocol: its inputs fetched and checked the way a
    vendor does (the problem, if one is not there), then the file rendered as the draw says (None: the job
    fails or hangs, nothing is rendered)."""
    for url, sha in inputs:  # (URL, its sha256 where the protocol sends one)
        if (problem := fetch_input(url, sha)) is not None:
            return None, problem
    if draw.failure or draw.hang:
        return None, None
    rights = (
        None if draw.missing_rights else {"license": "sim-commercial-1.0", "holder": f"simulator/{executor}"}
    )
    output = render(executor, request, bad_media=draw.bad_media, broken_code=draw.broken_code, rights=rights)
    if draw.truncated:
        # A transfer the vendor cut short, with its hash computed on what it kept: only decoding tells.
        output = Output(output.data[: len(output.data) * 7 // 10], output.media, output.content_type)
    return output, None


def fetch_input(url: str, sha256: str | None, timeout: float = 10.0) -> str | None:
    """Fetch one input the way a vendor does (http(s) or a file on this machine); the problem, or None.
    ``sha256``: the hash the request gave it (None: the protocol sends none, as Replicate's; only fetched)."""
    name = f"{sha256[:12]}…" if sha256 else url.split("?", 1)[0][-60:]
    own = _UPLOAD_PATH.search(urlparse(url).path)
    try:
        if own is not None and own.group(1) in UPLOADS:
            data = UPLOADS[own.group(1)]
        elif url.startswith("file://"):
            data = Path(unquote(urlparse(url).path)).read_bytes()
        else:
            response = httpx.get(url, timeout=timeout)
            if not response.is_success:
                return f"input {name} could not be fetched: HTTP {response.status_code}"
            data = response.content
    except (OSError, httpx.HTTPError) as e:
        return f"input {name} could not be fetched: {type(e).__name__}"
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        return f"input {sha256[:12]}… does not match its sha256"
    return None


def refuse(draw: Draw, *, request_timeout: bool = True) -> None:
    """Raise the refusal a draw holds (429, 408, 500): answered before anything is accepted or billed."""
    if draw.rate_limited:
        raise SimError(429, "rate_limited", "too many requests", headers={"Retry-After": "1"})
    if request_timeout and draw.request_timeout:
        raise SimError(408, "request_timeout", "the request body arrived too slowly; nothing accepted")
    if draw.server_error:
        status = draw.server_error_status
        raise SimError(status, "server_error", f"server error {status}; nothing was accepted")


class SimState:
    """Jobs, the billing record and counters of every protocol, behind one lock."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.cdn_base: str | None = None  # set by the server once the CDN's port is known
        self.reset()

    def configure(self, config: SimConfig) -> None:
        with self.lock:
            self.config = config

    def reset(self) -> None:
        with self.lock:
            self.jobs: dict[str, Job] = {}
            self.by_key: dict[str, list[Job]] = defaultdict(list)
            self.attempts: dict[str, int] = defaultdict(int)
            self.inflight: set[str] = set()
            self.charges_: list[dict[str, Any]] = []
            self.chat_: dict[str, int] = {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0}
            self.leaks: list[dict[str, str]] = []  # requests that reached the CDN carrying a credential
            self.conflicts = 0  # 409s answered to a key whose first request was still in flight
            self.dropped = 0  # responses dropped after the job was created and charged (drop_response)
            self.gateway_errors = 0  # 5xx answered after the job was created and charged (gateway_error)
            self.predictions: dict[str, Job] = {}  # the predictions protocol's jobs, in creation order
            self.predictions_asked = 0  # every POST /v1/predictions, refused or not (names anonymous ones)
            self.files: dict[str, Output] = {}  # images served by URL from the CDN
            # Every webhook delivery attempt of the predictions dialect (GET /admin/webhooks), in order.
            self.webhooks: list[dict[str, Any]] = []

    # ── authentication ────────────────────────────────────────────────────────────────────────────────
    def authenticate(self, authorization: str | None) -> None:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise SimError(
                401, "unauthorized", "missing bearer token", headers={"WWW-Authenticate": "Bearer"}
            )
        accepted = self.config.accepted_keys
        if accepted is not None and token.strip() not in accepted:
            raise SimError(401, "invalid_api_key", "the API key is not valid (was it rotated?)")

    # ── billing ───────────────────────────────────────────────────────────────────────────────────────
    def charge(self, key: str, job_id: str, executor: str, amount: str, protocol: str = "jobs") -> None:
        """Record one charge (the caller holds the lock)."""
        self.charges_.append(
            {
                "idempotency_key": key,
                "job_id": job_id,
                "executor": executor,
                "amount": amount,
                "protocol": protocol,
                "at": time.time(),  # wall clock: what a billing listing's ``since`` is compared with
            }
        )

    def inject_charge(self, protocol: str, job_id: str, key: str | None, amount: str) -> None:
        """Test hook: a charge nobody asked for (a vendor's billing error, another client of the account)."""
        with self.lock:
            self.charge(key or "", job_id, "injected", amount, protocol)

    def credit(self, job_id: str, amount: str | None) -> dict[str, Any]:
        """Test hook: the vendor refunds (part of) a job's charge. The credit is listed with the charges, a
        negative line under the refunded job's id and key (the whole charge when ``amount`` is None)."""
        with self.lock:
            charged = next((c for c in self.charges_ if c["job_id"] == job_id), None)
            if charged is None:
                raise SimError(404, "not_found", f"no charge for job {job_id}")
            refund = amount if amount is not None else charged["amount"]
            line = {**charged, "amount": f"-{refund.lstrip('-')}", "at": time.time(), "credit": True}
            self.charges_.append(line)
            return dict(line)

    def charges(self) -> dict[str, Any]:
        with self.lock:
            rows = [dict(c) for c in self.charges_]
        total = Decimal(0)
        for c in rows:
            try:
                amount = Decimal(c["amount"])
            except InvalidOperation:
                continue
            if amount.is_finite():
                total += amount
        return {"charges": rows, "total": str(total), "count": len(rows)}

    def billing(self, job_id: str | None, key: str | None) -> dict[str, Any]:
        """The vendor's own billing API: charges of one job or one idempotency key."""
        with self.lock:
            rows = [
                {"job_id": c["job_id"], "idempotency_key": c["idempotency_key"], "amount": c["amount"]}
                for c in self.charges_
                if (job_id is None or c["job_id"] == job_id) and (key is None or c["idempotency_key"] == key)
            ]
        return {"charges": rows}

    def listing(
        self, protocol: str, since: datetime | None, cursor: str | None, limit: int
    ) -> tuple[list[dict[str, Any]], str | None]:
        """One page of a protocol's charges since ``since``, oldest first, and the next page's cursor.

        What a vendor's billing API lists for an account: every charge, with its job id and the key the call
        carried, whoever made it. The cursor is an offset into the (append-only) record.
        """
        after = since.timestamp() if since is not None else None
        with self.lock:
            rows = [
                dict(c)
                for c in self.charges_
                if c["protocol"] == protocol and (after is None or c["at"] >= after)
            ]
        start = int(cursor) if cursor and cursor.isdigit() else 0
        nxt = str(start + limit) if start + limit < len(rows) else None
        return rows[start : start + limit], nxt

    # ── the jobs protocol ─────────────────────────────────────────────────────────────────────────────
    def result_url(self, job: Job) -> str:
        p = job.profile
        if p.result_url_template is not None:
            cdn = (self.cdn_base or "").removeprefix("http://")
            return p.result_url_template.format(cdn=cdn, job=job.id)
        if p.absolute_urls and self.cdn_base:
            return f"{self.cdn_base}/files/{job.id}"
        return f"/jobs/{job.id}/result"

    def view(self, job: Job, now: float) -> dict[str, Any]:
        return job.view(now, self.result_url(job))

    def _replay(self, key: str, req: JobRequest, now: float) -> tuple[int, dict[str, Any]] | None:
        """Idempotent mode: the job this key already created, while the vendor remembers the key."""
        cfg = self.config
        if cfg.mode != "idempotent":
            return None
        retention = cfg.profile(req.executor).key_retention_seconds
        live = [j for j in self.by_key.get(key, []) if retention is None or now - j.accepted_at < retention]
        if not live:
            return None
        job = live[0]
        if job.request.identity() != req.identity():
            raise SimError(409, "idempotency_conflict", "Idempotency-Key already used with another body")
        return 200, self.view(job, now)

    def draw(
        self, key: str, executor: str, *, counter: str | None = None
    ) -> tuple[int, ExecutorProfile, Draw]:
        """The next attempt at ``key``, its executor's profile and its fate (the caller holds the lock).

        ``counter``: where the attempts are counted, if not under the key itself (each protocol its own).
        """
        slot = counter or key
        attempt = self.attempts[slot]
        self.attempts[slot] += 1
        profile = self.config.profile(executor)
        return attempt, profile, Draw.for_attempt(self.config.seed, key, attempt, profile)

    def submit(self, key: str, req: JobRequest) -> tuple[int, dict[str, Any]]:
        """Accept (201), replay (200) or refuse one POST /jobs; returns the status code and the job."""
        with self.lock:
            cfg, now = self.config, time.monotonic()
            attempt, profile, draw = self.draw(key, req.executor)
            refuse(draw)
            if cfg.mode == "idempotent" and key in self.inflight:
                self.conflicts += 1
                raise SimError(
                    409, "request_in_progress", "a request with this Idempotency-Key is in progress"
                )
            replay = self._replay(key, req, now)
            if replay is not None:
                return replay
            if draw.late:
                self.inflight.add(key)
        if draw.late:
            # The vendor's slow intake: the job is created (and charged) only now, long after the client may
            # have given up waiting. A retry meanwhile finds nothing by key — yet.
            time.sleep(profile.late_accept_seconds)
        try:
            return self._create(key, req, attempt, profile, draw)
        finally:
            if draw.late:
                with self.lock:
                    self.inflight.discard(key)

    def _create(
        self, key: str, req: JobRequest, attempt: int, profile: ExecutorProfile, draw: Draw
    ) -> tuple[int, dict[str, Any]]:
        fetches: list[tuple[str, str | None]] = [(url, sha) for sha, url in req.input_urls.items()]
        output, input_error = deliverable(req.executor, req.input, fetches, draw)
        with self.lock:
            cfg, now = self.config, time.monotonic()
            replay = self._replay(key, req, now)
            if replay is not None:  # a retry created it while this request was late
                return replay
            job_id = "job_" + hashlib.sha256(f"{cfg.seed}:{key}:{attempt}".encode()).hexdigest()[:20]
            cost = reported_cost(profile, req.estimate)
            job = Job(
                job_id, key, req, cost, profile.latency_seconds, draw, now, profile, output, input_error
            )
            self.jobs[job_id] = job
            self.by_key[key].append(job)
            self.charge(key, job_id, req.executor, cost)
            view = self.view(job, now)
        if draw.slow:
            time.sleep(profile.slow_seconds)  # the job exists and is charged; the answer is just late
        if draw.dropped:
            # The vendor's worst habit: the job exists and is charged, but the client never learns its id.
            with self.lock:
                self.dropped += 1
            raise SimError(502, "bad_gateway", "upstream connection reset")
        if draw.gateway_error:
            # A gateway in front of the vendor gave up on its upstream after the job was created and charged:
            # a 503/504 that says nothing about whether the request was taken.
            with self.lock:
                self.gateway_errors += 1
            status = draw.gateway_error_status
            raise SimError(status, "gateway_error", f"upstream timed out ({status})")
        return 201, view

    def job(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise SimError(404, "not_found", f"no job {job_id}")
        return job

    def get(self, job_id: str) -> dict[str, Any]:
        with self.lock:
            job, now = self.job(job_id), time.monotonic()
            if job.gone(now, job.profile.forget_after_seconds):
                raise SimError(404, "not_found", f"no job {job_id} (records are kept for a limited time)")
            view = self.view(job, now)
            slow = job.draw.slow
        if slow:
            time.sleep(job.profile.slow_seconds)
        return view

    def find(self, key: str) -> dict[str, Any]:
        with self.lock:
            if self.config.mode == "none":
                raise SimError(501, "not_implemented", "this vendor cannot look jobs up by idempotency key")
            now = time.monotonic()
            # A search by the key stored with each job: it finds jobs whose key the dedup index forgot.
            return {"jobs": [self.view(job, now) for job in self.by_key.get(key, [])]}

    def cancel(self, job_id: str) -> dict[str, Any]:
        with self.lock:
            job, now = self.job(job_id), time.monotonic()
            status, progress = job.state(now)
            if status in ("succeeded", "failed"):
                raise SimError(409, "already_finished", f"job {job_id} is {status}", job=self.view(job, now))
            if status == "running":
                job.cancelled_progress = progress  # the charge stays: the vendor already billed at acceptance
            return self.view(job, now)

    def result(self, job_id: str) -> Output:
        with self.lock:
            job, now = self.job(job_id), time.monotonic()
            status, _ = job.state(now)
            if status != "succeeded" or job.output is None:
                raise SimError(409, "not_ready", f"job {job_id} is {status}")
            if job.gone(now, job.profile.purge_after_seconds):
                raise SimError(404, "purged", f"the output of job {job_id} was purged")
            out = job.output
        if job.draw.corrupt:
            return Output(out.data[:-1] + bytes([out.data[-1] ^ 1]), out.media, out.content_type)
        return out

    def download_habits(self, job_id: str) -> ExecutorProfile | None:
        """The profile of the job whose result is being downloaded (None: no such job, or an image file)."""
        with self.lock:
            job = self.jobs.get(job_id)
            return job.profile if job is not None else None

    def cdn_file(self, file_id: str, authorization: str | None) -> Output:
        """A file on the CDN: a job's result, or an image; a request carrying a credential is a leak."""
        with self.lock:
            if authorization:
                self.leaks.append({"file": file_id, "authorization": authorization[:12] + "…"})
            stored = self.files.get(file_id)
        return stored if stored is not None else self.result(file_id)

    def record_chat(self, prompt_tokens: int, completion_tokens: int) -> None:
        with self.lock:
            self.chat_["calls"] += 1
            self.chat_["prompt_tokens"] += prompt_tokens
            self.chat_["completion_tokens"] += completion_tokens

    def chat_stats(self) -> dict[str, int]:
        with self.lock:
            return dict(self.chat_)
