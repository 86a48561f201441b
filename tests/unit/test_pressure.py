"""Backpressure from the people in the loop (rules.pressure): what opens and closes a request in the shared
queue, and how wide a fan-out may run while the project's people hold more requests than they can."""

from __future__ import annotations

from helpers import T0, History, make_plan, stage, until

from rules.actions import (
    Complete,
    Dispatch,
    Escalate,
    HumanDecisionType,
    HumanRequest,
    RequestKind,
    SuspendForHuman,
)
from rules.events import HumanDecision, Intent, MarkerKind, SystemMarker, to_new
from rules.pressure import QueueChange, Reading, queue_changes, width
from rules.recompute import recompute
from rules.table import decide, ready_nodes

OVER = {"pressure": {"load": 8, "capacity": 4}}  # twice what the people can hold
UNDER = {"pressure": {"load": 3, "capacity": 4}}


def test_width_is_the_plans_until_the_people_are_over_capacity_then_one_more_per_finished_node() -> None:
    assert width(6, 0, None) == 6
    assert width(6, 0, Reading(4, 4)) == 6  # at capacity is not over it
    assert width(6, 0, Reading(9, 0)) == 6  # capacity 0: backpressure is off
    assert [width(6, done, Reading(8, 4)) for done in range(5)] == [1, 2, 3, 3, 3]  # capped at 6 × 4 / 8
    assert width(6, 10, Reading(100, 1)) == 1  # never below one: the node in flight reads again


def _intent(action) -> tuple[str, dict]:
    new = to_new(Intent(action=action, rule="R9", watermark=1, decided_at=T0), dedup_key="k")
    return new.type, new.payload


def test_queue_changes_follow_a_request_from_the_intent_that_asks_it_to_what_closes_it() -> None:
    ask = HumanRequest(id="approval:a:v1", kind=RequestKind.APPROVAL, reason="r", options=())
    assert queue_changes(*_intent(SuspendForHuman(request=ask))) == QueueChange(
        opened=(("approval:a:v1", "approval"),)
    )
    stands_in = Escalate(reason="timed out", terminal=False, request=ask, resolves="approval:a:v0")
    assert queue_changes(*_intent(stands_in)) == QueueChange(
        opened=(("approval:a:v1", "approval"),), closed=("approval:a:v0",)
    )
    decided = to_new(HumanDecision(request_id="x", decision=HumanDecisionType.APPROVE, approver="d"), "k")
    assert queue_changes(decided.type, decided.payload) == QueueChange(closed=("x",))
    timeout = to_new(SystemMarker(kind=MarkerKind.TIMEOUT, request_id="x"), "k")
    assert queue_changes(timeout.type, timeout.payload) == QueueChange(closed=("x",))
    for ending in (Complete(verdict="Pass"), Escalate(reason="aborted", terminal=True)):
        assert queue_changes(*_intent(ending)) == QueueChange(close_all=True)
    closing = to_new(SystemMarker(kind=MarkerKind.CLOSING), "k")
    assert queue_changes(closing.type, closing.payload) == QueueChange(close_all=True)
    refused = to_new(SystemMarker(kind=MarkerKind.REJECTED_INPUT, request_id="x"), "k")
    assert queue_changes(refused.type, refused.payload) is None  # a refused decision closes nothing


def _fan_out_plan():
    shots = stage("shots", "script", fan_out=6, canary=False)
    return make_plan(stage("script"), shots, budget_ceiling="100", concurrency=6)


def _after_script(pressure: dict) -> History:
    """The script dispatched (its executor's append recorded ``pressure``) and done: the fan-out is next."""
    h = History(_fan_out_plan())
    rule, action = h.decide()
    assert isinstance(action, Dispatch) and action.node == "script"
    h.record(rule, action, extra=pressure)
    return h.outcome("script")


def _dispatch_all(h: History) -> list[Dispatch]:
    out = []
    while ready_nodes(h.view):
        rule, action = decide(h.view, h.now)
        assert isinstance(action, Dispatch)
        h.record(rule, action)
        out.append(action)
    return out


def test_over_capacity_a_fan_out_starts_with_one_node_and_widens_as_nodes_finish() -> None:
    h = _after_script(OVER)
    first = _dispatch_all(h)
    assert [d.node for d in first] == ["shots/S01"]
    assert "backpressure: 8 open requests for people who hold 4: 1 of 6 in flight" in first[0].reason
    h.outcome("shots/S01")
    assert [d.node for d in _dispatch_all(h)] == ["shots/S02", "shots/S03"]  # 1 finished: 2 in flight
    h.outcome("shots/S02").outcome("shots/S03")
    assert len(_dispatch_all(h)) == 3  # 3 finished: capped at 6 × 4 / 8 = 3
    assert recompute(h.events) == []  # every decision recomputes from the task's own record


