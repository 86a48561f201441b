"""Issue 24 §5, URLs and downloads: each attack as the vendor (the simulator's switches) would mount it.

Everything stays on 127.0.0.1. The simulator's API is the route's own origin and its CDN (the API's port + 1)
is what a dev deployment allow-lists (vendors.routes.deployment_table); an "attack" URL is any other loopback
port (a stand-in for the object store or a /metrics page, ``Listener``) or the cloud metadata address, which
must be refused before anything connects.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import httpx
import pytest

from rules.events import parse
from vendors.adapter import JobStatus, VendorJob
from vendors.errors import ResultTooLarge, ResultUnavailable, UnsafeResultUrl, VendorUnavailable
from vendors.jobs import JobsAdapter
from vendors.routes import RouteSpec, RouteTable, Timeouts, parse_table, with_simulator_cdn

KEY = "sk-test-4f1c9e"  # the key tests/conftest.py gives the worker
METADATA = "http://169.254.169.254/latest/meta-data/iam/security-credentials/"

PLAN = """
goal: one paid shot
budget_ceiling: 20
time_ceiling: 1h
review: {{reviewers: [compliance.rules]}}
stages:
  - {{id: shot, executor: {executor}, estimate: 1.5, retries: 0}}
"""


class Listener:
    """Something private on another loopback port (an object store, a /metrics page): counts who calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.calls += 1
        await reader.readuntil(b"\r\n\r\n")
        body = b"aws_secret_access_key=private"
        head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
        writer.write(head + body)
        await writer.drain()
        writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


@pytest.fixture
async def listener() -> AsyncIterator[Listener]:
    found = Listener()
    found.server = await asyncio.start_server(found._serve, "127.0.0.1", 0)
    async with found.server:
        yield found


def cdn_of(url: str) -> str:
    """host:port of the simulator's CDN (its API's port + 1)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return f"{host}:{int(port) + 1}"


class Sent:
    """Every request the client sends, recorded before it leaves (an httpx request hook)."""

    def __init__(self) -> None:
        self.urls: list[str] = []
        self.keyed: list[str] = []

    async def __call__(self, request: httpx.Request) -> None:
        self.urls.append(str(request.url))
        if "authorization" in request.headers:
            self.keyed.append(str(request.url))


@pytest.fixture
async def sent() -> Sent:
    return Sent()


@pytest.fixture
async def client(sent: Sent) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(event_hooks={"request": [sent]}) as c:
        yield c


def dev_route(simulator_url: str, name: str, **spec: Any) -> RouteSpec:
    """The route as a dev deployment builds it on the simulator (its CDN allow-listed)."""
    return with_simulator_cdn(RouteTable(routes={name: RouteSpec(**spec)}), simulator_url).routes[name]


async def finished(adapter: JobsAdapter, executor: str) -> VendorJob:
    job = await adapter.submit(
        operation_key=f"sec-{uuid.uuid4().hex[:12]}",
        executor=executor,
        request={"format": "png", "width": 64, "height": 64},
        estimate=Decimal("1.5"),
    )
    while job.status == JobStatus.RUNNING:
        await asyncio.sleep(0.02)
        job = await adapter.get(job.id)
    assert job.status == JobStatus.SUCCEEDED and job.result is not None
    return job


async def download(adapter: JobsAdapter, job: VendorJob) -> bytes:
    chunks: list[bytes] = []
    await adapter.download(job, chunks.append)
    return b"".join(chunks)


async def leaks(sim: Any) -> int:
    """Requests that reached the simulator's CDN carrying a credential (so far, this session)."""
    return int((await sim.http.get("/admin/leaks")).json()["count"])


def executor() -> str:
    return f"video.sec{uuid.uuid4().hex[:8]}"


