"""What an operation whose INTENT has no result does next, decided before anything is sent.

An executor reaches an open operation on its first attempt, on a Temporal retry (the worker died, the vendor
failed), on a takeover (a new run resumed the task from the ledger) and when a task ends with the operation
in flight. Only the ledger and the vendor know how far it got, so the decision is made from them, never from
local memory. The ledger knows, per operation: the job id (Progress, or the heartbeat of a retry), every
*send* (a ``submitting`` marker written just before each submit, with the client's timeout) and every send
the vendor *refused* (a ``refused`` marker: a 429, 408, 401 … proves nothing was accepted).

* A job id on record always wins: resume that job (in every mode).
* No send that may have landed (none, or every one refused): submit.
* The vendor deduplicates on the key and still remembers it (the first send is younger than the route's
  ``key_retention``): submit again under the same key; the resubmission *is* the lookup.
* Otherwise, if the vendor can look the key up: found → resume it; not found → that is proof of absence
  only once no send can land any more (its ``recorded_at + timeout_s + max_accept_seconds`` has passed): then
  void the INTENT (the loop decides afresh under a new key); before that, wait and look again.
* The vendor can do neither: the outcome is unknown. A person decides; the operation is counted at its
  estimate with a cost anomaly (a charge that may have happened is never lost, never counted as zero).

``next_step`` is the pure decision; ``reconcile`` runs it, looking the key up where the decision needs it.
``stop_step`` is the same reasoning for an operation that must end now (its task ended): it never submits.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from enum import StrEnum

from temporalio import activity

from rules.envelope import StoredEvent
from rules.operation import OperationRecord, fold_operation
from rules.routing import convert
from runtime import telemetry
from vendors.adapter import Capabilities, Sent, VendorAdapter, VendorJob, mode_of
from vendors.errors import VendorCannotTell
from vendors.routes import RouteSpec, VendorMode


def sent_of(record: OperationRecord, route: RouteSpec) -> Sent | None:
    """What the operation sent, from its INTENT: the executor it was sent as (its route, for a fallback) and
    the request, in the route's field names (``route.convert``, as ``activities.stages`` converts it). None
    where the INTENT says nothing of it (no INTENT on record, a compensation)."""
    intent = record.intent
    action = intent.payload.get("action") if intent is not None else None
    if not isinstance(action, dict) or action.get("kind") != "Dispatch":
        return None
    request, executor = action.get("input"), action.get("executor")
    if not isinstance(request, dict) or not isinstance(executor, str):
        return None
    if record.route and record.route != executor:
        return Sent(record.route, convert(request, route.convert))
    return Sent(executor, request)


class Next(StrEnum):
    RESUME = "resume"  # poll (or settle) this job
    SUBMIT = "submit"  # send the request (again, under the same key)
    LOOKUP = "lookup"  # ask the vendor for jobs under the key (``reconcile`` does it)
    VOID = "void"  # provably never reached the vendor: resolve as void, nothing spent
    UNKNOWN = "unknown"  # nobody can tell: estimate + cost anomaly, a person decides
    WAIT = "wait"  # not provable yet: look again after ``wait_s``


@dataclass(frozen=True)
class OperationState(OperationRecord):
    """An operation's record (``rules.operation``) as read at ``now``, the database's clock: how long ago
    its sends left, and whether a send could still land, is measured against it."""

    now: datetime


def operation_state(events: list[StoredEvent], now: datetime) -> OperationState:
    """Fold one operation's events (all carrying its OperationKey) into what reconciliation needs."""
    record = fold_operation(events)
    return OperationState(**{f.name: getattr(record, f.name) for f in fields(record)}, now=now)


@dataclass(frozen=True, slots=True)
class Step:
    next: Next
    job_id: str | None = None
    why: str = ""
    wait_s: float = 0.0
    job: VendorJob | None = None  # a job found by the lookup
    extra: tuple[VendorJob, ...] = ()  # more jobs found under the key: each one was paid for too


