"""A vendor simulator: a paid "submit, then poll" generation API with seeded faults, served over real HTTP.

It charges at acceptance, can charge and then drop the response, rate-limits, fails, hangs and serves
artifacts with a sha256 and media metadata (format, duration, size and rights: what was asked for, unless a
fault says otherwise), so workers and the reconciler are tested against the failure modes that cost money.
It also answers OpenAI-style chat completions from a script, for the LLM decision and review calls.

Every outcome is drawn from ``random.Random(f"{seed}:{key}:{attempt}")``: the same workload gives the same
outcomes whatever the interleaving of requests, and again after ``POST /admin/reset``. ``rate_limit`` and
``server_error`` refuse any POST before it is looked at (nothing is charged); ``drop_response`` only hits a
POST that creates a job, so in "idempotent" mode resubmitting the key adopts the charged job.

Run it with ``python -m vendors.simulator --port 8700 [--config sim.json] [--seed 7]``, or in-process with
``BackgroundSimulator`` (tests).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

QUANTUM = Decimal("0.0001")
DEFAULT_CHAT = '{"verdict": "pass", "scores": {"overall": 0.9}, "reasons": []}'

Rate = Annotated[float, Field(ge=0, le=1)]


class ExecutorProfile(BaseModel):
    """How one executor behaves: latency, price and the probability of each fault."""

    model_config = ConfigDict(extra="forbid")

    latency_seconds: float = Field(default=0.0, ge=0)
    cost: Decimal | None = Field(default=None, ge=0, description="None charges the request's estimate")
    cost_multiplier: Decimal = Field(default=Decimal(1), ge=0)
    fail_technical: Rate = 0.0
    reject_content: Rate = 0.0
    drop_response: Rate = 0.0
    rate_limit: Rate = 0.0
    server_error: Rate = 0.0
    hang: Rate = 0.0
    corrupt_result: Rate = Field(
        default=0.0, description="serve bytes that do not match the advertised sha256"
    )
    bad_media: Rate = Field(
        default=0.0,
        description="deliver media outside what was asked: format gif, duration doubled, width/height halved",
    )
    missing_rights: Rate = Field(default=0.0, description="report no rights metadata with the artifact")


class ChatRule(BaseModel):
    """Answer ``content`` when ``match`` occurs in the last user message (and, below 1, a seeded draw hits).

    The draw comes from ``(seed, match, message)``: the same question always gets the same answer, and
    different questions (another task's goal, a new version of a part) meet the rate independently.
    """

    match: str
    content: str
    rate: Rate = 1.0

    def applies(self, seed: int, message: str) -> bool:
        if self.match not in message:
            return False
        return self.rate >= 1 or random.Random(f"{seed}:{self.match}:{message}").random() < self.rate


class SimConfig(BaseModel):
    """The whole simulator configuration; replaceable at runtime with ``PUT /admin/config``."""

    model_config = ConfigDict(extra="forbid")

    seed: int = 0
    default: ExecutorProfile = Field(default_factory=ExecutorProfile)
    executors: dict[str, ExecutorProfile] = Field(default_factory=dict)
    mode: Literal["idempotent", "lookup_only", "none"] = "idempotent"
    chat_script: list[ChatRule] = Field(default_factory=list)
    chat_default: str = DEFAULT_CHAT
    # The chat endpoint's own faults: answer every call with this HTTP status (an outage), and take this long
    # to answer (a slow model). Off by default.
    chat_error_status: int | None = Field(default=None, ge=400, le=599)
    chat_latency_seconds: float = Field(default=0.0, ge=0)

    def profile(self, executor: str) -> ExecutorProfile:
        return self.executors.get(executor, self.default)


class JobRequest(BaseModel):
    """Body of ``POST /jobs``; two requests are "the same body" when these compare equal."""

    executor: str
    input: dict[str, Any]
    estimate: Decimal = Field(ge=0)


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


def money(amount: Decimal) -> str:
    return str(amount.quantize(QUANTUM))


@dataclass(frozen=True)
class Draw:
    """The fate of one POST /jobs attempt, drawn before anything else happens."""

    rate_limited: bool
    server_error: bool
    dropped: bool
    hang: bool
    failure: Literal["technical", "content_rejected"] | None
    corrupt: bool
    fail_at: float  # fraction of the latency at which a failing job fails
    bad_media: bool = False
    missing_rights: bool = False

    @classmethod
    def for_attempt(cls, seed: int, key: str, attempt: int, p: ExecutorProfile) -> Draw:
        rng = random.Random(f"{seed}:{key}:{attempt}")
        # Always draw every number in the same order, so changing one rate never shifts the others' outcomes.
        # Rates added later draw after the first eight, so every outcome seeded before them stays the same.
        u = [rng.random() for _ in range(10)]
        failure: Literal["technical", "content_rejected"] | None = None
        if u[4] < p.fail_technical:
            failure = "technical"
        elif u[5] < p.reject_content:
            failure = "content_rejected"
        return cls(
            rate_limited=u[0] < p.rate_limit,
            server_error=u[1] < p.server_error,
            dropped=u[2] < p.drop_response,
            hang=u[3] < p.hang,
            failure=failure,
            corrupt=u[6] < p.corrupt_result,
            fail_at=0.1 + 0.8 * u[7],
            bad_media=u[8] < p.bad_media,
            missing_rights=u[9] < p.missing_rights,
        )


@dataclass
class Job:
    """One accepted (and charged) job; its status is a function of the monotonic clock."""

    id: str
    key: str
    request: JobRequest
    cost: Decimal
    latency: float
    draw: Draw
    accepted_at: float
    cancelled_progress: float | None = None
    artifact: bytes = field(init=False)

    def __post_init__(self) -> None:
        # Derived from key and input only, so duplicate jobs of one request yield identical artifacts.
        payload = {
            "idempotency_key": self.key,
            "executor": self.request.executor,
            "input": self.request.input,
        }
        self.artifact = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()

    def media(self) -> dict[str, Any]:
        """What the vendor reports it delivered: what the request asked for, unless this job's draw says not.

        Kept apart from the artifact bytes (those depend on key and input only), as real vendors report it.
        """
        asked = self.request.input
        fmt = asked.get("format") if isinstance(asked.get("format"), str) else "json"
        duration, width, height = (
            _number(asked.get("duration_s")),
            _whole(asked.get("width")),
            _whole(asked.get("height")),
        )
        if self.draw.bad_media:
            fmt = "gif"
            duration = duration * 2 if duration is not None else None
            width = width // 2 if width is not None else None
            height = height // 2 if height is not None else None
        rights = None
        if not self.draw.missing_rights:
            rights = {"license": "sim-commercial-1.0", "holder": f"simulator/{self.request.executor}"}
        return {"format": fmt, "duration_s": duration, "width": width, "height": height, "rights": rights}

    def state(self, now: float) -> tuple[str, float]:
        if self.cancelled_progress is not None:
            return "cancelled", self.cancelled_progress
        if self.draw.hang:
            return "running", 0.0
        ends_at = self.latency * (self.draw.fail_at if self.draw.failure else 1.0)
        elapsed = now - self.accepted_at
        if elapsed < ends_at:
            return "running", round(elapsed / self.latency, 4)
        if self.draw.failure:
            return "failed", round(self.draw.fail_at if self.latency else 0.0, 4)
        return "succeeded", 1.0

    def view(self, now: float) -> dict[str, Any]:
        status, progress = self.state(now)
        error = None
        if status == "failed":
            message = (
                "executor crashed" if self.draw.failure == "technical" else "input violates content policy"
            )
            error = {"kind": self.draw.failure, "message": message}
        result = None
        if status == "succeeded":
            digest = hashlib.sha256(self.artifact).hexdigest()
            result = {
                "url": f"/jobs/{self.id}/result",
                "sha256": digest,
                "size": len(self.artifact),
                "media": self.media(),
            }
        return {
            "id": self.id,
            "status": status,
            "progress": progress,
            "idempotency_key": self.key,
            "executor": self.request.executor,
            "cost": money(self.cost),
            "error": error,
            "result": result,
        }


class SimState:
    """Jobs, charges and chat counters behind one lock (handlers run on uvicorn's thread pool)."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self.reset()

    def configure(self, config: SimConfig) -> None:
        with self._lock:
            self.config = config

    def reset(self) -> None:
        with self._lock:
            self._jobs: dict[str, Job] = {}
            self._by_key: dict[str, list[Job]] = defaultdict(list)
            self._attempts: dict[str, int] = defaultdict(int)
            self._charges: list[dict[str, Any]] = []
            self._chat = {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0}

    def submit(self, key: str, req: JobRequest) -> tuple[int, dict[str, Any]]:
        """Accept (201), replay (200) or refuse one POST /jobs; returns the status code and the job."""
        with self._lock:
            cfg, now = self.config, time.monotonic()
            attempt = self._attempts[key]
            self._attempts[key] += 1
            profile = cfg.profile(req.executor)
            draw = Draw.for_attempt(cfg.seed, key, attempt, profile)
            if draw.rate_limited:
                raise SimError(429, "rate_limited", "too many requests", headers={"Retry-After": "1"})
            if draw.server_error:
                raise SimError(500, "server_error", "internal error; nothing was accepted")
            if cfg.mode == "idempotent" and self._by_key.get(key):
                job = self._by_key[key][0]
                if job.request != req:
                    raise SimError(
                        409, "idempotency_conflict", "Idempotency-Key already used with another body"
                    )
                return 200, job.view(now)
            base_cost = profile.cost if profile.cost is not None else req.estimate
            cost = (base_cost * profile.cost_multiplier).quantize(QUANTUM)
            job_id = "job_" + hashlib.sha256(f"{cfg.seed}:{key}:{attempt}".encode()).hexdigest()[:20]
            job = Job(job_id, key, req, cost, profile.latency_seconds, draw, now)
            self._jobs[job_id] = job
            self._by_key[key].append(job)
            self._charges.append(
                {"idempotency_key": key, "job_id": job_id, "executor": req.executor, "amount": cost}
            )
            if draw.dropped:
                # The vendor's worst habit: the job exists and is charged, but the client never learns its id.
                raise SimError(502, "bad_gateway", "upstream connection reset")
            return 201, job.view(now)

    def _job(self, job_id: str) -> Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise SimError(404, "not_found", f"no job {job_id}")
        return job

    def get(self, job_id: str) -> dict[str, Any]:
        with self._lock:
            return self._job(job_id).view(time.monotonic())

    def find(self, key: str) -> dict[str, Any]:
        with self._lock:
            if self.config.mode == "none":
                raise SimError(501, "not_implemented", "this vendor cannot look jobs up by idempotency key")
            now = time.monotonic()
            return {"jobs": [job.view(now) for job in self._by_key.get(key, [])]}

    def cancel(self, job_id: str) -> dict[str, Any]:
        with self._lock:
            job, now = self._job(job_id), time.monotonic()
            status, progress = job.state(now)
            if status in ("succeeded", "failed"):
                raise SimError(409, "already_finished", f"job {job_id} is {status}", job=job.view(now))
            if status == "running":
                job.cancelled_progress = progress  # the charge stays: the vendor already billed at acceptance
            return job.view(now)

    def result(self, job_id: str) -> bytes:
        with self._lock:
            job = self._job(job_id)
            status, _ = job.state(time.monotonic())
            if status != "succeeded":
                raise SimError(409, "not_ready", f"job {job_id} is {status}")
            if job.draw.corrupt:
                return job.artifact[:-1] + bytes([job.artifact[-1] ^ 1])
            return job.artifact

    def charges(self) -> dict[str, Any]:
        with self._lock:
            rows = [{**c, "amount": money(c["amount"])} for c in self._charges]
            total = sum((c["amount"] for c in self._charges), Decimal(0))
            return {"charges": rows, "total": money(total), "count": len(rows)}

    def chat(self, body: ChatRequest) -> dict[str, Any]:
        cfg = self.config
        if cfg.chat_latency_seconds:
            time.sleep(cfg.chat_latency_seconds)  # on uvicorn's thread pool: other requests go on meanwhile
        if cfg.chat_error_status is not None:
            with self._lock:
                self._chat["calls"] += 1  # a refused call is still a call (nothing is billed for it)
            raise SimError(cfg.chat_error_status, "chat_unavailable", "the model is unavailable")
        texts = [_text(m.content) for m in body.messages]
        last_user = next((_text(m.content) for m in reversed(body.messages) if m.role == "user"), "")
        with self._lock:
            rule = next((r for r in cfg.chat_script if r.applies(cfg.seed, last_user)), None)
            content = rule.content if rule else cfg.chat_default
            prompt_tokens = sum(_tokens(t) for t in texts)
            completion_tokens = _tokens(content)
            self._chat["calls"] += 1
            self._chat["prompt_tokens"] += prompt_tokens
            self._chat["completion_tokens"] += completion_tokens
        digest = hashlib.sha256(json.dumps([body.model, texts]).encode()).hexdigest()[:24]
        return {
            "id": f"chatcmpl-{digest}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def chat_stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._chat)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    response_format: dict[str, Any] | None = None


def _number(value: Any) -> float | None:
    """A number the request asked for (never a bool), else None: nothing usable was asked."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _whole(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(part.get("text", "")) for part in content)
    return content or ""


def _tokens(text: str) -> int:
    return len(text) // 4 + 1


def _require_bearer(authorization: str | None = Header(default=None)) -> None:
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise SimError(401, "unauthorized", "missing bearer token", headers={"WWW-Authenticate": "Bearer"})


def create_app(config: SimConfig | None = None) -> FastAPI:
    """Build the simulator app; its state lives in the returned app (``app.state.sim``)."""
    state = SimState(config or SimConfig())
    app = FastAPI(title="ledgerflow vendor simulator")
    app.state.sim = state

    @app.exception_handler(SimError)
    def sim_error(_request: Request, exc: SimError) -> JSONResponse:
        return exc.response()

    api = APIRouter(dependencies=[Depends(_require_bearer)])

    @api.post("/jobs")
    def submit(req: JobRequest, idempotency_key: str | None = Header(default=None)) -> JSONResponse:
        if not idempotency_key:
            raise SimError(400, "missing_idempotency_key", "the Idempotency-Key header is required")
        status, body = state.submit(idempotency_key, req)
        return JSONResponse(body, status_code=status)

    @api.get("/jobs")
    def find(idempotency_key: str) -> dict[str, Any]:
        return state.find(idempotency_key)

    @api.get("/jobs/{job_id}")
    def get(job_id: str) -> dict[str, Any]:
        return state.get(job_id)

    @api.get("/jobs/{job_id}/result")
    def result(job_id: str) -> Response:
        return Response(state.result(job_id), media_type="application/json")

    @api.post("/jobs/{job_id}/cancel")
    def cancel(job_id: str) -> dict[str, Any]:
        return state.cancel(job_id)

    @api.post("/v1/chat/completions")
    def chat(body: ChatRequest) -> dict[str, Any]:
        return state.chat(body)

    # Inspection and control hooks: unauthenticated, they are the test harness's view, not the vendor's API.
    @app.get("/healthz")
    def healthz() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/charges")
    def charges() -> dict[str, Any]:
        return state.charges()

    @app.get("/chat/stats")
    def chat_stats() -> dict[str, int]:
        return state.chat_stats()

    @app.get("/admin/config")
    def get_config() -> SimConfig:
        return state.config

    @app.put("/admin/config")
    def put_config(new: SimConfig) -> SimConfig:
        state.configure(new)
        return new

    @app.post("/admin/reset")
    def reset() -> dict[str, bool]:
        state.reset()
        return {"ok": True}

    app.include_router(api)
    return app


def serve(host: str = "127.0.0.1", port: int = 8700, config: SimConfig | None = None) -> None:
    """Serve the simulator with uvicorn until interrupted (blocks)."""
    uvicorn.run(create_app(config), host=host, port=port, log_level="info")


class BackgroundSimulator:
    """The simulator served by real uvicorn on a daemon thread, bound to a free port.

    ``start()`` returns once uvicorn reports ``started``; then ``url`` is the base URL. A context manager too.
    """

    def __init__(self, config: SimConfig | None = None, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = create_app(config)
        # Bind before starting so the port is known up front and no other process can take it meanwhile.
        # IPPROTO_TCP explicitly: asyncio only sets TCP_NODELAY on accepted sockets whose proto says TCP, and
        # proto 0 costs every request a 40 ms Nagle / delayed-ACK stall.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.url = f"http://{host}:{self._socket.getsockname()[1]}"
        uv_config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(uv_config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="vendor-simulator", daemon=True
        )

    def start(self, timeout: float = 10.0) -> BackgroundSimulator:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"vendor simulator did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._socket.close()

    def __enter__(self) -> BackgroundSimulator:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve the ledgerflow vendor simulator.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8700)
    parser.add_argument("--config", type=Path, help="a SimConfig JSON file")
    parser.add_argument("--seed", type=int, help="overrides the config's seed")
    args = parser.parse_args(argv)
    config = SimConfig.model_validate_json(args.config.read_text()) if args.config else SimConfig()
    if args.seed is not None:
        config = config.model_copy(update={"seed": args.seed})
    serve(args.host, args.port, config)


if __name__ == "__main__":
    main()
