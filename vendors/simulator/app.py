"""The simulator's HTTP surface: the vendor API (jobs, billing, chat), a CDN on a second port, admin hooks.

Vendor endpoints need a bearer key (any non-empty one, or one of ``accepted_keys`` after a rotation). The CDN
serves result files without authentication, the way real vendors serve outputs from another host, and it
records every request that arrives *with* a credential (``GET /admin/leaks``): a client must never send the
vendor's key there. ``/charges``, ``/chat/stats`` and ``/admin/*`` are the test harness's view (no key).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vendors.simulator.chat import chat, images
from vendors.simulator.config import SimConfig
from vendors.simulator.outputs import Output
from vendors.simulator.predictions import PredictionRequest, PredictionsApi
from vendors.simulator.queue import QueueApi
from vendors.simulator.state import UPLOADS, JobRequest, SimError, SimState

DRIP_BYTES = 16  # what a dripping download sends at a time


def create_app(state: SimState) -> FastAPI:
    """The vendor API over ``state``."""
    app = FastAPI(title="ledgerflow vendor simulator")
    app.state.sim = state
    predictions = PredictionsApi(state)
    queue = QueueApi.of(state)

    @app.exception_handler(SimError)
    def sim_error(_request: Request, exc: SimError) -> JSONResponse:
        return exc.response()

    def authenticated(authorization: str | None = Header(default=None)) -> None:
        state.authenticate(authorization)

    api = APIRouter(dependencies=[Depends(authenticated)])

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
        return deliver(state, job_id, lambda: state.result(job_id), redirect=True)

    @api.post("/jobs/{job_id}/cancel")
    def cancel(job_id: str) -> dict[str, Any]:
        return state.cancel(job_id)

    @api.get("/billing/charges")
    def billing(
        job_id: str | None = None,
        idempotency_key: str | None = None,
        since: datetime | None = None,
        cursor: str | None = None,
        limit: int = Query(default=100, ge=1, le=1000),
    ) -> dict[str, Any]:
        if job_id is not None or idempotency_key is not None:
            return state.billing(job_id, idempotency_key)
        # No filter: the account's billing listing (the jobs API's charges), a page at a time.
        rows, nxt = state.listing("jobs", since, cursor, limit)
        charges = [
            {
                "job_id": c["job_id"],
                "idempotency_key": c["idempotency_key"],
                "amount": c["amount"],
                "created_at": _iso(c["at"]),
            }
            for c in rows
        ]
        return {"charges": charges, "next": nxt}

    def base_of(request: Request) -> str:
        return str(request.base_url).rstrip("/")

    @api.post("/v1/predictions")
    async def create_prediction(body: PredictionRequest, request: Request) -> Response:
        # Async only to learn the server's event loop, where webhook callbacks run; the work itself (which
        # fetches inputs and may sleep) stays on the thread pool.
        predictions.webhooks.bind(asyncio.get_running_loop())
        view = await run_in_threadpool(predictions.create, body, base_of(request))
        return _raw_json(view, status_code=201)

    @api.get("/v1/predictions")
    def list_predictions(
        request: Request,
        cursor: str | None = Query(default=None),
        created_after: datetime | None = Query(default=None),
        created_before: datetime | None = Query(default=None),
    ) -> Response:
        return _raw_json(predictions.list(base_of(request), cursor, created_after, created_before))

    @api.get("/v1/predictions/{prediction_id}")
    def get_prediction(prediction_id: str, request: Request) -> Response:
        return _raw_json(predictions.get(prediction_id, base_of(request)))

    @api.post("/v1/predictions/{prediction_id}/cancel")
    def cancel_prediction(prediction_id: str, request: Request) -> Response:
        return _raw_json(predictions.cancel(prediction_id, base_of(request)))

    # Replicate's Files API: an input file uploaded first, for a route with ``inputs: upload``. Its URL is
    # read back by the simulator itself when a request names it (state.UPLOADS).
    @api.post("/v1/files")
    async def upload_file(request: Request) -> dict[str, Any]:
        async with request.form() as form:
            content = form.get("content")
            if content is None or isinstance(content, str):
                raise SimError(400, "invalid", "a multipart field 'content' holding the file is required")
            data = await content.read()
        fid = hashlib.sha256(data).hexdigest()[:24]
        UPLOADS[fid] = data
        url = f"{base_of(request)}/v1/files/{fid}"
        return {"id": fid, "size": len(data), "urls": {"get": url}}

    @api.get("/v1/files/{file_id}")
    def get_file(file_id: str) -> Response:
        data = UPLOADS.get(file_id)
        if data is None:
            raise SimError(404, "not_found", f"no file {file_id}")
        return Response(data, media_type="application/octet-stream")

    @api.get("/v1/webhooks/default/secret")
    def webhook_secret() -> dict[str, str]:
        """Replicate's signing secret for the account's webhooks (``{"key": "whsec_…"}``)."""
        habits = state.config.webhooks
        if habits is None:
            raise SimError(404, "not_found", "no webhook signing secret is configured")
        return {"key": habits.secret}

    # OpenAI's dialect (vendors/simulator/chat.py): the raw body is checked there, as the API checks it, so
    # that a malformed request is OpenAI's 400 (not FastAPI's 422); the work runs on the thread pool.
    @api.post("/v1/chat/completions")
    async def chat_completion(
        request: Request, x_client_request_id: str | None = Header(default=None)
    ) -> Response:
        raw = await request.body()
        return _raw_json(await run_in_threadpool(chat, state, raw, x_client_request_id))

    @api.post("/v1/images/generations")
    async def image_generation(
        request: Request, x_client_request_id: str | None = Header(default=None)
    ) -> Response:
        raw = await request.body()
        return _raw_json(await run_in_threadpool(images, state, raw, x_client_request_id))

    # The queue dialect (vendors/simulator/queue.py, fal.ai's Queue API): the body is the model's input.
    @api.post("/queue/submit")
    async def queue_submit(request: Request, fal_webhook: str | None = Query(default=None)) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise SimError(422, "invalid_input", "the body must be a JSON object", detail="invalid input")
        answer = await run_in_threadpool(queue.submit, body, fal_webhook, base_of(request))
        return _raw_json(answer, status_code=202)

    @api.get("/queue/requests/{request_id}/status")
    def queue_status(request_id: str, request: Request) -> Response:
        return _raw_json(queue.status(request_id, base_of(request)))

    @api.get("/queue/requests/{request_id}")
    def queue_result(request_id: str) -> Response:
        return _raw_json(queue.result(request_id))

    @api.put("/queue/requests/{request_id}/cancel")
    def queue_cancel(request_id: str) -> Response:
        status, body = queue.cancel(request_id)
        return _raw_json(body, status_code=status)

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

    @app.get("/admin/leaks")
    def leaks() -> dict[str, Any]:
        with state.lock:
            return {"leaks": list(state.leaks), "count": len(state.leaks)}

    @app.get("/admin/stats")
    def stats() -> dict[str, int]:
        with state.lock:
            return {
                "conflicts": state.conflicts,
                "leaks": len(state.leaks),
                "dropped": state.dropped,
                "gateway_errors": state.gateway_errors,
            }

    @app.get("/admin/webhooks")
    def webhooks() -> list[dict[str, Any]]:
        """Every webhook delivery attempt of the predictions dialect, in order."""
        with state.lock:
            return [dict(row) for row in state.webhooks]

    @app.get("/admin/jobs/{job_id}")
    def job_request(job_id: str) -> dict[str, Any]:
        """What a job was asked for, as the vendor received it (the harness checks an input conversion)."""
        with state.lock:
            job = state.jobs.get(job_id)
            if job is None:
                raise SimError(404, "not_found", f"no job {job_id}")
            return job.request.model_dump(mode="json", exclude={"input_urls"})

    @app.post("/admin/charges")
    def inject_charge(body: dict[str, str]) -> dict[str, bool]:
        """A charge nobody made: ``{protocol: jobs|predictions, job_id, idempotency_key?, amount}``."""
        state.inject_charge(
            body.get("protocol", "jobs"), body["job_id"], body.get("idempotency_key"), body["amount"]
        )
        return {"ok": True}

    @app.post("/admin/credits")
    def credit(body: dict[str, str]) -> dict[str, Any]:
        """The vendor refunds a job's charge (``{job_id, amount?}``): a negative line in the listings."""
        return state.credit(body["job_id"], body.get("amount"))

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
        predictions.webhooks.wake_all()  # pending callbacks find their predictions gone and end
        return {"ok": True}

    app.include_router(api)
    return app


