"""The ledger recorder: the two write paths and the reads, each one short transaction on Postgres.

* **Fenced** (``append_fenced``): the workflow's own events. The write locks the task's lease row, checks the
  caller's epoch and takes consecutive seqs, so a superseded run can never write; a stale epoch raises
  ``StaleEpoch`` and nothing is written.
* **Idempotent** (``append_idempotent``): executors, the timeout marker, human decisions. The first write of a
  dedup key wins; a repeat returns the stored event and writes nothing.

Both paths allocate ``seq`` under the lease row lock, so each task's seqs are gapless 1..n in commit order.
Driver errors are translated into ``ledger.errors`` here, once, and nowhere else.

Money rides on the same two paths: a fenced append may ``reserve`` an amount on every budget scope of the task
(all of them or nothing, in the INTENT's transaction), and the idempotent append that records an outcome may
``release`` the reservation and ``spend`` the actual cost (only if it is the write that inserted the event).

Lock order, on every path that locks more than one thing: the task's lease row, then its new event rows, then
its budget accounts in ``scope COLLATE "C"`` order (the order of Python's ``sorted``). Each transaction holds
at most one lease row and takes it first, so no cycle of waits can form: see ``_LOCK_ACCOUNTS``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from functools import cache
from typing import Any, Final

from sqlalchemy import (
    BigInteger,
    Connection,
    Numeric,
    Text,
    any_,
    bindparam,
    create_engine,
    delete,
    func,
    select,
    text,
    update,
)
from sqlalchemy import Engine as sa_Engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects.postgresql import ARRAY, distinct_on
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ledger.errors import (
    AlreadyResolved,
    BudgetRefused,
    DuplicateEvent,
    InvalidAmount,
    LedgerError,
    LedgerUnavailable,
    RouteContended,
    RouteWaiting,
    StaleEpoch,
    TaskNotFound,
)
from ledger.schema import (
    APPROVER_KEY_CONSTRAINT,
    DEDUP_CONSTRAINT,
    approver_keys,
    budget_accounts,
    create_schema,
    events,
    human_queue,
    route_breakers,
    route_changes,
    route_events,
    route_observations,
    route_slots,
    route_waiters,
    task_leases,
)
from rules.approvers import KeyRecord, registry
from rules.envelope import NewEvent, StoredEvent
from rules.keys import is_result_key, key_fraction
from rules.money import MONEY_SCALE, parse_amount
from rules.pressure import Reading, queue_changes
from rules.projection import fold
from rules.routing import (
    FAILURES,
    BreakerPolicy,
    BreakerState,
    Candidate,
    Health,
    Observation,
    Waiter,
    Window,
    choose,
    claimed,
    grant,
    observed,
)

_EVENT_COLUMNS: Final = (
    events.c.task_id,
    events.c.seq,
    events.c.type,
    events.c.schema_version,
    events.c.epoch,
    events.c.dedup_key,
    events.c.operation_key,
    events.c.payload,
    events.c.recorded_at,
)

_EVENT_FIELDS: Final = tuple(c.name for c in _EVENT_COLUMNS)

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
# The executor's clock is the database's: every deadline an operation keeps (a submit that may still land, a
# key the vendor may have forgotten) is measured against recorded_at, which this clock wrote.
_EPOCH_AND_NOW: Final = select(task_leases.c.epoch, func.clock_timestamp()).where(
    task_leases.c.task_id == bindparam("b_task_id")
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

# The idempotent path takes the same row lock to allocate its seq (gapless per task); it is not fenced, and
# records the lease's current epoch for information only.
_RESERVE_ONE: Final = (
    update(task_leases)
    .where(task_leases.c.task_id == bindparam("b_task_id"))
    .values(next_seq=task_leases.c.next_seq + 1)
    .returning(task_leases.c.next_seq, task_leases.c.epoch)
)

# Plain INSERT: on the fenced path a dedup conflict is an error (DuplicateEvent), never silently skipped.
_INSERT_EVENTS: Final = events.insert().returning(*_EVENT_COLUMNS)

# First write wins: a repeat of a dedup key inserts nothing and returns no row. Only the dedup key is a
# tolerated conflict; a (task_id, seq) clash would be a bug and must still raise.
_INSERT_IDEMPOTENT: Final = (
    pg_insert(events).on_conflict_do_nothing(index_elements=[events.c.dedup_key]).returning(*_EVENT_COLUMNS)
)

_BY_DEDUP_KEY: Final = select(*_EVENT_COLUMNS).where(events.c.dedup_key == bindparam("b_dedup_key"))

# An executor's one read before it acts: the task's current epoch and the result already recorded, if any.
_PREFLIGHT: Final = (
    select(task_leases.c.epoch.label("current_epoch"), *_EVENT_COLUMNS)
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
    select(*_EVENT_COLUMNS)
    .where(events.c.task_id == bindparam("b_task_id"), events.c.seq > bindparam("b_after"))
    .order_by(events.c.seq)
)
_READ_EVENTS_LIMITED: Final = _READ_EVENTS.limit(bindparam("b_limit"))

_BY_OPERATION_KEY: Final = (
    select(*_EVENT_COLUMNS)
    .where(events.c.operation_key == bindparam("b_operation_key"))
    .order_by(events.c.task_id, events.c.seq)
)

# Outcomes registered for an input hash by tasks of one project (served by ix_events_outcome_input_hash).
_OUTPUTS_BY_HASH: Final = (
    select(*_EVENT_COLUMNS)
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

# --- routes ------------------------------------------------------------------------------------------------

_ROUTE_STATE: Final = (
    select(route_events.c.kind, route_events.c.reason, route_events.c.actor, route_events.c.recorded_at)
    .where(route_events.c.route == bindparam("b_route"))
    .order_by(route_events.c.id.desc())
    .limit(1)
)
_ROUTE_STATES: Final = (
    select(
        route_events.c.route,
        route_events.c.kind,
        route_events.c.reason,
        route_events.c.actor,
        route_events.c.recorded_at,
    )
    .ext(distinct_on(route_events.c.route))
    .order_by(route_events.c.route, route_events.c.id.desc())
)
# One event per change of state: many workers meeting the same rotated key record one pause, not hundreds.
# The advisory lock serialises the check and the insert for one route: two pausers never both insert.
_ROUTE_LOCK: Final = text("SELECT pg_advisory_xact_lock(hashtext('route:' || :route))")

# --- money -------------------------------------------------------------------------------------------------


_SCOPES: Final = ARRAY(Text)
_MONEY: Final = Numeric(20, MONEY_SCALE, asdecimal=True)

# The money variants of the two seq reservations also return the task's scopes: same statement, same row lock.
_RESERVE_FENCED_SCOPES: Final = (
    update(task_leases)
    .where(task_leases.c.task_id == bindparam("b_task_id"), task_leases.c.epoch == bindparam("b_epoch"))
    .values(next_seq=task_leases.c.next_seq + bindparam("b_count", type_=BigInteger))
    .returning(task_leases.c.next_seq, task_leases.c.budget_scopes)
)
# A routed dispatch's INTENT (rules.routing) reads every route of its executor in the same statement that
# fences it: the rows as JSON, and the database's clock the choice is made at.
_rb = route_breakers.alias("rb")
_BREAKERS_OF: Final = (
    select(func.coalesce(func.json_agg(func.row_to_json(_rb.table_valued())), text("'[]'::json")))
    .where(_rb.c.route == any_(bindparam("b_routes", type_=ARRAY(Text))))
    .scalar_subquery()
)
# … and whether the INTENT is already written (a retry of its executor): then nothing is chosen, claimed or
# queued again — a retry must not count its own quota slot, nor claim a canary it cannot keep.
_WRITTEN_ALREADY: Final = (
    select(events.c.seq).where(events.c.dedup_key == bindparam("b_intent_key")).scalar_subquery()
)
_ROUTED_EXTRAS: Final = (_WRITTEN_ALREADY, _BREAKERS_OF, func.clock_timestamp())
# A dispatch's INTENT also reads its project's open human requests (rules.pressure): one more scalar
# subquery, correlated to the lease row being fenced (its first budget scope is the project's, like the rows).
_HUMAN_LOAD: Final = (
    select(func.count())
    .select_from(human_queue)
    .where(human_queue.c.scope == task_leases.c.budget_scopes[1])
    .correlate(task_leases)
    .scalar_subquery()
    .label("human_load")
)


@cache
def _fence_statement(scopes: bool, load: bool, routed: bool) -> Any:
    """The fencing statement with what this append also needs: the task's scopes (a reservation), its
    project's human load (``pressure``), the routes' rows (``routing``; always last: ``fence[-3:]``)."""
    stmt = _RESERVE_FENCED_SCOPES if scopes else _RESERVE_FENCED
    extras = ((_HUMAN_LOAD,) if load else ()) + (_ROUTED_EXTRAS if routed else ())
    return stmt.returning(*extras) if extras else stmt


# Closing requests in the shared queue (rules.pressure.queue_changes), in the event's own transaction.
_QUEUE_CLOSE_ALL: Final = delete(human_queue).where(human_queue.c.task_id == bindparam("b_task_id"))
_QUEUE_CLOSE: Final = delete(human_queue).where(
    human_queue.c.task_id == bindparam("b_task_id"),
    human_queue.c.request_id == any_(bindparam("b_requests", type_=ARRAY(Text))),
)
# An open request's row names the task's project scope (the first of its budget scopes).
_QUEUE_OPEN: Final = text(
    "INSERT INTO human_queue (task_id, request_id, kind, scope)"
    " SELECT task_id, :b_request, :b_kind, coalesce(budget_scopes[1], '') FROM task_leases"
    " WHERE task_id = :b_task_id ON CONFLICT DO NOTHING"
)
_BREAKER_ROW: Final = (
    select(func.row_to_json(_rb.table_valued())).where(_rb.c.route == bindparam("b_route")).scalar_subquery()
)
# An executor's open (operation_view) on a routed operation: the epoch, the clock and the route's row at once.
_EPOCH_NOW_BREAKER: Final = select(task_leases.c.epoch, func.clock_timestamp(), _BREAKER_ROW).where(
    task_leases.c.task_id == bindparam("b_task_id")
)
# An observation, and in the same statement the route's row and the clock (most need nothing more).
_OBSERVE: Final = (
    route_observations.insert()
    .values(route=bindparam("b_route"), kind=bindparam("b_kind"), operation_key=bindparam("b_key"))
    .returning(_BREAKER_ROW, func.clock_timestamp(), route_observations.c.id)
)
# Observations older than any window of the route are never read again: every PRUNE_EVERY-th insert deletes
# the route's rows older than twice its widest window (at least RETAIN_OBSERVATIONS), by the route's index.
PRUNE_EVERY: Final = 500
RETAIN_OBSERVATIONS: Final = timedelta(hours=1)
_PRUNE_OBSERVATIONS: Final = delete(route_observations).where(
    route_observations.c.route == bindparam("b_route"),
    route_observations.c.recorded_at < bindparam("b_before"),
)
_WINDOW: Final = text(
    "SELECT"
    " count(*) FILTER (WHERE kind IN ('ok', 'error', 'timeout', 'anomaly') AND recorded_at > :now - :calls),"
    " count(*) FILTER (WHERE kind IN ('error', 'timeout', 'anomaly') AND recorded_at > :now - :calls),"
    " count(*) FILTER (WHERE kind IN ('review_pass', 'review_fail')),"
    " count(*) FILTER (WHERE kind = 'review_pass')"
    " FROM route_observations WHERE route = :route AND recorded_at > :now - :widest"
)
_FREE_SLOT: Final = delete(route_slots).where(route_slots.c.operation_key == bindparam("b_key"))
_HEALTH_COLUMNS: Final = (
    "state",
    "since",
    "opened_at",
    "reason",
    "probe_key",
    "canary_key",
    "canary_outage",
    "canary_passed",
    "qualified_at",
    "version",
)

_RESERVE_ONE_SCOPES: Final = (
    update(task_leases)
    .where(task_leases.c.task_id == bindparam("b_task_id"))
    .values(next_seq=task_leases.c.next_seq + 1)
    .returning(task_leases.c.next_seq, task_leases.c.epoch, task_leases.c.budget_scopes)
)
# An idempotent write that is also a fence: an executor's write-ahead marker just before a paid call matches
# only while its run's epoch is current, so a zombie of a fenced-off run writes nothing and sends nothing.
_RESERVE_ONE_FENCED: Final = _RESERVE_ONE_SCOPES.where(task_leases.c.epoch == bindparam("b_epoch"))
# A person's decision also reads its project's human load (rules.pressure), as a dispatch's INTENT does.
_RESERVE_ONE_LOAD: Final = _RESERVE_ONE_SCOPES.returning(_HUMAN_LOAD)

_ACCOUNT_COLUMNS: Final = (
    budget_accounts.c.scope,
    budget_accounts.c.ceiling,
    budget_accounts.c.reserved,
    budget_accounts.c.spent,
    budget_accounts.c.updated_at,
)
# COLLATE "C": byte order, the same on every database and equal to Python's sorted() over str, so the lock
# order below and the insert order in open_budget agree whatever the database's default collation is.
_BY_SCOPE: Final = budget_accounts.c.scope.collate("C")

# The task's accounts, locked in one fixed global order. Deadlock-free: a transaction that locks accounts has
# first locked its own task's lease row (that one only) and inserted its events, and locks accounts last,
# always ascending. One waiting for a lease row holds nothing yet; one waiting for an event row (a dedup key
# being inserted elsewhere) holds no account; one waiting for an account waits only for a scope above every
# scope it holds. So no cycle of waits can close. FOR UPDATE under READ COMMITTED returns each row's newest
# committed version once its lock is granted, so the figures checked are the ones the UPDATE then changes.
# (LockRows runs above the Sort, so the rows are locked in this order.)
_LOCK_ACCOUNTS: Final = (
    select(*_ACCOUNT_COLUMNS)
    .where(budget_accounts.c.scope == any_(bindparam("b_scopes", type_=_SCOPES)))
    .order_by(_BY_SCOPE)
    .with_for_update()
)

# Applied to rows already locked by _LOCK_ACCOUNTS in the same transaction: no new waits, no re-check.
_ADD_RESERVED: Final = (
    update(budget_accounts)
    .where(budget_accounts.c.scope == any_(bindparam("b_scopes", type_=_SCOPES)))
    .values(
        reserved=budget_accounts.c.reserved + bindparam("b_amount", type_=_MONEY),
        updated_at=func.clock_timestamp(),
    )
)
_SETTLE: Final = (
    update(budget_accounts)
    .where(budget_accounts.c.scope == any_(bindparam("b_scopes", type_=_SCOPES)))
    .values(
        reserved=budget_accounts.c.reserved - bindparam("b_release", type_=_MONEY),
        spent=budget_accounts.c.spent + bindparam("b_spend", type_=_MONEY),
        updated_at=func.clock_timestamp(),
    )
)

# Records the task's scopes on its lease row (taking that row's lock first, as every path does). Matches only
# if none are recorded yet or the same list is: a task never moves to other scopes, or its reservations would
# be released on accounts that never held them.
_SET_TASK_SCOPES: Final = (
    update(task_leases)
    .where(
        task_leases.c.task_id == bindparam("b_task_id"),
        (func.cardinality(task_leases.c.budget_scopes) == 0)
        | (task_leases.c.budget_scopes == bindparam("b_scopes", type_=_SCOPES)),
    )
    .values(budget_scopes=bindparam("b_scopes", type_=_SCOPES))
    .returning(task_leases.c.task_id)
)
_TASK_SCOPES: Final = select(task_leases.c.budget_scopes).where(
    task_leases.c.task_id == bindparam("b_task_id")
)

# ON CONFLICT DO NOTHING: an existing account keeps its ceiling and totals (re-opening a task changes nothing,
# and a project shared by many tasks is created once). It takes no lock on an existing row.
_OPEN_ACCOUNT: Final = pg_insert(budget_accounts).on_conflict_do_nothing(
    index_elements=[budget_accounts.c.scope]
)

_ceiling_insert = pg_insert(budget_accounts).values(
    scope=bindparam("b_scope"), ceiling=bindparam("b_ceiling", type_=_MONEY)
)
# ON CONFLICT DO UPDATE: create or overwrite in one statement; it row-locks the one account it touches and
# nothing else, so it cannot join a cycle.
_SET_CEILING: Final = _ceiling_insert.on_conflict_do_update(
    index_elements=[budget_accounts.c.scope],
    set_={"ceiling": _ceiling_insert.excluded.ceiling, "updated_at": func.clock_timestamp()},
)
# NULL + amount is NULL: an unlimited scope stays unlimited. One row, one lock, as above.
_RAISE_CEILING: Final = (
    update(budget_accounts)
    .where(budget_accounts.c.scope == bindparam("b_scope"))
    .values(
        ceiling=budget_accounts.c.ceiling + bindparam("b_amount", type_=_MONEY),
        updated_at=func.clock_timestamp(),
    )
    .returning(budget_accounts.c.scope)
)

_ACCOUNT: Final = select(*_ACCOUNT_COLUMNS).where(budget_accounts.c.scope == bindparam("b_scope"))
_ACCOUNTS: Final = select(*_ACCOUNT_COLUMNS).order_by(_BY_SCOPE)
_ACCOUNTS_UNDER: Final = _ACCOUNTS.where(func.starts_with(budget_accounts.c.scope, bindparam("b_prefix")))

# @> rather than = ANY(...): the containment operator is the one the GIN index on budget_scopes serves.
_TASKS_IN_SCOPE: Final = (
    select(task_leases.c.task_id)
    .where(task_leases.c.budget_scopes.contains(bindparam("b_scope_list", type_=_SCOPES)))
    .order_by(task_leases.c.created_at, task_leases.c.task_id)
)


@dataclass(frozen=True, slots=True)
class RouteState:
    """A route's latest event: ``paused`` True until a person resumes it."""

    route: str
    paused: bool
    reason: str
    actor: str
    at: datetime


