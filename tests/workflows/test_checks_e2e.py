"""Review phase 1 end to end: rights and media bounds judged on what the vendor reported, on real servers.

The simulator is the only stand-in; its seeded draws decide which attempts deliver faulty metadata.
"""

from __future__ import annotations

from decimal import Decimal

from rules.events import parse
from rules.projection import fold
from rules.table import operation_key
from vendors.simulator import Draw, ExecutorProfile

ASKED = "{format: mp4, duration_s: 30, width: 1920, height: 1080}"
PIPELINE = f"""
goal: a short edit
budget_ceiling: 10
stages:
  - {{id: script, executor: llm.text, estimate: 0.10}}
  - id: edit
    executor: edit.assembly
    estimate: 0.20
    depends_on: [script]
    input: {ASKED}
    output: {{formats: [mp4], duration: [20, 40], min_width: 1280, min_height: 720}}
"""


def events_of(lf, task_id, type_):
    return [parse(e) for e in lf.recorder.read_events(task_id) if e.type == type_]


def review_results(lf, task_id):
    return [e for e in events_of(lf, task_id, "ExecutionResult") if e.kind == "review"]


async def test_an_artifact_without_rights_blocks_the_task_with_no_rollback_and_no_paid_review(lf, sim):
    await sim.configure(executors={"edit.assembly": {"missing_rights": 1.0}})
    plan = lf.plan(PIPELINE)

    result = await lf.run(plan)

    assert result.state == "Failed" and result.summary["verdict"] == "ComplianceBlock"
    [review] = review_results(lf, plan.task_id)
    assert review.findings == ("compliance.rights: edit has no rights metadata",)
    assert review.flagged == ("edit",)
    assert review.actual_cost == 0  # the short-circuit skipped the paid judgement
    assert events_of(lf, plan.task_id, "Rollback") == []
    p = fold(lf.recorder.read_events(plan.task_id))
    assert p.rework_rounds == 0 and {n: v.attempts for n, v in p.nodes.items()}["edit"] == 1
    assert [c["idempotency_key"] for c in await sim.charges(plan.task_id)] == [
        f"{plan.task_id}:script:a1",
        f"{plan.task_id}:edit:a1",
    ]  # nothing was spent on rework


def _seed_bad_then_good(task_id: str, profile: ExecutorProfile) -> int:
    """The first simulator seed whose draws give edit's first attempt bad media and its second good media.

    The draws depend on (seed, operation key, vendor attempt) only, so this picks the faults exactly.
    """
    first, second = operation_key(task_id, "edit", 1), operation_key(task_id, "edit", 2)
    return next(
        seed
        for seed in range(10_000)
        if Draw.for_attempt(seed, first, 0, profile).bad_media
        and not Draw.for_attempt(seed, second, 0, profile).bad_media
    )


async def test_media_outside_the_stage_s_bounds_is_reworked_then_the_task_completes(lf, sim):
    profile = {"bad_media": 0.5}
    plan = lf.plan(PIPELINE)
    assert plan.task_id is not None
    seed = _seed_bad_then_good(plan.task_id, ExecutorProfile(**profile))
    await sim.configure(seed=seed, executors={"edit.assembly": profile})

    result = await lf.run(plan)

    assert result.state == "Completed" and result.summary["verdict"] == "Pass"
    first, second = review_results(lf, plan.task_id)
    assert first.verdict == "QualityRework" and first.flagged == ("edit",)
    assert first.findings == (
        "technical.media: edit format gif is not one of mp4; duration 60s is outside 20-40s; "
        "width 960 is below 1280; height 540 is below 720",
    )
    assert second.verdict == "Pass"
    [rollback] = events_of(lf, plan.task_id, "Rollback")
    assert rollback.flagged == ("edit",) and "script" not in rollback.invalidated
    outcomes = [e for e in events_of(lf, plan.task_id, "Outcome") if e.node == "edit"]
    assert [e.operation_key for e in outcomes] == [
        operation_key(plan.task_id, "edit", 1),
        operation_key(plan.task_id, "edit", 2),
    ]
    assert [o.artifact.media.format for o in outcomes] == ["gif", "mp4"]  # recorded with each artifact
    assert await sim.total(f"{plan.task_id}:edit:") == Decimal("0.40")  # two paid attempts, no more


async def test_the_static_gate_blocks_a_node_whose_input_has_no_rights_before_it_spends(lf, sim):
    await sim.configure(executors={"llm.text": {"missing_rights": 1.0}})
    plan = lf.plan(PIPELINE.replace("    depends_on: [script]", "    depends_on: [script]\n    gate: true"))

    result = await lf.run(plan)

    assert result.state == "Failed" and "compliance gate failed: edit" in result.summary["terminal_reason"]
    [gate] = [e for e in events_of(lf, plan.task_id, "ExecutionResult") if e.kind == "gate"]
    assert not gate.passed and gate.findings == ("compliance.rights: script has no rights metadata",)
    assert await sim.charges(f"{plan.task_id}:edit") == []
