"""Recompute every decision on record from its inputs: the audit that the rule table decided what it says.

Each INTENT the rule table decided (rule ``R1``…``R11``) names its inputs: ``fold(events with seq <=
watermark)``, the INTENTs still pending then (``Intent.pending``: dispatches decided before it whose INTENT
its executor had not written yet), and ``decided_at``. Folding those and deciding again must give the same
rule and the same action. Pure: events in, problems out.

Two recorded actions differ from the rule's by design, and are recognised:

* a dispatch whose reservation the ledger refused on a scope above the task becomes an escalation naming the
  node (``rules.table.budget_refused``); the refused INTENT itself is kept in an ``intent_refused`` marker, so
  the decisions made while it was pending stay recomputable;
* decisions of the LLM planner (rule ``LLM``) are checked through their Decision events, not here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rules.actions import Dispatch, Escalate
from rules.envelope import StoredEvent
from rules.events import Intent, MarkerKind, SystemMarker, parse, parse_as
from rules.keys import refused_intent_key
from rules.projection import Projection, apply_provisional, fold
from rules.table import BUDGET_REFUSED, decide


def recompute(events: Iterable[StoredEvent]) -> list[str]:
    """Every disagreement between a recorded rule decision and its recomputation (empty: none)."""
    ordered = sorted(events, key=lambda e: e.seq)
    intents = {e.dedup_key: e for e in ordered if e.type == "Intent"}
    refused: dict[str, Intent] = {}
    for e in ordered:
        if e.type == "SystemMarker":
            marker = parse(e)
            if isinstance(marker, SystemMarker) and marker.kind == MarkerKind.INTENT_REFUSED:
                refused[e.dedup_key] = Intent.model_validate_json(marker.detail)
    problems = []
    for e in intents.values():
        intent = parse_as(e, Intent)
        if intent.rule == "LLM":
            continue
        p = fold(x for x in ordered if x.seq <= intent.watermark)
        missing = _apply_pending(p, intent.pending, intents, refused)
        if missing:
            problems.append(f"seq {e.seq}: pending INTENT {missing} is not on record")
            continue
        decided = decide(p, intent.decided_at)
        if decided is None:
            problems.append(f"seq {e.seq}: {intent.rule} recorded, but no rule matches its inputs")
            continue
        rule, action = decided
        if rule == intent.rule and (action == intent.action or _refused_dispatch(action, intent.action)):
            continue
        problems.append(
            f"seq {e.seq}: recorded {intent.rule} {_name(intent.action)}, recomputed {rule} {_name(action)}"
        )
    return problems


def _apply_pending(
    p: Projection, pending: tuple[str, ...], intents: dict[str, StoredEvent], refused: dict[str, Intent]
) -> str | None:
    """Fold the INTENTs pending at a decision; the key of one on record nowhere, if any."""
    for key in pending:
        if key in intents:
            apply_provisional(p, key, parse_as(intents[key], Intent))
        elif refused_intent_key(key) in refused:
            apply_provisional(p, key, refused[refused_intent_key(key)])
        else:
            return key
    return None


def _refused_dispatch(decided: Any, recorded: Any) -> bool:
    """The rules dispatched; the ledger refused its reservation, so the node's escalation was recorded."""
    return (
        isinstance(decided, Dispatch)
        and isinstance(recorded, Escalate)
        and recorded.reason.startswith(BUDGET_REFUSED.format(node=decided.node))
    )


def _name(action: Any) -> str:
    node = getattr(action, "node", None)
    return f"{type(action).__name__}({node})" if node else type(action).__name__
