"""The decision loop on real servers: parallel fan-out, replay determinism, one workflow per task."""

from __future__ import annotations

import time

import pytest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from ledgerflow import client as lfclient
from rules.events import parse
from rules.projection import fold
from rules.recompute import recompute
from workflows.contracts import workflow_id
from workflows.task import TaskWorkflow

FAN_OUT = """
goal: six slow shots in parallel
budget_ceiling: 50
concurrency: 8
stages:
  - {id: shots, executor: video.motion, estimate: 1, fan_out: 6, canary: false}
"""


async def test_fan_out_runs_in_parallel(lf, sim):
    await sim.configure(executors={"video.motion": {"latency_seconds": 1.5}})
    plan = lf.plan(FAN_OUT)
    started = time.monotonic()
    result = await lf.run(plan)
    wall = time.monotonic() - started
    assert result.state == "Completed"
    # Six 1.5 s jobs: 9 s if serial. Parallel dispatch finishes in about one job's latency plus overhead.
    assert wall < 9.0 / 2, f"fan-out took {wall:.1f}s: not parallel"
    assert recompute(lf.recorder.read_events(plan.task_id)) == []  # six dispatches on one watermark
    intents = [parse(e) for e in lf.recorder.read_events(plan.task_id) if e.type == "Intent"]
    dispatched = [i.action.node for i in intents if i.action.kind == "Dispatch"]
    assert sorted(dispatched[:6]) == [f"shots/S0{i}" for i in range(1, 7)]
    # One decision round: six dispatches on one watermark, each decided with the ones before it pending.
    fan = [i for i in intents if i.action.kind == "Dispatch"][:6]
    assert len({i.watermark for i in fan}) == 1
    assert sorted(len(i.pending) for i in fan) == [0, 1, 2, 3, 4, 5]


async def test_every_intent_records_the_watermark_it_was_decided_on(lf, sim):
    plan = lf.plan(FAN_OUT.replace("fan_out: 6", "fan_out: 2"))
    await lf.run(plan)
    events = lf.recorder.read_events(plan.task_id)
    for e in events:
        if e.type == "Intent":
            intent = parse(e)
            assert intent.watermark < e.seq
            assert intent.rule in {f"R{i}" for i in range(1, 12)} | {"LLM"}


async def test_history_replays_deterministically(lf, sim):
    plan = lf.plan(
        """
goal: replay me
budget_ceiling: 30
approval: {timeout: 1s, policy: approve}
stages:
  - {id: board, executor: llm.text, estimate: 1, approval: true}
  - {id: shots, executor: image.keyframe, estimate: 1, depends_on: [board], fan_out: 3}
"""
    )
    handle = await lf.start(plan)
    result = await handle.result()
    assert result.state == "Completed"
    history = await handle.fetch_history()
    replayer = Replayer(workflows=[TaskWorkflow], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(history)  # raises on any nondeterminism


async def test_approval_timeout_applies_the_plans_policy(lf, sim):
    plan = lf.plan(
        """
goal: the approver is away
budget_ceiling: 30
approval: {timeout: 1s, policy: approve}
stages:
  - {id: board, executor: llm.text, estimate: 1, approval: true}
  - {id: shots, executor: image.keyframe, estimate: 1, depends_on: [board]}
"""
    )
    result = await lf.run(plan)
    assert result.state == "Completed"
    events = [parse(e) for e in lf.recorder.read_events(plan.task_id)]
    markers = [e for e in events if e.type == "SystemMarker" and e.kind == "timeout"]
    assert [m.request_id for m in markers] == ["approval:board:v1"]


async def test_abort_policy_fails_the_task_on_timeout(lf, sim):
    plan = lf.plan(
        """
goal: nobody approves, and the plan says abort
budget_ceiling: 30
approval: {timeout: 1s, policy: abort}
stages:
  - {id: board, executor: llm.text, estimate: 1, approval: true}
  - {id: shots, executor: image.keyframe, estimate: 1, depends_on: [board]}
"""
    )
    result = await lf.run(plan)
    assert result.state == "Failed"
    p = fold(lf.recorder.read_events(plan.task_id))
    assert "policy abort" in (p.terminal_reason or "")
    assert p.nodes["shots"].attempts == 0  # nothing after the approval point ran


async def test_second_submit_of_a_task_id_is_refused(lf, sim):
    settings = lf.settings
    plan = lf.plan(FAN_OUT.replace("fan_out: 6", "fan_out: 1"))
    first = await lfclient.submit(settings, plan, plan.task_id, wait=True)
    assert first["state"] == "Completed"
    with pytest.raises(lfclient.ClientError, match="already exists"):
        await lfclient.submit(settings, plan, plan.task_id)
    # The refusal comes from the workflow id too, even before the ledger knows the task.
    other = lf.plan(FAN_OUT.replace("fan_out: 6", "fan_out: 1"))
    await lf.start(other)
    with pytest.raises(lfclient.ClientError, match="already submitted"):
        await lfclient.submit(settings, other, other.task_id)
    assert workflow_id(other.task_id).endswith(other.task_id)
