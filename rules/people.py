"""People in the loop, the pure part (docs/design.md#people): signed decisions and their validation, and the
context package a person is shown (the operator's views of them, the queue and the dead letters, are
``ledgerflow/views/queue.py``: they never enter the workflow's sandbox).

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
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, Final

from rules.actions import HumanDecisionType, RequestKind
from rules.approvers import KEY_ID, KeyRecord, endorsement_message, refusal
from rules.envelope import NewEvent, StoredEvent
from rules.events import (
    HumanDecision,
    MarkerKind,
    SystemMarker,
    parse,
    to_new,
)
from rules.keys import rejected_burst_key, rejected_key, resolution_key
from rules.money import parse_amount
from rules.plan import COMPOSE, ApprovalPolicy, budget_scopes
from rules.projection import Projection, RequestView
from rules.scopes import SCOPE_TEXT

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
    "issued_at",
    "signature",
)
CANONICAL_VERSION: Final = "ledgerflow-decision-v2"  # no issued-at: recorded decisions of earlier releases
CANONICAL_V3: Final = "ledgerflow-decision-v3"  # with issued-at (issue 24): what the CLI and the page sign
MAX_NOTE: Final = 2000
MAX_ERROR_SHOWN: Final = 1000  # per failure in a context package
MAX_FAILURES_SHOWN: Final = 50  # for a task-level request (no node): the most recent ones

_UUID: Final = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_REQUEST_ID: Final = re.compile(r"[A-Za-z0-9_.:/-]{1,200}")
_APPROVER: Final = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_SIGNATURE: Final = re.compile(r"[0-9a-f]{128}")
_AMOUNT: Final = re.compile(r"[0-9]{1,12}(\.[0-9]{1,12})?")
# An issued-at time: ISO 8601 in UTC with a Z, as JavaScript's Date.toISOString writes it (and issued_now).
_ISSUED_AT: Final = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?Z")

# Verifies an Ed25519 signature: (public key hex, message, signature hex) -> valid. runtime.signing.verify in
# the worker; passed in so that this module (imported by the workflow's sandbox) needs no C library.
Verify = Callable[[str, str, str], bool]

# The request an undo asks when the budget cannot carry it (rules.table.undo_refused): the one request a
# terminal task still takes answers to.
UNDO_REQUEST: Final = "undo:"


def rules_on(p: Projection, request_id: str) -> bool:
    """Whether the task's loop still rules on decisions for ``request_id``: on every request until the task
    ends; after its end, only on an open undo waiting for budget (its compensating phase waits for it)."""
    if not p.terminal:
        return True
    view = p.requests.get(request_id)
    return request_id.startswith(UNDO_REQUEST) and view is not None and view.open


@dataclass(frozen=True, slots=True)
class Answer:
    """What a decision's sender is told: ``accepted`` (what, by whom), ``already resolved`` (by what) or
    ``rejected`` (why); ``pending`` only where no ruling could be waited for."""

    decision_id: str
    status: str
    detail: str


def refusal_reason(stored: StoredEvent, decision_id: str) -> str | None:
    """The reason ``stored`` gives for refusing ``decision_id`` (one by one, or in a burst), if it does."""
    if stored.type != "SystemMarker":
        return None
    kind, detail = stored.payload.get("kind"), str(stored.payload.get("detail", ""))
    if kind == MarkerKind.REJECTED_INPUT.value and detail.startswith(f"{decision_id}: "):
        return detail[len(decision_id) + 2 :]
    if kind == MarkerKind.REJECTED_BURST.value and decision_id in detail:
        marker = parse(stored)
        assert isinstance(marker, SystemMarker)
        return burst_reasons(marker).get(decision_id)
    return None


def answer(events: Iterable[StoredEvent], decision_id: str) -> Answer | None:
    """What the ledger says of the decision ``decision_id``: its acceptance or its refusal, if recorded."""
    refused: Answer | None = None
    for stored in events:
        if stored.type == "HumanDecision" and stored.payload.get("decision_id") == decision_id:
            event = parse(stored)
            assert isinstance(event, HumanDecision)
            amount = f" {event.amount}" if event.amount is not None else ""
            return Answer(decision_id, "accepted", f"{event.decision.value}{amount} by {event.approver}")
        reason = refusal_reason(stored, decision_id)
        if reason is None:
            continue
        if reason.startswith("already resolved: "):
            refused = Answer(decision_id, "already resolved", reason.removeprefix("already resolved: "))
        else:
            refused = Answer(decision_id, "rejected", reason)
    return refused


def answer_after(p: Projection, recorded: Iterable[StoredEvent], raw: Any) -> Answer:
    """The ruling on ``raw`` once its batch was recorded: from what the batch recorded (``recorded``, folded
    into ``p``), else from the request as ``p`` has it (the same decision sent again: it stood, or it was
    refused before and the ledger already says why)."""
    ref = decision_ref(raw)
    found = answer(recorded, ref)
    if found is not None:
        return found
    rid = raw.get("request_id") if isinstance(raw, dict) else None
    view = p.requests.get(rid) if isinstance(rid, str) else None
    if view is not None and view.decision_id is not None and view.decision_id == ref:
        assert view.decision is not None
        return Answer(ref, "accepted", f"{view.decision.value} by {view.decided_by}")
    if view is not None and not view.open:
        return Answer(ref, "already resolved", describe_view(view))
    return Answer(ref, "rejected", "this decision was refused before (the ledger holds why)")


def precheck(p: Projection | None, raw: Any) -> str | None:
    """Why a decision cannot be taken at all, judged without I/O (a Temporal Update's validator): its shape,
    and whether it names a request still open on a task still ruling. None: it goes on to be verified and
    recorded. What needs the key registry (signature, authority, key endorsements) is judged after."""
    if p is None:
        return "the task is still opening: send it again in a moment"
    parsed = parse_decision(raw)
    if isinstance(parsed, str):
        return parsed
    view = p.requests.get(parsed.request_id)
    if view is None:
        return f"no request {parsed.request_id[:200]!r} in task {p.task_id}"
    if not rules_on(p, parsed.request_id):
        return f"task {p.task_id} is {p.state.value}: nothing to decide"
    if not view.open:
        if view.decision_id == parsed.decision_id:
            return None  # the same decision again: answered as it stood
        return f"already resolved: {describe_view(view)}"
    return None


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
    issued_at: str | None = None,
) -> str:
    """The signed message (UTF-8): a version line, then one field per line. Every field but ``note`` is
    newline-free, and ``note`` comes last, so two different decisions never produce the same message. The
    task id is signed but not sent: a decision signed for one task fails verification in every other.
    The reviewer page builds the same string in the browser (``ledgerflow/review/static/review.js``).

    With ``issued_at`` (v3, what is signed now) the time the approver signed is a line before the note;
    without it, the v2 message of the decisions recorded before issued-at (the audit re-verifies those)."""
    # The fields in _SIGNED_FIELDS' order (signed_fields reads them back).
    head = [task_id, decision_id, request_id, str(decision), approver, key_id, amount or "", scope or ""]
    if issued_at is not None:
        return "\n".join([CANONICAL_V3, *head, issued_at, note])
    return "\n".join([CANONICAL_VERSION, *head, note])


def decision_ref(raw: Any) -> str:
    """The decision's id if it carries a well-formed one, else a digest of the whole payload."""
    if isinstance(raw, dict):
        did = raw.get("decision_id")
        if isinstance(did, str) and _UUID.fullmatch(did):
            return did
    text = json.dumps(raw, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def issued_now(now: datetime) -> str:
    """``now`` as an issued-at field: UTC, milliseconds, a Z (the browser's ``toISOString`` form)."""
    return now.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_issued_at(text: str) -> datetime:
    """An issued-at field as an aware datetime; ValueError if it is not one."""
    if not _ISSUED_AT.fullmatch(text):
        raise ValueError(f"issued_at {text[:40]!r} is not an ISO 8601 UTC time like 2026-12-03T10:00:00.000Z")
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


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
    issued_at: str | None = None

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
            self.issued_at,
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
        ("scope", SCOPE_TEXT, False),
        ("issued_at", _ISSUED_AT, False),
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
        issued_at=raw.get("issued_at"),
    )


_SHAPES: Final = {
    "decision_id": "a lowercase UUID",
    "request_id": "a request id",
    "approver": "a valid approver name",
    "key_id": "a key id",
    "amount": "a decimal string",
    "scope": "a budget scope (project:P, episode:P/E or task:T)",
    "issued_at": "an ISO 8601 UTC time like 2026-12-03T10:00:00.000Z",
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
    """What :func:`evaluate` authenticates with: the registry's keys and the verifier (runtime.signing),
    and the issued-at window: a decision signed further than ``window`` from when it reached Temporal, or
    signed without an issued-at time, is refused (the worker always passes its setting; None, for the pure
    tests' v2 fixtures only, leaves the time unchecked)."""

    registry: Mapping[str, KeyRecord]
    verify: Verify
    window: timedelta | None = None
    # The deployment's root public keys (LEDGERFLOW_KEY_ROOTS): when any, only a key whose registry entry one
    # of them endorsed may sign (``unendorsed``). Empty: every registered key may, as before roots.
    roots: frozenset[str] = frozenset()


def unendorsed(key: KeyRecord, keys: Keys) -> str | None:
    """Why ``key`` may not sign under ``keys.roots`` (None if it may): no root configured means no check; else
    one of its recorded endorsements must be a configured root's valid signature over the entry as it stands.
    An endorsement of other content (a widened scope, another public key) or by another root counts for
    nothing."""
    if not keys.roots:
        return None
    message = endorsement_message(key.entry())
    for root, signature in key.endorsements:
        if root in keys.roots and keys.verify(root, message, signature):
            return None
    return f"key {key.key_id} is not endorsed by a root key (LEDGERFLOW_KEY_ROOTS)"


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
        return refuse(f"bad signature for key {d.key_id!r} (forged, altered or signed for another task)")
    why_not = unendorsed(key, keys)
    if why_not is not None:
        return refuse(why_not)
    issued = None if d.issued_at is None else parse_issued_at(d.issued_at)  # its shape is checked
    if keys.window is not None:
        why = outside_window(issued, received_at, keys.window)
        if why is not None:
            return refuse(why)
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
    why = refusal(
        key, approver=d.approver, kind=view.request.kind.value, chain=chain, scope=scope, at=received_at
    )
    if why is not None:
        return refuse(why)
    # … and the plan's: who may decide this kind of request.
    allowed = allowed_approvers(p.plan.approval, view.request.kind)
    if allowed and d.approver not in allowed and not _backup_may(p, view, d.approver, received_at):
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
    if not rules_on(p, d.request_id):
        return refuse(f"task {task_id} is already {p.state.value}")
    final = final_deadline(p, view)
    if final is not None and received_at > final:
        # Fair both ways: a decision that reached Temporal after the deadline loses to the timeout even if
        # the timeout is not marked yet (and one that arrived in time wins: the workflow rules on it first).
        return refuse(
            f"arrived at {received_at.isoformat()}, after the request's deadline {final.isoformat()}"
        )
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
        signed=d.message(task_id),
        signature=d.signature,
        issued_at=issued,
        received_at=received_at,
    )
    raised = None if amount is None else (scope, amount)
    return Ruling(task_id=task_id, ref=ref, request_id=rid, node=node, decision=event, raise_ceiling=raised)


def outside_window(issued: datetime | None, received_at: datetime, window: timedelta) -> str | None:
    """Why a decision issued at ``issued`` may not count when it reached Temporal at ``received_at``; None
    if it may. Replaying a signed decision later, or signing one ahead of time, is refused by this."""
    if issued is None:
        return (
            "signed without an issued-at time (decision format v2): sign it again with a current ledgerflow"
        )
    skew = received_at - issued
    if abs(skew) > window:
        when = "before" if skew > timedelta(0) else "after"
        return (
            f"issued at {issued.isoformat()}, {_span(abs(skew))} {when} it arrived at"
            f" {received_at.isoformat()}: outside the {_span(window)} window"
        )
    return None


def _span(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    return f"{seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"{seconds} s"


def _backup_may(p: Projection, view: RequestView, approver: str, at: datetime) -> bool:
    """A named backup approver may decide a request that its first deadline passed unanswered (it is offered
    to the backups then, whether or not the workflow has marked that yet)."""
    first = view.request.deadline
    return approver in p.plan.approval.backups and first is not None and at > first


def final_deadline(p: Projection, view: RequestView) -> datetime | None:
    """When a request times out: its deadline, or with backup approvers named, the backups' deadline."""
    if view.backup_deadline is not None:
        return view.backup_deadline
    first = view.request.deadline
    if first is None or not p.plan.approval.backups:
        return first
    return first + timedelta(seconds=p.plan.approval.backup_seconds)


# ── the audit: every recorded decision re-verified ──────────────────────────────────────────────────


@dataclass(frozen=True, slots=True)
class Reverified:
    """One recorded decision, re-verified: ``problem`` fails the audit, ``note`` only flags it."""

    seq: int
    problem: str | None = None
    note: str | None = None


_SIGNED_FIELDS: Final = (
    "task_id",
    "decision_id",
    "request_id",
    "decision",
    "approver",
    "key_id",
    "amount",
    "scope",
)


def signed_fields(message: str) -> dict[str, str] | None:
    """A canonical message (v2 or v3) back into its fields (``issued_at`` only in v3); None if not one."""
    version, _, rest = message.partition("\n")
    names = list(_SIGNED_FIELDS) + (["issued_at"] if version == CANONICAL_V3 else [])
    if version not in (CANONICAL_VERSION, CANONICAL_V3):
        return None
    parts = rest.split("\n", len(names))
    if len(parts) != len(names) + 1:
        return None
    return {**dict(zip(names, parts, strict=False)), "note": parts[-1]}


def reverify(
    task_id: str,
    stored: StoredEvent,
    p: Projection,
    keys: Keys,
    signed_since: datetime | None,
) -> Reverified:
    """Re-verify one recorded ``HumanDecision`` as the worker verified it when it arrived: the stored
    signature over the stored message, with the key the registry held *as of its arrival* (added before,
    not revoked or expired by then, allowed the request's kind and scope), the message saying what the
    event says, and its issued-at within ``keys.window`` of its arrival.

    A decision without a stored signature was recorded before decisions kept theirs: accepted as recorded
    then (a note), unless it was recorded at or after ``signed_since`` (when this database began keeping
    signatures): then nothing proves a person made it (a problem).
    """
    d = parse(stored)
    assert isinstance(d, HumanDecision)
    seq = stored.seq
    who = f"#{seq} {d.decision.value} by {d.approver}"
    if d.signed is None or d.signature is None:
        if signed_since is not None and stored.recorded_at >= signed_since:
            return Reverified(
                seq, problem=f"{who}: recorded without its signature: nothing proves it was signed"
            )
        return Reverified(
            seq,
            note=f"{who}: signed before issued-at (recorded before decisions kept their "
            "signature; accepted as recorded then)",
        )
    key = keys.registry.get(d.key_id or "")
    if key is None:
        return Reverified(seq, problem=f"{who}: key {d.key_id!r} is not in the approver key registry")
    if not keys.verify(key.public_key, d.signed, d.signature):
        return Reverified(seq, problem=f"{who}: its signature does not verify with key {key.key_id}")
    why_not = unendorsed(key, keys)
    if why_not is not None:
        return Reverified(seq, problem=f"{who}: {why_not}")
    fields = signed_fields(d.signed)
    if fields is None:
        return Reverified(seq, problem=f"{who}: what it records as signed is not a decision message")
    recorded = {
        "task_id": task_id,
        "decision_id": d.decision_id or "",
        "request_id": d.request_id,
        "decision": d.decision.value,
        "approver": d.approver,
        "key_id": d.key_id or "",
        "note": d.note,
    }
    differs = [name for name, value in recorded.items() if fields[name] != value]
    signed_amount = Decimal(fields["amount"]) if _AMOUNT.fullmatch(fields["amount"]) else None
    if signed_amount != d.amount:
        differs.append("amount")
    if fields["scope"] and fields["scope"] != d.scope:
        differs.append("scope")
    issued = None
    if "issued_at" in fields:
        try:
            issued = parse_issued_at(fields["issued_at"])
        except ValueError:
            issued = None
        if issued is None or issued != d.issued_at:
            differs.append("issued_at")
    if differs:
        return Reverified(
            seq, problem=f"{who}: the record differs from what was signed ({', '.join(differs)})"
        )
    at = d.received_at or stored.recorded_at
    if key.added_at is not None and key.added_at > at:
        return Reverified(
            seq,
            problem=f"{who}: key {key.key_id} was registered at {key.added_at.isoformat()}, after the"
            f" decision arrived at {at.isoformat()}",
        )
    view = p.requests.get(d.request_id)
    chain = [s for s, _ in budget_scopes(p.plan, task_id)]
    scope = d.scope or chain[-1]
    kind = view.request.kind.value if view is not None else ""
    why = refusal(key, approver=d.approver, kind=kind, chain=chain, scope=scope, at=at)
    if view is None:
        why = f"no request {d.request_id!r} in the task"
    if why is not None:
        return Reverified(seq, problem=f"{who}: {why} (as of its arrival at {at.isoformat()})")
    if issued is None:
        return Reverified(seq, note=f"{who}: signed before issued-at (a v2 signature; verified)")
    if keys.window is not None:
        late = outside_window(issued, at, keys.window)
        if late is not None:
            return Reverified(seq, problem=f"{who}: {late}")
    return Reverified(seq)


# ── floods: refusals beyond the first few on a request are counted, not recorded one by one ────────────

SINGLE_REFUSALS: Final = 3  # refused decisions per request recorded one by one
MAX_BURST_REASONS: Final = 30  # distinct reasons kept in one burst marker (the rest are counted)
MAX_REASON: Final = 300


def prior_rejections(events: Iterable[StoredEvent]) -> dict[str, int]:
    """Request id ("" for none) -> refused decisions already recorded one by one for it."""
    counts: dict[str, int] = {}
    for e in events:
        if e.type == "SystemMarker" and e.payload.get("kind") == MarkerKind.REJECTED_INPUT.value:
            rid = str(e.payload.get("request_id") or "")
            counts[rid] = counts.get(rid, 0) + 1
    return counts


def refused_refs(events: Iterable[StoredEvent]) -> set[str]:
    """The refs of every decision refused on record, one by one or in a burst."""
    refs: set[str] = set()
    for e in events:
        if e.type != "SystemMarker":
            continue
        kind, detail = e.payload.get("kind"), str(e.payload.get("detail", ""))
        if kind == MarkerKind.REJECTED_INPUT.value:
            refs.add(detail.partition(": ")[0])
        elif kind == MarkerKind.REJECTED_BURST.value:
            refs.update(json.loads(detail)["refs"])
    return refs


def bounded(
    task_id: str, refused: Sequence[Ruling], prior: Mapping[str, int]
) -> tuple[list[Ruling], list[NewEvent]]:
    """Split one batch's refusals: the ones to record one by one (up to :data:`SINGLE_REFUSALS` per request,
    counting ``prior``), and one ``REJECTED_BURST`` marker per request for the rest: their count, every
    distinct reason (up to :data:`MAX_BURST_REASONS`, the rest counted) and each decision's reason by its ref,
    so its sender still finds the ruling (a batch holds at most the workflow's batch size). Idempotent: a
    retried batch produces the same markers under the same keys."""
    single: list[Ruling] = []
    rest: dict[str, list[Ruling]] = {}
    seen = dict(prior)
    refs: set[str] = set()
    for r in refused:
        if r.ref in refs:
            continue  # the same decision twice in one batch: ruled on once
        refs.add(r.ref)
        rid = r.request_id or ""
        if seen.get(rid, 0) < SINGLE_REFUSALS:
            seen[rid] = seen.get(rid, 0) + 1
            single.append(r)
        else:
            rest.setdefault(rid, []).append(r)
    bursts = []
    for rid, rulings in rest.items():
        reasons: list[str] = []
        by_ref: dict[str, int] = {}
        uncounted = 0
        for r in rulings:
            reason = (r.rejection or "")[:MAX_REASON]
            if reason not in reasons and len(reasons) < MAX_BURST_REASONS:
                reasons.append(reason)
            if reason in reasons:
                by_ref[r.ref] = reasons.index(reason)
            else:
                by_ref[r.ref] = -1  # refused for a reason beyond the ones kept
                uncounted += 1
        detail = {"count": len(rulings), "reasons": reasons, "refs": by_ref, "other_reasons": uncounted}
        digest = hashlib.sha256("\n".join(sorted(by_ref)).encode()).hexdigest()[:32]
        marker = SystemMarker(
            kind=MarkerKind.REJECTED_BURST,
            request_id=rid or None,
            node=rulings[0].node,
            detail=json.dumps(detail, sort_keys=True),
        )
        bursts.append(to_new(marker, dedup_key=rejected_burst_key(task_id, rid or "-", digest)))
    return single, bursts


def burst_reasons(marker: SystemMarker) -> dict[str, str]:
    """A ``REJECTED_BURST`` marker's refusals: decision ref -> reason."""
    detail = json.loads(marker.detail)
    reasons: list[str] = detail["reasons"]
    other = f"refused (one of {detail['other_reasons']} reasons not kept in a burst of {detail['count']})"
    return {ref: reasons[i] if i >= 0 else other for ref, i in detail["refs"].items()}


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
