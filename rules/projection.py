"""The projection: a task's current business state, derived only by folding its ledger events.

The projection is never stored. ``fold`` builds one from scratch; ``apply`` advances one by a single event,
in place, which is what the workflow does after each ledger read (so a long task never refolds its whole
history). Everything here is pure: no clock (times come from events' ``recorded_at``), no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from enum import StrEnum
from typing import Any, Final, assert_never

from rules import scopes
from rules.actions import (
    Compensate,
    Complete,
    Dispatch,
    Escalate,
    HumanDecisionType,
    HumanRequest,
    RequestKind,
    Rollback,
    StaticGate,
    SuspendForHuman,
    Wait,
)
from rules.dag import Graph, build_graph
from rules.envelope import StoredEvent
from rules.events import (
    ChangeKind,
    Decision,
    Escalation,
    ExecutionResult,
    Failure,
    FailureKind,
    HumanDecision,
    Intent,
    MarkerKind,
    Outcome,
    PartialResolution,
    Progress,
    RollbackDone,
    SystemMarker,
    TaskChange,
    TaskCreated,
    Verdict,
    parse,
)
from rules.keys import key_fraction
from rules.plan import REVIEW, Plan, TimeoutPolicy, Value
from rules.pressure import Reading
from rules.pricing import PriceBook

# People's notes on a node's decisions: each kept this long, the last few carried by its next requests.
MAX_NOTE_SHOWN = 500
NOTES_SHOWN = 3
# Voids (provably never sent) a node may have per round before they count against its attempts.
FREE_VOIDS = 3
# Failures retried automatically (with the error in the next request); any other asks a person (or, for an
# undo in a terminal task's compensating phase, ends it).
RETRYABLE: Final = frozenset({FailureKind.TECHNICAL, FailureKind.STALLED, FailureKind.INVALID_OUTPUT})
# The events whose append may read the project's human load and record it (rules.pressure).
_READS_LOAD: Final = frozenset({"Intent", "HumanDecision"})


class TaskState(StrEnum):
    QUEUED = "Queued"
    RUNNING = "Running"
    WAITING_HUMAN = "WaitingHuman"
    REPAIRING = "Repairing"
    ESCALATED = "Escalated"
    COMPENSATING = "Compensating"  # failed or aborted: its outputs are being undone before it is Failed
    COMPLETED = "Completed"
    FAILED = "Failed"


class NodeStatus(StrEnum):
    PENDING = "pending"
    LEASED = "leased"
    RUNNING = "running"
    WAITING_HUMAN = "waiting_human"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    COMPENSATING = "compensating"
    CANCELLED = "cancelled"
    STALE = "stale"


@dataclass(slots=True)
class FailureInfo:
    attempt: int
    kind: FailureKind
    error: str
    at: datetime


@dataclass(slots=True)
class OutputView:
    """One registered output of a node, and whether it may still be reused for an equal request."""

    operation_key: str
    input_hash: str | None
    artifact: dict[str, Any]
    reused_from: str | None = None  # the operation whose output this one reused (nothing was sent for it)
    flagged: bool = False  # a review blamed it: never reused
    lost: bool = False  # its bytes were found missing or corrupt: never reused, never handed on
    seq: int = 0  # its Outcome's seq (what a restore makes the node's ``artifact_seq`` again)

    @property
    def reusable(self) -> bool:
        return self.input_hash is not None and not self.flagged and not self.lost


# A node's index memberships (``_flags``): (done, idle, running, failed, unapproved, stale).
_NOT_INDEXED: tuple[bool, ...] = (False,) * 6
_IDLE: tuple[bool, ...] = (False, True, False, False, False, False)  # how every node starts


@dataclass(slots=True)
class NodeView:
    """What the ledger says about one node."""

    id: str
    status: NodeStatus = NodeStatus.PENDING
    attempts: int = 0  # business attempts dispatched so far (each has its own OperationKey)
    round_base: int = 0  # attempts made before the current rework round: retries are counted per round
    voided: int = 0  # attempts voided because they provably never reached the vendor (keys stay unique)
    voided_base: int = 0  # ``voided`` when the current rework round began
    extra_attempts: int = 0  # granted by a person (Resume on a dead letter)
    operation_key: str | None = None  # the current attempt's key
    job_id: str | None = None
    in_flight: bool = False
    reserved: Decimal = Decimal(0)  # outstanding reservation of the in-flight attempt
    spent: Decimal = Decimal(0)
    failures: list[FailureInfo] = field(default_factory=list)
    retry_at: datetime | None = None
    artifact: dict[str, Any] | None = None
    artifact_seq: int = 0  # seq of the Outcome that registered the current artifact version
    versions: int = 0
    approved: bool = False
    dispatch: Dispatch | None = None  # the current attempt's recorded action (what was, or will be, sent)
    # The findings of the review whose rework round invalidated this node: every attempt of the node in that
    # round carries them (a retry after a technical failure too), until a later round replaces them.
    rework_findings: tuple[str, ...] = ()
    rework_round: int = 0
    dead_letter: str | None = None  # open or resolved dead-letter request for the current failure
    # What people said when they decided about this node ("director (resume): use a warmer palette"): the
    # next attempts' requests carry them (rules.table.request_input), as they carry the review's findings.
    notes: tuple[str, ...] = ()
    # Request fields a person set by a signed edit (rules.changes): its next attempts ask with them.
    edits: dict[str, Any] = field(default_factory=dict)
    # A person's signed re-route: the route its next attempts go to (None: its stage's executor), and what
    # one attempt costs at most there (its declared bound, recorded with the change): admission reserves it.
    route: str | None = None
    route_price: Decimal | None = None
    # Skipped by a person's signed change (it, or a node only it fed): never runs, counts as done, and hands
    # its dependents nothing (a join reads the items that remain).
    skipped: bool = False
    # Its current output was lost from the store (and its vendor no longer held it): it is made again only
    # once a person approves the cost (rules.table R9, table 9). Only ever true while the node is STALE:
    # cleared by that approval, a dispatch (a table-8 run makes it again at once), a restore or an output.
    lost_pending: bool = False
    outputs: list[OutputView] = field(default_factory=list)  # every output it registered, oldest first
    # Fixed by the plan: where the node sits, and whether its stage asks a person to approve each output.
    stage: str = ""
    order: int = 0
    needs_approval: bool = False
    indexed: tuple[bool, ...] = _NOT_INDEXED  # the index memberships ``_reindex`` last gave this node

    @property
    def done(self) -> bool:
        """Succeeded, and approved where its stage asks (or skipped): its dependents may start."""
        return self.skipped or (
            self.status == NodeStatus.SUCCEEDED and (self.approved or not self.needs_approval)
        )

    @property
    def reused(self) -> bool:
        """Its current output was reused (nothing sent for it this time)."""
        return bool(self.outputs) and self.outputs[-1].reused_from is not None

    @property
    def last_failure(self) -> FailureInfo | None:
        return self.failures[-1] if self.failures else None


@dataclass(slots=True)
class CompensationView:
    """One output a compensable stage made at the vendor (rules.plan.Compensation), and its undoing."""

    node: str
    compensates: str  # the output's operation key
    seq: int  # its Outcome's seq: a terminal task undoes its outputs newest first
    job_id: str | None
    sha256: str | None
    attempts: int = 0
    voided: int = 0  # attempts provably never sent: they do not count against the retries (up to FREE_VOIDS)
    operation_key: str | None = None  # the current attempt's
    in_flight: bool = False
    done: bool = False
    failures: list[FailureInfo] = field(default_factory=list)
    retry_at: datetime | None = None
    action: Compensate | None = None  # the current attempt's recorded action (a new run adopts it)


@dataclass(slots=True)
class RequestView:
    request: HumanRequest
    opened_seq: int
    decision: HumanDecisionType | None = None
    decided_by: str | None = None
    decision_id: str | None = None  # the signed decision that resolved it (its sender's id)
    timed_out: bool = False
    applied: bool = False  # the timeout policy's consequence has been recorded
    resolves: str | None = None  # for an escalation: the timed-out request it stands in for
    # Its first deadline passed unanswered: the plan's backup approvers may decide it until this deadline.
    backup_deadline: datetime | None = None

    @property
    def open(self) -> bool:
        return self.decision is None and not self.timed_out

    @property
    def offered_to_backups(self) -> bool:
        return self.backup_deadline is not None

    @property
    def deadline(self) -> datetime | None:
        """When the request times out (its first deadline, or the backups' if it was offered to them)."""
        return self.backup_deadline or self.request.deadline


@dataclass(slots=True)
class ReviewView:
    verdict: Verdict
    seq: int
    flagged: tuple[str, ...]
    findings: tuple[str, ...]
    scores: dict[str, float]
    handled: bool = False  # a rollback or escalation has answered this verdict
    waived: frozenset[str] = frozenset()  # outputs whose findings people waived (rules.changes)

    @property
    def waived_all(self) -> bool:
        """A rework verdict every blamed output of which a person waived: it stands as a soft warning."""
        return self.verdict == Verdict.QUALITY_REWORK and (
            REVIEW in self.waived or (bool(self.flagged) and set(self.flagged) <= self.waived)
        )

    def unwaived(self) -> tuple[str, ...]:
        """The outputs it blames that no person waived."""
        return tuple(n for n in self.flagged if n not in self.waived)


@dataclass
class Projection:
    """The fold of one task's events. Treat as read-only outside this module."""

    task_id: str
    plan: Plan
    graph: Graph
    created_at: datetime
    watermark: int = 0
    nodes: dict[str, NodeView] = field(default_factory=dict)
    requests: dict[str, RequestView] = field(default_factory=dict)
    ceiling: Decimal = Decimal(0)
    spent: Decimal = Decimal(0)
    reserved: Decimal = Decimal(0)
    reservations: dict[str, Decimal] = field(default_factory=dict)  # operation key -> outstanding reservation
    # The task's price book (TaskCreated.prices; None before price books) and, per stage, the dearest
    # settled operation so far: what admission prices the stage's next node at (rules.pricing).
    prices: PriceBook | None = None
    observed: dict[str, Decimal] = field(default_factory=dict)
    inference_spent: Decimal = Decimal(0)
    review: ReviewView | None = None
    rework_rounds: int = 0
    rework_allowance: int = 0  # extra rounds granted by a person
    aborted_by: str | None = None
    # Paused by a person's signed change (rules.changes): no new dispatch until a resume.
    paused_by: str | None = None
    changes: dict[str, str] = field(default_factory=dict)  # change id -> what it did ("pause by director")
    completed: bool = False
    terminal_reason: str | None = None
    escalation_reason: str | None = None
    intents: int = 0
    llm_decisions: int = 0
    cost_anomalies: int = 0
    failed_gate: str | None = None
    # Static gates are a stage's (one per stage and input version): the verdicts, and the gate in progress.
    gates: dict[tuple[str, int], bool] = field(default_factory=dict)  # (stage, input version) -> passed
    gate_pending: dict[str, StaticGate] = field(default_factory=dict)  # stage -> its recorded gate action
    # Indexes over the nodes, kept by ``apply`` for the nodes each event touches (``_reindex``), so that a
    # decision costs what changed, not the size of the plan. ``index_problems`` recomputes them from the
    # nodes; the rule tests check every fold with it.
    unfinished: dict[str, int] = field(default_factory=dict)  # stage -> its nodes not ``done``
    idle: dict[str, set[str]] = field(default_factory=dict)  # stage -> pending or stale, nothing in flight
    running: dict[str, set[str]] = field(default_factory=dict)  # stage -> its nodes in flight
    failed: set[str] = field(default_factory=set)
    unapproved: set[str] = field(default_factory=set)  # succeeded, its stage asks for approval, not approved
    stale: set[str] = field(default_factory=set)
    # Dispatches decided and folded before the ledger holds their INTENT (its executor writes it: see
    # ``apply_provisional``), by dedup key, in the order decided.
    provisional: dict[str, Intent] = field(default_factory=dict)
    # The latest reading of the project's human load an INTENT of this task recorded (rules.pressure).
    pressure: Reading | None = None
    # Outputs of compensable stages, by their operation key, and each attempt to undo one: its key -> the
    # output's key (rules.table R12).
    compensations: dict[str, CompensationView] = field(default_factory=dict)
    undo_of: dict[str, str] = field(default_factory=dict)

    @property
    def state(self) -> TaskState:
        if self.completed:
            return TaskState.COMPLETED
        if self.terminal_reason is not None:
            return TaskState.COMPENSATING if self.uncompensated() else TaskState.FAILED
        open_kinds = {r.request.kind for r in self.requests.values() if r.open}
        if RequestKind.ESCALATION in open_kinds:
            return TaskState.ESCALATED
        if open_kinds:
            return TaskState.WAITING_HUMAN
        if self.stale:
            return TaskState.REPAIRING
        if self.intents:
            return TaskState.RUNNING
        return TaskState.QUEUED

    @property
    def terminal(self) -> bool:
        """Completed, or its end recorded (Failed, or Compensating on the way there): nothing new starts."""
        return self.completed or self.terminal_reason is not None

    @property
    def finished(self) -> bool:
        """Terminal with nothing left to undo: no run is needed for it any more."""
        return self.terminal and not self.uncompensated()

    def gave_up_undoing(self, view: CompensationView) -> bool:
        """Whether an output's undoing stopped for good: a failure no retry fixes, or its attempts used up."""
        last = view.failures[-1] if view.failures else None
        if last is not None and last.kind not in RETRYABLE:
            return True
        spec = self.graph.nodes[view.node].stage.compensation
        assert spec is not None  # only a compensable stage's outputs are recorded
        return view.attempts - min(view.voided, FREE_VOIDS) >= spec.retries + 1 and not view.in_flight

    def uncompensated(self) -> list[CompensationView]:
        """A terminal (not completed) task's outputs still to undo or being undone, newest first."""
        if self.completed or self.terminal_reason is None:
            return []
        left = (v for v in self.compensations.values() if not v.done and not self.gave_up_undoing(v))
        return sorted(left, key=lambda v: -v.seq)

    def in_flight(self) -> list[NodeView]:
        """The nodes with an operation in flight, in node order."""
        return self.in_order(n for ids in self.running.values() for n in ids)

    def in_order(self, ids: Iterable[str]) -> list[NodeView]:
        return sorted((self.nodes[n] for n in ids), key=_by_order)

    def max_attempts(self, node: str) -> int:
        """Attempts a node may make in the current rework round."""
        spec = self.graph.nodes[node]
        bonus = 2 if spec.stage.value == Value.HERO else 0
        return spec.stage.retries + 1 + bonus + self.nodes[node].extra_attempts

    def exhausted(self, node: str) -> bool:
        """Whether the node has used up its attempts in this round. A void (provably never sent) is free up
        to ``FREE_VOIDS`` times: beyond that something keeps voiding it (an input that cannot be made, a bug)
        and it counts, so a person is asked instead of a loop."""
        view = self.nodes[node]
        free = min(view.voided - view.voided_base, FREE_VOIDS)
        return view.attempts - view.round_base - free >= self.max_attempts(node)


def new_projection(created: StoredEvent) -> Projection:
    """Start a projection from the task's TaskCreated event."""
    event = parse(created)
    if not isinstance(event, TaskCreated):
        raise ValueError(f"first event of {created.task_id} is {created.type}, not TaskCreated")
    graph = build_graph(event.plan)
    p = Projection(
        task_id=created.task_id,
        plan=event.plan,
        graph=graph,
        created_at=created.recorded_at,
        ceiling=event.plan.budget_ceiling,
        prices=event.prices,
    )
    # Node order (topological) is the order the rules iterate in; every node starts idle.
    p.nodes = {
        n: NodeView(
            id=n, stage=spec.stage.id, order=spec.order, needs_approval=spec.stage.approval, indexed=_IDLE
        )
        for n, spec in graph.nodes.items()
    }
    for sid in graph.stage_order:
        ids = graph.stage_nodes[sid]
        p.unfinished[sid], p.idle[sid], p.running[sid] = len(ids), set(ids), set()
    p.watermark = created.seq
    return p


def fold(events: Iterable[StoredEvent]) -> Projection:
    """Fold a task's events (in seq order, starting with TaskCreated) into a projection."""
    it = iter(events)
    p = new_projection(next(it))
    for e in it:
        apply(p, e)
    return p


def apply(p: Projection, stored: StoredEvent) -> None:
    """Advance ``p`` by one event, in place. Events at or below the watermark are ignored."""
    if stored.seq <= p.watermark:
        return
    p.watermark = stored.seq
    if stored.type in _READS_LOAD and (reading := Reading.from_payload(stored.payload)) is not None:
        # Read by the append that wrote it: a dispatch's INTENT (a provisional one had none when it was
        # decided), or a person's decision.
        p.pressure = reading
    if stored.dedup_key in p.provisional:
        del p.provisional[stored.dedup_key]  # folded already, when it was decided
        return
    event = parse(stored)
    _apply(p, event, stored)
    for node in _touched(p, event):
        _reindex(p, p.nodes[node])


def _apply(p: Projection, event: Any, stored: StoredEvent) -> None:
    match event:
        case TaskCreated():
            pass
        case Intent():
            _apply_intent(p, event, stored.seq)
        case Decision():
            p.llm_decisions += 1
            _spend(p, None, event.cost, inference=True)
        case Outcome():
            node = p.nodes.get(event.node)
            if node is None:
                return
            _settle(p, node, event.operation_key, event.actual_cost)
            if (undone := p.undo_of.get(event.operation_key)) is not None:
                undo = p.compensations[undone]
                undo.in_flight, undo.done = False, True
                return
            if p.graph.nodes[node.id].stage.compensation is not None and event.reused_from is None:
                # Made at the vendor (not a reuse): a failed task undoes it (R12).
                p.compensations[event.operation_key] = CompensationView(
                    node.id, event.operation_key, stored.seq, event.job_id, event.artifact.sha256
                )
            if event.operation_key == node.operation_key and node.status not in (NodeStatus.STALE,):
                node.lost_pending = False
                node.status = NodeStatus.SUCCEEDED
                node.artifact = event.artifact.model_dump()
                node.artifact_seq = stored.seq
                node.versions += 1
                node.job_id = event.job_id or node.job_id
                node.outputs.append(
                    OutputView(
                        event.operation_key,
                        event.input_hash,
                        node.artifact,
                        event.reused_from,
                        seq=stored.seq,
                    )
                )
        case ExecutionResult():
            _apply_result(p, event, stored)
        case Progress():
            node = p.nodes.get(event.node)
            if node is not None and event.operation_key == node.operation_key:
                node.job_id = event.job_id
        case Failure():
            node = p.nodes.get(event.node)
            if node is None:
                return
            _settle(p, node, event.operation_key, event.actual_cost)
            if (undone := p.undo_of.get(event.operation_key)) is not None:
                undo = p.compensations[undone]
                undo.in_flight = False
                undo.failures.append(FailureInfo(undo.attempts, event.kind, event.error, stored.recorded_at))
                undo.retry_at = stored.recorded_at + backoff(undo.attempts, event.operation_key)
                return
            stage = p.graph.nodes[node.id].stage.id
            gate = p.gate_pending.get(stage)
            if gate is not None and event.operation_key == gate.operation_key:
                del p.gate_pending[stage]  # the gate itself broke (not a verdict): the rules re-issue it
            elif event.operation_key == node.operation_key and node.status != NodeStatus.STALE:
                node.status = NodeStatus.FAILED
                node.failures.append(FailureInfo(node.attempts, event.kind, event.error, stored.recorded_at))
                jitter_key = event.operation_key if stored.schema_version >= 2 else None
                node.retry_at = stored.recorded_at + backoff(node.attempts, jitter_key)
                node.dead_letter = None
        case SystemMarker():
            _apply_marker(p, event)
        case HumanDecision():
            _apply_human(p, event)
        case TaskChange():
            _apply_change(p, event)
        case RollbackDone():
            p.rework_rounds = max(p.rework_rounds, event.round)
            findings = p.review.findings if p.review is not None else ()
            for n in event.invalidated:
                view = p.nodes.get(n)
                if view is not None and not view.skipped:  # a skipped node stays skipped
                    view.status = NodeStatus.STALE
                    view.approved = False
                    view.round_base = view.attempts
                    if stored.schema_version >= 3:  # v3: the free voids are per round too (v2 leaked them)
                        view.voided_base = view.voided
                    if stored.schema_version < 3 or n in event.flagged or n == REVIEW:
                        # v3: what the review said goes to what it blamed (and to the review itself, so its
                        # next question is never the unchanged one). A node invalidated only because it is
                        # built on a blamed one is asked the same thing with new inputs: its input hash tells
                        # whether anything really changed. (v2 rounds gave every invalidated node the
                        # findings, and are folded as they were decided.)
                        view.rework_findings = findings or (event.reason,)
                        view.rework_round = event.round
                    else:
                        view.rework_findings, view.rework_round = (), event.round
                    if n in event.flagged and view.outputs:
                        view.outputs[-1].flagged = True  # a blamed output is never reused
            if p.review is not None:
                p.review.handled = True
        case Escalation():
            if event.terminal:
                p.terminal_reason = event.reason
            else:
                p.escalation_reason = event.reason
            if event.resolves and event.resolves in p.requests:
                p.requests[event.resolves].applied = True
            request = p.requests.get(event.request_id) if event.request_id else None
            if p.review is not None and _answers_review(p, request):
                p.review.handled = True
        case PartialResolution():
            # A person resolved a request about the node outside a decision (an edit or skip its dead letter,
            # a restore its approval, a waiver the rework-limit escalation: rules.changes), recorded under
            # the request's resolution key, so it, a decision or the timeout resolves it, first wins.
            node = p.nodes.get(event.node)
            rid = event.request_id or (node.dead_letter if node is not None else None)
            request = p.requests.get(rid) if rid else None
            if request is not None and request.open:
                request.decision = HumanDecisionType.RESUME
                request.decided_by = event.resolution.partition(" by ")[2] or "a person"
                _grant(p, request, HumanDecisionType.RESUME)
            elif node is not None:
                node.dead_letter = None
        case _:
            assert_never(event)


def apply_provisional(p: Projection, key: str, intent: Intent) -> None:
    """Fold a Dispatch's INTENT before the ledger holds it.

    The executor activity writes a dispatch's INTENT as its first step (workflows/task.py), so the loop folds
    it as decided: the next decision of a fan-out sees this node in flight and its reservation held. The
    stored INTENT, when ``apply`` meets it (same dedup key), only advances the watermark. If it is never
    written (the ledger refused it, or the task closed first), ``refold`` builds the projection without it.
    """
    assert isinstance(intent.action, Dispatch)
    p.provisional[key] = intent
    _apply_intent(p, intent, p.watermark)
    _reindex(p, p.nodes[intent.action.node])


def refold(events: list[StoredEvent], keep: dict[str, Intent], intents: int) -> Projection:
    """The fold of ``events`` plus the provisional INTENTs in ``keep`` that they do not hold, with the INTENT
    count no lower than ``intents`` (a dropped INTENT's number is never used again)."""
    p = fold(events)
    held = {e.dedup_key for e in events}
    for key, intent in keep.items():
        if key not in held:
            apply_provisional(p, key, intent)
    p.intents = max(p.intents, intents)
    return p


def _apply_intent(p: Projection, e: Intent, seq: int) -> None:
    p.intents += 1
    match e.action:
        case Dispatch() as d:
            node = p.nodes[d.node]
            node.status = NodeStatus.RUNNING
            node.lost_pending = False  # (set only while STALE: rules.table_versions reads it there only)
            node.attempts = d.attempt
            node.operation_key = d.operation_key
            node.in_flight = True
            node.retry_at = None
            node.job_id = None
            node.reserved = e.reservation
            node.dispatch = d
            p.reservations[d.operation_key] = e.reservation
            p.reserved += e.reservation
        case StaticGate() as g:
            p.gate_pending[p.graph.nodes[g.node].stage.id] = g
        case Compensate() as c:
            undo = p.compensations[c.compensates]
            undo.attempts, undo.operation_key, undo.action = c.attempt, c.operation_key, c
            undo.in_flight, undo.retry_at = True, None
            p.undo_of[c.operation_key] = c.compensates
            p.reservations[c.operation_key] = e.reservation
            p.reserved += e.reservation
        case SuspendForHuman() as s:
            _open_request(p, s.request, seq)
        case Escalate() as esc:
            if esc.request is not None:
                _open_request(p, esc.request, seq)
                p.requests[esc.request.id].resolves = esc.resolves
        case Complete():
            p.completed = True
        case Rollback() | Wait():
            pass
        case _:
            assert_never(e.action)


def _open_request(p: Projection, request: HumanRequest, seq: int) -> None:
    p.requests[request.id] = RequestView(request=request, opened_seq=seq)
    if request.kind == RequestKind.DEAD_LETTER and request.node in p.nodes:
        p.nodes[request.node].dead_letter = request.id


def _apply_result(p: Projection, e: ExecutionResult, stored: StoredEvent) -> None:
    node = p.nodes.get(e.node)
    if node is None:
        return
    if e.kind == "gate":
        stage = p.graph.nodes[e.node].stage.id
        p.gates[(stage, e.input_version)] = e.passed
        p.gate_pending.pop(stage, None)
        if not e.passed:
            p.failed_gate = f"{e.node}: {'; '.join(e.findings) or 'compliance gate failed'}"
        _spend(p, None, e.actual_cost)
        return
    _settle(p, node, e.operation_key, e.actual_cost)
    if e.operation_key == node.operation_key and node.status != NodeStatus.STALE:
        node.status = NodeStatus.SUCCEEDED
        node.versions += 1
        node.artifact_seq = stored.seq
        if e.verdict is not None:
            p.review = ReviewView(e.verdict, stored.seq, e.flagged, e.findings, dict(e.scores))


def _apply_marker(p: Projection, e: SystemMarker) -> None:
    if e.kind == MarkerKind.TIMEOUT and e.request_id in p.requests:
        r = p.requests[e.request_id]
        if r.open:
            r.timed_out = True
            if r.request.timeout_policy == TimeoutPolicy.APPROVE:
                _grant(p, r, HumanDecisionType.APPROVE)
                r.applied = True
    elif e.kind == MarkerKind.BACKUPS_OFFERED and e.request_id in p.requests:
        r = p.requests[e.request_id]
        if r.open and r.backup_deadline is None and r.request.deadline is not None:
            r.backup_deadline = r.request.deadline + timedelta(seconds=p.plan.approval.backup_seconds)
    elif e.kind == MarkerKind.VOID and e.operation_key in p.undo_of:
        undo = p.compensations[p.undo_of[e.operation_key]]
        if undo.in_flight and undo.operation_key == e.operation_key:
            _release(p, p.nodes[undo.node], e.operation_key)  # the undo's reservation; the node is not its
            undo.in_flight = False
            undo.voided += 1  # never sent: decided again, and it does not count against the retries
    elif e.kind == MarkerKind.VOID and e.node in p.nodes:
        node = p.nodes[e.node]
        stage = p.graph.nodes[e.node].stage.id
        gate = p.gate_pending.get(stage)
        if gate is not None and e.operation_key == gate.operation_key:
            del p.gate_pending[stage]  # the gate never ran: the rules issue it again
        elif e.operation_key is not None and e.operation_key == node.operation_key and node.in_flight:
            _release(p, node, e.operation_key)
            node.status = NodeStatus.PENDING
            node.voided += 1  # it never reached the vendor: it does not count against the retries
    elif e.kind == MarkerKind.COST_ANOMALY:
        p.cost_anomalies += 1
    elif e.kind == MarkerKind.ARTIFACT_EXPIRED and e.node in p.nodes:
        for out in p.nodes[e.node].outputs:  # deleted by retention from an ended task: never reused
            if out.artifact.get("sha256") == e.detail:
                out.lost = True
    elif e.kind == MarkerKind.ARTIFACT_LOST and e.node in p.nodes:
        # The bytes of an output are gone or corrupt: never reuse it or hand it on; a node whose current
        # output it is must make it again.
        node = p.nodes[e.node]
        for out in node.outputs:
            if out.artifact.get("sha256") == e.detail:
                out.lost = True
        if node.status == NodeStatus.SUCCEEDED and node.artifact and node.artifact.get("sha256") == e.detail:
            node.status = NodeStatus.STALE
            node.approved = False  # the output made again is new bytes: approved again before it is used
            node.lost_pending = True  # making it again is paid: a person approves the cost first (table 9)
    elif e.kind == MarkerKind.LATE_CHARGE and e.amount is not None:
        _spend(p, p.nodes.get(e.node) if e.node else None, e.amount)


def _apply_change(p: Projection, e: TaskChange) -> None:
    """A person's signed change, recorded (rules.changes validated it against the fold it was ruled on)."""
    if e.change_id in p.changes:
        return
    p.changes[e.change_id] = f"{e.kind.value} by {e.approver}"
    if e.kind == ChangeKind.PAUSE:
        p.paused_by = e.approver
    elif e.kind == ChangeKind.RESUME:
        p.paused_by = None
    elif e.kind == ChangeKind.REROUTE and e.input:
        for node_id in e.nodes:
            if (moved := p.nodes.get(node_id)) is not None:
                moved.route, moved.route_price = str(e.input["route"]), e.route_price
    elif e.kind == ChangeKind.EDIT and e.node in p.nodes and e.input:
        edited = p.nodes[e.node]
        edited.edits = {**edited.edits, **e.input}
    elif e.kind == ChangeKind.SKIP:
        for node_id in e.nodes:
            if (skipped := p.nodes.get(node_id)) is not None:
                skipped.skipped = True
                skipped.retry_at = None
    elif e.kind == ChangeKind.WAIVE and p.review is not None:
        p.review.waived = p.review.waived | set(e.nodes)
    elif e.kind == ChangeKind.RESTORE and e.node in p.nodes and e.input:
        _restore(p, p.nodes[e.node], int(e.input["version"]), e.nodes)
    node = p.nodes.get(e.node) if e.node else None
    if node is not None and e.note.strip() and e.kind in _NOTED:
        # What the person said reaches the node's next attempts (an edit's why; for a waiver or a restore,
        # a regenerated version is made knowing why the person chose as they did).
        node.notes = (*node.notes, f"{e.approver} ({e.kind.value}): {e.note.strip()[:MAX_NOTE_SHOWN]}")


# Changes whose note reaches the node's next requests (``feedback.people``).
_NOTED: Final = frozenset({ChangeKind.EDIT, ChangeKind.WAIVE, ChangeKind.RESTORE})


def _restore(p: Projection, node: NodeView, version: int, stale: tuple[str, ...]) -> None:
    """Make the node's ``version``-th output (1-based) current again, chosen by a person (so approved), and
    its recorded descendants stale: each is asked again with this input, and one whose input hash then
    equals an earlier output of its own reuses that output instead of paying again (rules.table). The
    review's verdict, if the review goes stale, is dropped: a rework it asked for is not done on outputs it
    never saw (the person chose; a new review judges what they chose)."""
    out = node.outputs[version - 1]
    node.artifact, node.artifact_seq = out.artifact, out.seq
    node.status, node.approved, node.lost_pending = NodeStatus.SUCCEEDED, True, False
    node.dead_letter, node.retry_at = None, None
    for node_id in stale:
        view = p.nodes.get(node_id)
        if view is not None and not view.skipped and view.status == NodeStatus.SUCCEEDED:
            view.status, view.approved = NodeStatus.STALE, False
    if REVIEW in stale:
        p.review = None  # its verdict judged outputs no longer current: the review runs again on these


def _apply_human(p: Projection, e: HumanDecision) -> None:
    r = p.requests.get(e.request_id)
    if r is None or not r.open or e.decision not in r.request.options:
        return  # the recording path validates; a late duplicate or an answer not offered changes nothing
    r.decision = e.decision
    r.decided_by = e.approver
    r.decision_id = e.decision_id
    node = p.nodes.get(r.request.node) if r.request.node else None
    if node is not None and e.note.strip():
        node.notes = (*node.notes, f"{e.approver} ({e.decision.value}): {e.note.strip()[:MAX_NOTE_SHOWN]}")
    if e.decision == HumanDecisionType.ABORT:
        p.aborted_by = e.approver
        return
    # An add_budget on the task's own scope raises its ceiling; on a scope above, that account rose (in the
    # ledger's budget_accounts), not this ceiling.
    raises_task = e.scope is None or e.scope == scopes.task(p.task_id)
    if e.decision == HumanDecisionType.ADD_BUDGET and e.amount is not None and raises_task:
        p.ceiling += e.amount
    _grant(p, r, e.decision)


def _grant(p: Projection, r: RequestView, decision: HumanDecisionType) -> None:
    """What an Approve / Resume / AddBudget means for the thing the request was about."""
    req = r.request
    node = p.nodes.get(req.node) if req.node else None
    if req.kind == RequestKind.APPROVAL and node is not None:
        node.approved = True
    elif req.kind == RequestKind.DEAD_LETTER and node is not None:
        node.extra_attempts += 1
        node.status = NodeStatus.PENDING if node.status == NodeStatus.FAILED else node.status
        node.dead_letter = None
        node.lost_pending = False  # a lost output's remaking, approved with its cost
    elif req.kind == RequestKind.ESCALATION:
        p.escalation_reason = None
        stood_for = p.requests.get(r.resolves) if r.resolves else None
        if stood_for is not None and stood_for.request.kind == RequestKind.APPROVAL and node is not None:
            node.approved = True  # resuming a timed-out approval is the approval the timeout did not give
        if stood_for is not None and stood_for.request.kind == RequestKind.DEAD_LETTER and node is not None:
            node.lost_pending = False  # resuming a timed-out remake request is the go-ahead it did not give
        if node is not None and node.status == NodeStatus.FAILED:
            node.extra_attempts += 1  # resuming a stopped node grants it one more attempt
            node.status = NodeStatus.PENDING
            node.dead_letter = None
        if _answers_review(p, r) and p.review is not None and p.review.handled:
            p.rework_allowance += 1  # resuming the rework-limit escalation grants one more round
            p.review.handled = False
    del decision


def _answers_review(p: Projection, request: RequestView | None) -> bool:
    """Whether ``request`` is the rework-limit escalation of the current QualityRework review.

    Only that escalation answers the review (and resuming it grants a round). Any other escalation met while
    a rework is pending or under way (budget, time, a refused reservation) leaves the review as it was.
    """
    return (
        request is not None
        and request.request.kind == RequestKind.ESCALATION
        and request.request.node == REVIEW
        and p.review is not None
        and p.review.verdict == Verdict.QUALITY_REWORK
        and request.opened_seq > p.review.seq
    )


def _settle(p: Projection, node: NodeView, operation_key: str, actual: Decimal) -> None:
    """An operation's result: its reservation is released and its actual cost spent (as the ledger does)."""
    _release(p, node, operation_key)
    _spend(p, node, actual)
    if operation_key not in p.undo_of and actual > p.observed.get(node.stage, Decimal(0)):
        p.observed[node.stage] = actual  # an undo's cost prices no node of the stage


def _release(p: Projection, node: NodeView, operation_key: str) -> None:
    p.reserved -= p.reservations.pop(operation_key, Decimal(0))
    if operation_key == node.operation_key:
        node.reserved = Decimal(0)
        node.in_flight = False


def _spend(p: Projection, node: NodeView | None, amount: Decimal, *, inference: bool = False) -> None:
    p.spent += amount
    if node is not None:
        node.spent += amount
    if inference:
        p.inference_spent += amount


# ── the node indexes ───────────────────────────────────────────────────────────────────────────────────
def _flags(n: NodeView) -> tuple[bool, ...]:
    """(done, idle, running, failed, unapproved, stale): which index sets the node belongs in."""
    status = n.status
    succeeded = status == NodeStatus.SUCCEEDED
    return (
        n.done,
        status in (NodeStatus.PENDING, NodeStatus.STALE) and not n.in_flight and not n.skipped,
        n.in_flight,
        status == NodeStatus.FAILED and not n.skipped,
        succeeded and n.needs_approval and not n.approved,
        status == NodeStatus.STALE and not n.skipped,
    )


def _touched(p: Projection, event: Any) -> set[str]:
    """The nodes an event may have changed (what ``_reindex`` must look at again)."""
    match event:
        case Intent():
            node = getattr(event.action, "node", None)
            nodes = {node} if node else set()
        case RollbackDone():
            nodes = set(event.invalidated)
        case TaskChange():
            nodes = {event.node, *event.nodes} if event.node else set(event.nodes)
        case HumanDecision() | SystemMarker():
            node = getattr(event, "node", None)
            nodes = {node} if node else set()
            request = p.requests.get(event.request_id) if event.request_id else None
            if request is not None and request.request.node:
                nodes.add(request.request.node)
        case _:
            node = getattr(event, "node", None)
            nodes = {node} if node else set()
    return {n for n in nodes if n in p.nodes}


def _reindex(p: Projection, n: NodeView) -> None:
    flags = _flags(n)
    old = n.indexed
    if flags == old:
        return
    n.indexed = flags
    if flags[0] != old[0]:
        p.unfinished[n.stage] += -1 if flags[0] else 1
    for member, was, group in (
        (flags[1], old[1], p.idle[n.stage]),
        (flags[2], old[2], p.running[n.stage]),
        (flags[3], old[3], p.failed),
        (flags[4], old[4], p.unapproved),
        (flags[5], old[5], p.stale),
    ):
        if member and not was:
            group.add(n.id)
        elif was and not member:
            group.discard(n.id)


def index_problems(p: Projection) -> list[str]:
    """Where the incremental indexes disagree with a recount from the nodes (empty when they agree)."""
    problems = []
    for n in p.nodes.values():
        if n.indexed != _flags(n):
            problems.append(f"{n.id}: indexed {n.indexed}, is {_flags(n)}")
    for sid, ids in p.graph.stage_nodes.items():
        unfinished = sum(1 for n in ids if not _flags(p.nodes[n])[0])
        if p.unfinished[sid] != unfinished:
            problems.append(f"stage {sid}: {p.unfinished[sid]} unfinished indexed, {unfinished} counted")
        for name, i, group in (("idle", 1, p.idle[sid]), ("running", 2, p.running[sid])):
            if group != {n for n in ids if _flags(p.nodes[n])[i]}:
                problems.append(f"stage {sid}: {name} set is {sorted(group)}")
    for name, i, group in (("failed", 3, p.failed), ("unapproved", 4, p.unapproved), ("stale", 5, p.stale)):
        if group != {n.id for n in p.nodes.values() if _flags(n)[i]}:
            problems.append(f"{name} set is {sorted(group)}")
    return problems


def _by_order(n: NodeView) -> int:
    return n.order


def backoff(attempt: int, key: str | None = None) -> timedelta:
    """Delay before retrying a technical failure: exponential, capped at 60 s, and — given the failed
    operation's key — stretched by a jitter of 0–50 % drawn from that key's hash, so a burst of failures
    (a vendor outage, a 429 storm) does not come back as one burst, and the rules stay pure: the same
    record gives the same delay."""
    base = min(60.0, 0.5 * 2 ** max(0, attempt - 1))
    if key is None:
        return timedelta(seconds=base)
    return timedelta(seconds=base * (1 + 0.5 * key_fraction(key)))


def node_state(p: Projection, n: NodeView, waiting: frozenset[str] | None = None) -> NodeStatus:
    """What a node is doing now, as a person reads it (``status`` in the summary is what the rules read):

    ``leased`` its attempt's INTENT is recorded and the vendor has not yet taken it; ``running`` the vendor
    has (a job id); ``waiting_human`` a request about it is open (its approval, its dead letter);
    ``compensating`` its output is being undone; ``cancelled`` a person skipped it (or only skipped nodes
    fed it), or the task ended before it finished; else ``pending``, ``succeeded``, ``failed`` or ``stale``
    (an output whose inputs changed)."""
    if any(c.node == n.id and c.in_flight for c in p.compensations.values()):
        return NodeStatus.COMPENSATING
    if n.skipped:
        return NodeStatus.CANCELLED
    if n.status == NodeStatus.STALE:
        return NodeStatus.STALE
    if n.id in (waiting if waiting is not None else waiting_nodes(p)):
        return NodeStatus.WAITING_HUMAN
    if n.in_flight:
        return NodeStatus.RUNNING if n.job_id is not None else NodeStatus.LEASED
    if n.status in (NodeStatus.SUCCEEDED, NodeStatus.FAILED):
        return n.status
    return NodeStatus.CANCELLED if p.terminal else NodeStatus.PENDING


def waiting_nodes(p: Projection) -> frozenset[str]:
    """The nodes a still-answerable request is about (a terminal task rules only on an undo waiting for
    budget: rules.people): read once per summary, not once per node."""
    return frozenset(
        r.request.node
        for rid, r in p.requests.items()
        if r.open and r.request.node is not None and (not p.terminal or rid.startswith("undo:"))
    )


def summary(p: Projection) -> dict[str, Any]:
    """A JSON-safe status summary (what the workflow's status query and the CLI show)."""
    waiting = waiting_nodes(p)
    return {
        "task_id": p.task_id,
        "state": p.state.value,
        "watermark": p.watermark,
        "ceiling": str(p.ceiling),
        "spent": str(p.spent),
        "reserved": str(p.reserved),
        "rework_rounds": p.rework_rounds,
        "verdict": p.review.verdict.value if p.review else None,
        # The outputs whose rework findings people waived (rules.changes): the verdict stands as it was.
        **({"waived": sorted(p.review.waived)} if p.review is not None and p.review.waived else {}),
        "terminal_reason": p.terminal_reason,
        "escalation_reason": p.escalation_reason,
        "nodes": {
            n.id: {
                "status": n.status.value,
                "state": node_state(p, n, waiting).value,
                "attempts": n.attempts,
                "spent": str(n.spent),
                "in_flight": n.in_flight,
                "last_error": n.last_failure.error if n.last_failure else None,
                **({"notes": list(n.notes[-NOTES_SHOWN:])} if n.notes else {}),  # the planner reads them
            }
            for n in p.nodes.values()
        },
        **({"paused_by": p.paused_by} if p.paused_by is not None else {}),
        # A task submitted with --budget-from-quote: its spend against the quote it was priced from, in the
        # status and in the workflow's result (the drift is recorded in the history when the task ends).
        **(
            {
                "quote": {
                    "percentile": p.plan.quote.percentile,
                    "total": str(p.plan.quote.total),
                    "drift": str(p.spent - p.plan.quote.total),
                }
            }
            if p.plan.quote is not None
            else {}
        ),
        **(
            {
                "compensations": {
                    v.compensates: {
                        "node": v.node,
                        "state": _undo_state(p, v),
                        "attempts": v.attempts,
                        "last_error": v.failures[-1].error if v.failures else None,
                    }
                    for v in p.compensations.values()
                }
            }
            if p.compensations
            else {}
        ),
        "open_requests": [
            {
                "id": r.request.id,
                "kind": r.request.kind.value,
                "node": r.request.node,
                "reason": r.request.reason,
                "options": [o.value for o in r.request.options],
                "deadline": r.deadline.isoformat() if r.deadline else None,
                "offered_to_backups": r.offered_to_backups,
            }
            for r in p.requests.values()
            if r.open
        ],
    }


def _undo_state(p: Projection, v: CompensationView) -> str:
    if v.done:
        return "undone"
    if p.gave_up_undoing(v):
        return "gave up"
    return "in flight" if v.in_flight else "due"
