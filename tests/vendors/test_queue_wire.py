"""The ``queue`` adapter's wire details (``vendors/queue.py``, fal.ai's Queue API), on real HTTP.

Against the simulator's queue dialect (``vendors/simulator/queue.py``): the status words mapped, the result's
URL downloaded through ``HttpVendor``'s safe download (no key to the CDN), a cancel of a running and of a
finished request, a FAILED request with a content error, the refusals classified as every adapter's are, and
what the API cannot do (no lookup, no billing). Then, over a mock transport, fal's own shapes: its paths and
``Authorization: Key`` set by the route alone, a result that is the model's output (``images[0].url``) with no
cost, a COMPLETED that carries an error, a word the adapter does not know.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from vendors.adapter import JobErrorKind, JobStatus, VendorJob
from vendors.errors import (
    VendorAuthError,
    VendorBadResponse,
    VendorCannotTell,
    VendorNotFound,
    VendorRateLimited,
    VendorUnavailable,
)
from vendors.queue import QueueAdapter, first_url
from vendors.routes import RouteSpec, RouteTable, with_simulator_cdn
from vendors.simulator.queue import APP

if TYPE_CHECKING:
    from tests.vendors.conftest import SimAdmin

API_KEY = "sk-test-4f1c9e"  # tests/vendors/conftest.py's: the simulator's key in these tests
REQUEST: dict[str, Any] = {"prompt": "a lighthouse at dusk", "format": "png", "width": 64, "height": 64}
HOOK = "https://hooks.ledgerflow.test/q?operation_key={operation_key}"


def route(simulator_url: str, **fields: Any) -> RouteSpec:
    """A queue route on the simulator, its CDN allow-listed as a dev deployment's is (without the key)."""
    spec = RouteSpec.model_validate(
        {"adapter": "queue", "timeouts": {"request": 3.0}, "webhook_url": HOOK, **fields}
    )
    return with_simulator_cdn(RouteTable(routes={"r": spec}), simulator_url).routes["r"]


@pytest.fixture
async def queue(sim: SimAdmin) -> AsyncIterator[QueueAdapter]:
    async with httpx.AsyncClient() as client:
        yield QueueAdapter(route(sim.url), sim.url, API_KEY, client=client)


async def vendor(sim: SimAdmin, **profile: Any) -> None:
    await sim.configure(executors={APP: profile})


async def submit(adapter: QueueAdapter, op: str | None = None) -> VendorJob:
    return await adapter.submit(
        operation_key=op or f"op-{uuid.uuid4().hex[:10]}",
        executor="image.queue",
        request=dict(REQUEST),
        estimate=Decimal("0.10"),
    )


async def until_done(adapter: QueueAdapter, job_id: str, within: float = 5.0) -> VendorJob:
    for _ in range(int(within / 0.05)):
        job = await adapter.get(job_id)
        if job.status.terminal:
            return job
        await asyncio.sleep(0.05)
    pytest.fail(f"request {job_id} still running after {within}s")


async def status_word(sim: SimAdmin, job_id: str) -> str:
    response = await sim.client.get(f"/queue/requests/{job_id}/status")
    response.raise_for_status()
    word: str = response.json()["status"]
    return word


# ── against the simulator ─────────────────────────────────────────────────────────────────────────────────
async def test_a_request_runs_to_its_result_downloaded_without_the_key(sim: SimAdmin, queue: QueueAdapter):
    await vendor(sim, latency_seconds=0.2)
    op = f"op-{uuid.uuid4().hex[:10]}"
    job = await submit(queue, op)
    assert job.status == JobStatus.RUNNING and job.result is None
    done = await until_done(queue, job.id)
    assert done.status == JobStatus.SUCCEEDED and done.result is not None
    assert (done.cost, done.seconds) == ("0.0600", 0.2), "the cost as stated, the inference time as seconds"
    chunks: list[bytes] = []
    await queue.download(done, chunks.append)
    assert b"".join(chunks).startswith(b"\x89PNG\r\n\x1a\n")
    leaks = (await sim.client.get("/admin/leaks")).json()
    assert leaks["count"] == 0, "the key never goes to the CDN"
    # Billed once, under the OperationKey the webhook URL carried (the vendor knows it by nothing else).
    [charge] = [c for c in (await sim.charges())["charges"] if c["job_id"] == job.id]
    assert (charge["idempotency_key"], charge["amount"], charge["protocol"]) == (op, "0.0600", "queue")


