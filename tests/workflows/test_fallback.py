"""A vendor outage or a quality collapse mid-task, end to end: the route's shared breaker opens, the
dispatches switch to the qualified fallback — its canary first, the rest once the canary's output passed its
check — and the money stays exact by the vendor's own billing. Real Temporal, real Postgres, the simulator.

Every test runs its own routes (``mo-<id>`` and ``mo-<id>-b``), so one test's breaker never touches another's.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal
from typing import Any

import httpx
from fallbackkit import check_money, names, outage_routes

from ledger.recorder import Recorder
from vendors.routes import Price, RouteSpec, RouteTable

PLAN = """
goal: {goal}
budget_ceiling: 40
rework_limit: 1
concurrency: {concurrency}
stages:
  - {{id: shots, executor: {primary}, estimate: 0.40, fan_out: {width}, canary: false,
      input: {{aspect: "16:9", format: json}}}}
"""
PASS = json.dumps({"scores": {"visual": 0.9}, "blame": {}, "reasons": []})


def intents(recorder: Recorder, task_id: str) -> list[Any]:
    return [e for e in recorder.read_events(task_id) if e.type == "Intent" and e.payload.get("route")]


async def test_an_outage_opens_the_breaker_and_the_shots_move_to_the_fallback_canary_first(
    lf_with: Any, sim: Any, recorder: Recorder
) -> None:
    primary, backup = names()
    await sim.configure(executors={primary: {"server_error": 1.0, "server_error_status": 503}})
    recorder.record_qualification(backup, True, "regression passed", {"scores": [0.9]}, "test")
    async with lf_with(routes=outage_routes(primary, backup)) as lf:
        plan = lf.plan(PLAN.format(goal="outage", concurrency=2, primary=primary, width=6))
        result = await lf.run(plan)

    assert result.state == "Completed"
    opened = [c for c in recorder.route_changes(primary) if c["kind"] == "opened"]
    # at least min_calls (2) calls, all failed (two observations at once may both miss the other's row)
    assert len(opened) == 1 and re.fullmatch(r"(\d+) of \1 calls failed in 60s", opened[0]["reason"])
    assert [c["kind"] for c in reversed(recorder.route_changes(backup))][1:] == ["switched", "canary_passed"]

    routed = intents(recorder, plan.task_id)
    on_primary = [i for i in routed if i.payload["route"] == primary]
    on_backup = [i for i in routed if i.payload["route"] == backup]
    assert len(on_primary) == 2  # the two in flight when it went down: refused (503), voided, sent again
    assert len(on_backup) == 6 and on_backup[0].payload["route_claim"] == "canary"
    canary_key = on_backup[0].operation_key
    events = recorder.read_events(plan.task_id)
    canary_done = next(e for e in events if e.type == "Outcome" and e.operation_key == canary_key)
    assert all(i.recorded_at > canary_done.recorded_at for i in on_backup[1:])

    charges = await check_money(sim, recorder, plan.task_id)
    assert {c["executor"] for c in charges} == {backup}  # the 503s were refusals: nothing billed there
    job = httpx.get(f"{sim.url}/admin/jobs/{charges[0]['job_id']}").json()
    assert job["executor"] == backup and job["input"]["ratio"] == "16:9" and "aspect" not in job["input"]


async def test_a_collapsing_first_pass_rate_opens_the_breaker_and_the_rework_runs_on_the_fallback(
    lf_with: Any, sim: Any, recorder: Recorder
) -> None:
    primary, backup = names()
    blamed = json.dumps(
        {
            "scores": {"visual": 0.3},
            "blame": {"visual": [f"shots/S0{i}" for i in range(1, 5)]},
            "reasons": ["every shot is off-model"],
        }
    )
    # The first outputs (version 1) are all blamed; the remade ones (version 2) pass.
    await sim.configure(chat_default=blamed, chat_script=[{"match": '"shots/S01": 2', "content": PASS}])
    recorder.record_qualification(backup, True, "regression passed", {"scores": [0.9]}, "test")
    routes = outage_routes(primary, backup, quality_min_reviews=4, quality_pass_rate=0.5)
    async with lf_with(routes=routes) as lf:
        plan = lf.plan(PLAN.format(goal="quality", concurrency=4, primary=primary, width=4))
        result = await lf.run(plan)

    assert result.state == "Completed"
    (opened,) = [c for c in recorder.route_changes(primary) if c["kind"] == "opened"]
    assert opened["reason"].startswith("quality collapse: 0 of 4 outputs passed their first review")
    routed = intents(recorder, plan.task_id)
    assert [i.payload["route"] for i in routed] == [primary] * 4 + [backup] * 4
    assert routed[4].payload["route_claim"] == "canary"
    charges = await check_money(sim, recorder, plan.task_id)
    assert sorted(c["executor"] for c in charges) == [primary] * 4 + [backup] * 4
    assert sum(Decimal(c["amount"]) for c in charges) > 0


async def test_a_route_quota_holds_across_tasks_and_every_task_completes(
    lf_with: Any, sim: Any, recorder: Recorder
) -> None:
    route, _ = names()
    await sim.configure(executors={route: {"latency_seconds": 0.3}})
    routes = RouteTable(routes={route: RouteSpec(concurrency=2)})
    async with lf_with(routes=routes) as lf:
        plans = [
            lf.plan(PLAN.format(goal=f"quota {i}", concurrency=4, primary=route, width=4)) for i in range(2)
        ]
        handles = [await lf.start(p) for p in plans]
        results = [await h.result() for h in handles]

    assert [r.state for r in results] == ["Completed", "Completed"]
    spans = []  # (INTENT written, result written) of every operation on the route, both tasks
    for p in plans:
        events = recorder.read_events(p.task_id)
        ends = {e.operation_key: e.recorded_at for e in events if e.dedup_key.endswith(":result")}
        spans += [(i.recorded_at, ends[i.operation_key]) for i in intents(recorder, p.task_id)]
        await check_money(sim, recorder, p.task_id)
    assert len(spans) == 8
    edges = sorted([(t, 1) for t, _ in spans] + [(t, -1) for _, t in spans], key=lambda x: (x[0], x[1]))
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    assert peak == 2  # never more than the quota in flight, and the quota was used


async def test_a_route_billing_far_above_its_declared_price_trips_its_breaker_like_a_failed_call(
    lf_with: Any, sim: Any, recorder: Recorder
) -> None:
    primary, backup = names()
    # The primary answers every call, but bills three times its own declared price: a price gone wrong.
    await sim.configure(executors={primary: {"cost_multiplier": "3"}})
    recorder.record_qualification(backup, True, "regression passed", {"scores": [0.9]}, "test")
    table = outage_routes(primary, backup, min_calls=1)  # one billing observation per task and window
    priced = table.routes[primary].model_copy(update={"price": Price(per_call=Decimal("0.40"))})
    async with lf_with(routes=RouteTable(routes={**table.routes, primary: priced})) as lf:
        plan = lf.plan(PLAN.format(goal="billing", concurrency=2, primary=primary, width=6))
        result = await lf.run(plan)

    assert result.state == "Completed"
    (opened,) = [c for c in recorder.route_changes(primary) if c["kind"] == "opened"]
    assert re.fullmatch(r"1 of [12] calls failed in 60s", opened["reason"])
    assert recorder.observations(primary).get("anomaly", 0) == 1
    routed = intents(recorder, plan.task_id)
    on_primary = [i for i in routed if i.payload["route"] == primary]
    # min_calls (2) tripled bills open it; a dispatch or two may be chosen while those are being observed
    assert 2 <= len(on_primary) <= 4 and len(routed) - len(on_primary) >= 2  # the rest on the fallback
    charges = await check_money(sim, recorder, plan.task_id)  # every charge, the tripled ones too
    assert sorted({c["executor"] for c in charges}) == sorted({primary, backup})
