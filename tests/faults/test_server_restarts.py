"""The servers crash too: SIGKILL the Temporal server, or Postgres, in the middle of a paid operation.

Each test runs its own server (on its own files, so it can be killed and restarted on the same files and
port); the other servers are the session's. A worker must ride out the outage and the task must finish with
the invariants intact: the operation is paid once and recorded once, and nothing acknowledged before the
crash is lost.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import warnings
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
from faultkit import ONE_SHOT, FaultRig, assert_artifact, assert_invariants, op_key, resolutions, scratch_dir
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from ledger.recorder import Recorder
from ledgerflow.stack import pg
from ledgerflow.stack.services import start_temporal


@dataclass
class TemporalServer:
    """A Temporal dev server on a SQLite file: SIGKILL it and start it again on the same file and port."""

    state: Path
    port: int
    ui_port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.proc = await asyncio.to_thread(self._start)

    def _start(self) -> subprocess.Popen[bytes]:
        # stack.start_temporal hands Popen a log file object it never closes: its ResourceWarning is the
        # product's (reported), not this test's.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            return start_temporal(self.state, self.port, self.ui_port, self.state / "temporal.log")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture
def temporal_dir() -> Iterator[Path]:
    with scratch_dir("ledgerflow-temporal-") as path:
        yield path


@pytest.fixture
async def own_temporal(temporal_dir: Path) -> AsyncIterator[TemporalServer]:
    server = TemporalServer(temporal_dir, pg.free_port(), pg.free_port())
    await server.start()
    try:
        yield server
    finally:
        server.kill()


async def test_temporal_server_killed_mid_operation(own_temporal, recorder, pg_url, simulator_url, sim):
    """SIGKILL Temporal while the worker polls a paid job, restart it on the same SQLite file and port."""
    client = await Client.connect(own_temporal.address, data_converter=pydantic_data_converter)
    with scratch_dir("ledgerflow-faults-") as workdir:
        rig = FaultRig(client, recorder, pg_url, simulator_url, workdir)
        try:
            await sim.configure(executors={"video.motion": {"latency_seconds": 2.0}})
            plan = rig.plan(ONE_SHOT)
            op = op_key(plan.task_id, "shot")
            worker = await rig.spawn()
            await rig.start(plan)
            polling = await worker.wait_for("polling", op, timeout=30)
            seen = rig.events(plan.task_id)
            own_temporal.kill()
            await asyncio.sleep(1.0)  # the job keeps running at the vendor; the worker cannot reach Temporal
            await own_temporal.start()

            await assert_invariants(rig.recorder, sim, [plan.task_id], seen=seen, rig=rig)
            charges = await sim.charges(op)
            assert [c["job_id"] for c in charges] == [polling.fields["job"]]
            outcome = resolutions(rig.events(plan.task_id))[op]
            assert outcome.payload["job_id"] == polling.fields["job"]
            assert_artifact(outcome)
        finally:
            await rig.close()


@dataclass
class OwnLedger:
    """The test's own Postgres (SIGKILL and restart it on the same data dir and port) and a rig on it."""

    data_dir: Path
    instance: pg.PgInstance
    rig: FaultRig

    async def kill(self) -> None:
        await asyncio.to_thread(pg.kill, self.data_dir)

    async def restart(self) -> datetime:
        await asyncio.to_thread(pg.init_and_start, self.data_dir, self.instance.port)
        return datetime.now(UTC)


@pytest.fixture
async def own_ledger(pg_scratch_dir, temporal, simulator_url) -> AsyncIterator[OwnLedger]:
    data_dir = pg_scratch_dir / "data"
    instance = await asyncio.to_thread(pg.init_and_start, data_dir)
    recorder = Recorder(instance.url)
    recorder.create_schema()
    (pg_scratch_dir / "work").mkdir()
    rig = FaultRig(temporal, recorder, instance.url, simulator_url, pg_scratch_dir / "work")
    try:
        yield OwnLedger(data_dir, instance, rig)
    finally:
        await rig.close()
        recorder.dispose()
        await asyncio.to_thread(pg.stop, data_dir, "immediate")


async def test_postgres_killed_mid_operation(own_ledger, sim):
    """SIGKILL the ledger's Postgres while the worker polls a paid job and keep it down past the job's end, so
    the Outcome write meets a dead database; restart it (crash recovery from the WAL) on the same port."""
    rig = own_ledger.rig
    latency = 1.0
    await sim.configure(executors={"video.motion": {"latency_seconds": latency}})
    plan = rig.plan(ONE_SHOT)
    op = op_key(plan.task_id, "shot")
    worker = await rig.spawn()
    await rig.start(plan)
    polling = await worker.wait_for("polling", op, timeout=30)
    seen = rig.events(plan.task_id)
    assert op not in resolutions(seen)
    await own_ledger.kill()
    await asyncio.sleep(latency + 1.5)  # the job ends at the vendor while the ledger is down
    restarted = await own_ledger.restart()

    await assert_invariants(rig.recorder, sim, [plan.task_id], seen=seen, rig=rig)
    charges = await sim.charges(op)
    assert [c["job_id"] for c in charges] == [polling.fields["job"]]
    outcome = resolutions(rig.events(plan.task_id))[op]
    assert outcome.payload["job_id"] == polling.fields["job"]
    assert outcome.recorded_at > restarted, "the outcome was written before the outage (harness timing)"
    assert_artifact(outcome)


async def test_postgres_down_longer_than_the_stage_retry_budget(own_ledger, sim):
    """A longer ledger outage (a managed database's failover takes tens of seconds): every attempt of the
    stage activity meets a dead database until Temporal's retry policy (STAGE_RETRY: 5 attempts, 1+2+4+8 s)
    gives up. The paid, finished job, whose id the ledger holds (Progress), must still become the operation's
    result once the ledger is back: never a zero-cost failure followed by paying for the node again."""
    rig = own_ledger.rig
    await sim.configure(executors={"video.motion": {"latency_seconds": 3.5}})
    plan = rig.plan(ONE_SHOT)
    op = op_key(plan.task_id, "shot")
    worker = await rig.spawn()
    await rig.start(plan)
    # The job id reaches the ledger with the first poll that finds the job still running after
    # RECORD_RUNNING_AFTER_S (2 s; before then the vendor finds it by the key).
    polling = await worker.wait_for("progress_recorded", op, timeout=30)
    seen = rig.events(plan.task_id)
    assert [e.payload["job_id"] for e in seen if e.type == "Progress"] == [polling.fields["job"]]
    await own_ledger.kill()
    await asyncio.sleep(20)  # longer than the stage activity's whole retry budget
    await own_ledger.restart()

    await rig.result(plan.task_id)
    resolution = resolutions(rig.events(plan.task_id))[op]
    assert resolution.type == "Outcome", f"the paid job's operation was resolved as {resolution.payload}"
    assert resolution.payload["job_id"] == polling.fields["job"]
    charges = await sim.charges(f"{plan.task_id}:shot:")
    assert [c["job_id"] for c in charges] == [polling.fields["job"]], f"the shot was paid again: {charges}"
    await assert_invariants(rig.recorder, sim, [plan.task_id], seen=seen, rig=rig)
