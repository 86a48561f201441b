"""Money on real servers: reserve before dispatch, settle at real cost, scopes that cannot be overdrawn."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from decimal import Decimal

from ledgerflow.views.audit import audit_budget
from rules.events import parse
from rules.projection import fold
from rules.recompute import recompute

ONE_SHOT = """
goal: one paid generation
project: {project}
budget_ceiling: 10
stages:
  - {{id: gen, executor: video.motion, estimate: 1.00}}
"""


async def test_ten_tasks_race_for_a_project_budget_and_it_is_never_overdrawn(lf, sim):
    project = f"race{uuid.uuid4().hex[:8]}"
    ceiling = Decimal("5.30")  # room for exactly five 1.00 generations and their five 0.05 reviews
    lf.recorder.set_ceiling(f"project:{project}", ceiling)
    await sim.configure(executors={"video.motion": {"latency_seconds": 0.5}})

    samples: list[Decimal] = []
    stop = threading.Event()

    def sample() -> None:  # reads the account the way any other process would, as often as it can
        while not stop.is_set():
            account = lf.recorder.account(f"project:{project}")
            if account is not None:
                samples.append(account.spent + account.reserved)
            time.sleep(0.003)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    plans = [lf.plan(ONE_SHOT.format(project=project)) for _ in range(10)]
    handles = [await lf.start(p) for p in plans]
    try:
        done = await asyncio.wait_for(_settle_all(lf, handles), timeout=60)
    finally:
        stop.set()
        sampler.join()
    completed = [tid for tid, state in done.items() if state == "Completed"]
    escalated = [tid for tid, state in done.items() if state == "Escalated"]
    assert len(completed) == 5 and len(escalated) == 5, done
    assert len(samples) > 50 and max(samples) <= ceiling, (len(samples), max(samples))
    print(f"race: max spent+reserved {max(samples)} of ceiling {ceiling} over {len(samples)} samples")
    for tid in escalated:
        p = fold(lf.recorder.read_events(tid))
        assert "budget refused: project:" in (p.escalation_reason or ""), p.escalation_reason
        assert p.nodes["gen"].attempts == 0 and p.reserved == 0  # refused: no INTENT, nothing reserved
        events = lf.recorder.read_events(tid)
        refused = [e for e in events if e.type == "SystemMarker" and parse(e).kind == "intent_refused"]
        assert [parse(e).node for e in refused] == ["gen"]  # the INTENT the executor could not write
        assert not [e for e in events if e.type == "Intent" and parse(e).action.kind == "Dispatch"]
    for tid in completed + escalated:
        assert recompute(lf.recorder.read_events(tid)) == [], tid  # the refusal's escalation included
    account = lf.recorder.account(f"project:{project}")
    assert account is not None and account.reserved == 0
    vendor = sum([await sim.total(t) for t in completed], Decimal(0))
    assert vendor == Decimal("5.00") and sum([await sim.total(t) for t in escalated], Decimal(0)) == 0
    inference = sum((fold(lf.recorder.read_events(t)).spent for t in completed), Decimal(0)) - vendor
    assert account.spent == vendor + inference  # every cent the tasks spent, vendor and LLM
    for tid in completed + escalated:
        assert all(c.ok for c in audit_budget(lf.recorder, tid)), tid
    for h in handles:
        if done[h.id.removeprefix("ledgerflow-task-")] == "Escalated":
            await h.terminate("test over")


async def _settle_all(lf, handles) -> dict[str, str]:
    """Wait until every task is Completed or Escalated (escalated ones wait for a person: never finish)."""
    states: dict[str, str] = {}
    while len(states) < len(handles):
        for h in handles:
            tid = h.id.removeprefix("ledgerflow-task-")
            if tid in states:
                continue
            status = await h.query("status")
            if status["state"] in ("Completed", "Escalated", "Failed"):
                states[tid] = status["state"]
        await asyncio.sleep(0.1)
    return states


async def test_a_vendor_charging_three_times_its_estimate_is_recorded_and_flagged(lf, sim):
    await sim.configure(executors={"video.motion": {"cost_multiplier": "3"}})
    plan = lf.plan(ONE_SHOT.format(project="default"))
    result = await lf.run(plan)
    assert result.state == "Completed"
    events = [parse(e) for e in lf.recorder.read_events(plan.task_id)]
    outcome = next(e for e in events if e.type == "Outcome" and e.node == "gen")
    assert outcome.actual_cost == Decimal("3.00") == await sim.total(plan.task_id)
    anomalies = [e for e in events if e.type == "SystemMarker" and e.kind == "cost_anomaly"]
    assert [a.node for a in anomalies] == ["gen"]
    task = lf.recorder.account(f"task:{plan.task_id}")
    assert (
        task is not None
        and task.reserved == 0
        and task.spent == fold(lf.recorder.read_events(plan.task_id)).spent
    )
    assert all(c.ok for c in audit_budget(lf.recorder, plan.task_id))
