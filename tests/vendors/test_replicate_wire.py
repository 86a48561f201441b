"""The ``predictions`` adapter speaks Replicate's published API, and the simulator answers as Replicate does.

Every request the adapter sends and every answer the simulator gives is checked against Replicate's own
OpenAPI document (``schemas/replicate-openapi.json``, source in ``schemas/SOURCES.md``), on real HTTP. Then
what that API cannot do, proved: no metadata (a body carrying it is refused, as ``additionalProperties:
false`` says), no key to find a lost prediction by (it is found by its version and input, and two alike
cannot be told apart), no billing listing, output files that need the token.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from openapi_check import load, request_problems, response_problems

from vendors.adapter import JobStatus, Sent
from vendors.errors import ResultUnavailable, VendorCannotTell, VendorUnavailable
from vendors.predictions import PredictionsAdapter, _cursor
from vendors.routes import CDN_PORT_OFFSET, RouteSpec, Timeouts

if TYPE_CHECKING:
    from tests.vendors.conftest import SimAdmin

API_KEY = "sk-test-4f1c9e"  # tests/vendors/conftest.py's: the simulator's key in these tests
REPLICATE = load("replicate")
VERSION = "acme/motion:5c7d5dc6dd8bf75c1acaa8565735e7986bc5b66206b55cca93cb72c9bf15ccaa"
ESTIMATE = Decimal("0.10")


def template(path: str) -> str:
    """The document's path template for a path the adapter called (the document's server is ``…/v1``)."""
    path = path.removeprefix("/v1")
    if path == "/predictions":
        return path
    if path.endswith("/cancel"):
        return "/predictions/{prediction_id}/cancel"
    return "/predictions/{prediction_id}"


class Wire:
    """Every exchange on a client: (method, path template, request body, status, answer)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, Any, int, Any]] = []

    async def record(self, response: httpx.Response) -> None:
        await response.aread()
        request = response.request
        if not request.url.path.startswith("/v1/predictions"):
            return
        sent = json.loads(request.content) if request.content else None
        answer = (
            response.json()
            if response.headers.get("content-type", "").startswith("application/json")
            else None
        )
        self.seen.append((request.method, template(request.url.path), sent, response.status_code, answer))

    def problems(self) -> list[str]:
        found = []
        for method, path, sent, status, answer in self.seen:
            if method == "POST" and path == "/predictions":
                found += request_problems(REPLICATE, method, path, sent)
            if status < 400:
                found += response_problems(REPLICATE, method, path, status, answer)
        return found


@pytest.fixture
async def wire(sim: SimAdmin) -> AsyncIterator[tuple[Wire, httpx.AsyncClient]]:
    recorded = Wire()
    async with httpx.AsyncClient(event_hooks={"response": [recorded.record]}) as client:
        yield recorded, client


def cdn_of(url: str) -> str:
    parts = httpx.URL(url)
    return f"http://{parts.host}:{(parts.port or 80) + CDN_PORT_OFFSET}"


def adapter(sim: SimAdmin, client: httpx.AsyncClient, **route: Any) -> PredictionsAdapter:
    spec = RouteSpec(adapter="predictions", model=VERSION, timeouts=Timeouts(request=5.0), **route)
    return PredictionsAdapter(spec, sim.url, API_KEY, client=client)


async def finished(vendor: PredictionsAdapter, job_id: str) -> Any:
    for _ in range(200):
        job = await vendor.get(job_id)
        if job.status != JobStatus.RUNNING:
            return job
    raise AssertionError(f"{job_id} never finished")


def request(prompt: str | None = None) -> dict[str, Any]:
    return {"prompt": prompt or f"a fox crossing a frozen river {uuid.uuid4().hex[:6]}", "width": 64}