# ── 1: the worker fetched any address a vendor named ──────────────────────────────────────────────────────
async def test_a_result_url_on_another_loopback_port_is_refused(sim, client, listener, sent):
    """Old: the worker fetched http://127.0.0.1:<object store>/... and stored it as the node's output."""
    name = executor()
    await sim.configure(executors={name: {"result_url_template": listener.url + "/metrics"}})
    async with JobsAdapter(dev_route(sim.url, name), sim.url, KEY, client=client) as adapter:
        job = await finished(adapter, name)
        with pytest.raises(UnsafeResultUrl, match="loopback, private, link-local or metadata"):
            await download(adapter, job)
    assert listener.calls == 0 and not any(listener.url in u for u in sent.urls)


async def test_the_metadata_address_is_refused_before_any_connection(sim, client, sent):
    name = executor()
    await sim.configure(executors={name: {"result_url_template": METADATA}})
    async with JobsAdapter(dev_route(sim.url, name), sim.url, KEY, client=client) as adapter:
        job = await finished(adapter, name)
        started = time.monotonic()
        with pytest.raises(UnsafeResultUrl, match=r"169\.254\.169\.254"):
            await download(adapter, job)
    assert time.monotonic() - started < 1.0
    assert not any("169.254" in u for u in sent.urls), "a request to the metadata address was sent"


async def test_the_allow_listed_cdn_is_still_fetched_and_without_the_key(sim, client, sent):
    name = executor()
    before = await leaks(sim)
    await sim.configure(executors={name: {"absolute_urls": True}})
    async with JobsAdapter(dev_route(sim.url, name), sim.url, KEY, client=client) as adapter:
        job = await finished(adapter, name)
        assert job.result is not None and cdn_of(sim.url) in job.result.url
        assert await download(adapter, job)
        # A route that does not allow-list the CDN (not a dev deployment on the simulator) refuses it.
        async with JobsAdapter(RouteSpec(), sim.url, KEY, client=client) as strict:
            with pytest.raises(UnsafeResultUrl):
                await download(strict, job)
    assert not [u for u in sent.keyed if cdn_of(sim.url) in u]
    assert await leaks(sim) == before


async def test_a_stage_whose_result_url_is_private_fails_at_the_jobs_cost_and_stores_nothing(
    lf_with, sim, listener
):
    name = executor()
    async with lf_with(routes=RouteTable(routes={name: RouteSpec()})) as lf:
        await sim.configure(executors={name: {"result_url_template": listener.url + "/bucket/secret"}})
        plan = lf.plan(PLAN.format(executor=name))
        handle = await lf.start(plan)
        await lf.wait_state(handle, {"WaitingHuman"})
    events = [parse(e) for e in lf.recorder.read_events(plan.task_id)]
    [failure] = [e for e in events if e.type == "Failure"]
    assert failure.kind == "invalid_output" and "does not allow-list" in failure.error
    assert failure.actual_cost == Decimal("1.5")  # the vendor finished (and billed) the job: never zero
    assert not [e for e in events if e.type == "Outcome"]
    assert listener.calls == 0
    assert len(await sim.charges(f"{plan.task_id}:")) == 1  # never sent again


# ── 2: allow_hosts ignored scheme and port ────────────────────────────────────────────────────────────────
async def test_a_bare_allow_hosts_entry_never_sends_the_key_over_plain_http(sim, client, sent):
    """Old: allow_hosts [127.0.0.1] sent the bearer key to http://127.0.0.1:<any port> in clear text."""
    name = executor()
    before = await leaks(sim)
    await sim.configure(executors={name: {"result_url_template": "http://{cdn}/files/{job}"}})
    route = dev_route(sim.url, name, allow_hosts=("127.0.0.1",))  # https://127.0.0.1:443 only
    async with JobsAdapter(route, sim.url, KEY, client=client) as adapter:
        assert await download(adapter, await finished(adapter, name))
    assert not [u for u in sent.keyed if cdn_of(sim.url) in u], "the key went to http://…:<cdn port>"
    assert await leaks(sim) == before


async def test_a_full_origin_entry_sends_the_key_to_that_origin_only(sim, client, listener, sent):
    name = executor()
    await sim.configure(executors={name: {"result_url_template": listener.url + "/wants-the-key"}})
    route = dev_route(sim.url, name, allow_hosts=(listener.url,))  # dev mode: http allowed, this port only
    async with JobsAdapter(route, sim.url, KEY, client=client) as adapter:
        assert await download(adapter, await finished(adapter, name)) == b"aws_secret_access_key=private"
    assert [u for u in sent.keyed if u.startswith(listener.url)] == [listener.url + "/wants-the-key"]