def test_under_capacity_or_without_a_reading_the_fan_out_opens_at_the_plans_width() -> None:
    for pressure in (UNDER, {}):
        h = _after_script(pressure)
        dispatched = _dispatch_all(h)
        assert len(dispatched) == 6
        assert not any("backpressure" in d.reason for d in dispatched)


def test_a_newer_reading_under_capacity_lets_the_fan_out_widen_at_once() -> None:
    h = _after_script(OVER)
    (first,) = _dispatch_all(h)
    # The next INTENT written (here a retry's, after a technical failure) carries a fresh reading.
    h.failure(first.node)
    h.tick(60)
    rule, retry = decide(h.view, h.now)
    assert isinstance(retry, Dispatch) and retry.node == first.node
    h.record(rule, retry, extra=UNDER)
    assert h.view.pressure == Reading(3, 4)
    assert len(_dispatch_all(h)) == 5  # the other five at once
    assert recompute(h.events) == []


def _replayed(events: list) -> set[str]:
    """The open requests ``queue_changes`` leaves after these events (what human_queue holds)."""
    open_ids: set[str] = set()
    for e in events:
        change = queue_changes(e.type, e.payload)
        if change is None:
            continue
        if change.close_all:
            open_ids.clear()
        open_ids -= set(change.closed)
        open_ids |= {rid for rid, _ in change.opened}
    return open_ids


def _open_in_fold(h: History) -> set[str]:
    p = h.fold()
    return set() if p.terminal else {rid for rid, r in p.requests.items() if r.open}


def _asked(policy: str) -> tuple[History, str]:
    h = History(
        make_plan(stage("a", approval=True), stage("b", "a"), approval={"timeout": 60, "policy": policy})
    )
    rule, ask = h.drive(until(SuspendForHuman))
    h.record(rule, ask)
    assert isinstance(ask, SuspendForHuman)
    return h, ask.request.id


def test_the_queue_the_writes_keep_is_the_folds_open_requests_after_every_event() -> None:
    """What human_queue holds (each event's queue_changes, applied in order) equals the fold's open requests
    — none once the task ended — after every event of approval, timeout, escalation, resume, abort and
    completion histories."""
    histories = []
    h, rid = _asked("escalate")  # approved, then the task completes
    h.human(rid, HumanDecisionType.APPROVE).drive_to_review()
    h.act()
    histories.append(h)
    h, rid = _asked("escalate")  # timed out: an escalation stands in for it; resumed, the task completes
    h.tick(61).marker(MarkerKind.TIMEOUT, request_id=rid)
    rule, escalation = h.act()
    assert rule == "R6" and isinstance(escalation, Escalate) and escalation.request is not None
    h.human(escalation.request.id, HumanDecisionType.RESUME).drive_to_review()
    h.act()
    histories.append(h)
    h, rid = _asked("escalate")  # a person aborts
    h.human(rid, HumanDecisionType.ABORT)
    rule, _ = h.act()
    assert rule == "R1"
    histories.append(h)
    h, rid = _asked("abort")  # timed out under policy abort: the task ends with its request
    h.tick(61).marker(MarkerKind.TIMEOUT, request_id=rid)
    h.act()
    histories.append(h)
    for h in histories:
        for n in range(1, len(h.events) + 1):
            prefix = History(task_id=h.task_id)
            prefix.events = h.events[:n]
            assert _replayed(h.events[:n]) == _open_in_fold(prefix), (n, h.events[n - 1].type)
        assert h.fold().terminal and _replayed(h.events) == set()


def test_no_backpressure_reason_when_the_soft_limit_already_holds_the_fan_out_to_one() -> None:
    plan = make_plan(
        stage("script", estimate="5"),
        stage("shots", "script", fan_out=6, canary=False),
        budget_ceiling="12",
        concurrency=6,
        soft_limit=0.4,
    )
    h = History(plan)
    rule, action = h.decide()
    h.record(rule, action, extra=OVER)
    h.outcome("script")  # spent 5 of 12: past the soft limit (4.8), one node at a time anyway
    (first,) = _dispatch_all(h)
    assert "backpressure" not in first.reason