@dataclass(frozen=True, slots=True)
class OperationView:
    """One read of an operation: the task's epoch (None: no such task), the database's clock, its events and,
    if a route was named, why it is paused (None: it is not)."""

    epoch: int | None
    now: datetime | None
    events: list[StoredEvent]
    paused: str | None = None
    breaker: Health | None = None  # the route's shared row, if it has one


@dataclass(frozen=True, slots=True)
class Account:
    """A budget scope's enforcement state: ``ceiling`` None means unlimited."""

    scope: str
    ceiling: Decimal | None
    reserved: Decimal
    spent: Decimal
    updated_at: datetime

    @property
    def remaining(self) -> Decimal | None:
        """``ceiling - spent - reserved`` (negative once actual spend passed the ceiling); None: unlimited."""
        return None if self.ceiling is None else self.ceiling - self.spent - self.reserved


class Recorder:
    """The only way into the ledger: appends on two paths, and reads; thread-safe, one transaction per call.

    Args:
        url: A SQLAlchemy URL for ``postgresql+psycopg``.
        pool_size: Connections kept open; as many again may be opened under a burst.
    """

    def __init__(self, url: str, *, pool_size: int = 10) -> None:
        # pre_ping: after a Postgres restart the pooled connections are dead; the ping replaces them on
        # checkout instead of failing the first call on each.
        self._engine = create_engine(url, pool_pre_ping=True, pool_size=pool_size, max_overflow=pool_size)
        # Reads are single statements, atomic on their own: AUTOCOMMIT saves the BEGIN and ROLLBACK round
        # trips.
        self._reader = self._engine.execution_options(isolation_level="AUTOCOMMIT")

    def create_schema(self) -> None:
        """Create the tables and append-only triggers if missing (idempotent, safe to race)."""
        with _translated():
            create_schema(self._engine)

    def dispose(self) -> None:
        """Close every pooled connection."""
        self._engine.dispose()

    # --- leases ------------------------------------------------------------------------------------------

    def take_lease(self, task_id: str, holder: str) -> int:
        """Make ``holder`` the task's current run and return its new epoch (1 for a new task).

        Every call bumps the epoch, fencing off whichever run held the previous one.
        """
        with _translated(), self._engine.begin() as conn:
            epoch: int = conn.execute(_TAKE_LEASE, {"b_task_id": task_id, "b_holder": holder}).scalar_one()
        return epoch

    def current_epoch(self, task_id: str) -> int | None:
        """The task's current epoch, or None if no lease was ever taken on it."""
        with _translated(), self._reader.connect() as conn:
            epoch: int | None = conn.execute(_CURRENT_EPOCH, {"b_task_id": task_id}).scalar_one_or_none()
        return epoch

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
        overdraw: bool = False,
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
        spent + reserved + reserve <= ceiling``); otherwise nothing at all is written. With ``overdraw`` it
        is reserved even past a ceiling (a failed task's compensation: an undo never waits on money). With
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
        amount = _amount("reserve", reserve)
        keys = [e.dedup_key for e in events]
        if len(set(keys)) != len(keys):
            raise DuplicateEvent(next(k for i, k in enumerate(keys) if k in keys[:i]))
        count = len(events)
        if (routing is not None or human_capacity is not None) and count != 1:
            raise LedgerError(f"a routed or load-reading append writes one INTENT, not {count} events")
        with _translated():
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
                        events = [_routed(conn, routing, events[0], fence[-2], fence[-1])]
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
                        _reserve(conn, task_id, fence[1], amount, check=not overdraw)
                    _track_queue(conn, task_id, events)
            except sa_exc.IntegrityError as e:
                if _constraint(e) != DEDUP_CONSTRAINT:
                    raise
                raise DuplicateEvent(self._existing_key(keys)) from e
            except _QueueFull as full:
                _queue(self._engine, full.waiter)  # its place in the queue outlives the rolled-back INTENT
                raise RouteWaiting(full.executor, full.reason, full.retry_s) from None
        # executemany with RETURNING does not promise row order; seq does.
        return sorted((_stored(r) for r in rows), key=lambda s: s.seq)

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
        a reading as fresh as the decision.

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
        to_release, to_spend = _amount("release", release), _amount("spend", spend)
        settle = bool(to_release or to_spend)
        raised = None if raise_ceiling is None else (raise_ceiling[0], _amount("raise", raise_ceiling[1]))
        with _translated(), self._engine.connect() as conn:
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
                    conn.execute(_FREE_SLOT, {"b_key": event.operation_key})
                _track_queue(conn, task_id, [event])
                if settle:
                    _settle(conn, task_id, reserved[2], to_release, to_spend)
                if raised is not None:
                    _raise(conn, task_id, reserved[2], *raised, locked=settle)
                conn.commit()
                return _stored(inserted), True
            # The key exists (ON CONFLICT waited for its writer to commit, so this new snapshot sees it).
            existing = conn.execute(_BY_DEDUP_KEY, {"b_dedup_key": event.dedup_key}).first()
            # Give back the reserved seq: the task's seqs stay gapless.
            conn.rollback()
        if existing is None:
            raise LedgerError(f"dedup key {event.dedup_key!r} conflicted but no event holds it")
        stored = _stored(existing)
        if stored.task_id != task_id:
            raise DuplicateEvent(event.dedup_key)
        return stored, False

    # --- money -------------------------------------------------------------------------------------------

    def open_budget(self, task_id: str, scopes: Sequence[tuple[str, Decimal | None]]) -> None:
        """Create the task's budget accounts if absent and record its scopes, outermost first. Idempotent.

        ``scopes`` is e.g. ``[("project:P", None), ("episode:P/E", None), ("task:T", plan_ceiling)]``; a
        ceiling applies only when the account is created (None: unlimited); an existing one is left as it is.

        Raises:
            TaskNotFound: The task has no lease (call ``take_lease`` first).
            InvalidAmount: A ceiling is not a valid amount.
            LedgerError: ``scopes`` is empty or repeats a scope, or the task already has other scopes.
        """
        names = [scope for scope, _ in scopes]
        if not names or len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise LedgerError(
                f"task {task_id!r}: budget scopes must be distinct non-empty names, got {names!r}"
            )
        rows = [
            {"scope": scope, "ceiling": None if ceiling is None else _amount(f"ceiling of {scope}", ceiling)}
            for scope, ceiling in sorted(scopes, key=lambda sc: sc[0])  # ascending, as _LOCK_ACCOUNTS
        ]
        with _translated(), self._engine.begin() as conn:
            params = {"b_task_id": task_id, "b_scopes": names}
            if conn.execute(_SET_TASK_SCOPES, params).first() is None:
                recorded = conn.execute(_TASK_SCOPES, {"b_task_id": task_id}).scalar_one_or_none()
                if recorded is None:
                    raise TaskNotFound(task_id)
                raise LedgerError(f"task {task_id!r} already draws on {recorded!r}, not {names!r}")
            conn.execute(_OPEN_ACCOUNT, rows)

    def set_ceiling(self, scope: str, ceiling: Decimal | None) -> None:
        """Set the scope's ceiling (None: unlimited), creating its account if absent.

        A ceiling below what is already spent and reserved is allowed: it refuses every further reservation.
        """
        value = None if ceiling is None else _amount("ceiling", ceiling)
        with _translated(), self._engine.begin() as conn:
            conn.execute(_SET_CEILING, {"b_scope": scope, "b_ceiling": value})

    def raise_ceiling(self, scope: str, amount: Decimal) -> None:
        """Add ``amount`` to the scope's ceiling (AddBudget); an unlimited scope stays unlimited.

        Raises:
            LedgerError: The scope has no account.
        """
        value = _amount("amount", amount)
        with _translated(), self._engine.begin() as conn:
            if conn.execute(_RAISE_CEILING, {"b_scope": scope, "b_amount": value}).first() is None:
                raise LedgerError(f"no budget account {scope!r}")

    def accounts(self, prefix: str | None = None) -> list[Account]:
        """Every account, or those whose scope starts with ``prefix`` (literally), ordered by scope."""
        with _translated(), self._reader.connect() as conn:
            if prefix is None:
                rows = conn.execute(_ACCOUNTS).all()
            else:
                rows = conn.execute(_ACCOUNTS_UNDER, {"b_prefix": prefix}).all()
        return [Account(*r) for r in rows]

    def account(self, scope: str) -> Account | None:
        """The scope's account, if it exists."""
        with _translated(), self._reader.connect() as conn:
            row = conn.execute(_ACCOUNT, {"b_scope": scope}).first()
        return None if row is None else Account(*row)

    def task_scopes(self, task_id: str) -> list[str]:
        """The task's budget scopes, outermost first; empty if it has none (or no lease)."""
        with _translated(), self._reader.connect() as conn:
            scopes: list[str] | None = conn.execute(_TASK_SCOPES, {"b_task_id": task_id}).scalar_one_or_none()
        return [] if scopes is None else list(scopes)

    def tasks_in_scope(self, scope: str) -> list[str]:
        """Every task drawing on ``scope``, oldest first."""
        with _translated(), self._reader.connect() as conn:
            return list(conn.execute(_TASKS_IN_SCOPE, {"b_scope_list": [scope]}).scalars())

    # --- reads -------------------------------------------------------------------------------------------

    def read_events(self, task_id: str, after_seq: int = 0, limit: int | None = None) -> list[StoredEvent]:
        """The task's events with ``seq > after_seq``, in seq order, at most ``limit`` of them."""
        params: dict[str, Any] = {"b_task_id": task_id, "b_after": after_seq}
        stmt = _READ_EVENTS
        if limit is not None:
            stmt, params["b_limit"] = _READ_EVENTS_LIMITED, limit
        with _translated(), self._reader.connect() as conn:
            rows = conn.execute(stmt, params).all()
        return [_stored(r) for r in rows]

    def find_by_dedup_key(self, dedup_key: str) -> StoredEvent | None:
        """The event stored under ``dedup_key``, if any."""
        with _translated(), self._reader.connect() as conn:
            row = conn.execute(_BY_DEDUP_KEY, {"b_dedup_key": dedup_key}).first()
        return None if row is None else _stored(row)

    def preflight(self, task_id: str, dedup_key: str) -> tuple[int | None, StoredEvent | None]:
        """One round trip for an executor: (current epoch, the event under ``dedup_key`` if any)."""
        with _translated(), self._reader.connect() as conn:
            row = conn.execute(_PREFLIGHT, {"b_task_id": task_id, "b_dedup_key": dedup_key}).first()
        if row is None:
            return None, None
        epoch: int = row[0]
        return epoch, None if row.seq is None else _stored(row[1:])

    def operation_view(self, task_id: str, operation_key: str, route: str | None = None) -> OperationView:
        """What an executor reads before it acts, on one connection: the task's current epoch, the database's
        clock, every event of the operation, whether the route it is about to call is paused, and the route's
        shared breaker row (one statement with the epoch)."""
        with _translated(), self._reader.connect() as conn:
            head: Any = (
                conn.execute(_EPOCH_AND_NOW, {"b_task_id": task_id}).first()
                if route is None
                else conn.execute(_EPOCH_NOW_BREAKER, {"b_task_id": task_id, "b_route": route}).first()
            )
            rows = conn.execute(_BY_OPERATION_KEY, {"b_operation_key": operation_key}).all()
            state = conn.execute(_ROUTE_STATE, {"b_route": route}).first() if route is not None else None
        epoch, now = (head[0], head[1]) if head is not None else (None, None)
        paused = state[1] or "paused" if state is not None and state[0] == "paused" else None
        breaker = _health(route, head[2]) if route is not None and head is not None and head[2] else None
        return OperationView(epoch, now, [_stored(r) for r in rows if r.task_id == task_id], paused, breaker)

    # --- routes ------------------------------------------------------------------------------------------

    def pause_route(self, route: str, reason: str, actor: str) -> bool:
        """Pause ``route`` for every worker and task (no-op if already paused); True if this call did."""
        return self._route_event(route, "paused", reason, actor)

    def resume_route(self, route: str, actor: str, reason: str = "") -> bool:
        """Resume a paused route; True if it was paused."""
        return self._route_event(route, "resumed", reason, actor)

    def _route_event(self, route: str, kind: str, reason: str, actor: str) -> bool:
        with _translated(), self._engine.begin() as conn:
            conn.execute(_ROUTE_LOCK, {"route": route})
            latest = conn.execute(_ROUTE_STATE, {"b_route": route}).first()
            current = latest[0] if latest is not None else "resumed"
            if current == kind:
                return False
            row = {"route": route, "kind": kind, "reason": reason[:1000], "actor": actor[:200]}
            conn.execute(route_events.insert().values(**row))
        return True

    def route_states(self) -> dict[str, RouteState]:
        """Every route that was ever paused, with its current state."""
        with _translated(), self._reader.connect() as conn:
            rows = conn.execute(_ROUTE_STATES).all()
        return {r[0]: RouteState(r[0], r[1] == "paused", r[2], r[3], r[4]) for r in rows}

    # --- shared route health (rules.routing) --------------------------------------------------------------

    def observe(self, route: str, what: Observation, key: str | None, policy: BreakerPolicy) -> str | None:
        """Record what a call to ``route`` (or a first review of its output) told, and move its breaker if
        that calls for it (a failure rate reached, a probe's or canary's result); returns the change logged
        (``opened``, ``closed``, ``canary_passed`` …) or None. Most observations are one statement."""
        with _translated(), self._engine.begin() as conn:
            row, now, seq = conn.execute(
                _OBSERVE, {"b_route": route, "b_kind": what.value, "b_key": key}
            ).one()
            if seq % PRUNE_EVERY == 0:
                keep = max(RETAIN_OBSERVATIONS, 2 * timedelta(seconds=policy.widest_s))
                conn.execute(_PRUNE_OBSERVATIONS, {"b_route": route, "b_before": now - keep})
            h = _health(route, row)
            counted = what in FAILURES or what == Observation.REVIEW_FAIL
            if not (counted or (key is not None and key in (h.probe_key, h.canary_key))):
                return None
            for _ in range(3):
                window = Window()
                if counted and h.state == BreakerState.CLOSED:
                    calls, failures, reviews, passed = conn.execute(
                        _WINDOW,
                        {
                            "route": route,
                            "now": now,
                            "calls": timedelta(seconds=policy.window_s),
                            "widest": timedelta(seconds=policy.widest_s),
                        },
                    ).one()
                    window = Window(calls, failures, reviews, passed)
                new, change = observed(h, what, key or "", window, policy, now)
                if change is None:
                    return None
                if _swap(conn, h, new):
                    _log_change(conn, route, change, new.reason if change != "canary_passed" else "", key)
                    return change
                h = _health(route, conn.execute(select(_BREAKER_ROW.label("r")), {"b_route": route}).scalar())
        return None

    def record_qualification(
        self, route: str, passed: bool, reason: str, detail: dict[str, Any], actor: str
    ) -> Health:
        """A regression run's result: a pass qualifies the route as a fallback from now (until it is older
        than its ``max_age``), a failure withdraws any qualification. Logged with its scores."""
        with _translated(), self._engine.begin() as conn:
            conn.execute(pg_insert(route_breakers).values(route=route).on_conflict_do_nothing())
            conn.execute(
                update(route_breakers)
                .where(route_breakers.c.route == route)
                .values(
                    qualified_at=func.clock_timestamp() if passed else None,
                    version=route_breakers.c.version + 1,
                )
            )
            kind = "qualified" if passed else "disqualified"
            _log_change(conn, route, kind, reason, None, {**detail, "actor": actor[:200]})
            row = conn.execute(select(_BREAKER_ROW.label("r")), {"b_route": route}).scalar()
        return _health(route, row)

    def route_health(self) -> dict[str, Health]:
        """Every route's shared row (routes without one are closed and unqualified)."""
        with _translated(), self._reader.connect() as conn:
            rows = conn.execute(select(route_breakers)).mappings().all()
        return {r["route"]: _health(r["route"], dict(r)) for r in rows}

    def observations(self, route: str) -> dict[str, int]:
        """How many observations of each kind ``route`` has had (for drills and reports)."""
        q = (
            select(route_observations.c.kind, func.count())
            .where(route_observations.c.route == route)
            .group_by(route_observations.c.kind)
        )
        with _translated(), self._reader.connect() as conn:
            return {str(k): int(n) for k, n in conn.execute(q).all()}

    def route_changes(self, route: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        """The newest ``limit`` changes (of one route, or all), newest first."""
        q = select(route_changes).order_by(route_changes.c.id.desc()).limit(limit)
        if route is not None:
            q = q.where(route_changes.c.route == route)
        with _translated(), self._reader.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings().all()]

    # --- the approver key registry (rules.approvers) -------------------------------------------------------

    def sync_human_queue(self, task_id: str) -> int:
        """Make the task's rows of ``human_queue`` what its ledger says — its open requests, none once it
        ended — and return how many rows that changed. For a database upgraded to 0004 with requests already
        open, and as a repair. Runs under the task's lease row lock, which every write of the task takes, so
        no request opens or closes between the read and the rewrite."""
        lock = select(task_leases.c.task_id).where(task_leases.c.task_id == task_id).with_for_update()
        mine = human_queue.c.task_id == task_id
        with _translated(), self._engine.begin() as conn:
            if conn.execute(lock).first() is None:
                raise TaskNotFound(task_id)
            events = [_stored(r) for r in conn.execute(_READ_EVENTS, {"b_task_id": task_id, "b_after": 0})]
            p = fold(events) if events else None
            want = (
                {}
                if p is None or p.terminal
                else {rid: r.request.kind.value for rid, r in p.requests.items() if r.open}
            )
            have = dict(conn.execute(select(human_queue.c.request_id, human_queue.c.kind).where(mine)).all())
            stale = [rid for rid in have if rid not in want]
            if stale:
                conn.execute(_QUEUE_CLOSE, {"b_task_id": task_id, "b_requests": stale})
            missing = [(rid, kind) for rid, kind in want.items() if rid not in have]
            for rid, kind in missing:
                conn.execute(_QUEUE_OPEN, {"b_task_id": task_id, "b_request": rid, "b_kind": kind})
        return len(stale) + len(missing)

    def open_requests_by_project(self) -> dict[str, int]:
        """Open human requests per project scope (``human_queue``, rules.pressure)."""
        stmt = select(human_queue.c.scope, func.count()).group_by(human_queue.c.scope)
        with _translated(), self._reader.connect() as conn:
            return {scope: n for scope, n in conn.execute(stmt)}

    def add_key(self, key: KeyRecord, *, actor: str, reason: str = "") -> None:
        """Register a public key. LedgerError if its key id was ever registered (ids are never reused)."""
        row = {
            "key_id": key.key_id,
            "action": "add",
            "approver": key.approver,
            "public_key": key.public_key,
            "kinds": list(key.kinds),
            "scopes": list(key.scopes),
            "not_before": key.not_before,
            "expires_at": key.expires_at,
            "reason": reason[:1000],
            "actor": actor[:200],
        }
        try:
            with _translated(), self._engine.begin() as conn:
                conn.execute(approver_keys.insert().values(**row))
        except LedgerError as e:
            if (
                isinstance(e.__cause__, sa_exc.IntegrityError)
                and _constraint(e.__cause__) == APPROVER_KEY_CONSTRAINT
            ):
                raise LedgerError(f"key {key.key_id} is already registered (a key id is used once)") from None
            raise

    def revoke_key(self, key_id: str, *, actor: str, reason: str) -> KeyRecord | None:
        """Revoke a registered key; the revoked record, or None if no such key is registered. A key already
        revoked stays revoked as it was (nothing is written)."""
        with _translated(), self._engine.begin() as conn:
            conn.execute(_KEY_LOCK, {"key_id": key_id})
            keys = registry(dict(r._mapping) for r in conn.execute(_KEY_LOG))
            found = keys.get(key_id)
            if found is None or found.revoked_at is not None:
                return found
            row = {
                "key_id": key_id,
                "action": "revoke",
                "approver": found.approver,
                "public_key": found.public_key,
                "reason": reason[:1000],
                "actor": actor[:200],
            }
            conn.execute(approver_keys.insert().values(**row))
            return registry(dict(r._mapping) for r in conn.execute(_KEY_LOG)).get(key_id)

    def key_registry(self) -> dict[str, KeyRecord]:
        """Every registered key, as of now (folded from the registry's log)."""
        with _translated(), self._reader.connect() as conn:
            return registry(dict(r._mapping) for r in conn.execute(_KEY_LOG))

    def events_by_operation_key(self, operation_key: str) -> list[StoredEvent]:
        """Every event carrying ``operation_key``, ordered by task and seq."""
        with _translated(), self._reader.connect() as conn:
            rows = conn.execute(_BY_OPERATION_KEY, {"b_operation_key": operation_key}).all()
        return [_stored(r) for r in rows]

    def outputs_by_input_hash(self, input_hash: str, project: str) -> list[StoredEvent]:
        """Outcomes registered for ``input_hash`` by any task of ``project``, newest first (at most 20)."""
        params = {"b_hash": input_hash, "b_scope_list": [f"project:{project}"]}
        with _translated(), self._reader.connect() as conn:
            rows = conn.execute(_OUTPUTS_BY_HASH, params).all()
        return [_stored(r) for r in rows]

    def task_ids(self) -> list[str]:
        """Every task that ever had a lease, oldest first."""
        with _translated(), self._reader.connect() as conn:
            return list(conn.execute(_TASK_IDS).scalars())

    def _existing_key(self, keys: list[str]) -> str:
        """Which of ``keys`` is already stored (after a dedup conflict; the error names no key in a field)."""
        if len(keys) == 1:
            return keys[0]
        with self._reader.connect() as conn:
            found: str | None = conn.execute(_EXISTING_DEDUP_KEY, {"b_keys": keys}).scalar_one_or_none()
        return found if found is not None else keys[0]

    def check_schema(self) -> None:
        """Refuse to go on unless the database is at this ledgerflow's schema revision: one read, no DDL.

        What workers and CLI commands call when they start (``create_schema`` is the upgrade, on request).

        Raises:
            SchemaMismatch: no schema yet, an older revision, or a newer one; the message says what to run.
        """
        from ledger.migrate import check  # ledger.migrate builds on this module

        check(self._reader)


_KEY_LOG: Final = select(approver_keys).order_by(approver_keys.c.seq)
_KEY_LOCK: Final = text("SELECT pg_advisory_xact_lock(hashtext('approver_key:' || :key_id))")


def _track_queue(conn: Connection, task_id: str, written: Sequence[NewEvent]) -> None:
    """Open and close people's requests in ``human_queue`` as the events just written say (in order)."""
    for event in written:
        change = queue_changes(event.type, event.payload)
        if change is None:
            continue
        if change.close_all:
            conn.execute(_QUEUE_CLOSE_ALL, {"b_task_id": task_id})
        if change.closed:
            conn.execute(_QUEUE_CLOSE, {"b_task_id": task_id, "b_requests": list(change.closed)})
        for request, kind in change.opened:
            conn.execute(_QUEUE_OPEN, {"b_task_id": task_id, "b_request": request, "b_kind": kind})


def _amount(name: str, value: object) -> Decimal:
    """``value`` as money, or InvalidAmount.

    A Decimal or int (not bool, str or float), finite, 0 to MAX_AMOUNT, and exact in the accounts' six
    decimals (rounding would make an account differ from the events it is audited against).
    """
    if isinstance(value, bool) or not isinstance(value, Decimal | int):
        raise InvalidAmount(name, value, f"must be a Decimal or an int, not {type(value).__name__}")
    try:
        return parse_amount(value)  # the one money type's rules (rules.money)
    except ValueError as e:
        raise InvalidAmount(name, value, str(e)) from None


def _lock_accounts(conn: Connection, task_id: str, scopes: list[str] | None) -> list[Account]:
    """Lock the task's accounts (after its lease row), in the fixed order; every one must exist."""
    if not scopes:
        raise LedgerError(f"task {task_id!r} has no budget accounts (open_budget was never called for it)")
    accounts = [Account(*r) for r in conn.execute(_LOCK_ACCOUNTS, {"b_scopes": scopes})]
    if len(accounts) != len(scopes):
        missing = sorted(set(scopes) - {a.scope for a in accounts})
        raise LedgerError(f"task {task_id!r}: budget accounts {missing!r} are missing")
    return accounts


def _reserve(
    conn: Connection, task_id: str, scopes: list[str] | None, amount: Decimal, *, check: bool = True
) -> None:
    """Reserve ``amount`` on every scope, or raise BudgetRefused for the first it does not fit (``check``)."""
    for a in _lock_accounts(conn, task_id, scopes):
        if check and a.ceiling is not None and a.spent + a.reserved + amount > a.ceiling:
            raise BudgetRefused(a.scope, a.ceiling, a.spent, a.reserved, amount)
    conn.execute(_ADD_RESERVED, {"b_scopes": scopes, "b_amount": amount})


def _settle(
    conn: Connection, task_id: str, scopes: list[str] | None, release: Decimal, spend: Decimal
) -> None:
    """Move a reservation to actual spend on every scope; spend is never refused, whatever the ceiling."""
    for a in _lock_accounts(conn, task_id, scopes):
        if release > a.reserved:
            raise LedgerError(
                f"task {task_id!r}: releasing {release} on {a.scope} exceeds its reservation {a.reserved}"
            )
    conn.execute(_SETTLE, {"b_scopes": scopes, "b_release": release, "b_spend": spend})


def _raise(
    conn: Connection, task_id: str, scopes: list[str] | None, scope: str, amount: Decimal, *, locked: bool
) -> None:
    """Raise one of the task's scopes' ceiling by ``amount``, its accounts locked in the fixed order."""
    if scope not in (scopes or []):
        raise LedgerError(f"task {task_id!r} does not draw on {scope!r}: its ceiling cannot be raised here")
    if not locked:
        _lock_accounts(conn, task_id, scopes)
    conn.execute(_RAISE_CEILING, {"b_scope": scope, "b_amount": amount})


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


def _stored(row: Sequence[Any]) -> StoredEvent:
    # Validating a plain dict in pydantic-core measured ~3x faster than the pure-Python model_construct, and
    # zip over the tuple-like row ~3x faster than Row._asdict().
    return StoredEvent.model_validate(dict(zip(_EVENT_FIELDS, row, strict=True)))


def _constraint(error: sa_exc.DBAPIError) -> str | None:
    diag = getattr(error.orig, "diag", None)
    name = getattr(diag, "constraint_name", None)
    return name if isinstance(name, str) else None


@contextmanager
def _translated() -> Iterator[None]:
    """Translate driver errors into ledger errors; our own errors pass through untouched."""
    try:
        yield
    except LedgerError:
        raise
    except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError) as e:
        raise LedgerUnavailable(f"ledger database unavailable: {_describe(e)}") from e
    except sa_exc.DBAPIError as e:
        if e.connection_invalidated:
            raise LedgerUnavailable(f"ledger connection lost: {_describe(e)}") from e
        raise LedgerError(f"ledger database error: {_describe(e)}") from e


