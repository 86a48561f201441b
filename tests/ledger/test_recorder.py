"""The recorder against a real PostgreSQL: fencing, dedup, gapless seqs, append-only, clock, outages."""

from __future__ import annotations

import pickle
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.errors import AlreadyResolved, DuplicateEvent, LedgerUnavailable, StaleEpoch, TaskNotFound
from ledger.recorder import Recorder
from ledgerflow.stack import pg
from rules.envelope import NewEvent, StoredEvent

T = TypeVar("T")


def new_task() -> str:
    return uuid.uuid4().hex


def ev(key: str, type_: str = "Noted", **payload: Any) -> NewEvent:
    return NewEvent(type=type_, dedup_key=key, payload=payload)


def run_concurrently(fns: list[Callable[[], T]]) -> list[T]:
    """Run every callable on its own thread, all released at once by a barrier, and return their results."""
    barrier = threading.Barrier(len(fns))

    def gated(fn: Callable[[], T]) -> T:
        barrier.wait()
        return fn()

    with ThreadPoolExecutor(max_workers=len(fns)) as pool:
        futures = [pool.submit(gated, fn) for fn in fns]
        return [f.result() for f in futures]


@pytest.fixture(scope="module")
def engine(pg_url: str) -> Iterator[sa.Engine]:
    """A plain engine for raw SQL that goes around the recorder."""
    eng = sa.create_engine(pg_url)
    try:
        yield eng
    finally:
        eng.dispose()


def db_now(engine: sa.Engine) -> datetime:
    with engine.connect() as conn:
        now: datetime = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
    return now


# --- the fenced path ----------------------------------------------------------------------------------------


def test_fenced_append_assigns_consecutive_seqs_and_server_timestamps(
    recorder: Recorder, engine: sa.Engine
) -> None:
    task = new_task()
    epoch = recorder.take_lease(task, "run-a")
    before = db_now(engine)

    first = recorder.append_fenced(task, epoch, [ev(f"{task}:1", n="1"), ev(f"{task}:2"), ev(f"{task}:3")])
    second = recorder.append_fenced(task, epoch, [ev(f"{task}:4")])

    after = db_now(engine)
    stored = first + second
    assert [e.seq for e in stored] == [1, 2, 3, 4]
    assert all(e.epoch == epoch and e.task_id == task for e in stored)
    assert stored[0].payload == {"n": "1"}
    assert all(e.recorded_at.tzinfo is not None and before <= e.recorded_at <= after for e in stored)
    assert recorder.read_events(task) == stored


def test_fenced_append_with_a_stale_epoch_raises_and_writes_nothing(recorder: Recorder) -> None:
    task = new_task()
    old = recorder.take_lease(task, "run-a")
    new = recorder.take_lease(task, "run-b")

    with pytest.raises(StaleEpoch) as caught:
        recorder.append_fenced(task, old, [ev(f"{task}:zombie")])

    assert (caught.value.task_id, caught.value.expected, caught.value.actual) == (task, old, new)
    assert recorder.read_events(task) == []
    assert recorder.find_by_dedup_key(f"{task}:zombie") is None
    # The refused write consumed no seq.
    assert [e.seq for e in recorder.append_fenced(task, new, [ev(f"{task}:live")])] == [1]


def test_fenced_append_unless_a_key_is_stored_is_refused_once_it_is_and_writes_nothing(
    recorder: Recorder,
) -> None:
    # An executor's INTENT is written unless the task began closing (the workflow's ``closing`` marker).
    task = new_task()
    epoch = recorder.take_lease(task, "run-a")
    closing = f"{task}:closing"
    recorder.append_fenced(task, epoch, [ev(f"{task}:intent:1")], unless=closing)
    recorder.append_idempotent(task, ev(closing))
    with pytest.raises(AlreadyResolved):
        recorder.append_fenced(task, epoch, [ev(f"{task}:intent:2")], unless=closing)
    assert [e.dedup_key for e in recorder.read_events(task)] == [f"{task}:intent:1", closing]
    assert recorder.find_by_dedup_key(f"{task}:intent:2") is None
    assert [e.seq for e in recorder.append_fenced(task, epoch, [ev(f"{task}:after")])] == [3]  # no seq used


