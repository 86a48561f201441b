"""Recompute every decision on record from its inputs: the audit that the rules, and the LLM planner's
checks, decided what the ledger says they decided.

Each INTENT names its inputs: ``fold(events with seq <= watermark)``, the INTENTs still pending then
(``Intent.pending``: dispatches decided before it whose INTENT its executor had not written yet),
``decided_at``, and the version of the rule table that decided it (``Intent.rules``). Folding those and
deciding again with that table (``rules.table_versions``) must give the same rule and the same action.
Where an INTENT was decided by an older table, today's table decides it too, and a difference is reported
apart: informational, not a divergence.

A decision of the LLM planner (rule ``LLM``) is re-validated instead: the rules were silent at the
watermark the model was asked on; the model's raw output parses to the recorded proposal (the shape it must
have, ``rules.llm.Proposal``); the proposal becomes the recorded action under the same checks the loop
applies (``rules.llm.check_llm_action``: a ready node, the static gate, cost admission) on the INTENT's
inputs, or else the question to a person the loop asks; and the Decision event's own verdict (``action``,
``valid``, ``error``) is what those checks give on the fold it was recorded on.

Two recorded actions differ from the rules' by design, and are recognised: a dispatch whose reservation the
ledger refused on a scope above the task becomes an escalation naming the node
(``rules.table.budget_refused``; the refused INTENT itself is kept in an ``intent_refused`` marker, so the
decisions made while it was pending stay recomputable); and a model that could not be asked at all
(an outage) leaves a question to a person, whose reason is the error's text.

The fold is incremental: one projection advances through the events in order, and the INTENTs pending at a
decision are applied on top of it and taken off again (a fan-out's decisions share a watermark, and each
one's pending INTENTs extend the previous one's, so each is applied once). ``incremental=False`` folds from
scratch for every decision, as the definition reads; the tests check that both give the same answer.
Pure: events in, findings out.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from decimal import Decimal
from typing import Any, Final

from rules import routing
from rules.actions import Action, Compensate, Dispatch, Escalate, SuspendForHuman
from rules.envelope import StoredEvent
from rules.events import Decision, Intent, MarkerKind, SystemMarker, parse, parse_as
from rules.keys import refused_intent_key
from rules.llm import MODEL_UNAVAILABLE, PROPOSAL_REFUSED, ask_person, check_llm_action, parse_proposal
from rules.people import UNDO_REQUEST
from rules.projection import (
    NodeView,
    Projection,
    _reindex,  # the one private helper used: taking a pending INTENT off again must restore the indexes
    apply,
    apply_provisional,
    fold,
    new_projection,
)
from rules.table import BUDGET_REFUSED
from rules.table_versions import table, today

LLM: Final = "LLM"


@dataclass(frozen=True)
class Divergence:
    """One decision on record that its inputs do not give again."""

    seq: int
    recorded: str  # e.g. "R11 Dispatch(shots/S02)"
    recomputed: str  # e.g. "R11 Dispatch(shots/S01)", or why nothing could be recomputed

    def __str__(self) -> str:
        return f"seq {self.seq}: recorded {self.recorded}, recomputed {self.recomputed}"

    def as_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "recorded": self.recorded, "recomputed": self.recomputed}


@dataclass(frozen=True)
class Recomputation:
    """What recomputing a task's decisions found."""

    decisions: int  # rule decisions recomputed
    llm: int  # LLM decisions re-validated
    divergences: tuple[Divergence, ...]  # in seq order; empty: every decision recomputes
    # Decisions of an older rule table that today's table would take differently (informational).
    today: tuple[Divergence, ...] = ()
    notes: tuple[str, ...] = ()  # what could not be checked, and why

    @property
    def ok(self) -> bool:
        return not self.divergences


def recompute(events: Iterable[StoredEvent]) -> list[str]:
    """Every disagreement between a recorded decision and its recomputation (empty: none)."""
    return [str(d) for d in audit_decisions(events).divergences]


