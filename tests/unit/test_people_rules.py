"""The pure part of people in the loop (rules/people.py): signing, parsing, the ruling on a decision, the
context package, the queue's order and grouping, the dead-letter view."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from helpers import T0, TASK, History, make_plan, stage, until

from ledgerflow.views.queue import (
    QueueItem,
    dead_letters,
    group,
    open_items,
    order,
    request_detail,
    root_cause,
    suggestion,
)
from rules.actions import Escalate, HumanDecisionType, RequestKind, SuspendForHuman
from rules.approvers import KeyRecord
from rules.events import FailureKind, HumanDecision, MarkerKind, SystemMarker
from rules.people import (
    Keys,
    Ruling,
    allowed_approvers,
    canonical,
    conflict,
    context_package,
    decision_ref,
    evaluate,
    parse_decision,
    resolution_key,
    resolutions,
)
from rules.plan import PlanError, Value, validate_plan
from runtime.signing import ApproverKey, demo_key, verify
from vendors.routes import DEFAULT_ROUTES

KEYS = {name: demo_key(name) for name in ("director", "producer", "editor")}
REGISTRY = {
    k.key_id: KeyRecord(key_id=k.key_id, approver=k.approver, public_key=k.public_key) for k in KEYS.values()
}
APPROVE, ABORT, RESUME, ADD = (
    HumanDecisionType.APPROVE,
    HumanDecisionType.ABORT,
    HumanDecisionType.RESUME,
    HumanDecisionType.ADD_BUDGET,
)


def payload(
    request_id: str,
    decision: str = "approve",
    approver: str = "director",
    *,
    task_id: str = TASK,
    amount: str | None = None,
    scope: str | None = None,
    note: str = "",
    key: ApproverKey | None = None,
    decision_id: str | None = None,
) -> dict[str, Any]:
    """A decision signed the way the CLI and the reviewer page sign it (Ed25519 over ``canonical``)."""
    did = decision_id or str(uuid.uuid4())
    signer = key or KEYS[approver]
    message = canonical(task_id, did, request_id, decision, approver, signer.key_id, amount, scope, note)
    return {
        "decision_id": did,
        "request_id": request_id,
        "decision": decision,
        "approver": approver,
        "key_id": signer.key_id,
        "note": note,
        "amount": amount,
        "scope": scope,
        "signature": signer.sign(message),
    }


def approval(**policy: Any) -> tuple[History, str]:
    """a (an approval point) -> b, run to its open approval request."""
    h = History(make_plan(stage("a", approval=True), stage("b", "a"), approval=policy))
    rule, action = h.drive(until(SuspendForHuman))
    h.record(rule, action)
    assert isinstance(action, SuspendForHuman)
    return h, action.request.id


def rule_on(
    h: History, raw: Any, registry: dict[str, KeyRecord] = REGISTRY, at: datetime | None = None
) -> Ruling:
    keys = Keys(registry=registry, verify=verify)
    return evaluate(TASK, raw, h.fold(), keys, at or h.now, resolutions(h.events, TASK))


# ── signing ──────────────────────────────────────────────────────────────────────────────────────────


def test_the_canonical_message_is_a_version_line_then_the_fields_in_order_with_the_note_last() -> None:
    msg = canonical(
        "t1", "d-1", "approval:a:v1", "add_budget", "producer", "k1", "5.5", "project:p", "line one\nline two"
    )
    assert msg == (
        "ledgerflow-decision-v2\nt1\nd-1\napproval:a:v1\nadd_budget\nproducer\nk1\n5.5\nproject:p\n"
        "line one\nline two"
    )
    assert (
        canonical("t1", "d", "r", APPROVE, "x", "k", None, None, "")
        == "ledgerflow-decision-v2\nt1\nd\nr\napprove\nx\nk\n\n\n"
    )


def test_signatures_are_ed25519_over_the_canonical_message_of_one_task() -> None:
    key = KEYS["director"]
    message = canonical("t1", "d", "r", "approve", "director", key.key_id, None, None, "ok")
    signature = key.sign(message)
    assert len(signature) == 128 and verify(key.public_key, message, signature)
    other_task = canonical("t2", "d", "r", "approve", "director", key.key_id, None, None, "ok")
    assert not verify(key.public_key, other_task, signature)  # the task is signed
    assert not verify(KEYS["producer"].public_key, message, signature)  # another key's public half
    assert not verify(key.public_key, message, "00" * 64)


def test_decision_ref_is_the_decision_id_or_a_stable_digest() -> None:
    did = str(uuid.uuid4())
    assert decision_ref({"decision_id": did}) == did
    a, b = decision_ref({"x": 1, "y": [2]}), decision_ref({"y": [2], "x": 1})
    assert a == b and a.startswith("sha256:") and len(a) == 7 + 64
    assert decision_ref({"decision_id": "nope"}) != decision_ref({"decision_id": "nope2"})
    assert decision_ref(None).startswith("sha256:")


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ([], "expected a JSON object, got an array"),
        ("x", "got a string"),
        (None, "got null"),
        (True, "got a boolean"),
        (1.5, "got a number"),
        ({"decision_id": "x", "extra": 1, "signature": "s"}, "unknown field 'extra'"),
        ({}, "unsigned decision"),
        ({"signature": ""}, "unsigned decision"),
        ({"signature": "a" * 128}, "decision_id is required"),
        ({"signature": "a" * 128, "decision_id": 7}, "decision_id must be a string, got a number"),
        ({"signature": "a" * 128, "decision_id": "ABC"}, "is not a lowercase UUID"),
    ],
)
def test_malformed_payloads_get_one_line_reasons(raw: Any, needle: str) -> None:
    problem = parse_decision(raw)
    assert isinstance(problem, str) and needle in problem and "\n" not in problem


def test_field_shapes_are_checked() -> None:
    good = payload("approval:a:v1")
    assert not isinstance(parse_decision(good), str)
    cases = {
        "request_id": ("bad id\n", "is not a request id"),
        "decision": ("Approve", "is not one of approve, resume, abort, add_budget"),
        "approver": ("../x", "is not a valid approver name"),
        "amount": ("1e3", "is not a decimal string"),
        "signature": ("ab" * 32, "is not 128 lowercase hex digits"),
        "key_id": ("a key", "is not a key id"),
        "scope": ("org:x", "is not a budget scope"),
        "note": (["a"], "note must be a string"),
    }
    for field, (value, needle) in cases.items():
        problem = parse_decision({**good, field: value})
        assert isinstance(problem, str) and needle in problem, (field, problem)
    assert "longer than 2000" in str(parse_decision({**good, "note": "n" * 2001}))
    optional = ("note", "amount", "scope")
    assert not isinstance(parse_decision({k: v for k, v in good.items() if k not in optional}), str)


# ── the ruling ───────────────────────────────────────────────────────────────────────────────────────


def test_a_valid_decision_is_accepted_with_its_id() -> None:
    h, rid = approval()
    p = payload(rid, note="ship it")
    ruling = rule_on(h, p)
    assert ruling.accepted and ruling.rejection is None and not ruling.duplicate
    assert ruling.decision == HumanDecision(
        request_id=rid,
        decision=APPROVE,
        approver="director",
        note="ship it",
        decision_id=p["decision_id"],
        key_id="demo-director",
        # what was signed is recorded with it (issue 24 §3), and when it arrived
        signed=canonical(
            TASK, p["decision_id"], rid, "approve", "director", "demo-director", None, None, "ship it"
        ),
        signature=p["signature"],
        received_at=h.now,
    )
    assert ruling.raise_ceiling is None and ruling.node == "a"


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"signature": "0" * 128}, "bad signature for key 'demo-director'"),
        ({"decision": "abort"}, "bad signature"),  # altered after signing
        ({"note": "changed"}, "bad signature"),
        ({"approver": "mallory"}, "bad signature"),  # the approver is signed too
        ({"key_id": "nobody-1"}, "unknown key 'nobody-1'"),
    ],
)
def test_authentication_refuses_forged_or_altered_or_unknown(change: dict[str, Any], needle: str) -> None:
    h, rid = approval()
    ruling = rule_on(h, {**payload(rid), **change})
    assert not ruling.accepted and needle in (ruling.rejection or "")


def test_a_decision_signed_for_another_task_or_with_another_key_is_refused() -> None:
    h, rid = approval()
    assert "bad signature" in (rule_on(h, payload(rid, task_id="other")).rejection or "")
    forged = payload(rid, key=KEYS["producer"]) | {"key_id": "demo-director"}  # producer's key, director's id
    assert "bad signature" in (rule_on(h, forged).rejection or "")
    assert "unknown key" in (rule_on(h, payload(rid), registry={}).rejection or "")  # an empty registry
    mallory = payload(rid, approver="mallory", key=KEYS["producer"])  # a valid signature, not the key's owner
    assert rule_on(h, mallory).rejection == "key demo-producer belongs to producer, not mallory"


def test_authorisation_per_kind_then_plan_approvers_then_anyone_with_a_key() -> None:
    h, rid = approval(approvers=["director", "producer"], approvers_by_kind={"approval": ["producer"]})
    assert rule_on(h, payload(rid, approver="producer")).accepted
    refused = rule_on(h, payload(rid, approver="director")).rejection
    assert refused == "director may not decide approval requests (allowed: producer)"
    h, rid = approval(approvers=["director"])
    assert rule_on(h, payload(rid)).accepted
    assert "editor may not decide" in (rule_on(h, payload(rid, approver="editor")).rejection or "")
    h, rid = approval()
    assert rule_on(h, payload(rid, approver="editor")).accepted  # nobody named: any authenticated approver
    policy = h.plan.approval
    assert allowed_approvers(policy, RequestKind.ESCALATION) == ()


def test_unknown_request_and_options_and_amounts() -> None:
    h, rid = approval()
    assert rule_on(h, payload("approval:zz:v1")).rejection == "no request 'approval:zz:v1' in task t1"
    assert (
        rule_on(h, payload(rid, "resume")).rejection
        == "resume is not an option of approval:a:v1 (options: approve, abort)"
    )
    assert "only for add_budget" in (rule_on(h, payload(rid, amount="5")).rejection or "")


def _escalated() -> tuple[History, str]:
    h = History(make_plan(stage("a")))
    h.escalation("budget exhausted", request_id="escalation:1")
    h.ask("escalation:1", RequestKind.ESCALATION)
    return h, "escalation:1"


@pytest.mark.parametrize(
    ("amount", "needle"),
    [
        (None, "add_budget needs an amount"),
        ("0", "must be positive"),
        ("1.0000001", "at most 6 decimal places"),
        ("2000000000", "must be at most"),
    ],
)
def test_add_budget_amounts_are_validated(amount: str | None, needle: str) -> None:
    h, rid = _escalated()
    ruling = rule_on(h, payload(rid, "add_budget", amount=amount))
    assert needle in (ruling.rejection or ""), ruling


def test_add_budget_raises_the_task_ceiling() -> None:
    h, rid = _escalated()
    ruling = rule_on(h, payload(rid, "add_budget", "producer", amount="12.5"))
    assert ruling.accepted and ruling.raise_ceiling == ("task:t1", Decimal("12.5"))
    assert ruling.decision is not None and ruling.decision.amount == Decimal("12.5")


def test_closed_requests_duplicates_and_losers() -> None:
    h, rid = approval()
    first = payload(rid)
    event = rule_on(h, first).decision
    assert event is not None
    h.append(event, dedup_key=resolution_key(TASK, rid))
    again = rule_on(h, first)
    assert again.duplicate and again.rejection is None and not again.accepted
    late = rule_on(h, payload(rid, "abort", "producer"))
    assert late.rejection == "already resolved: approve by director"
    # The timer's marker resolves a request just the same.
    h2, rid2 = approval()
    h2.append(SystemMarker(kind=MarkerKind.TIMEOUT, request_id=rid2), dedup_key=resolution_key(TASK, rid2))
    assert rule_on(h2, payload(rid2)).rejection == "already resolved: timed out"


def test_conflict_after_a_lost_insert_tells_the_loser_and_recognises_a_repeat() -> None:
    h, rid = approval()
    mine = payload(rid)
    event = rule_on(h, mine).decision
    assert event is not None
    h.append(event, dedup_key=resolution_key(TASK, rid))
    stored = h.events[-1]
    assert conflict(TASK, mine, stored).duplicate
    theirs = conflict(TASK, payload(rid, "abort", "producer"), stored)
    assert theirs.rejection == "already resolved: approve by director" and theirs.request_id == rid


def test_a_refusal_is_a_rejected_input_marker_under_the_decisions_own_key() -> None:
    h, rid = approval()
    p = {**payload(rid), "signature": "f" * 128}
    ruling = rule_on(h, p)
    marker = ruling.marker()
    assert marker.kind == MarkerKind.REJECTED_INPUT and marker.request_id == rid and marker.node == "a"
    assert marker.detail.startswith(f"{p['decision_id']}: bad signature")
    assert ruling.marker_key() == f"{TASK}:rejected:{p['decision_id']}"
    junk = rule_on(h, ["not", "an", "object"])
    assert junk.marker_key() == f"{TASK}:rejected:{decision_ref(['not', 'an', 'object'])}"
    assert junk.request_id is None


def test_a_finished_task_takes_no_decision() -> None:
    h, rid = approval()
    h.human(rid, ABORT, approver="producer")
    h.act()  # R1: aborted
    h.ask("escalation:9", RequestKind.ESCALATION)
    assert rule_on(h, payload("escalation:9", "resume")).rejection == "task t1 is already Failed"


# ── context package ──────────────────────────────────────────────────────────────────────────────────


def test_a_dead_letter_carries_every_error_spend_options_and_artifacts() -> None:
    h = History(make_plan(stage("a"), stage("b", "a", retries=1)))
    h.dispatch("a").outcome("a")
    for i in range(2):
        h.dispatch("b").failure("b", error=f"vendor 503 on try {i + 1}", cost="0.25")
        h.tick(120)
    rule, action = h.decide() or ("", None)
    assert rule == "R9" and isinstance(action, SuspendForHuman)
    ctx = action.request.context
    assert [f["error"] for f in ctx["failures"]] == ["vendor 503 on try 1", "vendor 503 on try 2"]
    assert [f["attempt"] for f in ctx["failures"]] == [1, 2]
    assert ctx["spend"] == {
        "ceiling": "100",
        "spent": "1.50",
        "reserved": "0.00",
        "remaining": "98.50",
        "inference_spent": "0",
    }
    assert [o["decision"] for o in ctx["options"]] == ["resume", "abort"]
    assert ctx["options"][0]["effect"] == "give b one more attempt"
    assert [(a["node"], a["role"]) for a in ctx["artifacts"]] == [("a", "input")]
    assert ctx["node"]["id"] == "b" and ctx["node"]["attempts"] == 2 and ctx["node"]["max_attempts"] == 2


def test_an_escalation_carries_the_task_wide_context() -> None:
    h = History(make_plan(stage("a"), stage("b", "a"), budget_ceiling="2.10"))
    h.dispatch("a").outcome("a", cost="2.10")
    rule, action = h.decide() or ("", None)
    assert rule == "R7" and isinstance(action, Escalate) and action.request is not None
    ctx = action.request.context
    assert ctx["spend"]["remaining"] == "0.00" and "node" not in ctx
    assert {o["decision"] for o in ctx["options"]} == {"resume", "add_budget", "abort"}
    assert context_package(h.fold(), RequestKind.ESCALATION, None, (RESUME,))["failures"] == []


# ── the queue ────────────────────────────────────────────────────────────────────────────────────────


def item(
    rid: str, kind: RequestKind, value: Value = Value.STANDARD, minutes: int = 0, **kw: Any
) -> QueueItem:
    fields: dict[str, Any] = {
        "task_id": kw.pop("task_id", "t"),
        "request_id": rid,
        "kind": kind,
        "node": None,
        "value": value,
        "blocking": kind == RequestKind.ESCALATION,
        "opened_at": T0 + timedelta(minutes=minutes),
        "reason": "r",
        "options": (),
        "deadline": None,
        "cause": None,
    }
    return QueueItem(**{**fields, **kw})


def test_order_is_consequence_then_value_then_age() -> None:
    items = [
        item("ap-old", RequestKind.APPROVAL, minutes=0),
        item("ap-hero", RequestKind.APPROVAL, Value.HERO, minutes=9),
        item("dl-bg", RequestKind.DEAD_LETTER, Value.BACKGROUND, minutes=0),
        item("dl-std-new", RequestKind.DEAD_LETTER, minutes=5),
        item("dl-std-old", RequestKind.DEAD_LETTER, minutes=1),
        item("esc-bg", RequestKind.ESCALATION, Value.BACKGROUND, minutes=9),
        item("dl-release", RequestKind.DEAD_LETTER, Value.BACKGROUND, blocking=True, minutes=8),
        item("esc-hero", RequestKind.ESCALATION, Value.HERO, minutes=9),
    ]
    assert [i.request_id for i in order(items)] == [
        "esc-hero",
        "dl-release",  # release-blocking counts with the escalations
        "esc-bg",
        "dl-std-old",
        "dl-std-new",
        "dl-bg",
        "ap-hero",
        "ap-old",
    ]


def test_requests_sharing_a_root_cause_are_one_group_placed_at_its_most_pressing_member() -> None:
    cause = root_cause("vendor refused: prompt flagged (job 8f3a9c12d4)", node="shots/S01")
    assert cause == root_cause("vendor refused: prompt flagged (job 77aa01bc99)", node="shots/S02")
    assert cause != root_cause("vendor timed out", node="shots/S01")
    assert root_cause("t-1:shots/S03:a2 failed after 3 tries", task_id="t-1", node="shots/S03") == (
        "<id>:<id>:a# failed after # tries"
    )
    items = [
        item("ap", RequestKind.APPROVAL, Value.HERO, minutes=0),
        item("dl-1", RequestKind.DEAD_LETTER, Value.BACKGROUND, minutes=1, cause=cause, task_id="x"),
        item("dl-2", RequestKind.DEAD_LETTER, Value.HERO, minutes=2, cause=cause, task_id="y"),
        item("dl-3", RequestKind.DEAD_LETTER, Value.STANDARD, minutes=0, cause="other"),
        item("ap-2", RequestKind.APPROVAL, minutes=3),
        item("esc", RequestKind.ESCALATION, minutes=5),
        item("gated", RequestKind.DEAD_LETTER, Value.BACKGROUND, blocking=True, minutes=9, cause=cause),
    ]
    groups = group(items)
    assert [[i.request_id for i in g] for g in groups] == [
        ["esc"],
        ["gated"],  # the same cause, but a blocker: grouped within its own tier only
        ["dl-2", "dl-1"],
        ["dl-3"],
        ["ap"],
        ["ap-2"],
    ]


def test_open_items_from_a_fold() -> None:
    h = History(
        make_plan(
            stage("a", value="hero"),
            stage("b", "a", value="background", approval=True),
            stage("c", "a", gate=True),
        )
    )
    h.dispatch("a").outcome("a")
    h.dispatch("b").outcome("b")
    h.ask("approval:b:v1", RequestKind.APPROVAL, node="b")
    h.ask("dead_letter:c:a1", RequestKind.DEAD_LETTER, node="c")
    h.ask("escalation:1", RequestKind.ESCALATION)
    p = h.fold()
    opened = {e.seq: e.recorded_at for e in h.events}
    got = {i.request_id: i for i in open_items(p, opened)}
    assert got["approval:b:v1"].value == Value.BACKGROUND and not got["approval:b:v1"].blocking
    assert got["dead_letter:c:a1"].blocking  # a compliance-gated node
    assert got["escalation:1"].value == Value.HERO and got["escalation:1"].blocking  # the task's best node
    assert got["approval:b:v1"].cause is None
    assert [i.request_id for i in order(got.values())] == [
        "escalation:1",
        "dead_letter:c:a1",
        "approval:b:v1",
    ]
    assert got["escalation:1"].global_id == "t1/escalation:1"


# ── dead letters and request details ─────────────────────────────────────────────────────────────────


def test_suggestions_follow_the_kind_of_failure() -> None:
    assert suggestion(FailureKind.TECHNICAL).startswith("retry with a different model")
    assert suggestion(FailureKind.CONTENT).startswith("edit the input by hand")
    assert suggestion(FailureKind.UNKNOWN_OUTCOME).startswith("a person decides")
    assert suggestion(None) == "a person decides"


def test_dead_letter_entries_show_the_original_request_every_attempt_and_the_cost() -> None:
    h = History(make_plan(stage("a", retries=0)))
    h.dispatch("a").failure("a", FailureKind.CONTENT, error="banned word in prompt", cost="0.10")
    rule, action = h.act()
    assert rule == "R9" and isinstance(action, SuspendForHuman)
    h.human(action.request.id, RESUME, approver="producer")
    [entry] = dead_letters(h.fold(), h.events)
    assert entry["status"] == "resume by producer"
    assert entry["original_request"]["action"]["operation_key"] == "t1:a:a1"
    assert [(a["attempt"], a["result"], a["cost"], a["error"]) for a in entry["attempts"]] == [
        (1, "failed (content)", "0.10", "banned word in prompt")
    ]
    assert entry["cost"] == "0.10" and entry["suggested_action"].startswith("edit the input by hand")


def test_request_detail_lists_refused_answers() -> None:
    h, rid = approval()
    ruling = rule_on(h, {**payload(rid), "signature": "e" * 128})
    h.append(ruling.marker(), dedup_key=ruling.marker_key())
    detail = request_detail(h.fold(), h.events, rid)
    assert detail is not None
    assert detail["status"] == "open" and detail["options"] == ["approve", "abort"]
    assert len(detail["refused"]) == 1 and "bad signature" in detail["refused"][0]["detail"]
    assert detail["context_at_request"]["options"][0]["decision"] == "approve"
    assert request_detail(h.fold(), h.events, "nope") is None


# ── the plan ─────────────────────────────────────────────────────────────────────────────────────────


def test_approvers_by_kind_is_validated_in_the_plan() -> None:
    raw = {"goal": "g", "budget_ceiling": "10", "stages": [stage("a")]}
    plan = validate_plan(
        {**raw, "approval": {"approvers_by_kind": {"escalation": ["producer"]}}}, DEFAULT_ROUTES
    )
    assert allowed_approvers(plan.approval, RequestKind.ESCALATION) == ("producer",)
    with pytest.raises(PlanError, match="approvers_by_kind"):
        validate_plan({**raw, "approval": {"approvers_by_kind": {"budget": ["x"]}}}, DEFAULT_ROUTES)
    with pytest.raises(PlanError, match="not a valid id"):
        validate_plan({**raw, "approval": {"approvers_by_kind": {"approval": ["a b"]}}}, DEFAULT_ROUTES)