async def test_status_words_map_to_running_and_the_queue_position_to_progress_zero(
    sim: SimAdmin, queue: QueueAdapter
):
    await vendor(sim, hang=1.0)  # never leaves the queue
    waiting = await submit(queue)
    assert await status_word(sim, waiting.id) == "IN_QUEUE"
    assert (await queue.get(waiting.id)).model_dump(include={"status", "progress"}) == {
        "status": JobStatus.RUNNING,
        "progress": 0.0,
    }
    await vendor(sim, latency_seconds=3.0)
    working = await submit(queue)
    await asyncio.sleep(0.5)
    assert await status_word(sim, working.id) == "IN_PROGRESS"
    job = await queue.get(working.id)
    assert (job.status, job.progress, job.cost) == (JobStatus.RUNNING, None, None), "no cost while running"


async def test_cancel_stops_a_running_request_and_returns_a_finished_one_as_it_ended(
    sim: SimAdmin, queue: QueueAdapter
):
    await vendor(sim, latency_seconds=5.0)
    running = await submit(queue)
    cancelled = await queue.cancel(running.id)
    assert cancelled.status == JobStatus.CANCELLED and await status_word(sim, running.id) == "CANCELLED"
    await vendor(sim, latency_seconds=0.05)
    finished = await until_done(queue, (await submit(queue)).id)
    raw = await sim.client.put(f"/queue/requests/{finished.id}/cancel")
    assert (raw.status_code, raw.json()) == (400, {"status": "ALREADY_COMPLETED"})
    again = await queue.cancel(finished.id)
    assert again.status == JobStatus.SUCCEEDED and again.result == finished.result, "too late is no error"


async def test_a_failed_request_with_a_content_error_is_content_rejected(sim: SimAdmin, queue: QueueAdapter):
    await vendor(sim, latency_seconds=0.05, reject_content=1.0)
    failed = await until_done(queue, (await submit(queue)).id)
    assert failed.status == JobStatus.FAILED and failed.error is not None
    assert failed.error.kind == JobErrorKind.CONTENT_REJECTED and "content policy" in failed.error.message
    assert failed.result is None and failed.seconds is not None
    await vendor(sim, latency_seconds=0.05, fail_technical=1.0)
    crashed = await until_done(queue, (await submit(queue)).id)
    assert crashed.error is not None and crashed.error.kind == JobErrorKind.TECHNICAL


async def test_refusals_are_classified_as_every_adapter_classifies_them(sim: SimAdmin, queue: QueueAdapter):
    await vendor(sim, rate_limit=1.0)
    with pytest.raises(VendorRateLimited) as limited:
        await submit(queue)
    assert limited.value.refused and limited.value.retry_after == 1.0
    for status in (500, 503):
        await vendor(sim, server_error=1.0, server_error_status=status)
        with pytest.raises(VendorUnavailable) as unavailable:
            await submit(queue)
        assert not unavailable.value.refused, f"a {status} proves nothing: the request may have been taken"
    await sim.configure(executors={APP: {}}, accepted_keys=["sk-the-rotated-one"])
    with pytest.raises(VendorAuthError) as auth:
        await submit(queue)
    assert auth.value.refused and API_KEY not in str(auth.value)
    assert (await sim.charges())["count"] == 0, "nothing refused was billed"


async def test_a_lost_answer_cannot_be_found_again_and_there_is_no_billing_to_read(
    sim: SimAdmin, queue: QueueAdapter
):
    await vendor(sim, drop_response=1.0)
    op = f"op-{uuid.uuid4().hex[:10]}"
    with pytest.raises(VendorUnavailable):
        await submit(queue, op)
    assert [c["idempotency_key"] for c in (await sim.charges())["charges"]] == [op], "billed all the same"
    caps = queue.capabilities
    assert not (caps.can_lookup or caps.deduplicates or caps.has_billing or caps.can_list_charges)
    with pytest.raises(VendorCannotTell):
        await queue.find_by_key(op)
    assert await queue.charged(op, None) is None
    with pytest.raises(VendorCannotTell):
        await queue.charges(since=datetime.now(UTC))


async def test_a_purged_output_and_a_forgotten_request_are_not_found(sim: SimAdmin, queue: QueueAdapter):
    await vendor(sim, latency_seconds=0.05, purge_after_seconds=0)
    done = await until_done(queue, (await submit(queue)).id)
    with pytest.raises(VendorNotFound):
        await queue.download(done, lambda chunk: None)
    await vendor(sim, latency_seconds=0.05, forget_after_seconds=0)
    job = await submit(queue)
    await asyncio.sleep(0.2)
    with pytest.raises(VendorNotFound):
        await queue.get(job.id)


