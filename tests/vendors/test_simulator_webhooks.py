"""The simulator's Replicate dialect calls a prediction's webhook back when it ends, and misbehaves as told.

A small receiver of the test's own (Starlette under uvicorn, on a free port) stands in for the webhook's
public host (``rewrite_host``). Signatures are checked here by a few lines of hmac written for the test, as
the Standard Webhooks scheme says (https://www.standardwebhooks.com, and Replicate's
https://replicate.com/docs/topics/webhooks/verify-webhook): independent of any receiver in ledgerflow, so the
two cannot share a mistake.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import pydantic
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from vendors.simulator import _bind
from vendors.simulator.config import WebhookHabits

if TYPE_CHECKING:
    from tests.vendors.conftest import SimAdmin

VERSION = "acme/motion:5c7d5dc6dd8bf75c1acaa8565735e7986bc5b66206b55cca93cb72c9bf15ccaa"
SECRET = "whsec_" + base64.b64encode(b"simulator-webhook-test-key-0001").decode()
QUIET = 0.3  # how long "nothing more arrives" is watched for


@dataclass
class Delivery:
    at: float  # monotonic arrival time
    headers: dict[str, str]
    body: bytes
    path: str
    query: str

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Receiver:
    """Records every POST it gets; answers the queued statuses first, then 204."""

    url: str = ""
    deliveries: list[Delivery] = field(default_factory=list)
    answers: list[int] = field(default_factory=list)

    async def hook(self, request: Request) -> Response:
        body = await request.body()
        at = time.monotonic()
        self.deliveries.append(Delivery(at, dict(request.headers), body, request.url.path, request.url.query))
        return Response(status_code=self.answers.pop(0) if self.answers else 204)

    def to(self, path: str) -> list[Delivery]:
        return [d for d in self.deliveries if d.path == path]


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    recv = Receiver()
    sock = _bind("127.0.0.1", 0)
    recv.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    app = Starlette(routes=[Route("/{path:path}", recv.hook, methods=["POST"])])
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=lambda: asyncio.run(server.serve(sockets=[sock])), name="webhook-receiver", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the receiver did not start"
        time.sleep(0.01)
    try:
        yield recv
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()


@pytest.fixture
def path() -> str:
    """This test's webhook path: the receiver's deliveries are told apart by it."""
    return f"/replicate/{uuid.uuid4().hex[:12]}"


def verifies(secret: str, d: Delivery) -> bool:
    """Standard Webhooks: HMAC-SHA256 over "id.timestamp.body", keyed by the base64 after ``whsec_``."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{d.headers['webhook-id']}.{d.headers['webhook-timestamp']}.".encode() + d.body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    given = [s.partition(",")[2] for s in d.headers["webhook-signature"].split() if s.startswith("v1,")]
    return any(hmac.compare_digest(expected, s) for s in given)


async def configure(sim: SimAdmin, receiver: Receiver, latency: float, **habits: Any) -> None:
    await sim.configure(
        executors={VERSION: {"latency_seconds": latency}},
        webhooks={"secret": SECRET, "rewrite_host": receiver.url, **habits},
    )


async def create(sim: SimAdmin, path: str | None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"version": VERSION, "input": {"prompt": uuid.uuid4().hex}, **extra}
    if path is not None:
        body["webhook"] = f"https://hooks.example.com{path}?operation_key=op-{path.rsplit('/', 1)[-1]}"
    response = await sim.client.post("/v1/predictions", json=body)
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


async def arrivals(receiver: Receiver, path: str, count: int, timeout: float = 5.0) -> list[Delivery]:
    """The deliveries to ``path`` once ``count`` have arrived, and ``QUIET`` seconds passed with no more."""
    deadline = time.monotonic() + timeout
    while len(receiver.to(path)) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    await asyncio.sleep(QUIET)
    return receiver.to(path)


async def admin_rows(sim: SimAdmin) -> list[dict[str, Any]]:
    response = await sim.client.get("/admin/webhooks")
    response.raise_for_status()
    rows: list[dict[str, Any]] = response.json()
    return rows


