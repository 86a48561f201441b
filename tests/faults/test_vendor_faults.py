"""What the vendor can and cannot tell us after a fault: dropped responses, and each of the vendor modes.

The simulator's ``mode`` and the worker's ``LEDGERFLOW_VENDOR_MODE`` always agree here: ``idempotent`` (same
key → same job, no new charge), ``lookup_only`` (jobs can be found by key, a resubmit would charge again),
``none`` (neither: after a crash between submit and Progress nobody can say whether the job exists).
"""

from __future__ import annotations

import asyncio

import pytest
import yaml
from faultkit import ONE_SHOT, assert_artifact, assert_invariants, op_key, resolutions

from rules.projection import fold
from vendors.routes import RouteSpec, RouteTable


@pytest.mark.parametrize("mode", ["idempotent", "lookup_only"])
async def test_vendor_charges_then_drops_the_response(rig, sim, mode):
    """Every first POST of a key is charged and answered 502: the worker finds the paid job, never pays twice.

    ``drop_response`` only hits a POST that creates a job, so at 1.0 exactly the first attempt of each key is
    dropped: in idempotent mode the resubmission is answered with the charged job; in lookup_only mode the
    worker must look the key up instead of resubmitting.
    """
    await sim.configure(mode=mode, executors={"video.motion": {"latency_seconds": 0.2, "drop_response": 1.0}})
    rig.vendor_mode = mode
    plan = rig.plan(ONE_SHOT)
    op = op_key(plan.task_id, "shot")
    dropped = (await sim.http.get("/admin/stats")).json()["dropped"]
    await rig.spawn()
    await rig.start(plan)
    await assert_invariants(rig.recorder, sim, [plan.task_id], rig=rig)
    after = (await sim.http.get("/admin/stats")).json()["dropped"]
    assert after > dropped, "the simulator did not drop the response (harness)"
    charges = await sim.charges(op)
    assert len(charges) == 1, charges
    outcome = resolutions(rig.events(plan.task_id))[op]
    assert outcome.type == "Outcome" and outcome.payload["job_id"] == charges[0]["job_id"]
    assert_artifact(outcome)


@pytest.mark.parametrize("mode", ["idempotent", "lookup_only", "none"])
async def test_kill_after_vendor_accept_in_each_vendor_mode(rig, sim, mode):
    """Killed after the vendor accepted (and charged) but before Progress recorded the job id.

    idempotent / lookup_only: the paid job is found again (resubmit under the key / lookup by key) and the
    task completes with one charge. none: the vendor cannot say, so nothing is resubmitted:
    Failure(unknown_outcome) + a cost_anomaly marker, and the task waits for a person (an open dead_letter
    request), still with at most one charge.
    """
    await sim.configure(mode=mode, executors={"video.motion": {"latency_seconds": 0.5}})
    rig.vendor_mode = mode
    plan = rig.plan(ONE_SHOT)
    op = op_key(plan.task_id, "shot")
    w1 = await rig.spawn(hold_at="vendor_accepted", hold_op=op)
    await rig.start(plan)
    held = await w1.held("vendor_accepted", op)
    seen = rig.events(plan.task_id)
    assert [c["job_id"] for c in await sim.charges(op)] == [held.fields["job"]]
    assert not [e for e in seen if e.operation_key == op and e.type == "Progress"]
    await rig.crash(w1)
    await rig.spawn()

    if mode != "none":
        await assert_invariants(rig.recorder, sim, [plan.task_id], seen=seen, rig=rig)
        charges = await sim.charges(op)
        outcome = resolutions(rig.events(plan.task_id))[op]
        assert len(charges) == 1 and outcome.payload["job_id"] == charges[0]["job_id"]
        assert_artifact(outcome)
        return

    def waiting_for_a_person(events):
        return fold(events).state.value == "WaitingHuman"

    await rig.wait_ledger(plan.task_id, waiting_for_a_person, timeout=60, what="WaitingHuman")
    events = rig.events(plan.task_id)
    failure = resolutions(events)[op]
    assert failure.type == "Failure" and failure.payload["kind"] == "unknown_outcome", failure
    anomalies = [e for e in events if e.type == "SystemMarker" and e.payload["kind"] == "cost_anomaly"]
    assert [a.operation_key for a in anomalies] == [op]
    summary = await rig.status(plan.task_id)
    assert summary["state"] == "WaitingHuman", summary
    assert [(r["kind"], r["node"]) for r in summary["open_requests"]] == [("dead_letter", "shot")]
    assert len(await sim.charges(op)) == 1
    # I1–I4 hold while it waits: the possibly-charged amount must be on the ledger too (I2), not only flagged.
    await assert_invariants(rig.recorder, sim, [plan.task_id], seen=seen, completed=False)


async def test_a_key_the_vendor_has_forgotten_is_looked_up_never_resubmitted(rig, sim):
    """An idempotent vendor remembers a key only for a while: a worker frozen past that must not resubmit.

    Old: the resumed attempt resubmitted under the key (idempotent mode: "the resubmission is the lookup");
    the vendor had forgotten the key, created a second job and billed it twice, and the ledger held one
    Outcome with no anomaly. Now a key older than the route's ``key_retention`` is looked up instead.
    """
    routes_file = rig.workdir / "routes.yaml"
    table = RouteTable(routes={"video.motion": RouteSpec(key_retention=1.0)})
    routes_file.write_text(yaml.safe_dump(table.model_dump(mode="json")))
    await sim.configure(executors={"video.motion": {"latency_seconds": 0.5, "key_retention_seconds": 1.5}})
    plan = rig.plan(ONE_SHOT)
    op = op_key(plan.task_id, "shot")
    w1 = await rig.spawn(hold_at="vendor_accepted", hold_op=op, LEDGERFLOW_ROUTES_FILE=str(routes_file))
    await rig.start(plan)
    held = await w1.held("vendor_accepted", op)
    seen = rig.events(plan.task_id)
    await asyncio.sleep(2.0)  # frozen past the vendor's memory of the key
    await rig.crash(w1)
    await rig.spawn(LEDGERFLOW_ROUTES_FILE=str(routes_file))
    await assert_invariants(rig.recorder, sim, [plan.task_id], seen=seen, rig=rig)
    charges = await sim.charges(op)
    assert [c["job_id"] for c in charges] == [held.fields["job"]]
    assert resolutions(rig.events(plan.task_id))[op].payload["job_id"] == held.fields["job"]
