"""Issue 24 §6.4: whatever goes wrong reading a new task's plan is a non-retryable PlanInvalid raised before
the lease is taken; a ledger outage stays an ordinary, retryable error."""

from __future__ import annotations

from typing import Any

import pytest
from limitskit import nested
from temporalio.exceptions import ApplicationError

from activities.contracts import ErrorType, OpenTaskInput
from activities.ledger import LedgerActivities
from ledger.errors import LedgerUnavailable
from rules.plan import Plan
from vendors.routes import default_table


class StubRecorder:
    """Only what open_task calls before and at the lease; the lease must never be reached here."""

    def __init__(self, outage: bool = False) -> None:
        self.outage = outage
        self.leases = 0

    def current_epoch(self, task_id: str) -> int | None:
        if self.outage:
            raise LedgerUnavailable("the ledger is unreachable")
        return None

    def take_lease(self, task_id: str, holder: str) -> int:
        self.leases += 1
        raise AssertionError("the lease was taken for a plan that cannot be read")


def plan(**stage: Any) -> Plan:
    """Built by the model alone, as a plain client's payload is decoded: no validator has seen it."""
    return Plan.model_validate(
        {
            "task_id": "t-sec",
            "goal": "g",
            "budget_ceiling": "10",
            "stages": [{"id": "deep", "executor": "llm.text", "estimate": "1", **stage}],
        }
    )


def open_with(rec: StubRecorder, p: Plan) -> None:
    LedgerActivities(rec, default_table()).open_task(  # type: ignore[arg-type]
        OpenTaskInput(task_id="t-sec", plan=p, holder="run-1")
    )


TOO_DEEP = "invalid plan: stage 'deep': input is nested deeper than 32 levels"
# Past what pydantic serialises, the plan cannot even be read for the depth check: still one line.
UNREADABLE = "invalid plan: cannot be read (ValueError: Maximum serialization depth exceeded)"


@pytest.mark.parametrize("depth, expected", [(40, TOO_DEEP), (190, TOO_DEEP), (260, UNREADABLE)])
def test_a_deep_input_is_plan_invalid_not_retried(depth, expected):
    rec = StubRecorder()
    with pytest.raises(ApplicationError) as e:
        open_with(rec, plan(input=nested(depth)))
    assert e.value.type == ErrorType.PLAN_INVALID and e.value.non_retryable
    assert "\n" not in str(e.value) and len(str(e.value)) < 300
    assert e.value.message == expected
    assert rec.leases == 0


def test_an_unexpected_error_reading_the_plan_is_plan_invalid_in_one_line(monkeypatch):
    def boom(*_: Any, **__: Any) -> None:
        raise RecursionError("maximum recursion depth exceeded\nwhile calling a Python object")

    monkeypatch.setattr("activities.ledger.validate_plan", boom)
    rec = StubRecorder()
    with pytest.raises(ApplicationError) as e:
        open_with(rec, plan())
    assert e.value.type == ErrorType.PLAN_INVALID and e.value.non_retryable
    expected = "invalid plan: cannot be read (RecursionError: maximum recursion depth exceeded)"
    assert e.value.message == expected
    assert rec.leases == 0


def test_a_ledger_outage_while_opening_stays_retryable():
    with pytest.raises(LedgerUnavailable):
        open_with(StubRecorder(outage=True), plan())