def audit_decisions(events: Iterable[StoredEvent], *, incremental: bool = True) -> Recomputation:
    """Recompute every rule decision and re-validate every LLM decision of one task's events."""
    ordered = sorted(events, key=lambda e: e.seq)
    if not ordered:
        return Recomputation(0, 0, ())
    record = _Record(ordered)
    run = _Run(record)
    checks = run.checks()
    views: _Views = _Incremental(record) if incremental else _Scratch(record)
    # By watermark, then by how many INTENTs were pending: a fan-out's chain is applied once, in order.
    for check in sorted(checks, key=lambda c: (c.watermark, len(c.pending), c.order)):
        p = views.at(check.watermark, check.pending)
        check.judge(p)
    route_divergences = _route_choices(ordered)
    return Recomputation(
        decisions=run.decisions,  # route choices are checked alongside, not counted as rule decisions
        llm=run.llm,
        divergences=tuple(sorted([*run.divergences, *route_divergences], key=lambda d: d.seq)),
        today=tuple(sorted(run.today, key=lambda d: d.seq)),
        notes=tuple(run.notes),
    )


def _route_choices(ordered: Sequence[StoredEvent]) -> list[Divergence]:
    """Every routed INTENT's route and claim, recomputed from the rows and the time it recorded
    (rules.routing): those that do not come out the same."""
    out = []
    for e in ordered:
        if e.type != "Intent" or not e.payload.get("route_chain"):
            continue
        recorded = f"route {e.payload.get('route')} ({e.payload.get('route_claim') or 'no claim'})"
        try:
            again = routing.recompute(e.payload)
        except (ValueError, KeyError, TypeError) as err:
            out.append(Divergence(e.seq, recorded, f"nothing: its routing inputs do not read ({err})"))
            continue
        if again is None:
            out.append(Divergence(e.seq, recorded, "nothing: its routing inputs are incomplete"))
        elif (again.route, again.claim) != (e.payload.get("route"), e.payload.get("route_claim")):
            out.append(Divergence(e.seq, recorded, f"route {again.route} ({again.claim or 'no claim'})"))
    return out


# ── what is on record ─────────────────────────────────────────────────────────────────────────────────
class _Record:
    """A task's events, with its INTENTs, refused INTENTs and Decisions parsed once."""

    def __init__(self, ordered: list[StoredEvent]) -> None:
        self.events = ordered
        self.intents: dict[str, tuple[StoredEvent, Intent]] = {}
        self.refused: dict[str, Intent] = {}  # by the refused marker's dedup key
        self.decisions: list[tuple[StoredEvent, Decision]] = []  # in seq order
        for e in ordered:
            if e.type == "Intent":
                self.intents[e.dedup_key] = (e, parse_as(e, Intent))
            elif e.type == "Decision":
                self.decisions.append((e, parse_as(e, Decision)))
            elif e.type == "SystemMarker":
                marker = parse(e)
                if isinstance(marker, SystemMarker) and marker.kind == MarkerKind.INTENT_REFUSED:
                    self.refused[e.dedup_key] = Intent.model_validate_json(marker.detail)

    def pending(self, key: str) -> Intent | None:
        """A pending INTENT by its dedup key: the one on record, or the one the ledger refused."""
        found = self.intents.get(key)
        if found is not None:
            return found[1]
        return self.refused.get(refused_intent_key(key))


# ── the projections the checks see ────────────────────────────────────────────────────────────────────
class _Views:
    def at(self, watermark: int, pending: Sequence[str]) -> Projection | str:
        """``fold(events <= watermark)`` plus the ``pending`` INTENTs in order; or the key of a pending INTENT
        on record nowhere. The projection is only good until the next call."""
        raise NotImplementedError


class _Scratch(_Views):
    """The definition, literally: a fresh fold for every decision."""

    def __init__(self, record: _Record) -> None:
        self.record = record

    def at(self, watermark: int, pending: Sequence[str]) -> Projection | str:
        p = fold(e for e in self.record.events if e.seq <= watermark)
        for key in pending:
            intent = self.record.pending(key)
            if intent is None:
                return key
            apply_provisional(p, key, intent)
        return p


_NODE_FIELDS: Final = tuple(f.name for f in fields(NodeView) if f.name != "indexed")


