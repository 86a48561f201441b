"""End to end on real servers: plans run from submission to Completed, and the money adds up."""

from __future__ import annotations

from decimal import Decimal

from rules.events import parse
from rules.projection import fold

SMALL = """
goal: a three-stage smoke pipeline
budget_ceiling: 20
stages:
  - {id: script, executor: llm.text, estimate: 0.5}
  - {id: shots, executor: image.keyframe, estimate: 1, depends_on: [script], fan_out: 3}
  - {id: edit, executor: edit.assembly, estimate: 0.25, depends_on: [shots]}
"""


async def test_small_plan_completes_and_ledger_equals_vendor_charges(lf, sim):
    plan = lf.plan(SMALL)
    result = await lf.run(plan)
    assert result.state == "Completed", result.summary
    events = lf.recorder.read_events(plan.task_id)
    p = fold(events)
    outcome_total = sum((parse(e).actual_cost for e in events if e.type == "Outcome"), Decimal(0))
    assert outcome_total == await sim.total(plan.task_id)
    assert outcome_total == Decimal("3.75")
    assert p.reserved == 0
    assert {n: v.status.value for n, v in p.nodes.items()} == dict.fromkeys(p.nodes, "succeeded")