def test_fenced_append_to_a_task_without_lease_raises_task_not_found(recorder: Recorder) -> None:
    task = new_task()
    with pytest.raises(TaskNotFound):
        recorder.append_fenced(task, 1, [ev(f"{task}:1")])
    with pytest.raises(TaskNotFound):
        recorder.append_idempotent(task, ev(f"{task}:2"))
    assert recorder.current_epoch(task) is None


def test_take_lease_bumps_the_epoch_and_the_lease_row_is_never_deleted(
    recorder: Recorder, engine: sa.Engine
) -> None:
    task = new_task()
    epochs = [recorder.take_lease(task, f"run-{i}") for i in range(4)]
    assert epochs == [1, 2, 3, 4]
    assert recorder.current_epoch(task) == 4

    for statement in ("DELETE FROM task_leases WHERE task_id = :t", "TRUNCATE task_leases CASCADE"):
        with pytest.raises(sa.exc.DBAPIError, match="append-only"), engine.begin() as conn:
            conn.execute(sa.text(statement), {"t": task})

    with engine.connect() as conn:
        holder = conn.execute(
            sa.text("SELECT holder FROM task_leases WHERE task_id = :t"), {"t": task}
        ).scalar()
    assert holder == "run-3"
    assert recorder.current_epoch(task) == 4


def test_fenced_duplicate_dedup_key_raises_and_writes_nothing_of_the_batch(recorder: Recorder) -> None:
    task = new_task()
    epoch = recorder.take_lease(task, "run-a")
    recorder.append_fenced(task, epoch, [ev(f"{task}:a")])

    with pytest.raises(DuplicateEvent) as caught:
        recorder.append_fenced(task, epoch, [ev(f"{task}:b"), ev(f"{task}:a"), ev(f"{task}:c")])
    assert caught.value.dedup_key == f"{task}:a"
    with pytest.raises(DuplicateEvent):
        recorder.append_fenced(task, epoch, [ev(f"{task}:d"), ev(f"{task}:d")])

    assert [e.dedup_key for e in recorder.read_events(task)] == [f"{task}:a"]
    assert recorder.find_by_dedup_key(f"{task}:b") is None
    # The rolled-back batches consumed no seqs.
    assert [e.seq for e in recorder.append_fenced(task, epoch, [ev(f"{task}:b")])] == [2]


def test_concurrent_fenced_appends_produce_gapless_unique_seqs(recorder: Recorder) -> None:
    task = new_task()
    epoch = recorder.take_lease(task, "run-a")
    threads, batches, size = 12, 6, 3

    def writer(w: int) -> list[list[StoredEvent]]:
        return [
            recorder.append_fenced(task, epoch, [ev(f"{task}:{w}:{b}:{i}") for i in range(size)])
            for b in range(batches)
        ]

    results = run_concurrently([partial(writer, w) for w in range(threads)])

    total = threads * batches * size
    assert [e.seq for e in recorder.read_events(task)] == list(range(1, total + 1))
    for batch in (batch for per_thread in results for batch in per_thread):
        # Each batch is atomic: its seqs are consecutive even under contention.
        assert [e.seq for e in batch] == list(range(batch[0].seq, batch[0].seq + size))


