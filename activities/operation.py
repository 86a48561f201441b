"""The Operation lifecycle: what every executor does around its body, in one place.

One operation is one external call (or one piece of framework work) under one OperationKey. Its life:

    INTENT (fenced, with reservation; a dispatch's is written by its executor as its first step: ``routed``)
    → open: one read of the ledger (epoch, the database's clock, the operation's events, the route's state),
      its events folded by ``rules.operation``
    → reconcile (reconcile.operations): resume a known job, submit, look the key up, void, or "unknown"
    → before each paid call: the write-ahead ``submitting`` marker, itself fenced by the run's epoch
    → the body (vendor job, model call, local work), heartbeating
    → exactly one result under ``{op}:result`` (Outcome, Failure, ExecutionResult or void), settling the
      reservation at the actual cost, plus a cost anomaly wherever the figure is odd or uncertain.

Every executor — the paid stages (``activities/stages.py``), the review and its model call, compose and the
static gate (``activities/review.py``) — runs inside it. The LLM planner (``activities/llm.py``) shares its
heartbeats and its fence, keyed by its decision's watermark, but writes no ``submitting`` marker (a planner
answer lost with its worker may be asked, and paid for, again: cents). Every dedup key comes from
``rules.keys``; every error crosses into Temporal through ``activities.boundary``.

Each step is logged through ``activity.logger`` (INTENT, opened, reconciled, submitting send N, the result
and its cost, a cost anomaly) and traced (``ledger.intent``, ``ledger.open``, ``ledger.submitting``,
``ledger.result``, ``ledger.append``); the operation is bound once per attempt (``bind``), so every line and
span names its task, node, OperationKey, epoch and run (``runtime/logs.py``, ``runtime/telemetry.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from decimal import Decimal
from typing import Any, Final

from temporalio import activity

from activities.boundary import NotYetProvable, RoutePaused, cross
from activities.contracts import StageInput
from artifacts.store import ArtifactStore
from ledger.errors import DuplicateEvent, LedgerError, StaleEpoch
from ledger.recorder import Recorder, Routing
from reconcile.operations import OperationState, operation_state
from rules.envelope import NewEvent, StoredEvent
from rules.events import (
    ExecutionResult,
    Failure,
    FailureKind,
    MarkerKind,
    Outcome,
    Progress,
    SystemMarker,
    to_new,
)
from rules.keys import (
    anomaly_key,
    closing_key,
    late_charge_key,
    lost_key,
    progress_key,
    refused_key,
    result_key,
    submitting_key,
)
from rules.money import VendorAmount
from rules.operation import AHEAD_SEND, fold_operation
from rules.routing import BreakerPolicy, RouteHealth
from runtime import logs, telemetry
from runtime.faults import mark


class Operation:
    """One operation's ledger side, for the executor running it (one instance per activity attempt).

    Args:
        recorder: The ledger.
        task_id, node, key: Whose operation this is.
        epoch: The fencing epoch of the run that recorded the INTENT; a paid call is made only under it.
        estimate: The reservation the INTENT made; the result releases it.
        route: The route the body calls (its pause state is checked when the operation opens), if any.
    """

    def __init__(
        self,
        recorder: Recorder,
        *,
        task_id: str,
        node: str,
        key: str,
        epoch: int,
        estimate: Decimal,
        route: str | None = None,
        pause_retry_s: float = 30.0,
        fence_writes: bool = False,
    ) -> None:
        self.recorder = recorder
        self.task_id, self.node, self.key = task_id, node, key
        self.epoch, self.estimate, self.route = epoch, estimate, route
        self.pause_retry_s = pause_retry_s
        # Every write fenced by ``epoch``, in the write's own statement (a close: a run that lost the task
        # writes nothing); else only the writes that ask for it.
        self.fence_writes = fence_writes
        self.seen_epoch: int | None = None  # the task's epoch as ``open`` read it
        self.breaker: RouteHealth | None = None  # the route's shared row, as ``open`` read it
        # Set when this attempt's own job was billed far above the route's own declared price: the route's
        # breaker counts the call as a failed one (once per task and breaker window: ``RouteStore.observe``).
        self.billing_off = False
        # Set by an executor whose calls its route's breaker judges: ``(route, its breaker policy)``. An
        # Outcome that shows the route answered well records the route's ``ok`` observation in the result's
        # own transaction (``observed``: it did), not in one more of its own.
        self.observing: tuple[str, BreakerPolicy] | None = None
        self.observed = False
        # Whether the INTENT's write-ahead of send 1 (``OperationState.ahead``) is this attempt's own and
        # still unused (None: not decided yet, at the first open), and until when (time.monotonic) send 1 may
        # still leave under it (None once used, or once a send no longer fit).
        self._claim_unused: bool | None = None
        self._ahead_until: float | None = None
        bind(task_id, node, key, epoch, route)

    # ── opening ───────────────────────────────────────────────────────────────────────────────────────
    async def open(self, *, fenced: bool = True) -> OperationState:
        """Read how far the operation got. Raises StaleEpoch for a fenced-off run, RoutePaused if paused.

        The caller returns ``state.result`` when it is set: a retry after the result was written does nothing.
        ``fenced=False`` is for closing an operation: that never calls a vendor to create anything.
        """
        asked = time.monotonic()  # before the read: the window left is counted from no later than its clock
        with telemetry.span("ledger.open"):
            view = await asyncio.to_thread(self.recorder.operation_view, self.task_id, self.key, self.route)
        if view.epoch is None or view.now is None:
            raise LedgerError(f"task {self.task_id!r} has no lease: {self.key} cannot run")
        state = self._own_ahead(operation_state(view.events, view.now), asked)
        self.breaker, self.seen_epoch = view.breaker, view.epoch
        activity.logger.info("opened: %s", _described(state))
        if state.result is not None:
            return state
        if fenced and view.epoch != self.epoch:
            # A zombie attempt of a run that lost the task must never start new vendor work.
            activity.logger.warning("fenced off: the task's epoch is now %d", view.epoch)
            raise StaleEpoch(self.task_id, self.epoch, view.epoch)
        if fenced and view.paused is not None and self.route is not None:
            activity.logger.info("route %s is paused: nothing is sent until a person resumes it", self.route)
            raise RoutePaused(self.route, view.paused, self.pause_retry_s)
        return state

    def _own_ahead(self, state: OperationState, asked: float) -> OperationState:
        """The record as this attempt knows it: where it wrote the INTENT a moment ago and that INTENT is the
        write-ahead of send 1 (``state.ahead``), nothing left under it until ``sending`` uses it, whatever the
        record says to anyone else. Decided at the attempt's first open; at each open until the claim is
        used, the INTENT's send is left out of the state (a marker written meanwhile stays in). Keeps until
        when (``_ahead_until``, measured from the database's clock: the INTENT's time and the read's ``now``)
        send 1 may still leave under it."""
        claim = state.ahead
        if self._claim_unused is None:  # the attempt's first open
            self._claim_unused = (
                _FRESH_INTENT.get() == self.key
                and claim is not None
                and state.sends == (claim,)
                and state.result is None
                and state.job_id is None
                and not state.refused
            )
            if self._claim_unused and claim is not None:
                self._ahead_until = asked + claim.timeout_s - (state.now - claim.at).total_seconds()
        if not self._claim_unused or claim is None:
            return state
        return dataclasses.replace(state, sends=tuple(s for s in state.sends if s != claim))

    def check_fence(self) -> None:
        """StaleEpoch unless this run's epoch was still the task's when ``open`` read it: before a vendor is
        asked to cancel (the writes that follow are fenced in their own statements)."""
        if self.seen_epoch is not None and self.seen_epoch != self.epoch:
            activity.logger.warning(
                "fenced off: the task's epoch is now %d; not closing %s", self.seen_epoch, self.key
            )
            raise StaleEpoch(self.task_id, self.epoch, self.seen_epoch)

    async def run(
        self,
        body: Callable[[OperationState, Heartbeat], Awaitable[StoredEvent]],
        *,
        fenced: bool = True,
    ) -> StoredEvent:
        """The whole lifecycle around a body that needs nothing more (compose, review, gate): open — a retry
        after the result was written does nothing —, heartbeat while the body runs, every error across the
        boundary into Temporal."""
        try:
            async with heartbeating() as beat:
                state = await self.open(fenced=fenced)
                if state.result is not None:
                    return state.result
                return await body(state, beat)
        except Exception as e:
            cross(e)

    # ── writes ────────────────────────────────────────────────────────────────────────────────────────
    async def write(
        self,
        event: NewEvent,
        *,
        release: Decimal = Decimal(0),
        spend: Decimal = Decimal(0),
        fenced: bool = False,
        unless_resolved: bool = False,
        span_name: str = "ledger.append",
        observed_ok: tuple[str, BreakerPolicy] | None = None,
    ) -> tuple[StoredEvent, bool]:
        """An idempotent append (first write of its key wins); ``fenced``: only under this run's epoch;
        ``unless_resolved``: only while the operation has no result (AlreadyResolved otherwise)."""
        append = functools.partial(
            self.recorder.append_idempotent,
            self.task_id,
            event,
            release=release,
            spend=spend,
            fence_epoch=self.epoch if fenced or self.fence_writes else None,
            unless=result_key(self.key) if unless_resolved else None,
            observed_ok=observed_ok,
        )
        marker = event.payload.get("kind") if event.type == "SystemMarker" else None
        cost = event.payload.get(
            "actual_cost"
        )  # what an Outcome or a Failure books: on every paid call's span
        attrs = {"ledgerflow.event": event.type, "ledgerflow.marker": marker, "ledgerflow.cost": cost}
        with telemetry.span(span_name, {k: None if v is None else str(v) for k, v in attrs.items()}) as s:
            stored, inserted = await asyncio.to_thread(append)
            s.set_attribute("ledgerflow.inserted", inserted)
        rows = _WRITTEN.get()
        if rows is not None:
            rows.append(stored)  # for ``routed``: the rows to hand the loop with the result
        return stored, inserted

    async def sending(self, state: OperationState, timeout_s: float) -> int:
        """Write-ahead before a paid call: the ``submitting`` marker of the next send, fenced by the epoch.

        After a crash this marker is what tells "maybe sent" from "never sent", and its time and timeout say
        until when the send could still create a job. It is written in one statement that takes the task's
        lease lock and checks two things, so nothing can slip between the check and the send:

        * the epoch is this run's: a zombie of a fenced-off run writes nothing, so never calls the vendor
          (StaleEpoch);
        * the operation has no result yet: if the task's end (``operation.close``) or another attempt resolved
          it, nothing may be sent any more (AlreadyResolved: the caller returns that result).

        Returns the send's number. If another attempt of this operation wrote the same send meanwhile (two
        attempts at once, e.g. one whose heartbeat was lost), this one does not send: it retries shortly and
        reconciles, which then sees that send.
        """
        n = state.next_send
        if n == AHEAD_SEND and self._ahead_until is not None:  # set only while the claim is unused
            left, self._ahead_until = self._ahead_until - time.monotonic(), None  # one use
            if left >= timeout_s:
                # From here on this attempt, too, reads send 1 as maybe sent (a cancellation's close looks).
                self._claim_unused = False
                # The INTENT this attempt wrote is send 1's write-ahead, and the send still fits its window.
                activity.logger.info(
                    "submitting send 1 under its INTENT's write-ahead"
                    " (the client gives up after %gs; %.1fs of the window left)",
                    timeout_s,
                    left,
                )
                return n
        marker = SystemMarker(
            kind=MarkerKind.SUBMITTING, node=self.node, operation_key=self.key, send=n, timeout_s=timeout_s
        )
        new = to_new(marker, dedup_key=submitting_key(self.key, n), operation_key=self.key)
        _, inserted = await self.write(new, fenced=True, unless_resolved=True, span_name="ledger.submitting")
        if not inserted:
            raise NotYetProvable(f"another attempt of {self.key} is sending (send {n}): reconcile first", 0.5)
        activity.logger.info("submitting send %d (the client gives up after %gs)", n, timeout_s)
        return n

    async def refused(self, n: int, why: str, status: int | None = None) -> None:
        """The vendor refused send ``n`` before accepting anything (with HTTP ``status``, if any): it is no
        longer "maybe sent"."""
        marker = SystemMarker(
            kind=MarkerKind.REFUSED,
            node=self.node,
            operation_key=self.key,
            send=n,
            detail=why[:2000],
            status=status,
        )
        await self.write(to_new(marker, dedup_key=refused_key(self.key, n), operation_key=self.key))

    async def progress(self, job_id: str, progress: float | None) -> None:
        event = Progress(node=self.node, operation_key=self.key, job_id=job_id, progress=progress or 0.0)
        await self.write(to_new(event, dedup_key=progress_key(self.key, job_id), operation_key=self.key))
        mark("progress_recorded", op=self.key, job=job_id)

    async def anomaly(self, detail: str, what: str) -> None:
        """A cost anomaly: recorded as it is, never hidden or blocking; people and the audit see it."""
        marker = SystemMarker(
            kind=MarkerKind.COST_ANOMALY, node=self.node, operation_key=self.key, detail=detail[:2000]
        )
        _, inserted = await self.write(
            to_new(marker, dedup_key=anomaly_key(self.key, what), operation_key=self.key)
        )
        if inserted:
            activity.logger.warning("cost anomaly (%s): %s", what, detail[:500])

    async def lost(self, node: str, sha256: str) -> None:
        """The output of ``node`` with these bytes is missing or corrupt: never reuse it, never hand it on."""
        marker = SystemMarker(kind=MarkerKind.ARTIFACT_LOST, node=node, operation_key=self.key, detail=sha256)
        await self.write(to_new(marker, dedup_key=lost_key(self.key, sha256), operation_key=self.key))

    async def refetched(self, node: str, sha256: str, job_id: str) -> None:
        """The output of ``node`` with these bytes was missing or corrupt and is back, fetched again from
        vendor job ``job_id`` and verified: recorded, so the audit sees the store lost it once."""
        marker = SystemMarker(
            kind=MarkerKind.ARTIFACT_REFETCHED,
            node=node,
            operation_key=self.key,
            detail=f"{sha256} from job {job_id}"[:2000],
        )
        await self.write(
            to_new(marker, dedup_key=f"{lost_key(self.key, sha256)}:refetched", operation_key=self.key)
        )

    async def late_charge(self, job_id: str, amount: VendorAmount, why: str) -> None:
        """A job the vendor created for this key after the operation was resolved: its charge is spent."""
        cost = amount.amount if amount.amount is not None else self.estimate
        marker = SystemMarker(
            kind=MarkerKind.LATE_CHARGE,
            node=self.node,
            operation_key=self.key,
            amount=cost,
            detail=f"job {job_id}: {why}"[:2000],
        )
        _, inserted = await self.write(
            to_new(marker, dedup_key=late_charge_key(self.key, job_id), operation_key=self.key), spend=cost
        )
        if inserted:
            raw = f" (vendor figure {amount.raw!r})" if amount.anomaly or amount.amount is None else ""
            await self.anomaly(f"late job {job_id} charged {cost}{raw}: {why}", f"late:{job_id}")

    async def check_inputs(
        self,
        inputs: list[dict[str, Any]],
        store_for: Callable[[str], ArtifactStore],
        refetch: Callable[[dict[str, Any]], Awaitable[bool]] | None = None,
    ) -> StoredEvent | None:
        """Verify every input artifact against its recorded sha256 before it is handed on.

        One whose bytes are gone or changed is fetched again from the vendor job that made it where
        ``refetch`` can (``Outputs.refetch``: nothing paid); the first that cannot be is recorded as lost (its
        producer makes it again) and the operation is voided, nothing sent: that void is returned. None:
        every input is intact.
        """
        for ref in inputs:
            store = store_for(ref["uri"])
            if not await asyncio.to_thread(store.verify, ref["uri"], ref["sha256"]) and not (
                refetch is not None
                and await refetch(ref)
                and await asyncio.to_thread(store.verify, ref["uri"], ref["sha256"])
            ):
                producer = str(ref.get("node") or self.node)
                await self.lost(producer, ref["sha256"])
                return await self.void(
                    f"input {producer} ({ref['sha256'][:12]}…) is missing or corrupt in the store"
                )
        return None

    # ── the one result ────────────────────────────────────────────────────────────────────────────────
    async def resolve(
        self, event: Outcome | Failure | ExecutionResult | SystemMarker, spend: Decimal
    ) -> StoredEvent:
        """Write the operation's one resolution, settling its reservation at the actual cost, once.

        Returns the result that stands: this one, or one written first by someone else (the task's end,
        another attempt), whose ``job_id`` then tells whether it was for the same job.
        """
        ok = self._observed_ok(event)
        stored, inserted = await self.write(
            to_new(event, dedup_key=result_key(self.key), operation_key=self.key),
            release=self.estimate,
            spend=spend,
            span_name="ledger.result",
            observed_ok=ok,
        )
        self.observed = inserted and ok is not None
        mark("outcome_recorded", op=self.key, type=stored.type)
        if inserted:
            activity.logger.info(
                "result recorded: %s, cost %s (reserved %s)", _result_name(stored), spend, self.estimate
            )
        else:
            activity.logger.info("result already recorded: %s stands", _result_name(stored))
        return stored

    def _observed_ok(self, event: object) -> tuple[str, BreakerPolicy] | None:
        """``observing`` where this result is an ok its breaker only counts: an Outcome billed as the route
        prices it, of an operation that is neither its route's probe nor its canary (those move the breaker:
        ``RouteStore.observe``, in a transaction of its own). The probe and canary claims are made by the
        INTENT, before ``open`` read the row."""
        h = self.breaker
        if self.observing is None or not isinstance(event, Outcome) or self.billing_off:
            return None
        if h is not None and self.key in (h.probe_key, h.canary_key):
            return None
        return self.observing

    async def settle_cost(
        self,
        amount: VendorAmount,
        *,
        price_bound: Decimal | None = None,
    ) -> Decimal:
        """The cost to record for a vendor's figure: the figure made money, or the estimate if unusable.

        Whatever is odd about the figure becomes a cost anomaly holding the raw value (and the estimate); so
        does a cost above the reserved estimate. Never zero for a charge that happened, never an exception.
        ``price_bound``: what the route's own declared price says this attempt's finished job costs; a figure
        far above it marks the route's billing as off — judged against the vendor's price, never against a
        plan's estimate (the route's breaker counts it once per task and window, so one plan cannot open a
        breaker every project shares).
        """
        if amount.amount is None:  # every producer of an unusable figure names its raw value in the anomaly
            await self.anomaly(f"{amount.anomaly}: counted at the estimate {self.estimate}", "figure")
            return self.estimate
        if amount.anomaly:
            await self.anomaly(amount.anomaly, "figure")
        if amount.amount > self.estimate:
            why = f"actual {amount.amount} above the reserved estimate {self.estimate}"
            await self.anomaly(why, "above_estimate")
        if price_bound is not None and amount.amount > BILLING_OFF_FACTOR * price_bound:
            why = f"actual {amount.amount} above {BILLING_OFF_FACTOR}x the route's own price {price_bound}"
            await self.anomaly(why, "above_price")
            self.billing_off = True
        return amount.amount

    async def failure(
        self, kind: FailureKind, error: str, cost: Decimal, job_id: str | None = None
    ) -> StoredEvent:
        event = Failure(
            node=self.node,
            operation_key=self.key,
            kind=kind,
            error=error[:4000],
            actual_cost=cost,
            job_id=job_id,
        )
        return await self.resolve(event, spend=cost)

    async def void(self, why: str) -> StoredEvent:
        """Provably never reached the vendor: nothing spent; the rules decide afresh under a new key."""
        marker = SystemMarker(kind=MarkerKind.VOID, node=self.node, operation_key=self.key, detail=why[:2000])
        return await self.resolve(marker, spend=Decimal(0))

    async def unknown(self, why: str) -> StoredEvent:
        """Nobody can say whether the vendor ran it: counted at the estimate, flagged, a person decides."""
        await self.anomaly(f"possible charge: {why}", "possible")
        # Counted as spent at the reserved estimate: a charge that may have happened is accounted for, never
        # lost (the person who decides sees the anomaly and can check the vendor's invoice).
        error = f"the vendor cannot say whether {self.key} ran ({why}); not resubmitted"
        return await self.failure(FailureKind.UNKNOWN_OUTCOME, error, self.estimate)


class Heartbeat:
    """What this attempt heartbeats; a retry reads it back (``activity.info().heartbeat_details``)."""

    def __init__(self) -> None:
        previous = activity.info().heartbeat_details
        self.details: Any = previous[0] if previous else None

    def beat(self, details: Any) -> None:
        self.details = details
        activity.heartbeat(details)


@contextlib.asynccontextmanager
async def heartbeating() -> AsyncIterator[Heartbeat]:
    """Heartbeat every third of the heartbeat timeout while the body runs.

    A heartbeat only says the worker is alive, which it is while it waits on a model or a vendor; a dead
    worker misses its heartbeats and its attempt is retried within the timeout, and a cancellation (the task
    ended) is delivered. The details sent are the latest ``beat.details`` (the previous attempt's until
    replaced), so a retry can resume from them (a job id, a paid answer).
    """
    beat = Heartbeat()
    timeout = activity.info().heartbeat_timeout
    if not timeout:
        yield beat
        return
    interval = max(0.05, timeout.total_seconds() / 3)

    async def loop() -> None:
        while True:
            activity.heartbeat(*(() if beat.details is None else (beat.details,)))
            await asyncio.sleep(interval)

    task = asyncio.create_task(loop())
    try:
        yield beat
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# A charge above this many times the route's own declared price for the job is the vendor's billing gone
# wrong (a price change, a runaway job), not rounding: its breaker counts it as a failed call. A charge
# above a plan's estimate is the plan's problem (a cost anomaly, never a breaker's); sub-cent figures rounded
# up, and figures a vendor does not report (counted at the estimate), stay mere cost anomalies.
BILLING_OFF_FACTOR: Final = 2


async def recorded(
    recorder: Recorder, inp: StageInput, body: Callable[[], Awaitable[StoredEvent]]
) -> StoredEvent | list[StoredEvent]:
    """``routed`` for an executor with no route to choose (compose, review): its body needs no route."""
    return await routed(recorder, inp, lambda route: body())


async def routed(
    recorder: Recorder,
    inp: StageInput,
    body: Callable[[str | None], Awaitable[StoredEvent]],
    routing: Routing | None = None,
    human_capacity: int | None = None,
) -> StoredEvent | list[StoredEvent]:
    """An executor activity's whole run for a dispatch whose INTENT it writes (``inp.intent``; None: the
    workflow wrote it, and the body's result is returned as before).

    The INTENT is the activity's first step: one fenced append that reserves on every budget scope, refused
    if another run holds the task (StaleEpoch), a scope is short (BudgetRefused: nothing written, the loop
    escalates) or the task began closing (AlreadyResolved: nothing may start any more). A retry finds its own
    INTENT already written and goes on. Returns the ledger rows this attempt wrote, INTENT to result (and the
    result, whoever wrote it), so the loop folds them without reading the ledger again when nothing else was
    written in between (workflows/task.py); the rows come from the writes themselves, not from a read.
    (Returning every row since the loop's watermark instead, to spare the read a small fan-out's interleaved
    rows cause, saved no history events in ``make bench`` and doubled E001's history.)

    With ``routing`` the same append chooses the operation's route (rules.routing: the primary, a qualified
    fallback, or RouteWaiting — nothing written, asked again later), and the body is handed the route the
    INTENT recorded (None: not routed, or the workflow wrote the INTENT). An operation keeps its route for
    life: a retry finds it in its INTENT. With ``human_capacity`` (how many open requests the project's
    people hold) the same append reads and records the human load (rules.pressure).
    """
    intent, task_id = inp.intent, inp.task_id
    bound = logs.current()
    if bound is None or bound.operation_key != inp.operation_key:
        bind(task_id, inp.node, inp.operation_key, inp.epoch, None)
    if intent is None:
        return await body(None)
    assert intent.operation_key is not None

    wrote = False
    with telemetry.span("ledger.intent", {"ledgerflow.reservation": str(inp.estimate)}) as span:
        try:
            rows = await asyncio.to_thread(
                recorder.append_fenced,
                task_id,
                inp.epoch,
                [intent],
                reserve=inp.estimate,
                unless=closing_key(task_id),
                routing=routing,
                human_capacity=human_capacity,
            )
            wrote = True  # by this attempt: a retry finds it on record (below)
            mark("intent_recorded", task=task_id, op=intent.operation_key)
            activity.logger.info("INTENT recorded, %s reserved", inp.estimate)
        except DuplicateEvent:
            # A retry: its INTENT is on record (a routed append finds it before choosing anything again).
            existing = await asyncio.to_thread(recorder.find_by_dedup_key, intent.dedup_key)
            if (
                existing is None
                or existing.task_id != task_id
                or existing.operation_key != intent.operation_key
            ):
                raise
            rows, wrote = [existing], False
        except LedgerError as e:
            activity.logger.info("INTENT refused: %s", e)
            cross(e)
        record = fold_operation(rows)
        if wrote and record.ahead is not None:  # the INTENT is send 1's write-ahead: the trace shows it
            span.set_attribute("ledgerflow.send_ahead_s", record.ahead.timeout_s)
    token = _WRITTEN.set(rows)
    fresh = _FRESH_INTENT.set(intent.operation_key if wrote else None)
    try:
        result = await body(record.route)
    finally:
        _FRESH_INTENT.reset(fresh)
        _WRITTEN.reset(token)
    return sorted({r.seq: r for r in [*rows, result]}.values(), key=lambda r: r.seq)


# The rows the current executor attempt has written (set by ``routed``, appended to by ``Operation.write``).
_WRITTEN: ContextVar[list[StoredEvent] | None] = ContextVar("ledgerflow_written", default=None)
# The OperationKey whose INTENT the current executor attempt wrote itself (not found on record by a retry):
# only that attempt knows an INTENT written ahead of send 1 did not send yet (``Operation._own_ahead``).
_FRESH_INTENT: ContextVar[str | None] = ContextVar("ledgerflow_fresh_intent", default=None)


def bind(task_id: str, node: str, key: str, epoch: int, route: str | None) -> None:
    """Name this operation on every log line and span of the rest of this activity attempt (runtime.logs),
    and on the attempt's own ``RunActivity`` span (runtime.telemetry)."""
    run_id = activity.info().workflow_run_id if activity.in_activity() else None
    ctx = logs.OperationContext(task_id, node, key, epoch, run_id=run_id, route=route)
    logs.bind(ctx)
    telemetry.annotate(ctx)


def _described(state: OperationState) -> str:
    """How far an operation got, for its ``opened`` log line (no request, no URL)."""
    if state.result is not None:
        return f"already resolved ({_result_name(state.result)})"
    if state.job_id is not None:
        return f"job {state.job_id} on record"
    if state.sends:
        return f"{len(state.sends)} send(s) on record, {len(state.refused)} refused, no job id"
    return "nothing sent yet"


def _result_name(stored: StoredEvent) -> str:
    """``Outcome``, ``Failure(technical)``, ``SystemMarker(void)``, ``ExecutionResult(gate)``…"""
    kind = stored.payload.get("kind")
    return f"{stored.type}({kind})" if kind else stored.type
