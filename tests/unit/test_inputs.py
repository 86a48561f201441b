"""Data flow in the rules (rules.inputs, rules.table): what a node receives, its input hash, reuse."""

from __future__ import annotations

from decimal import Decimal

from helpers import History, make_plan, stage

from rules.actions import Dispatch, Escalate, HumanDecisionType, RequestKind, SuspendForHuman
from rules.dag import build_graph
from rules.events import ArtifactRef, MarkerKind, Outcome, RollbackDone, SystemMarker
from rules.inputs import input_hash, sources
from rules.projection import FREE_VOIDS
from rules.table_versions import table


def test_fan_outs_of_one_width_map_item_to_item_by_position_whatever_their_items_are_called() -> None:
    plan = make_plan(stage("frames", fan_out=2), stage("shots", "frames", fan_out=["x", "y"]))
    graph = build_graph(plan)
    assert sources(graph, graph.nodes["shots/y"]) == {"frames": "frames/S02"}


def test_an_undeclared_mapping_between_different_widths_joins() -> None:
    plan = make_plan(stage("frames", fan_out=2), stage("shots", "frames", fan_out=3))
    graph = build_graph(plan)
    assert sources(graph, graph.nodes["shots/S03"]) == {"frames": ["frames/S01", "frames/S02"]}


def test_the_input_hash_is_of_the_bytes_not_the_uris_and_names_who_is_asked() -> None:
    ref = {"uri": "file:///a/1", "sha256": "ab" * 32, "node": "frames/S01", "seq": 4}
    moved = {**ref, "uri": "s3://bucket/ab", "seq": 9}
    request = {"prompt": "p", "inputs": {"frame": ref}}
    assert input_hash(request, node="n") == input_hash({**request, "inputs": {"frame": moved}}, node="n")
    assert input_hash(request, node="n") != input_hash(request, node="m")
    assert input_hash(request, node="n", executor="a") != input_hash(request, node="n", executor="b")
    changed = {**request, "inputs": {"frame": {**ref, "sha256": "cd" * 32}}}
    assert input_hash(changed, node="n") != input_hash(request, node="n")


def _dispatch(h: History) -> Dispatch:
    rule, action = h.act()
    assert isinstance(action, Dispatch), (rule, action)
    return action


def _register(h: History, d: Dispatch, sha: str, reused_from: str | None = None) -> None:
    artifact = ArtifactRef(uri=f"file:///store/{sha}", sha256=sha, size=1)
    outcome = Outcome(
        node=d.node,
        operation_key=d.operation_key,
        artifact=artifact,
        actual_cost=Decimal(0) if reused_from else d.estimate,
        input_hash=d.input_hash,
        reused_from=reused_from,
    )
    h.append(outcome, dedup_key=f"{d.operation_key}:result", operation_key=d.operation_key)


def test_a_node_invalidated_with_unchanged_inputs_reuses_its_output_at_no_cost() -> None:
    h = History(make_plan(stage("a", estimate="1"), stage("b", "a", estimate="2")))
    a1 = _dispatch(h)
    _register(h, a1, "11" * 32)
    b1 = _dispatch(h)
    _register(h, b1, "22" * 32)
    h.rollback(targets=("a",), invalidated=("a", "b"))  # a reworked (not flagged here), b built on it
    a2 = _dispatch(h)
    assert a2.reuse is not None and a2.estimate == 0, "a's request is unchanged: its output is reused"
    _register(h, a2, "11" * 32, reused_from=a1.operation_key)
    b2 = _dispatch(h)
    assert b2.reuse == {"operation_key": b1.operation_key, "artifact": h.view.nodes["b"].outputs[0].artifact}
    assert b2.input_hash == b1.input_hash


def test_an_output_the_review_blamed_is_never_reused() -> None:
    h = History(make_plan(stage("a", estimate="1")))
    a1 = _dispatch(h)
    _register(h, a1, "11" * 32)
    h.append(RollbackDone(targets=("a",), invalidated=("a",), flagged=("a",), round=1, reason="bad"))
    a2 = _dispatch(h)
    assert a2.reuse is None and a2.estimate == Decimal("1")
    assert a2.input["feedback"]["review_findings"] == ["bad"], "the blamed node is told why"


