"""Issue 26 §4: each node state a person reads (``rules.projection.node_state``), one transition at a time,
on a fold of recorded events (the e2e sequence: ``tests/workflows/test_node_states.py``)."""

from __future__ import annotations

from helpers import History, make_plan, stage

from rules.actions import Compensate, Dispatch, RequestKind
from rules.events import FailureKind, Progress
from rules.projection import NodeStatus, node_state

UNDO = {"executor": "llm.text", "input": {"action": "unpublish"}, "estimate": "0.10", "retries": 1}


def state(h: History, node: str) -> NodeStatus:
    return node_state(h.view, h.view.nodes[node])


def test_pending_leased_running_succeeded() -> None:
    h = History(make_plan(stage("a")))
    assert state(h, "a") == NodeStatus.PENDING
    _rule, action = h.act()
    assert isinstance(action, Dispatch)
    assert state(h, "a") == NodeStatus.LEASED, "its INTENT is recorded; the vendor has not taken it"
    h.append(Progress(node="a", operation_key=h.op("a"), job_id="job-1"), operation_key=h.op("a"))
    assert state(h, "a") == NodeStatus.RUNNING, "the vendor holds a job for it"
    h.outcome("a")
    assert state(h, "a") == NodeStatus.SUCCEEDED


def test_a_retry_is_leased_again_not_running_on_the_last_attempts_job() -> None:
    h = History(make_plan(stage("a")))
    h.act()
    h.append(Progress(node="a", operation_key=h.op("a"), job_id="job-1"), operation_key=h.op("a"))
    h.failure("a", FailureKind.TECHNICAL)
    h.tick(600)
    _rule, action = h.act()
    assert isinstance(action, Dispatch) and action.attempt == 2
    assert state(h, "a") == NodeStatus.LEASED


def test_an_open_request_about_a_node_is_waiting_human_then_succeeded_once_approved() -> None:
    h = History(make_plan(stage("a", approval=True), stage("b", "a")))
    h.act()
    h.outcome("a")
    rule, ask = h.act()
    assert state(h, "a") == NodeStatus.WAITING_HUMAN, (rule, ask)
    [rid] = [r for r, v in h.view.requests.items() if v.open]
    h.human(rid, "approve")
    assert state(h, "a") == NodeStatus.SUCCEEDED


def test_a_failed_node_with_its_dead_letter_open_is_waiting_human_and_failed_once_the_task_ends() -> None:
    h = History(make_plan(stage("a", retries=0), time_ceiling=600))
    h.act()
    h.failure("a", FailureKind.CONTENT)
    h.act()  # R9: its dead letter
    assert any(v.request.kind == RequestKind.DEAD_LETTER and v.open for v in h.view.requests.values())
    assert state(h, "a") == NodeStatus.WAITING_HUMAN
    h.tick(601)
    h.act()  # R4: past the time ceiling
    assert h.view.terminal and state(h, "a") == NodeStatus.FAILED


def test_nodes_a_task_never_reached_are_cancelled_and_an_output_being_undone_is_compensating() -> None:
    h = History(make_plan(stage("publish", compensation=UNDO), stage("after", "publish"), time_ceiling=600))
    h.act()
    h.outcome("publish")
    h.tick(601)
    h.act()  # R4: terminal
    assert state(h, "after") == NodeStatus.CANCELLED, "the task ended before it ran"
    rule, undo = h.act()
    assert rule == "R12" and isinstance(undo, Compensate)
    assert state(h, "publish") == NodeStatus.COMPENSATING
    h.outcome("publish", op_key=undo.operation_key, cost="0.10")
    assert state(h, "publish") == NodeStatus.SUCCEEDED, "undone: its own record stands"