@dataclass(slots=True)
class _Applied:
    """A pending INTENT applied to the projection, and what it changed (to take it off again)."""

    key: str
    node: str
    saved: tuple[Any, ...]  # the node's fields before (``_NODE_FIELDS``)
    intents: int
    reserved: Decimal
    operation_key: str
    reservation: Decimal | None  # the operation's reservation before, None: it had none


class _Incremental(_Views):
    """One projection advanced event by event; pending INTENTs stacked on top and taken off again.

    Exact: before the projection moves on to later events every pending INTENT is taken off, so it always
    equals ``fold(events <= watermark)`` and then the pending INTENTs applied in order, as ``_Scratch``.
    """

    def __init__(self, record: _Record) -> None:
        self.record = record
        self.p = new_projection(record.events[0])
        self._next = 1  # index of the next event to apply
        self._stack: list[_Applied] = []

    def at(self, watermark: int, pending: Sequence[str]) -> Projection | str:
        events = self.record.events
        if self._next < len(events) and events[self._next].seq <= watermark:
            self._take_off(0)
            while self._next < len(events) and events[self._next].seq <= watermark:
                apply(self.p, events[self._next])
                self._next += 1
        keep = 0
        while keep < min(len(self._stack), len(pending)) and self._stack[keep].key == pending[keep]:
            keep += 1
        self._take_off(keep)
        for key in pending[keep:]:
            intent = self.record.pending(key)
            if intent is None:
                return key
            self._stack.append(self._put_on(key, intent))
        return self.p

    def _put_on(self, key: str, intent: Intent) -> _Applied:
        p = self.p
        action = intent.action
        assert isinstance(action, Dispatch)
        node = p.nodes[action.node]
        applied = _Applied(
            key=key,
            node=node.id,
            saved=tuple(getattr(node, name) for name in _NODE_FIELDS),
            intents=p.intents,
            reserved=p.reserved,
            operation_key=action.operation_key,
            reservation=p.reservations.get(action.operation_key),
        )
        apply_provisional(p, key, intent)
        return applied

    def _take_off(self, keep: int) -> None:
        """Take the pending INTENTs above the first ``keep`` off again, last first."""
        p = self.p
        while len(self._stack) > keep:
            a = self._stack.pop()
            del p.provisional[a.key]
            p.intents, p.reserved = a.intents, a.reserved
            if a.reservation is None:
                p.reservations.pop(a.operation_key, None)
            else:
                p.reservations[a.operation_key] = a.reservation
            node = p.nodes[a.node]
            for name, value in zip(_NODE_FIELDS, a.saved, strict=True):
                setattr(node, name, value)
            _reindex(p, node)  # ``indexed`` still says where the node is filed: it moves back


# ── the checks ────────────────────────────────────────────────────────────────────────────────────────
@dataclass
class _Check:
    watermark: int
    pending: tuple[str, ...]
    order: int  # the seq of what is checked: a stable tie-break
    judge: Callable[[Projection | str], None]


