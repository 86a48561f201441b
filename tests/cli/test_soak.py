"""``ledgerflow soak``'s report: verdicts, end states and money read back from the ledger and the vendor."""

from __future__ import annotations

import json

from ledgerflow.runs.soak import tally

PLAN = """
goal: {goal}
budget_ceiling: 20
stages:
  - {{id: script, executor: llm.text, estimate: 0.10}}
  - {{id: shots, executor: image.keyframe, estimate: 0.40, depends_on: [script], fan_out: 2, canary: false}}
"""
PASS = json.dumps({"scores": {"visual": 0.9}, "blame": {}, "reasons": []})
REWORK = json.dumps({"scores": {"visual": 0.4}, "blame": {"visual": ["shots/S01"]}, "reasons": ["off"]})


async def test_tally_counts_every_review_verdict_and_checks_the_ledger_against_the_vendor(lf, sim):
    await sim.configure(
        chat_default=PASS,
        chat_script=[
            {"match": '"shots/S01": 2', "content": PASS},  # the repaired version passes
            {"match": "needs a second look", "content": REWORK},
        ],
    )
    fine, reworked = (
        lf.plan(PLAN.format(goal="fine as it is")),
        lf.plan(PLAN.format(goal="needs a second look")),
    )
    results = [await lf.run(fine), await lf.run(reworked)]
    assert [r.state for r in results] == ["Completed", "Completed"]

    report = tally(lf.recorder, [fine.task_id, reworked.task_id], sim.url)

    assert report.review_verdicts == {"Pass": 2, "QualityRework": 1}
    assert report.last_verdicts == {"Pass": 2}
    assert report.end_states == {"Completed": 2}
    assert report.rework_rounds == {0: 1, 1: 1}
    assert report.repaired == 1 and report.gate_failures == 0
    assert report.duplicate_charges == 0
    assert report.vendor_total == await sim.total(fine.task_id) + await sim.total(reworked.task_id)
    assert report.ledger_total == report.vendor_total > 0 and report.clean
    # one generation charge per Outcome: the first task's 3 (script, two shots), the second's 3 and its rework
    # of shots/S01 (the reviews' LLM calls are billed apart)
    assert report.operations == report.outcomes == 7
    # a hop per node with dependencies, first dispatch only: two shots, compose, review, for each task
    assert len(report.hops) == 8 and all(0 <= h < 30 for h in report.hops)
