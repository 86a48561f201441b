"""A worker SIGKILLed in a failed task's compensating phase, just after the vendor accepted an undo: another
worker finishes that same undo under its own key, the other output is undone too, and every money invariant
holds (one charge per key, ledger = vendor, no INTENT left open)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import yaml
from faultkit import FaultRig, assert_invariants, new_task_id

from rules.plan import load_plan
from vendors.routes import load_table

PLAN = """
goal: publish, then run out of time
budget_ceiling: 40
time_ceiling: 8s
stages:
  - {{id: publish, executor: {pub}, estimate: 1, fan_out: 2, canary: false,
      compensation: {{executor: {unpub}, estimate: 0.5}}}}
  - {{id: after, executor: {slow}, estimate: 1, depends_on: [publish]}}
"""


async def _held_mid_undo(rig: FaultRig, sim: Any) -> tuple[Any, Any, str, Path]:
    """A task past its ceiling, compensating; its worker frozen just after the vendor accepted an undo.
    Returns (the plan, the hold's mark, the undo route, the route file)."""
    u = uuid.uuid4().hex[:8]
    pub, unpub, slow = f"pub-{u}", f"unpub-{u}", f"slow-{u}"
    routes_file = rig.workdir / "routes.yaml"
    routes_file.write_text(yaml.safe_dump({"routes": {pub: {}, unpub: {}, slow: {}}}))
    await sim.configure(executors={slow: {"latency_seconds": 120.0}, unpub: {"latency_seconds": 1.0}})
    plan = load_plan(
        PLAN.format(pub=pub, unpub=unpub, slow=slow), load_table(routes_file).names(), task_id=new_task_id()
    )
    w1 = await rig.spawn(hold_at="vendor_accepted", hold_op=":undo", LEDGERFLOW_ROUTES_FILE=str(routes_file))
    await rig.start(plan)
    held = await w1.held("vendor_accepted", ":undo", timeout=60)
    await rig.crash(w1)
    return plan, held, unpub, routes_file


async def _check_undone(rig: FaultRig, sim: Any, plan: Any, held: Any, unpub: str) -> None:
    result = await rig.result(plan.task_id)
    assert result.state == "Failed" and result.summary["terminal_reason"].startswith("time ceiling")
    compensations = result.summary["compensations"]
    assert len(compensations) == 2 and {c["state"] for c in compensations.values()} == {"undone"}
    await assert_invariants(rig.recorder, sim, [plan.task_id], rig=rig, completed=False)
    charges = await sim.charges(f"{plan.task_id}:")
    undos = [c["idempotency_key"] for c in charges if c["executor"] == unpub]
    assert sorted(undos) == sorted(f"{k}:undo1" for k in compensations) and held.op in undos


async def test_a_worker_killed_mid_undo_leaves_the_undo_to_another_worker_paid_once(
    rig: FaultRig, sim: Any
) -> None:
    plan, held, unpub, routes_file = await _held_mid_undo(rig, sim)
    await rig.spawn(LEDGERFLOW_ROUTES_FILE=str(routes_file))
    await _check_undone(rig, sim, plan, held, unpub)


async def test_a_compensating_task_whose_workflow_was_terminated_is_resumed_and_finishes_its_undo(
    rig: FaultRig, sim: Any
) -> None:
    """`ledgerflow resume` treats a task still compensating as unfinished; the new run adopts the undo the
    lost run had started (same key: the vendor's job is found, not paid again) and undoes the rest."""
    plan, held, unpub, routes_file = await _held_mid_undo(rig, sim)
    await rig.handle(plan.task_id).terminate("fault test: the run is gone")
    await rig.spawn(LEDGERFLOW_ROUTES_FILE=str(routes_file))
    done = await rig.cli("resume", plan.task_id)
    assert done.returncode == 0, f"ledgerflow resume failed ({done.returncode}): {done.stdout}{done.stderr}"
    await _check_undone(rig, sim, plan, held, unpub)
