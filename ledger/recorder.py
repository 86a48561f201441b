"""The ledger recorder: the two write paths and the reads, each one short transaction on Postgres.

* **Fenced** (``append_fenced``): the workflow's own events. The write locks the task's lease row, checks the
  caller's epoch and takes consecutive seqs, so a superseded run can never write; a stale epoch raises
  ``StaleEpoch`` and nothing is written.
* **Idempotent** (``append_idempotent``): executors, the timeout marker, human decisions. The first write of a
  dedup key wins; a repeat returns the stored event and writes nothing.

Both paths allocate ``seq`` under the lease row lock, so each task's seqs are gapless 1..n in commit order.
Driver errors are translated into ``ledger.errors`` here, once, and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final

from sqlalchemy import BigInteger, bindparam, create_engine, func, select, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ledger.errors import DuplicateEvent, LedgerError, LedgerUnavailable, StaleEpoch, TaskNotFound
from ledger.schema import DEDUP_CONSTRAINT, create_schema, events, task_leases
from rules.envelope import NewEvent, StoredEvent

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
            events, (events.c.dedup_key == bindparam("b_dedup_key")) & (events.c.task_id == task_leases.c.task_id)
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

_TASK_IDS: Final = select(task_leases.c.task_id).order_by(task_leases.c.created_at, task_leases.c.task_id)


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

    def append_fenced(self, task_id: str, epoch: int, events: Sequence[NewEvent]) -> list[StoredEvent]:
        """Append ``events`` atomically with consecutive seqs, if ``epoch`` is still the task's current one.

        An empty ``events`` still checks the fence.

        Raises:
            TaskNotFound: The task has no lease.
            StaleEpoch: A newer run holds the task; nothing was written.
            DuplicateEvent: A dedup key of the batch is already stored (or repeats within the batch);
                nothing was written.
            LedgerUnavailable: The database could not be reached; the write may or may not have committed.
        """
        keys = [e.dedup_key for e in events]
        if len(set(keys)) != len(keys):
            raise DuplicateEvent(next(k for i, k in enumerate(keys) if k in keys[:i]))
        count = len(events)
        with _translated():
            try:
                with self._engine.begin() as conn:
                    next_seq = conn.execute(
                        _RESERVE_FENCED, {"b_task_id": task_id, "b_epoch": epoch, "b_count": count}
                    ).scalar_one_or_none()
                    if next_seq is None:
                        # Error path only: tell a missing task from a stale epoch.
                        actual = conn.execute(_CURRENT_EPOCH, {"b_task_id": task_id}).scalar_one_or_none()
                        if actual is None:
                            raise TaskNotFound(task_id)
                        raise StaleEpoch(task_id, epoch, actual)
                    if not events:
                        return []
                    first = next_seq - count
                    rows = conn.execute(
                        _INSERT_EVENTS,
                        [_params(task_id, first + i, epoch, e) for i, e in enumerate(events)],
                    ).all()
            except sa_exc.IntegrityError as e:
                if _constraint(e) != DEDUP_CONSTRAINT:
                    raise
                raise DuplicateEvent(self._existing_key(keys)) from e
        # executemany with RETURNING does not promise row order; seq does.
        return sorted((_stored(r) for r in rows), key=lambda s: s.seq)

    def append_idempotent(self, task_id: str, event: NewEvent) -> tuple[StoredEvent, bool]:
        """Append ``event`` unless its dedup key is already stored: the first write wins.

        Returns:
            ``(stored, True)`` if this call wrote it, ``(existing, False)`` if the dedup key was already there
            (then nothing was written and no seq was used).

        Raises:
            TaskNotFound: The task has no lease.
            DuplicateEvent: The dedup key belongs to an event of another task: a key-construction bug, since
                returning another task's fact as if it were this one's would hide it.
            LedgerUnavailable: The database could not be reached; the write may or may not have committed.
        """
        with _translated(), self._engine.connect() as conn:
            reserved = conn.execute(_RESERVE_ONE, {"b_task_id": task_id}).first()
            if reserved is None:
                raise TaskNotFound(task_id)
            next_seq, epoch = reserved
            inserted = conn.execute(_INSERT_IDEMPOTENT, _params(task_id, next_seq - 1, epoch, event)).first()
            if inserted is not None:
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
        """One round trip for an executor: (the task's current epoch, the event under ``dedup_key`` if any)."""
        with _translated(), self._reader.connect() as conn:
            row = conn.execute(_PREFLIGHT, {"b_task_id": task_id, "b_dedup_key": dedup_key}).first()
        if row is None:
            return None, None
        epoch: int = row[0]
        return epoch, None if row.seq is None else _stored(row[1:])

    def events_by_operation_key(self, operation_key: str) -> list[StoredEvent]:
        """Every event carrying ``operation_key``, ordered by task and seq."""
        with _translated(), self._reader.connect() as conn:
            rows = conn.execute(_BY_OPERATION_KEY, {"b_operation_key": operation_key}).all()
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
