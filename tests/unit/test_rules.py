"""The rule table, as data and as behaviour: each rule wins over the rules below it.

Every projection here is folded from real ledger events (``helpers.History``), so these tests exercise the
fold as well as the table.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from helpers import T0, History, chain_plan, make_plan, stage, until

from rules.actions import (
    Action,
    Complete,
    Dispatch,
    Escalate,
    HumanDecisionType,
    RequestKind,
    Rollback,
    StaticGate,
    SuspendForHuman,
    Wait,
)
from rules.events import FailureKind, MarkerKind, Verdict
from rules.inputs import input_hash
from rules.llm import check_llm_action
from rules.plan import (
    COMPOSE,
    INFERENCE_RESERVE,
    REVIEW,
    PlanError,
    TimeoutPolicy,
    estimated_total,
    load_plan,
)
from rules.projection import NodeStatus, Projection, TaskState, summary
from rules.table import RULES, decide, ready_nodes
from vendors.routes import DEFAULT_ROUTES

APPROVE, RESUME, ABORT, ADD_BUDGET = (
    HumanDecisionType.APPROVE,
    HumanDecisionType.RESUME,
    HumanDecisionType.ABORT,
    HumanDecisionType.ADD_BUDGET,
)


def matching(p: Projection, now: datetime) -> list[str]:
    """Every rule whose condition holds, in priority order (the first one is what ``decide`` picks)."""
    return [rule.id for rule in RULES if rule.when(p, now)]


def decided(h: History, now: datetime | None = None) -> tuple[str, Action, list[str]]:
    p = h.fold()
    at = h.now if now is None else now
    result = decide(p, at)
    assert result is not None, "expected a rule to match"
    matched = matching(p, at)
    assert result[0] == (matched[0] if matched else "wait"), "decide picks the first matching rule"
    return result[0], result[1], matched


def gated_plan(**fields: object) -> History:
    """a -> b, where b is statically gated."""
    return History(make_plan(stage("a"), stage("b", "a", gate=True), **fields))


def approval_plan(**approval: object) -> History:
    """a (an approval point) -> b."""
    return History(make_plan(stage("a", approval=True), stage("b", "a"), approval=approval))


def open_approval(h: History) -> str:
    """Run to the approval point and record the question; return its request id."""
    rule, action = h.drive(until(SuspendForHuman))
    h.record(rule, action)
    assert isinstance(action, SuspendForHuman)
    return action.request.id


# ── the table as data ─────────────────────────────────────────────────────────────────────────────────
def test_rule_ids_are_unique_and_ordered_r1_to_r11() -> None:
    assert [r.id for r in RULES] == [f"R{i}" for i in range(1, 12)]
    assert [r.name for r in RULES] == [
        "abort",
        "compliance_block",
        "complete",
        "time_ceiling",
        "awaiting_human",
        "human_timeout",
        "budget_exhausted",
        "retry_technical",
        "needs_person",
        "quality_rework",
        "advance",
    ]
    assert all(r.doc for r in RULES)


def _abort() -> History:
    h = History(chain_plan())
    return h.ask("escalation:1").human("escalation:1", ABORT, approver="producer")


def _compliance() -> History:
    return History(chain_plan()).drive_to_review(Verdict.COMPLIANCE_BLOCK)


def _complete() -> History:
    return History(chain_plan()).drive_to_review(Verdict.PASS)


def _time() -> History:
    return History(chain_plan(time_ceiling="1m")).tick(61)


def _awaiting() -> History:
    h = _budget()
    rule, action = h.act()  # R7 escalates: a question that stops the whole task
    assert rule == "R7" and isinstance(action, Escalate) and action.request is not None
    return h


def _timeout() -> History:
    h = approval_plan(policy="escalate")
    return h.marker(MarkerKind.TIMEOUT, request_id=open_approval(h))


def _budget() -> History:
    return History(chain_plan()).dispatch("a").outcome("a", cost="100")


def _retry() -> History:
    return History(chain_plan()).dispatch("a").failure("a", FailureKind.TECHNICAL).tick(5)


def _person() -> History:
    return History(chain_plan()).dispatch("a").failure("a", FailureKind.CONTENT)


def _rework() -> History:
    return History(chain_plan()).drive_to_review(Verdict.QUALITY_REWORK)


def _advance() -> History:
    return History(chain_plan())


SCENARIOS: dict[str, Callable[[], History]] = {
    "R1": _abort,
    "R2": _compliance,
    "R3": _complete,
    "R4": _time,
    "R5": _awaiting,
    "R6": _timeout,
    "R7": _budget,
    "R8": _retry,
    "R9": _person,
    "R10": _rework,
    "R11": _advance,
}


@pytest.mark.parametrize("rule_id", list(SCENARIOS))
def test_every_rule_is_reachable(rule_id: str) -> None:
    assert decided(SCENARIOS[rule_id]())[0] == rule_id


def test_every_action_type_is_reachable_and_the_fallbacks_too() -> None:
    kinds = {type(decided(build())[1]).__name__ for build in SCENARIOS.values()}
    kinds.add(type(decided(gated_plan().dispatch("a").outcome("a"))[1]).__name__)
    assert kinds == {"Dispatch", "Rollback", "SuspendForHuman", "Escalate", "StaticGate", "Complete", "Wait"}
    assert History(chain_plan()).dispatch("a").decide() == (
        "wait",
        Wait(until=T0 + timedelta(days=1, seconds=1)),
    )
    assert History(chain_plan()).drive_to_review(verdict=None).decide() is None


@pytest.mark.parametrize("rule_id", list(SCENARIOS))
def test_decide_is_pure(rule_id: str) -> None:
    h = SCENARIOS[rule_id]()
    p = h.fold()
    before = summary(p)
    assert decide(p, h.now) == decide(p, h.now) == decide(h.fold(), h.now)
    assert summary(p) == before, "deciding must not change the projection"


# ── one test per rule: it wins over the rules below it ────────────────────────────────────────────────
def test_r1_abort_beats_compliance_block_and_complete() -> None:
    h = gated_plan().drive_to_review(Verdict.PASS)
    h.gate("b", passed=False, input_version=99)  # a failed compliance gate is on record too
    h.ask("escalation:1").human("escalation:1", ABORT, approver="producer")
    rule, action, matched = decided(h)
    assert matched[:3] == ["R1", "R2", "R3"]
    assert rule == "R1"
    assert action == Escalate(reason="aborted by producer", terminal=True)


def test_r2_failed_gate_beats_complete() -> None:
    h = gated_plan().drive_to_review(Verdict.PASS)
    h.gate("b", passed=False, input_version=99)
    _rule, action, matched = decided(h)
    assert matched == ["R2", "R3"]
    assert isinstance(action, Escalate) and action.terminal
    assert action.reason == "compliance gate failed: b: banned term in input"


def test_r2_failed_gate_stops_the_task_before_the_gated_node_dispatches() -> None:
    h = gated_plan()
    rule, action = h.drive(until(StaticGate, "b"))
    h.record(rule, action).gate("b", passed=False)
    rule, action, matched = decided(h)
    assert matched == ["R2", "R11"]  # b would otherwise be ready again
    assert rule == "R2" and isinstance(action, Escalate) and action.terminal


def test_r2_compliance_block_verdict_beats_budget_exhausted_and_never_rolls_back() -> None:
    h = History(chain_plan(rework_limit=5))
    h.drive(until(Dispatch, REVIEW))
    h.act()
    h.review(
        Verdict.COMPLIANCE_BLOCK,
        flagged=("b",),
        findings=("compliance.terms: b uses a banned term",),
        cost="98",
    )
    _rule, action, matched = decided(h)
    assert matched == ["R2", "R7"]
    assert action == Escalate(
        reason="compliance block: compliance.terms: b uses a banned term", terminal=True
    )


@pytest.mark.parametrize("verdict", [Verdict.PASS, Verdict.SOFT_WARNING])
def test_r3_complete_beats_time_ceiling(verdict: Verdict) -> None:
    h = History(chain_plan(time_ceiling="1h")).drive_to_review(verdict)
    _rule, action, matched = decided(h, now=T0 + timedelta(hours=2))
    assert matched == ["R3", "R4"]
    assert action == Complete(verdict=verdict.value)


def test_r3_does_not_complete_while_a_node_is_stale() -> None:
    h = _complete()
    h.rollback(("b",), ("b",))  # e.g. a newer upstream version invalidated b after the review passed
    rule, _action, matched = decided(h)
    assert "R3" not in matched and rule == "R11"


def test_r4_time_ceiling_beats_awaiting_a_person_and_in_flight_work() -> None:
    h = History(
        make_plan(stage("a", approval=True), stage("c"), time_ceiling="1h", approval={"timeout": "10m"})
    )
    h.dispatch("c")  # still running
    rid = open_approval(h)
    late, before = T0 + timedelta(hours=1, seconds=2), T0 + timedelta(hours=1)
    # An open approval is not R5: with nothing else to do the task waits, and the ceiling still wins.
    assert decided(h)[:2] == ("wait", Wait(until=h.view.requests[rid].request.deadline))
    assert decided(h, now=late)[2] == ["R4"]
    h.marker(MarkerKind.TIMEOUT, request_id=rid)
    assert h.act()[0] == "R6"  # policy escalate: now a question stops the whole task
    _rule, action, matched = decided(h, now=late)
    assert matched == ["R4", "R5"]
    assert action == Escalate(reason="time ceiling of 3600s exceeded", terminal=True)
    assert decided(h, now=before)[0] == "R5"  # not before the ceiling


@pytest.mark.parametrize("kind", [RequestKind.ESCALATION, RequestKind.INVALID_DECISION])
def test_r5_open_request_beats_a_timed_out_one_and_ready_work(kind: RequestKind) -> None:
    h = History(make_plan(stage("a", approval=True), stage("e", "a"), stage("f")))
    h.dispatch("a").outcome("a")
    rule, first = h.act()
    assert rule == "R9" and isinstance(first, SuspendForHuman)
    h.marker(MarkerKind.TIMEOUT, request_id=first.request.id)
    deadline = h.now + timedelta(minutes=5)
    h.ask(f"{kind.value}:7", kind=kind, deadline=deadline)
    rule, action, matched = decided(h)
    assert matched == ["R5", "R6", "R11"]  # f is ready, a's approval timed out, a task question is open
    assert action == Wait(until=deadline)


@pytest.mark.parametrize("kind", [RequestKind.APPROVAL, RequestKind.DEAD_LETTER])
def test_r5_ignores_a_request_that_stops_only_its_own_node(kind: RequestKind) -> None:
    h = History(make_plan(stage("a", approval=True), stage("e", "a"), stage("f")))
    h.dispatch("a").outcome("a")
    rule, first = h.act()
    assert rule == "R9" and isinstance(first, SuspendForHuman)
    h.marker(MarkerKind.TIMEOUT, request_id=first.request.id)
    h.ask(f"{kind.value}:e", kind=kind, node="e", deadline=h.now + timedelta(minutes=5))
    assert decided(h)[2] == ["R6", "R11"]


@pytest.mark.parametrize(
    "source", ["budget_exhausted", "pre_dispatch_budget", "approval_timeout", "llm_escalate", "llm_ask_human"]
)
def test_r5_a_question_that_stops_the_task_stops_every_branch(source: str) -> None:
    # a (an approval point) -> b, and an independent c: whatever stopped the task, c stays ready but is not
    # dispatched while the question is open.
    plan = make_plan(
        stage("a", approval=True),
        stage("b", "a"),
        stage("c"),
        approval={"policy": "escalate"},
        review={"estimate": "0"},
        budget_ceiling="3.05",  # the plan's estimated total is 3.00, plus the 0.05 inference reserve
    )
    h = History(plan)
    expected = RequestKind.ESCALATION
    if source == "budget_exhausted":
        h.dispatch("a").outcome("a", cost="3.05")
    elif source == "pre_dispatch_budget":
        h.dispatch("a").outcome("a", cost="2.01")  # b needs 1.00 + the 0.05 inference reserve: 0.99 is left
        h.human(open_approval(h), APPROVE)
    elif source == "approval_timeout":
        h.marker(MarkerKind.TIMEOUT, request_id=open_approval(h))
    else:
        proposal = {"action": source.removeprefix("llm_"), "reason": "unsure"}
        problem, stop = check_llm_action(h.fold(), proposal, h.now)
        assert problem is None and stop is not None
        h.record("LLM", stop)
        expected = RequestKind.ESCALATION if source == "llm_escalate" else RequestKind.INVALID_DECISION
    if not source.startswith("llm_"):
        rule, stop = h.act()
        escalated_by = {"budget_exhausted": "R7", "pre_dispatch_budget": "R11", "approval_timeout": "R6"}
        assert rule == escalated_by[source] and isinstance(stop, Escalate) and not stop.terminal, stop
    p = h.fold()
    assert [r.request.kind for r in p.requests.values() if r.open] == [expected]
    assert "c" in [n.id for n in ready_nodes(p)]
    rule, action, matched = decided(h)
    assert (rule, action) == ("R5", Wait(until=p.created_at + timedelta(days=1)))  # the time ceiling
    assert "R11" in matched


def test_an_open_escalation_holds_back_the_next_question() -> None:
    h = History(make_plan(stage("a", approval=True), stage("c")))
    h.dispatch("a").outcome("a").ask("escalation:1")
    rule, action, matched = decided(h)
    assert matched == ["R5", "R9", "R11"]  # a's approval is asked only once the escalation is answered
    assert rule == "R5" and isinstance(action, Wait)
    h.human("escalation:1", RESUME)
    rule, ask, _ = decided(h)
    assert rule == "R9" and isinstance(ask, SuspendForHuman) and ask.request.node == "a"


def test_r9_asks_for_several_approvals_at_once() -> None:
    h = History(make_plan(stage("a", approval=True), stage("c", approval=True), approval={"timeout": "5m"}))
    h.dispatch("a").outcome("a").dispatch("c").outcome("c")
    rule, first = h.act()
    assert rule == "R9" and isinstance(first, SuspendForHuman) and first.request.node == "a"
    rule, second, matched = decided(h)
    assert matched == ["R9"]  # a's open approval does not hold back c's
    assert isinstance(second, SuspendForHuman)
    assert (second.request.id, second.request.node) == ("approval:c:v1", "c")
    h.record(rule, second)
    # Both are open and nothing else can move: wait for an answer or the earlier deadline.
    assert decided(h)[:2] == ("wait", Wait(until=first.request.deadline))
    assert first.request.deadline is not None and second.request.deadline is not None
    assert first.request.deadline < second.request.deadline
    h.human(second.request.id, APPROVE)
    assert decided(h)[:2] == ("wait", Wait(until=first.request.deadline))  # compose needs a too
    h.human(first.request.id, APPROVE)
    rule, compose, _ = decided(h)
    assert rule == "R11" and isinstance(compose, Dispatch) and compose.node == COMPOSE


@pytest.mark.parametrize("kind", [RequestKind.APPROVAL, RequestKind.DEAD_LETTER])
def test_an_open_request_on_one_branch_does_not_stop_an_independent_branch(kind: RequestKind) -> None:
    h = History(make_plan(stage("a", approval=True), stage("b", "a"), stage("c"), stage("d", "c")))
    if kind == RequestKind.APPROVAL:
        h.dispatch("a").outcome("a")
    else:
        h.dispatch("a").failure("a", FailureKind.CONTENT)
    rule, ask = h.act()
    assert rule == "R9" and isinstance(ask, SuspendForHuman)
    assert (ask.request.kind, ask.request.node) == (kind, "a")
    assert [n.id for n in ready_nodes(h.fold())] == ["c"]  # b waits on a; c's branch does not
    rule, action, matched = decided(h)
    assert matched == ["R11"]
    assert isinstance(action, Dispatch) and action.node == "c"
    h.record(rule, action).outcome("c")
    rule, action = h.act()
    assert rule == "R11" and isinstance(action, Dispatch) and action.node == "d"
    h.outcome("d")
    # The independent branch is done; only the person's answer can move the task now.
    assert decided(h)[:2] == ("wait", Wait(until=ask.request.deadline))
    h.human(ask.request.id, APPROVE if kind == RequestKind.APPROVAL else RESUME)
    rule, action, _ = decided(h)
    assert rule == "R11" and isinstance(action, Dispatch)
    assert action.node == ("b" if kind == RequestKind.APPROVAL else "a")


def test_r6_timeout_with_policy_approve_passes_the_approval_point() -> None:
    h = approval_plan(timeout="3s", policy="approve")
    rid = open_approval(h)
    h.tick(3).marker(MarkerKind.TIMEOUT, request_id=rid)
    p = h.fold()
    assert p.requests[rid].timed_out and p.requests[rid].applied and p.nodes["a"].approved
    _rule, action, matched = decided(h)
    assert matched == ["R11"]  # the fold applied the policy: nothing left for R6
    assert isinstance(action, Dispatch) and action.node == "b"


def test_r6_timeout_with_policy_abort_fails_the_task_before_budget_is_considered() -> None:
    h = approval_plan(policy="abort")
    rule, action = h.drive(until(SuspendForHuman))
    h.record(rule, action)
    assert isinstance(action, SuspendForHuman)
    h.failure("b", op_key="t1:b:zombie", cost="100")  # a stray late charge exhausts the budget too
    h.marker(MarkerKind.TIMEOUT, request_id=action.request.id)
    rule, escalate, matched = decided(h)
    assert matched == ["R6", "R7"]
    assert escalate == Escalate(
        reason="approval request approval:a:v1 timed out: policy abort",
        terminal=True,
        resolves="approval:a:v1",
    )


def test_r6_timeout_with_policy_escalate_asks_for_a_resume_and_is_applied_once() -> None:
    h = approval_plan(policy="escalate")
    rid = open_approval(h)
    h.marker(MarkerKind.TIMEOUT, request_id=rid)
    rule, action, matched = decided(h)
    assert (rule, matched) == ("R6", ["R6"])
    assert isinstance(action, Escalate) and not action.terminal and action.resolves == rid
    assert action.request is not None and action.request.kind == RequestKind.ESCALATION
    assert action.request.options == (RESUME, ADD_BUDGET, ABORT)
    h.record(rule, action)
    assert h.fold().requests[rid].applied
    assert decided(h)[0] == "R5"  # now waiting on the escalation, not escalating again


def test_resuming_an_escalated_approval_timeout_lets_the_task_continue() -> None:
    h = approval_plan(policy="escalate")
    rid = open_approval(h)
    h.marker(MarkerKind.TIMEOUT, request_id=rid)
    _rule, action = h.act()
    assert isinstance(action, Escalate) and action.request is not None
    escalation = h.fold().requests[action.request.id]
    assert (escalation.resolves, escalation.request.node) == (rid, "a")
    assert not h.fold().nodes["a"].approved
    h.human(action.request.id, RESUME)
    p = h.fold()
    assert p.nodes["a"].approved, "the resume is the approval the timeout did not give"
    assert p.escalation_reason is None and p.state == TaskState.RUNNING
    rule, dispatch, _ = decided(h)
    assert rule == "R11" and isinstance(dispatch, Dispatch) and dispatch.node == "b"


def test_resuming_an_escalation_that_stands_for_no_approval_approves_nothing() -> None:
    h = History(make_plan(stage("a", approval=True), stage("b", "a"), approval={"policy": "escalate"}))
    h.dispatch("a").outcome("a").ask("escalation:1", node="a")  # about a, but resolving no request
    h.human("escalation:1", RESUME)
    p = h.fold()
    assert not p.nodes["a"].approved
    rule, ask, _ = decided(h)
    assert rule == "R9" and isinstance(ask, SuspendForHuman) and ask.request.id == "approval:a:v1"


def test_r7_budget_exhausted_beats_retry_and_add_budget_continues() -> None:
    h = History(chain_plan()).dispatch("a").failure("a", FailureKind.TECHNICAL, cost="100").tick(5)
    rule, action, matched = decided(h)
    assert matched == ["R7", "R8"]
    assert isinstance(action, Escalate) and not action.terminal
    assert action.reason == "budget exhausted: spent 100 of 100"
    assert action.request is not None and action.request.options == (RESUME, ADD_BUDGET, ABORT)
    h.record(rule, action)
    assert decided(h)[0] == "R5"
    h.human(action.request.id, ADD_BUDGET, amount="50")
    rule, retry, _ = decided(h)
    assert rule == "R8"
    assert isinstance(retry, Dispatch) and (retry.node, retry.attempt, retry.operation_key) == (
        "a",
        2,
        "t1:a:a2",
    )


def test_r8_retry_beats_needs_person_and_advance_once_the_backoff_passed() -> None:
    h = History(make_plan(stage("a"), stage("c"), stage("e")))
    h.dispatch("a").dispatch("c")
    h.failure("a", FailureKind.TECHNICAL, error="vendor returned 503").failure("c", FailureKind.CONTENT)
    _rule, action, matched = decided(h, now=h.now + timedelta(seconds=5))
    assert matched == ["R8", "R9", "R11"]  # e is ready, c needs a person
    assert isinstance(action, Dispatch)
    assert (action.node, action.attempt, action.operation_key) == ("a", 2, "t1:a:a2")
    assert action.reason == "retry 2 after technical failure: vendor returned 503"
    # Before the backoff has passed, a is not retried yet and the next rule decides.
    retry_at = h.fold().nodes["a"].retry_at
    assert retry_at is not None
    assert decided(h, now=retry_at - timedelta(milliseconds=1))[0] == "R9"


def test_r8_retries_a_stall_too_but_stops_at_the_attempt_limit() -> None:
    h = History(make_plan(stage("a", retries=1)))
    h.dispatch("a").failure("a", FailureKind.STALLED).tick(5)
    assert decided(h)[0] == "R8"
    h.act()
    h.failure("a", FailureKind.TECHNICAL).tick(5)
    rule, action, _ = decided(h)
    assert rule == "R9"  # 2 of 2 attempts used
    assert isinstance(action, SuspendForHuman) and "exhausted 2 attempts" in action.request.reason


def test_r8_retries_an_output_that_failed_its_node_check_with_the_problem_in_the_request() -> None:
    h = History(make_plan(stage("a", retries=1)))
    error = "a: format gif is not one of mp4"
    h.dispatch("a").failure("a", FailureKind.INVALID_OUTPUT, error=error).tick(60)
    rule, retry, _ = decided(h)
    assert rule == "R8" and isinstance(retry, Dispatch) and retry.attempt == 2
    assert retry.input["feedback"]["previous_errors"] == [f"attempt 1 (invalid_output): {error}"]
    h.record(rule, retry).failure("a", FailureKind.INVALID_OUTPUT, error=error).tick(60)
    assert decided(h)[0] == "R9", "at the attempt limit a person decides"


def test_r8_hero_nodes_get_two_more_attempts() -> None:
    h = History(make_plan(stage("a", retries=0, value="hero")))
    for attempt in (1, 2, 3):
        h.tick(60).dispatch("a").failure("a", FailureKind.TECHNICAL).tick(60)
        assert decided(h)[0] == ("R8" if attempt < 3 else "R9")


@pytest.mark.parametrize("kind", [FailureKind.CONTENT, FailureKind.UNKNOWN_OUTCOME])
@pytest.mark.parametrize("policy", [TimeoutPolicy.APPROVE, TimeoutPolicy.ESCALATE, TimeoutPolicy.ABORT])
def test_r9_a_non_technical_failure_asks_a_person_instead_of_retrying(
    kind: FailureKind, policy: TimeoutPolicy
) -> None:
    h = History(make_plan(stage("a"), stage("c"), approval={"timeout": "10m", "policy": policy}))
    h.dispatch("a").failure("a", kind, error="refused by the vendor's policy").tick(5)
    rule, action, matched = decided(h)
    assert matched == ["R9", "R11"]  # c is ready; a has attempts left but is not retried
    assert isinstance(action, SuspendForHuman)
    request = action.request
    assert (request.id, request.kind, request.node) == ("dead_letter:a:a1", RequestKind.DEAD_LETTER, "a")
    assert request.options == (RESUME, ABORT)
    assert request.deadline == h.now + timedelta(minutes=10)
    # An unanswered dead letter never approves itself.
    assert request.timeout_policy == (TimeoutPolicy.ESCALATE if policy == TimeoutPolicy.APPROVE else policy)
    h.record(rule, action)
    h.human(request.id, RESUME)
    rule, redo, _ = decided(h)
    assert rule == "R11" and isinstance(redo, Dispatch) and redo.operation_key == "t1:a:a2"


def test_r9_approval_point_asks_a_person_before_its_dependents_dispatch() -> None:
    h = approval_plan(timeout="3s", policy="approve")
    h.dispatch("a").outcome("a")
    p = h.fold()
    assert ready_nodes(p) == []  # b waits for the approval, not just for a's outcome
    rule, action, _ = decided(h)
    assert rule == "R9" and isinstance(action, SuspendForHuman)
    request = action.request
    assert (request.id, request.kind, request.node) == ("approval:a:v1", RequestKind.APPROVAL, "a")
    assert request.options == (APPROVE, ABORT)
    assert (request.deadline, request.timeout_policy) == (h.now + timedelta(seconds=3), TimeoutPolicy.APPROVE)
    h.record(rule, action)
    assert ready_nodes(h.fold()) == []
    rule, wait, matched = decided(h)  # the approval stops only b, and nothing else can move
    assert (rule, wait, matched) == ("wait", Wait(until=request.deadline), [])
    h.human(request.id, APPROVE)
    rule, dispatch, _ = decided(h)
    assert rule == "R11" and isinstance(dispatch, Dispatch) and dispatch.node == "b"


def test_r10_rework_rolls_back_to_the_flagged_node_and_redoes_only_its_lineage() -> None:
    h = History(make_plan(stage("a"), stage("b", "a"), stage("c", "b")))
    h.drive(until(Dispatch, REVIEW))
    h.act()
    h.review(Verdict.QUALITY_REWORK, flagged=("c", "b"), findings=("content.pacing: score 0.40",))
    rule, action, matched = decided(h)
    assert matched == ["R10"]
    assert action == Rollback(
        targets=("b",),
        invalidated=("b", "c", COMPOSE, REVIEW),
        flagged=("c", "b"),
        round=1,
        reason="content.pacing: score 0.40",
    )
    h.record(rule, action)
    p = h.fold()
    assert p.rework_rounds == 1
    assert p.nodes["a"].status == NodeStatus.SUCCEEDED
    rule, redo, _ = decided(h)
    assert rule == "R11" and isinstance(redo, Dispatch)
    assert (redo.node, redo.operation_key, redo.reason) == ("b", "t1:b:a2", "rework")


def test_r10_rework_without_known_flagged_nodes_redoes_the_review() -> None:
    h = History(chain_plan()).drive_to_review(Verdict.QUALITY_REWORK)
    _rule, action, _ = decided(h)
    assert isinstance(action, Rollback)
    assert (action.targets, action.invalidated, action.flagged) == ((REVIEW,), (REVIEW,), (REVIEW,))


def test_r10_rework_escalates_at_the_rework_limit_and_resume_grants_one_more_round() -> None:
    h = History(chain_plan(rework_limit=1))
    h.drive(until(Dispatch, REVIEW))
    h.act()
    h.review(Verdict.QUALITY_REWORK, flagged=("b",))
    assert isinstance(h.act()[1], Rollback)
    h.drive(until(Dispatch, REVIEW))
    h.act()
    h.review(Verdict.QUALITY_REWORK, flagged=("b",))
    rule, action, _ = decided(h)
    assert rule == "R10"
    assert isinstance(action, Escalate) and not action.terminal
    assert action.reason == "rework limit of 1 rounds reached"
    h.record(rule, action)
    assert decided(h)[0] == "R5"
    assert action.request is not None
    h.human(action.request.id, RESUME)
    rule, again, _ = decided(h)
    assert rule == "R10" and isinstance(again, Rollback) and again.round == 2


def test_r10_e001_rework_of_two_shots_reruns_those_two_shots_and_what_is_built_on_them() -> None:
    text = (Path(__file__).resolve().parents[2] / "examples" / "e001_video.yaml").read_text()
    h = History(load_plan(text, DEFAULT_ROUTES)).drive_to_review(Verdict.PASS)
    h.dispatch(REVIEW).review(Verdict.QUALITY_REWORK, flagged=("motion/S07", "motion/S03"))
    _rule, action, _ = decided(h)
    assert isinstance(action, Rollback)
    assert action.targets == ("motion/S03", "motion/S07")
    motion = [n for n in action.invalidated if n.startswith("motion/")]
    assert motion == ["motion/S03", "motion/S07"]  # not the other 17 shots, not keyframe_qc above them
    assert "keyframe_qc" not in action.invalidated and "keyframes/S03" not in action.invalidated
    assert action.invalidated[-2:] == (COMPOSE, REVIEW)


def _reworked_once(**fields: object) -> History:
    """a -> b; the review asked for rework of b and round 1 (Rollback) is recorded."""
    h = History(chain_plan(**fields))
    h.drive(until(Dispatch, REVIEW))
    h.act()
    h.review(Verdict.QUALITY_REWORK, flagged=("b",), findings=("content.visual: b is off model",))
    rule, action = h.act()
    assert rule == "R10" and isinstance(action, Rollback) and action.round == 1
    return h


def test_resuming_another_escalation_mid_round_does_not_repeat_the_round() -> None:
    h = _reworked_once(budget_ceiling="3.00")
    h.dispatch("b").outcome("b", cost="5")  # the rework overran: spent is above the ceiling
    rule, escalation = h.act()
    assert rule == "R7" and isinstance(escalation, Escalate) and escalation.request is not None
    h.human(escalation.request.id, HumanDecisionType.ADD_BUDGET, amount="10")
    p = h.fold()
    assert p.rework_allowance == 0 and p.review is not None and p.review.handled
    rule, action, matched = decided(h)
    assert "R10" not in matched and isinstance(action, Dispatch) and action.node == COMPOSE


def test_add_budget_on_a_budget_escalation_does_not_lift_the_rework_limit() -> None:
    h = History(chain_plan(rework_limit=0, budget_ceiling="3.00"))
    h.drive(until(Dispatch, REVIEW))
    h.act()
    h.review(Verdict.QUALITY_REWORK, flagged=("b",), cost="5")  # the review itself overran the ceiling
    rule, escalation = h.act()
    assert rule == "R7" and isinstance(escalation, Escalate) and escalation.request is not None
    h.human(escalation.request.id, HumanDecisionType.ADD_BUDGET, amount="10")
    rule, action, _ = decided(h)
    assert rule == "R10" and isinstance(action, Escalate), "the limit of 0 rounds still holds"
    assert action.reason == "rework limit of 0 rounds reached"


def test_a_retry_within_a_rework_round_still_carries_the_review_findings() -> None:
    h = _reworked_once()
    rule, rework = h.act()
    assert rule == "R11" and isinstance(rework, Dispatch) and rework.node == "b"
    assert rework.input["feedback"]["review_findings"] == ["content.visual: b is off model"]
    h.failure("b", FailureKind.TECHNICAL, error="vendor returned 503").tick(60)
    rule, retry, _ = decided(h)
    assert rule == "R8" and isinstance(retry, Dispatch)
    assert retry.input["feedback"]["review_findings"] == ["content.visual: b is off model"]
    assert retry.input["feedback"]["previous_errors"] == ["attempt 2 (technical): vendor returned 503"]


def test_rework_rounds_do_not_use_up_technical_retries() -> None:
    h = History(chain_plan(rework_limit=5))  # b: retries 2, so 3 attempts per round
    for _ in range(3):
        h.drive(until(Dispatch, REVIEW))
        h.act()
        h.review(Verdict.QUALITY_REWORK, flagged=("b",))
        assert isinstance(h.act()[1], Rollback)
    b = h.fold().nodes["b"]
    assert (b.attempts, b.round_base) == (3, 3)  # three rounds used three attempts: none count now
    assert not h.fold().exhausted("b")
    _rule, redo = h.act()
    assert isinstance(redo, Dispatch) and redo.attempt == 4  # b's fourth business attempt, first of round 4
    for attempt in (4, 5):
        h.failure("b", FailureKind.TECHNICAL).tick(60)
        rule, retry, _ = decided(h)
        assert rule == "R8", "a technical failure with attempts left in this round is retried"
        assert isinstance(retry, Dispatch) and retry.attempt == attempt + 1
        h.record(rule, retry)
    # The per-round limit still holds: the third failure of this round goes to a person.
    h.failure("b", FailureKind.TECHNICAL).tick(60)
    rule, ask, _ = decided(h)
    assert rule == "R9" and isinstance(ask, SuspendForHuman)
    assert ask.request.id == "dead_letter:b:a6" and "b exhausted 3 attempts" in ask.request.reason


def test_r11_dispatch_has_a_stable_operation_key_per_business_attempt() -> None:
    h = History(chain_plan())
    rule, action, matched = decided(h)
    assert (rule, matched) == ("R11", ["R11"])
    assert action == Dispatch(
        node="a", attempt=1, operation_key="t1:a:a1", executor="llm.text", estimate=Decimal("1.00"),
        reason="first attempt",
        input=action.input, input_hash=input_hash(action.input, node=action.node, executor="llm.text"),
    )  # fmt: skip
    assert decided(h)[1] == decided(History(chain_plan()))[1], "same history, same key"
    h.record(rule, action)
    h.marker(MarkerKind.VOID, node="a")  # the INTENT provably never reached the vendor
    again = decided(h)[1]
    # A voided key is never reused (the vendor may know it by then): the redo is a new business attempt.
    assert isinstance(again, Dispatch) and again.operation_key == "t1:a:a2"


def test_r11_gates_a_gated_stage_once_per_input_version() -> None:
    h = gated_plan()
    h.dispatch("a").outcome("a")
    a_version = h.fold().nodes["a"].artifact_seq
    rule, gate, _ = decided(h)
    assert rule == "R11"
    assert gate == StaticGate(node="b", input_version=a_version, operation_key=f"t1:b:gate{a_version}")
    h.record(rule, gate)
    assert decided(h)[1] == Wait(until=T0 + timedelta(days=1, seconds=1))  # the gate is running
    h.gate("b", passed=True)
    rule, dispatch, _ = decided(h)
    assert isinstance(dispatch, Dispatch) and dispatch.node == "b"
    h.record(rule, dispatch).failure("b", FailureKind.TECHNICAL).tick(5)
    rule, retry, _ = decided(h)
    assert rule == "R8" and isinstance(retry, Dispatch), "same input version: no second gate"
    # A new version of a (after a rework round) is checked again.
    h.rollback(("a",), ("a", "b", COMPOSE, REVIEW)).dispatch("a").outcome("a")
    rule, regate, _ = decided(h)
    assert (
        isinstance(regate, StaticGate)
        and regate.input_version == h.fold().nodes["a"].artifact_seq > a_version
    )


def test_r11_one_gate_covers_every_node_of_a_fan_out_for_one_input_version() -> None:
    h = History(make_plan(stage("a"), stage("m", "a", gate=True, fan_out=3, canary=False)))
    h.dispatch("a").outcome("a")
    rule, gate = h.act()
    version = h.fold().nodes["a"].artifact_seq
    assert rule == "R11" and isinstance(gate, StaticGate)
    assert (gate.input_version, gate.operation_key) == (version, f"t1:m:gate{version}")  # the stage's key
    assert decided(h)[0] == "wait", "no second gate while the stage's gate runs"
    h.gate(gate.node, passed=True)
    dispatched = [h.act()[1] for _ in range(3)]
    assert [(type(d).__name__, getattr(d, "node", None)) for d in dispatched] == [
        ("Dispatch", "m/S01"),
        ("Dispatch", "m/S02"),
        ("Dispatch", "m/S03"),
    ]


def test_r11_gate_threshold_gates_every_stage_estimated_at_or_above_it() -> None:
    h = History(make_plan(stage("a", estimate="0.50"), stage("b", "a", estimate="2.00"), gate_threshold="2"))
    assert isinstance(decided(h)[1], Dispatch)
    h.dispatch("a").outcome("a")
    assert isinstance(decided(h)[1], StaticGate)


@pytest.mark.parametrize(("ceiling", "admitted"), [("2.55", True), ("2.54", False)])
def test_r11_refuses_a_dispatch_that_cost_admission_does_not_admit(ceiling: str, admitted: bool) -> None:
    # a -> b with a review estimated at 0: the plan's total is 2.00, so both ceilings pass submission (2.05).
    # a overran its estimate (1.50 spent); admission keeps 0.05 for inference on top of b's estimate:
    # 1.50 + 1.00 + 0.05 fits under 2.55 exactly, not 2.54.
    h = History(make_plan(stage("a"), stage("b", "a"), budget_ceiling=ceiling, review={"estimate": "0"}))
    h.dispatch("a").outcome("a", cost="1.50")
    rule, action, _ = decided(h)
    assert rule == "R11"
    if admitted:
        assert isinstance(action, Dispatch)
    else:
        assert isinstance(action, Escalate) and not action.terminal
        assert (
            action.reason
            == f"pre-dispatch budget insufficient for b: needs 1.00, spent 1.50 + reserved 0.00 of {ceiling}"
        )
        assert action.request is not None and action.request.node == "b"


def test_r11_admission_counts_outstanding_reservations() -> None:
    # a -> b and a -> c, a review estimated at 0: the plan's total is 3.00, the ceiling 3.00 + 0.05 reserve.
    plan = make_plan(
        stage("a"), stage("b", "a"), stage("c", "a"), budget_ceiling="3.05", review={"estimate": "0"}
    )
    h = History(plan)
    h.dispatch("a").outcome("a", cost="1.01")  # a overran its estimate by 0.01
    _rule, first, _ = decided(h)
    assert isinstance(first, Dispatch) and first.node == "b"  # 3.05 - 1.01 - 0.05 leaves room for one node
    h.dispatch("b")  # reserves 1.00: 0.99 is left for c, nothing more is spent yet
    _rule, action, _ = decided(h)
    assert isinstance(action, Escalate) and not action.terminal
    assert (
        action.reason
        == "pre-dispatch budget insufficient for c: needs 1.00, spent 1.01 + reserved 1.00 of 3.05"
    )


def test_a_plan_accepted_at_its_estimated_total_finishes_when_every_node_costs_its_estimate() -> None:
    # Submission asks for the plan's estimated total plus the inference reserve that admission keeps on top
    # of every estimate: one cent less is refused up front, exactly that much lets the task finish.
    with pytest.raises(PlanError, match=r"budget_ceiling 2\.09 is below the plan's estimated total 2\.10 "):
        chain_plan(budget_ceiling="2.09")
    plan = chain_plan(budget_ceiling="2.10")
    assert estimated_total(plan) + INFERENCE_RESERVE == plan.budget_ceiling  # accepted at submission
    h = History(plan)
    decision = h.drive(lambda _r, a: not isinstance(a, Dispatch | StaticGate | SuspendForHuman))
    assert decision == ("R3", Complete(verdict="Pass")), decision


def test_r11_canary_runs_the_first_fan_out_node_alone_until_it_succeeds() -> None:
    h = History(make_plan(stage("shots", fan_out=4)))
    rule, first, _ = decided(h)
    assert isinstance(first, Dispatch) and first.node == "shots/S01"
    h.record(rule, first)
    assert decided(h)[0] == "wait"
    h.failure("shots/S01", FailureKind.TECHNICAL).tick(5)
    rule, retry, _ = decided(h)
    assert rule == "R8" and isinstance(retry, Dispatch) and retry.node == "shots/S01"
    h.record(rule, retry).outcome("shots/S01")
    nodes = []
    for _ in range(3):
        rule, action = h.act()
        assert isinstance(action, Dispatch)
        nodes.append(action.node)
    assert nodes == ["shots/S02", "shots/S03", "shots/S04"]


def test_r11_without_canary_the_whole_fan_out_is_ready_at_once() -> None:
    h = History(make_plan(stage("shots", fan_out=4, canary=False)))
    assert [n.id for n in ready_nodes(h.fold())] == [f"shots/S0{i}" for i in range(1, 5)]


def test_r11_concurrency_bounds_the_in_flight_nodes_of_a_stage() -> None:
    h = History(make_plan(stage("shots", fan_out=5, canary=False), concurrency=2))
    first, second = h.act()[1], h.act()[1]
    assert isinstance(first, Dispatch) and isinstance(second, Dispatch)
    assert (first.node, second.node) == ("shots/S01", "shots/S02")
    assert decided(h)[0] == "wait"
    h.outcome("shots/S01")
    _rule, action, _ = decided(h)
    assert isinstance(action, Dispatch) and action.node == "shots/S03"


def test_wait_when_only_in_flight_work_remains() -> None:
    h = History(chain_plan()).dispatch("a")
    assert matching(h.fold(), h.now) == []
    assert h.decide() == ("wait", Wait(until=T0 + timedelta(days=1, seconds=1)))  # the time ceiling


def test_wait_for_a_retry_backoff_until_it_passes() -> None:
    h = History(chain_plan()).dispatch("a").failure("a", FailureKind.TECHNICAL)
    retry_at = h.fold().nodes["a"].retry_at
    assert retry_at is not None and retry_at > h.now
    assert h.decide() == ("wait", Wait(until=retry_at))


def test_none_when_nothing_matches_and_nothing_is_in_flight() -> None:
    # The review finished without a verdict: a genuinely open question, for the LLM.
    h = History(chain_plan()).drive_to_review(verdict=None)
    p = h.fold()
    assert matching(p, h.now) == [] and not p.in_flight()
    assert decide(p, h.now) is None


def test_decide_says_nothing_about_a_terminal_task() -> None:
    h = _complete()
    h.act()
    assert h.fold().terminal
    assert h.decide() is None
