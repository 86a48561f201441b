"""A task that ends with work in flight: every operation resolved, nothing left reserved, books balanced."""

from __future__ import annotations

import uuid
from decimal import Decimal

from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from ledgerflow.views.audit import audit_budget
from rules.events import parse
from rules.plan import budget_scopes
from rules.recompute import recompute
from workflows.task import TaskWorkflow

# Two independent branches: script → edit, whose static gate fails on a banned term in its request (R2 ends
# the task), and a slow generation that is still running at the vendor when that happens.
TWO_BRANCHES = """
goal: one branch is blocked at its gate while the other is still generating
project: {project}
episode: e1
budget_ceiling: 10
stages:
  - {{id: slow, executor: video.motion, estimate: 1.00}}
  - {{id: script, executor: llm.text, estimate: 0.10}}
  - {{id: edit, executor: edit.assembly, estimate: 0.20, depends_on: [script], gate: true,
      input: {{note: "[banned]"}}}}
"""


async def test_a_failed_gate_with_work_in_flight_releases_every_reservation_and_books_the_charge(lf, sim):
    # The script takes a moment, so the slow job is surely running at the vendor when the gate fails.
    await sim.configure(
        executors={"video.motion": {"latency_seconds": 60.0}, "llm.text": {"latency_seconds": 0.5}}
    )
    plan = lf.plan(TWO_BRANCHES.format(project=f"term{uuid.uuid4().hex[:8]}"))
    assert plan.task_id is not None
    # A short heartbeat timeout: a cancellation reaches an executor with its next heartbeat.
    handle = await lf.start(plan, heartbeat_timeout_seconds=2.0)
    result = await handle.result()

    assert result.state == "Failed" and "compliance gate failed: edit" in result.summary["terminal_reason"]
    scopes = [scope for scope, _ceiling in budget_scopes(plan, plan.task_id)]
    assert [s.split(":")[0] for s in scopes] == ["project", "episode", "task"]
    for scope in scopes:
        account = lf.recorder.account(scope)
        assert account is not None and account.reserved == 0, (scope, account)
    events = [parse(e) for e in lf.recorder.read_events(plan.task_id)]
    results = [e for e in events if e.type in ("Outcome", "Failure")]
    ledger_total = sum((e.actual_cost for e in results), Decimal(0))
    assert ledger_total == await sim.total(plan.task_id) == lf.recorder.account(f"task:{plan.task_id}").spent
    [slow] = [e for e in results if e.node == "slow"]
    assert slow.type == "Failure" and slow.error.startswith("cancelled: the task ended while job")
    [charge] = await sim.charges(f"{plan.task_id}:slow")  # the job was running: it was paid for, once
    assert slow.actual_cost == Decimal(charge["amount"]) == Decimal("1.00")
    job = (await sim.http.get(f"/jobs/{charge['job_id']}")).json()
    assert job["status"] == "cancelled"  # and stopped at the vendor
    assert all(c.ok for c in audit_budget(lf.recorder, plan.task_id))
    replayer = Replayer(workflows=[TaskWorkflow], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(await handle.fetch_history())  # the wait for the cancellations replays


# Three slow shots, but the worker runs two activities at once: the third dispatch is decided (its INTENT
# folded as decided, for its executor to write) but its activity never starts before the time ceiling ends the
# task.
CROWDED = """
goal: a fan-out wider than the worker's activity slots, cut short by the time ceiling
budget_ceiling: 10
time_ceiling: 3s
stages:
  - {id: shots, executor: video.motion, estimate: 1.00, fan_out: 3, canary: false}
"""


async def test_a_task_that_closes_before_an_executor_wrote_its_intent_never_lets_it_start(lf_with, sim):
    await sim.configure(executors={"video.motion": {"latency_seconds": 60.0}})
    async with lf_with(max_concurrent_activities=2) as lf:
        plan = lf.plan(CROWDED)
        assert plan.task_id is not None
        handle = await lf.start(plan, heartbeat_timeout_seconds=2.0)
        result = await handle.result()
        assert result.state == "Failed" and "time ceiling" in result.summary["terminal_reason"]
        stored = lf.recorder.read_events(plan.task_id)
    events = [parse(e) for e in stored]
    [closing] = [e for e in stored if e.type == "SystemMarker" and parse(e).kind == "closing"]
    dispatched = [e.action.node for e in events if e.type == "Intent" and e.action.kind == "Dispatch"]
    [never] = {"shots/S01", "shots/S02", "shots/S03"} - set(dispatched)  # two slots: two INTENTs written …
    assert len(dispatched) == 2 and max(e.seq for e in stored if e.type == "Intent") < closing.seq
    assert await sim.charges(f"{plan.task_id}:{never}") == []  # … and the third never sent anything
    [refused] = [e for e in events if e.type == "SystemMarker" and e.kind == "intent_refused"]
    assert refused.node == never  # kept as decided, for the audit
    account = lf.recorder.account(f"task:{plan.task_id}")
    assert account is not None and account.reserved == 0
    results = [e for e in events if e.type in ("Outcome", "Failure")]
    assert sorted(e.node for e in results) == sorted(dispatched)  # both running ones closed
    assert sum((e.actual_cost for e in results), Decimal(0)) == await sim.total(plan.task_id) == account.spent
    assert recompute(stored) == []
    replayer = Replayer(workflows=[TaskWorkflow], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(await handle.fetch_history())
