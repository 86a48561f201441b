"""Issue 23 §3 and §5 end to end: real Temporal, real Postgres, the simulator misbehaving.

§3 "One money gate for every figure": a prediction whose compute seconds are NaN, infinite or negative, and a
model whose usage says negative tokens, are counted at their estimate with a cost anomaly holding the raw
figure — the paid output kept, no exception after the work was paid, no retry loop.
§5 "Breakers judge vendors, not plans": a plan's tiny estimate never opens a route's shared breaker; a vendor
billing far above the route's own declared price does (one observation per task per breaker window). The
money is checked from the simulator's own billing.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from decimal import Decimal
from typing import Any

import pytest
from fallbackkit import check_money, names

from ledger.recorder import Recorder
from rules.events import parse
from vendors.routes import AdapterKind, Breaker, Price, RouteSpec, RouteTable, VendorMode

ONE_SHOT = """
goal: one paid shot
budget_ceiling: 20
review: {{reviewers: [compliance.rules], require_rights: false}}
stages:
  - {{id: shot, executor: {executor}, estimate: 1.5, retries: 2}}
"""
FAN = """
goal: {goal}
budget_ceiling: 40
rework_limit: 1
concurrency: {width}
review: {{reviewers: [compliance.rules]}}
stages:
  - {{id: shots, executor: {primary}, estimate: {estimate}, fan_out: {width}, canary: false,
      input: {{aspect: "16:9", format: json}}}}
"""
JUDGED = """
goal: one judged shot
budget_ceiling: 20
stages:
  - {{id: shot, executor: {executor}, estimate: 0.40}}