async def test_what_the_adapter_sends_and_the_simulator_answers_follow_replicates_schema(sim, wire):
    recorded, client = wire
    await sim.configure(executors={VERSION: {"latency_seconds": 0.2}})
    hook = "https://hooks.example.com/replicate?operation_key={operation_key}"
    vendor = adapter(sim, client, webhook_url=hook)
    asked = request()
    job = await vendor.submit(
        operation_key="t-1:a:1", executor="video.motion", request=asked, estimate=ESTIMATE
    )
    done = await finished(vendor, job.id)
    assert done.status == JobStatus.SUCCEEDED and done.seconds is not None
    other = await vendor.submit(
        operation_key="t-1:b:1", executor="video.motion", request=request(), estimate=ESTIMATE
    )
    await vendor.cancel(other.id)
    since = datetime.now(UTC) - timedelta(minutes=5)
    [again] = await vendor.find_by_key("t-1:a:1", since=since, sent=Sent("video.motion", asked))
    assert again.id == job.id
    called = {(method, path) for method, path, *_ in recorded.seen}
    assert called == {
        ("POST", "/predictions"),
        ("GET", "/predictions"),
        ("GET", "/predictions/{prediction_id}"),
        ("POST", "/predictions/{prediction_id}/cancel"),
    }
    create = next(
        sent for method, path, sent, *_ in recorded.seen if (method, path) == ("POST", "/predictions")
    )
    assert set(create) == {"version", "input", "webhook", "webhook_events_filter"}
    assert create["webhook"] == "https://hooks.example.com/replicate?operation_key=t-1%3Aa%3A1"
    assert recorded.problems() == []


async def test_a_body_carrying_metadata_is_refused_as_replicate_refuses_it(sim):
    """What the adapter sent before it spoke Replicate's API: a 422, and nothing billed."""
    body = {"version": VERSION, "input": request(), "metadata": {"operation_key": "t-1:a:1"}}
    assert request_problems(REPLICATE, "POST", "/predictions", body) != []
    answer = await sim.client.post("/v1/predictions", json=body)
    assert answer.status_code == 422
    assert (await sim.charges())["count"] == 0


async def test_a_lost_prediction_is_found_again_by_its_version_and_input(sim, wire):
    _, client = wire
    await sim.configure(executors={VERSION: {"drop_response": 1.0}})
    vendor = adapter(sim, client)
    asked = request()
    since = datetime.now(UTC) - timedelta(minutes=5)
    with pytest.raises(VendorUnavailable):
        await vendor.submit(
            operation_key="t-2:a:1", executor="video.motion", request=asked, estimate=ESTIMATE
        )
    other = {**asked, "width": 128}  # another operation's request of the same version: never claimed
    await sim.configure(executors={VERSION: {}})
    await vendor.submit(operation_key="t-2:b:1", executor="video.motion", request=other, estimate=ESTIMATE)
    [found] = await vendor.find_by_key("t-2:a:1", since=since, sent=Sent("video.motion", asked))
    assert found.id in {c["job_id"] for c in (await sim.charges())["charges"]}
    assert (await sim.charges())["count"] == 2  # the lost one was billed: found, not sent again
    # Not sent before the window: not found; nothing on record of what was sent: it cannot tell.
    assert (
        await vendor.find_by_key("t-2:a:1", since=datetime.now(UTC), sent=Sent("video.motion", asked)) == []
    )
    with pytest.raises(VendorCannotTell, match="what was sent is not on record"):
        await vendor.find_by_key("t-2:a:1", since=since)


async def test_two_predictions_asking_the_same_cannot_be_told_apart(sim, wire):
    _, client = wire
    vendor = adapter(sim, client)
    asked = request()
    for key in ("t-3:a:1", "t-3:b:1"):
        await vendor.submit(operation_key=key, executor="video.motion", request=asked, estimate=ESTIMATE)
    with pytest.raises(VendorCannotTell, match=r"2 predictions of .* with its input"):
        await vendor.find_by_key("t-3:a:1", since=None, sent=Sent("video.motion", asked))


