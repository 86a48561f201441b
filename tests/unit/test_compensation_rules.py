"""Compensation (rules.table R12): a task that fails or is aborted after a compensable stage succeeded undoes
each output the vendor made — newest first, one at a time, each an operation with its own INTENT — before its
end state is final; a completed task undoes nothing."""

from __future__ import annotations

from decimal import Decimal

from helpers import History, make_plan, stage

from rules import table_versions
from rules.actions import Compensate, Dispatch, Escalate, Wait
from rules.events import ArtifactRef, FailureKind, Outcome
from rules.plan import PlanError, Routes, validate_plan
from rules.projection import TaskState, summary
from rules.recompute import recompute
from rules.table import decide

UNPUBLISH = {"executor": "llm.text", "input": {"action": "unpublish"}, "estimate": "0.10", "retries": 1}


def _published(width: int | None = None) -> History:
    """``publish`` (compensable) done, then the task runs past its time ceiling: R4 makes it terminal."""
    publish = stage(
        "publish", compensation=UNPUBLISH, **({"fan_out": width, "canary": False} if width else {})
    )
    h = History(make_plan(publish, stage("after", "publish"), time_ceiling=600))
    for _ in range(width or 1):
        rule, action = h.act()
        assert isinstance(action, Dispatch) and action.node.startswith("publish")
        h.outcome(action.node)
    h.tick(601)
    rule, action = h.act()
    assert rule == "R4" and isinstance(action, Escalate) and action.terminal
    return h


def test_a_task_past_its_ceiling_undoes_its_published_output_before_it_is_failed() -> None:
    h = _published()
    assert h.view.state == TaskState.COMPENSATING
    rule, undo = h.act()
    assert rule == "R12" and isinstance(undo, Compensate)
    published = h.op("publish")
    assert (undo.node, undo.compensates, undo.operation_key) == ("publish", published, f"{published}:undo1")
    assert undo.input == {
        "action": "unpublish",
        "compensates": {
            "operation_key": published,
            "node": "publish",
            "job_id": f"job-{published}",
            "sha256": h.view.nodes["publish"].artifact["sha256"],
        },
    }
    assert undo.estimate == Decimal("0.10") and h.view.reserved == Decimal("0.10")
    assert decide(h.view, h.now) == ("wait", Wait(until=None))  # one in flight: wait for its result
    h.outcome("publish", op_key=undo.operation_key, cost="0.10")
    assert decide(h.view, h.now) is None  # nothing left: the end state is final
    assert h.view.state == TaskState.FAILED
    assert h.view.nodes["publish"].status.value == "succeeded"  # the node's own record is untouched
    assert summary(h.view)["compensations"][published]["state"] == "undone"
    assert recompute(h.events) == []


def test_a_fan_outs_outputs_are_undone_newest_first_one_at_a_time() -> None:
    h = _published(width=3)
    order = []
    while (decided := decide(h.view, h.now)) is not None:
        rule, undo = decided
        assert isinstance(undo, Compensate)
        h.record(rule, undo)
        assert decide(h.view, h.now)[1] == Wait(until=None)  # type: ignore[index]
        h.outcome(undo.node, op_key=undo.operation_key, cost="0.10")
        order.append(undo.node)
    assert order == ["publish/S03", "publish/S02", "publish/S01"]
    assert recompute(h.events) == []


def test_a_failed_undo_is_retried_after_its_backoff_then_given_up_after_its_retries() -> None:
    h = _published()
    _rule, first = h.act()
    assert isinstance(first, Compensate)
    h.failure("publish", op_key=first.operation_key, error="vendor returned 503")
    _rule, waiting = decide(h.view, h.now)  # type: ignore[misc]
    assert isinstance(waiting, Wait) and waiting.until is not None and waiting.until > h.now
    h.tick((waiting.until - h.now).total_seconds())
    _rule, second = h.act()
    assert isinstance(second, Compensate) and second.attempt == 2
    assert second.input["feedback"]["previous_errors"] == ["attempt 1 (technical): vendor returned 503"]
    h.failure("publish", op_key=second.operation_key, error="still down")
    assert decide(h.view, h.now) is None  # retries: 1 → two attempts, both failed: it gives up
    assert h.view.state == TaskState.FAILED
    assert summary(h.view)["compensations"][h.op("publish")]["state"] == "gave up"
    assert recompute(h.events) == []


def test_a_content_refusal_of_an_undo_is_not_sent_again() -> None:
    h = _published()
    _rule, undo = h.act()
    h.failure("publish", kind=FailureKind.CONTENT, op_key=undo.operation_key, error="refused")  # type: ignore[union-attr]
    assert decide(h.view, h.now) is None


def test_a_completed_task_or_a_reused_output_undoes_nothing() -> None:
    h = History(make_plan(stage("publish", compensation=UNPUBLISH)))
    h.drive_to_review()
    rule, _done = h.act()
    assert rule == "R3" and h.view.completed and decide(h.view, h.now) is None

    reused = History(make_plan(stage("publish", compensation=UNPUBLISH), time_ceiling=600))
    rule, action = reused.act()
    artifact = ArtifactRef(uri="file:///a", sha256="0" * 64, size=1)
    reused.append(
        Outcome(
            node="publish",
            operation_key=action.operation_key,  # type: ignore[union-attr]
            artifact=artifact,
            actual_cost=Decimal(0),
            reused_from="earlier:publish:a1",
        ),
        dedup_key=f"{action.operation_key}:result",  # type: ignore[union-attr]
    )
    reused.tick(601).act()
    assert (
        reused.view.terminal and decide(reused.view, reused.now) is None
    )  # nothing was sent: nothing to undo


def test_the_rule_table_before_compensation_decides_nothing_for_a_terminal_task() -> None:
    h = _published()
    v1 = table_versions.table(1)
    assert v1 is not None and v1(h.view, h.now) is None
    assert decide(h.view, h.now)[0] == "R12"  # type: ignore[index]


def test_a_compensation_executor_without_a_route_is_refused_with_the_stage_named() -> None:
    routes = Routes(executors=frozenset({"llm.text"}), reviewers=frozenset())
    raw = {
        "goal": "g",
        "budget_ceiling": 10,
        "stages": [{"id": "publish", "executor": "llm.text", "compensation": {"executor": "nowhere"}}],
    }
    try:
        validate_plan(raw, routes)
    except PlanError as e:
        assert str(e) == "stage 'publish': compensation executor 'nowhere' has no route"
    else:
        raise AssertionError("accepted")
