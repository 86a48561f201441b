"""``ledgerflow evals``: review scores per composition version, regressions against the best earlier score."""

from __future__ import annotations

import json

from ledgerflow.views.versions import evals

PLAN = """
goal: three shots, reviewed until they hold together
budget_ceiling: 40
rework_limit: 2
stages:
  - {id: script, executor: llm.text, estimate: 0.10}
  - {id: shots, executor: image.keyframe, estimate: 0.40, depends_on: [script], fan_out: 3, canary: false}
"""


def judgement(visual: float, story: float, blame: str | None = None) -> str:
    return json.dumps(
        {"scores": {"visual": visual, "story": story}, "blame": {"visual": [blame] if blame else []}}
    )


async def test_a_slow_drift_below_the_best_earlier_score_is_flagged_as_a_regression(lf, sim):
    await sim.configure(
        chat_default=judgement(0.4, 0.90, "shots/S02"),
        chat_script=[
            {"match": '"shots/S01": 2', "content": judgement(0.9, 0.76)},
            {"match": '"shots/S02": 2', "content": judgement(0.4, 0.82, "shots/S01")},
        ],
    )
    plan = lf.plan(PLAN)
    result = await lf.run(plan)
    assert result.state == "Completed"
    rows = evals(lf.settings, plan.task_id, threshold=0.1)
    assert [(r.version, r.scores["story"]) for r in rows] == [(1, 0.90), (2, 0.82), (3, 0.76)]
    # Each step is under the threshold (0.08, 0.06); the drift from the best (0.14) is not.
    assert [r.regressions for r in rows] == [{}, {}, {"story": (0.90, 0.76)}]