# ── fal's own shapes, over a mock transport ───────────────────────────────────────────────────────────────
FAL_PATHS = {
    "submit": "/fal-ai/flux/dev",
    "status": "/fal-ai/flux/requests/{job_id}/status",
    "result": "/fal-ai/flux/requests/{job_id}",
    "cancel": "/fal-ai/flux/requests/{job_id}/cancel",
}


def fal(answers: dict[tuple[str, str], tuple[int, Any]]) -> tuple[QueueAdapter, list[httpx.Request]]:
    """An adapter on https://queue.fal.run whose route sets fal's paths and key scheme, and what it sent."""
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        status, body = answers[(request.method, request.url.path)]
        return httpx.Response(status, json=body)

    spec = RouteSpec.model_validate(
        {
            "adapter": "queue",
            "base_url": "https://queue.fal.run",
            "auth": {"scheme": "header", "name": "Authorization", "prefix": "Key "},
            "paths": FAL_PATHS,
            "webhook_url": HOOK,
        }
    )
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return QueueAdapter(spec, "https://queue.fal.run", "fal-key-1", client=client), sent


async def test_fal_paths_key_and_webhook_come_from_the_route_alone():
    rid = "80e732af-660e-45cd-bd63-580e4f2a94cc"
    adapter, sent = fal(
        {
            ("POST", "/fal-ai/flux/dev"): (
                200,
                {"request_id": rid, "status": "IN_QUEUE", "queue_position": 3},
            ),
            ("GET", f"/fal-ai/flux/requests/{rid}/status"): (
                200,
                {"status": "COMPLETED", "metrics": {"inference_time": 1.5}},
            ),
            ("GET", f"/fal-ai/flux/requests/{rid}"): (
                200,
                {"images": [{"url": "https://v3.fal.media/files/x.png", "width": 64}], "seed": 7},
            ),
        }
    )
    job = await submit(adapter, "op/1 & more")
    assert (job.id, job.status) == (rid, JobStatus.RUNNING)
    post = sent[0]
    assert post.headers["Authorization"] == "Key fal-key-1"
    assert json.loads(post.content) == REQUEST, "the body is the model's input and nothing else"
    hook = post.url.params["fal_webhook"]
    assert hook == "https://hooks.ledgerflow.test/q?operation_key=op%2F1%20%26%20more"
    done = await adapter.get(rid)
    assert done.status == JobStatus.SUCCEEDED and done.result is not None
    assert done.result.url == "https://v3.fal.media/files/x.png"
    assert (done.cost, done.seconds) == (None, 1.5), "fal states no cost: the route prices the seconds"


async def test_a_completed_request_carrying_an_error_failed_and_unknown_words_are_unreadable():
    adapter, _ = fal(
        {
            ("GET", "/fal-ai/flux/requests/a/status"): (
                200,
                {"status": "COMPLETED", "error": "Request timed out", "error_type": "request_timeout"},
            ),
            ("GET", "/fal-ai/flux/requests/b/status"): (200, {"status": "EXPLODED"}),
            ("GET", "/fal-ai/flux/requests/d/status"): (200, {"status": "COMPLETED"}),
            ("GET", "/fal-ai/flux/requests/d"): (
                422,
                {"detail": [{"loc": ["body", "prompt"], "msg": "field required", "type": "missing"}]},
            ),
            ("GET", "/fal-ai/flux/requests/c/status"): (
                200,
                {"status": "COMPLETED", "error": "flagged", "error_type": "content_policy_violation"},
            ),
        }
    )
    failed = await adapter.get("a")
    assert failed.status == JobStatus.FAILED and failed.error is not None
    assert failed.error.kind == JobErrorKind.TECHNICAL
    rejected = await adapter.get("c")
    assert rejected.error is not None and rejected.error.kind == JobErrorKind.CONTENT_REJECTED
    with pytest.raises(VendorBadResponse):
        await adapter.get("b")
    # COMPLETED with no error: the result call answers it (422: the model refused the input).
    refused = await adapter.get("d")
    assert refused.status == JobStatus.FAILED and refused.error is not None
    assert refused.error.kind == JobErrorKind.CONTENT_REJECTED and "422" in refused.error.message


def test_the_output_url_is_found_in_the_shapes_models_return():
    assert first_url({"url": "https://x/a.png"}) == "https://x/a.png"
    assert first_url({"video": {"url": "https://x/v.mp4"}, "seed": 1}) == "https://x/v.mp4"
    assert (
        first_url({"images": [{"url": "https://x/1.png"}, {"url": "https://x/2.png"}]}) == "https://x/1.png"
    )
    assert first_url("https://x/raw.wav") == "https://x/raw.wav"
    assert first_url({"text": "no file here"}) is None
