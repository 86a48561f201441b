"""A worker that stops answering does not hold its workflows' next step for the sticky timeout.

The sticky schedule-to-start timeout is long (Temporal's 10 s: shorter, and busy workers' workflows are
replayed elsewhere — runtime/stickiness.py). What keeps a hung or dead worker from holding a task that long:
the activity attempt that replaces the one it abandoned resets the workflow's stickiness before it runs, so
the workflow task that brings its result goes to the task queue every live worker polls.
"""

from __future__ import annotations

from typing import Any

from faultkit import ONE_SHOT, FaultRig, assert_invariants, op_key
from temporalio.api.enums.v1 import EventType, TaskQueueKind


def _next_task_kinds(events: list[Any]) -> list[tuple[int, int]]:
    """(attempt, kind of the workflow task scheduled next) for each completed activity of the history."""
    started_attempt: dict[int, int] = {}
    out: list[tuple[int, int]] = []
    pending: int | None = None
    for e in events:
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            started_attempt[e.event_id] = e.activity_task_started_event_attributes.attempt
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            pending = started_attempt[e.activity_task_completed_event_attributes.started_event_id]
        elif e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED and pending is not None:
            out.append((pending, e.workflow_task_scheduled_event_attributes.task_queue.kind))
            pending = None
    return out


async def test_a_retried_activity_frees_its_workflow_from_a_hung_worker(rig: FaultRig, sim: Any) -> None:
    """Worker 1 runs the task and hangs (SIGSTOP: its sticky polls stay open, so Temporal takes it for alive)
    in the middle of the paid shot; worker 2 retries the shot once the heartbeat times out. The workflow task
    that brings attempt 2's result goes to the normal queue (worker 2 takes it at once), not to worker 1's
    sticky queue to wait out the timeout (60 s here) — and the task completes with one charge."""
    await sim.configure(executors={"video.motion": {"latency_seconds": 0.5}})
    plan = rig.plan(ONE_SHOT)
    assert plan.task_id is not None
    op = op_key(plan.task_id, "shot")
    sticky = {"LEDGERFLOW_STICKY_SCHEDULE_TO_START_SECONDS": "60"}
    hung = await rig.spawn(hold_at="vendor_accepted", hold_op=op, **sticky)
    handle = await rig.start(plan)
    await hung.held("vendor_accepted", op)
    seen = rig.events(plan.task_id)
    await rig.spawn(**sticky)

    # Well inside the 60 s sticky timeout that would otherwise hold the shot's result.
    await rig.result(plan.task_id, timeout=45.0)
    kinds = _next_task_kinds((await handle.fetch_history()).events)
    retried = [kind for attempt, kind in kinds if attempt > 1]
    assert retried == [TaskQueueKind.TASK_QUEUE_KIND_NORMAL], (
        f"after a retried activity the next workflow task went to {retried} (kinds by attempt: {kinds})"
    )
    # Stickiness is kept where nothing was retried: the first attempt's sibling activities (opening the
    # task) were followed by sticky workflow tasks.
    assert TaskQueueKind.TASK_QUEUE_KIND_STICKY in [kind for attempt, kind in kinds if attempt == 1], kinds
    assert len(await sim.charges(op)) == 1
    await assert_invariants(rig.recorder, sim, [plan.task_id], seen=seen, rig=rig)
