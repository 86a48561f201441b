"""The rule table: a fixed-priority, pure mapping from a projection to the next action.

``decide`` walks ``RULES`` in order and returns the first matching rule's action; ``None`` means no rule
matched and nothing is in flight (a genuinely open question: the loop asks the LLM). Rules read only the
projection and ``now``; they never read a clock, never do I/O, never draw random numbers. That is what
lets an audit recompute every decision from the ledger.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, Final

from rules.actions import (
    Action,
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
from rules.admission import admits, node_price
from rules.events import MarkerKind, Verdict
from rules.inputs import input_hash, reference, sources
from rules.keys import compensation_key, gate_key, operation_key
from rules.people import UNDO_REQUEST, context_package
from rules.plan import REVIEW, Stage, TimeoutPolicy
from rules.pressure import describe as describe_pressure
from rules.pressure import width as pressure_width
from rules.projection import (
    NOTES_SHOWN,
    RETRYABLE,
    CompensationView,
    FailureInfo,
    NodeStatus,
    NodeView,
    Projection,
)

_RESUME_OPTIONS: Final = (HumanDecisionType.RESUME, HumanDecisionType.ADD_BUDGET, HumanDecisionType.ABORT)


@dataclass(frozen=True)
class Rule:
    id: str
    name: str
    when: Callable[[Projection, datetime], bool]
    then: Callable[[Projection, datetime], Action]
    doc: str


def escalate(p: Projection, reason: str, *, node: str | None = None, scope: str | None = None) -> Escalate:
    """A semi-terminal escalation: the task stops and a person may resume it. ``scope``: the budget scope
    that refused, for a budget escalation."""
    n = sum(1 for r in p.requests.values() if r.request.kind == RequestKind.ESCALATION) + 1
    request = HumanRequest(
        id=f"escalation:{n}",
        kind=RequestKind.ESCALATION,
        reason=reason,
        node=node,
        options=_RESUME_OPTIONS,
        budget_scope=scope,
        context=context_package(p, RequestKind.ESCALATION, node, _RESUME_OPTIONS),
    )
    return Escalate(reason=reason, terminal=False, request=request)


# R1 ───────────────────────────────────────────────────────────────────────────────────────────────
def _abort_when(p: Projection, now: datetime) -> bool:
    return p.aborted_by is not None


def _abort_then(p: Projection, now: datetime) -> Action:
    return Escalate(reason=f"aborted by {p.aborted_by}", terminal=True)


# R2 ───────────────────────────────────────────────────────────────────────────────────────────────
def _compliance_when(p: Projection, now: datetime) -> bool:
    return p.failed_gate is not None or (
        p.review is not None and p.review.verdict == Verdict.COMPLIANCE_BLOCK
    )


def _compliance_then(p: Projection, now: datetime) -> Action:
    if p.failed_gate is not None:
        return Escalate(reason=f"compliance gate failed: {p.failed_gate}", terminal=True)
    findings = "; ".join(p.review.findings) if p.review else ""
    return Escalate(reason=f"compliance block: {findings or 'review blocked the composition'}", terminal=True)


# R3 ───────────────────────────────────────────────────────────────────────────────────────────────
def _complete_when(p: Projection, now: datetime) -> bool:
    return (
        p.review is not None
        and (p.review.verdict in (Verdict.PASS, Verdict.SOFT_WARNING) or p.review.waived_all)
        and p.nodes[REVIEW].status == NodeStatus.SUCCEEDED
        and not p.stale
    )


def _complete_then(p: Projection, now: datetime) -> Action:
    assert p.review is not None
    return Complete(verdict=p.review.verdict.value)  # a waived rework stays what it was (the summary: waived)


# R4 ───────────────────────────────────────────────────────────────────────────────────────────────
def _deadline(p: Projection) -> datetime:
    return p.created_at + timedelta(seconds=p.plan.time_ceiling)


def _time_when(p: Projection, now: datetime) -> bool:
    return now > _deadline(p)


def _time_then(p: Projection, now: datetime) -> Action:
    return Escalate(reason=f"time ceiling of {p.plan.time_ceiling:g}s exceeded", terminal=True)


# R5 ───────────────────────────────────────────────────────────────────────────────────────────────
# Only a question that stops the whole task (an escalation, a refused LLM proposal) stops every branch.
# An approval or a dead letter blocks just its node's dependents (they are not ready), so independent
# branches keep running; when nothing else can move, the loop waits on it (see ``decide``).
TASK_STOPPING: Final = frozenset({RequestKind.ESCALATION, RequestKind.INVALID_DECISION})


def _awaiting_when(p: Projection, now: datetime) -> bool:
    return any(r.open and r.request.kind in TASK_STOPPING for r in p.requests.values())


def _awaiting_then(p: Projection, now: datetime) -> Action:
    return Wait(until=next_deadline(p, now))


# R6 ───────────────────────────────────────────────────────────────────────────────────────────────
def _timed_out(p: Projection) -> list[str]:
    return [rid for rid, r in p.requests.items() if r.timed_out and not r.applied]


def _timeout_when(p: Projection, now: datetime) -> bool:
    return bool(_timed_out(p))


def _timeout_then(p: Projection, now: datetime) -> Action:
    rid = _timed_out(p)[0]
    req = p.requests[rid].request
    reason = f"{req.kind.value} request {rid} timed out"
    if req.timeout_policy == TimeoutPolicy.ABORT:
        return Escalate(reason=f"{reason}: policy abort", terminal=True, resolves=rid)
    esc = escalate(p, f"{reason}: policy escalate", node=req.node)
    return esc.model_copy(update={"resolves": rid})


# R7 ───────────────────────────────────────────────────────────────────────────────────────────────
def _budget_when(p: Projection, now: datetime) -> bool:
    return p.spent >= p.ceiling


def _budget_then(p: Projection, now: datetime) -> Action:
    return escalate(p, f"budget exhausted: spent {p.spent} of {p.ceiling}")


# R8 ───────────────────────────────────────────────────────────────────────────────────────────────
def _retryable(p: Projection, now: datetime) -> list[NodeView]:
    out = []
    for n in p.in_order(p.failed):
        last = n.last_failure
        if (
            last is not None
            and last.kind in RETRYABLE
            and not p.exhausted(n.id)
            and n.retry_at is not None
            and now >= n.retry_at
        ):
            out.append(n)
    return out


def _retry_when(p: Projection, now: datetime) -> bool:
    return bool(_retryable(p, now))


def _retry_then(p: Projection, now: datetime) -> Action:
    n = _retryable(p, now)[0]
    last = n.last_failure
    assert last is not None
    return _dispatch_or_escalate(
        p, n, f"retry {n.attempts + 1} after {last.kind.value} failure: {last.error[:200]}", now
    )


# R9 ───────────────────────────────────────────────────────────────────────────────────────────────
# The request that asks a person to approve making a lost output again (its cost): ``remake:NODE:vN``.
REMAKE: Final = "remake:"


def _needs_person(p: Projection, now: datetime) -> tuple[NodeView, RequestKind, str, str] | None:
    """The first node a person must decide about: (it, the request's kind, its id, why)."""
    for n in p.in_order(n for n in p.stale if p.nodes[n].lost_pending):
        rid = f"{REMAKE}{n.id}:v{n.versions}"
        if rid not in p.requests and not n.in_flight:
            price, priced_by = node_price(p, p.graph.nodes[n.id].stage)
            why = f"{n.id}'s output was lost from the store and its vendor no longer holds it: making it"
            return n, RequestKind.DEAD_LETTER, rid, f"{why} again costs about {price} ({priced_by})"
    for n in p.in_order(p.failed | p.unapproved):
        if n.id in p.unapproved:
            rid = f"approval:{n.id}:v{n.versions}"
            if rid not in p.requests:
                why = f"approve {n.id} (version {n.versions}) before its dependents run"
                return n, RequestKind.APPROVAL, rid, why
        last = n.last_failure
        if n.status != NodeStatus.FAILED or last is None or n.dead_letter is not None:
            continue
        rid = f"dead_letter:{n.id}:a{n.attempts}"
        if last.kind not in RETRYABLE:
            return n, RequestKind.DEAD_LETTER, rid, f"{n.id} failed ({last.kind.value}): {last.error[:300]}"
        if p.exhausted(n.id):
            tries = n.attempts - n.round_base
            return n, RequestKind.DEAD_LETTER, rid, f"{n.id} exhausted {tries} attempts: {last.error[:300]}"
    return None


def _person_when(p: Projection, now: datetime) -> bool:
    return _needs_person(p, now) is not None


def _person_then(p: Projection, now: datetime) -> Action:
    found = _needs_person(p, now)
    assert found is not None
    n, kind, rid, reason = found
    deadline = now + timedelta(seconds=p.plan.approval.timeout)
    if kind == RequestKind.APPROVAL:
        options = (HumanDecisionType.APPROVE, HumanDecisionType.ABORT)
        policy = p.plan.approval.policy
    else:
        options = (HumanDecisionType.RESUME, HumanDecisionType.ABORT)
        # An unanswered dead letter never approves itself: the safe default is to stop and escalate.
        policy = p.plan.approval.policy
        if policy == TimeoutPolicy.APPROVE:
            policy = TimeoutPolicy.ESCALATE
    request = HumanRequest(
        id=rid,
        kind=kind,
        reason=reason,
        node=n.id,
        options=options,
        deadline=deadline,
        timeout_policy=policy,
    )
    context = context_package(p, request.kind, request.node, request.options)
    return SuspendForHuman(request=request.model_copy(update={"context": context}))


# R10 ──────────────────────────────────────────────────────────────────────────────────────────────
# How a rework verdict's escalation past the plan's rework limit begins (a waiver or a restore answers it).
REWORK_LIMIT: Final = "rework limit of "


def _rework_when(p: Projection, now: datetime) -> bool:
    return (
        p.review is not None
        and p.review.verdict == Verdict.QUALITY_REWORK
        and not p.review.handled
        and not p.review.waived_all
    )


def _rework_then(p: Projection, now: datetime) -> Action:
    assert p.review is not None
    if p.rework_rounds >= p.plan.rework_limit + p.rework_allowance:
        # About the review node: resuming this escalation (and only this one) grants one more round.
        return escalate(p, f"{REWORK_LIMIT}{p.plan.rework_limit} rounds reached", node=REVIEW)
    flagged = [f for f in p.review.unwaived() if f in p.nodes] or [REVIEW]  # a waived output is kept
    targets, invalid = p.graph.rollback_target(flagged)
    ordered = tuple(sorted(invalid, key=lambda n: p.graph.nodes[n].order))
    return Rollback(
        targets=targets,
        invalidated=ordered,
        flagged=tuple(flagged),
        round=p.rework_rounds + 1,
        reason="; ".join(p.review.findings)[:1000] or "quality rework",
    )


# R11 ──────────────────────────────────────────────────────────────────────────────────────────────
# Operations in flight per task at most: below Temporal's limit on pending activities per workflow (2,000).
MAX_IN_FLIGHT: Final = 1000


def ready_nodes(p: Projection) -> list[NodeView]:
    """Nodes whose dependencies succeeded (and were approved), canary and concurrency permitting, in node
    order.

    Above the plan's soft limit the per-stage concurrency drops to one: money is running out, so a fan-out
    proceeds one node at a time and a person can still stop it before the hard limit. While the project's
    people hold more open requests than they can (the latest reading, rules.pressure), a fan-out widens
    one node per finished node instead of starting at full width. Read from the
    projection's indexes: the cost is the number of stages plus the ready stages' idle nodes, not the plan.
    """
    return list(_ready(p))


def first_ready(p: Projection) -> NodeView | None:
    return next(_ready(p), None)


def _ready(p: Projection) -> Iterator[NodeView]:
    running = sum(len(ids) for ids in p.running.values())
    if running >= MAX_IN_FLIGHT:
        return
    width = _task_width(p)
    for sid, idle in p.idle.items():  # stages in node order
        if not idle or sid in p.gate_pending or any(p.unfinished[d] for d in p.graph.stage_deps[sid]):
            continue
        stage_nodes = p.graph.stage_nodes[sid]
        stage = p.graph.nodes[stage_nodes[0]].stage
        candidates: Iterable[str] = idle
        if stage.canary and len(stage_nodes) > 1 and p.nodes[stage_nodes[0]].status != NodeStatus.SUCCEEDED:
            # Only the canary may run until it succeeded (the others wait on it).
            candidates = (stage_nodes[0],) if stage_nodes[0] in idle else ()
        if len(p.running[sid]) >= _stage_width(p, sid, width)[0]:
            continue
        # A lost output is made again only once a person approved the cost (R9's ``remake:`` request).
        yield from (n for n in p.in_order(candidates) if not n.lost_pending)


def _task_width(p: Projection) -> int:
    """The plan's per-stage width, or 1 once spent + reserved reached the soft limit."""
    soft = p.ceiling * Decimal(str(p.plan.soft_limit))
    return 1 if p.spent + p.reserved >= soft else p.plan.concurrency


def _stage_width(p: Projection, sid: str, width: int) -> tuple[int, str | None]:
    """How many of a stage's nodes may be in flight (``width``: the task's), and why backpressure made it
    fewer, if it did (the dispatch's reason says so)."""
    stage_nodes = p.graph.stage_nodes[sid]
    canary = p.nodes[stage_nodes[0]]
    if (
        p.graph.nodes[stage_nodes[0]].stage.canary
        and len(stage_nodes) > 1
        and canary.status == NodeStatus.SUCCEEDED
        and canary.reused
        and not any(p.nodes[s].status == NodeStatus.SUCCEEDED and not p.nodes[s].reused for s in stage_nodes)
    ):
        # A reused canary proved nothing about the route this time: until one node really ran, the fan-out
        # goes one at a time (each acting as the canary).
        return 1, None
    if width <= 1 or p.pressure is None:
        return width, None
    finished = len(stage_nodes) - p.unfinished[sid]
    allowed = pressure_width(width, finished, p.pressure)
    return allowed, describe_pressure(width, allowed, p.pressure) if allowed < width else None


# R12 (a terminal task) ─────────────────────────────────────────────────────────────────────────────
def _undo_next(p: Projection, now: datetime) -> CompensationView | None:
    """The output to undo now: the newest still to undo, one at a time (a saga undoes in reverse order), once
    its retry time came."""
    left = p.uncompensated()
    if not left or any(v.in_flight for v in left) or _undo_waits_for_money(p):
        return None
    newest = left[0]
    return newest if newest.retry_at is None or now >= newest.retry_at else None


def _undo_waits_for_money(p: Projection) -> bool:
    """An undo the budget could not carry asked a person (``undo_refused``) and is not answered yet."""
    return any(r.open and rid.startswith(UNDO_REQUEST) for rid, r in p.requests.items())


# How an undo's escalation begins when a scope cannot carry it (its id: rules.people.UNDO_REQUEST).
UNDO_REFUSED: Final = "undo of {node}'s output waits for budget: "


def undo_refused(p: Projection, action: Compensate, why: str, scope: str | None) -> Escalate:
    """The escalation when the ledger refuses an undo's reservation (a scope above the task is short, or the
    task's own past its stage's overdraw cap). Never skipped: R12 waits with the undo pending until a person
    adds budget to ``scope`` and resumes (or aborts, leaving it undone on record)."""
    reason = UNDO_REFUSED.format(node=action.node) + why
    request = HumanRequest(
        id=f"{UNDO_REQUEST}{action.operation_key}",
        kind=RequestKind.ESCALATION,
        reason=reason[:2000],
        node=action.node,
        options=_RESUME_OPTIONS,
        budget_scope=scope,
        context=context_package(p, RequestKind.ESCALATION, action.node, _RESUME_OPTIONS),
    )
    return Escalate(reason=reason, terminal=False, request=request)


def _compensate_when(p: Projection, now: datetime) -> bool:
    return _undo_next(p, now) is not None


def _compensate_then(p: Projection, now: datetime) -> Action:
    v = _undo_next(p, now)
    assert v is not None
    spec = p.graph.nodes[v.node].stage.compensation
    assert spec is not None
    attempt = v.attempts + 1
    request: dict[str, Any] = {
        **spec.input,
        "compensates": {
            "operation_key": v.compensates,
            "node": v.node,
            "job_id": v.job_id,
            "sha256": v.sha256,
        },
    }
    if v.failures:
        request["feedback"] = {"previous_errors": _previous_errors(v.failures)}
    return Compensate(
        node=v.node,
        compensates=v.compensates,
        attempt=attempt,
        operation_key=compensation_key(v.compensates, attempt),
        executor=spec.executor,
        estimate=spec.estimate,
        overdraw=spec.overdraw,
        input=request,
        reason=f"undo {v.node}'s output {v.compensates}: {(p.terminal_reason or '')[:300]}",
    )


def _input_version(p: Projection, node: str) -> int:
    return max((p.nodes[d].artifact_seq for d in p.graph.nodes[node].deps), default=0)


def _needs_gate(p: Projection, n: NodeView) -> bool:
    stage = p.graph.nodes[n.id].stage
    threshold = p.plan.gate_threshold
    return stage.gate or (threshold is not None and stage.estimate >= threshold)


def _advance_when(p: Projection, now: datetime) -> bool:
    # Paused by a person (rules.changes): nothing new starts; what is in flight finishes and is recorded.
    return p.paused_by is None and first_ready(p) is not None


def _advance_then(p: Projection, now: datetime) -> Action:
    n = first_ready(p)
    assert n is not None
    return advance(p, n, now)


def advance(p: Projection, n: NodeView, now: datetime) -> Action:
    """Start a ready node: its static gate first if due, else admission, then Dispatch or Escalate."""
    if _needs_gate(p, n):
        version = _input_version(p, n.id)
        stage = p.graph.nodes[n.id].stage.id
        if (stage, version) not in p.gates:
            # One gate per stage and input version: the fan-out's nodes share their request and inputs.
            return StaticGate(
                node=n.id, input_version=version, operation_key=gate_key(p.task_id, stage, version)
            )
    reason = "rework" if n.status == NodeStatus.STALE else "first attempt" if n.attempts == 0 else "redo"
    if (squeezed := _stage_width(p, n.stage, _task_width(p))[1]) is not None:
        reason = f"{reason}; {squeezed}"
    return _dispatch_or_escalate(p, n, reason, now)


# How an escalation for a dispatch the budget does not admit begins (the rules' admission, or the ledger's).
BUDGET_REFUSED: Final = "pre-dispatch budget insufficient for {node}: "


def budget_refused(p: Projection, node: str, why: str, scope: str | None) -> Escalate:
    """The escalation when the ledger refuses a dispatch's reservation on a scope above the task. ``why`` is
    the ledger's BudgetRefused message, for a person to read; ``scope`` the scope it names (its typed
    details), which an add_budget raises."""
    return escalate(p, BUDGET_REFUSED.format(node=node) + why, node=node, scope=scope)


def _dispatch_or_escalate(p: Projection, n: NodeView, reason: str, now: datetime) -> Action:
    stage = p.graph.nodes[n.id].stage
    request = request_input(p, n)
    output = stage.output.model_dump(mode="json") if stage.output is not None else None
    executor = n.route or stage.executor  # a person's signed re-route (rules.changes), else the plan's
    digest = input_hash(request, node=n.id, executor=executor, output=output)
    reuse = next((o for o in reversed(n.outputs) if o.reusable and o.input_hash == digest), None)
    price, priced_by = node_price(p, stage)
    if n.route_price is not None and n.route_price > price:
        price, priced_by = n.route_price, f"declared by route {n.route} (re-routed)"
    if reuse is None and not admits(p, price):  # a reuse spends nothing: nothing to admit
        return escalate(
            p, BUDGET_REFUSED.format(node=n.id) + _shortfall(p, stage, price, priced_by), node=n.id
        )
    attempt = n.attempts + 1
    return Dispatch(
        node=n.id,
        attempt=attempt,
        operation_key=operation_key(p.task_id, n.id, attempt),
        executor=executor,
        # A reuse sends nothing and costs nothing; if its bytes turn out to be gone, the attempt is voided and
        # the next one is a real dispatch, admitted at the stage's estimate.
        estimate=Decimal(0) if reuse is not None else price,
        plan_estimate=stage.estimate if reuse is None and price != stage.estimate else None,
        priced_by=priced_by if reuse is None else "",
        reason=f"{reason}; reusing {reuse.operation_key} (same input hash)" if reuse is not None else reason,
        input=request,
        input_hash=digest,
        reuse={"operation_key": reuse.operation_key, "artifact": reuse.artifact}
        if reuse is not None
        else None,
    )


def _shortfall(p: Projection, stage: Stage, price: Decimal, priced_by: str) -> str:
    """What a person is told when admission refuses a node: what it needs and why, what is left, and what
    the stage's nodes not yet run would cost at that price."""
    if not priced_by:  # the plan's estimate: worded as before price books (recorded escalations recompute)
        return f"needs {price}, spent {p.spent} + reserved {p.reserved} of {p.ceiling}"
    rest = sum(
        1 for nid in p.graph.stage_nodes[stage.id] if not p.nodes[nid].done and not p.nodes[nid].in_flight
    )
    return (
        f"needs {price} ({priced_by}; the plan estimated {stage.estimate}), "
        f"spent {p.spent} + reserved {p.reserved} of {p.ceiling}; "
        f"the stage's {rest} nodes not yet run would cost {price * rest}"
    )


def request_input(p: Projection, n: NodeView) -> dict[str, Any]:
    """The request for a node's next attempt: the stage's input, its fan-out item, and what went wrong before.

    A rerun carries the reviewer's findings (after a rework rollback), the previous attempts' errors
    (docs/design.md#error-context-on-retries) and people's notes on its decisions, so a content failure is
    never resent unchanged and a person's "why" reaches the attempt it is about.
    """
    spec = p.graph.nodes[n.id]
    request: dict[str, Any] = {**spec.stage.input, **n.edits}  # a person's signed edit over the plan's
    if spec.item is not None:
        request["item"] = spec.item
    inputs = {name: _refs(p, src) for name, src in sources(p.graph, spec).items()}
    if any(v for v in inputs.values()):
        request["inputs"] = inputs
    feedback: dict[str, Any] = {}
    if n.rework_findings:  # every attempt of the round, a retry after a technical failure too
        feedback["review_findings"] = list(n.rework_findings)
        feedback["rework_round"] = n.rework_round
    if n.failures:
        feedback["previous_errors"] = _previous_errors(n.failures)
    if n.notes:  # what the people who decided about it said (resuming its dead letter, approving it …)
        feedback["people"] = list(n.notes[-NOTES_SHOWN:])
    if feedback:
        request["feedback"] = feedback
    return request


def _previous_errors(failures: list[FailureInfo]) -> list[str]:
    """The last attempts' errors, as the next request carries them (a content failure never resent as is)."""
    return [f"attempt {f.attempt} ({f.kind.value}): {f.error[:300]}" for f in failures[-3:]]


def _refs(p: Projection, src: str | list[str]) -> dict[str, Any] | list[dict[str, Any]] | None:
    """The artifact reference(s) of the producing node(s); None for a producer with no artifact."""
    if isinstance(src, list):
        return [r for s in src if (r := _ref(p, s)) is not None]
    return _ref(p, src)


def _ref(p: Projection, node: str) -> dict[str, Any] | None:
    view = p.nodes[node]
    return reference(node, view.artifact, view.artifact_seq) if view.artifact else None


# ── the table ─────────────────────────────────────────────────────────────────────────────────────
# The rule table's version, recorded in every INTENT (``Intent.rules``): bump it with any change to what the
# table decides, and keep the old table importable, so an audit recomputes each decision with the table that
# made it (and reports apart where today's table would decide differently).
# 2: backpressure (rules.pressure) and compensation (a terminal task's compensating phase).
# 3: admission at the worst credible cost (rules.pricing: the price book, the stage's observed price).
# 4: a task a person paused (rules.changes) starts nothing new and waits for its resume.
# 5: a node's next request carries what people said when they decided about it (``feedback.people``).
# 6: a node's request carries the fields a person's signed edit set (rules.changes).
# 7: a re-routed node is dispatched to its new route, admitted at least at that route's declared bound.
# 8: a review's rework finding a person waived is not redone; every blamed output waived, the task completes.
# 9: an output lost from the store (and its vendor) is made again only once a person approves the cost.
RULES_VERSION: Final = 9

RULES: Final[tuple[Rule, ...]] = (
    Rule("R1", "abort", _abort_when, _abort_then, "a person aborted: fail the task"),
    Rule("R2", "compliance_block", _compliance_when, _compliance_then, "gate failed or review blocked: fail"),
    Rule("R3", "complete", _complete_when, _complete_then, "review passed on a fresh composition: complete"),
    Rule("R4", "time_ceiling", _time_when, _time_then, "past the time ceiling: fail"),
    Rule(
        "R5", "awaiting_human", _awaiting_when, _awaiting_then, "an open request: wait for it or its deadline"
    ),
    Rule("R6", "human_timeout", _timeout_when, _timeout_then, "a request timed out: apply the plan's policy"),
    Rule("R7", "budget_exhausted", _budget_when, _budget_then, "spent reached the ceiling: escalate"),
    Rule("R8", "retry_technical", _retry_when, _retry_then, "technical failure with attempts left: retry"),
    Rule("R9", "needs_person", _person_when, _person_then, "content failure, exhausted, unknown, approval"),
    Rule("R10", "quality_rework", _rework_when, _rework_then, "review asked for rework: targeted rollback"),
    Rule("R11", "advance", _advance_when, _advance_then, "a node is ready: gate, admit, dispatch"),
)


# A terminal task's rules: its compensating phase, before its end state is final.
ENDING_RULES: Final[tuple[Rule, ...]] = (
    Rule(
        "R12",
        "compensate",
        _compensate_when,
        _compensate_then,
        "failed or aborted: undo each compensable output, newest first, before the end state is final",
    ),
)


def decide(p: Projection, now: datetime) -> tuple[str, Action] | None:
    """The first matching rule's id and action, or Wait, or None (ask the LLM).

    Wait when no rule matches but something will change without the loop acting: work in flight, a gate
    running, a retry backing off, a person's answer pending. None only when nothing matches and nothing is
    pending: a genuinely open question. A terminal task decides only its compensating phase
    (``ENDING_RULES``): None there means its end state is final.
    """
    if p.terminal:
        return _ending(p, now)
    for rule in RULES:
        if rule.when(p, now):
            return rule.id, rule.then(p, now)
    pending = (
        p.paused_by is not None  # a paused task waits for its resume (never a question for the planner)
        or any(p.running.values())
        or bool(p.gate_pending)
        or any((at := p.nodes[n].retry_at) is not None and at > now for n in p.failed)
        or any(r.open for r in p.requests.values())
    )
    if pending:
        return "wait", Wait(until=next_deadline(p, now))
    return None


def _ending(p: Projection, now: datetime) -> tuple[str, Action] | None:
    for rule in ENDING_RULES:
        if rule.when(p, now):
            return rule.id, rule.then(p, now)
    left = p.uncompensated()
    if not left:
        return None
    retry = [v.retry_at for v in left if not v.in_flight and v.retry_at is not None and v.retry_at > now]
    return "wait", Wait(until=min(retry) if retry else None)


def past_deadline(p: Projection, now: datetime) -> list[tuple[str, str | None, MarkerKind]]:
    """The open requests whose deadline has passed at ``now``, and what to mark: ``backups_offered`` when
    the plan names backup approvers and the request was not offered to them yet, else ``timeout``."""
    backups = bool(p.plan.approval.backups)
    return [
        (
            rid,
            r.request.node,
            MarkerKind.TIMEOUT if r.offered_to_backups or not backups else MarkerKind.BACKUPS_OFFERED,
        )
        for rid, r in p.requests.items()
        if r.open and (d := r.deadline) is not None and d <= now
    ]


def next_deadline(p: Projection, now: datetime) -> datetime | None:
    """The earliest future instant at which a rule could start matching without a new event."""
    candidates = [_deadline(p)]
    candidates += [d for r in p.requests.values() if r.open and (d := r.deadline) is not None]
    candidates += [r for n in p.failed if (r := p.nodes[n].retry_at) is not None]
    future = [c for c in candidates if c > now]
    return min(future) if future else None