def next_step(state: OperationState, route: RouteSpec, caps: Capabilities, heartbeat_job: str | None) -> Step:
    """The pure decision for an executor about to act (see the module doc)."""
    known = heartbeat_job or state.job_id
    if known is not None:
        return Step(Next.RESUME, known, "job id on record")
    if not state.maybe_sent:
        return Step(Next.SUBMIT, why="never sent" if not state.sends else "every send was refused")
    if caps.free:
        return Step(Next.SUBMIT, why="redoing it costs nothing")
    mode = mode_of(route, caps)
    first = min(s.at for s in state.maybe_sent)
    age = (state.now - first).total_seconds()
    if mode == VendorMode.IDEMPOTENT and age < route.key_retention:
        return Step(Next.SUBMIT, why="the vendor deduplicates on the key")
    if caps.can_lookup:
        why = "key older than the vendor's retention" if mode == VendorMode.IDEMPOTENT else "maybe sent"
        return Step(Next.LOOKUP, why=why)
    if mode == VendorMode.IDEMPOTENT:
        return Step(
            Next.UNKNOWN, why=f"the key is {age:.0f}s old, past the vendor's retention, and no lookup"
        )
    return Step(Next.UNKNOWN, why="the vendor can neither deduplicate nor look up")


def stop_step(state: OperationState, route: RouteSpec, caps: Capabilities, heartbeat_job: str | None) -> Step:
    """The decision for an operation that must end now (its task ended): never a submit."""
    known = heartbeat_job or state.job_id
    if known is not None:
        return Step(Next.RESUME, known, "job id on record: cancel it")
    if not state.maybe_sent or caps.free:
        return Step(
            Next.VOID, why="never reached the vendor" if not caps.free else "no vendor money involved"
        )
    if caps.can_lookup:
        return Step(Next.LOOKUP, why="maybe sent")
    return Step(Next.UNKNOWN, why="maybe sent, and the vendor cannot look the key up")


def after_lookup(state: OperationState, route: RouteSpec, found: list[VendorJob]) -> Step:
    """What a lookup by key proves: found → resume it; absent → void, once no send can land any more."""
    if found:
        return Step(
            Next.RESUME, found[0].id, "found at the vendor by key", job=found[0], extra=tuple(found[1:])
        )
    provable = state.provable_at(route.max_accept_seconds)
    if provable is None or state.now >= provable:
        return Step(Next.VOID, why="provably not at the vendor (no send can land any more)")
    wait = (provable - state.now).total_seconds()
    return Step(Next.WAIT, why=f"not found by key yet; a send may still land for {wait:.1f}s", wait_s=wait)


async def reconcile(
    adapter: VendorAdapter,
    route: RouteSpec,
    state: OperationState,
    operation_key: str,
    heartbeat_job: str | None,
    *,
    stopping: bool = False,
) -> Step:
    """Decide how an open operation continues, looking its key up at the vendor if that is what it takes.

    Traced as a ``reconcile`` span holding the decision (its lookup is a ``vendor.find_by_key`` span inside
    it), and logged: what was decided, and why.
    """
    with telemetry.span("reconcile", {"ledgerflow.stopping": stopping}) as span:
        step = await _reconcile(adapter, route, state, operation_key, heartbeat_job, stopping=stopping)
        span.set_attributes(
            {"ledgerflow.reconcile.next": step.next.value, "ledgerflow.reconcile.why": step.why}
        )
    activity.logger.info("reconciled: %s (%s)", step.next.value, step.why)
    return step


async def _reconcile(
    adapter: VendorAdapter,
    route: RouteSpec,
    state: OperationState,
    operation_key: str,
    heartbeat_job: str | None,
    *,
    stopping: bool,
) -> Step:
    caps = adapter.capabilities
    decide = stop_step if stopping else next_step
    step = decide(state, route, caps, heartbeat_job)
    if step.next != Next.LOOKUP:
        return step
    since = min(s.at for s in state.maybe_sent) - timedelta(minutes=5)
    try:
        found = await adapter.find_by_key(operation_key, since=since, sent=sent_of(state, route))
    except VendorCannotTell:
        return Step(Next.UNKNOWN, why="the vendor could not look the key up")
    step = after_lookup(state, route, found)
    if step.next == Next.VOID and caps.has_billing:
        # A lookup may forget keys as the vendor's dedup does; its billing does not. A charge under the key
        # means a job existed whatever the lookup says: never void what was billed.
        billed = await adapter.charged(operation_key, None)
        if billed is not None:
            return Step(Next.UNKNOWN, why=f"not found by key, yet the vendor billed {billed} under it")
    return step
