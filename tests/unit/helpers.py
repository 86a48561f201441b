"""Build task histories as real ledger events, so rule tests fold them exactly as the workflow does.

``History`` appends ``StoredEvent``s with seq 1..n and a clock that advances one second per event; every
payload comes from ``rules.events.to_new(Event(...))``. ``act`` decides with the real rule table and records
what ``workflows.task.TaskWorkflow._record`` records (the INTENT, plus RollbackDone / Escalation for
event-only actions); ``drive`` plays a happy path until a chosen action comes up.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from rules.actions import (
    Action,
    Compensate,
    Dispatch,
    HumanDecisionType,
    HumanRequest,
    RequestKind,
    StaticGate,
    SuspendForHuman,
)
from rules.envelope import StoredEvent
from rules.events import (
    ArtifactRef,
    Escalation,
    ExecutionResult,
    Failure,
    FailureKind,
    HumanDecision,
    Intent,
    MarkerKind,
    Outcome,
    PartialResolution,
    RollbackDone,
    SystemMarker,
    TaskCreated,
    Verdict,
    effect_of,
    to_new,
)
from rules.plan import REVIEW, Plan, validate_plan
from rules.pricing import PriceBook
from rules.projection import Projection, apply, fold, index_problems, new_projection
from rules.table import RULES_VERSION, decide
from vendors.routes import DEFAULT_ROUTES

T0 = datetime(2025, 1, 6, 9, 0, tzinfo=UTC)
TASK = "t1"

# The answers the rules offer for each kind of request (rules/table.py, rules/llm.py): the fold ignores a
# decision that is not among its request's options.
OPTIONS: dict[RequestKind, tuple[HumanDecisionType, ...]] = {
    RequestKind.APPROVAL: (HumanDecisionType.APPROVE, HumanDecisionType.ABORT),
    RequestKind.DEAD_LETTER: (HumanDecisionType.RESUME, HumanDecisionType.ABORT),
    RequestKind.ESCALATION: (HumanDecisionType.RESUME, HumanDecisionType.ADD_BUDGET, HumanDecisionType.ABORT),
    RequestKind.INVALID_DECISION: (HumanDecisionType.RESUME, HumanDecisionType.ABORT),
}


def stage(sid: str, *deps: str, **fields: Any) -> dict[str, Any]:
    """A raw stage mapping: ``stage("b", "a", estimate=2)``; executor defaults to ``llm.text``."""
    return {"id": sid, "executor": "llm.text", "estimate": "1.00", "depends_on": list(deps), **fields}


def make_plan(*stages: dict[str, Any], **fields: Any) -> Plan:
    """A validated plan with a generous budget unless told otherwise."""
    raw = {"goal": "test", "budget_ceiling": "100", "stages": list(stages), **fields}
    return validate_plan(raw, DEFAULT_ROUTES)


def chain_plan(**fields: Any) -> Plan:
    """a -> b: the smallest plan with a dependency (plus the framework's compose and review)."""
    return make_plan(stage("a"), stage("b", "a"), **fields)


class History:
    """One task's ledger, written fluently: ``History(plan).dispatch("a").outcome("a")``."""

    def __init__(self, plan: Plan | None = None, task_id: str = TASK, start: datetime = T0) -> None:
        self.task_id = task_id
        self.events: list[StoredEvent] = []
        self.now = start
        self._ops: dict[str, str] = {}  # node -> operation key of its latest dispatch or gate
        self._intents = 0
        self._view: Projection | None = None  # kept up to date with ``apply``, for the helper's own lookups
        if plan is not None:
            self.created(plan)

    # ── raw appends ─────────────────────────────────────────────────────────────────────────────────
    def append(
        self,
        event: Any,
        dedup_key: str | None = None,
        operation_key: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> History:
        """Append ``event`` (``extra``: payload fields the ledger adds as it writes, e.g. a route or a
        pressure reading)."""
        seq = len(self.events) + 1
        new = to_new(event, dedup_key=dedup_key or f"{self.task_id}:{seq}", operation_key=operation_key)
        if extra:
            new = new.model_copy(update={"payload": {**new.payload, **extra}})
        self.now += timedelta(seconds=1)
        self.events.append(new.stored(self.task_id, seq, 1, self.now))
        if self._view is None:
            self._view = new_projection(self.events[-1])
        else:
            apply(self._view, self.events[-1])
        # Every rule test checks the projection's incremental node indexes against a recount: event by event
        # on the small plans rule tests use, every 100th event on a plan of thousands (a recount is O(nodes)).
        if len(self._view.nodes) <= 200 or seq % 100 == 0:
            assert not index_problems(self._view), index_problems(self._view)
        return self

    def tick(self, seconds: float) -> History:
        """Let time pass without an event (the next event is recorded after it)."""
        self.now += timedelta(seconds=seconds)
        return self

    def fold(self) -> Projection:
        """A fresh fold of every event so far (what the rules under test see)."""
        return fold(self.events)

    @property
    def view(self) -> Projection:
        assert self._view is not None, "no TaskCreated yet"
        return self._view

    def decide(self, now: datetime | None = None) -> tuple[str, Action] | None:
        return decide(self.fold(), self.now if now is None else now)

    # ── the events, by name ─────────────────────────────────────────────────────────────────────────
    def created(self, plan: Plan, prices: PriceBook | None = None) -> History:
        self.plan = plan
        return self.append(TaskCreated(plan=plan, prices=prices), dedup_key=f"{self.task_id}:created")

    def intent(
        self,
        action: Action,
        rule: str = "R11",
        reservation: Decimal | None = None,
        extra: dict[str, Any] | None = None,
    ) -> History:
        """An INTENT as the workflow writes it (a Dispatch reserves its estimate unless told otherwise)."""
        if reservation is None:
            reservation = action.estimate if isinstance(action, Dispatch | Compensate) else Decimal(0)
        if isinstance(action, Dispatch | StaticGate):
            self._ops[action.node] = action.operation_key
        self._intents += 1
        watermark = len(self.events)
        intent = Intent(
            action=action,
            rule=rule,
            watermark=watermark,
            decided_at=self.now,
            reservation=reservation,
            rules=RULES_VERSION,
        )
        op = action.operation_key if isinstance(action, Dispatch | StaticGate | Compensate) else None
        return self.append(
            intent,
            dedup_key=f"{self.task_id}:intent:{watermark}:{self._intents}",
            operation_key=op,
            extra=extra,
        )

    def dispatch(self, node: str, attempt: int | None = None, reservation: Decimal | None = None) -> History:
        """A Dispatch INTENT for ``node`` built by hand (attempt defaults to the next one)."""
        spec = self.view.graph.nodes[node]
        if attempt is None:
            attempt = self.view.nodes[node].attempts + 1
        action = Dispatch(
            node=node,
            attempt=attempt,
            operation_key=f"{self.task_id}:{node}:a{attempt}",
            executor=spec.stage.executor,
            estimate=spec.stage.estimate,
        )
        return self.intent(action, reservation=reservation)

    def op(self, node: str) -> str:
        """The operation key of ``node``'s latest dispatch."""
        return self._ops[node]

    def outcome(self, node: str, op_key: str | None = None, cost: Decimal | str | None = None) -> History:
        key = op_key or self.op(node)
        actual = Decimal(str(cost)) if cost is not None else self.plan_estimate(node)
        artifact = ArtifactRef(uri=f"file:///artifacts/{key}", sha256=f"{len(self.events):064x}", size=1)
        event = Outcome(
            node=node, operation_key=key, job_id=f"job-{key}", artifact=artifact, actual_cost=actual
        )
        return self.append(event, dedup_key=f"{key}:result", operation_key=key)

    def failure(
        self,
        node: str,
        kind: FailureKind = FailureKind.TECHNICAL,
        error: str = "vendor returned 503",
        op_key: str | None = None,
        cost: Decimal | str = "0",
    ) -> History:
        key = op_key or self.op(node)
        event = Failure(node=node, operation_key=key, kind=kind, error=error, actual_cost=Decimal(str(cost)))
        return self.append(event, dedup_key=f"{key}:result", operation_key=key)

    def marker(
        self,
        kind: MarkerKind,
        node: str | None = None,
        op_key: str | None = None,
        request_id: str | None = None,
    ) -> History:
        if kind == MarkerKind.VOID and op_key is None and node is not None:
            op_key = self.op(node)
        return self.append(SystemMarker(kind=kind, node=node, operation_key=op_key, request_id=request_id))

    def ask(self, request_id: str, kind: RequestKind = RequestKind.ESCALATION, **fields: Any) -> History:
        """A SuspendForHuman INTENT with a hand-made request (options default to what the rules offer)."""
        options = fields.pop("options", OPTIONS[kind])
        request = HumanRequest(id=request_id, kind=kind, reason="test", options=options, **fields)
        return self.intent(SuspendForHuman(request=request), rule="R9")

    def human(
        self,
        request_id: str,
        decision: HumanDecisionType,
        approver: str = "director",
        amount: Decimal | str | None = None,
    ) -> History:
        event = HumanDecision(
            request_id=request_id,
            decision=decision,
            approver=approver,
            amount=Decimal(str(amount)) if amount is not None else None,
        )
        return self.append(event, dedup_key=f"{self.task_id}:resolution:{request_id}")

    def gate(self, node: str, passed: bool = True, input_version: int | None = None) -> History:
        """The static gate's result for the gate in progress on ``node``'s stage (one gate per stage)."""
        stage = self.view.graph.nodes[node].stage.id
        pending = self.view.gate_pending.get(stage)
        if input_version is None:
            assert pending is not None, f"no gate pending on {node}'s stage"
            input_version = pending.input_version
        version = input_version
        key = f"{self.task_id}:{stage}:gate{version}"  # the rules' key for a stage's gate on this version
        event = ExecutionResult(
            kind="gate",
            node=node,
            operation_key=key,
            passed=passed,
            input_version=version,
            findings=() if passed else ("banned term in input",),
        )
        return self.append(event, dedup_key=f"{key}:result")

    def review(
        self,
        verdict: Verdict | None,
        flagged: tuple[str, ...] = (),
        findings: tuple[str, ...] = (),
        cost: Decimal | str | None = None,
    ) -> History:
        """The review stage's result for its current dispatch."""
        key = self.op(REVIEW)
        actual = Decimal(str(cost)) if cost is not None else self.plan_estimate(REVIEW)
        event = ExecutionResult(
            kind="review",
            node=REVIEW,
            operation_key=key,
            verdict=verdict,
            flagged=flagged,
            findings=findings or ((f"content.llm: {verdict}",) if verdict else ()),
            actual_cost=actual,
        )
        return self.append(event, dedup_key=f"{key}:result", operation_key=key)

    def rollback(self, targets: tuple[str, ...], invalidated: tuple[str, ...], round: int = 1) -> History:
        return self.append(RollbackDone(targets=targets, invalidated=invalidated, round=round))

    def escalation(self, reason: str, terminal: bool = False, request_id: str | None = None) -> History:
        return self.append(Escalation(reason=reason, terminal=terminal, request_id=request_id))

    def partial(self, node: str, resolution: str = "fixed by hand") -> History:
        return self.append(PartialResolution(node=node, resolution=resolution))

    # ── the rules in the loop ───────────────────────────────────────────────────────────────────────
    def record(self, rule: str, action: Action, extra: dict[str, Any] | None = None) -> History:
        """Record a decided action the way the workflow does: the INTENT (with ``extra`` payload fields, as
        its executor's append adds them) and, if any, its effect event."""
        self.intent(action, rule=rule, extra=extra)
        if (effect := effect_of(action)) is not None:
            self.append(effect[1])
        return self

    def act(self, now: datetime | None = None) -> tuple[str, Action]:
        """Decide on the current fold, record the decision, and return it."""
        decided = self.decide(now)
        assert decided is not None, "no rule matched"
        self.record(*decided)
        return decided

    def drive(
        self,
        stop: Callable[[str, Action], bool],
        verdict: Verdict | None = Verdict.PASS,
        max_steps: int = 500,
    ) -> tuple[str, Action]:
        """Play the happy path (dispatches succeed at their estimate, gates pass, approvals are given, the
        review returns ``verdict``) until ``stop(rule, action)`` holds; return that decision unrecorded."""
        for _ in range(max_steps):
            decided = self.decide()
            assert decided is not None, "the happy path ran out of rules"
            rule, action = decided
            if stop(rule, action):
                return decided
            self.record(rule, action)
            match action:
                case Dispatch(node=node) if node == REVIEW:
                    self.review(verdict)
                case Dispatch(node=node):
                    self.outcome(node)
                case StaticGate(node=node):
                    self.gate(node)
                case SuspendForHuman(request=request) if request.kind == RequestKind.APPROVAL:
                    self.human(request.id, HumanDecisionType.APPROVE)
                case _:
                    raise AssertionError(f"drive cannot play {rule} {action!r}")
        raise AssertionError("drive did not stop")

    def drive_to_review(self, verdict: Verdict | None = Verdict.PASS) -> History:
        """Run every node, then record the review's result (``verdict``; None: the review gave none)."""
        self.drive(lambda _r, a: isinstance(a, Dispatch) and a.node == REVIEW)
        rule, action = self.act()
        assert isinstance(action, Dispatch) and action.node == REVIEW, (rule, action)
        return self.review(verdict)

    def plan_estimate(self, node: str) -> Decimal:
        return self.view.graph.nodes[node].stage.estimate


def until(kind: type, node: str | None = None) -> Callable[[str, Action], bool]:
    """A ``drive`` stop condition: the first action of this type (on this node)."""

    def stop(_rule: str, action: Action) -> bool:
        return isinstance(action, kind) and (node is None or getattr(action, "node", None) == node)

    return stop
