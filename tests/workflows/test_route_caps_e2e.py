"""Issue 23 §4, end to end: a route's monthly cap (the vendor contract's ceiling) bounds what the vendor bills
on that route across tasks, and the dispatch that does not fit escalates naming ``route:R:YYYY-MM``. Real
Temporal, real Postgres, the simulator's own billing. The route is the test's own (fallbackkit.names)."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import Any

from fallbackkit import names

from ledger.recorder import Recorder
from rules.events import parse
from rules.projection import fold
from rules.recompute import recompute
from vendors.routes import Price, RouteSpec, RouteTable

PLAN = """
goal: {goal}
budget_ceiling: 40
concurrency: 2
stages:
  - {{id: shots, executor: {route}, estimate: 1.00, fan_out: 2, canary: false,
      input: {{aspect: "16:9", format: json}}}}
"""


async def test_a_routes_monthly_cap_bounds_its_vendor_billing_across_tasks_and_the_rest_escalates(
    lf_with: Any, sim: Any, recorder: Recorder
) -> None:
    route, _ = names()
    cap = Decimal("3.00")  # room for three 1.00 shots: two tasks of two shots each need four
    routes = RouteTable(routes={route: RouteSpec(price=Price(per_call=Decimal("1.00")), monthly_cap=cap)})
    async with lf_with(routes=routes) as lf:
        first = lf.plan(PLAN.format(goal="cap first", route=route))
        assert (await lf.run(first)).state == "Completed"
        second = lf.plan(PLAN.format(goal="cap second", route=route))
        handle = await lf.start(second)
        status = await lf.wait_state(handle, {"Escalated", "Completed", "Failed"})
        # The shot admitted before the refusal settles (nothing stays reserved on the month).
        (account,) = await _settled(recorder, f"route:{route}:")
        await handle.terminate("test over")

    assert status["state"] == "Escalated"
    p = fold(recorder.read_events(second.task_id))
    reason = p.escalation_reason or ""
    assert f"budget refused: {account.scope} has 0.00 left of 3.00" in reason, reason
    assert f"ledgerflow budget set {account.scope} N" in reason  # a person's add_budget cannot raise it
    events = recorder.read_events(second.task_id)
    refused = [e for e in events if e.type == "SystemMarker" and parse(e).kind == "intent_refused"]
    assert len(refused) == 1  # one shot did not fit; its INTENT was never written, nothing was sent
    assert recompute(events) == []  # the refusal's escalation included
    assert recompute(recorder.read_events(first.task_id)) == []

    # The vendor's own billing on this route: three shots, within the cap, and what the month's account holds.
    billed = [c for c in await sim.charges() if c["executor"] == route]
    vendor = sum((Decimal(c["amount"]) for c in billed), Decimal(0))
    assert len(billed) == 3 and vendor == cap == account.spent and account.reserved == 0
    assert account.ceiling == cap
    holds = recorder.route_holds(account.scope)
    assert len(holds) == 3 and all(h["settled_at"] is not None for h in holds)
    assert sum((h["spent"] for h in holds), Decimal(0)) == vendor


async def _settled(recorder: Recorder, prefix: str, timeout: float = 30.0) -> list[Any]:
    """The route's month accounts once nothing is reserved on them."""

    async def poll() -> list[Any]:
        while not (found := recorder.accounts(prefix)) or any(a.reserved for a in found):
            await asyncio.sleep(0.1)
        return found

    return await asyncio.wait_for(poll(), timeout)