def _describe(error: sa_exc.SQLAlchemyError) -> str:
    # The driver's message only: SQLAlchemy's own text appends the statement and its parameters (payloads).
    cause = getattr(error, "orig", None) or error
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"


@dataclass(frozen=True)
class Routing:
    """What a routed dispatch's INTENT asks of ``append_fenced``: the executor, its routes (primary first),
    the operation's key (a probe's or canary's claim names it) and, for routes with a concurrency quota,
    ``(route, limit, aging_s)`` with the dispatch's place in their queues (priority, deadline)."""

    executor: str
    chain: tuple[Candidate, ...]
    key: str
    task_id: str = ""
    quotas: tuple[tuple[str, int, float], ...] = ()
    priority: str = "standard"
    deadline: datetime | None = None


# A waiter not seen again for this long (its task ended, its worker died) no longer holds its place.
WAITER_STALE = timedelta(seconds=30)


def _health(route: str, row: Any) -> Health:
    """A ``route_breakers`` row (JSON from row_to_json, or a mapping) as rules.routing reads it."""
    if not row:
        return Health(route)
    return Health.from_basis(route, {k: row.get(k) for k in _HEALTH_COLUMNS})


def _routed(conn: Connection, routing: Routing, intent: NewEvent, rows: Any, now: datetime) -> NewEvent:
    """The INTENT with its route chosen (and claimed) on the rows read by the fence, in its transaction."""
    healths = {r["route"]: _health(r["route"], r) for r in rows or []}
    choice = choose(routing.chain, healths, now, routing.key)
    if choice.route is None:
        raise RouteWaiting(routing.executor, choice.reason, choice.retry_s)
    if choice.claim is not None:
        primary = healths.get(routing.chain[0].route)
        before = healths.get(choice.route) or Health(choice.route)
        outage = primary.opened_at if primary is not None else None
        after = claimed(before, choice, routing.key, now, outage)
        if not _swap(conn, before, after):
            raise RouteContended(routing.executor, f"{choice.route} changed meanwhile", 0.1)
        if choice.claim == "probe":
            kind, reason = "half_opened", f"probe {routing.key} after {before.reason}"
        else:
            kind = "switched" if before.canary_outage != outage else "canary_claimed"
            reason = f"{routing.chain[0].route} → {choice.route}: {choice.reason}"
        _log_change(conn, choice.route, kind, reason, routing.key, {"executor": routing.executor})
    quota = next((q for q in routing.quotas if q[0] == choice.route), None)
    granted = _take_slot(conn, routing, quota, now) if quota is not None else None
    basis = {c.route: (healths.get(c.route) or Health(c.route)).as_basis() for c in routing.chain}
    payload = {
        **intent.payload,
        "route": choice.route,
        "route_claim": choice.claim,
        "route_reason": choice.reason,
        "route_basis": basis,
        "route_chain": [[c.route, c.open_for_s, c.max_age_s] for c in routing.chain],
        "route_at": now.isoformat(),
    }
    if granted is not None:
        payload["route_quota"] = granted
    return intent.model_copy(update={"payload": payload})


