"""A ceiling bounds spend, not estimates (rules.pricing), on the real servers, checked from the vendor's own
billing: a vendor that bills 5× the plan's estimate, a route whose price the ledger has learned, a route that
declares its price."""

from __future__ import annotations

import asyncio
import uuid
from decimal import Decimal

from rules.events import parse, vendor_spend
from rules.recompute import recompute
from vendors.routes import Price, RouteSpec, RouteTable

FAN_OUT = """
goal: keyframes from a vendor that bills more than the plan thinks
budget_ceiling: 10
stages:
  - {{id: keys, executor: {executor}, estimate: 0.50, fan_out: 12}}
"""


async def _settled(lf, handle) -> dict:
    """The task's status once it finished or stopped to ask a person, with nothing it sent still in flight."""
    while True:
        status = await lf.wait_state(handle, {"Completed", "Escalated", "WaitingHuman"}, timeout=60)
        if not any(n["in_flight"] for n in status["nodes"].values()):
            return status
        await asyncio.sleep(0.1)


async def _billed(sim, task_id: str) -> Decimal:
    """What the vendor billed the task's generations (its model calls are billed apart, as chat)."""
    charges = await sim.charges(f"{task_id}:")
    return sum((Decimal(c["amount"]) for c in charges if c.get("protocol") != "chat"), Decimal(0))


def _dispatches(events: list) -> list:
    return [
        e.action
        for e in map(parse, events)
        if e.type == "Intent" and e.action.kind == "Dispatch" and e.action.node.startswith("keys/")
    ]


async def test_a_vendor_billing_five_times_the_estimate_is_stopped_at_the_ceiling(lf, sim):
    # Before price books, every node was admitted at 0.50 and settled at 2.50: 12 × 2.50 = 30 of 10 spent.
    await sim.configure(executors={"image.keyframe": {"cost_multiplier": "5"}})
    plan = lf.plan(FAN_OUT.format(executor="image.keyframe"))
    handle = await lf.start(plan)
    status = await _settled(lf, handle)
    events = lf.recorder.read_events(plan.task_id)
    billed = await _billed(sim, plan.task_id)
    assert billed == vendor_spend(events)  # the vendor's own billing, not the ledger alone
    assert billed <= plan.budget_ceiling  # the canary's overrun priced the rest: nothing past the ceiling
    canary, *rest = _dispatches(events)
    assert canary.estimate == Decimal("0.50") and rest, "the fan-out widened after its canary"
    assert all(d.estimate == Decimal("2.50") and d.plan_estimate == Decimal("0.50") for d in rest)
    assert all(d.priced_by == "observed: the stage's dearest result in this task" for d in rest)
    reason = status["escalation_reason"] or ""
    observed = "observed: the stage's dearest result in this task"
    assert f"needs 2.500000 ({observed}; the plan estimated 0.5)" in reason
    assert f"the stage's {12 - len(rest) - 1} nodes not yet run would cost" in reason
    assert recompute(events) == []  # every admission recomputes from the record


async def test_a_price_learned_from_the_ledger_prices_a_new_task_and_is_recorded(lf_with, sim):
    route = f"px-{uuid.uuid4().hex[:8]}"  # a route no other test writes results for
    await sim.configure(executors={route: {"cost_multiplier": "3"}})
    table = RouteTable(routes={route: RouteSpec()})
    plan_text = FAN_OUT.format(executor=route).replace("fan_out: 12", "fan_out: 5, canary: false")
    async with lf_with(routes=table, price_history=50, price_cache_seconds=0) as lf:
        first = lf.plan(plan_text.replace("budget_ceiling: 10", "budget_ceiling: 30"))
        assert (await lf.run(first)).state == "Completed"  # five results at 3× the estimate
        second = lf.plan(plan_text)
        handle = await lf.start(second)
        await _settled(lf, handle)
    events = lf.recorder.read_events(second.task_id)
    created = parse(events[0])
    assert created.prices is not None
    book = created.prices.stages["keys"]
    assert (book.learned_ratio, book.learned_route, book.learned_results) == (Decimal("3"), route, 5)
    first_dispatch = _dispatches(events)[0]
    assert first_dispatch.estimate == Decimal("1.50")  # 0.50 × the learned 3, before anything ran
    assert first_dispatch.priced_by == f"learned: p95 3.000000× the estimate over 5 results of route {route}"
    assert await _billed(sim, second.task_id) == vendor_spend(events) <= second.budget_ceiling
    assert recompute(events) == []


async def test_a_declared_price_bounds_what_a_node_reserves(lf_with, sim):
    route = f"pd-{uuid.uuid4().hex[:8]}"
    table = RouteTable(routes={route: RouteSpec(price=Price(per_call=Decimal("0.80")))})
    async with lf_with(routes=table) as lf:
        plan = lf.plan(FAN_OUT.format(executor=route).replace("fan_out: 12", "fan_out: 2"))
        assert (await lf.run(plan)).state == "Completed"
    events = lf.recorder.read_events(plan.task_id)
    assert {(d.estimate, d.priced_by) for d in _dispatches(events)} == {
        (Decimal("0.80"), f"declared by route {route}")
    }
    assert recompute(events) == []
