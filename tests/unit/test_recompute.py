"""Every rule decision on record recomputes from its inputs (rules.recompute), a fan-out's too."""

from __future__ import annotations

from helpers import TASK, History, make_plan, stage, until

from rules.actions import Dispatch
from rules.events import Intent, MarkerKind, SystemMarker
from rules.keys import intent_key, refused_intent_key
from rules.projection import Projection, apply_provisional
from rules.recompute import recompute
from rules.table import decide


def fan_out(h: History, p: Projection, n: int) -> list[tuple[str, Intent]]:
    """Decide ``n`` dispatches the way the workflow does: each folded as decided, none written yet."""
    decided = []
    for _ in range(n):
        found = decide(p, h.now)
        assert found is not None
        rule, action = found
        assert isinstance(action, Dispatch)
        intent = Intent(
            action=action,
            rule=rule,
            watermark=p.watermark,
            decided_at=h.now,
            reservation=action.estimate,
            pending=tuple(p.provisional),
        )
        key = intent_key(TASK, p.watermark, p.intents + 1)
        apply_provisional(p, key, intent)
        decided.append((key, intent))
    return decided


def write(h: History, key: str, intent: Intent) -> None:
    assert isinstance(intent.action, Dispatch)
    h.append(intent, dedup_key=key, operation_key=intent.action.operation_key)


def test_a_fan_out_decided_on_one_watermark_recomputes_with_its_pending_intents() -> None:
    h = History(make_plan(stage("shots", fan_out=3, canary=False)))
    decided = fan_out(h, h.fold(), 3)
    assert [i.action.node for _, i in decided] == ["shots/S01", "shots/S02", "shots/S03"]
    for key, intent in reversed(decided):  # executors write their INTENTs in any order
        write(h, key, intent)
    assert recompute(h.events) == []


def test_a_decision_recorded_without_what_was_pending_does_not_recompute() -> None:
    h = History(make_plan(stage("shots", fan_out=2, canary=False)))
    (k1, i1), (k2, i2) = fan_out(h, h.fold(), 2)
    write(h, k1, i1)
    write(h, k2, i2.model_copy(update={"pending": ()}))  # as if decided on the fold alone
    assert recompute(h.events) == [
        f"seq {len(h.events)}: recorded R11 Dispatch(shots/S02), recomputed R11 Dispatch(shots/S01)"
    ]


def test_a_recorded_action_the_rules_would_not_take_is_reported() -> None:
    h = History(make_plan(stage("a"), stage("b", "a")))
    h.drive(until(Dispatch, "b"))
    wrong = Dispatch(node="b", attempt=1, operation_key=f"{TASK}:b:a1", executor="llm.text", estimate=0)
    h.intent(wrong)
    assert len(recompute(h.events)) == 1


def test_a_pending_intent_the_ledger_refused_still_lets_later_decisions_recompute() -> None:
    h = History(make_plan(stage("shots", fan_out=2, canary=False)))
    (k1, i1), (k2, i2) = fan_out(h, h.fold(), 2)
    h.append(
        SystemMarker(kind=MarkerKind.INTENT_REFUSED, node="shots/S01", detail=i1.model_dump_json()),
        refused_intent_key(k1),
    )
    write(h, k2, i2)
    assert recompute(h.events) == []
