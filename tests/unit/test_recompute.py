"""Every rule decision on record recomputes from its inputs (rules.recompute), a fan-out's too."""

from __future__ import annotations

import json
import time
from datetime import datetime
from decimal import Decimal

from helpers import TASK, History, make_plan, stage, until

from rules import table_versions
from rules.actions import Action, Complete, Dispatch, StaticGate, Wait
from rules.envelope import StoredEvent
from rules.events import Decision, ExecutionResult, Intent, MarkerKind, SystemMarker, Verdict, to_new
from rules.keys import intent_key, refused_intent_key
from rules.llm import ask_person, check_llm_action, parse_proposal
from rules.plan import REVIEW, Plan
from rules.projection import Projection, apply, apply_provisional
from rules.recompute import audit_decisions, recompute
from rules.table import RULES_VERSION, decide
from rules.table_versions import registered


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


# ── the rule table's versions ────────────────────────────────────────────────────────────────────────
def _dispatches_a_before_b(p: Projection, now: datetime) -> tuple[str, Action] | None:
    """A changed table: like today's, except that it asks a person before dispatching ``b``."""
    decided = decide(p, now)
    if decided is not None and isinstance(decided[1], Dispatch) and decided[1].node == "b":
        return "R9", ask_person(p, "v2 asks first")
    return decided


def _chain_history() -> History:
    h = History(make_plan(stage("a"), stage("b", "a")))
    h.drive(until(Dispatch, REVIEW))
    return h


def _retagged(h: History, node: str, version: int) -> tuple[list[StoredEvent], int]:
    """A copy of the events with the Dispatch INTENT of ``node`` recorded as decided by table ``version``
    (the ledger is append-only: the audit's inputs are changed in memory, never the rows)."""
    out, seq = [], 0
    for e in h.events:
        if e.type == "Intent" and e.payload["action"].get("node") == node:
            e, seq = e.model_copy(update={"payload": {**e.payload, "rules": version}}), e.seq
        out.append(e)
    return out, seq


NEXT = RULES_VERSION + 1  # a table no INTENT was recorded by yet


def test_an_intent_is_recomputed_with_the_table_version_it_records() -> None:
    h = _chain_history()
    events, seq = _retagged(h, "b", NEXT)
    with registered(NEXT, _dispatches_a_before_b):
        found = audit_decisions(events)
    assert [str(d) for d in found.divergences] == [
        f"seq {seq}: recorded R11 Dispatch(b), recomputed R9 SuspendForHuman"
    ]
    assert found.today == ()  # today's table is the one that would have dispatched b
    assert (
        audit_decisions(events).divergences[0].recomputed == f"nothing: rule table v{NEXT} is not registered"
    )


def test_where_today_s_table_decides_otherwise_it_is_reported_apart_not_as_a_divergence() -> None:
    h = _chain_history()  # every INTENT recorded by today's table
    with registered(NEXT, _dispatches_a_before_b, as_today=True):
        found = audit_decisions(h.events)
    assert found.ok and found.decisions == len([e for e in h.events if e.type == "Intent"])
    [differs] = found.today
    assert str(differs).endswith(f"recorded R11 Dispatch(b), recomputed R9 SuspendForHuman (today's v{NEXT})")
    assert table_versions.today()[0] == RULES_VERSION and table_versions.table(NEXT) is None  # both restored