def test_allow_hosts_entries_are_origins_and_plain_http_is_for_dev_mode_only(tmp_path):
    from runtime.settings import ConfigError, Settings
    from vendors.routes import RouteError, deployment_table

    origins = [("https://cdn.example/x", "no path"), ("ftp://cdn.example", r"not an http\(s\) origin")]
    for bad, said in origins:
        with pytest.raises(RouteError, match=said):
            parse_table({"routes": {"r": {"allow_hosts": [bad]}}})
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "routes: {r: {base_url: 'https://api.example', allow_hosts: ['http://cdn.example:8080']}}"
    )
    with pytest.raises(ConfigError, match=r"allow_hosts 'http://cdn\.example:8080' is not https"):
        deployment_table(Settings(routes_file=routes, env="prod", state_dir=tmp_path))
    assert deployment_table(Settings(routes_file=routes, env="dev", state_dir=tmp_path)).routes["r"]


# ── 3: a 3xx was not followed (retried until the time ceiling) ────────────────────────────────────────────
async def test_a_redirect_to_the_cdn_is_followed_and_the_key_dropped(sim, client, sent):
    name = executor()
    before = await leaks(sim)
    await sim.configure(executors={name: {"result_redirect": "http://{cdn}/files/{job}"}})
    async with JobsAdapter(dev_route(sim.url, name), sim.url, KEY, client=client) as adapter:
        job = await finished(adapter, name)
        assert await download(adapter, job)
    assert any(u.startswith(f"http://{cdn_of(sim.url)}") for u in sent.urls)
    assert not [u for u in sent.keyed if cdn_of(sim.url) in u]
    assert await leaks(sim) == before


async def test_a_redirect_to_a_private_address_is_refused(sim, client, listener, sent):
    name = executor()
    for target in (METADATA, listener.url + "/metrics"):
        await sim.configure(executors={name: {"result_redirect": target}})
        async with JobsAdapter(dev_route(sim.url, name), sim.url, KEY, client=client) as adapter:
            with pytest.raises(UnsafeResultUrl):
                await download(adapter, await finished(adapter, name))
    assert listener.calls == 0 and not any("169.254" in u for u in sent.urls)


async def test_a_redirect_loop_stops_after_five_hops(sim, client, sent):
    name = executor()
    await sim.configure(executors={name: {"result_redirect": "/jobs/{job}/result"}})
    async with JobsAdapter(dev_route(sim.url, name), sim.url, KEY, client=client) as adapter:
        job = await finished(adapter, name)
        before = len(sent.urls)
        with pytest.raises(ResultUnavailable, match="more than 5 redirects"):
            await download(adapter, job)
    assert len(sent.urls) - before == 6


# ── 4: a CDN's 401/403 paused the whole route ─────────────────────────────────────────────────────────────
async def test_an_expired_presigned_url_fails_that_output_not_the_route(lf_with, sim):
    """Old: the CDN's 403 was a VendorAuthError: the route paused for every task until a person resumed it."""
    name = executor()
    async with lf_with(routes=RouteTable(routes={name: RouteSpec()})) as lf:
        await sim.configure(executors={name: {"absolute_urls": True, "download_status": 403}})
        plan = lf.plan(PLAN.format(executor=name))
        handle = await lf.start(plan)
        await lf.wait_state(handle, {"WaitingHuman"})
        assert name not in lf.recorder.route_states() or not lf.recorder.route_states()[name].paused
    [failure] = [parse(e) for e in lf.recorder.read_events(plan.task_id) if e.type == "Failure"]
    assert failure.kind == "technical" and "403" in failure.error
    assert failure.actual_cost == Decimal("1.5")  # the job was done and billed: its charge stands
    assert len(await sim.charges(f"{plan.task_id}:")) == 1  # and it was never sent (nor paid) twice


