"""Money: one type with one scale for plans, vendor figures and the ledger (rules.money)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from rules.money import MAX_AMOUNT, parse_amount, vendor_amount
from rules.plan import PlanError, validate_plan
from vendors.adapter import VendorJob
from vendors.routes import DEFAULT_ROUTES


def test_a_plan_estimate_finer_than_the_ledger_is_refused_at_submission_naming_the_stage() -> None:
    raw = {
        "goal": "g",
        "budget_ceiling": 10,
        "stages": [{"id": "a", "executor": "llm.text", "estimate": "0.1234567"}],
    }
    with pytest.raises(PlanError, match=r"stage 'a': estimate must have at most 6 decimal places"):
        validate_plan(raw, DEFAULT_ROUTES)


def test_a_ceiling_finer_than_the_ledger_is_refused_too() -> None:
    raw = {"goal": "g", "budget_ceiling": "10.0000001", "stages": [{"id": "a", "executor": "llm.text"}]}
    with pytest.raises(PlanError, match="budget_ceiling must have at most 6 decimal places"):
        validate_plan(raw, DEFAULT_ROUTES)


@pytest.mark.parametrize("text", ["0.1", "12", "0.000001", str(MAX_AMOUNT)])
def test_exact_money_a_person_writes_is_taken_as_written(text: str) -> None:
    assert parse_amount(text) == Decimal(text)


def test_a_vendor_cost_finer_than_the_ledger_is_rounded_up_never_down_and_flagged() -> None:
    made = vendor_amount("0.3999991")
    assert made.amount == Decimal("0.400000") and made.anomaly is not None and "0.3999991" in made.anomaly
    assert vendor_amount("0.000000001").amount == Decimal("0.000001")  # a charge is never rounded to zero


def test_an_exact_vendor_cost_is_not_an_anomaly() -> None:
    made = vendor_amount("1.25")
    assert (made.amount, made.anomaly) == (Decimal("1.25"), None)
    exact = vendor_amount(Decimal("1.250000"))
    assert (exact.amount, exact.anomaly, exact.raw) == (Decimal("1.25"), None, "1.250000")


@pytest.mark.parametrize("raw", ["-1", "NaN", "inf", "1e12", "abc", None, True, [], float("nan")])
def test_an_unusable_vendor_figure_has_no_amount_and_says_what_it_was(raw: object) -> None:
    made = vendor_amount(raw)
    assert made.amount is None and made.anomaly is not None
    shown = str(raw)[:10]
    assert shown in made.anomaly, "the anomaly holds the raw figure"


@pytest.mark.parametrize("progress", ["NaN", float("nan"), float("inf"), -0.5, 1.5, "fast", None, True])
def test_a_nonsense_progress_figure_is_no_progress_never_a_value_the_ledger_refuses(progress: object) -> None:
    job = VendorJob.model_validate({"id": "j1", "status": "running", "progress": progress})
    assert job.progress is None


def test_a_progress_figure_in_range_is_kept() -> None:
    assert VendorJob.model_validate({"id": "j1", "status": "running", "progress": 0.25}).progress == 0.25