def _raw_json(body: Any, status_code: int = 200) -> Response:
    """A body as JSON where an odd figure may be a bare NaN or Infinity, as a sloppy vendor sends it."""
    return Response(json.dumps(body, allow_nan=True), status_code=status_code, media_type="application/json")


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat()


def create_cdn_app(state: SimState) -> FastAPI:
    """Result files on another origin, unauthenticated; a request carrying a credential is a leak."""
    app = FastAPI(title="ledgerflow simulator CDN")

    @app.exception_handler(SimError)
    def sim_error(_request: Request, exc: SimError) -> JSONResponse:
        return exc.response()

    @app.get("/files/{job_id}")
    def file(job_id: str, authorization: str | None = Header(default=None)) -> Response:
        return deliver(state, job_id, lambda: state.cdn_file(job_id, authorization), redirect=False)

    @app.get("/predictions/{prediction_id}/{name}")
    def prediction_file(
        prediction_id: str, name: str, authorization: str | None = Header(default=None)
    ) -> Response:
        # Replicate's output files need the API token ("You'll need to pass the Authorization header").
        state.authenticate(authorization)
        out = PredictionsApi(state).file(prediction_id)
        return Response(out.data, media_type=out.content_type)

    @app.get("/queue-files/{request_id}/{name}")
    def queue_file(request_id: str, name: str, authorization: str | None = Header(default=None)) -> Response:
        out = QueueApi.of(state).file(request_id, authorization)
        return Response(out.data, media_type=out.content_type)

    return app


def deliver(state: SimState, job_id: str, output: Callable[[], Output], *, redirect: bool) -> Response:
    """A job's result as its profile's download habits serve it: refused (``download_status``), redirected
    (``result_redirect``, by the API only), dripped (``drip_seconds``) or plainly."""
    habits = state.download_habits(job_id)
    if habits is not None and habits.download_status is not None:
        status = habits.download_status
        raise SimError(status, "download_refused", f"the result of job {job_id} is refused ({status})")
    if redirect and habits is not None and habits.result_redirect is not None:
        cdn = (state.cdn_base or "").removeprefix("http://")
        location = habits.result_redirect.format(cdn=cdn, job=job_id)
        return Response(status_code=302, headers={"Location": location})
    out = output()
    if habits is not None and habits.drip_seconds > 0:
        return StreamingResponse(_drip(out.data, habits.drip_seconds), media_type=out.content_type)
    return Response(out.data, media_type=out.content_type)


async def _drip(data: bytes, every: float) -> AsyncIterator[bytes]:
    for i in range(0, len(data), DRIP_BYTES):
        yield data[i : i + DRIP_BYTES]
        await asyncio.sleep(every)