def test_a_void_is_free_only_a_few_times_then_it_counts_against_the_attempts() -> None:
    h = History(make_plan(stage("a", retries=0)))
    for _ in range(FREE_VOIDS):
        d = _dispatch(h)
        h.marker(MarkerKind.VOID, node="a", op_key=d.operation_key)
        assert not h.fold().exhausted("a")
    d = _dispatch(h)
    h.marker(MarkerKind.VOID, node="a", op_key=d.operation_key)
    assert h.fold().exhausted("a"), "a node that keeps voiding goes to a person, not round and round"


def test_a_void_of_a_static_gate_lets_the_rules_issue_the_gate_again() -> None:
    h = History(make_plan(stage("a"), stage("b", "a", gate=True)))
    _register(h, _dispatch(h), "11" * 32)
    _rule, gate = h.act()
    assert gate.kind == "StaticGate" and h.fold().gate_pending
    h.marker(MarkerKind.VOID, node="b", op_key=gate.operation_key)
    assert not h.fold().gate_pending
    assert h.decide()[1].kind == "StaticGate"


def test_the_free_voids_are_counted_per_rework_round() -> None:
    h = History(make_plan(stage("a", retries=0)))
    for _ in range(FREE_VOIDS):
        d = _dispatch(h)
        h.marker(MarkerKind.VOID, node="a", op_key=d.operation_key)
    _register(h, _dispatch(h), "11" * 32)
    h.append(RollbackDone(targets=("a",), invalidated=("a",), flagged=("a",), round=1, reason="bad"))
    assert not h.fold().exhausted("a"), "a new round has its attempts"
    d = _dispatch(h)
    h.failure("a", op_key=d.operation_key)
    assert h.fold().exhausted("a"), "round 1's voids are not free attempts of round 2"


def test_an_approved_output_that_is_lost_and_made_again_is_approved_again() -> None:
    h = History(make_plan(stage("a", approval=True), stage("b", "a")))
    a1 = _dispatch(h)
    _register(h, a1, "11" * 32)
    rule, ask = h.act()
    assert isinstance(ask, SuspendForHuman), (rule, ask)
    h.human(ask.request.id, HumanDecisionType.APPROVE)
    assert h.fold().nodes["a"].approved
    h.append(SystemMarker(kind=MarkerKind.ARTIFACT_LOST, node="a", operation_key="lost-1", detail="11" * 32))
    # Making it again is paid: a person approves the cost first (table 9), and nothing is dispatched before.
    rule, remake = h.act()
    assert isinstance(remake, SuspendForHuman) and remake.request.id == "remake:a:v1", (rule, remake)
    assert h.decide()[0] == "wait", "nothing is made again before the person answers"
    v8 = table(8)
    assert v8 is not None and isinstance(v8(h.view, h.now)[1], Dispatch), "table 8 made it again at once"
    h.human(remake.request.id, HumanDecisionType.RESUME)
    a2 = _dispatch(h)
    assert a2.node == "a", "the lost output is made again before anything is built on it"
    _register(h, a2, "33" * 32)
    rule, action = h.act()
    assert isinstance(action, SuspendForHuman) and action.request.node == "a", (
        f"new bytes, a new approval; got {rule} {action}"
    )


def test_a_remake_request_that_timed_out_and_escalated_is_granted_by_resuming_the_escalation() -> None:
    """Nobody answered the remake request (its policy escalates): resuming that escalation is the go-ahead,
    as resuming a timed-out approval is the approval — the node is made again, not left waiting for ever."""
    h = History(make_plan(stage("a"), stage("b", "a"), approval={"timeout": "1h", "policy": "escalate"}))
    _register(h, _dispatch(h), "11" * 32)
    h.append(SystemMarker(kind=MarkerKind.ARTIFACT_LOST, node="a", operation_key="lost-1", detail="11" * 32))
    _, remake = h.act()
    assert isinstance(remake, SuspendForHuman) and remake.request.id == "remake:a:v1"
    h.tick(3601)
    h.marker(MarkerKind.TIMEOUT, node="a", request_id=remake.request.id)  # the workflow marks it
    rule, action = h.act()
    assert rule == "R6" and isinstance(action, Escalate) and action.request is not None, (rule, action)
    escalation = action.request
    assert escalation.kind == RequestKind.ESCALATION and escalation.node == "a", escalation
    h.human(escalation.id, HumanDecisionType.RESUME)
    again = _dispatch(h)
    assert again.node == "a", "resumed: the lost output is made again"
