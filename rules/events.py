"""The twelve event types: every fact the ledger records, as frozen pydantic models.

The schema evolves append-only: new fields are optional with defaults; a breaking change bumps
``schema_version`` and adds an upcaster to ``_UPCASTERS``. History is never rewritten.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from decimal import Decimal
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from rules.actions import Action, Escalate, HumanDecisionType, Rollback
from rules.envelope import NewEvent, StoredEvent
from rules.plan import Plan
from rules.pricing import PriceBook


class FailureKind(StrEnum):
    """Why an attempt failed; the rules treat each kind differently
    (docs/design.md#technical-and-content-failures)."""

    TECHNICAL = "technical"  # timeouts, 5xx, vendor job errors: retry with backoff
    CONTENT = "content"  # the vendor refused the content: never resend it unchanged
    UNKNOWN_OUTCOME = "unknown_outcome"  # the vendor cannot say whether it ran: a person decides
    STALLED = "stalled"  # progress stopped past the watchdog threshold: cancelled at the vendor
    INVALID_OUTPUT = "invalid_output"  # the artifact or the model output failed validation


class MarkerKind(StrEnum):
    """System markers: facts about the machinery rather than the work."""

    VOID = "void"  # an INTENT provably never reached the vendor
    SUBMITTING = "submitting"  # write-ahead: a submit under this key is about to be sent
    REFUSED = "refused"  # the vendor refused that submit before accepting anything: it was not sent after all
    LATE_CHARGE = "late_charge"  # a job the vendor created after its operation was resolved: its charge
    ARTIFACT_LOST = (
        "artifact_lost"  # a node's output (sha256 in ``detail``) is missing or corrupt in the store
    )
    # A node's output (sha256 in ``detail``) found missing or corrupt, fetched again from the vendor job that
    # made it (it still held it) and verified against its sha256: nothing paid, nothing made again.
    ARTIFACT_REFETCHED = "artifact_refetched"
    # An ended task's output (sha256 in ``detail``) deleted from the store by retention: never reused again.
    ARTIFACT_EXPIRED = "artifact_expired"
    TIMEOUT = "timeout"  # a human request passed its deadline
    STALL = "stall"
    LEASE = "lease"
    COST_ANOMALY = "cost_anomaly"
    REJECTED_INPUT = "rejected_input"  # e.g. a human decision that failed validation
    # A dispatch's INTENT that was never written (the ledger refused it: a budget scope above the task was
    # short, or the task had begun closing): ``detail`` holds the INTENT as decided, so the decisions made
    # while it was pending can still be recomputed.
    INTENT_REFUSED = "intent_refused"
    CLOSING = "closing"  # the task ended: no executor may write a dispatch's INTENT after this
    # A request's first deadline passed unanswered: it is offered to the plan's backup approvers until its
    # final deadline (``ApprovalPolicy.backup_timeout`` later); only then does the timeout policy apply.
    BACKUPS_OFFERED = "backups_offered"
    # A burst of refused decisions on one request, beyond the first few recorded one by one: how many, and
    # every distinct reason (``detail``: JSON), so a flood of signals cannot grow the ledger without bound.
    REJECTED_BURST = "rejected_burst"


class Verdict(StrEnum):
    """The four review verdicts."""

    PASS = "Pass"
    SOFT_WARNING = "SoftWarning"
    QUALITY_REWORK = "QualityRework"
    COMPLIANCE_BLOCK = "ComplianceBlock"


class Media(BaseModel, frozen=True):
    """What the vendor says it delivered (every field optional: a vendor reports what it knows).

    ``rights`` is the usage-rights metadata (e.g. ``license``, ``holder``); None means the vendor sent none.
    """

    format: str | None = None
    duration_s: float | None = None
    width: int | None = None
    height: int | None = None
    rights: dict[str, str] | None = None
    codec: str | None = None  # probed from the file
    frames: int | None = None  # probed: video frames actually decoded


class ArtifactRef(BaseModel, frozen=True):
    """A registered artifact: where it is, what its bytes hash to and, if the vendor said, what it is."""

    uri: str
    sha256: str
    size: int = 0
    media: Media | None = None  # what the file is (probed, for media); optional: older records still parse
    claimed: Media | None = None  # what the vendor said, kept only where it disagrees with the file


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")
    SCHEMA: ClassVar[int] = 1  # the payload version this code writes; older versions are upcast on read


E = TypeVar("E", bound=_Event)


class TaskCreated(_Event):
    type: Literal["TaskCreated"] = "TaskCreated"
    plan: Plan
    # What each stage's routes said a node costs when the task opened (rules.pricing): an input to every
    # admission, recorded so the audit recomputes them. None: a task opened before price books.
    prices: PriceBook | None = None


class Intent(_Event):
    """The loop's decision, written (fenced) before it is acted on."""

    SCHEMA: ClassVar[int] = 2  # v2: a Rollback action names ``targets`` (v1: one ``target``)
    type: Literal["Intent"] = "Intent"
    action: Action
    rule: str  # "R11" or "LLM"
    watermark: int  # the decision was made on fold(events with seq <= watermark) …
    decided_at: datetime  # … at this workflow time: together they let an audit recompute it
    reservation: Decimal = Decimal(0)
    # … plus these INTENTs (dedup keys, in the order decided), decided before this one but not yet in the
    # fold at ``watermark``: a dispatch's INTENT is written by its executor (workflows/task.py), so a fan-out
    # decides node i on fold(<= watermark) and the i-1 dispatches before it (rules.recompute).
    pending: tuple[str, ...] = ()
    rules: int = 1  # the rule table's version that decided it (rules.table.RULES_VERSION; older INTENTs: 1)
    # A dispatch on an executor with routes to choose from: the route its executor chose when it wrote this
    # INTENT, the claim it made (a half-open probe, a fallback's canary), why, and every route's shared row
    # as that same statement read it, at the database time ``route_at`` (rules.routing.choose recomputes it).
    route: str | None = None
    route_claim: str | None = None
    route_reason: str = ""
    route_basis: dict[str, dict[str, Any]] | None = None
    route_chain: tuple[
        tuple[str, float, float | None], ...
    ] = ()  # (route, open_for_s, max_age_s), primary first
    route_at: datetime | None = None


class Decision(_Event):
    """An LLM's discretionary choice, with everything needed to judge it later.

    ``proposal`` is what the model proposed, as parsed (None: no usable output). ``action`` is the action it
    becomes after the same checks the loop applies (``rules.llm.check_llm_action`` on the task's fold at the
    decision's watermark and time, this decision's inference spend included); ``valid`` and ``error`` cover
    both the output's shape and that admission. The loop recomputes the action from the same inputs and acts
    on its own result. Both fields are optional: decisions recorded before them still parse.
    """

    type: Literal["Decision"] = "Decision"
    model: str
    prompt_hash: str
    raw_output: str = Field(max_length=20000)
    proposal: dict[str, Any] | None = None
    action: Action | None = None
    valid: bool
    error: str | None = None
    tokens_in: int = 0
    tokens_out: int = 0
    cost: Decimal = Decimal(0)


class Outcome(_Event):
    """A node's attempt succeeded and its artifact is registered."""

    type: Literal["Outcome"] = "Outcome"
    node: str
    operation_key: str
    job_id: str | None = None
    artifact: ArtifactRef
    actual_cost: Decimal
    input_hash: str | None = None  # the request's input hash (rules.inputs): equal hash, reusable output
    reused_from: str | None = None  # the OperationKey whose output this reuses (nothing was sent, cost 0)


class ExecutionResult(_Event):
    """A check's result: a static gate (``kind='gate'``) or the review (``kind='review'``)."""

    type: Literal["ExecutionResult"] = "ExecutionResult"
    kind: Literal["gate", "review"]
    node: str
    operation_key: str
    passed: bool = True
    input_version: int = 0
    verdict: Verdict | None = None
    flagged: tuple[str, ...] = ()
    findings: tuple[str, ...] = ()
    scores: dict[str, float] = Field(default_factory=dict)
    actual_cost: Decimal = Decimal(0)


class Progress(_Event):
    type: Literal["Progress"] = "Progress"
    node: str
    operation_key: str
    job_id: str
    progress: float = 0.0


class Failure(_Event):
    # v2: the retry's backoff after it is jittered by the operation's key (rules.projection.backoff); a v1
    # Failure keeps the plain exponential delay, so histories recorded before replay their timers unchanged.
    SCHEMA: ClassVar[int] = 2
    type: Literal["Failure"] = "Failure"
    node: str
    operation_key: str
    kind: FailureKind
    error: str = Field(max_length=4000)
    actual_cost: Decimal = Decimal(0)
    job_id: str | None = None  # the vendor job whose cost this is, where there was one


class SystemMarker(_Event):
    type: Literal["SystemMarker"] = "SystemMarker"
    kind: MarkerKind
    node: str | None = None
    operation_key: str | None = None
    request_id: str | None = None
    detail: str = ""
    # ``submitting``: which send this is (1, 2 …) and the client's timeout for it; the send may still create a
    # job until ``recorded_at + timeout_s + the route's max_accept_seconds`` (reconcile.operations).
    send: int | None = None
    timeout_s: float | None = None
    # ``late_charge``: what the vendor charged for the late job (spent on every budget scope).
    amount: Decimal | None = None
    # ``refused``: the HTTP status the vendor refused that send with, where there was one (a 5xx is a refusal
    # only on a route that declares it so; the end-of-task sweep still looks such an operation up).
    status: int | None = None


class HumanDecision(_Event):
    type: Literal["HumanDecision"] = "HumanDecision"
    request_id: str
    decision: HumanDecisionType
    approver: str
    note: str = Field(default="", max_length=2000)
    amount: Decimal | None = None
    decision_id: str | None = None  # the signed decision's id (rules.people): what its sender polls for
    # An add_budget's budget scope (``project:P``, ``episode:P/E``, ``task:T``); None: the task's.
    scope: str | None = None
    key_id: str | None = None  # the registry key the decision was signed with (older events: HMAC, none)
    # Decision format v3 (issue 24 §3): the exact message the approver signed and its Ed25519 signature, so
    # ``ledgerflow audit`` re-verifies the decision against the key registry as of its arrival; when it was
    # signed (the approver's clock, inside ``signed``) and when it reached Temporal (the instant it was judged
    # at). None on decisions recorded before signatures were kept.
    signed: str | None = Field(default=None, max_length=8000)
    signature: str | None = None
    issued_at: datetime | None = None
    received_at: datetime | None = None


class RollbackDone(_Event):
    # v2: ``targets``, the restart points (v1: one ``target``). v3: the same payload; the review's findings go
    # only to the nodes it flagged (rules.projection folds each version as it was decided).
    SCHEMA: ClassVar[int] = 3
    type: Literal["Rollback"] = "Rollback"
    targets: tuple[str, ...]
    invalidated: tuple[str, ...]
    flagged: tuple[str, ...] = ()
    round: int
    reason: str = ""


class Escalation(_Event):
    type: Literal["Escalation"] = "Escalation"
    reason: str
    terminal: bool
    request_id: str | None = None
    resolves: str | None = None


class PartialResolution(_Event):
    """A person resolved part of a task outside the normal path (e.g. a dead-letter recovery)."""

    type: Literal["PartialResolution"] = "PartialResolution"
    node: str
    resolution: str
    note: str = ""
    # The open request it resolves (a restore resolves the node's approval, a waiver the rework-limit
    # escalation); None: the node's dead letter (every resolution before requests were named).
    request_id: str | None = None


class ChangeKind(StrEnum):
    """What a person's signed change to a running task does (rules.changes)."""

    PAUSE = "pause"  # no new dispatch; work in flight finishes and is recorded
    RESUME = "resume"
    EDIT = "edit"  # a node's request fields, set: its next attempt asks that (its dead letter resolved)
    REROUTE = "reroute"  # a node's (or a stage's) next attempts go to another route, re-quoted at its price
    SKIP = "skip"  # a node, and what only it feeds, never runs (a fan-out item: cancelled); nothing is paid
    WAIVE = "waive"  # a review's rework finding on one output accepted as it is, with a reason
    RESTORE = "restore"  # an earlier version of a node's output made current again; descendants redo or reuse


class TaskChange(_Event):
    """A person's signed change to a running task (rules.changes), recorded as it was signed: the exact
    message and its Ed25519 signature (``ledgerflow audit`` re-verifies them), when it was signed and when it
    reached Temporal."""

    type: Literal["TaskChange"] = "TaskChange"
    change_id: str
    kind: ChangeKind
    node: str | None = None
    input: dict[str, Any] | None = None  # edit: request fields; reroute: {"route"}; restore: {"version"}
    # A re-route: the nodes it moves, and what one node costs at most on the new route (its declared bound,
    # read from the route table when the change was ruled on: admission reserves at least that from then on).
    # A skip: the nodes it skips (the named one and what only it feeds). A restore: the descendants whose
    # output it makes stale. A waiver: the outputs whose findings it waives.
    nodes: tuple[str, ...] = ()
    route_price: Decimal | None = None
    approver: str
    key_id: str
    note: str = Field(default="", max_length=2000)
    signed: str = Field(max_length=32000)
    signature: str
    issued_at: datetime
    received_at: datetime


Event = (
    TaskCreated
    | Intent
    | Decision
    | Outcome
    | ExecutionResult
    | Progress
    | Failure
    | SystemMarker
    | HumanDecision
    | RollbackDone
    | Escalation
    | PartialResolution
    | TaskChange
)
LedgerEvent = Annotated[Event, Field(discriminator="type")]
EVENT_TYPES = (
    "TaskCreated",
    "Intent",
    "Decision",
    "Outcome",
    "ExecutionResult",
    "Progress",
    "Failure",
    "SystemMarker",
    "HumanDecision",
    "Rollback",
    "Escalation",
    "PartialResolution",
    "TaskChange",
)

_ADAPTER: TypeAdapter[Event] = TypeAdapter(LedgerEvent)


def _rollback_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 named one restart point, the nearest common ancestor of the flagged nodes; v2 lists them."""
    out = {k: v for k, v in payload.items() if k != "target"}
    return {**out, "targets": [payload["target"]]}


def _intent_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    action = payload.get("action") or {}
    if action.get("kind") != "Rollback":
        return payload
    return {**payload, "action": _rollback_v1_to_v2(action)}


# (type, from_version) -> callable(payload) -> payload of from_version + 1
_UPCASTERS: dict[tuple[str, int], Any] = {
    ("Rollback", 1): _rollback_v1_to_v2,
    ("Rollback", 2): lambda payload: payload,  # v3 changed what the fold does with it, not its shape
    ("Intent", 1): _intent_v1_to_v2,
}


def parse(stored: StoredEvent) -> Event:
    """Turn a stored envelope into its typed event, upcasting old schema versions first."""
    payload = stored.payload
    version = stored.schema_version
    while (stored.type, version) in _UPCASTERS:
        payload = _UPCASTERS[(stored.type, version)](payload)
        version += 1
    return _ADAPTER.validate_python({**payload, "type": stored.type})


def effect_of(action: Action) -> tuple[str, RollbackDone | Escalation] | None:
    """The event an event-only action's INTENT is written with, in one transaction, and its key's suffix
    (``rules.keys.effect_key``): a Rollback's RollbackDone, an Escalate's Escalation; None for the rest."""
    if isinstance(action, Rollback):
        done = RollbackDone(
            targets=action.targets,
            invalidated=action.invalidated,
            flagged=action.flagged,
            round=action.round,
            reason=action.reason,
        )
        return "rollback", done
    if isinstance(action, Escalate):
        esc = Escalation(
            reason=action.reason,
            terminal=action.terminal,
            request_id=action.request.id if action.request else None,
            resolves=action.resolves,
        )
        return "escalation", esc
    return None


def parse_as(stored: StoredEvent, kind: type[E]) -> E:
    """``parse``, for a caller that knows which type the event is (ValueError if it is not)."""
    event = parse(stored)
    if not isinstance(event, kind):
        raise ValueError(f"event {stored.seq} of task {stored.task_id} is {stored.type}, not {kind.__name__}")
    return event


def to_new(event: _Event, dedup_key: str, operation_key: str | None = None) -> NewEvent:
    """Wrap a typed event for appending."""
    payload = event.model_dump(mode="json", exclude={"type"})
    return NewEvent(
        type=event.type,  # type: ignore[attr-defined]
        dedup_key=dedup_key,
        operation_key=operation_key,
        schema_version=event.SCHEMA,
        payload=payload,
    )


def vendor_spend(events: Iterable[StoredEvent]) -> Decimal:
    """What the ledger says was paid to vendors for these events: every operation's recorded cost (Outcome
    and Failure) and every late charge. The figure money checks hold against the vendor's own billing."""
    total = Decimal(0)
    for e in events:
        if e.type in ("Outcome", "Failure"):
            total += Decimal(str(e.payload.get("actual_cost", "0")))
        elif e.type == "SystemMarker" and e.payload.get("kind") == MarkerKind.LATE_CHARGE:
            total += Decimal(str(e.payload.get("amount") or "0"))
    return total