"""
PASS = json.dumps({"scores": {"visual": 0.9}, "blame": {}, "reasons": []})
PRICE = Decimal("0.10")  # the route's declared price per call


def events_of(recorder: Recorder, task_id: str, type_: str) -> list[Any]:
    return [parse(e) for e in recorder.read_events(task_id) if e.type == type_]


def anomalies(recorder: Recorder, task_id: str) -> list[Any]:
    return [m for m in events_of(recorder, task_id, "SystemMarker") if m.kind == "cost_anomaly"]


async def within(aw: Any, seconds: float = 60.0) -> Any:
    """``aw``, or a failure naming the retry loop the old code fell into."""
    try:
        return await asyncio.wait_for(aw, seconds)
    except TimeoutError:
        raise AssertionError(f"the task did not end within {seconds:g}s (a retry loop?)") from None


# ── §3: a bad usage figure never throws a paid output away ───────────────────────────────────────────────
@pytest.mark.parametrize("figure", ["NaN", "1e400", "-5"])
async def test_prediction_seconds_that_are_no_number_keep_the_paid_output_at_the_estimate(
    lf_with: Any, sim: Any, recorder: Recorder, figure: str
) -> None:
    """Old: NaN or 1e400 seconds raised InvalidOperation after the prediction was made and paid, and the
    settlement was retried without end; -5 seconds priced the job at less than nothing ("no cost")."""
    name = f"video.{uuid.uuid4().hex[:8]}"
    spec = RouteSpec(
        adapter=AdapterKind.PREDICTIONS,
        mode=VendorMode.LOOKUP_ONLY,
        price=Price(per_second=0.3),
        # The one place Replicate keeps our OperationKey: the simulator bills each prediction under it.
        webhook_url="https://hooks.ledgerflow.test/r?operation_key={operation_key}",
    )
    async with lf_with(routes=RouteTable(routes={name: spec})) as lf:
        await sim.configure(executors={name: {"latency_seconds": 0.2, "predict_time_override": figure}})
        plan = lf.plan(ONE_SHOT.format(executor=name))
        result = await within(lf.run(plan))
    assert result.state == "Completed"
    [outcome] = [o for o in events_of(recorder, plan.task_id, "Outcome") if o.node == "shot"]
    assert outcome.actual_cost == Decimal("1.5")  # the estimate: never less, never zero
    [flag] = [a for a in anomalies(recorder, plan.task_id) if a.node == "shot"]
    assert "seconds" in flag.detail and "counted at the estimate 1.5" in flag.detail
    assert str(float(figure)) in flag.detail  # the raw figure
    charges = await sim.charges(f"{plan.task_id}:")
    assert len(charges) == 1  # one prediction, paid once: no retry made another
    intents = events_of(recorder, plan.task_id, "Intent")
    shots = [i for i in intents if getattr(i.action, "node", "") == "shot"]
    assert len(shots) == 1  # dispatched once: the paid output was kept, not thrown away and redone


async def test_a_review_whose_model_reports_negative_tokens_settles_at_its_estimate(
    lf_with: Any, sim: Any, recorder: Recorder
) -> None:
    """Old: the review spent ``reply.cost`` outside the settle path; a usage of -500 tokens made the paid
    answer unreadable ("not a chat completion") and the model was asked, and paid, again and again."""
    await sim.configure(chat_default=PASS, chat_usage_override={"prompt_tokens": "-500"})
    async with lf_with() as lf:
        plan = lf.plan(JUDGED.format(executor="image.keyframe"))
        before = (await sim.http.get("/chat/stats")).json()["calls"]
        result = await within(lf.run(plan))
    assert (await sim.http.get("/chat/stats")).json()["calls"] == before + 1  # asked, and paid, once
    assert result.state == "Completed"
    [review] = [r for r in events_of(recorder, plan.task_id, "ExecutionResult") if r.kind == "review"]
    assert review.actual_cost == Decimal("0.05")  # the review's estimate (the plan's default)
    flags = [a for a in anomalies(recorder, plan.task_id) if a.node == review.node]
    assert any("prompt_tokens -500 is negative" in a.detail and "estimate 0.05" in a.detail for a in flags)


# ── §5: breakers judge vendors, not plans ────────────────────────────────────────────────────────────────
def priced_routes(primary: str, backup: str) -> RouteTable:
    # A window longer than the test: on a loaded machine the two tasks' calls may be more than a minute apart,
    # and the breaker must judge them together (what is tested is "once per task", not the window). A low
    # error rate: how many good calls (each task's second node, its review) land between the two tasks' one
    # counted anomaly each depends on how the tasks interleave; two failures among them must open it.
    breaker = Breaker(window=600.0, min_calls=2, error_rate=0.2, open_for=600.0)
    return RouteTable(
        routes={
            primary: RouteSpec(price=Price(per_call=PRICE), breaker=breaker, fallbacks=(backup,)),
            backup: RouteSpec(regression="regressions/motion.yaml", convert={"aspect": "ratio"}),
        }
    )


async def test_a_plan_with_a_tiny_estimate_never_opens_a_breaker_its_vendor_bills_normally(
    lf_with: Any, sim: Any, recorder: Recorder
) -> None:
    """Old: four nodes estimated at 0.001, billed the route's normal 0.10, were four 'failed calls' (0.10 >
    2 × 0.001): the route's shared breaker opened for every project because of one plan. Now admission
    reserves the declared 0.10 (rules.pricing); the vendor bills 0.15 — above every reservation, flagged for
    the plan's owner, yet within 2× its own price — so a charge above what was reserved still counts nothing
    against the route."""
    primary, backup = names()
    billed = Decimal("0.15")
    await sim.configure(executors={primary: {"cost": str(billed)}})
    async with lf_with(routes=priced_routes(primary, backup)) as lf:
        plan = lf.plan(FAN.format(goal="tiny", width=4, primary=primary, estimate="0.001"))
        result = await within(lf.run(plan))
    assert result.state == "Completed"
    assert [c for c in recorder.route_changes(primary) if c["kind"] == "opened"] == []
    assert recorder.observations(primary).get("anomaly", 0) == 0
    charges = await check_money(sim, recorder, plan.task_id)
    assert {c["executor"] for c in charges} == {primary} and len(charges) == 4
    assert await sim.total(f"{plan.task_id}:") == 4 * billed
    # Admission reserved the route's declared price, not the plan's 0.001 (rules.pricing) — or, for a node
    # decided after one of the fan-out settled, what that one cost.
    reserved = [
        (Decimal(e.payload["reservation"]), e.payload["action"]["priced_by"])
        for e in recorder.read_events(plan.task_id)
        if e.type == "Intent" and e.payload["action"].get("node", "").startswith("shots/")
    ]
    assert len(reserved) == 4 and (PRICE, f"declared by route {primary}") in reserved
    assert set(reserved) <= {
        (PRICE, f"declared by route {primary}"),
        (billed, "observed: the stage's dearest result in this task"),
    }
    # Each charge above its reservation is flagged for the plan's owner, never counted against the route.
    above = sum("above the reserved estimate" in a.detail for a in anomalies(recorder, plan.task_id))
    assert above == sum(r < billed for r, _ in reserved) >= 1


async def test_a_vendor_billing_far_above_its_declared_price_opens_its_breaker_once_per_task(
    lf_with: Any, sim: Any, recorder: Recorder
) -> None:
    primary, backup = names()
    await sim.configure(executors={primary: {"cost": "5.00"}})  # 50 × its declared 0.10 a call
    recorder.record_qualification(backup, True, "regression passed", {"scores": [0.9]}, "test")
    async with lf_with(routes=priced_routes(primary, backup)) as lf:
        # A generous estimate: the plan does not mind the bill, the vendor's price is what is off.
        plans = [
            lf.plan(FAN.format(goal=f"over {i}", width=2, primary=primary, estimate="6")) for i in (1, 2)
        ]
        handles = [await lf.start(p) for p in plans]
        results = await within(asyncio.gather(*(h.result() for h in handles)), 90)
    assert [r.state for r in results] == ["Completed", "Completed"]
    changes = recorder.route_changes(primary)
    assert len([c for c in changes if c["kind"] == "opened"]) == 1, (changes, recorder.observations(primary))
    # One billing observation per task per breaker window, however many of its nodes were overbilled.
    assert recorder.observations(primary).get("anomaly", 0) == 2
    for p in plans:
        await check_money(sim, recorder, p.task_id)  # every charge as billed, the 5.00s too
        flags = [a.detail for a in anomalies(recorder, p.task_id)]
        assert any("above 2x the route's own price 0.10" in f for f in flags)