@dataclass
class _Run:
    """Builds the checks of one task's record and collects what they find."""

    record: _Record
    decisions: int = 0
    llm: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    today: list[Divergence] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    acted_at: dict[int, datetime] = field(default_factory=dict)  # Decision seq -> its LLM INTENT's time

    def checks(self) -> list[_Check]:
        out: list[_Check] = []
        decisions = self.record.decisions
        decision_seqs = [e.seq for e, _ in decisions]
        intents = sorted(self.record.intents.values(), key=lambda pair: pair[0].seq)
        for stored, intent in intents:
            if intent.rule != LLM:
                self.decisions += 1
                out.append(
                    _Check(intent.watermark, intent.pending, stored.seq, self._rule_check(stored, intent))
                )
                continue
            self.llm += 1
            asked: tuple[StoredEvent, Decision] | None = None
            if not _model_unavailable(intent.action):
                # The Decision it acted on: the latest one at its watermark (the loop records the INTENT
                # right after it reads the Decision back).
                i = bisect.bisect_right(decision_seqs, intent.watermark) - 1
                if i >= 0 and decision_seqs[i] not in self.acted_at:
                    asked = decisions[i]
                    self.acted_at[decision_seqs[i]] = intent.decided_at
            out.extend(self._llm_checks(stored, intent, asked))
        for e, decision in decisions:
            out.extend(self._decision_checks(e, decision))
        return out

    # A rule decision ─────────────────────────────────────────────────────────────────────────────────
    def _rule_check(self, stored: StoredEvent, intent: Intent) -> Callable[[Projection | str], None]:
        recorded = _describe(intent.rule, intent.action)

        def judge(p: Projection | str) -> None:
            if isinstance(p, str):
                self._diverge(stored.seq, recorded, f"nothing: pending INTENT {p} is not on record")
                return
            decide = table(intent.rules)
            if decide is None:
                self._diverge(stored.seq, recorded, f"nothing: rule table v{intent.rules} is not registered")
                return
            decided = decide(p, intent.decided_at)
            if not _same(decided, intent.rule, intent.action):
                self._diverge(stored.seq, recorded, _recomputed(decided, intent.action))
            version, today_decide = today()
            if intent.rules != version:
                now = today_decide(p, intent.decided_at)
                if not _same(now, intent.rule, intent.action):
                    self.today.append(
                        Divergence(
                            stored.seq, recorded, f"{_recomputed(now, intent.action)} (today's v{version})"
                        )
                    )

        return judge

    # An LLM decision ─────────────────────────────────────────────────────────────────────────────────
    def _llm_checks(
        self, stored: StoredEvent, intent: Intent, asked: tuple[StoredEvent, Decision] | None
    ) -> list[_Check]:
        recorded = _describe(LLM, intent.action)
        seq, at = stored.seq, intent.decided_at
        if asked is None and not _model_unavailable(intent.action):
            self._diverge(seq, recorded, "nothing: no Decision of the model is on record for it")
            return []
        # The watermark the model was asked on (its Decision's key ends with it): the rules were silent there.
        asked_at = _asked_watermark(asked[0]) if asked is not None else intent.watermark

        def silent(p: Projection | str) -> None:
            if isinstance(p, str):
                self._diverge(seq, recorded, f"nothing: pending INTENT {p} is not on record")
                return
            decide = table(intent.rules)
            if decide is None:
                self._diverge(seq, recorded, f"nothing: rule table v{intent.rules} is not registered")
                return
            decided = decide(p, at)
            if decided is not None:
                self._diverge(seq, recorded, f"{_describe(*decided)} (the rules were not silent)")

        def acted(p: Projection | str) -> None:
            if isinstance(p, str):
                self._diverge(seq, recorded, f"nothing: pending INTENT {p} is not on record")
                return
            expected: Action
            if asked is None:
                assert isinstance(intent.action, SuspendForHuman)  # _model_unavailable
                expected = ask_person(p, intent.action.request.reason)  # the outage's text, as recorded
            else:
                problem, action = check_llm_action(p, asked[1].proposal, at)
                expected = action if action is not None else ask_person(p, f"{PROPOSAL_REFUSED}{problem}")
            if not _same((LLM, expected), LLM, intent.action):
                self._diverge(seq, recorded, _recomputed((LLM, expected), intent.action))

        return [
            _Check(asked_at, intent.pending if asked is None else (), seq, silent),
            _Check(intent.watermark, intent.pending, seq, acted),
        ]

    def _decision_checks(self, e: StoredEvent, decision: Decision) -> list[_Check]:
        """The Decision event itself: its proposal is what its raw output parses to, and its verdict is what
        the loop's checks give on the fold it was recorded on (``fold(<= W)`` plus itself at seq W + 1)."""
        reparsed = _reparse(decision.raw_output)
        if reparsed != decision.proposal or (decision.proposal is None and decision.valid):
            self._diverge(
                e.seq,
                f"Decision proposal {_short(decision.proposal)} (valid={decision.valid})",
                f"proposal {_short(reparsed)}",
            )
            return []
        if decision.proposal is None:
            return []  # nothing to admit: the loop asks a person (checked with the INTENT that did)
        if decision.action is None and decision.valid and decision.error is None:
            self.notes.append(f"seq {e.seq}: a Decision recorded before decisions carried their action")
            return []
        at = self.acted_at.get(e.seq)
        if at is None:
            self.notes.append(
                f"seq {e.seq}: a Decision no INTENT acted on (its run ended first): proposal re-validated, "
                "admission not (no decision time)"
            )
            return []
        asked_at = _asked_watermark(e)
        recorded = _verdict(decision.action, decision.error)

        def judge(p: Projection | str) -> None:
            assert not isinstance(p, str)  # nothing pending
            if e.seq != asked_at + 1:
                # Something was written between the question and the answer: the activity checked on
                # fold(<= W) plus the Decision placed right after it (rare: fold that from scratch).
                p = fold(x for x in self.record.events if x.seq <= asked_at)
                apply(p, e.model_copy(update={"seq": asked_at + 1}))
            problem, action = check_llm_action(p, decision.proposal, at)
            if (action, problem) != (decision.action, decision.error):
                self._diverge(e.seq, f"Decision {recorded}", f"Decision {_verdict(action, problem)}")

        return [_Check(e.seq, (), e.seq, judge)]

    def _diverge(self, seq: int, recorded: str, recomputed: str) -> None:
        self.divergences.append(Divergence(seq, recorded, recomputed))