def test_take_lease_during_concurrent_fenced_appends_fences_the_old_run(recorder: Recorder) -> None:
    task = new_task()
    old = recorder.take_lease(task, "run-a")
    started = threading.Barrier(9)

    def old_run_writer(w: int) -> int:
        started.wait()
        for b in range(10_000):
            try:
                recorder.append_fenced(task, old, [ev(f"{task}:{w}:{b}:{i}") for i in range(2)])
            except StaleEpoch:
                return b
        raise AssertionError("the old run was never fenced")

    with ThreadPoolExecutor(max_workers=8) as pool:
        writers = [pool.submit(old_run_writer, w) for w in range(8)]
        started.wait()
        new = recorder.take_lease(task, "run-b")
        recorder.append_fenced(task, new, [ev(f"{task}:new")])
        written_by_old = sum(f.result() for f in writers)

    stored = recorder.read_events(task)
    assert [e.seq for e in stored] == list(range(1, len(stored) + 1))
    # Every write of the old run committed before the takeover, none after it.
    assert [e.epoch for e in stored] == [old] * (len(stored) - 1) + [new]
    assert len(stored) - 1 == 2 * written_by_old


# --- the idempotent path ------------------------------------------------------------------------------------


def test_idempotent_first_write_wins_and_a_repeat_consumes_no_seq(recorder: Recorder) -> None:
    task = new_task()
    epoch = recorder.take_lease(task, "run-a")
    recorder.append_fenced(task, epoch, [ev(f"{task}:intent")])

    first, first_inserted = recorder.append_idempotent(task, ev(f"{task}:outcome", "Outcome", attempt="1"))
    again, again_inserted = recorder.append_idempotent(task, ev(f"{task}:outcome", "Outcome", attempt="2"))

    assert (first_inserted, again_inserted) == (True, False)
    assert again == first
    assert (first.seq, first.epoch, first.payload) == (2, epoch, {"attempt": "1"})
    assert [e.seq for e in recorder.append_fenced(task, epoch, [ev(f"{task}:next")])] == [3]


def test_idempotent_repeat_of_a_fenced_event_returns_it(recorder: Recorder) -> None:
    task = new_task()
    epoch = recorder.take_lease(task, "run-a")
    [fenced] = recorder.append_fenced(task, epoch, [ev(f"{task}:x")])
    assert recorder.append_idempotent(task, ev(f"{task}:x")) == (fenced, False)


def test_idempotent_write_of_another_tasks_dedup_key_is_refused(recorder: Recorder) -> None:
    owner, other = new_task(), new_task()
    recorder.take_lease(owner, "run-a")
    recorder.take_lease(other, "run-b")
    recorder.append_idempotent(owner, ev(f"{owner}:k"))

    with pytest.raises(DuplicateEvent):
        recorder.append_idempotent(other, ev(f"{owner}:k"))
    assert recorder.read_events(other) == []


def test_idempotent_race_of_20_writers_stores_exactly_one_row(recorder: Recorder) -> None:
    task = new_task()
    epoch = recorder.take_lease(task, "run-a")
    key = f"{task}:decision"

    results = run_concurrently(
        [partial(recorder.append_idempotent, task, ev(key, "Decision", writer=str(w))) for w in range(20)]
    )

    assert sum(inserted for _, inserted in results) == 1
    winner = next(stored for stored, inserted in results if inserted)
    assert all(stored == winner for stored, _ in results)
    assert [e.dedup_key for e in recorder.read_events(task)] == [key]
    assert [e.seq for e in recorder.append_fenced(task, epoch, [ev(f"{task}:after")])] == [2]


# --- database-enforced rules --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE events SET payload = '{}'::jsonb WHERE task_id = :t",
        "UPDATE events SET type = 'x' WHERE false",
        "DELETE FROM events WHERE task_id = :t",
        "TRUNCATE events",
    ],
)
def test_events_table_refuses_update_delete_and_truncate(
    recorder: Recorder, engine: sa.Engine, statement: str
) -> None:
    task = new_task()
    epoch = recorder.take_lease(task, "run-a")
    stored = recorder.append_fenced(task, epoch, [ev(f"{task}:1", v="original")])

    with pytest.raises(sa.exc.DBAPIError, match="append-only"), engine.begin() as conn:
        conn.execute(sa.text(statement), {"t": task})

    assert recorder.read_events(task) == stored