async def test_an_input_file_is_matched_whatever_url_it_went_out_as(sim, wire, tmp_path: Path):
    _, client = wire
    vendor = adapter(sim, client)
    data = b"keyframe bytes"
    sha = hashlib.sha256(data).hexdigest()
    (tmp_path / "k.png").write_bytes(data)
    ref = {"uri": "s3://bucket/artifacts/k.png", "sha256": sha}
    asked = {"prompt": "move", "inputs": {"image": ref}}
    url = f"file://{tmp_path / 'k.png'}"  # the URL the store made for this one send
    job = await vendor.submit(
        operation_key="t-4:a:1", executor="video.motion", request=asked, estimate=ESTIMATE, files={sha: url}
    )
    sent = (await sim.client.get(f"/v1/predictions/{job.id}")).json()["input"]
    assert sent == {"prompt": "move", "image": url}  # the reference went out as the model's own input
    [found] = await vendor.find_by_key("t-4:a:1", since=None, sent=Sent("video.motion", asked))
    assert found.id == job.id
    # An input the vendor cannot fetch fails the prediction, as Replicate's does.
    broken = {"prompt": "move", "inputs": {"image": {**ref, "uri": "s3://bucket/artifacts/gone.png"}}}
    gone = await vendor.submit(
        operation_key="t-4:b:1",
        executor="video.motion",
        request=broken,
        estimate=ESTIMATE,
        files={sha: f"file://{tmp_path / 'gone.png'}"},
    )
    failed = await finished(vendor, gone.id)
    assert failed.status == JobStatus.FAILED and failed.error is not None
    assert "could not be fetched" in failed.error.message


async def test_output_files_need_the_token_and_get_it_only_where_the_route_allows(sim, wire):
    _, client = wire
    await sim.configure(executors={VERSION: {"latency_seconds": 0.0}})
    cdn = cdn_of(sim.url)
    plain = adapter(sim, client, allow_private=(cdn,))  # the CDN reachable, but not trusted with the key
    job = await finished(
        plain,
        (
            await plain.submit(
                operation_key="t-5:a:1", executor="video.motion", request=request(), estimate=ESTIMATE
            )
        ).id,
    )
    assert job.result is not None and job.result.url.startswith(cdn)
    with pytest.raises(ResultUnavailable, match="401"):
        await plain.download(job, lambda chunk: None)
    keyed = adapter(sim, client, allow_hosts=(cdn,))
    chunks: list[bytes] = []
    await keyed.download(job, chunks.append)
    assert json.loads(b"".join(chunks))["executor"] == VERSION  # the rendered output, whole


async def test_replicate_lists_no_charges_so_the_adapter_says_it_cannot(sim, wire):
    _, client = wire
    vendor = adapter(sim, client)
    assert not vendor.capabilities.can_list_charges and not vendor.capabilities.has_billing
    with pytest.raises(VendorCannotTell, match="lists no charges"):
        await vendor.charges(datetime.now(UTC) - timedelta(days=1))
    assert "/v1/usage" not in str(load("replicate")["paths"])  # the document has none either
    assert (await sim.client.get("/v1/usage")).status_code == 404


async def test_the_listing_is_paged_through_next_on_our_own_origin_only(sim, wire):
    recorded, client = wire
    vendor = adapter(sim, client)
    asked = request()
    first = await vendor.submit(
        operation_key="t-6:a:1", executor="video.motion", request=asked, estimate=ESTIMATE
    )
    for i in range(100):  # a full page newer than it
        body = {"version": VERSION, "input": {"prompt": f"filler {i}"}}
        assert (await sim.client.post("/v1/predictions", json=body)).status_code == 201
    [found] = await vendor.find_by_key("t-6:a:1", since=None, sent=Sent("video.motion", asked))
    assert found.id == first.id
    lists = [(path, status) for method, path, _, status, _ in recorded.seen if method == "GET"]
    assert lists == [("/predictions", 200), ("/predictions", 200)]
    assert recorded.problems() == []
    # A next URL naming another host is read for its cursor only: the key never goes there.
    assert _cursor("https://evil.example/v1/predictions?cursor=abc&created_after=x") == {
        "cursor": "abc",
        "created_after": "x",
    }
    assert re.fullmatch(
        r"\d+", (await sim.client.get("/v1/predictions")).json()["next"].split("cursor=")[1].split("&")[0]
    )
