"""Issue 24 §6: a plan is refused, with one line naming the stage, unless the system can carry it.

Each case here was accepted by the validator before the caps (and then failed later, or never ended).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from limitskit import billion_laughs, fan_outs, nested

from rules.plan import (
    MAX_INPUT_BYTES,
    MAX_INPUT_DEPTH,
    MAX_NODES,
    PlanError,
    load_plan,
    validate_plan,
)
from vendors.routes import DEFAULT_ROUTES


def raw(**stage: Any) -> dict[str, Any]:
    return {
        "goal": "limits",
        "budget_ceiling": "10",
        "stages": [{"id": "deep", "executor": "llm.text", "estimate": "1", **stage}],
    }


def test_the_limits_are_what_the_issue_and_the_benchmarks_need() -> None:
    assert MAX_INPUT_DEPTH == 32
    assert MAX_INPUT_BYTES == 256 * 1024
    assert MAX_NODES >= 10_002  # `make bench-10k` runs a 10,002-node plan


def test_a_stage_input_nested_260_deep_is_refused_naming_the_stage() -> None:
    with pytest.raises(PlanError) as e:
        validate_plan(raw(input=nested(260)), DEFAULT_ROUTES)
    assert str(e.value) == f"stage 'deep': input is nested deeper than {MAX_INPUT_DEPTH} levels"


def test_a_stage_input_at_the_depth_limit_is_accepted() -> None:
    plan = validate_plan(raw(input=nested(MAX_INPUT_DEPTH)), DEFAULT_ROUTES)
    assert plan.stages[0].input["a"]["a"]
    with pytest.raises(PlanError, match="nested deeper than 32"):
        validate_plan(raw(input=nested(MAX_INPUT_DEPTH + 1)), DEFAULT_ROUTES)


def test_lists_count_as_levels_too_and_a_compensation_input_is_held_to_the_same_caps() -> None:
    deep_list: Any = 1
    for _ in range(100):
        deep_list = [deep_list]
    with pytest.raises(PlanError, match=r"^stage 'deep': input is nested deeper"):
        validate_plan(raw(input={"k": deep_list}), DEFAULT_ROUTES)
    undo = {"executor": "llm.text", "input": nested(100)}
    with pytest.raises(PlanError, match=r"^stage 'deep': compensation\.input is nested deeper"):
        validate_plan(raw(compensation=undo), DEFAULT_ROUTES)


def test_a_stage_input_over_256_kib_is_refused_naming_the_stage() -> None:
    big = {"text": "x" * MAX_INPUT_BYTES}
    with pytest.raises(PlanError) as e:
        validate_plan(raw(input=big), DEFAULT_ROUTES)
    assert str(e.value) == "stage 'deep': input is larger than 256 KiB serialised"
    validate_plan(raw(input={"text": "x" * (MAX_INPUT_BYTES - 100)}), DEFAULT_ROUTES)  # just under: fine


def test_a_100k_deep_document_is_one_line_not_a_recursion_error() -> None:
    text = "goal: x\nbudget_ceiling: 10\nstages: " + "[" * 100_000 + "]" * 100_000 + "\n"
    with pytest.raises(PlanError) as e:
        load_plan(text, DEFAULT_ROUTES)
    assert "\n" not in str(e.value) and "nested too deeply" in str(e.value)


def test_a_yaml_alias_bomb_is_refused_fast_with_one_line() -> None:
    text = billion_laughs()
    assert len(text) < 4000
    started = time.monotonic()
    with pytest.raises(PlanError) as e:
        load_plan(text, DEFAULT_ROUTES)
    assert time.monotonic() - started < 1.0
    assert str(e.value) == "plan: YAML aliases (*l0) are not allowed, at line 9"


def test_anchors_without_aliases_still_load() -> None:
    text = "goal: &g anchored\nbudget_ceiling: 10\nstages:\n  - {id: a, executor: llm.text, estimate: 1}\n"
    assert load_plan(text, DEFAULT_ROUTES).goal == "anchored"


def test_a_100k_node_plan_is_refused_with_the_cap_named() -> None:
    with pytest.raises(PlanError) as e:
        validate_plan(fan_outs(200), DEFAULT_ROUTES)
    assert str(e.value) == (
        f"plan: expands to 100,002 nodes (fan-outs included); at most {MAX_NODES:,} fit one task"
    )


def test_the_10k_benchmark_plan_is_accepted() -> None:
    plan = validate_plan(fan_outs(20), DEFAULT_ROUTES)
    assert sum(len(s.items()) or 1 for s in plan.all_stages()) == 10_002


def test_a_recorded_plan_is_never_held_to_the_new_caps() -> None:
    """The caps are the validator's, not the model's: a plan already in a ledger (TaskCreated) still loads
    and folds, whatever it holds."""
    from rules.plan import Plan

    plan = Plan.model_validate({**fan_outs(200), "stages": [*fan_outs(200)["stages"]]})
    assert len(plan.stages) == 200
    assert Plan.model_validate(raw(input=nested(60))).stages[0].input


def test_all_stage_inputs_together_are_capped_at_1_mib() -> None:
    stages = [
        {"id": f"s{i}", "executor": "llm.text", "estimate": "0.1", "input": {"text": "x" * (200 * 1024)}}
        for i in range(6)
    ]
    with pytest.raises(PlanError) as e:
        validate_plan({"goal": "big", "budget_ceiling": "10", "stages": stages}, DEFAULT_ROUTES)
    assert str(e.value) == "plan: the stages' inputs are larger than 1 MiB together"
    validate_plan({"goal": "big", "budget_ceiling": "10", "stages": stages[:4]}, DEFAULT_ROUTES)
