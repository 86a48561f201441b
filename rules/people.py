"""People in the loop, the pure part (design.md §8): signed decisions and their validation, and the context
package a person is shown (the operator's views of them, the queue and the dead letters, are
``ledgerflow/queue.py``: they never enter the workflow's sandbox).

A decision arrives as raw JSON in a workflow signal. ``evaluate`` turns it into a :class:`Ruling`: the
``HumanDecision`` to record under the request's resolution key, or the reason it is refused (recorded as a
``REJECTED_INPUT`` marker), or "a duplicate, record nothing". It checks, in order: the shape, the signature
(authentication), the request (exists, in this task), the approver's right to decide it (authorisation),
that it is still open, that the decision is one of its options, and the amount of an add_budget.

Nothing here reads a key, a clock or the ledger. The activity (``activities/people.py``) reads the approver
keys from the worker's settings and the task's events from the ledger and passes them in; HMAC is a pure
function. Keys never appear in a workflow argument, result or error.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, Final

from rules.actions import HumanDecisionType, RequestKind
from rules.approvers import KEY_ID, KeyRecord, refusal
from rules.envelope import StoredEvent
from rules.events import (
    HumanDecision,
    MarkerKind,
    SystemMarker,
    parse,
)
from rules.keys import rejected_key, resolution_key
from rules.money import parse_amount
from rules.plan import COMPOSE, ApprovalPolicy, budget_scopes
from rules.projection import Projection, RequestView

# ── signing ──────────────────────────────────────────────────────────────────────────────────────────

FIELDS: Final = (
    "decision_id",
    "request_id",
    "decision",
    "approver",
    "key_id",
    "note",
    "amount",
    "scope",
    "signature",
)
CANONICAL_VERSION: Final = "ledgerflow-decision-v2"
MAX_NOTE: Final = 2000
MAX_ERROR_SHOWN: Final = 1000  # per failure in a context package
MAX_FAILURES_SHOWN: Final = 50  # for a task-level request (no node): the most recent ones

_UUID: Final = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_REQUEST_ID: Final = re.compile(r"[A-Za-z0-9_.:/-]{1,200}")
_APPROVER: Final = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_SIGNATURE: Final = re.compile(r"[0-9a-f]{128}")
_AMOUNT: Final = re.compile(r"[0-9]{1,12}(\.[0-9]{1,12})?")
_SCOPE: Final = re.compile(r"(project|episode|task):[A-Za-z0-9_.:/-]{1,200}")

# Verifies an Ed25519 signature: (public key hex, message, signature hex) -> valid. runtime.signing.verify in
# the worker; passed in so that this module (imported by the workflow's sandbox) needs no C library.
Verify = Callable[[str, str, str], bool]


def canonical(
    task_id: str,
    decision_id: str,
    request_id: str,
    decision: str,
    approver: str,
    key_id: str,
    amount: str | None,
    scope: str | None,
    note: str,
) -> str:
    """The signed message (UTF-8): a version line, then one field per line. Every field but ``note`` is
    newline-free, and ``note`` comes last, so two different decisions never produce the same message. The
    task id is signed but not sent: a decision signed for one task fails verification in every other.
    The reviewer page builds the same string in the browser (``ledgerflow/review/static/review.js``)."""
    fields = [task_id, decision_id, request_id, str(decision), approver, key_id, amount or "", scope or "", note]
    return "\n".join([CANONICAL_VERSION, *fields])


def decision_ref(raw: Any) -> str:
    """The decision's id if it carries a well-formed one, else a digest of the whole payload."""
    if isinstance(raw, dict):
        did = raw.get("decision_id")
        if isinstance(did, str) and _UUID.fullmatch(did):
            return did
    text = json.dumps(raw, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


# ── parsing ──────────────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True, slots=True)
class SignedDecision:
    """A decision payload of the right shape (not yet authenticated)."""

    decision_id: str
    request_id: str
    decision: HumanDecisionType
    approver: str
    key_id: str
    note: str
    amount: str | None
    scope: str | None
    signature: str

    def message(self, task_id: str) -> str:
        """The canonical message this decision's signature must be over."""
        return canonical(
            task_id,
            self.decision_id,
            self.request_id,
            self.decision.value,
            self.approver,
            self.key_id,
            self.amount,
            self.scope,
            self.note,
        )


def parse_decision(raw: Any) -> SignedDecision | str:
    """The payload as a :class:`SignedDecision`, or a one-line reason it is malformed or unsigned."""
    if not isinstance(raw, dict):
        return f"malformed decision: expected a JSON object, got {_json_type(raw)}"
    unknown = sorted(str(k) for k in raw if k not in FIELDS)
    if unknown:
        return f"malformed decision: unknown field {unknown[0][:40]!r}"
    sig = raw.get("signature")
    if sig is None or sig == "":
        return "unsigned decision: no signature"
    checks: tuple[tuple[str, re.Pattern[str] | None, bool], ...] = (
        ("decision_id", _UUID, True),
        ("request_id", _REQUEST_ID, True),
        ("decision", None, True),
        ("approver", _APPROVER, True),
        ("key_id", KEY_ID, True),
        ("note", None, False),
        ("amount", _AMOUNT, False),
        ("scope", _SCOPE, False),
        ("signature", _SIGNATURE, True),
    )
    for name, pattern, required in checks:
        value = raw.get(name)
        if value is None:
            if required:
                return f"malformed decision: {name} is required"
            continue
        if not isinstance(value, str):
            return f"malformed decision: {name} must be a string, got {_json_type(value)}"
        if pattern is not None and not pattern.fullmatch(value):
            return f"malformed decision: {name} {value[:60]!r} is not {_SHAPES[name]}"
    decision = raw["decision"]
    if decision not in {d.value for d in HumanDecisionType}:
        choices = ", ".join(d.value for d in HumanDecisionType)
        return f"malformed decision: decision {decision[:40]!r} is not one of {choices}"
    note = raw.get("note") or ""
    if len(note) > MAX_NOTE:
        return f"malformed decision: note is longer than {MAX_NOTE} characters"
    return SignedDecision(
        decision_id=raw["decision_id"],
        request_id=raw["request_id"],
        decision=HumanDecisionType(decision),
        approver=raw["approver"],
        key_id=raw["key_id"],
        note=note,
        amount=raw.get("amount"),
        scope=raw.get("scope"),
        signature=raw["signature"],
    )


_SHAPES: Final = {
    "decision_id": "a lowercase UUID",
    "request_id": "a request id",
    "approver": "a valid approver name",
    "key_id": "a key id",
    "amount": "a decimal string",
    "scope": "a budget scope (project:P, episode:P/E or task:T)",
    "signature": "128 lowercase hex digits (an Ed25519 signature)",
}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def parse_money(text: str) -> Decimal:
    """An add_budget amount: positive money (rules.money.parse_amount). ValueError says why."""
    amount = parse_amount(text)
    if amount <= 0:
        raise ValueError(f"must be positive, got {amount}")
    return amount


# ── the ruling ───────────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True, slots=True)
class Ruling:
    """What to record for one signalled decision: one of ``decision``, ``rejection``, ``duplicate``."""

    task_id: str
    ref: str  # the decision id, or a digest of a payload without a usable one
    request_id: str | None = None
    node: str | None = None
    decision: HumanDecision | None = None  # accepted: append under the resolution key
    raise_ceiling: tuple[str, Decimal] | None = None  # an accepted add_budget: (scope, amount) to raise
    rejection: str | None = None  # refused: append a REJECTED_INPUT marker with this reason
    duplicate: bool = False  # this very decision is already the request's resolution: record nothing

    @property
    def accepted(self) -> bool:
        return self.decision is not None

    def marker(self) -> SystemMarker:
        """The audit record of a refusal: ``detail`` is ``"<decision id>: <reason>"``."""
        assert self.rejection is not None
        return SystemMarker(
            kind=MarkerKind.REJECTED_INPUT,
            request_id=self.request_id,
            node=self.node,
            detail=f"{self.ref}: {self.rejection}"[:2000],
        )

    def marker_key(self) -> str:
        return rejected_key(self.task_id, self.ref)


def allowed_approvers(policy: ApprovalPolicy, kind: RequestKind) -> tuple[str, ...]:
    """Who may decide a request of this kind; empty means any approver with a key (authenticated)."""
    return policy.approvers_by_kind.get(kind.value, policy.approvers)


def resolutions(events: Iterable[StoredEvent], task_id: str) -> dict[str, StoredEvent]:
    """Request id -> the event stored under its resolution key (a decision or a timeout marker)."""
    prefix = resolution_key(task_id, "")
    return {e.dedup_key[len(prefix) :]: e for e in events if e.dedup_key.startswith(prefix)}


def describe_resolution(stored: StoredEvent) -> str:
    """``"approve by director"`` or ``"timed out"``: how a request was resolved."""
    event = parse(stored)
    if isinstance(event, HumanDecision):
        amount = f" {event.amount}" if event.amount is not None else ""
        return f"{event.decision.value}{amount} by {event.approver}"
    if isinstance(event, SystemMarker) and event.kind == MarkerKind.TIMEOUT:
        return "timed out"
    return f"{stored.type} #{stored.seq}"


@dataclass(frozen=True, slots=True)
class Keys:
    """What :func:`evaluate` authenticates with: the registry's keys and the verifier (runtime.signing)."""

    registry: Mapping[str, KeyRecord]
    verify: Verify


def evaluate(
    task_id: str,
    raw: Any,
    p: Projection,
    keys: Keys,
    received_at: datetime,
    resolved: Mapping[str, StoredEvent] | None = None,
) -> Ruling:
    """Rule on one raw decision against the task's fold ``p`` and the approver key registry.

    ``received_at`` is when the decision reached the workflow (a key is judged valid or expired as of then).
    ``resolved`` maps request ids to their resolution events (:func:`resolutions`), to tell a repeat of the
    decision that resolved a request (a duplicate: nothing to record) from a late or conflicting one.
    """
    ref = decision_ref(raw)
    raw_rid = raw.get("request_id") if isinstance(raw, dict) else None
    rid = raw_rid if isinstance(raw_rid, str) and _REQUEST_ID.fullmatch(raw_rid) else None
    view = p.requests.get(rid) if rid is not None else None
    node = view.request.node if view is not None else None

    def refuse(reason: str) -> Ruling:
        return Ruling(task_id=task_id, ref=ref, request_id=rid, node=node, rejection=reason)

    parsed = parse_decision(raw)
    if isinstance(parsed, str):
        return refuse(parsed)
    d = parsed
    # Authentication: a registered key, and its signature over this task's canonical message.
    key = keys.registry.get(d.key_id)
    if key is None:
        return refuse(f"unknown key {d.key_id!r} (not in the approver key registry)")
    if not keys.verify(key.public_key, d.message(task_id), d.signature):
        return refuse(
            f"bad signature for key {d.key_id!r} (forged, altered or signed for another task)"
        )
    if view is None:
        return refuse(f"no request {d.request_id!r} in task {task_id}")
    chain = [s for s, _ in budget_scopes(p.plan, task_id)]
    task_scope = chain[-1]
    scope = task_scope
    if d.decision == HumanDecisionType.ADD_BUDGET:
        scope = d.scope or view.request.budget_scope or task_scope
        if scope not in chain:
            return refuse(f"scope {scope} is not one of this task's budgets ({', '.join(chain)})")
    elif d.scope is not None:
        return refuse(f"a scope is only for add_budget, not {d.decision.value}")
    # Authorisation: the key's own limits (approver, validity, request kinds, scopes) …
    why = refusal(key, approver=d.approver, kind=view.request.kind.value, chain=chain, scope=scope, at=received_at)
    if why is not None:
        return refuse(why)
    # … and the plan's: who may decide this kind of request.
    allowed = allowed_approvers(p.plan.approval, view.request.kind)
    if allowed and d.approver not in allowed and not _backup_may(p, view, d.approver):
        return refuse(
            f"{d.approver} may not decide {view.request.kind.value} requests (allowed: {', '.join(allowed)})"
        )
    if not view.open:
        stored = (resolved or {}).get(d.request_id)
        if stored is not None:
            repeat = conflict(task_id, raw, stored)
            if repeat.duplicate:
                return repeat
            return refuse(repeat.rejection or "already resolved")
        return refuse(f"already resolved: {describe_view(view)}")
    if p.terminal:
        return refuse(f"task {task_id} is already {p.state.value}")
    if d.decision not in view.request.options:
        options = ", ".join(o.value for o in view.request.options)
        return refuse(f"{d.decision.value} is not an option of {d.request_id} (options: {options})")
    amount: Decimal | None = None
    if d.decision == HumanDecisionType.ADD_BUDGET:
        if d.amount is None:
            return refuse("add_budget needs an amount")
        try:
            amount = parse_money(d.amount)
        except ValueError as e:
            return refuse(f"amount {d.amount[:40]!r} {e}")
    elif d.amount is not None:
        return refuse(f"an amount is only for add_budget, not {d.decision.value}")
    event = HumanDecision(
        request_id=d.request_id,
        decision=d.decision,
        approver=d.approver,
        note=d.note,
        amount=amount,
        scope=scope if amount is not None else None,
        decision_id=d.decision_id,
        key_id=d.key_id,
    )
    raised = None if amount is None else (scope, amount)
    return Ruling(task_id=task_id, ref=ref, request_id=rid, node=node, decision=event, raise_ceiling=raised)


def _backup_may(p: Projection, view: RequestView, approver: str) -> bool:
    """A named backup approver may decide a request once it was offered to the backups (its first deadline
    passed unanswered)."""
    return view.offered_to_backups and approver in p.plan.approval.backups


def conflict(task_id: str, raw: Any, existing: StoredEvent) -> Ruling:
    """The ruling for a decision whose request's resolution key turned out to be taken by ``existing``.

    The same decision again is a duplicate (nothing to record); anything else lost the race and is told so.
    """
    ref = decision_ref(raw)
    rid = existing.dedup_key.removeprefix(resolution_key(task_id, ""))
    event = parse(existing)
    if isinstance(event, HumanDecision) and event.decision_id is not None and event.decision_id == ref:
        return Ruling(task_id=task_id, ref=ref, request_id=rid, duplicate=True)
    node = event.node if isinstance(event, SystemMarker) else None
    reason = f"already resolved: {describe_resolution(existing)}"
    return Ruling(task_id=task_id, ref=ref, request_id=rid, node=node, rejection=reason)


def describe_view(r: RequestView) -> str:
    if r.decision is not None:
        return f"{r.decision.value} by {r.decided_by}"
    return "timed out"


# ── the context package ──────────────────────────────────────────────────────────────────────────────

_EFFECTS: Final[dict[tuple[RequestKind | None, HumanDecisionType], str]] = {
    (RequestKind.APPROVAL, HumanDecisionType.APPROVE): "approve {node}: its dependents may run",
    (RequestKind.DEAD_LETTER, HumanDecisionType.RESUME): "give {node} one more attempt",
    (
        RequestKind.ESCALATION,
        HumanDecisionType.RESUME,
    ): "resume the task: a failed node gets one more attempt, a timed-out approval is given",
    (RequestKind.INVALID_DECISION, HumanDecisionType.RESUME): "resume the task",
    (None, HumanDecisionType.ADD_BUDGET): "raise the task's ceiling by the amount given, and resume",
    (None, HumanDecisionType.ABORT): "fail the task: nothing further runs or is paid for",
    (None, HumanDecisionType.APPROVE): "approve",
    (None, HumanDecisionType.RESUME): "resume",
}


def option_effects(
    kind: RequestKind, node: str | None, options: Sequence[HumanDecisionType]
) -> list[dict[str, str]]:
    """Each option with what it will do."""
    out = []
    for o in options:
        text = _EFFECTS.get((kind, o)) or _EFFECTS[(None, o)]
        out.append({"decision": o.value, "effect": text.format(node=node or "the node")})
    return out


def context_package(
    p: Projection, kind: RequestKind, node: str | None, options: Sequence[HumanDecisionType]
) -> dict[str, Any]:
    """What a person needs to decide: failure history (every error of every attempt), spend so far and the
    remaining budget, the options and their effect, and the artifacts concerned. JSON-safe and bounded."""
    view = p.nodes.get(node) if node is not None else None
    if view is not None and node is not None:
        concerned = [node]
    else:
        concerned = [n for n in p.nodes if p.nodes[n].failures]
    failures = sorted(
        (
            {
                "node": n,
                "attempt": f.attempt,
                "kind": f.kind.value,
                "error": f.error[:MAX_ERROR_SHOWN],
                "at": f.at.isoformat(),
            }
            for n in concerned
            for f in p.nodes[n].failures
        ),
        key=lambda f: (str(f["at"]), str(f["node"]), int(f["attempt"])),
    )
    omitted = 0
    if view is None and len(failures) > MAX_FAILURES_SHOWN:
        omitted = len(failures) - MAX_FAILURES_SHOWN
        failures = failures[-MAX_FAILURES_SHOWN:]
    package: dict[str, Any] = {
        "spend": {
            "ceiling": str(p.ceiling),
            "spent": str(p.spent),
            "reserved": str(p.reserved),
            "remaining": str(p.ceiling - p.spent - p.reserved),
            "inference_spent": str(p.inference_spent),
        },
        "failures": failures,
        "options": option_effects(kind, node, options),
        "artifacts": _artifacts(p, node),
    }
    if omitted:
        package["failures_omitted"] = omitted
    if view is not None and node is not None:
        spec = p.graph.nodes[node]
        package["node"] = {
            "id": node,
            "stage": spec.stage.id,
            "executor": spec.stage.executor,
            "value": spec.stage.value.value,
            "status": view.status.value,
            "attempts": view.attempts,
            "max_attempts": p.max_attempts(node),
            "spent": str(view.spent),
            "estimate": str(spec.stage.estimate),
        }
    return package


def _artifacts(p: Projection, node: str | None) -> list[dict[str, Any]]:
    """The node's own artifact and its inputs' (its dependencies'); task-level: the composition."""
    if node is None or node not in p.nodes:
        pairs = [(COMPOSE, "composition")] if COMPOSE in p.nodes else []
    else:
        pairs = [(node, "output"), *((d, "input") for d in p.graph.nodes[node].deps)]
    out = []
    for n, role in pairs:
        artifact = p.nodes[n].artifact
        if artifact is not None:
            out.append({"node": n, "role": role, **artifact})
    return out
