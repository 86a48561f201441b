"""The fold: money (reserve, settle, release), rework, the watermark, determinism; the LLM guard; verdicts."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from helpers import History, chain_plan, make_plan, stage, until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rules.actions import (
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
from rules.envelope import StoredEvent
from rules.events import Decision, FailureKind, MarkerKind, Verdict, parse
from rules.inputs import input_hash
from rules.llm import check_llm_action
from rules.plan import REVIEW
from rules.projection import NodeStatus, TaskState, apply, backoff, fold, new_projection, summary
from rules.table import decide
from rules.verdicts import CheckResult, Severity, aggregate, score_results


# ── money ─────────────────────────────────────────────────────────────────────────────────────────────
def test_dispatch_intent_reserves_the_estimate() -> None:
    p = History(chain_plan()).dispatch("a").fold()
    a = p.nodes["a"]
    assert (a.status, a.in_flight, a.attempts, a.operation_key) == (NodeStatus.RUNNING, True, 1, "t1:a:a1")
    assert a.reserved == p.reserved == Decimal("1.00")
    assert p.spent == 0
    assert p.state == TaskState.RUNNING


def test_outcome_settles_the_reservation_at_the_actual_cost() -> None:
    p = History(chain_plan()).dispatch("a").outcome("a", cost="0.73").fold()
    a = p.nodes["a"]
    assert (a.status, a.in_flight, a.versions) == (NodeStatus.SUCCEEDED, False, 1)
    assert p.reserved == a.reserved == 0
    assert p.spent == a.spent == Decimal("0.73")
    assert a.artifact is not None and a.artifact["uri"] == "file:///artifacts/t1:a:a1"


def test_failure_settles_with_its_actual_cost_and_schedules_a_backoff() -> None:
    h = History(chain_plan()).dispatch("a").failure("a", FailureKind.TECHNICAL, error="503", cost="0.20")
    p = h.fold()
    a = p.nodes["a"]
    assert (a.status, a.in_flight) == (NodeStatus.FAILED, False) and p.reserved == 0
    assert p.spent == a.spent == Decimal("0.20")
    assert a.last_failure is not None and (a.last_failure.kind, a.last_failure.error) == ("technical", "503")
    assert a.operation_key is not None
    assert a.retry_at == h.now + backoff(1, a.operation_key)
    assert timedelta(seconds=0.5) <= a.retry_at - h.now < timedelta(seconds=0.75)


def test_the_retry_backoff_is_jittered_by_the_operation_key_and_stays_a_function_of_the_record() -> None:
    keys = [f"t1:shots/S{i:02d}:1" for i in range(1, 41)]
    delays = [backoff(3, k) for k in keys]
    assert delays == [backoff(3, k) for k in keys]  # the same key, the same delay: rules stay pure
    assert all(timedelta(seconds=2) <= d < timedelta(seconds=3) for d in delays)
    assert len(set(delays)) == len(keys)  # a burst of failures does not come back as one burst
    assert backoff(3) == timedelta(seconds=2)  # a Failure of schema v1 (recorded before): no jitter
    assert backoff(20, keys[0]) <= timedelta(seconds=90)  # capped at 60 s, + at most half


def test_void_marker_releases_the_reservation_and_does_not_count_the_attempt() -> None:
    p = History(chain_plan()).dispatch("a").marker(MarkerKind.VOID, node="a").fold()
    a = p.nodes["a"]
    # The attempt number stays used (a new dispatch gets a new OperationKey: the voided key is never reused),
    # but it does not count against the node's retries: it never reached the vendor.
    assert (a.status, a.in_flight, a.attempts, a.voided) == (NodeStatus.PENDING, False, 1, 1)
    assert not p.exhausted("a") and p.max_attempts("a") == 3
    assert p.reserved == a.reserved == 0 and p.spent == 0


def test_void_marker_for_an_older_attempt_changes_nothing() -> None:
    h = History(chain_plan()).dispatch("a").failure("a").dispatch("a")
    p = h.marker(MarkerKind.VOID, node="a", op_key="t1:a:a1").fold()
    assert p.nodes["a"].in_flight and p.reserved == Decimal("1.00") and p.nodes["a"].attempts == 2


def test_late_result_of_an_older_attempt_is_charged_but_does_not_change_the_node() -> None:
    h = History(chain_plan()).dispatch("a").failure("a").dispatch("a")
    p = h.outcome("a", op_key="t1:a:a1", cost="0.40").fold()
    a = p.nodes["a"]
    assert (a.status, a.in_flight, a.versions) == (NodeStatus.RUNNING, True, 0)
    assert p.spent == Decimal("0.40") and p.reserved == Decimal("1.00")


def test_decision_event_charges_inference() -> None:
    h = History(chain_plan())
    h.append(Decision(model="m", prompt_hash="h", raw_output="{}", valid=False, cost=Decimal("0.02")))
    p = h.fold()
    assert (p.spent, p.inference_spent, p.llm_decisions) == (Decimal("0.02"), Decimal("0.02"), 1)


def test_add_budget_raises_the_ceiling() -> None:
    h = History(chain_plan()).ask("escalation:1")  # offers resume, add_budget, abort
    p = h.human("escalation:1", HumanDecisionType.ADD_BUDGET, amount="25.50").fold()
    assert p.ceiling == Decimal("125.50")
    assert p.requests["escalation:1"].decision == HumanDecisionType.ADD_BUDGET
    assert not p.requests["escalation:1"].open


def test_a_second_decision_on_a_request_changes_nothing() -> None:
    h = History(chain_plan()).ask("escalation:1")
    h.human("escalation:1", HumanDecisionType.ADD_BUDGET, amount="10")
    # ABORT is one of the request's options, so only the request being answered already stops it.
    assert HumanDecisionType.ABORT in h.view.requests["escalation:1"].request.options
    p = h.human("escalation:1", HumanDecisionType.ABORT, approver="producer").fold()
    assert p.ceiling == Decimal("110") and p.aborted_by is None
    assert (p.requests["escalation:1"].decision, p.requests["escalation:1"].decided_by) == (
        HumanDecisionType.ADD_BUDGET,
        "director",
    )


@pytest.mark.parametrize(
    ("decision", "amount"),
    [(HumanDecisionType.ADD_BUDGET, "50"), (HumanDecisionType.RESUME, None)],
)
def test_a_decision_the_request_did_not_offer_is_ignored(
    decision: HumanDecisionType, amount: str | None
) -> None:
    h = History(make_plan(stage("a", approval=True), stage("b", "a"))).dispatch("a").outcome("a")
    h.ask("approval:a:v1", kind=RequestKind.APPROVAL, node="a")  # offers approve, abort
    p = h.human("approval:a:v1", decision, amount=amount).fold()
    request = p.requests["approval:a:v1"]
    assert request.open and request.decision is None and request.decided_by is None
    assert p.ceiling == Decimal("100"), "no budget is added by an answer that was not offered"
    assert not p.nodes["a"].approved, "nothing is approved by an answer that was not offered"
    assert p.state == TaskState.WAITING_HUMAN
    # The request is still open: an answer it offers is applied as usual.
    p = h.human("approval:a:v1", HumanDecisionType.APPROVE).fold()
    assert p.requests["approval:a:v1"].decision == HumanDecisionType.APPROVE and p.nodes["a"].approved
    assert p.ceiling == Decimal("100")


# ── rework and lifecycle ──────────────────────────────────────────────────────────────────────────────
def test_rollback_marks_invalidated_nodes_stale_and_counts_the_round() -> None:
    h = History(make_plan(stage("a", approval=True), stage("b", "a")))
    h.drive(until(Dispatch, REVIEW))
    h.act()
    h.review(Verdict.QUALITY_REWORK, flagged=("a",))
    rule, action = h.act()
    assert rule == "R10" and isinstance(action, Rollback)
    p = h.fold()
    assert p.rework_rounds == 1
    assert all(p.nodes[n].status == NodeStatus.STALE for n in action.invalidated)
    assert set(action.invalidated) == set(p.nodes)
    assert not p.nodes["a"].approved, "a new version needs a new approval"
    assert p.review is not None and p.review.handled
    assert p.state == TaskState.REPAIRING


def test_v1_rollback_records_upcast_to_v2_and_fold_like_new_ones() -> None:
    """Ledgers written before restart points became a list still read: history is upcast, never rewritten."""
    h = History(make_plan(stage("a"), stage("b", "a")))
    h.drive(until(Dispatch, REVIEW))
    h.act()
    h.review(Verdict.QUALITY_REWORK, flagged=("b",))
    h.act()
    intent, done = h.events[-2], h.events[-1]
    assert (intent.schema_version, done.schema_version) == (2, 3)

    def as_v1(stored: StoredEvent, payload: dict[str, Any]) -> StoredEvent:
        return stored.model_copy(update={"schema_version": 1, "payload": payload})

    v1_action = {k: v for k, v in intent.payload["action"].items() if k != "targets"} | {"target": "b"}
    v1_done = {k: v for k, v in done.payload.items() if k != "targets"} | {"target": "b"}
    old = [*h.events[:-2], as_v1(intent, {**intent.payload, "action": v1_action}), as_v1(done, v1_done)]
    assert parse(old[-1]).targets == ("b",)
    assert parse(old[-2]).action.targets == ("b",)
    assert summary(fold(old)) == summary(fold(h.events))


def test_terminal_states_come_from_the_ledger() -> None:
    done = History(chain_plan()).drive_to_review(Verdict.PASS)
    done.act()
    assert done.fold().state == TaskState.COMPLETED
    failed = History(chain_plan()).escalation("time ceiling", terminal=True).fold()
    assert (failed.state, failed.terminal_reason) == (TaskState.FAILED, "time ceiling")


def test_open_requests_set_the_task_state() -> None:
    h = History(chain_plan()).ask("dead_letter:a:a1", kind=RequestKind.DEAD_LETTER)
    assert h.fold().state == TaskState.WAITING_HUMAN
    h.ask("escalation:1")
    assert h.fold().state == TaskState.ESCALATED


# ── the watermark ─────────────────────────────────────────────────────────────────────────────────────
def test_events_at_or_below_the_watermark_are_ignored() -> None:
    h = History(chain_plan()).dispatch("a").outcome("a", cost="0.50")
    p = fold(h.events)
    before = summary(p)
    for e in h.events:
        apply(p, e)  # a re-read of everything already folded
    apply(p, h.events[-1])
    assert summary(p) == before
    assert p.spent == Decimal("0.50"), "applying an Outcome twice charges once"


def test_fold_refuses_a_history_that_does_not_start_with_task_created() -> None:
    h = History(chain_plan()).dispatch("a")
    with pytest.raises(ValueError, match="not TaskCreated"):
        new_projection(h.events[1])


# ── Hypothesis: random valid histories ────────────────────────────────────────────────────────────────
PLAN = make_plan(
    stage("a", approval=True, estimate="0.50"),
    stage("b", "a", fan_out=3, gate=True, estimate="1.00"),
    stage("c", "b", estimate="0.50", retries=1),
    stage("d", estimate="0.30"),
    rework_limit=1,
    concurrency=2,
    budget_ceiling="4.50",
)


def random_history(data: st.DataObject, steps: int) -> History:
    """Drive the real rule table, with the outside world (vendors, gates, people, time) drawn at random."""
    h = History(PLAN)
    for _ in range(steps):
        p = h.view
        if p.terminal:
            break
        decided = decide(p, h.now)
        if decided is None:
            break
        rule, action = decided
        if not isinstance(action, Wait):
            h.record(rule, action)
            if isinstance(action, SuspendForHuman | Escalate) and action.request is not None:
                request = action.request
                if request.deadline is None or data.draw(st.booleans()):
                    # People mostly say yes: abort is one choice in (2 x options - 1).
                    choices = [*request.options, *(o for o in request.options if o != "abort")]
                    decision = data.draw(st.sampled_from(choices))
                    amount = data.draw(st.sampled_from(["0.50", "5"])) if decision == "add_budget" else None
                    h.human(request.id, decision, amount=amount)
                else:
                    h.tick((request.deadline - h.now).total_seconds())
                    h.marker(MarkerKind.TIMEOUT, request_id=request.id)
            _check_money(h)
            continue
        gated = {g.node for g in p.gate_pending.values()}
        pending = [n for n in p.nodes.values() if n.in_flight or n.id in gated]
        if not pending:
            # Nothing will report: sleep until the Wait's deadline and, like the workflow's timer, mark
            # every request whose deadline has passed.
            h.tick(max(1.0, ((action.until or h.now) - h.now).total_seconds()))
            for rid, r in list(p.requests.items()):
                if r.open and r.request.deadline is not None and r.request.deadline <= h.now:
                    h.marker(MarkerKind.TIMEOUT, request_id=rid)
            continue
        node = data.draw(st.sampled_from(pending))
        if node.id in gated:
            h.gate(node.id, passed=data.draw(st.integers(0, 9)) > 0)
        elif node.id == REVIEW:
            h.review(
                data.draw(st.sampled_from([*Verdict, None])), flagged=data.draw(st.sampled_from([(), ("c",)]))
            )
        else:
            estimate = p.graph.nodes[node.id].stage.estimate
            cost = Decimal(data.draw(st.integers(0, 100))) * estimate / 100
            what = data.draw(
                st.sampled_from(["outcome", "outcome", "outcome", "technical", "content", "void"])
            )
            if what == "outcome":
                h.outcome(node.id, cost=cost)
            elif what == "void":
                h.marker(MarkerKind.VOID, node=node.id)
            else:
                h.failure(node.id, FailureKind(what), cost=cost)
        _check_money(h)
    return h


def _check_money(h: History) -> None:
    p = h.view
    assert p.reserved == sum((n.reserved for n in p.nodes.values()), Decimal(0)) >= 0
    assert p.spent == sum((n.spent for n in p.nodes.values()), Decimal(0)) + p.inference_spent
    assert p.spent + p.reserved <= p.ceiling, "admission never lets spent + reserved pass the ceiling"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.integers(1, 80))
def test_fold_is_deterministic_and_incremental_apply_equals_the_full_fold(
    data: st.DataObject, steps: int
) -> None:
    h = random_history(data, steps)
    full = fold(h.events)
    assert summary(full) == summary(fold(h.events)), "same events, same projection"
    assert summary(h.view) == summary(full), "applying one event at a time equals folding them all"
    cut = data.draw(st.integers(1, len(h.events)))
    partial = fold(h.events[:cut])
    for e in h.events[cut - 1 :]:  # overlapping on purpose: the watermark drops the repeat
        apply(partial, e)
    assert summary(partial) == summary(full)
    assert decide(partial, h.now) == decide(full, h.now)


# ── the LLM's proposals ───────────────────────────────────────────────────────────────────────────────
@pytest.mark.parametrize(
    ("raw", "why"),
    [
        pytest.param(None, "the model gave no usable output", id="none"),
        pytest.param("dispatch a", "invalid output", id="not-an-object"),
        pytest.param(["dispatch", "a"], "invalid output", id="list"),
        pytest.param({}, "invalid output: action: Field required", id="missing-action"),
        pytest.param({"action": 1, "node": "a"}, "invalid output: action", id="wrong-type"),
        pytest.param({"action": "dispatch", "node": ["a"]}, "invalid output: node", id="node-wrong-type"),
        pytest.param(
            {"action": "dispatch", "node": "a", "cost": 0}, "invalid output: cost", id="extra-field"
        ),
        pytest.param(
            {"action": "dispatch", "node": "a", "reason": "x" * 501}, "invalid output: reason", id="huge"
        ),
        pytest.param({"action": "dispatch", "node": "a" * 201}, "invalid output: node", id="huge-node"),
        pytest.param({"action": "x" * 10_000}, "invalid output: action", id="huge-action"),
        pytest.param(
            {"action": "rollback", "node": "a"}, "action 'rollback' is not one of", id="unknown-action"
        ),
        pytest.param({"action": "Dispatch", "node": "a"}, "action 'Dispatch' is not one of", id="wrong-case"),
        pytest.param(
            {"action": "dispatch", "node": "b"}, "node 'b' is not ready to dispatch", id="not-ready"
        ),
        pytest.param({"action": "dispatch", "node": "ghost"}, "node 'ghost' is not ready", id="unknown-node"),
        pytest.param({"action": "dispatch"}, "node 'None' is not ready", id="no-node"),
    ],
)
def test_llm_proposal_is_refused(raw: Any, why: str) -> None:
    h = History(chain_plan())
    problem, action = check_llm_action(h.fold(), raw, h.now)
    assert action is None
    assert problem is not None and why in problem
    assert len(problem) < 300, "a refusal is short enough to show a person"


@pytest.mark.parametrize(("ceiling", "admitted"), [("2.55", True), ("2.54", False)])
def test_llm_dispatch_over_budget_is_refused_by_the_same_admission_as_the_rules(
    ceiling: str, admitted: bool
) -> None:
    # a -> b with a review estimated at 0: the plan's total is 2.00, so both ceilings pass submission (2.05).
    # a overran its 1.00 estimate by 0.50; b's 1.00 + the 0.05 inference reserve fits under 2.55 - 1.50
    # exactly, not under 2.54 - 1.50.
    h = History(make_plan(stage("a"), stage("b", "a"), budget_ceiling=ceiling, review={"estimate": "0"}))
    h.dispatch("a").outcome("a", cost="1.50")
    p = h.fold()
    problem, action = check_llm_action(p, {"action": "dispatch", "node": "b"}, h.now)
    rule = decide(p, h.now)
    assert rule is not None and rule[0] == "R11"
    if admitted:
        assert problem is None and isinstance(action, Dispatch) and action.node == "b"
        assert isinstance(rule[1], Dispatch)
    else:
        assert action is None and problem == "dispatch of b refused by cost admission (estimate 1.00)"
        assert isinstance(rule[1], Escalate) and "pre-dispatch budget insufficient for b" in rule[1].reason


def test_llm_valid_dispatch_gets_its_key_attempt_and_estimate_from_the_projection() -> None:
    p = History(chain_plan()).dispatch("a").marker(MarkerKind.VOID, node="a").fold()
    problem, action = check_llm_action(
        p, {"action": "dispatch", "node": "a", "reason": "start"}, p.created_at
    )
    assert problem is None
    assert action == Dispatch(
        node="a", attempt=2, operation_key="t1:a:a2", executor="llm.text", estimate=Decimal("1.00"),
        reason="model: start",
        input=action.input, input_hash=input_hash(action.input, node=action.node, executor="llm.text"),
    )  # fmt: skip


def test_llm_cannot_dispatch_a_gated_node_before_its_gate() -> None:
    h = History(make_plan(stage("a"), stage("b", "a", gate=True))).dispatch("a").outcome("a")
    p = h.fold()
    version = p.nodes["a"].artifact_seq
    gate = StaticGate(node="b", input_version=version, operation_key=f"t1:b:gate{version}")
    assert decide(p, h.now) == ("R11", gate)
    # The model's dispatch takes the same path as R11: the gate comes first, whatever the model says.
    problem, action = check_llm_action(p, {"action": "dispatch", "node": "b", "reason": "skip it"}, h.now)
    assert (problem, action) == (None, gate)
    # Once the gate passed on this input version, the same proposal dispatches b.
    h.intent(gate).gate("b", passed=True)
    p = h.fold()
    problem, action = check_llm_action(p, {"action": "dispatch", "node": "b", "reason": "gate passed"}, h.now)
    assert problem is None
    assert action == Dispatch(
        node="b", attempt=1, operation_key="t1:b:a1", executor="llm.text", estimate=Decimal("1.00"),
        reason="model: gate passed",
        input=action.input, input_hash=input_hash(action.input, node=action.node, executor="llm.text"),
    )  # fmt: skip


def test_llm_escalate_and_ask_human_become_questions_to_a_person() -> None:
    h = History(chain_plan())
    p = h.fold()
    problem, escalate = check_llm_action(p, {"action": "escalate", "reason": "vendor looks down"}, h.now)
    assert problem is None
    assert isinstance(escalate, Escalate) and not escalate.terminal
    assert escalate.request is not None and escalate.request.kind == RequestKind.ESCALATION
    assert escalate.reason == "model escalated: vendor looks down"
    problem, ask = check_llm_action(p, {"action": "ask_human"}, h.now)
    assert problem is None
    assert isinstance(ask, SuspendForHuman) and ask.request.kind == RequestKind.INVALID_DECISION
    assert ask.request.reason == "model asks a person: no reason given"


# ── review verdicts ───────────────────────────────────────────────────────────────────────────────────
def _r(severity: Severity, *nodes: str, check: str = "c") -> CheckResult:
    return CheckResult(check, severity, f"{severity} finding", nodes)


@pytest.mark.parametrize(
    ("severities", "verdict"),
    [
        ([], Verdict.PASS),
        ([Severity.OK, Severity.OK], Verdict.PASS),
        ([Severity.SOFT, Severity.OK], Verdict.SOFT_WARNING),
        ([Severity.SOFT, Severity.REWORK], Verdict.QUALITY_REWORK),
        ([Severity.REWORK, Severity.BLOCK, Severity.SOFT], Verdict.COMPLIANCE_BLOCK),
        ([Severity.BLOCK, Severity.OK], Verdict.COMPLIANCE_BLOCK),
    ],
)
def test_aggregate_worst_severity_wins(severities: list[Severity], verdict: Verdict) -> None:
    assert aggregate([_r(s) for s in severities])[0] == verdict


def test_aggregate_flags_only_the_nodes_of_the_winning_severity_once_each() -> None:
    results = [
        _r(Severity.REWORK, "b/S01", "c", check="content.pacing"),
        _r(Severity.SOFT, "a", check="content.tone"),
        _r(Severity.REWORK, "c", check="technical.artifact"),
    ]
    verdict, flagged, findings = aggregate(results)
    assert verdict == Verdict.QUALITY_REWORK
    assert flagged == ("b/S01", "c")
    assert findings == ("content.pacing: rework finding", "technical.artifact: rework finding")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(list(Severity)), max_size=6))
def test_aggregate_is_order_independent_in_its_verdict(severities: list[Severity]) -> None:
    forward = aggregate([_r(s) for s in severities])[0]
    assert aggregate([_r(s) for s in reversed(severities)])[0] == forward


def test_score_results_thresholds() -> None:
    results = score_results(
        {"clarity": 0.59, "pacing": 0.6, "tone": 0.74, "accuracy": 0.75}, {"clarity": ("b",)}
    )
    assert [(r.check, r.severity, r.nodes) for r in results] == [
        ("content.clarity", Severity.REWORK, ("b",)),
        ("content.pacing", Severity.SOFT, ()),
        ("content.tone", Severity.SOFT, ()),
    ]


def test_complete_intent_needs_no_other_event() -> None:
    h = History(chain_plan()).intent(Complete(verdict="Pass"), rule="R3")
    assert h.fold().completed


def test_static_gate_intent_marks_the_gate_pending_until_its_result() -> None:
    h = History(make_plan(stage("a", gate=True)))
    h.intent(StaticGate(node="a", input_version=0, operation_key="t1:a:gate0"))
    assert h.fold().gate_pending["a"].input_version == 0
    h.gate("a")
    assert h.fold().gates == {("a", 0): True} and h.fold().gate_pending == {}