def test_recorded_at_is_the_database_clock_and_never_goes_back(recorder: Recorder, engine: sa.Engine) -> None:
    task = new_task()
    epoch = recorder.take_lease(task, "run-a")
    for i in range(5):
        recorder.append_fenced(task, epoch, [ev(f"{task}:f{i}:{j}") for j in range(3)])
        recorder.append_idempotent(task, ev(f"{task}:i{i}"))

    stamps = [e.recorded_at for e in recorder.read_events(task)]
    assert stamps == sorted(stamps)
    assert len(set(stamps)) > 1  # clock_timestamp(), not the transaction-frozen now()
    with engine.connect() as conn:
        default = conn.execute(
            sa.text(
                "SELECT pg_get_expr(d.adbin, d.adrelid) FROM pg_attrdef d JOIN pg_attribute a"
                " ON a.attrelid = d.adrelid AND a.attnum = d.adnum"
                " WHERE d.adrelid = 'events'::regclass AND a.attname = 'recorded_at'"
            )
        ).scalar_one()
    assert default == "clock_timestamp()"


def test_create_schema_again_and_concurrently_is_harmless(recorder: Recorder, pg_url: str) -> None:
    task = new_task()
    epoch = recorder.take_lease(task, "run-a")
    stored = recorder.append_fenced(task, epoch, [ev(f"{task}:1")])
    recorder.create_schema()
    recorder.create_schema()
    assert recorder.read_events(task) == stored

    # A fresh database, so the racing processes really create the tables and triggers.
    database = f"lf_schema_{new_task()}"
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{database}"'))
        url = sa.make_url(pg_url).set(database=database).render_as_string(hide_password=False)
        racers = [Recorder(url, pool_size=1) for _ in range(4)]
        try:
            run_concurrently([r.create_schema for r in racers])
            fresh = new_task()
            assert racers[0].append_fenced(fresh, racers[0].take_lease(fresh, "x"), [ev("k")])[0].seq == 1
        finally:
            for r in racers:
                r.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE "{database}" WITH (FORCE)'))
    finally:
        admin.dispose()


# --- reads --------------------------------------------------------------------------------------------------


def test_reads_page_by_seq_and_find_by_keys(recorder: Recorder) -> None:
    task = new_task()
    epoch = recorder.take_lease(task, "run-a")
    op = f"{task}:op"
    stored = recorder.append_fenced(
        task,
        epoch,
        [NewEvent(type="E", dedup_key=f"{task}:{i}", operation_key=op if i % 2 else None) for i in range(6)],
    )

    assert recorder.read_events(task, after_seq=2) == stored[2:]
    assert recorder.read_events(task, after_seq=1, limit=2) == stored[1:3]
    assert recorder.read_events(task, after_seq=6) == []
    assert recorder.find_by_dedup_key(f"{task}:4") == stored[4]
    assert recorder.events_by_operation_key(op) == [stored[1], stored[3], stored[5]]
    assert task in recorder.task_ids()


# --- failures -----------------------------------------------------------------------------------------------


def test_unreachable_database_raises_ledger_unavailable() -> None:
    closed = Recorder(f"postgresql+psycopg://postgres@127.0.0.1:{pg.free_port()}/postgres", pool_size=1)
    try:
        with pytest.raises(LedgerUnavailable) as caught:
            closed.take_lease(new_task(), "run-a")
        assert isinstance(caught.value.__cause__, sa.exc.OperationalError)
        with pytest.raises(LedgerUnavailable):
            closed.read_events(new_task())
    finally:
        closed.dispose()


