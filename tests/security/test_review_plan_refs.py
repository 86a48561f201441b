"""Issue 24 §4: a value shaped like an artifact reference (a mapping with a ``uri`` and a ``sha256``) in a
plan's free ``input`` is refused at validation in one line: references come only from ``inputs:`` (an upstream
stage's registered output), never from what a plan author types. A plain client that skips ``submit`` is
refused the same way when the task opens."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from temporalio.client import WorkflowFailureError

from rules.plan import Plan, PlanError, load_plan
from vendors.routes import DEFAULT_ROUTES

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LEAK = "{uri: 'file:///etc/hostname', sha256: " + "'" + "ab" * 32 + "'}"


def plan_with(input_text: str, where: str = "input") -> str:
    return (
        "goal: g\nbudget_ceiling: 5\nstages:\n"
        f"  - {{id: a, executor: llm.text, estimate: 1, {where}: {input_text}}}\n"
    )


@pytest.mark.parametrize(
    ("value", "path"),
    [
        (f"{{keyframe: {LEAK}}}", "input.keyframe"),
        (f"{{style: {{refs: [1, {LEAK}]}}}}", "input.style.refs[1]"),
    ],
)
def test_an_artifact_reference_in_a_stage_input_is_refused_in_one_line(value, path):
    with pytest.raises(PlanError) as refused:
        load_plan(plan_with(value), DEFAULT_ROUTES)
    assert str(refused.value) == (
        f"stage 'a': {path} is an artifact reference (uri and sha256): a stage receives artifacts only "
        "through inputs: naming an upstream stage"
    )


def test_an_artifact_reference_in_a_compensation_input_is_refused_too():
    text = plan_with("{executor: llm.text, input: {undo: " + LEAK + "}}", where="compensation")
    with pytest.raises(PlanError, match=r"^stage 'a': compensation\.input\.undo is an artifact reference"):
        load_plan(text, DEFAULT_ROUTES)


def test_a_uri_or_a_sha256_alone_is_ordinary_input():
    plan = load_plan(
        plan_with("{source: 'https://example.com/a.png', sha256: '" + "ab" * 32 + "'}"), DEFAULT_ROUTES
    )
    assert plan.stages[0].input["source"] == "https://example.com/a.png"


def test_no_example_plan_relies_on_a_typed_reference():
    plans = sorted(p for p in EXAMPLES.glob("*.yaml") if p.name != "routes.yaml")
    assert plans, EXAMPLES
    for path in plans:
        load_plan(path.read_text(), DEFAULT_ROUTES)  # each still validates


async def test_a_plain_client_starting_such_a_task_is_refused_when_it_opens(lf):
    # Built by the model alone, as a plain Temporal client's payload is decoded: no validator has seen it.
    raw = load_plan(plan_with("{topic: x}"), DEFAULT_ROUTES).model_dump(mode="json", exclude_unset=True)
    raw["stages"][0]["input"] = {"keyframe": {"uri": "file:///etc/hostname", "sha256": "ab" * 32}}
    raw["task_id"] = lf.plan(plan_with("{topic: x}")).task_id
    handle = await lf.start(Plan.model_validate(raw))
    with pytest.raises(WorkflowFailureError) as failed:
        await asyncio.wait_for(handle.result(), 30)
    cause = str(failed.value.cause)
    assert "invalid plan: stage 'a': input.keyframe is an artifact reference" in cause, cause