# ── the LLM's decisions ──────────────────────────────────────────────────────────────────────────────
def _llm_history(raw: str, *, act: bool = True) -> History:
    """A task whose review gave no verdict (no rule matches), the model asked, its Decision recorded as
    ``llm.decide`` records it, and the loop's LLM INTENT."""
    h = History(make_plan(stage("a"), stage("b", "a"))).drive_to_review(verdict=None)
    asked = h.fold()
    assert decide(asked, h.now) is None
    at, watermark = h.now, asked.watermark
    proposal, problem = parse_proposal(json.loads(raw))
    decision = Decision(
        model="m",
        prompt_hash="0" * 64,
        raw_output=raw,
        proposal=proposal.model_dump() if proposal else None,
        valid=proposal is not None,
        error=problem,
        cost=Decimal("0.01"),
    )
    if proposal is not None:  # the activity's admission, on fold(<= W) plus the Decision at W + 1
        p = h.fold()
        apply(p, to_new(decision, dedup_key="x").stored(TASK, watermark + 1, 1, at))
        problem, action = check_llm_action(p, proposal.model_dump(), at)
        decision = decision.model_copy(update={"action": action, "valid": problem is None, "error": problem})
    h.append(decision, dedup_key=f"{TASK}:decision:{watermark}")
    if act:
        p = h.fold()
        problem, action = check_llm_action(p, decision.proposal, at)
        action = action or ask_person(p, f"no rule matched and the model's proposal was refused: {problem}")
        intent = Intent(action=action, rule="LLM", watermark=p.watermark, decided_at=at)
        h.append(intent, dedup_key=f"{TASK}:intent:{p.watermark}:{p.intents + 1}")
    return h


def test_an_llm_decision_is_re_validated_from_its_raw_output_to_the_action_taken() -> None:
    for raw in ('{"action": "escalate", "reason": "odd"}', '{"action": "dispatch", "node": "nowhere"}'):
        found = audit_decisions(_llm_history(raw).events)
        assert found.ok and found.llm == 1, (raw, found)


def test_an_llm_decision_whose_record_does_not_follow_from_its_inputs_is_a_divergence() -> None:
    h = _llm_history('{"action": "escalate", "reason": "odd"}')
    decision_at = next(e.seq for e in h.events if e.type == "Decision")
    intent_at = h.events[-1].seq
    # The model's raw output said something else than the proposal on record.
    forged = [
        e.model_copy(update={"payload": {**e.payload, "raw_output": '{"action": "ask_human"}'}})
        if e.seq == decision_at
        else e
        for e in h.events
    ]
    [d] = audit_decisions(forged).divergences
    assert d.seq == decision_at and "ask_human" in d.recomputed
    # The loop acted otherwise than the checks allow.
    wrong = Intent(action=Complete(verdict="Pass"), rule="LLM", watermark=intent_at - 1, decided_at=h.now)
    acted = [*h.events[:-1], to_new(wrong, dedup_key="y").stored(TASK, intent_at, 1, h.now)]
    assert [str(d) for d in audit_decisions(acted).divergences] == [
        f"seq {intent_at}: recorded LLM Complete, recomputed LLM Escalate"
    ]


def test_a_decision_no_intent_acted_on_is_noted_not_failed() -> None:
    found = audit_decisions(_llm_history('{"action": "escalate"}', act=False).events)
    assert found.ok and found.llm == 0 and "no INTENT acted on" in found.notes[0]


