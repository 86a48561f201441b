"""Scans that run themselves (issue 27 §2), on the real servers: Temporal Schedules start the orphan scan, the
route-holds scan and the consistency check on the test's own task queue, whose worker runs them.

Each test creates the Schedules as ``ledgerflow schedules apply`` does (``ensure_schedules``), with intervals
long enough that only the test's ``trigger()`` starts a run, and deletes them at the end. The ledger is shared
by the session: every scan is scoped to the test's task queue, and assertions name the test's own tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from metricskit import exporter, scrape
from peoplekit import cli
from temporalio.client import Client, ScheduleActionExecutionStartWorkflow
from temporalio.service import RPCError

from ledger.recorder import Recorder
from ledgerflow.views.schedules import (
    CONSISTENCY,
    ORPHANS,
    ROUTE_HOLDS,
    SCANS,
    ensure_schedules,
    last_success,
    schedule_id,
)
from reconcile.scans import ScanReport
from vendors.routes import RouteSpec, RouteTable
from workflows.contracts import TaskResult, workflow_id

PLAN = """
goal: {goal}
budget_ceiling: 10
stages:
  - {{id: shot, executor: {route}, estimate: 0.40, input: {{format: json}}}}
"""
JOB_S = 3.0  # the vendor's job takes this long: the operation is in flight (and its slot held) meanwhile
LONG = timedelta(hours=6)  # no run starts by itself during a test: each is triggered


def slot_holders(recorder: Recorder, route: str) -> set[str]:
    with recorder.reader.connect() as conn:
        rows = conn.execute(sa.text("SELECT task_id FROM route_slots WHERE route = :r"), {"r": route}).all()
    return {r[0] for r in rows}


async def until(check: Any, timeout: float, what: str) -> None:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def run_now(client: Client, sid: str, timeout: float = 60.0) -> ScanReport:
    """Trigger the Schedule and return the report of the run it started."""
    handle = client.get_schedule_handle(sid)
    before = (await handle.describe()).info.num_actions
    await handle.trigger()
    started = time.monotonic()
    while (desc := await handle.describe()).info.num_actions <= before:
        assert time.monotonic() - started < timeout, f"{sid} started no run"
        await asyncio.sleep(0.1)
    action = desc.info.recent_actions[-1].action
    assert isinstance(action, ScheduleActionExecutionStartWorkflow)
    assert action.workflow_id.startswith(sid)
    run = client.get_workflow_handle(
        action.workflow_id, run_id=action.first_execution_run_id, result_type=ScanReport
    )
    report = await asyncio.wait_for(run.result(), timeout)
    assert report.run_id == f"{action.workflow_id}/{action.first_execution_run_id}"  # it names its run
    return report


async def delete_schedules(client: Client, queue: str) -> None:
    for scan in SCANS:
        with contextlib.suppress(RPCError):  # one this test did not create
            await client.get_schedule_handle(schedule_id(scan, queue)).delete()


async def dead_holder(lf: Any, sim: Any, recorder: Recorder, route: str) -> tuple[str, str, str]:
    """A task whose paid job is in flight at the vendor (its slot held), whose workflow is then terminated:
    (task id, operation key, the job id the dead run started)."""
    await sim.configure(executors={route: {"latency_seconds": JOB_S}})
    plan = lf.plan(PLAN.format(goal="a paid shot", route=route))
    assert plan.task_id is not None
    handle = await lf.start(plan, heartbeat_timeout_seconds=2)

    def job() -> tuple[str, str] | None:
        for e in recorder.read_events(plan.task_id):
            if e.operation_key and e.payload.get("job_id"):
                return e.operation_key, str(e.payload["job_id"])
        return None

    await until(lambda: job() is not None and plan.task_id in slot_holders(recorder, route), 30, "the job")
    await handle.terminate(reason="test: the run is gone while its job runs at the vendor")
    found = job()
    assert found is not None
    return plan.task_id, found[0], found[1]


# ── (1) a terminated task, found and taken over by the scheduled scan ────────────────────────────────────
async def test_a_task_terminated_mid_flight_is_resumed_by_the_scheduled_scan_paying_once_and_freeing_its_slot(
    lf_with: Any, sim: Any, recorder: Recorder
) -> None:
    route = f"sched-{uuid.uuid4().hex[:8]}"
    started_at = datetime.now(UTC)
    async with lf_with(routes=RouteTable(routes={route: RouteSpec(concurrency=1)})) as lf:
        queue = lf.task_queue
        names = {ORPHANS.name, ROUTE_HOLDS.name}
        every = dict.fromkeys(names, LONG)
        try:
            await ensure_schedules(lf.client, lf.settings, scans=names, every=every)
            task, op, job = await dead_holder(lf, sim, recorder, route)

            # The route-holds scan sees the dead run's slot, and leaves it: its job is still at the vendor.
            holds = await run_now(lf.client, schedule_id(ROUTE_HOLDS, queue))
            mine = [f for f in holds.found if f.task_id == task]
            assert [(f.kind, f.operation_key, f.route) for f in mine] == [("slot", op, route)]
            assert not [a for a in holds.did if a.task_id == task]
            assert task in slot_holders(recorder, route)

            # The orphan scan finds the task and starts a new run, which adopts the paid job.
            orphans = await run_now(lf.client, schedule_id(ORPHANS, queue))
            assert [f.kind for f in orphans.found if f.task_id == task] == ["orphan"]
            assert [a.did for a in orphans.did if a.task_id == task] == ["resumed"]
            resumed = lf.client.get_workflow_handle(workflow_id(task), result_type=TaskResult)
            result = await asyncio.wait_for(resumed.result(), 60)
            assert result.state == "Completed", result.summary

            # No duplicate charge: one charge per idempotency key, the shot's being the dead run's own job.
            charges = await sim.charges(task)
            assert charges, "the vendor billed nothing"
            per_key = Counter(c["idempotency_key"] for c in charges)
            assert all(n == 1 for n in per_key.values()), per_key
            assert [c["job_id"] for c in charges if c["idempotency_key"] == op] == [job]

            # Its slot was given back with the operation's result; the next scan finds nothing of it.
            assert task not in slot_holders(recorder, route)
            again = await run_now(lf.client, schedule_id(ROUTE_HOLDS, queue))
            assert not [f for f in again.found if f.task_id == task]
            assert not [
                f for f in (await run_now(lf.client, schedule_id(ORPHANS, queue))).found if f.task_id == task
            ]

            # Each scan's last success is readable, and /metrics exports it (0 for a scan never run here).
            last = await last_success(lf.client, queue)
            for name in names:
                at = last[name]
                assert at is not None and at >= started_at, (name, at)
            read = functools.partial(last_success, lf.client, queue)
            with exporter(lf.settings.resolved_database_url(), lf.client, scans=read) as server:
                scraped = await scrape(server.url)
            for name in names:
                value = scraped.value("ledgerflow_scan_last_success_timestamp_seconds", scan=name)
                assert value == pytest.approx(last[name].timestamp()), name
            assert scraped.value("ledgerflow_scan_last_success_timestamp_seconds", scan=CONSISTENCY.name) == 0
        finally:
            await delete_schedules(lf.client, queue)


# ── (2) the ledger against Temporal ──────────────────────────────────────────────────────────────────────
async def test_the_consistency_check_reports_a_terminated_task_and_nothing_for_healthy_ones(
    lf_with: Any, sim: Any, recorder: Recorder
) -> None:
    route = f"cons-{uuid.uuid4().hex[:8]}"
    async with lf_with(routes=RouteTable(routes={route: RouteSpec()})) as lf:
        queue = lf.task_queue
        sid = schedule_id(CONSISTENCY, queue)
        try:
            await ensure_schedules(
                lf.client, lf.settings, scans={CONSISTENCY.name}, every={CONSISTENCY.name: LONG}
            )
            done = lf.plan(PLAN.format(goal="a finished shot", route=route))
            assert (await lf.run(done)).state == "Completed"

            await sim.configure(executors={route: {"latency_seconds": 20.0}})
            running = lf.plan(PLAN.format(goal="a shot in flight", route=route))
            assert running.task_id is not None
            handle = await lf.start(running, heartbeat_timeout_seconds=2)
            await until(
                lambda: any(
                    e.type == "Intent" and e.operation_key for e in recorder.read_events(running.task_id)
                ),
                30,
                "the shot dispatched",
            )

            healthy = await run_now(lf.client, sid)
            assert healthy.looked_at >= 2  # the open task in the ledger, and its running workflow
            assert not [f for f in healthy.found if f.task_id in {done.task_id, running.task_id}], (
                healthy.found
            )

            await handle.terminate(reason="test: Temporal no longer runs it; the ledger still says open")
            broken = await run_now(lf.client, sid)
            found = [f for f in broken.found if f.task_id in {done.task_id, running.task_id}]
            assert [(f.task_id, f.kind) for f in found] == [(running.task_id, "ledger_open_not_running")]
            assert "terminated" in found[0].detail, found[0].detail
        finally:
            await sim.configure()
            await delete_schedules(lf.client, queue)


# ── (3) `ledgerflow schedules apply`, twice: one Schedule per scan ───────────────────────────────────────
async def test_schedules_apply_run_twice_leaves_exactly_one_schedule_per_scan(lf: Any, tmp_path: Any) -> None:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    env = {"LEDGERFLOW_TASK_QUEUE": queue}
    long = ["--orphans-every", "21600", "--route-holds-every", "21600", "--consistency-every", "21600"]
    expected = {schedule_id(scan, queue) for scan in SCANS}
    try:
        code, first, _ = await cli(
            lf, tmp_path, "schedules", "apply", *long, "--billing-every", "21600", env=env
        )
        assert code == 0, first
        assert sorted(line.split(":")[0] for line in first.splitlines()) == sorted(
            f"schedule {s}" for s in expected
        )
        assert first.count(": created,") == len(SCANS), first

        code, second, _ = await cli(
            lf, tmp_path, "schedules", "apply", *long, "--billing-every", "43200", env=env
        )
        assert code == 0, second
        assert second.count(": updated,") == len(SCANS), second

        async def listed() -> list[str]:
            return [s.id async for s in await lf.client.list_schedules() if s.id.endswith(f"-{queue}")]

        started = time.monotonic()
        while len(ids := await listed()) < len(expected):
            assert time.monotonic() - started < 20, ids
            await asyncio.sleep(0.2)
        assert sorted(ids) == sorted(expected)  # one per scan, none twice
        billing = await lf.client.get_schedule_handle(schedule_id("billing-reconciliation", queue)).describe()
        assert billing.schedule.spec.intervals[0].every == timedelta(hours=12)  # the second call's spec

        code, shown, _ = await cli(lf, tmp_path, "schedules", "list", env=env)
        assert code == 0, shown
        lines = [line for line in shown.splitlines() if line.startswith("ledgerflow-")]
        assert sorted(line.split(":")[0] for line in lines) == sorted(expected)
        assert all("0 runs, last success never" in line for line in lines), shown
    finally:
        await delete_schedules(lf.client, queue)