async def get(sim: SimAdmin, pid: str) -> dict[str, Any]:
    response = await sim.client.get(f"/v1/predictions/{pid}")
    response.raise_for_status()
    answer: dict[str, Any] = response.json()
    return answer


async def test_a_completed_prediction_is_called_back_once_signed(
    sim: SimAdmin, receiver: Receiver, path: str
) -> None:
    await configure(sim, receiver, 0.2)
    started = time.monotonic()
    created = await create(sim, path)
    [d] = await arrivals(receiver, path, 1)
    assert d.at - started >= 0.2
    assert d.query == f"operation_key=op-{path.rsplit('/', 1)[-1]}"  # path and query kept, host rewritten
    assert d.headers["webhook-id"].startswith("msg_")
    assert abs(int(d.headers["webhook-timestamp"]) - time.time()) < 5
    assert d.headers["content-type"] == "application/json"
    assert verifies(SECRET, d)
    assert d.json() == await get(sim, created["id"])
    assert d.json()["status"] == "succeeded"
    [row] = await admin_rows(sim)
    assert row["webhook_id"] == d.headers["webhook-id"]
    assert row["url"] == receiver.url + path + "?" + d.query
    assert (row["status_code"], row["error"]) == (204, None)
    assert (row["forged"], row["early"], row["duplicate_of"], row["body_status"]) == (
        False,
        False,
        None,
        "succeeded",
    )


async def test_the_callback_waits_delay_seconds_after_completion(
    sim: SimAdmin, receiver: Receiver, path: str
) -> None:
    await configure(sim, receiver, 0.1, delay_seconds=0.2)
    started = time.monotonic()
    await create(sim, path)
    [d] = await arrivals(receiver, path, 1)
    assert d.at - started >= 0.3


async def test_a_filter_without_completed_gets_no_completed_delivery(
    sim: SimAdmin, receiver: Receiver, path: str
) -> None:
    await configure(sim, receiver, 0.1)
    created = await create(sim, path, webhook_events_filter=["start"])
    assert await arrivals(receiver, path, 1, timeout=0.2) == []
    assert (await get(sim, created["id"]))["status"] == "succeeded"
    assert await admin_rows(sim) == []


async def test_no_webhook_no_callback(sim: SimAdmin, receiver: Receiver) -> None:
    await configure(sim, receiver, 0.1)
    before = len(receiver.deliveries)
    created = await create(sim, None)
    await asyncio.sleep(0.1 + QUIET)
    assert (await get(sim, created["id"]))["status"] == "succeeded"
    assert len(receiver.deliveries) == before
    assert await admin_rows(sim) == []


async def test_callbacks_off_by_default(sim: SimAdmin, receiver: Receiver, path: str) -> None:
    await sim.configure(executors={VERSION: {"latency_seconds": 0.1}})
    await create(sim, path)
    assert await arrivals(receiver, path, 1, timeout=0.2) == []


async def test_a_dropped_callback_never_arrives_but_the_prediction_completes_and_is_billed(
    sim: SimAdmin, receiver: Receiver, path: str
) -> None:
    await configure(sim, receiver, 0.1, drop=1.0)
    created = await create(sim, path)
    assert await arrivals(receiver, path, 1, timeout=0.2) == []
    assert (await get(sim, created["id"]))["status"] == "succeeded"
    billed = [c for c in (await sim.charges())["charges"] if c["job_id"] == created["id"]]
    assert len(billed) == 1 and billed[0]["protocol"] == "predictions"
    assert await admin_rows(sim) == []


async def test_a_duplicated_callback_is_a_replay(sim: SimAdmin, receiver: Receiver, path: str) -> None:
    await configure(sim, receiver, 0.1, duplicate=1.0)
    await create(sim, path)
    first, second = await arrivals(receiver, path, 2)
    for name in ("webhook-id", "webhook-timestamp", "webhook-signature"):
        assert first.headers[name] == second.headers[name]
    assert first.body == second.body
    assert verifies(SECRET, first) and verifies(SECRET, second)
    rows = await admin_rows(sim)
    assert [r["duplicate_of"] for r in rows] == [None, first.headers["webhook-id"]]


