"""Compensation is money too (rules.plan.Compensation): an undo the project cannot afford is not skipped and
does not overdraw the project — the task asks a person with the undo pending, and undoes once budget is
added. Real Temporal, real Postgres, the simulator; money from the vendor's own billing."""

from __future__ import annotations

import re
import uuid
from decimal import Decimal
from typing import Any

from peoplekit import wait_open

from ledger.recorder import Recorder
from ledgerflow.views import people
from rules.events import vendor_spend
from rules.projection import fold
from rules.recompute import recompute
from runtime.signing import demo_key
from vendors.routes import RouteSpec, RouteTable

PLAN = """
goal: publish two clips, then a person aborts
project: {project}
budget_ceiling: 20
approval: {{timeout: 1h, policy: escalate}}
stages:
  - {{id: publish, executor: {pub}, estimate: 1, fan_out: 2, canary: false,
      compensation: {{executor: {unpub}, estimate: 0.5, input: {{action: unpublish}}}}}}
  - {{id: board, executor: {pub}, estimate: 1, depends_on: [publish], approval: true}}
"""


async def test_an_undo_the_project_cannot_afford_asks_a_person_then_undoes(
    lf_with: Any, sim: Any, recorder: Recorder
) -> None:
    u = uuid.uuid4().hex[:8]
    pub, unpub, project = f"pub-{u}", f"unpub-{u}", f"cm-{u}"
    await sim.configure(executors={unpub: {"no_result": True}})
    # Room for the three generations (3.00) and little else: the first undo's 0.50 does not fit.
    recorder.set_ceiling(f"project:{project}", Decimal("3.20"))
    routes = RouteTable(routes={pub: RouteSpec(), unpub: RouteSpec()})
    async with lf_with(routes=routes) as lf:
        plan = lf.plan(PLAN.format(project=project, pub=pub, unpub=unpub))
        handle = await lf.start(plan)
        rid = await wait_open(lf, plan.task_id, "approval:board")
        aborted = await people.decide(lf.settings, demo_key("producer"), plan.task_id, rid, "abort")
        assert aborted.status == "accepted"
        undo = await wait_open(lf, plan.task_id, "undo:")
        events = recorder.read_events(plan.task_id)
        assert not [e for e in events if e.type == "Intent" and e.payload["action"]["kind"] == "Compensate"]
        status = await handle.query("status")
        assert status["state"] == "Compensating"  # not Failed: the undo is pending, not skipped
        fold_now = fold(events)
        escalation = fold_now.requests[undo].request
        # The newest output first (the two publishes run at once: either may have finished last).
        assert re.match(r"undo of publish/S0[12]'s output waits for budget: ", escalation.reason)
        assert escalation.budget_scope == f"project:{project}"
        account = recorder.account(f"project:{project}")
        assert account is not None and account.spent + account.reserved <= account.ceiling  # never overdrawn
        added = await people.decide(
            lf.settings, demo_key("producer"), plan.task_id, undo, "add-budget", amount="1.00"
        )
        assert added.status == "accepted", added
        # The add_budget is the answer: it closes the request (as resume would), and R12 undoes.
        assert not fold(recorder.read_events(plan.task_id)).requests[undo].open
        result = await handle.result()

    assert result.state == "Failed"
    assert {v["state"] for v in result.summary["compensations"].values()} == {"undone"}
    events = recorder.read_events(plan.task_id)
    assert await sim.total(f"{plan.task_id}:") == vendor_spend(events)  # both undos billed and recorded once
    account = recorder.account(f"project:{project}")
    assert account is not None and account.spent == Decimal("4.00") <= account.ceiling == Decimal("4.20")
    assert recompute(events) == []
