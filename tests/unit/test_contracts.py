"""The workflow's contract with its activities: names in one place, typed errors, the request sent once."""

from __future__ import annotations

import ast
import json
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

from temporalio.exceptions import ApplicationError

import ledger.errors as ledger_errors
from activities.boundary import error_text, error_type, refused_scope, to_application_error
from activities.contracts import Activity, ErrorType, StageInput, executor_activity
from rules.actions import Dispatch
from rules.events import Intent, to_new
from vendors.routes import DEFAULT_ROUTES

ROOT = Path(__file__).resolve().parents[2]


def _activity_names_defined() -> set[str]:
    """Every ``@activity.defn(name=...)`` in activities/: each must name an ``Activity`` member."""
    found: set[str] = set()
    for path in (ROOT / "activities").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and ast.unparse(node.func) == "activity.defn"):
                continue
            for kw in node.keywords:
                if kw.arg == "name":
                    assert isinstance(kw.value, ast.Attribute), f"{path.name}: a literal activity name"
                    assert ast.unparse(kw.value.value) == "Activity", f"{path.name}: {ast.unparse(kw.value)}"
                    found.add(Activity[kw.value.attr].value)
    return found


def test_every_registered_activity_is_named_in_the_contract() -> None:
    defined = _activity_names_defined()
    # people.record is the one name no worker registers: only replays of old histories schedule it.
    assert defined == {a.value for a in Activity} - {Activity.PEOPLE_RECORD.value}


def test_the_workflow_schedules_no_activity_by_a_string_literal() -> None:
    tree = ast.parse((ROOT / "workflows" / "task.py").read_text())
    literals = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in set(Activity)
    ]
    assert literals == []


def test_executor_activity_routes_the_framework_stages_and_every_paid_one() -> None:
    assert executor_activity("compose") is Activity.COMPOSE_RUN
    assert executor_activity("review") is Activity.REVIEW_RUN
    paid = DEFAULT_ROUTES.executors - {"compose", "review"}
    assert paid, "the default routes declare no executor"
    for executor in sorted(paid):
        assert executor_activity(executor) is Activity.STAGE_RUN, executor
    assert executor_activity("video.animate") is Activity.STAGE_RUN  # one no route table declares


# Each ErrorType raised under a ledger.errors class's name, with an instance of that class.
LEDGER_BACKED: dict[ErrorType, BaseException] = {
    ErrorType.STALE_EPOCH: ledger_errors.StaleEpoch("t1", 1, 2),
    ErrorType.BUDGET_REFUSED: ledger_errors.BudgetRefused(
        "task:t1", Decimal("10"), Decimal("9"), Decimal("0.5"), Decimal("2")
    ),
    ErrorType.ALREADY_RESOLVED: ledger_errors.AlreadyResolved("t1:n:1:result"),
    ErrorType.DUPLICATE_EVENT: ledger_errors.DuplicateEvent("t1:n:1:result"),
    ErrorType.LEDGER_ERROR: ledger_errors.LedgerError("the ledger broke"),
    ErrorType.INVALID_AMOUNT: ledger_errors.InvalidAmount("amount", -1, "negative"),
    ErrorType.TASK_NOT_FOUND: ledger_errors.TaskNotFound("t1"),
}


def test_error_types_are_the_ledger_error_class_names() -> None:
    # No ErrorType names a ledger.errors class without being checked here.
    assert {k for k in ErrorType if hasattr(ledger_errors, k.value)} == set(LEDGER_BACKED)
    for kind, instance in LEDGER_BACKED.items():
        cls = getattr(ledger_errors, kind.value, None)
        assert isinstance(cls, type) and issubclass(cls, Exception), kind
        assert cls.__name__ == kind.value
        assert type(instance) is cls
        assert to_application_error(instance).type == kind, kind


def test_a_refused_budget_carries_its_scope_in_typed_details_not_in_the_text() -> None:
    refused = ledger_errors.BudgetRefused(
        "episode:p/e", Decimal("10"), Decimal("9"), Decimal("0.5"), Decimal("2")
    )
    crossed = to_application_error(refused)
    assert crossed.type == ErrorType.BUDGET_REFUSED and crossed.non_retryable
    assert refused_scope(crossed) == "episode:p/e"
    # The scope is read from the details: a message naming another scope changes nothing.
    forged = ApplicationError("budget refused: project:other has 0", "task:t1", type="BudgetRefused")
    assert refused_scope(forged) == "task:t1"
    assert refused_scope(ApplicationError("budget refused: project:x has 0", type="BudgetRefused")) is None
    assert error_type(crossed) == "BudgetRefused" and "episode:p/e" in error_text(crossed)


def test_the_request_travels_once_inside_the_intent() -> None:
    request = {"prompt": "a lighthouse at dusk", "inputs": {"keyframe": {"uri": "x", "sha256": "0" * 64}}}
    dispatch = Dispatch(
        node="shot/S01",
        operation_key="t1:shot/S01:a1",
        attempt=1,
        executor="video.animate",
        estimate=Decimal("0.5"),
        input=request,
    )
    intent = Intent(
        action=dispatch,
        rule="R11",
        watermark=3,
        decided_at=datetime(2026, 12, 2, tzinfo=UTC),
        reservation=Decimal("0.5"),
    )
    sent = StageInput(
        task_id="t1",
        node="shot/S01",
        operation_key="t1:shot/S01:a1",
        attempt=1,
        epoch=1,
        executor="video.animate",
        estimate=Decimal("0.5"),
        input=request,  # as the workflow builds it
        intent=to_new(intent, dedup_key="t1:intent:3:1", operation_key="t1:shot/S01:a1"),
    )
    wire = sent.model_dump_json()
    assert json.loads(wire)["input"] == {}  # not a second copy on the wire
    assert wire.count("a lighthouse at dusk") == 1
    assert StageInput.model_validate_json(wire).input == request  # the executor sees the request
    # An input recorded before (both copies, or no INTENT to write) is kept as it came.
    old = sent.model_copy(update={"input": {"prompt": "as sent"}})
    assert StageInput.model_validate_json(old.model_dump_json()).input == {"prompt": "as sent"}
