"""One operation's record, folded: everything the ledger says about one external call, in one place.

An operation's events all carry its OperationKey: its INTENT (what it was for, what it reserved, the route it
chose), a ``submitting`` marker before each paid send and a ``refused`` one for each send the vendor provably
did not accept, Progress with the vendor's job id, its one result under ``{operation_key}:result`` (Outcome,
Failure, ExecutionResult or a void), late charges for jobs the vendor created after that, and cost anomalies.

The executors fold them to decide how an operation goes on (``reconcile.operations``), the sweep to find
voided operations that may still have reached the vendor, the audit to match the vendors' bills: each reads
the same view, so none of them can disagree about what an operation sent, paid or was refused. Pure: no I/O
and no clock (the times are the events' ``recorded_at``, the database's).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, Final

from rules.actions import OPERATION_KINDS
from rules.envelope import StoredEvent
from rules.events import MarkerKind
from rules.keys import is_result_key, late_charge_key
from rules.plan import COMPOSE, REVIEW

# An INTENT payload's field naming the window of the operation's first send, where the INTENT is that send's
# write-ahead (``ledger.routes.routed``: a route whose vendor deduplicates on our key and finds a job by it).
# Its executor sends under it without a ``submitting`` marker of its own, within the window from the INTENT's
# commit; after a crash the record reads "send 1 may have been made", whether or not it was.
SEND_AHEAD: Final = "send_ahead_s"
AHEAD_SEND: Final = 1  # the send an INTENT's write-ahead stands for


@dataclass(frozen=True, slots=True)
class Send:
    """One paid send, as its ``submitting`` marker (or the INTENT written ahead of it) recorded it before the
    request left."""

    n: int
    at: datetime  # the marker's (INTENT's) recorded_at: the database's clock, before the request left
    timeout_s: float  # the client's timeout for it: until then (plus the route's window) it can create a job


@dataclass(frozen=True, slots=True)
class LateCharge:
    """A job the vendor created for the operation beyond the one it kept (or after it was resolved)."""

    job_id: str
    amount: Decimal


@dataclass(frozen=True)
class OperationRecord:
    """What the ledger says about one operation (``fold_operation``)."""

    key: str  # its OperationKey ("" while none of its events is on record)
    kind: str | None  # its INTENT's action (Dispatch, Compensate …); None: no INTENT among the events
    node: str | None
    executor: str | None  # the executor its INTENT's action names
    route: str | None  # the route its INTENT chose (None: not routed)
    reservation: Decimal  # what its INTENT reserved
    result: StoredEvent | None  # its one resolution
    job_id: str | None  # the job it is at: the latest Progress's (a retry resumes this one)
    job_ids: tuple[str, ...]  # every job of it on record (Progress, the result's, each late charge's)
    sends: tuple[Send, ...]
    refused: frozenset[int]  # the sends the vendor refused before accepting anything
    # Those of them refused with a 5xx, or with no status on record: evidence only where the route says so,
    # so a voided operation with one is still looked up when its task ends.
    refused_5xx: frozenset[int]
    late_charges: tuple[LateCharge, ...]
    anomalies: tuple[str, ...]  # every cost anomaly's detail
    # Its INTENT event (None: none among the events), whose fields are folded above. Keyword-only with a
    # default, so a subclass's fields may follow it and a record built by hand needs none; not compared.
    intent: StoredEvent | None = field(default=None, kw_only=True, compare=False, repr=False)
    # The send its INTENT stands for as the write-ahead (``SEND_AHEAD``), also among ``sends``; None: none.
    ahead: Send | None = field(default=None, kw_only=True)

    @property
    def dispatched(self) -> bool:
        """Its INTENT started an operation of its own at a vendor (a dispatch, or a compensation)."""
        return self.kind in OPERATION_KINDS

    @property
    def resolved(self) -> bool:
        return self.result is not None

    @property
    def voided(self) -> bool:
        """Resolved as provably never having reached the vendor."""
        r = self.result
        return r is not None and r.type == "SystemMarker" and r.payload.get("kind") == MarkerKind.VOID

    @property
    def cost(self) -> Decimal:
        """What its result counts as paid (nothing for a void, or while it has none)."""
        return _decimal(self.result.payload.get("actual_cost")) if self.result is not None else Decimal(0)

    @property
    def recorded(self) -> Decimal:
        """Everything the ledger counts as paid for it: its result's cost and every late charge."""
        return self.cost + sum((c.amount for c in self.late_charges), Decimal(0))

    @property
    def maybe_sent(self) -> tuple[Send, ...]:
        """Sends the vendor did not refuse: any of them may have created (and charged) a job."""
        return tuple(s for s in self.sends if s.n not in self.refused)

    @property
    def next_send(self) -> int:
        return max((s.n for s in self.sends), default=0) + 1

    def provable_at(self, max_accept_seconds: float) -> datetime | None:
        """When "not found by key" becomes proof of absence: no maybe-sent request can land after it, given
        how long after a send the route's vendor may still accept it (None: nothing may have been sent)."""
        sends = self.maybe_sent
        if not sends:
            return None
        latest = max(s.at + timedelta(seconds=s.timeout_s) for s in sends)
        return latest + timedelta(seconds=max_accept_seconds)


