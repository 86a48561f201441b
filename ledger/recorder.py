"""The ledger recorder: the two write paths and the reads, each one short transaction on Postgres.

* **Fenced** (``append_fenced``): the workflow's own events. The write locks the task's lease row, checks the
  caller's epoch and takes consecutive seqs, so a superseded run can never write; a stale epoch raises
  ``StaleEpoch`` and nothing is written.
* **Idempotent** (``append_idempotent``): executors, the timeout marker, human decisions. The first write of a
  dedup key wins; a repeat returns the stored event and writes nothing.

Both paths allocate ``seq`` under the lease row lock, so each task's seqs are gapless 1..n in commit order.
Driver errors are translated into ``ledger.errors`` by ``ledger.pgerrors``, around every call.

The other stores join an append's transaction: an append hands its open ``Connection`` to ``ledger.accounts``
(money: a fenced append may ``reserve`` an amount on every budget scope of the task, all of them or nothing;
the idempotent append that records an outcome may ``release`` the reservation and ``spend`` the actual cost,
only if it is the write that inserted the event), to ``ledger.routes`` (a routed INTENT's choice, claim and
quota slot; a result gives its slot back) and to ``ledger.approvals`` (the requests an event opens or closes).
The fencing statement itself reads what they need (the task's scopes, the routes' rows, the project's human
load), under the lease row's lock.

``Recorder`` inherits each store's own methods (``AccountStore``, ``RouteStore``, ``ApprovalStore``: small
mixins that use nothing of the recorder but its ``_engine`` and ``_reader``) rather than delegating to store
objects: each public method is written once, next to its store's statements, and callers keep calling
``recorder.open_budget`` and the like; delegation would repeat every signature and docstring here as a
forwarding method to keep in step.

Lock order, on every path that locks more than one thing: the task's lease row, then its new event rows, then
its budget accounts in ``scope COLLATE "C"`` order (the order of Python's ``sorted``). Each transaction holds
at most one lease row and takes it first, so no cycle of waits can form: see ``ledger.accounts``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from functools import cache
from typing import Any, Final

from sqlalchemy import BigInteger, Engine, Text, bindparam, create_engine, func, select, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ledger import accounts, admission, approvals, migrate, routes, txcount
from ledger.accounts import Account, AccountStore
from ledger.approvals import ApprovalStore
from ledger.errors import AlreadyResolved, DuplicateEvent, LedgerError, RouteWaiting, StaleEpoch, TaskNotFound
from ledger.pgerrors import translated, violated
from ledger.routes import PRUNE_EVERY, RouteState, RouteStore, Routing
from ledger.schema import DEDUP_CONSTRAINT, EVENT_COLUMNS, events, stored_event, task_leases
from rules import scopes
from rules.envelope import NewEvent, StoredEvent
from rules.keys import is_result_key
from rules.pressure import Reading
from rules.routing import BreakerPolicy, RouteHealth

# The stores' types are imported from here too: their callers need not know which store holds them.
__all__ = ["PRUNE_EVERY", "Account", "OperationView", "Recorder", "RouteState", "Routing"]


# Statements are built once so SQLAlchemy's compiled cache is hit on every call, and psycopg prepares them
# server-side after a few executions.

_lease_insert = pg_insert(task_leases).values(
    task_id=bindparam("b_task_id"), epoch=1, holder=bindparam("b_holder")
)
# An upsert: a new task gets epoch 1; an existing one gets epoch + 1. ON CONFLICT DO UPDATE locks the existing
# row, so the bump waits for any in-flight fenced write of the old run and is ordered after it.
_TAKE_LEASE: Final = _lease_insert.on_conflict_do_update(
    index_elements=[task_leases.c.task_id],
    set_={
        "epoch": task_leases.c.epoch + 1,
        "holder": _lease_insert.excluded.holder,
        "renewed_at": func.clock_timestamp(),
    },
).returning(task_leases.c.epoch)

_CURRENT_EPOCH: Final = select(task_leases.c.epoch).where(task_leases.c.task_id == bindparam("b_task_id"))
_LEASE: Final = select(task_leases.c.epoch, task_leases.c.holder).where(
    task_leases.c.task_id == bindparam("b_task_id")
)
# The executor's clock is the database's: every deadline an operation keeps (a submit that may still land, a
# key the vendor may have forgotten) is measured against recorded_at, which this clock wrote.
_EPOCH_AND_NOW: Final = select(task_leases.c.epoch, func.clock_timestamp()).where(
    task_leases.c.task_id == bindparam("b_task_id")
)
# An executor's open (operation_view) on a routed operation: the epoch, the clock and the route's row at once.
_EPOCH_NOW_BREAKER: Final = select(task_leases.c.epoch, func.clock_timestamp(), routes.BREAKER_ROW).where(
    task_leases.c.task_id == bindparam("b_task_id")
)
# The lease row's lock alone (sync_human_queue): every write of the task takes it, so none slips in meanwhile.
_LOCK_LEASE: Final = (
    select(task_leases.c.task_id).where(task_leases.c.task_id == bindparam("b_task_id")).with_for_update()
)

# Lock + fence + seq reservation in one round trip. The UPDATE row lock serializes every writer of this task
# (both paths and take_lease) until commit; if it had to wait for a concurrent take_lease, Postgres re-checks
# the WHERE against the newly committed row, so a superseded epoch matches nothing.
_RESERVE_FENCED: Final = (
    update(task_leases)
    .where(task_leases.c.task_id == bindparam("b_task_id"), task_leases.c.epoch == bindparam("b_epoch"))
    .values(next_seq=task_leases.c.next_seq + bindparam("b_count", type_=BigInteger))
    .returning(task_leases.c.next_seq)
)
# The money variant also returns the task's scopes: same statement, same row lock.
_RESERVE_FENCED_SCOPES: Final = _RESERVE_FENCED.returning(task_leases.c.budget_scopes)


@cache
def _fence_statement(money: bool, load: bool, routed: bool) -> Any:
    """The fencing statement with what this append also needs: the task's scopes (a reservation), its
    project's human load (``pressure``), the routes' rows (``routing``; always last: ``fence[-3:]``)."""
    stmt = _RESERVE_FENCED_SCOPES if money else _RESERVE_FENCED
    extras = ((approvals.HUMAN_LOAD,) if load else ()) + (routes.ROUTED_EXTRAS if routed else ())
    return stmt.returning(*extras) if extras else stmt


# The idempotent path takes the same row lock to allocate its seq (gapless per task); it is not fenced, and
# records the lease's current epoch for information only.
_RESERVE_ONE: Final = (
    update(task_leases)
    .where(task_leases.c.task_id == bindparam("b_task_id"))
    .values(next_seq=task_leases.c.next_seq + 1)
    .returning(task_leases.c.next_seq, task_leases.c.epoch)
)
# Its money variant also returns the task's scopes, as the fenced one does.
_RESERVE_ONE_SCOPES: Final = _RESERVE_ONE.returning(task_leases.c.budget_scopes)
# An idempotent write that is also a fence: an executor's write-ahead marker just before a paid call matches
# only while its run's epoch is current, so a zombie of a fenced-off run writes nothing and sends nothing.
_RESERVE_ONE_FENCED: Final = _RESERVE_ONE_SCOPES.where(task_leases.c.epoch == bindparam("b_epoch"))
# A person's decision also reads its project's human load (rules.pressure), as a dispatch's INTENT does.
_RESERVE_ONE_LOAD: Final = _RESERVE_ONE_SCOPES.returning(approvals.HUMAN_LOAD)

# Plain INSERT: on the fenced path a dedup conflict is an error (DuplicateEvent), never silently skipped.
_INSERT_EVENTS: Final = events.insert().returning(*EVENT_COLUMNS)

# First write wins: a repeat of a dedup key inserts nothing and returns no row. Only the dedup key is a
# tolerated conflict; a (task_id, seq) clash would be a bug and must still raise.
_INSERT_IDEMPOTENT: Final = (
    pg_insert(events).on_conflict_do_nothing(index_elements=[events.c.dedup_key]).returning(*EVENT_COLUMNS)
)

_BY_DEDUP_KEY: Final = select(*EVENT_COLUMNS).where(events.c.dedup_key == bindparam("b_dedup_key"))

# An executor's one read before it acts: the task's current epoch and the result already recorded, if any.
_PREFLIGHT: Final = (
    select(task_leases.c.epoch.label("current_epoch"), *EVENT_COLUMNS)
    .select_from(
        task_leases.outerjoin(
            events,
            (events.c.dedup_key == bindparam("b_dedup_key")) & (events.c.task_id == task_leases.c.task_id),
        )
    )
    .where(task_leases.c.task_id == bindparam("b_task_id"))
)

_EXISTING_DEDUP_KEY: Final = (
    select(events.c.dedup_key).where(events.c.dedup_key.in_(bindparam("b_keys", expanding=True))).limit(1)
)

_READ_EVENTS: Final = (
    select(*EVENT_COLUMNS)
    .where(events.c.task_id == bindparam("b_task_id"), events.c.seq > bindparam("b_after"))
    .order_by(events.c.seq)
)
_READ_EVENTS_LIMITED: Final = _READ_EVENTS.limit(bindparam("b_limit"))

_BY_OPERATION_KEY: Final = (
    select(*EVENT_COLUMNS)
    .where(events.c.operation_key == bindparam("b_operation_key"))
    .order_by(events.c.task_id, events.c.seq)
)

# Outcomes registered for an input hash by tasks of one project (served by ix_events_outcome_input_hash).
_OUTPUTS_BY_HASH: Final = (
    select(*EVENT_COLUMNS)
    .select_from(events.join(task_leases, task_leases.c.task_id == events.c.task_id))
    .where(
        events.c.type == "Outcome",
        events.c.payload["input_hash"].astext == bindparam("b_hash"),
        task_leases.c.budget_scopes.contains(bindparam("b_scope_list", type_=ARRAY(Text))),
    )
    .order_by(events.c.recorded_at.desc())
    .limit(20)
)

_TASK_IDS: Final = select(task_leases.c.task_id).order_by(task_leases.c.created_at, task_leases.c.task_id)


@dataclass(frozen=True, slots=True)
class OperationView:
    """One read of an operation: the task's epoch (None: no such task), the database's clock, its events and,
    if a route was named, why it is paused (None: it is not)."""

    epoch: int | None
    now: datetime | None
    events: list[StoredEvent]
    paused: str | None = None
    breaker: RouteHealth | None = None  # the route's shared row, if it has one


class Recorder(AccountStore, RouteStore, ApprovalStore):
    """The only way into the ledger: appends on two paths, and reads; thread-safe, one transaction per call.

    Args:
        url: A SQLAlchemy URL for ``postgresql+psycopg``.
        pool_size: Connections kept open; as many again may be opened under a burst.
    """

    def __init__(self, url: str, *, pool_size: int = 10) -> None:
        # pre_ping: after a Postgres restart the pooled connections are dead; the ping replaces them on
        # checkout instead of failing the first call on each.
        self._engine = create_engine(url, pool_pre_ping=True, pool_size=pool_size, max_overflow=pool_size)
        txcount.watch(self._engine)  # its transactions counted by kind (the bench's writes per node)
        # Reads are single statements, atomic on their own: AUTOCOMMIT saves the BEGIN and ROLLBACK round
        # trips.
        self._reader = self._engine.execution_options(isolation_level="AUTOCOMMIT")

    @property
    def url(self) -> str:
        """The database URL this recorder writes to (with its credentials: never log it)."""
        return self._engine.url.render_as_string(hide_password=False)

    def create_schema(self) -> None:
        """Create the schema, or upgrade it to this ledgerflow's revision; idempotent, safe to race.

        Runs DDL (``ledger.migrate.upgrade``): only for callers that were asked to (``ledgerflow db upgrade``,
        the embedded stack, tests).

        Raises:
            SchemaMismatch: the database is at a revision this ledgerflow does not know (nothing was changed).
        """
        migrate.upgrade(self._engine)

    def check_schema(self) -> None:
        """Refuse to go on unless the database is at this ledgerflow's schema revision: one read, no DDL.

        What workers and CLI commands call when they start (``create_schema`` is the upgrade, on request).

        Raises:
            SchemaMismatch: no schema yet, an older revision, or a newer one; the message says what to run.
        """
        migrate.check(self._reader)

    @property
    def reader(self) -> Engine:
        """The engine for single-statement reads (AUTOCOMMIT): report queries such as ``ledger.prices``."""
        return self._reader

    def dispose(self) -> None:
        """Close every pooled connection."""
        self._engine.dispose()

    # --- leases ------------------------------------------------------------------------------------------

    def take_lease(self, task_id: str, holder: str) -> int:
        """Make ``holder`` the task's current run and return its new epoch (1 for a new task).

        Every call bumps the epoch, fencing off whichever run held the previous one.
        """
        with translated(), self._engine.begin() as conn:
            epoch: int = conn.execute(_TAKE_LEASE, {"b_task_id": task_id, "b_holder": holder}).scalar_one()
        return epoch

    def current_epoch(self, task_id: str) -> int | None:
        """The task's current epoch, or None if no lease was ever taken on it."""
        with translated(), self._reader.connect() as conn:
            epoch: int | None = conn.execute(_CURRENT_EPOCH, {"b_task_id": task_id}).scalar_one_or_none()
        return epoch

    def run_epoch(self, task_id: str, holder: str) -> tuple[int | None, int | None]:
        """``(the epoch holder took, the task's current epoch)``: the first is None unless ``holder`` (a
        workflow run's id, as ``take_lease`` was given it) is the run holding the task now. For a closing run
        that knows no epoch (``operation.close`` at its task's end): its writes are fenced by that epoch."""
        with translated(), self._reader.connect() as conn:
            row = conn.execute(_LEASE, {"b_task_id": task_id}).first()
        if row is None:
            return None, None
        return (row[0] if row[1] == holder else None), row[0]

    # --- writes ------------------------------------------------------------------------------------------

    def append_fenced(
        self,
        task_id: str,
        epoch: int,
        events: Sequence[NewEvent],
        *,
        reserve: Decimal = Decimal(0),
        unless: str | None = None,
        routing: Routing | None = None,
        human_capacity: int | None = None,
        overdraw: Decimal | None = None,
    ) -> list[StoredEvent]:
        """Append ``events`` atomically with consecutive seqs, if ``epoch`` is still the task's current one.

        With ``routing`` (one event: a dispatch's INTENT) the fencing statement also reads the executor's
        routes, ``rules.routing.choose`` picks one, a probe's or canary's claim is made on its row, and the
        INTENT is written with the choice and the rows it was made on (``route``, ``route_claim``,
        ``route_basis``). RouteWaiting if no route serves now (nothing written). With ``human_capacity``
        (one event: a dispatch's INTENT) the same statement counts the task's project's open human requests,
        and the INTENT records the reading with that capacity (``pressure``, rules.pressure). Events that
        open or close a person's request change ``human_queue`` in this transaction.

        An empty ``events`` still checks the fence. With ``reserve > 0`` the same transaction also reserves
        that amount on every budget scope of the task, if it fits all of them (``ceiling IS NULL OR
        spent + reserved + reserve <= ceiling``); otherwise nothing at all is written. With ``overdraw`` (a
        failed task's compensation) the task's own scope may go that far past its ceiling; the scopes above
        it are checked as always (an undo the project cannot afford asks a person, rules.table R12). With
        ``unless`` the write happens only while no event holds that dedup key, checked under the lease row's
        lock that every write of the task takes (an executor's INTENT is never written after its task began
        closing).

        Raises:
            TaskNotFound: The task has no lease.
            StaleEpoch: A newer run holds the task; nothing was written.
            DuplicateEvent: A dedup key of the batch is already stored (or repeats within the batch);
                nothing was written.
            BudgetRefused: ``reserve`` does not fit a scope (the first short one, in lock order); nothing was
                written.
            AlreadyResolved: an event holds the ``unless`` key; nothing was written.
            InvalidAmount: ``reserve`` is not a valid amount; nothing was written.
            LedgerError: ``reserve > 0`` but the task has no budget accounts (``open_budget`` was not called).
            LedgerUnavailable: The database could not be reached; the write may or may not have committed.
        """
        amount = accounts.as_money("reserve", reserve)
        keys = [e.dedup_key for e in events]
        if len(set(keys)) != len(keys):
            raise DuplicateEvent(next(k for i, k in enumerate(keys) if k in keys[:i]))
        count = len(events)
        if (routing is not None or human_capacity is not None) and count != 1:
            raise LedgerError(f"a routed or load-reading append writes one INTENT, not {count} events")
        with translated():
            try:
                with self._engine.begin() as conn:
                    params: dict[str, Any] = {"b_task_id": task_id, "b_epoch": epoch, "b_count": count}
                    stmt = _fence_statement(bool(amount), human_capacity is not None, routing is not None)
                    if routing is not None:
                        params["b_routes"] = [c.route for c in routing.chain]
                        params["b_intent_key"] = keys[0]
                    fence = conn.execute(stmt, params).first()
                    if fence is None:
                        # Error path only: tell a missing task from a stale epoch.
                        actual = conn.execute(_CURRENT_EPOCH, {"b_task_id": task_id}).scalar_one_or_none()
                        if actual is None:
                            raise TaskNotFound(task_id)
                        raise StaleEpoch(task_id, epoch, actual)
                    if unless is not None and conn.execute(_BY_DEDUP_KEY, {"b_dedup_key": unless}).first():
                        raise AlreadyResolved(unless)  # the transaction rolls back: nothing is written
                    if routing is not None:
                        if fence[-3] is not None:
                            raise DuplicateEvent(keys[0])  # rolls back; the caller takes the INTENT on record
                        events = [routes.routed(conn, routing, events[0], fence[-2], fence[-1])]
                    if human_capacity is not None:
                        reading = Reading(fence._mapping["human_load"], human_capacity)
                        payload = {**events[0].payload, "pressure": reading.as_payload()}
                        events = [events[0].model_copy(update={"payload": payload})]
                    first = fence[0] - count
                    rows = (
                        conn.execute(
                            _INSERT_EVENTS,
                            [_params(task_id, first + i, epoch, e) for i, e in enumerate(events)],
                        ).all()
                        if events
                        else []
                    )
                    if amount:
                        accounts.reserve(conn, task_id, fence[1], amount, task_overdraw=overdraw)
                        if routing is not None and routing.caps:  # the route's month, locked last
                            route = events[0].payload["route"]
                            accounts.hold_route(conn, routing.key, routing.caps, route, fence[-1], amount)
                    approvals.track_queue(conn, task_id, events)
            except sa_exc.IntegrityError as e:
                if violated(e) != DEDUP_CONSTRAINT:
                    raise
                raise DuplicateEvent(self._existing_key(keys)) from e
            except routes.QueueFull as full:
                routes.wait_in_line(self._engine, full.waiter)
                raise RouteWaiting(full.executor, full.reason, full.retry_s) from None
        # executemany with RETURNING does not promise row order; seq does.
        return sorted((stored_event(r) for r in rows), key=lambda s: s.seq)

    def append_idempotent(
        self,
        task_id: str,
        event: NewEvent,
        *,
        release: Decimal = Decimal(0),
        spend: Decimal = Decimal(0),
        raise_ceiling: tuple[str, Decimal] | None = None,
        fence_epoch: int | None = None,
        unless: str | None = None,
        human_capacity: int | None = None,
        observed_ok: tuple[str, BreakerPolicy] | None = None,
    ) -> tuple[StoredEvent, bool]:
        """Append ``event`` unless its dedup key is already stored: the first write wins.

        With ``fence_epoch`` the write is also a fence: it happens only while that epoch is the task's
        current one (StaleEpoch otherwise), in the same statement that takes the lease row's lock. With
        ``unless`` it happens only while no event holds that dedup key (AlreadyResolved otherwise): checked
        under the same lock, which every write of the task takes, so no write of that key can slip between.

        If this call inserts the event, the same transaction settles on every budget scope of the task:
        ``reserved -= release`` and ``spent += spend``; actual spend is recorded as it is, even past the
        ceiling. A repeat settles nothing, so each settlement happens exactly once. Likewise
        ``raise_ceiling=(scope, amount)`` (a person's AddBudget) adds ``amount`` to the ceiling of ``scope``,
        one of the task's own scopes, only if this call inserts the event (an unlimited scope stays
        unlimited); the accounts are locked in the same order as for a settlement. With ``human_capacity``
        (a person's decision, not fenced) the same statement counts the project's open human requests and the
        event records the reading (``pressure``, rules.pressure): the work a decision unblocks is decided on
        a reading as fresh as the decision. With ``observed_ok=(route, policy)`` (an operation's result that
        shows its route answered well) the route's ``ok`` observation is recorded in the same transaction, if
        this call inserts the event (``ledger.routes.observe_ok``).

        Returns:
            ``(stored, True)`` if this call wrote it, ``(existing, False)`` if the dedup key was already there
            (then nothing was written and no seq was used).

        Raises:
            TaskNotFound: The task has no lease.
            DuplicateEvent: The dedup key belongs to an event of another task: a key-construction bug, since
                returning another task's fact as if it were this one's would hide it.
            InvalidAmount: ``release``, ``spend`` or the raise is not a valid amount; nothing was written.
            LedgerError: ``release`` exceeds a scope's reservation, there is something to settle but the
                task has no budget accounts, or the raised scope is not one of the task's: caller bugs;
                nothing was written.
            StaleEpoch: ``fence_epoch`` is given and is not the task's current epoch; nothing was written.
            LedgerUnavailable: The database could not be reached; the write may or may not have committed.
        """
        to_release, to_spend = accounts.as_money("release", release), accounts.as_money("spend", spend)
        settle = bool(to_release or to_spend)
        raised = None
        if raise_ceiling is not None:
            raised = (raise_ceiling[0], accounts.as_money("raise", raise_ceiling[1]))
        with translated(), self._engine.connect() as conn:
            if fence_epoch is not None:
                params = {"b_task_id": task_id, "b_epoch": fence_epoch}
                reserved = conn.execute(_RESERVE_ONE_FENCED, params).first()
            elif human_capacity is not None:
                reserved = conn.execute(_RESERVE_ONE_LOAD, {"b_task_id": task_id}).first()
                if reserved is not None:
                    reading = Reading(reserved._mapping["human_load"], human_capacity)
                    event = event.model_copy(
                        update={"payload": {**event.payload, "pressure": reading.as_payload()}}
                    )
            else:
                reserved = conn.execute(
                    _RESERVE_ONE_SCOPES if settle or raised else _RESERVE_ONE, {"b_task_id": task_id}
                ).first()
            if reserved is None:
                actual = conn.execute(_CURRENT_EPOCH, {"b_task_id": task_id}).scalar_one_or_none()
                conn.rollback()
                if actual is None:
                    raise TaskNotFound(task_id)
                assert fence_epoch is not None
                raise StaleEpoch(task_id, fence_epoch, actual)
            next_seq, epoch = reserved[0], reserved[1]
            if unless is not None and conn.execute(_BY_DEDUP_KEY, {"b_dedup_key": unless}).first():
                conn.rollback()
                raise AlreadyResolved(unless)
            inserted = conn.execute(_INSERT_IDEMPOTENT, _params(task_id, next_seq - 1, epoch, event)).first()
            if inserted is not None:
                # An error below leaves the transaction uncommitted: closing the connection rolls it back.
                if event.operation_key is not None and is_result_key(event.dedup_key):
                    # The operation's one result gives back its route slot (if it held one), in this write.
                    routes.free_slot(conn, event.operation_key)
                approvals.track_queue(conn, task_id, [event])
                if settle:
                    accounts.settle(conn, task_id, reserved[2], to_release, to_spend)
                if raised is not None:
                    accounts.raise_on(conn, task_id, reserved[2], *raised, locked=settle)
                if event.operation_key is not None:
                    # Its route-month hold (a capped route), after the task's accounts: locked last.
                    result = is_result_key(event.dedup_key)
                    accounts.settle_route(conn, event.operation_key, to_spend, result=result)
                    if observed_ok is not None:
                        routes.observe_ok(conn, observed_ok[0], event.operation_key, observed_ok[1])
                conn.commit()
                return stored_event(inserted), True
            # The key exists (ON CONFLICT waited for its writer to commit, so this new snapshot sees it).
            existing = conn.execute(_BY_DEDUP_KEY, {"b_dedup_key": event.dedup_key}).first()
            # Give back the reserved seq: the task's seqs stay gapless.
            conn.rollback()
        if existing is None:
            raise LedgerError(f"dedup key {event.dedup_key!r} conflicted but no event holds it")
        stored = stored_event(existing)
        if stored.task_id != task_id:
            raise DuplicateEvent(event.dedup_key)
        return stored, False

    def admit(
        self, task_id: str, queue: str, rank: int, capacity: int, *, enter: bool
    ) -> admission.Admission:
        """Ask for the task's admission to run its work (ledger.admission): its place in ``queue``, and the
        other tasks this admitted."""
        with translated(), self._engine.begin() as conn:
            return admission.admit(conn, task_id, queue, rank, capacity, enter=enter)

    def release_admission(self, task_id: str, queue: str, capacity: int) -> tuple[str, ...]:
        """The task ended: it leaves its admission queue; returns the tasks admitted in its place."""
        with translated(), self._engine.begin() as conn:
            return admission.release(conn, task_id, queue, capacity)

    def sync_human_queue(self, task_id: str) -> int:
        """Make the task's rows of ``human_queue`` what its ledger says — its open requests, none once it
        ended — and return how many rows that changed. For a database upgraded to revision 0004 with requests
        already open, and as a repair. Runs under the task's lease row lock, which every write of the task
        takes, so no request opens or closes between the read and the rewrite."""
        with translated(), self._engine.begin() as conn:
            if conn.execute(_LOCK_LEASE, {"b_task_id": task_id}).first() is None:
                raise TaskNotFound(task_id)
            rows = conn.execute(_READ_EVENTS, {"b_task_id": task_id, "b_after": 0})
            return approvals.resync_queue(conn, task_id, [stored_event(r) for r in rows])

    # --- reads -------------------------------------------------------------------------------------------

    def read_events(self, task_id: str, after_seq: int = 0, limit: int | None = None) -> list[StoredEvent]:
        """The task's events with ``seq > after_seq``, in seq order, at most ``limit`` of them."""
        params: dict[str, Any] = {"b_task_id": task_id, "b_after": after_seq}
        stmt = _READ_EVENTS
        if limit is not None:
            stmt, params["b_limit"] = _READ_EVENTS_LIMITED, limit
        with translated(), self._reader.connect() as conn:
            rows = conn.execute(stmt, params).all()
        return [stored_event(r) for r in rows]

    def find_by_dedup_key(self, dedup_key: str) -> StoredEvent | None:
        """The event stored under ``dedup_key``, if any."""
        with translated(), self._reader.connect() as conn:
            row = conn.execute(_BY_DEDUP_KEY, {"b_dedup_key": dedup_key}).first()
        return None if row is None else stored_event(row)

    def preflight(self, task_id: str, dedup_key: str) -> tuple[int | None, StoredEvent | None]:
        """One round trip for an executor: (current epoch, the event under ``dedup_key`` if any)."""
        with translated(), self._reader.connect() as conn:
            row = conn.execute(_PREFLIGHT, {"b_task_id": task_id, "b_dedup_key": dedup_key}).first()
        if row is None:
            return None, None
        epoch: int = row[0]
        return epoch, None if row.seq is None else stored_event(row[1:])

    def operation_view(self, task_id: str, operation_key: str, route: str | None = None) -> OperationView:
        """What an executor reads before it acts, on one connection: the task's current epoch, the database's
        clock, every event of the operation, whether the route it is about to call is paused, and the route's
        shared breaker row (one statement with the epoch)."""
        with translated(), self._reader.connect() as conn:
            head: Any = (
                conn.execute(_EPOCH_AND_NOW, {"b_task_id": task_id}).first()
                if route is None
                else conn.execute(_EPOCH_NOW_BREAKER, {"b_task_id": task_id, "b_route": route}).first()
            )
            rows = conn.execute(_BY_OPERATION_KEY, {"b_operation_key": operation_key}).all()
            state = None if route is None else conn.execute(routes.ROUTE_STATE, {"b_route": route}).first()
        epoch, now = (head[0], head[1]) if head is not None else (None, None)
        paused = state[1] or "paused" if state is not None and state[0] == "paused" else None
        breaker = None
        if route is not None and head is not None and head[2]:
            breaker = routes.health(route, head[2])
        return OperationView(
            epoch, now, [stored_event(r) for r in rows if r.task_id == task_id], paused, breaker
        )

    def events_by_operation_key(self, operation_key: str) -> list[StoredEvent]:
        """Every event carrying ``operation_key``, ordered by task and seq."""
        with translated(), self._reader.connect() as conn:
            rows = conn.execute(_BY_OPERATION_KEY, {"b_operation_key": operation_key}).all()
        return [stored_event(r) for r in rows]

    def outputs_by_input_hash(self, input_hash: str, project: str) -> list[StoredEvent]:
        """Outcomes registered for ``input_hash`` by any task of ``project``, newest first (at most 20)."""
        params = {"b_hash": input_hash, "b_scope_list": [scopes.project(project)]}
        with translated(), self._reader.connect() as conn:
            rows = conn.execute(_OUTPUTS_BY_HASH, params).all()
        return [stored_event(r) for r in rows]

    def task_ids(self) -> list[str]:
        """Every task that ever had a lease, oldest first."""
        with translated(), self._reader.connect() as conn:
            return list(conn.execute(_TASK_IDS).scalars())

    def _existing_key(self, keys: list[str]) -> str:
        """Which of ``keys`` is already stored (after a dedup conflict; the error names no key in a field)."""
        if len(keys) == 1:
            return keys[0]
        with self._reader.connect() as conn:
            found: str | None = conn.execute(_EXISTING_DEDUP_KEY, {"b_keys": keys}).scalar_one_or_none()
        return found if found is not None else keys[0]


def _params(task_id: str, seq: int, epoch: int, event: NewEvent) -> dict[str, Any]:
    # recorded_at is left out on purpose: its column default takes the server's clock_timestamp().
    return {
        "task_id": task_id,
        "seq": seq,
        "type": event.type,
        "schema_version": event.schema_version,
        "epoch": epoch,
        "dedup_key": event.dedup_key,
        "operation_key": event.operation_key,
        "payload": event.payload,
    }
