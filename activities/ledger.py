"""Ledger access for the workflow, run as local activities (no server round trip per call).

Two write paths, never merged (docs/design.md#two-write-paths): ``append`` is fenced by the run's epoch (a
stale run's writes are refused); ``mark`` is idempotent (first write wins) and serves the timer's timeout
markers and failures of executors that died. Every call returns the events after the caller's watermark, so
one local activity both writes and reads.
"""

from __future__ import annotations

import threading
import time
from decimal import Decimal

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.boundary import cross
from activities.contracts import (
    Activity,
    AdmitInput,
    AdmitResult,
    AppendInput,
    ErrorType,
    MarkInput,
    OpenTaskInput,
    OpenTaskResult,
    ReadInput,
)
from ledger.errors import BudgetRefused, DuplicateEvent, StaleEpoch
from ledger.prices import learned_prices
from ledger.recorder import Recorder
from rules.envelope import StoredEvent
from rules.events import TaskCreated, to_new
from rules.keys import created_key
from rules.plan import Plan, PlanError, Routes, budget_scopes, validate_plan
from rules.pricing import PriceBook, RoutePrice, price_book
from runtime.faults import mark
from vendors.routes import RouteTable


class LedgerActivities:
    """Holds the recorder; each method is one short transaction (plus a read)."""

    def __init__(
        self,
        recorder: Recorder,
        table: RouteTable | None = None,
        *,
        price_history: int = 0,
        price_cache_s: float = 60.0,
        notify_projects: frozenset[str] = frozenset(),
        active_tasks: int = 0,
    ) -> None:
        self.recorder = recorder
        # Tasks of one task queue that run their work at once (ledger.admission; settings.active_tasks). 0: no
        # bound, and a new task never enters the queue.
        self.active_tasks = active_tasks
        # This deployment's routes: a new task's plan is validated against them (None: not validated), and
        # their declared prices go into its price book (rules.pricing).
        self.table = table
        self.routes: Routes | None = table.names() if table is not None else None
        self.price_history = price_history  # results per route a learned price reads (0: none)
        self.price_cache_s = price_cache_s  # how long a worker reuses what the ledger taught
        # The projects whose people are told of their requests ("*": every one): settings.notify_webhooks.
        self.notify_projects = notify_projects
        self._learned: tuple[float, frozenset[str], dict[str, tuple[Decimal, int]]] | None = None
        self._learned_lock = threading.Lock()

    @activity.defn(name=Activity.OPEN_TASK)
    def open_task(self, inp: OpenTaskInput) -> OpenTaskResult:
        """Take the task's fencing epoch (+1), write TaskCreated if absent, return the history (its first
        ``limit`` events, if given: the caller reads the rest in pages).

        A new task's plan is validated first, exactly as ``ledgerflow submit`` validates it (graph, data,
        routes, budget): a workflow started by any client with an invalid plan fails at once, with the
        problem named, and nothing is written."""
        if self.routes is not None and self.recorder.current_epoch(inp.task_id) is None:
            try:
                validate_plan(inp.plan.model_dump(mode="json", exclude_unset=True), self.routes)
            except PlanError as e:
                # PlanError names the part at fault ("stage 'a': …", "plan: …"): say "plan" once.
                problem = str(e).removeprefix("plan: ")
                raise ApplicationError(
                    f"invalid plan: {problem}", type=ErrorType.PLAN_INVALID, non_retryable=True
                ) from None
            except Exception as e:  # serialising or reading it failed: RecursionError, ValueError, …
                # Nothing is written yet and a retry reads the same plan: never retried (a ledger outage is
                # raised by current_epoch above, or by the lease below, and stays retryable).
                lines = str(e).strip().splitlines() or [""]
                raise ApplicationError(
                    f"invalid plan: cannot be read ({type(e).__name__}: {lines[0][:160]})",
                    type=ErrorType.PLAN_INVALID,
                    non_retryable=True,
                ) from None
        epoch = self.recorder.take_lease(inp.task_id, inp.holder)
        self.recorder.open_budget(inp.task_id, budget_scopes(inp.plan, inp.task_id))
        events = self.recorder.read_events(inp.task_id, limit=None if inp.limit is None else inp.limit + 1)
        fresh = not any(e.type == "Intent" for e in events)  # no work asked for yet
        admission = AdmitResult()
        if inp.queue and (self.active_tasks > 0 or not fresh):
            # A new task enters the queue; a later run of one that entered finds its place (and is woken
            # with the rest if the bound was lifted). A fresh task with no bound asks nothing.
            admission = self._admit(inp.task_id, inp.queue, inp.rank, enter=fresh)
        if not events:
            created = to_new(
                TaskCreated(plan=inp.plan, prices=self._price_book(inp.plan)),
                dedup_key=created_key(inp.task_id),
            )
            try:
                self.recorder.append_fenced(inp.task_id, epoch, [created])
            except StaleEpoch as e:
                cross(e)
            except DuplicateEvent:
                pass  # a concurrent opener wrote it first; the read below returns it
            events = self.recorder.read_events(inp.task_id)
        notify = inp.plan.project in self.notify_projects or "*" in self.notify_projects
        if inp.limit is not None and len(events) > inp.limit:
            return OpenTaskResult(
                epoch=epoch, events=events[: inp.limit], complete=False, notify=notify, admission=admission
            )
        return OpenTaskResult(epoch=epoch, events=events, notify=notify, admission=admission)

    @activity.defn(name=Activity.ADMIT)
    def admit(self, inp: AdmitInput) -> AdmitResult:
        """A waiting task asks again: its place now, and the tasks admitted meanwhile (the caller wakes
        them)."""
        return self._admit(inp.task_id, inp.queue, 0, enter=False)  # no rank: it does not enter

    @activity.defn(name=Activity.RELEASE)
    def release(self, inp: AdmitInput) -> AdmitResult:
        """The task ended: it leaves its queue; the tasks admitted in its place are returned, to be woken."""
        return AdmitResult(
            woken=list(self.recorder.release_admission(inp.task_id, inp.queue, self.active_tasks))
        )

    def _admit(self, task_id: str, queue: str, rank: int, *, enter: bool) -> AdmitResult:
        place = self.recorder.admit(task_id, queue, rank, self.active_tasks, enter=enter)
        return AdmitResult.model_validate(place, from_attributes=True)  # ledger.admission.Admission

    def _price_book(self, plan: Plan) -> PriceBook:
        """What each stage's routes say a node costs, now: their declared bounds (the route table) and learned
        ratios (the ledger's last results on them). Recorded in TaskCreated; every admission reads it."""
        chains: dict[str, tuple[RoutePrice, ...]] = {}
        for stage in plan.stages:
            if self.table is not None and stage.executor in self.table.routes:
                chains[stage.executor] = self.table.prices(stage.executor)
            else:  # a route this worker does not know: what the ledger learned under the executor's name
                chains[stage.executor] = (RoutePrice(route=stage.executor),)
        names = frozenset(r.route for chain in chains.values() for r in chain)
        return price_book(plan, chains, self._learned_ratios(names))

    def _learned_ratios(self, routes: frozenset[str]) -> dict[str, tuple[Decimal, int]]:
        """route -> (p95 of actual ÷ estimate, results counted), read at most once per ``price_cache_s`` for
        the same routes: a burst of new tasks reads the ledger once (the figure is recorded per task)."""
        if self.price_history == 0:
            return {}
        now = time.monotonic()
        with self._learned_lock:
            cached = self._learned
            if cached is not None and now - cached[0] < self.price_cache_s and routes <= cached[1]:
                return cached[2]
        learned = learned_prices(self.recorder.reader, routes, last=self.price_history)
        ratios = {r: (lp.ratio_p95, lp.results) for r, lp in learned.items()}
        with self._learned_lock:
            self._learned = (now, routes, ratios)
        return ratios

    @activity.defn(name=Activity.APPEND)
    def append(self, inp: AppendInput) -> list[StoredEvent]:
        """Fenced append of the run's own events (an INTENT and its immediate effect)."""
        try:
            self.recorder.append_fenced(
                inp.task_id,
                inp.epoch,
                inp.events,
                reserve=inp.reserve,
                overdraw=inp.overdraw_cap if inp.overdraw else None,
            )
            mark("intent_recorded", task=inp.task_id, op=inp.events[0].operation_key or "")
        except (StaleEpoch, BudgetRefused) as e:
            # Not errors of the ledger: the loop stops (another run holds the task), or records an escalation
            # naming the scope that is short (the boundary carries it in the error's details).
            cross(e)
        except DuplicateEvent as e:
            if not self._already_written(inp, e.dedup_key):
                cross(e)
            # This run wrote an INTENT under this key before its worker died; the local activity's result died
            # with it, so the replayed workflow decided again (at a later workflow time). The ledger's INTENT
            # is the decision: the caller finds it among the events returned and acts on that one.
        return self.recorder.read_events(inp.task_id, after_seq=inp.after)

    def _already_written(self, inp: AppendInput, dedup_key: str) -> bool:
        """Whether the key that collided is this run's own INTENT, written before its worker died."""
        first = inp.events[0]
        existing = self.recorder.find_by_dedup_key(dedup_key)
        return (
            existing is not None
            and dedup_key == first.dedup_key
            and existing.task_id == inp.task_id
            and existing.epoch == inp.epoch
            and existing.type == first.type
        )

    @activity.defn(name=Activity.MARK)
    def mark(self, inp: MarkInput) -> list[StoredEvent]:
        """Idempotent append (first write wins), then read what is new."""
        self.recorder.append_idempotent(inp.task_id, inp.event, release=inp.release, spend=inp.spend)
        return self.recorder.read_events(inp.task_id, after_seq=inp.after)

    @activity.defn(name=Activity.READ)
    def read(self, inp: ReadInput) -> list[StoredEvent]:
        return self.recorder.read_events(inp.task_id, after_seq=inp.after, limit=inp.limit)