def _swap(conn: Connection, before: Health, after: Health) -> bool:
    """Write ``after`` over the route's row if it is still ``before`` (its version); False if it moved."""
    values = {k: getattr(after, k) for k in _HEALTH_COLUMNS} | {"state": after.state.value}
    if before.version == 0:
        inserted = conn.execute(
            pg_insert(route_breakers)
            .values(route=after.route, **values)
            .on_conflict_do_nothing()
            .returning(route_breakers.c.route)
        ).first()
        if inserted is not None:
            return True
    done = conn.execute(
        update(route_breakers)
        .where(route_breakers.c.route == after.route, route_breakers.c.version == before.version)
        .values(**values)
    )
    return done.rowcount == 1


def _log_change(
    conn: Connection,
    route: str,
    kind: str,
    reason: str,
    key: str | None,
    detail: dict[str, Any] | None = None,
) -> None:
    conn.execute(
        route_changes.insert().values(
            route=route, kind=kind, reason=reason[:1000], operation_key=key, detail=detail
        )
    )


class _QueueFull(RouteWaiting):
    """The chosen route's quota is full for this dispatch: its waiter row is written after the rollback."""

    def __init__(self, executor: str, reason: str, retry_s: float, waiter: dict[str, Any]) -> None:
        super().__init__(executor, reason, retry_s)
        self.waiter = waiter

    def __reduce__(self) -> tuple[Any, ...]:
        return (RouteWaiting, (self.executor, self.reason, self.retry_s))