# ── helpers ───────────────────────────────────────────────────────────────────────────────────────────
def _same(decided: tuple[str, Action] | None, rule: str, recorded: Action) -> bool:
    if decided is None:
        return False
    got_rule, action = decided
    return got_rule == rule and (
        action == recorded or _refused_dispatch(action, recorded) or _refused_undo(action, recorded)
    )


def _refused_dispatch(decided: Any, recorded: Any) -> bool:
    """The rules dispatched; the ledger refused its reservation, so the node's escalation was recorded."""
    return (
        isinstance(decided, Dispatch)
        and isinstance(recorded, Escalate)
        and recorded.reason.startswith(BUDGET_REFUSED.format(node=decided.node))
    )


def _refused_undo(decided: Any, recorded: Any) -> bool:
    """The rules undid an output; the ledger refused its reservation, so its escalation was recorded."""
    return (
        isinstance(decided, Compensate)
        and isinstance(recorded, Escalate)
        and recorded.request is not None
        and recorded.request.id == f"{UNDO_REQUEST}{decided.operation_key}"
    )


def _model_unavailable(action: Action) -> bool:
    return isinstance(action, SuspendForHuman) and action.request.reason.startswith(MODEL_UNAVAILABLE)


def _asked_watermark(e: StoredEvent) -> int:
    """W of a Decision's dedup key ``task:decision:W`` (rules.keys.decision_key)."""
    return int(e.dedup_key.rsplit(":", 1)[1])


def _reparse(raw_output: str) -> dict[str, Any] | None:
    """The proposal the model's raw output gives under the planner's parse (activities.llm), or None."""
    try:
        value = json.loads(raw_output)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    proposal, _ = parse_proposal(value)
    return proposal.model_dump() if proposal is not None else None


def _describe(rule: str, action: Any) -> str:
    return f"{rule} {_name(action)}"


def _recomputed(decided: tuple[str, Action] | None, recorded: Action) -> str:
    """The recomputed decision, and where it has the recorded one's name, the first field that differs."""
    if decided is None:
        return "no rule (nothing matches and nothing is pending)"
    rule, action = decided
    text = _describe(rule, action)
    if _name(action) == _name(recorded) and action != recorded:
        theirs, ours = recorded.model_dump(mode="json"), action.model_dump(mode="json")
        differs = next((k for k in ours if ours.get(k) != theirs.get(k)), None)
        if differs is not None:
            text += f" (its {differs} differs)"
    return text


def _verdict(action: Action | None, error: str | None) -> str:
    return _name(action) if action is not None else f"refused ({error})"


def _short(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)[:200]


def _name(action: Any) -> str:
    node = getattr(action, "node", None)
    return f"{type(action).__name__}({node})" if node else type(action).__name__
