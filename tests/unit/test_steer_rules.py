"""The rules of skip, waive and restore (rules.changes, the fold, rule table 8), pure: what each change
may name, what it records, and what the rules then decide. The end-to-end flows are tests/workflows/
test_steering.py; these pin the refusals a running task rarely reaches (a compliance finding is never
waivable, a lost version is never restored) and the table's answers."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from helpers import T0, TASK, History, make_plan, stage

from ledgerflow.views.people import signed_change
from rules.actions import Complete, Dispatch, Rollback
from rules.approvers import KeyRecord
from rules.changes import applies, evaluate_change, parse_change, skipped_with
from rules.events import MarkerKind, SystemMarker, TaskChange, Verdict
from rules.people import Keys
from rules.projection import NodeStatus, index_problems, node_state
from rules.recompute import recompute
from rules.table_versions import table
from runtime.signing import demo_key, verify

_DIRECTOR = demo_key("director")
KEYS = Keys(
    {_DIRECTOR.key_id: KeyRecord(_DIRECTOR.key_id, _DIRECTOR.approver, _DIRECTOR.public_key)}, verify, None
)


def signed(kind: str, **kw: Any) -> dict[str, Any]:
    return signed_change(demo_key("director"), TASK, kind, issued_at=T0, **kw)


def record(h: History, raw: dict[str, Any]) -> TaskChange:
    """Rule on ``raw`` as the worker does and record the change (it must be accepted)."""
    ruling = evaluate_change(TASK, raw, h.view, KEYS, T0 + timedelta(seconds=1))
    assert ruling.event is not None, ruling.rejection
    h.append(ruling.event)
    return ruling.event


def items_plan() -> Any:
    return make_plan(
        stage("frames", fan_out=["A", "B", "C"], canary=False),
        stage("clips", "frames", fan_out=["A", "B", "C"], canary=False, inputs={"frame": "frames"}),
        stage("edit", "clips", inputs={"clips": "clips"}),
    )


def test_a_skip_takes_what_only_the_node_feeds_and_never_a_join_fed_by_others_too() -> None:
    h = History(items_plan())
    assert skipped_with(h.view, "frames/B") == ("frames/B", "clips/B"), "the edit joins A and C as well"
    event = record(h, signed("skip", node="frames/B"))
    assert event.nodes == ("frames/B", "clips/B")
    p = h.view
    assert p.nodes["frames/B"].done and node_state(p, p.nodes["clips/B"]) == NodeStatus.CANCELLED
    assert index_problems(p) == []
    assert applies(p, _parsed(signed("skip", node="clips/B"))) == "node clips/B is already skipped"
    assert applies(p, _parsed(signed("skip", node="compose"))) == (
        "the compose is never skipped (abort the task to stop it)"
    )


def test_the_edit_after_a_skip_reads_only_the_items_that_remain() -> None:
    h = History(items_plan())
    record(h, signed("skip", node="frames/B"))
    h.drive(lambda _r, a: isinstance(a, Dispatch) and a.node == "edit")
    _, action = h.decide()
    assert isinstance(action, Dispatch) and action.node == "edit"
    assert [ref["node"] for ref in action.input["inputs"]["clips"]] == ["clips/A", "clips/C"]
    assert recompute(h.events) == []


def test_a_compliance_finding_is_never_waivable_and_a_pass_has_nothing_to_waive() -> None:
    h = History(make_plan(stage("a")))
    to_review(h, Verdict.COMPLIANCE_BLOCK, ("a",))
    refused = evaluate_change(TASK, signed("waive", node="review", note="ship it"), h.view, KEYS, T0)
    assert refused.rejection == "compliance findings are never waivable"
    passed = History(make_plan(stage("a")))
    passed.drive_to_review(Verdict.PASS)
    why = applies(passed.view, _parsed(signed("waive", node="a", note="fine")))
    assert why == "no review asks for rework: there is nothing to waive"


def test_table_8_completes_a_fully_waived_rework_and_table_7_would_have_rolled_it_back() -> None:
    h = History(make_plan(stage("a"), stage("b", "a")))
    to_review(h, Verdict.QUALITY_REWORK, ("a", "b"))
    record(h, signed("waive", node="a", note="a is right"))
    rule, action = h.decide()
    assert (rule, isinstance(action, Rollback)) == ("R10", True) and action.targets == ("b",)
    record(h, signed("waive", node="b", note="b too"))
    rule, action = h.decide()
    assert (rule, action) == ("R3", Complete(verdict=Verdict.QUALITY_REWORK.value))
    v7 = table(7)
    assert v7 is not None and isinstance(v7(h.view, T0)[1], Rollback), "no waiver existed under table 7"


def test_a_lost_version_is_never_restored_and_a_current_one_is_already_current() -> None:
    h = History(make_plan(stage("a"), stage("b", "a")))
    to_review(h, Verdict.QUALITY_REWORK, ("a",))
    _, rollback = h.act()
    h.drive(lambda _r, act: isinstance(act, Dispatch) and act.node == "review")
    p = h.view
    assert len(p.nodes["a"].outputs) == 2
    assert applies(p, _parsed(signed("restore", node="a", edit={"version": 2}))) == (
        "version 2 of a is already current"
    )
    h.append(
        SystemMarker(
            kind=MarkerKind.ARTIFACT_LOST, node="a", detail=p.nodes["a"].outputs[0].artifact["sha256"]
        )
    )
    assert applies(h.view, _parsed(signed("restore", node="a", edit={"version": 1}))) == (
        "version 1 of a was found missing or corrupt: it cannot be restored"
    )
    assert isinstance(rollback, Rollback)


def test_change_shapes_are_refused_in_one_line() -> None:
    for raw, why in (
        (signed("restore", node="a", edit={"version": 0}), 'a restore sets input {"version": N}'),
        (signed("restore", node="a", edit={"version": "1"}), 'a restore sets input {"version": N}'),
        (signed("skip"), "a skip names a node"),
        (signed("skip", node="a", edit={"x": 1}), "a skip sets no input"),
        (signed("waive", node="a"), "a waiver says why in its note"),
    ):
        parsed = parse_change(raw)
        assert isinstance(parsed, str) and why in parsed, (raw, parsed)


def to_review(h: History, verdict: Verdict, flagged: tuple[str, ...]) -> None:
    """Run every node, then record the review's ``verdict`` blaming ``flagged``."""
    h.drive(lambda _r, a: isinstance(a, Dispatch) and a.node == "review")
    h.act()
    h.review(verdict, flagged=flagged, findings=tuple(f"content.visual: {n} off" for n in flagged))


def _parsed(raw: dict[str, Any]) -> Any:
    parsed = parse_change(raw)
    assert not isinstance(parsed, str), parsed
    return parsed