def _take_slot(
    conn: Connection, routing: Routing, quota: tuple[str, int, float], now: datetime
) -> dict[str, Any]:
    """A slot on a quota'd route for this dispatch, or _QueueFull (the transaction rolls back; the caller
    records its place in the queue). Grants on one route are serialized by an advisory lock."""
    route, limit, aging = quota
    conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:k))"), {"k": f"route-quota:{route}"})
    used = conn.execute(
        select(func.count()).select_from(route_slots).where(route_slots.c.route == route)
    ).scalar_one()
    rows = (
        conn.execute(
            select(route_waiters).where(
                route_waiters.c.route == route, route_waiters.c.seen_at > now - WAITER_STALE
            )
        )
        .mappings()
        .all()
    )
    waiters = [Waiter(r["operation_key"], r["priority"], r["deadline"], r["since"]) for r in rows]
    mine = next((w for w in waiters if w.key == routing.key), None)
    me = Waiter(routing.key, routing.priority, routing.deadline, mine.since if mine else now)
    g = grant(me, used, limit, waiters, now, aging)
    if not g.granted:
        waiter = {
            "operation_key": routing.key,
            "route": route,
            "task_id": routing.task_id,
            "priority": routing.priority,
            "deadline": routing.deadline,
            "since": me.since,
            "seen_at": now,
        }
        # Asked again soon, a little later the further back it stands (never all at once: a full route
        # must not turn its queue into a storm of retries).
        retry = min(10.0, 0.5 + 0.25 * g.ahead) * (1 + 0.5 * key_fraction(routing.key))
        raise _QueueFull(routing.executor, f"{route}: {g.reason}", retry, waiter)
    conn.execute(route_slots.insert().values(operation_key=routing.key, route=route, task_id=routing.task_id))
    conn.execute(delete(route_waiters).where(route_waiters.c.operation_key == routing.key))
    assert me.since is not None  # its first ask, or now
    return {
        "used": g.used,
        "limit": g.limit,
        "ahead": g.ahead,
        "priority": routing.priority,
        "waited_s": (now - me.since).total_seconds(),
    }


def _queue(engine: sa_Engine, waiter: dict[str, Any]) -> None:
    """Record (or refresh) a dispatch's place in a full route's queue, in its own transaction."""
    stmt = pg_insert(route_waiters).values(**waiter)
    stmt = stmt.on_conflict_do_update(
        index_elements=[route_waiters.c.operation_key], set_={"seen_at": stmt.excluded.seen_at}
    )
    with engine.begin() as conn:
        conn.execute(stmt)
        conn.execute(
            delete(route_waiters).where(route_waiters.c.seen_at < waiter["seen_at"] - 10 * WAITER_STALE)
        )