async def test_a_forged_callback_does_not_verify(sim: SimAdmin, receiver: Receiver, path: str) -> None:
    await configure(sim, receiver, 0.1, forge=1.0)
    created = await create(sim, path)
    [d] = await arrivals(receiver, path, 1)
    assert d.headers["webhook-signature"].startswith("v1,")  # well-formed: only the key is wrong
    assert not verifies(SECRET, d)
    assert d.json() == await get(sim, created["id"])
    [row] = await admin_rows(sim)
    assert row["forged"] is True


async def test_an_early_callback_claims_success_while_the_prediction_runs(
    sim: SimAdmin, receiver: Receiver, path: str
) -> None:
    await configure(sim, receiver, 0.4, early=1.0)
    created = await create(sim, path)
    deadline = time.monotonic() + 5
    while not receiver.to(path) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    [lie] = receiver.to(path)
    now = await get(sim, created["id"])
    assert lie.json()["status"] == "succeeded"
    assert now["status"] in ("starting", "processing")
    assert verifies(SECRET, lie)  # signed by the vendor all the same: the body lies, not the signature
    _, truth = await arrivals(receiver, path, 2)
    assert truth.headers["webhook-id"] != lie.headers["webhook-id"]
    assert truth.json() == await get(sim, created["id"])
    rows = await admin_rows(sim)
    assert [(r["early"], r["body_status"]) for r in rows] == [(True, "succeeded"), (False, "succeeded")]


async def test_a_failed_delivery_is_retried_with_the_same_id(
    sim: SimAdmin, receiver: Receiver, path: str
) -> None:
    await configure(sim, receiver, 0.05)
    receiver.answers[:] = [500]
    await create(sim, path)
    first, retry = await arrivals(receiver, path, 2)
    assert first.headers["webhook-id"] == retry.headers["webhook-id"]
    assert first.body == retry.body
    assert verifies(SECRET, retry)
    assert [r["status_code"] for r in await admin_rows(sim)] == [500, 204]


async def test_a_canceled_prediction_is_called_back_at_once(
    sim: SimAdmin, receiver: Receiver, path: str
) -> None:
    await configure(sim, receiver, 30.0)
    created = await create(sim, path)
    started = time.monotonic()
    canceled = await sim.client.post(f"/v1/predictions/{created['id']}/cancel")
    assert canceled.status_code == 200
    [d] = await arrivals(receiver, path, 1)
    assert d.at - started < 2
    assert d.json()["status"] == "canceled"
    assert d.json() == await get(sim, created["id"])


async def test_a_reset_forgets_pending_callbacks(sim: SimAdmin, receiver: Receiver, path: str) -> None:
    await configure(sim, receiver, 0.2)
    await create(sim, path)
    await sim.reset()
    assert await arrivals(receiver, path, 1, timeout=0.3) == []
    assert await admin_rows(sim) == []


async def test_the_signing_secret_endpoint(sim: SimAdmin, simulator_url: str) -> None:
    assert (await sim.client.get("/v1/webhooks/default/secret")).status_code == 404
    await sim.configure(webhooks={"secret": SECRET})
    answer = await sim.client.get("/v1/webhooks/default/secret")
    assert (answer.status_code, answer.json()) == (200, {"key": SECRET})
    async with httpx.AsyncClient(base_url=simulator_url) as anonymous:
        assert (await anonymous.get("/v1/webhooks/default/secret")).status_code == 401


@pytest.mark.parametrize(
    "habits",
    [
        {"secret": "not-a-secret"},
        {"secret": "whsec_not base64!"},
        {"secret": "whsec_"},
        {"secret": SECRET, "rewrite_host": "http://127.0.0.1:9/hooks"},
        {"secret": SECRET, "rewrite_host": "127.0.0.1:9"},
        {"secret": SECRET, "surprise": 1},
    ],
)
def test_webhook_habits_are_checked(habits: dict[str, Any]) -> None:
    with pytest.raises(pydantic.ValidationError):
        WebhookHabits.model_validate(habits)
