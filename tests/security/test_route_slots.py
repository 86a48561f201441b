"""Issue 24 §7: a terminated task's route slots are given back.

A route's quota slot is taken with a dispatch's INTENT and given back in the transaction that writes the
operation's one result (docs/design.md, quotas): a slot is held exactly while its operation is open, because
the vendor may be running its job. A task whose workflow is terminated (``temporal workflow terminate``,
``handle.terminate()``) keeps its open operations, so it keeps their slots until a run resolves them: the
documented recovery is the orphan scan (``ledgerflow reconcile --apply``: resume from the ledger alone). Its
new run adopts the open operations (resumed, finished, slot given back) — and, if the task's end was already
recorded, closes them (``operation.close``). That last case was lost: such a task was no orphan and refused
``resume``, so its slots and reservations were held for ever and a concurrency-1 route stopped for everyone.

Real Temporal, real Postgres, the simulator; every test runs its own route.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import sqlalchemy as sa

from ledger.recorder import Recorder
from ledgerflow import client
from reconcile.takeover import orphaned_tasks
from rules.actions import Escalate
from rules.events import Escalation, Intent, to_new
from rules.keys import effect_key, intent_key
from rules.plan import Plan
from vendors.routes import RouteSpec, RouteTable
from workflows.contracts import workflow_id

PLAN = """
goal: {goal}
budget_ceiling: 10
stages:
  - {{id: shot, executor: {route}, estimate: 0.40, input: {{format: json}}}}
"""
JOB_S = 2.0  # how long the vendor takes over a job: the slot is really in use meanwhile
# After the recovery step, A's slot is given back within this (the new run's start, its executor's
# reconciliation of the job, the job's remaining time), and B, a waiter that asks again after a delay that
# grows with how long it waited (at most 15 s), dispatches within this again: room for a loaded machine.
BOUND_S = 30.0


def slot_holders(recorder: Recorder, route: str) -> set[str]:
    with recorder.reader.connect() as conn:
        rows = conn.execute(sa.text("SELECT task_id FROM route_slots WHERE route = :r"), {"r": route}).all()
    return {r[0] for r in rows}


async def until(check: Any, timeout: float) -> float:
    """Seconds until ``check()`` holds (fails after ``timeout``)."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, "timed out"
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def a_terminated_holder(lf: Any, sim: Any, recorder: Recorder, route: str) -> Plan:
    """Task A takes the route's one slot (its job takes JOB_S at the vendor), then its workflow is
    terminated; its executor, whose heartbeats now find no workflow, ends without a result."""
    await sim.configure(executors={route: {"latency_seconds": JOB_S}})
    a = lf.plan(PLAN.format(goal="the holder", route=route))
    handle = await lf.start(a, heartbeat_timeout_seconds=2)
    await until(lambda: a.task_id in slot_holders(recorder, route), 30)
    await handle.terminate(reason="test: an operator terminates the workflow")
    return a


async def recover(lf: Any, recorder: Recorder, task_id: str) -> None:
    """The documented recovery step, for this one task: the orphan scan finds it; --apply resumes it."""
    orphans = await orphaned_tasks(recorder, lf.client, workflow_id, only={task_id})
    assert orphans == [task_id]
    await client.resume(lf.settings, task_id)


def dispatched_on(recorder: Recorder, task_id: str, route: str) -> bool:
    return any(e.type == "Intent" and e.payload.get("route") == route for e in recorder.read_events(task_id))


async def test_a_terminated_tasks_slot_goes_to_the_next_task_after_the_orphan_scan_resumes_it(
    lf_with: Any, sim: Any, recorder: Recorder
) -> None:
    route = f"slot-{uuid.uuid4().hex[:8]}"
    async with lf_with(routes=RouteTable(routes={route: RouteSpec(concurrency=1)})) as lf:
        a = await a_terminated_holder(lf, sim, recorder, route)
        b = lf.plan(PLAN.format(goal="the next task", route=route))
        await lf.start(b)
        await asyncio.sleep(JOB_S + 1)  # A's job is over at the vendor: its slot is still A's, B still waits
        assert slot_holders(recorder, route) == {a.task_id}
        assert not dispatched_on(recorder, b.task_id, route)

        await recover(lf, recorder, a.task_id)
        freed = await until(lambda: a.task_id not in slot_holders(recorder, route), BOUND_S)
        waited = freed + await until(lambda: dispatched_on(recorder, b.task_id, route), BOUND_S)
        print(f"A's slot freed {freed:.1f} s, B dispatched {waited:.1f} s after the recovery step")


async def test_a_task_terminated_after_its_end_was_recorded_gives_its_slot_back_after_the_orphan_scan(
    lf_with: Any, sim: Any, recorder: Recorder
) -> None:
    """A's run recorded the task's end (a time ceiling, a failed gate) and was terminated before it closed its
    open operation: the ledger says Failed, the operation is open, its slot and reservation are held."""
    route = f"slot-{uuid.uuid4().hex[:8]}"
    async with lf_with(routes=RouteTable(routes={route: RouteSpec(concurrency=1)})) as lf:
        a = await a_terminated_holder(lf, sim, recorder, route)
        assert a.task_id is not None
        epoch = recorder.current_epoch(a.task_id)
        assert epoch is not None
        watermark = recorder.read_events(a.task_id)[-1].seq
        key = intent_key(a.task_id, watermark, 1)
        end = Escalate(reason="time ceiling reached", terminal=True)
        intent = Intent(action=end, rule="R4", watermark=watermark, decided_at=datetime.now(UTC))
        escalation = Escalation(reason=end.reason, terminal=True)
        recorder.append_fenced(
            a.task_id,
            epoch,
            [to_new(intent, dedup_key=key), to_new(escalation, dedup_key=effect_key(key, "escalation"))],
        )
        b = lf.plan(PLAN.format(goal="the next task", route=route))
        await lf.start(b)

        await recover(lf, recorder, a.task_id)
        waited = await until(lambda: dispatched_on(recorder, b.task_id, route), BOUND_S)
        print(f"B dispatched {waited:.1f} s after the recovery step")
        events = recorder.read_events(a.task_id)
        results = [e for e in events if e.dedup_key.endswith(":result")]
        assert len(results) == 1 and results[0].type == "Failure"  # closed from the vendor: its job's cost
        assert a.task_id not in slot_holders(recorder, route)
        account = recorder.account(f"task:{a.task_id}")
        assert account is not None and account.reserved == Decimal(0)
