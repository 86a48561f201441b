"""A worker stopped with SIGTERM mid-operation (a deploy, a scale-down) shuts down gracefully: it stops
polling, lets its in-flight activity finish within ``graceful_shutdown_seconds``, and exits 0; nothing is
lost, nothing is charged twice, no operation is left open."""

from __future__ import annotations

import time

from faultkit import ONE_SHOT, assert_invariants, op_key


async def test_sigterm_mid_operation_lets_the_activity_finish_and_loses_nothing(rig, sim):
    await sim.configure(executors={"video.motion": {"latency_seconds": 2.0}})
    plan = rig.plan(ONE_SHOT)
    op = op_key(plan.task_id, "shot")
    w1 = await rig.spawn()
    await rig.start(plan)
    await w1.wait_for("polling", op)  # the job is running at the vendor
    seen = rig.events(plan.task_id)
    started = time.monotonic()
    assert w1.terminate() == 0, w1.tail()
    assert time.monotonic() - started < 20  # within the grace period, not killed
    # The in-flight activity finished on the stopping worker: its result is in the ledger already.
    kinds = [e.type for e in rig.events(plan.task_id) if e.operation_key == op]
    assert "Outcome" in kinds, kinds
    await rig.spawn()  # the workflow's remaining steps run on a fresh worker
    await assert_invariants(rig.recorder, sim, [plan.task_id], seen=seen, rig=rig)
    assert len(await sim.charges(op)) == 1