def test_committed_events_survive_a_postgres_crash_and_the_recorder_reconnects(pg_scratch_dir: Path) -> None:
    data_dir = pg_scratch_dir / "data"
    instance = pg.init_and_start(data_dir)
    rec = Recorder(instance.url, pool_size=2)
    try:
        rec.create_schema()
        task = new_task()
        epoch = rec.take_lease(task, "run-a")
        stored = rec.append_fenced(task, epoch, [ev(f"{task}:{i}") for i in range(3)])

        pg.kill(data_dir)
        with pytest.raises(LedgerUnavailable):
            rec.read_events(task)
        assert pg.init_and_start(data_dir, port=instance.port).port == instance.port

        assert rec.read_events(task) == stored
        assert [e.seq for e in rec.append_fenced(task, epoch, [ev(f"{task}:after")])] == [4]
    finally:
        rec.dispose()
        pg.stop(data_dir)


def test_ledger_errors_pickle_with_their_fields() -> None:
    stale = pickle.loads(pickle.dumps(StaleEpoch("t", 1, 2)))
    assert (stale.task_id, stale.expected, stale.actual, str(stale)) == (
        "t",
        1,
        2,
        str(StaleEpoch("t", 1, 2)),
    )
    assert pickle.loads(pickle.dumps(DuplicateEvent("k"))).dedup_key == "k"
    assert pickle.loads(pickle.dumps(TaskNotFound("t"))).task_id == "t"


# --- invariants under random interleavings ------------------------------------------------------------------

KEYS = 6  # a small key pool, so repeats within a batch, across batches and across paths are common

operations = st.lists(
    st.one_of(
        st.tuples(st.just("fenced"), st.lists(st.integers(0, KEYS - 1), min_size=1, max_size=3)),
        st.tuples(st.just("idempotent"), st.integers(0, KEYS - 1)),
        st.tuples(st.just("take_lease"), st.just(0)),
        st.tuples(st.just("stale"), st.integers(0, KEYS - 1)),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations)
def test_random_interleavings_keep_seqs_gapless_and_dedup_keys_unique(
    recorder: Recorder, ops: list[tuple[str, Any]]
) -> None:
    task = new_task()
    epoch = recorder.take_lease(task, "run-0")
    seq_of: dict[str, int] = {}  # the model: dedup key -> the seq it was stored at

    def key(i: int) -> str:
        return f"{task}:{i}"

    for op, arg in ops:
        if op == "fenced":
            keys = [key(i) for i in arg]
            if len(set(keys)) < len(keys) or any(k in seq_of for k in keys):
                with pytest.raises(DuplicateEvent):
                    recorder.append_fenced(task, epoch, [ev(k) for k in keys])
            else:
                for stored in recorder.append_fenced(task, epoch, [ev(k) for k in keys]):
                    assert stored.seq == len(seq_of) + 1
                    seq_of[stored.dedup_key] = stored.seq
        elif op == "idempotent":
            stored, inserted = recorder.append_idempotent(task, ev(key(arg)))
            assert inserted == (key(arg) not in seq_of)
            seq_of.setdefault(key(arg), len(seq_of) + 1)
            assert stored.seq == seq_of[key(arg)]
        elif op == "take_lease":
            epoch = recorder.take_lease(task, f"run-{epoch}")
        else:
            with pytest.raises(StaleEpoch):
                recorder.append_fenced(task, epoch - 1, [ev(f"{task}:stale:{arg}")])

    stored_events = recorder.read_events(task)
    assert [e.seq for e in stored_events] == list(range(1, len(stored_events) + 1))
    assert {e.dedup_key: e.seq for e in stored_events} == seq_of


def test_create_schema_on_a_current_schema_runs_no_ddl(recorder: Recorder, pg_url: str) -> None:
    """Every CLI command and worker start calls create_schema: on a current schema it must not replace the
    triggers (that DDL locks the events table exclusively)."""
    engine = sa.create_engine(pg_url)
    query = sa.text(
        "SELECT oid FROM pg_trigger WHERE tgrelid = 'events'::regclass AND NOT tgisinternal ORDER BY oid"
    )
    try:
        with engine.connect() as conn:
            before = conn.execute(query).scalars().all()
        recorder.create_schema()
        with engine.connect() as conn:
            after = conn.execute(query).scalars().all()
    finally:
        engine.dispose()
    assert before and after == before
