"""Takeover: a frozen worker's activity moves to another worker; a terminated workflow is resumed (CLI)."""

from __future__ import annotations

import asyncio

import pytest
from faultkit import (
    HEARTBEAT_S,
    ONE_SHOT,
    assert_artifact,
    assert_invariants,
    op_key,
    resolutions,
)

from ledgerflow.views.people import send, signed_payload
from runtime.settings import Settings
from runtime.signing import demo_key


@pytest.mark.parametrize("point", ["polling", "artifact_staged"])
async def test_frozen_worker_is_taken_over_and_its_late_writes_change_nothing(rig, sim, point):
    """SIGSTOP a worker past its heartbeat timeout (mid-poll, or with the finished job's artifact staged and
    its Outcome about to be written): a second worker resumes the same paid job and records it; when the
    first wakes up (SIGCONT) its obsolete attempt pays nothing and changes nothing (first write wins)."""
    await sim.configure(executors={"video.motion": {"latency_seconds": 3.5}})
    plan = rig.plan(ONE_SHOT)
    op = op_key(plan.task_id, "shot")
    a = await rig.spawn(stop_on=(point, op))
    await rig.start(plan)
    polling = await a.wait_for("polling", op, timeout=30)
    # B starts while A owns the activity (and before A stages anything: B's start-up temp sweep is over).
    b = await rig.spawn()
    frozen = await a.wait_for(point, op, timeout=30)
    assert a.stopped
    seen = rig.events(plan.task_id)
    await rig.unstick()
    await rig.wait_ledger(plan.task_id, lambda ev: op in resolutions(ev), timeout=60, what=f"{op} resolved")
    settled = rig.by_op(plan.task_id, op)
    resolution = resolutions(settled)[op]
    paid = polling.fields["job"]
    assert resolution.type == "Outcome", f"the paid job {paid} was not recorded: {resolution}"
    took_over = await b.wait_for("outcome_recorded", op, timeout=5)
    assert took_over.at - frozen.at >= HEARTBEAT_S, "taken over before the heartbeat timeout passed"
    assert a.find("outcome_recorded", op) == [], "the frozen worker wrote while stopped"
    charges = await sim.charges(op)
    assert [c["job_id"] for c in charges] == [polling.fields["job"]], "B did not resume the paid job"

    a.cont()
    await assert_invariants(rig.recorder, sim, [plan.task_id], seen=[*seen, *settled], rig=rig)
    # The woken worker resumes its obsolete attempt(s) at once; give any straggling write a moment to land.
    await asyncio.sleep(1.0)
    assert rig.by_op(plan.task_id, op) == settled, "the woken worker changed the operation's record"
    assert await sim.charges(op) == charges, "the woken worker paid again"
    await assert_invariants(rig.recorder, sim, [plan.task_id], seen=[*seen, *settled], rig=rig)
    outcome = resolutions(rig.events(plan.task_id))[op]
    assert outcome.payload["job_id"] == polling.fields["job"]
    assert_artifact(outcome)


async def test_resume_after_the_workflow_was_terminated(rig, sim):
    """Terminate the workflow mid-poll; ``ledgerflow resume TASK`` starts a new run from the ledger alone,
    which takes a new epoch, reconciles the open operation (the paid job) and completes: nothing paid
    twice."""
    await sim.configure(executors={"video.motion": {"latency_seconds": 2.0}})
    plan = rig.plan(ONE_SHOT)
    op = op_key(plan.task_id, "shot")
    worker = await rig.spawn()
    handle = await rig.start(plan)
    polling = await worker.wait_for("polling", op, timeout=30)
    await handle.terminate("fault test: the run is gone")
    seen = rig.events(plan.task_id)
    old_epoch = max(e.epoch for e in seen)

    done = await rig.cli("resume", plan.task_id)
    assert done.returncode == 0, f"ledgerflow resume failed ({done.returncode}): {done.stdout}{done.stderr}"
    assert (await rig.handle(plan.task_id).describe()).run_id != handle.result_run_id, "no new run"

    await assert_invariants(rig.recorder, sim, [plan.task_id], seen=seen, rig=rig)
    charges = await sim.charges(op)
    assert [c["job_id"] for c in charges] == [polling.fields["job"]]
    events = rig.events(plan.task_id)
    outcome = resolutions(events)[op]
    assert outcome.payload["job_id"] == polling.fields["job"]
    assert_artifact(outcome)
    new_intents = [e for e in events[len(seen) :] if e.type == "Intent"]
    assert new_intents and all(e.epoch > old_epoch for e in new_intents), (
        "the new run did not take a new epoch"
    )


APPROVED_THEN_SHOT = """
goal: a frame a person approves, then a paid shot
budget_ceiling: 20
approval: {timeout: 1h, policy: escalate}
stages:
  - {id: frame, executor: image.keyframe, estimate: 0.4, approval: true}
  - {id: shot, executor: video.motion, estimate: 1.5, depends_on: [frame]}
"""


async def test_an_intent_written_just_after_a_decision_by_a_worker_that_died_is_adopted(rig, sim):
    """A person approves; the worker records the decision and the next INTENT (the shot) and dies before its
    workflow task completes. The next worker replays: recording the decision again returns that INTENT from
    the ledger. It must start the shot's executor rather than wait (before, it waited for ever: the INTENT
    arrived after the loop's adoption step, and nothing was left to wake it)."""
    await sim.configure(executors={"video.motion": {"latency_seconds": 0.2}})
    plan = rig.plan(APPROVED_THEN_SHOT)
    assert plan.task_id is not None
    op = op_key(plan.task_id, "shot")
    w1 = await rig.spawn(hold_at="intent_recorded", hold_op=op)
    await rig.start(plan)

    def asked(events) -> bool:
        return any(e.type == "Intent" and e.payload["action"]["kind"] == "SuspendForHuman" for e in events)

    await rig.wait_ledger(plan.task_id, asked, timeout=30, what="the approval asked")
    settings = Settings(temporal_address=rig.client.service_client.config.target_host)
    payload = signed_payload(demo_key("director"), plan.task_id, "approval:frame:v1", "approve")
    await send(settings, plan.task_id, payload)
    await w1.held("intent_recorded", op)
    seen = rig.events(plan.task_id)
    await rig.crash(w1)
    await rig.spawn()
    await assert_invariants(rig.recorder, sim, [plan.task_id], seen=seen, rig=rig)
    assert len(await sim.charges(op)) == 1