# ── incremental, and exact ───────────────────────────────────────────────────────────────────────────
def simulate(plan: Plan, fail_every: int = 13) -> History:
    """Drive the real rule table the way the loop does: a fan-out decides node after node on one watermark,
    each folded as decided (``Intent.pending``); executors write their INTENTs late, last decided first,
    some only after later decisions; every ``fail_every``-th first attempt fails and is retried."""
    h = History(plan)
    p = h.fold()
    queued: list[tuple[str, Intent]] = []
    results = 0

    def catch_up() -> None:
        for e in h.events[p.watermark :]:
            apply(p, e)

    while not p.terminal:
        found = decide(p, h.now)
        assert found is not None
        rule, action = found
        pending = tuple(p.provisional)
        key = intent_key(TASK, p.watermark, p.intents + 1)
        if isinstance(action, Dispatch):
            intent = Intent(
                action=action,
                rule=rule,
                watermark=p.watermark,
                decided_at=h.now,
                reservation=action.estimate,
                pending=pending,
            )
            apply_provisional(p, key, intent)
            queued.append((key, intent))
        elif isinstance(action, Wait):
            if not queued:
                h.tick(30)
                continue
            half = max(1, len(queued) // 2)
            done, queued = queued[:half], queued[half:]
            for k, i in reversed(done):
                write(h, k, i)
            for _, i in done:
                d = i.action
                assert isinstance(d, Dispatch)
                results += 1
                if d.node == REVIEW:
                    h.append(
                        ExecutionResult(
                            kind="review",
                            node=REVIEW,
                            operation_key=d.operation_key,
                            verdict=Verdict.PASS,
                            actual_cost=d.estimate,
                        ),
                        f"{d.operation_key}:result",
                        d.operation_key,
                    )
                elif d.attempt == 1 and results % fail_every == 0:
                    h.failure(d.node, op_key=d.operation_key)
                else:
                    h.outcome(d.node, op_key=d.operation_key)
            catch_up()
        else:
            op = action.operation_key if isinstance(action, StaticGate) else None
            h.append(
                Intent(action=action, rule=rule, watermark=p.watermark, decided_at=h.now, pending=pending),
                key,
                op,
            )
            catch_up()
            if isinstance(action, StaticGate):
                h.gate(action.node)
                catch_up()
    return h


def test_the_incremental_recomputation_equals_folding_from_scratch_for_every_decision() -> None:
    h = simulate(make_plan(stage("a", fan_out=30), stage("b", "a", fan_out=30, gate=True), concurrency=6))
    events = h.events
    intents = [e for e in events if e.type == "Intent"]
    assert max(len(e.payload["pending"]) for e in intents) >= 5  # fan-out chains, decided ahead of the ledger
    assert any(e.payload["action"].get("attempt") == 2 for e in intents)  # retries
    fast, slow = audit_decisions(events), audit_decisions(events, incremental=False)
    assert fast == slow and fast.ok and fast.decisions == len(intents)
    # And where decisions do not recompute: two INTENTs recorded without what was pending.
    broken = [
        e.model_copy(update={"payload": {**e.payload, "pending": []}})
        if e.seq in (intents[3].seq, intents[40].seq)
        else e
        for e in events
    ]
    fast, slow = audit_decisions(broken), audit_decisions(broken, incremental=False)
    assert fast == slow and len(fast.divergences) >= 1


def test_two_thousand_intents_recompute_in_well_under_a_few_seconds() -> None:
    width = 465  # four chained fan-outs: 1,860 dispatches, their retries, the gates, compose, review
    plan = make_plan(
        *(
            stage(s, *prev, fan_out=width)
            for s, prev in (("a", ()), ("b", ("a",)), ("c", ("b",)), ("d", ("c",)))
        ),
        concurrency=40,
        budget_ceiling="100000",
    )
    h = simulate(plan)
    n = sum(1 for e in h.events if e.type == "Intent")
    assert n >= 2000
    started = time.perf_counter()
    found = audit_decisions(h.events)
    took = time.perf_counter() - started
    print(f"recomputed {n} INTENTs ({len(h.events)} events) in {took:.2f} s")
    assert found.ok and found.decisions == n
    assert took < 5.0, took  # about 0.5 s on a 2-core machine; from scratch it is quadratic (minutes)


def test_a_model_that_could_not_be_asked_leaves_a_question_to_a_person_that_recomputes() -> None:
    h = History(make_plan(stage("a"))).drive_to_review(verdict=None)
    p = h.fold()
    reason = "no rule matched and the model could not be asked: LLM answered 500"
    h.append(
        Intent(action=ask_person(p, reason), rule="LLM", watermark=p.watermark, decided_at=h.now),
        dedup_key=f"{TASK}:intent:{p.watermark}:{p.intents + 1}",
    )
    found = audit_decisions(h.events)
    assert found.ok and found.llm == 1
    # Asked while the review was still running (the rules said wait), it is a divergence.
    *before, review_result, asked = h.events
    moved = {"seq": review_result.seq, "payload": {**asked.payload, "watermark": review_result.seq - 1}}
    early = [*before, asked.model_copy(update=moved)]
    first = audit_decisions(early).divergences[0]
    assert first.recomputed == "wait Wait (the rules were not silent)", first
