"""A worker SIGKILLed while it holds a fallback's canary, during an outage of a route with a quota: another
worker finishes the canary under its own key and at its own route, the rest follow, and nothing shared is left
held — no canary claim, no quota slot — while every money invariant holds (one charge per key, ledger =
vendor, no INTENT left open)."""

from __future__ import annotations

import uuid
from typing import Any

import sqlalchemy as sa
import yaml
from faultkit import FaultRig, assert_invariants, new_task_id

from rules.plan import load_plan
from vendors.routes import load_table

PLAN = """
goal: shots through an outage
budget_ceiling: 40
concurrency: 2
stages:
  - {{id: shots, executor: {primary}, estimate: 0.40, fan_out: 4, canary: false, input: {{format: json}}}}
"""


async def test_a_worker_killed_holding_the_canary_leaves_no_claim_or_slot_held(
    rig: FaultRig, sim: Any
) -> None:
    u = uuid.uuid4().hex[:8]
    primary, backup = f"fmo-{u}", f"fmo-{u}-b"
    routes_file = rig.workdir / "routes.yaml"
    routes = {
        primary: {
            "breaker": {"min_calls": 2, "error_rate": 0.5, "open_for": "600s"},
            "fallbacks": [backup],
            "concurrency": 2,
            "refused_statuses": [503],  # the simulator's server_error: "down, not taken"
        },
        backup: {"regression": "motion.yaml", "concurrency": 2},
    }
    routes_file.write_text(yaml.safe_dump({"routes": routes}))
    names = load_table(routes_file).names()
    await sim.configure(
        executors={
            primary: {"server_error": 1.0, "server_error_status": 503},
            backup: {"latency_seconds": 1.0},
        }
    )
    rig.recorder.record_qualification(backup, True, "regression passed", {}, "test")
    plan = load_plan(PLAN.format(primary=primary), names, task_id=new_task_id())
    assert plan.task_id is not None

    # The first job any vendor accepts is the fallback's canary (the primary refuses everything).
    w1 = await rig.spawn(
        hold_at="vendor_accepted", hold_op=":shots/", LEDGERFLOW_ROUTES_FILE=str(routes_file)
    )
    await rig.start(plan)
    held = await w1.held("vendor_accepted", ":shots/", timeout=60)
    canary = held.op
    claimed = rig.recorder.route_health()[backup]
    assert claimed.canary_key == canary and not claimed.canary_passed
    await rig.crash(w1)
    await rig.spawn(LEDGERFLOW_ROUTES_FILE=str(routes_file))

    await assert_invariants(rig.recorder, sim, [plan.task_id], rig=rig)
    health = rig.recorder.route_health()[backup]
    assert health.canary_key == canary and health.canary_passed  # the same operation finished it
    charges = await sim.charges(f"{plan.task_id}:")
    assert {c["executor"] for c in charges} == {backup} and len(charges) == 4
    assert [c["idempotency_key"] for c in charges].count(canary) == 1
    engine = sa.create_engine(rig.database_url)
    try:
        with engine.connect() as conn:
            held_slots = conn.execute(
                sa.text("SELECT count(*) FROM route_slots WHERE route IN (:a, :b)"),
                {"a": primary, "b": backup},
            ).scalar_one()
    finally:
        engine.dispose()
    assert held_slots == 0  # every slot went back with its operation's result, the killed worker's too
