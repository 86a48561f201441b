"""The pure rules of issue 15: what a registered key may sign (rules.approvers), add_budget per scope, backup
approvers, fair deadlines, and bounded refusals (rules.people)."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta
from decimal import Decimal
from typing import Any

from helpers import TASK, History, make_plan, stage, until
from test_people_rules import REGISTRY, approval, payload, rule_on

from rules.actions import RequestKind, SuspendForHuman
from rules.approvers import KeyRecord, covers_any, registry
from rules.events import MarkerKind, SystemMarker
from rules.people import Ruling, bounded, burst_reasons, final_deadline, prior_rejections
from rules.table import past_deadline

CHAIN = ["project:p", "episode:p/e1", "task:t1"]


def test_a_key_scope_covers_itself_and_what_is_below_it_in_the_tasks_chain() -> None:
    assert covers_any(["project:p"], "task:t1", CHAIN) and covers_any(["project:p"], "project:p", CHAIN)
    assert covers_any(["episode:p/e1"], "task:t1", CHAIN)
    assert not covers_any(["task:t1"], "project:p", CHAIN)  # a task's approver cannot raise the project
    assert not covers_any(["project:q"], "task:t1", CHAIN)
    assert covers_any(["*"], "project:p", CHAIN) and not covers_any(["project:p"], "project:x", CHAIN)


def test_the_registry_folds_adds_and_the_first_revoke() -> None:
    h = History(make_plan(stage("a")))
    t0, t1, t2 = h.now, h.now + timedelta(hours=1), h.now + timedelta(hours=2)
    log: list[dict[str, Any]] = [
        {"key_id": "k1", "action": "add", "approver": "ann", "public_key": "ab", "recorded_at": t0},
        {"key_id": "k1", "action": "revoke", "reason": "laptop lost", "recorded_at": t1},
        {"key_id": "k1", "action": "revoke", "reason": "again", "recorded_at": t2},
        {"key_id": "k2", "action": "add", "approver": "ann", "public_key": "cd", "kinds": ["approval"]},
    ]
    keys = registry(log)
    assert keys["k1"].revoked_at == t1 and keys["k1"].revoked_reason == "laptop lost"
    assert keys["k2"].kinds == ("approval",) and keys["k2"].scopes == ("*",) and keys["k2"].revoked_at is None


def _with(**change: Any) -> dict[str, KeyRecord]:
    return {**REGISTRY, "demo-director": replace(REGISTRY["demo-director"], **change)}


def test_a_revoked_expired_or_not_yet_valid_key_is_refused_as_of_the_decisions_arrival() -> None:
    h, rid = approval()
    now = h.now
    revoked = _with(revoked_at=now - timedelta(seconds=1), revoked_reason="rotated")
    assert "key demo-director was revoked at" in (rule_on(h, payload(rid), revoked).rejection or "")
    assert "rotated" in (rule_on(h, payload(rid), revoked).rejection or "")
    # Revoked after the decision arrived: the decision stands (it is judged as of its arrival).
    later = _with(revoked_at=now + timedelta(seconds=5))
    assert rule_on(h, payload(rid), later).accepted
    expired = _with(expires_at=now - timedelta(seconds=1))
    assert "key demo-director expired at" in (rule_on(h, payload(rid), expired).rejection or "")
    early = _with(not_before=now + timedelta(hours=1))
    assert "is not valid before" in (rule_on(h, payload(rid), early).rejection or "")


def test_a_key_limited_to_some_request_kinds_or_scopes_is_refused_elsewhere() -> None:
    h, rid = approval()
    kinds = _with(kinds=("dead_letter",))
    assert rule_on(h, payload(rid), kinds).rejection == (
        "key demo-director may not decide approval requests (allowed: dead_letter)"
    )
    elsewhere = _with(scopes=("project:other",))
    assert rule_on(h, payload(rid), elsewhere).rejection == (
        "key demo-director does not cover task:t1 (scopes: project:other)"
    )
    assert rule_on(h, payload(rid), _with(scopes=("project:default",))).accepted  # the plan's project


def _budget_escalation(scope: str | None) -> tuple[History, str]:
    h = History(make_plan(stage("a"), project="p", episode="e1"))
    h.ask("escalation:1", RequestKind.ESCALATION, budget_scope=scope)
    return h, "escalation:1"


def test_add_budget_raises_the_scope_that_refused_unless_it_names_another_of_the_tasks() -> None:
    h, rid = _budget_escalation("project:p")
    ruling = rule_on(h, payload(rid, "add_budget", "producer", amount="7"))
    assert ruling.accepted and ruling.raise_ceiling == ("project:p", Decimal("7"))
    assert ruling.decision is not None and ruling.decision.scope == "project:p"
    named = rule_on(h, payload(rid, "add_budget", "producer", amount="7", scope="episode:p/e1"))
    assert named.raise_ceiling == ("episode:p/e1", Decimal("7"))
    foreign = rule_on(h, payload(rid, "add_budget", "producer", amount="7", scope="project:zz"))
    assert foreign.rejection == (
        "scope project:zz is not one of this task's budgets (project:p, episode:p/e1, task:t1)"
    )
    assert "a scope is only for add_budget" in (
        rule_on(h, payload(rid, "resume", scope="task:t1")).rejection or ""
    )


def test_add_budget_is_authorised_per_scope() -> None:
    h, rid = _budget_escalation("project:p")
    task_only = {
        **REGISTRY,
        "demo-producer": replace(REGISTRY["demo-producer"], scopes=("task:t1",)),
    }
    refused = rule_on(h, payload(rid, "add_budget", "producer", amount="7"), task_only)
    assert refused.rejection == "key demo-producer does not cover project:p (scopes: task:t1)"
    ok = rule_on(h, payload(rid, "add_budget", "producer", amount="7", scope="task:t1"), task_only)
    assert ok.raise_ceiling == ("task:t1", Decimal("7"))


def test_an_add_budget_on_a_scope_above_the_task_leaves_the_tasks_ceiling() -> None:
    h, rid = _budget_escalation("project:p")
    before = h.fold().ceiling
    event = rule_on(h, payload(rid, "add_budget", "producer", amount="7")).decision
    assert event is not None
    h.append(event, dedup_key=f"{TASK}:resolution:{rid}")
    assert h.fold().ceiling == before and not h.fold().requests[rid].open
    h2, rid2 = _budget_escalation(None)
    event2 = rule_on(h2, payload(rid2, "add_budget", "producer", amount="7")).decision
    assert event2 is not None and event2.scope == "task:t1"
    h2.append(event2, dedup_key=f"{TASK}:resolution:{rid2}")
    assert h2.fold().ceiling == before + 7


def test_a_decision_that_arrived_after_the_deadline_loses_to_the_timeout() -> None:
    h, rid = approval(timeout="10m")
    deadline = h.fold().requests[rid].deadline
    assert deadline is not None
    assert rule_on(h, payload(rid), at=deadline).accepted  # at the deadline: still in time
    late = rule_on(h, payload(rid), at=deadline + timedelta(seconds=1))
    assert late.rejection == (
        f"arrived at {(deadline + timedelta(seconds=1)).isoformat()}, after the request's deadline "
        f"{deadline.isoformat()}"
    )


def test_backups_are_offered_the_request_at_its_first_deadline_then_it_times_out() -> None:
    h = History(
        make_plan(
            stage("a", approval=True),
            stage("b", "a"),
            approval={
                "timeout": "10m",
                "approvers": ["director"],
                "backups": ["editor"],
                "backup_timeout": "5m",
            },
        )
    )
    rule, action = h.drive(until(SuspendForHuman))
    h.record(rule, action)
    assert isinstance(action, SuspendForHuman)
    rid = action.request.id
    first = action.request.deadline
    assert first is not None
    p = h.fold()
    assert final_deadline(p, p.requests[rid]) == first + timedelta(minutes=5)
    # Before the first deadline only the plan's approvers decide; after it the backups may too.
    assert "editor may not decide" in (rule_on(h, payload(rid, approver="editor"), at=first).rejection or "")
    assert past_deadline(p, first) == [(rid, "a", MarkerKind.BACKUPS_OFFERED)]
    h.append(SystemMarker(kind=MarkerKind.BACKUPS_OFFERED, request_id=rid, node="a"))
    p = h.fold()
    assert p.requests[rid].open and p.requests[rid].deadline == first + timedelta(minutes=5)
    assert past_deadline(p, first + timedelta(minutes=1)) == []
    assert rule_on(h, payload(rid, approver="editor"), at=first + timedelta(minutes=1)).accepted
    assert past_deadline(p, first + timedelta(minutes=5)) == [(rid, "a", MarkerKind.TIMEOUT)]


def _refusal(i: int, rid: str | None, reason: str) -> Ruling:
    return Ruling(task_id=TASK, ref=f"ref-{i:03d}", request_id=rid, rejection=reason)


def test_beyond_three_refusals_per_request_a_batch_is_counted_in_one_marker_with_every_reason() -> None:
    flood = [_refusal(i, "approval:a:v1", "bad signature" if i % 2 else "unknown key") for i in range(500)]
    flood += [_refusal(900, None, "malformed decision")]
    single, bursts = bounded(TASK, flood, {"approval:a:v1": 1})
    assert [r.ref for r in single] == ["ref-000", "ref-001", "ref-900"]  # 3 - 1 already recorded, + another
    assert len(bursts) == 1
    detail = json.loads(bursts[0].payload["detail"])
    assert detail["count"] == 498 and detail["reasons"] == ["unknown key", "bad signature"]
    marker = SystemMarker.model_validate(bursts[0].payload)
    reasons = burst_reasons(marker)  # each sender still finds the ruling on its decision
    assert (
        len(reasons) == 498 and reasons["ref-002"] == "unknown key" and reasons["ref-003"] == "bad signature"
    )
    again = bounded(TASK, flood, {"approval:a:v1": 1})[1]
    assert again[0].dedup_key == bursts[0].dedup_key  # a retried batch writes the same marker


def test_prior_rejections_count_the_markers_recorded_one_by_one() -> None:
    h, rid = approval()
    for i in range(2):
        ruling = rule_on(h, {**payload(rid), "signature": f"{i}" * 128})
        h.append(ruling.marker(), dedup_key=ruling.marker_key())
    assert prior_rejections(h.events) == {rid: 2}
