"""SIGKILL a worker at each named fault point of one paid operation; a fresh worker must finish the task.

Each test freezes the worker right after one mark of the operation ``task:shot:a1`` (``LEDGERFLOW_HOLD_AT``),
checks the world is exactly in the state that point describes, kills the worker, starts another and then
checks the invariants (one charge per key, ledger == vendor, no open INTENT, nothing acknowledged lost,
Completed) plus what that point specifically risks.
"""

from __future__ import annotations

import asyncio
from typing import Any

from faultkit import (
    ONE_SHOT,
    FaultRig,
    Mark,
    Worker,
    assert_artifact,
    assert_invariants,
    op_key,
    resolutions,
    vendor_job,
)

from rules.envelope import StoredEvent
from rules.operation import fold_operation
from rules.plan import Plan


async def freeze_at(
    rig: FaultRig, sim: Any, point: str, *, latency: float
) -> tuple[Plan, str, Worker, Mark, list[StoredEvent]]:
    """Start a worker that freezes at ``point`` of the shot's operation, run the task until it does."""
    await sim.configure(executors={"video.motion": {"latency_seconds": latency}})
    plan = rig.plan(ONE_SHOT)
    assert plan.task_id is not None
    op = op_key(plan.task_id, "shot")
    worker = await rig.spawn(hold_at=point, hold_op=op)
    await rig.start(plan)
    held = await worker.held(point, op)
    return plan, op, worker, held, rig.events(plan.task_id)


async def recover_and_check(rig: FaultRig, sim: Any, task_id: str, op: str, seen: list[StoredEvent]) -> None:
    """Kill-survivor checks shared by every point: a fresh worker completes; exactly one charge; verified."""
    await rig.spawn()
    await assert_invariants(rig.recorder, sim, [task_id], seen=seen, rig=rig)
    charges = await sim.charges(op)
    assert len(charges) == 1, f"{op} charged {len(charges)} times: {charges}\n{rig.logs()}"
    outcome = resolutions(rig.events(task_id))[op]
    assert outcome.type == "Outcome", outcome
    assert outcome.payload["job_id"] == charges[0]["job_id"], "the outcome is not the job that was paid for"
    assert_artifact(outcome)


async def test_kill_after_intent_before_submit(rig, sim):
    """The INTENT is committed, nothing was sent: recovery sends it exactly once (never zero, never twice)."""
    plan, op, w1, _, seen = await freeze_at(rig, sim, "intent_recorded", latency=0.2)
    assert [e.type for e in seen if e.operation_key == op] == ["Intent"]
    assert await sim.charges(op) == []
    assert w1.find("submitting", op) == [], "the vendor was called before the fault point"
    await rig.crash(w1)
    await recover_and_check(rig, sim, plan.task_id, op, seen)


async def test_kill_after_vendor_accept_before_progress(rig, sim):
    """The vendor has charged, the ledger has no job id yet: recovery adopts that job, never pays again."""
    plan, op, w1, held, seen = await freeze_at(rig, sim, "vendor_accepted", latency=0.5)
    charges = await sim.charges(op)
    assert [c["job_id"] for c in charges] == [held.fields["job"]]
    kinds = [(e.type, e.payload.get("kind")) for e in seen if e.operation_key == op]
    # The INTENT, written ahead of the send (the vendor dedups on the key and finds jobs by it), and no
    # Progress yet: the ledger does not know the job id.
    assert kinds == [("Intent", None)], "a marker or Progress written before the point"
    ahead = fold_operation(e for e in seen if e.operation_key == op).ahead
    assert ahead is not None and ahead.timeout_s > 0, "the INTENT is not send 1's write-ahead"
    await rig.crash(w1)
    await recover_and_check(rig, sim, plan.task_id, op, seen)


