"""Backpressure end to end: while a project's people hold more open requests than they can, a fan-out of
another task in that project widens one node per finished node instead of opening at full width; every
dispatch's INTENT records the reading it was written with, and the decisions recompute from the ledger.
Real Temporal, real Postgres, the simulator."""

from __future__ import annotations

import uuid
from typing import Any

from peoplekit import wait_open

from ledger.recorder import Recorder
from ledgerflow.views import people
from rules.pressure import Reading
from rules.recompute import recompute
from runtime.signing import demo_key

WAITING = """
goal: two approvals nobody answers yet
project: {project}
budget_ceiling: 20
approval: {{timeout: 1h, policy: escalate}}
stages:
  - {{id: board, executor: llm.text, estimate: 1, fan_out: 2, canary: false, approval: true}}
"""
FAN_OUT = """
goal: a six-wide fan-out
project: {project}
budget_ceiling: 40
concurrency: 6
stages:
  - {{id: script, executor: llm.text, estimate: 1}}
  - {{id: shots, executor: video.motion, estimate: 1, depends_on: [script], fan_out: 6, canary: false}}
"""


def peak_in_flight(recorder: Recorder, task_id: str, stage: str) -> tuple[int, list[int]]:
    """The most operations of ``stage`` in flight at once, by the ledger's own order (INTENT to result), and
    how many were in flight as each INTENT was written."""
    running: set[str] = set()
    at_intent, peak = [], 0
    for e in recorder.read_events(task_id):
        key = e.operation_key or ""
        if f":{stage}/" not in key:
            continue
        if e.type == "Intent":
            running.add(key)
            at_intent.append(len(running))
            peak = max(peak, len(running))
        elif e.type in ("Outcome", "Failure"):
            running.discard(key)
    return peak, at_intent


async def run_fan_out(lf_with: Any, sim: Any, capacity: int) -> str:
    """Another task of the project holds two approvals; then a six-wide fan-out runs with people who hold
    ``capacity`` requests. Returns the fan-out task's id."""
    project = f"bp-{uuid.uuid4().hex[:8]}"
    await sim.configure(executors={"video.motion": {"latency_seconds": 0.3}})
    async with lf_with(human_capacity=capacity) as lf:
        waiting = await lf.start(lf.plan(WAITING.format(project=project)))
        await lf.wait_state(waiting, {"WaitingHuman"})
        assert lf.recorder.open_requests_by_project()[f"project:{project}"] == 2
        plan = lf.plan(FAN_OUT.format(project=project))
        result = await lf.run(plan)
        await waiting.terminate("test over")
    assert result.state == "Completed"
    return str(plan.task_id)


async def test_over_capacity_a_fan_out_widens_one_node_per_finished_node(
    lf_with: Any, sim: Any, recorder: Recorder
) -> None:
    task_id = await run_fan_out(lf_with, sim, capacity=1)  # two open requests: twice what its people hold
    peak, at_intent = peak_in_flight(recorder, task_id, "shots")
    assert at_intent[0] == 1 and peak == 3  # 1, then 2, then capped at 6 × 1 / 2 = 3 (full width: 6)
    events = recorder.read_events(task_id)
    shots = [e for e in events if e.type == "Intent" and ":shots/" in str(e.operation_key)]
    assert {Reading.from_payload(e.payload) for e in shots} == {Reading(2, 1)}
    reason = shots[0].payload["action"]["reason"]
    assert "backpressure: 2 open requests for people who hold 1: 1 of 6 in flight" in reason
    assert recompute(events) == []


async def test_under_capacity_the_same_fan_out_opens_at_full_width(
    lf_with: Any, sim: Any, recorder: Recorder
) -> None:
    task_id = await run_fan_out(lf_with, sim, capacity=2)
    assert peak_in_flight(recorder, task_id, "shots")[0] == 6


APPROVED_FAN_OUT = """
goal: a script a person approves, then a six-wide fan-out
project: {project}
budget_ceiling: 40
concurrency: 6
approval: {{timeout: 1h, policy: escalate}}
stages:
  - {{id: script, executor: llm.text, estimate: 1, approval: true}}
  - {{id: shots, executor: video.motion, estimate: 1, depends_on: [script], fan_out: 6, canary: false}}
"""


async def test_a_fan_out_after_an_approval_uses_the_load_read_with_the_decision(
    lf_with: Any, sim: Any, recorder: Recorder
) -> None:
    """The script's INTENT read an overloaded queue; by the time a person approves the script the other
    requests were answered. The decision's own reading (recorded with it) is what the fan-out goes by: it
    opens at full width, not at one."""
    project = f"bp-{uuid.uuid4().hex[:8]}"
    await sim.configure(executors={"video.motion": {"latency_seconds": 0.3}})
    async with lf_with(human_capacity=1) as lf:
        waiting = await lf.start(lf.plan(WAITING.format(project=project)))
        await lf.wait_state(waiting, {"WaitingHuman"})
        plan = lf.plan(APPROVED_FAN_OUT.format(project=project))
        handle = await lf.start(plan)
        script_rid = await wait_open(lf, plan.task_id, "approval:script")
        for rid in ("approval:board/S01:v1", "approval:board/S02:v1"):
            sent = await people.decide(
                lf.settings, demo_key("director"), waiting.id.removeprefix("ledgerflow-task-"), rid, "approve"
            )
            assert sent.status == "accepted"
        sent = await people.decide(lf.settings, demo_key("director"), plan.task_id, script_rid, "approve")
        assert sent.status == "accepted"
        assert (await handle.result()).state == "Completed"
        assert (await waiting.result()).state == "Completed"  # its two approvals answered

    events = recorder.read_events(plan.task_id)
    script = next(e for e in events if e.type == "Intent" and ":script:" in str(e.operation_key))
    assert Reading.from_payload(script.payload) == Reading(2, 1)  # over capacity when the script was sent
    decision = next(e for e in events if e.type == "HumanDecision")
    assert Reading.from_payload(decision.payload) == Reading(1, 1)  # only the script's own request left
    assert peak_in_flight(recorder, plan.task_id, "shots")[0] == 6
    assert recompute(events) == []