async def test_a_download_refusal_at_the_adapter_is_not_an_auth_error(sim, client):
    name = executor()
    for status in (401, 403):
        await sim.configure(executors={name: {"absolute_urls": True, "download_status": status}})
        async with JobsAdapter(dev_route(sim.url, name), sim.url, KEY, client=client) as adapter:
            with pytest.raises(ResultUnavailable, match=str(status)):
                await download(adapter, await finished(adapter, name))


# ── 5: the download timeout was checked once per MiB; nothing capped a size ───────────────────────────────
async def test_one_deadline_covers_a_slow_drip(sim, client):
    """Old: the deadline was checked after each MiB: a file dripping 16 bytes a second never reached it."""
    name = executor()
    await sim.configure(executors={name: {"drip_seconds": 0.2}})
    route = dev_route(sim.url, name, timeouts=Timeouts(request=5.0, download=1.0))
    async with JobsAdapter(route, sim.url, KEY, client=client) as adapter:
        job = await finished(adapter, name)
        started = time.monotonic()
        with pytest.raises(VendorUnavailable, match="download exceeded 1s"):
            await download(adapter, job)
    assert time.monotonic() - started < 2.0


async def test_a_result_above_the_routes_cap_is_refused(sim, client):
    name = executor()
    await sim.configure(executors={name: {"absolute_urls": True}})
    route = dev_route(sim.url, name, max_result_bytes=100)
    async with JobsAdapter(route, sim.url, KEY, client=client) as adapter:
        with pytest.raises(ResultTooLarge, match="max_result_bytes"):
            await download(adapter, await finished(adapter, name))


async def test_a_json_answer_above_the_routes_cap_is_unreadable(sim, client):
    from vendors.errors import VendorBadResponse

    name = executor()
    route = dev_route(sim.url, name, max_json_bytes=64)
    async with JobsAdapter(route, sim.url, KEY, client=client) as adapter:
        with pytest.raises(VendorBadResponse, match="max_json_bytes"):
            await finished(adapter, name)


@pytest.mark.parametrize(
    ("habit", "spec", "kind", "said"),
    [
        ({"result_redirect": "/jobs/{job}/result"}, {}, "technical", "more than 5 redirects"),
        ({"absolute_urls": True}, {"max_result_bytes": 10}, "invalid_output", "max_result_bytes"),
    ],
    ids=["redirect-loop", "oversize"],
)
async def test_a_download_that_cannot_finish_is_a_failure_at_the_jobs_cost_not_a_retry_loop(
    lf_with, sim, habit, spec, kind, said
):
    """Old: a 3xx was a VendorRejected, retried until the time ceiling with the reservation held."""
    name = executor()
    async with lf_with(routes=RouteTable(routes={name: RouteSpec(**spec)})) as lf:
        await sim.configure(executors={name: habit})
        plan = lf.plan(PLAN.format(executor=name))
        handle = await lf.start(plan)
        await lf.wait_state(handle, {"WaitingHuman"})
    [failure] = [parse(e) for e in lf.recorder.read_events(plan.task_id) if e.type == "Failure"]
    assert failure.kind == kind and said in failure.error
    assert failure.actual_cost == Decimal("1.5")
    assert len(await sim.charges(f"{plan.task_id}:")) == 1


def test_byte_caps_are_configurable_and_each_mistake_is_one_line():
    table = parse_table({"routes": {"r": {"max_result_bytes": "512MiB", "max_json_bytes": "1MiB"}}})
    assert (table.routes["r"].max_result_bytes, table.routes["r"].max_json_bytes) == (512 << 20, 1 << 20)
    assert RouteSpec().max_result_bytes == 2 << 30 and RouteSpec().max_json_bytes == 16 << 20
    for field, value in [("max_result_bytes", "lots"), ("max_json_bytes", 0)]:
        with pytest.raises(ValueError) as e:
            parse_table({"routes": {"r": {field: value}}})
        assert str(e.value).count("\n") == 0 and f"route 'r': {field}" in str(e.value)