async def test_kill_under_the_intents_write_ahead_before_the_send(rig, sim):
    """The INTENT stands for send 1's write-ahead and the worker dies between deciding to send and sending:
    the record reads "maybe sent" though nothing left; recovery resubmits under the key (the vendor would
    deduplicate a send that had landed) and the vendor bills exactly once."""
    plan, op, w1, _, seen = await freeze_at(rig, sim, "submitting", latency=0.2)
    assert [e.type for e in seen if e.operation_key == op] == ["Intent"], "a marker of its own was written"
    record = fold_operation(e for e in seen if e.operation_key == op)
    assert [s.n for s in record.maybe_sent] == [1], "the INTENT does not read as send 1"
    assert await sim.charges(op) == []
    await rig.crash(w1)
    await recover_and_check(rig, sim, plan.task_id, op, seen)


async def test_kill_while_polling(rig, sim):
    """Killed mid-poll of a running job: recovery resumes polling the same job (job id from the record, where
    the first poll that found the job still running after RECORD_RUNNING_AFTER_S wrote it)."""
    plan, op, w1, held, seen = await freeze_at(rig, sim, "progress_recorded", latency=4.0)
    progress = [e for e in seen if e.operation_key == op and e.type == "Progress"]
    assert [p.payload["job_id"] for p in progress] == [held.fields["job"]]
    assert (await vendor_job(sim, held.fields["job"]))["status"] == "running"
    await rig.crash(w1)
    await recover_and_check(rig, sim, plan.task_id, op, seen)


async def test_kill_after_vendor_completed_before_outcome(rig, sim):
    """The job is done and paid at the vendor, nothing fetched: recovery fetches and registers it, unpaid."""
    plan, op, w1, held, seen = await freeze_at(rig, sim, "vendor_completed", latency=0.3)
    assert (await vendor_job(sim, held.fields["job"]))["status"] == "succeeded"
    assert op not in resolutions(seen)
    assert len(await sim.charges(op)) == 1
    await rig.crash(w1)
    await recover_and_check(rig, sim, plan.task_id, op, seen)


async def test_kill_after_outcome_before_workflow_saw_it(rig, sim):
    """The Outcome is committed, the activity never reported back: the retry finds it and changes nothing."""
    plan, op, w1, _, seen = await freeze_at(rig, sim, "outcome_recorded", latency=0.2)
    outcome = resolutions(seen)[op]
    assert outcome.type == "Outcome"
    # The workflow has not folded it: nothing after the Outcome (no compose INTENT) was written yet.
    assert seen[-1].seq == outcome.seq or all(e.operation_key == op for e in seen[outcome.seq :])
    await rig.crash(w1)
    await recover_and_check(rig, sim, plan.task_id, op, seen)
    assert resolutions(rig.events(plan.task_id))[op] == outcome  # the very same event, not a second one


async def test_kill_after_the_artifact_was_stored_never_pays_for_the_node_again(rig, sim):
    """The artifact is in the store, its Outcome not yet written; meanwhile the vendor purges the output.

    Recovery finds the job done, finds its bytes already stored (content-addressed, verified against the
    vendor's sha256) and registers them: nothing is downloaded again, nothing is paid for again.
    """
    await sim.configure(executors={"video.motion": {"latency_seconds": 0.2, "purge_after_seconds": 1.0}})
    plan = rig.plan(ONE_SHOT)
    assert plan.task_id is not None
    op = op_key(plan.task_id, "shot")
    w1 = await rig.spawn(hold_at="artifact_stored", hold_op=op)
    await rig.start(plan)
    held = await w1.held("artifact_stored", op)
    seen = rig.events(plan.task_id)
    assert op not in resolutions(seen)
    stored = [p for p in rig.artifact_dir.rglob(f"{held.fields['sha']}*") if p.is_file()]
    assert stored, "the artifact is in the store before the kill"
    await asyncio.sleep(1.5)  # the vendor purges the output while the worker is down
    await rig.crash(w1)
    await recover_and_check(rig, sim, plan.task_id, op, seen)