def fold_operation(events: Iterable[StoredEvent]) -> OperationRecord:
    """Fold one operation's events (all carrying its OperationKey), in ledger order."""
    key = ""
    intent: StoredEvent | None = None
    result: StoredEvent | None = None
    job_id: str | None = None
    jobs: dict[str, None] = {}  # ordered, each once
    sends: list[Send] = []
    ahead: Send | None = None
    refused: set[int] = set()
    refused_5xx: set[int] = set()
    late: list[LateCharge] = []
    anomalies: list[str] = []
    for e in events:
        key = key or e.operation_key or ""
        if is_result_key(e.dedup_key):
            if result is None:  # the ledger keeps one: the first written
                result = e
                if job := e.payload.get("job_id"):
                    jobs[str(job)] = None
        elif e.type == "Intent" and intent is None:
            intent = e
            if (window := e.payload.get(SEND_AHEAD)) is not None:
                ahead = Send(AHEAD_SEND, e.recorded_at, float(window))
                sends.append(ahead)
        elif e.type == "Progress":
            job_id = str(e.payload["job_id"])
            jobs[job_id] = None
        elif e.type == "SystemMarker":
            kind, n = e.payload.get("kind"), e.payload.get("send")
            if kind == MarkerKind.SUBMITTING:
                # Markers written before sends were numbered count as send 0, with no known timeout: the
                # longest a request could take is then the route's acceptance window alone.
                sends.append(Send(int(n or 0), e.recorded_at, float(e.payload.get("timeout_s") or 0.0)))
            elif kind == MarkerKind.REFUSED and n is not None:
                refused.add(int(n))
                status = e.payload.get("status")
                # No status on record (written before refusals kept theirs, when 503 and 529 were refusals
                # by default): counted with the 5xx ones, since a lookup is cheap and a missed charge is not.
                if not isinstance(status, int) or status >= 500:
                    refused_5xx.add(int(n))
            elif kind == MarkerKind.LATE_CHARGE:
                late_job = e.dedup_key.removeprefix(late_charge_key(key, ""))
                late.append(LateCharge(late_job, _decimal(e.payload.get("amount"))))
                jobs[late_job] = None
            elif kind == MarkerKind.COST_ANOMALY:
                anomalies.append(str(e.payload.get("detail") or ""))
    action: dict[str, Any] = (intent.payload.get("action") or {}) if intent is not None else {}
    node = _text(action.get("node")) or (_text(result.payload.get("node")) if result is not None else None)
    return OperationRecord(
        key=key,
        kind=_text(action.get("kind")),
        node=node,
        executor=_text(action.get("executor")),
        route=_text(intent.payload.get("route")) if intent is not None else None,
        reservation=_decimal(intent.payload.get("reservation")) if intent is not None else Decimal(0),
        result=result,
        job_id=job_id,
        job_ids=tuple(jobs),
        sends=tuple(sends),
        refused=frozenset(refused),
        refused_5xx=frozenset(refused_5xx),
        late_charges=tuple(late),
        anomalies=tuple(anomalies),
        intent=intent,
        ahead=ahead,
    )


def fold_operations(events: Iterable[StoredEvent]) -> dict[str, OperationRecord]:
    """Every operation among a task's events, folded, by OperationKey (in the order each first appears)."""
    by_key: dict[str, list[StoredEvent]] = {}
    for e in events:
        if e.operation_key is not None:
            by_key.setdefault(e.operation_key, []).append(e)
    return {key: fold_operation(op_events) for key, op_events in by_key.items()}


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _decimal(value: Any) -> Decimal:
    return Decimal(str(value)) if value is not None else Decimal(0)


def overrun_bound(events: Iterable[StoredEvent]) -> Decimal:
    """The bound on a task's spend past its ceiling (rules.pricing): the overrun — settled cost above what
    was reserved, where positive — of the operations in flight when its last operation was admitted.

    Admission checks spent + reserved + a node's price against every ceiling, so only what was already in
    flight at the last admission can take spend past one. ``events``: one task's, in ``seq`` order.
    """
    events = list(events)
    in_flight: set[str] = set()
    at_last: set[str] = set()
    for e in events:
        if e.type == "Intent" and e.operation_key and e.payload["action"]["kind"] in OPERATION_KINDS:
            in_flight.add(e.operation_key)
            at_last = set(in_flight)
        elif e.operation_key and is_result_key(e.dedup_key):
            in_flight.discard(e.operation_key)
    ops = fold_operations(e for e in events if e.operation_key in at_last)
    return sum((max(Decimal(0), op.recorded - op.reservation) for op in ops.values()), Decimal(0))


def served_by(op: OperationRecord) -> str | None:
    """The route that served an operation: the one its INTENT chose (a fallback, while its primary's breaker
    was open), else — a record from before routes were chosen — its executor's. None: framework work (the
    review's model call, compose), which no vendor bills."""
    if op.executor in (REVIEW, COMPOSE):
        return None
    return op.route or op.executor
