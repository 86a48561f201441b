"""Schema migrations on real Postgres: the baseline, adoption of earlier databases, and the start-up check.

Each test makes its own databases on the session's server (``CREATE DATABASE``), so upgrades, races and
adoptions start from exactly the state they name.
"""

from __future__ import annotations

import pickle
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from ledger import migrate
from ledger.errors import LedgerError, LedgerUnavailable, SchemaMismatch
from ledger.migrate import HEAD
from ledger.recorder import Recorder
from ledger.schema import metadata
from ledgerflow.stack import pg
from rules.envelope import NewEvent

# What ``create_schema_on`` of the last release before migrations (its SCHEMA_VERSION 4) made, frozen: its
# ``metadata.create_all`` DDL as SQLAlchemy emitted it, then its upgrades, the refusing function, the triggers
# and its version marker.
LEGACY_V4 = """
CREATE TABLE approver_keys (
    seq BIGSERIAL NOT NULL,
    key_id TEXT NOT NULL,
    action TEXT NOT NULL,
    approver TEXT NOT NULL,
    public_key TEXT NOT NULL,
    kinds TEXT[] DEFAULT '{}' NOT NULL,
    scopes TEXT[] DEFAULT '{*}' NOT NULL,
    not_before TIMESTAMP WITH TIME ZONE,
    expires_at TIMESTAMP WITH TIME ZONE,
    reason TEXT DEFAULT '' NOT NULL,
    actor TEXT NOT NULL,
    recorded_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    PRIMARY KEY (seq),
    CONSTRAINT ck_approver_keys_action CHECK (action IN ('add', 'revoke'))
);
CREATE UNIQUE INDEX uq_approver_keys_add ON approver_keys (key_id) WHERE action = 'add';
CREATE TABLE budget_accounts (
    scope TEXT NOT NULL,
    ceiling NUMERIC(20, 6),
    reserved NUMERIC(20, 6) DEFAULT 0 NOT NULL,
    spent NUMERIC(20, 6) DEFAULT 0 NOT NULL,
    updated_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    PRIMARY KEY (scope),
    CONSTRAINT ck_budget_accounts_reserved_non_negative CHECK (reserved >= 0),
    CONSTRAINT ck_budget_accounts_spent_non_negative CHECK (spent >= 0),
    CONSTRAINT ck_budget_accounts_ceiling_non_negative CHECK (ceiling >= 0)
);
CREATE TABLE route_events (
    id BIGSERIAL NOT NULL,
    route TEXT NOT NULL,
    kind TEXT NOT NULL,
    reason TEXT DEFAULT '' NOT NULL,
    actor TEXT NOT NULL,
    recorded_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    PRIMARY KEY (id),
    CONSTRAINT ck_route_events_kind CHECK (kind IN ('paused', 'resumed'))
);
CREATE INDEX ix_route_events_route ON route_events (route, id);
CREATE TABLE task_leases (
    task_id TEXT NOT NULL,
    epoch BIGINT NOT NULL,
    holder TEXT,
    next_seq BIGINT DEFAULT 1 NOT NULL,
    renewed_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    created_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    budget_scopes TEXT[] DEFAULT '{}' NOT NULL,
    PRIMARY KEY (task_id),
    CONSTRAINT ck_task_leases_epoch_positive CHECK (epoch >= 1),
    CONSTRAINT ck_task_leases_next_seq_positive CHECK (next_seq >= 1)
);
CREATE INDEX ix_task_leases_budget_scopes ON task_leases USING gin (budget_scopes);
CREATE TABLE events (
    task_id TEXT NOT NULL,
    seq BIGINT NOT NULL,
    type TEXT NOT NULL,
    schema_version INTEGER DEFAULT 1 NOT NULL,
    epoch BIGINT NOT NULL,
    dedup_key TEXT NOT NULL,
    operation_key TEXT,
    payload JSONB NOT NULL,
    recorded_at TIMESTAMP WITH TIME ZONE DEFAULT clock_timestamp() NOT NULL,
    PRIMARY KEY (task_id, seq),
    CONSTRAINT uq_events_dedup_key UNIQUE (dedup_key),
    CONSTRAINT ck_events_seq_positive CHECK (seq >= 1),
    FOREIGN KEY(task_id) REFERENCES task_leases (task_id)
);
CREATE INDEX ix_events_operation_key ON events (operation_key);
CREATE INDEX IF NOT EXISTS ix_events_outcome_input_hash ON events ((payload->>'input_hash'))
    WHERE type = 'Outcome';
CREATE OR REPLACE FUNCTION ledger_refuse_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'ledger: % on table % is refused (the ledger is append-only)', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation', HINT = 'record a new event instead of changing an old one';
END;
$$;
CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE OR TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change();
CREATE TRIGGER task_leases_never_deleted BEFORE DELETE OR TRUNCATE ON task_leases
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change();
CREATE TRIGGER route_events_append_only BEFORE UPDATE OR DELETE OR TRUNCATE ON route_events
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change();
CREATE TRIGGER approver_keys_append_only BEFORE UPDATE OR DELETE OR TRUNCATE ON approver_keys
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change();
CREATE TABLE IF NOT EXISTS ledger_schema_version (version integer PRIMARY KEY);
INSERT INTO ledger_schema_version VALUES (4) ON CONFLICT DO NOTHING;
"""

# Back from LEGACY_V4 to the first release: no budgets, route events or approver keys, no version marker.
FIRST_RELEASE = """
DROP TABLE budget_accounts, route_events, approver_keys, ledger_schema_version;
DROP INDEX ix_events_outcome_input_hash;
ALTER TABLE task_leases DROP COLUMN budget_scopes;
"""

LEDGER_TABLES = {
    "task_leases",
    "events",
    "budget_accounts",
    "route_events",
    "approver_keys",
    "route_breakers",
    "route_observations",
    "route_changes",
    "route_slots",
    "route_waiters",
    "human_queue",
    "billing_reconciliation",
    "route_holds",
    "review_logouts",
    "vendor_callbacks",
    "releases",
    "task_admission",
}

# The catalog, as comparable rows: what "the same schema" means below. Column positions are ranks (a column
# dropped and added again leaves a gap in attnum, not in the table's shape).
_CATALOG = {
    "columns": """
        SELECT table_name, rank() OVER (PARTITION BY table_name ORDER BY ordinal_position), column_name,
               udt_name, is_nullable, column_default, numeric_precision, numeric_scale
        FROM information_schema.columns WHERE table_schema = current_schema() ORDER BY 1, 2""",
    "constraints": """
        SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint
        WHERE connamespace = current_schema()::regnamespace ORDER BY 1, 2""",
    "indexes": "SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema()"
    " ORDER BY 1, 2",
    "sequences": """
        SELECT sequence_name, data_type, start_value, increment FROM information_schema.sequences
        WHERE sequence_schema = current_schema() ORDER BY 1""",
    "triggers": "SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(oid) FROM pg_trigger"
    " WHERE NOT tgisinternal ORDER BY 1, 2",
    "functions": "SELECT proname, pg_get_functiondef(oid) FROM pg_proc"
    " WHERE pronamespace = current_schema()::regnamespace ORDER BY 1",
}


def catalog(url: str, *, without: frozenset[str] = frozenset()) -> dict[str, list[tuple[Any, ...]]]:
    """The schema's every table, column, constraint, index, sequence, trigger and function, as rows."""
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            found = {kind: [tuple(r) for r in conn.execute(sa.text(q))] for kind, q in _CATALOG.items()}
    finally:
        engine.dispose()
    # A row's first field names its table (or sequence, or function).
    return {kind: [r for r in rows if r[0] not in without] for kind, rows in found.items()}


def execute(url: str, sql: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.begin() as conn:
            result = conn.execute(sa.text(sql), params or {})
            return [tuple(r) for r in result] if result.returns_rows else []
    finally:
        engine.dispose()


@pytest.fixture
def new_db(pg_url: str) -> Iterator[Callable[[], str]]:
    """Make empty databases on the test server; each is dropped after the test."""
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    made: list[str] = []

    def make() -> str:
        name = f"lf_migrate_{uuid.uuid4().hex[:12]}"
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        made.append(name)
        return sa.make_url(pg_url).set(database=name).render_as_string(hide_password=False)

    try:
        yield make
    finally:
        with admin.connect() as conn:
            for name in made:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def legacy_db(new_db: Callable[[], str], *steps: str) -> str:
    url = new_db()
    for sql in (LEGACY_V4, *steps):
        execute(url, sql)
    return url


def record_something(url: str) -> tuple[Recorder, str, list[Any]]:
    rec = Recorder(url, pool_size=1)
    task = uuid.uuid4().hex
    stored = rec.append_fenced(task, rec.take_lease(task, "run-a"), [NewEvent(type="Noted", dedup_key=task)])
    return rec, task, stored


# --- upgrade ----------------------------------------------------------------------------------------------


def test_upgrade_creates_every_table_and_the_append_only_triggers_on_an_empty_database(
    new_db: Callable[[], str],
) -> None:
    url = new_db()

    assert migrate.upgrade(url).lines() == [f"created the ledger schema at revision {HEAD}"]

    assert migrate.current(url) == HEAD
    migrate.check(url)
    tables = {r[0] for r in execute(url, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert tables == LEDGER_TABLES | {"alembic_version", "ledger_schema_version"}
    rec, task, stored = record_something(url)
    try:
        assert rec.read_events(task) == stored
        for statement in (
            "UPDATE events SET type = 'x'",
            "DELETE FROM events",
            "DELETE FROM task_leases",
            "DELETE FROM route_changes",
        ):
            with pytest.raises(sa.exc.DBAPIError, match="append-only"):
                execute(url, statement)
        assert rec.read_events(task) == stored
    finally:
        rec.dispose()


def test_upgrade_again_is_a_no_op_that_runs_no_ddl(new_db: Callable[[], str]) -> None:
    url = new_db()
    migrate.upgrade(url)
    triggers = "SELECT oid FROM pg_trigger WHERE NOT tgisinternal ORDER BY oid"
    before = execute(url, triggers)

    again = migrate.upgrade(url)

    assert (again.before, again.after) == (HEAD, HEAD)
    assert again.lines() == [f"the ledger database is at revision {HEAD} already: nothing to do"]
    assert execute(url, triggers) == before  # the triggers were not replaced: no DDL ran
    assert execute(url, "SELECT version_num FROM alembic_version") == [(HEAD,)]


def test_concurrent_upgrades_of_an_empty_database_all_succeed_and_one_creates_it(
    new_db: Callable[[], str],
) -> None:
    url = new_db()
    barrier = threading.Barrier(4)

    def racer() -> migrate.Upgraded:
        barrier.wait()
        return migrate.upgrade(url)

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = [f.result() for f in [pool.submit(racer) for _ in range(4)]]

    assert sorted(r.before or "" for r in results) == ["", HEAD, HEAD, HEAD]
    assert execute(url, "SELECT version_num FROM alembic_version") == [(HEAD,)]
    migrate.check(url)


def test_recorder_create_schema_is_the_upgrade_and_check_schema_the_check(new_db: Callable[[], str]) -> None:
    url = new_db()
    rec = Recorder(url, pool_size=1)
    try:
        with pytest.raises(SchemaMismatch, match="has no schema"):
            rec.check_schema()
        rec.create_schema()
        rec.check_schema()
        rec.create_schema()
        assert migrate.current(url) == HEAD
    finally:
        rec.dispose()


# --- adoption of databases made before migrations ---------------------------------------------------------


def test_a_database_of_the_last_release_before_migrations_is_adopted_with_its_records(
    new_db: Callable[[], str],
) -> None:
    url = legacy_db(new_db)
    rec, task, stored = record_something(url)
    try:
        with pytest.raises(SchemaMismatch) as refused:
            migrate.check(url)
        assert str(refused.value) == (
            "the ledger database has the schema of a ledgerflow from before migrations (schema version 4),"
            f" this ledgerflow needs revision {HEAD}: run `ledgerflow db upgrade`"
        )
        assert migrate.current(url) is None

        done = migrate.upgrade(url)

        assert done.lines() == [
            "adopted the ledger database of a ledgerflow from before migrations (schema version 4)",
            f"upgraded it to revision {HEAD}",
        ]
        migrate.check(url)
        assert rec.read_events(task) == stored
        with pytest.raises(sa.exc.DBAPIError, match="append-only"):
            execute(url, "UPDATE events SET type = 'x'")
        assert migrate.upgrade(url).before == HEAD
    finally:
        rec.dispose()


def test_a_database_of_the_first_release_is_adopted_into_the_whole_baseline(
    new_db: Callable[[], str],
) -> None:
    url = legacy_db(new_db, FIRST_RELEASE)
    fresh = new_db()
    migrate.upgrade(fresh)
    rec, task, stored = record_something(url)
    try:
        with pytest.raises(SchemaMismatch, match=r"before migrations \(no schema version\)"):
            migrate.check(url)

        assert migrate.upgrade(url).adopted == "no schema version"

        assert catalog(url) == catalog(fresh)
        assert rec.read_events(task) == stored
        assert rec.task_scopes(task) == []
        rec.open_budget(task, [("project:up", Decimal(3)), (f"task:{task}", Decimal(2))])
        assert [a.scope for a in rec.accounts()] == ["project:up", f"task:{task}"]
    finally:
        rec.dispose()


def test_the_baseline_is_exactly_the_schema_of_the_last_release_before_migrations(
    new_db: Callable[[], str],
) -> None:
    fresh = new_db()
    from alembic import command

    command.upgrade(migrate.config(fresh), "0001")  # the baseline alone (later revisions add to it)
    old = legacy_db(new_db)

    assert catalog(fresh, without=frozenset({"alembic_version"})) == catalog(old)
    assert execute(fresh, "SELECT version FROM ledger_schema_version") == [(4,)]


def test_the_baseline_is_the_schema_the_metadata_describes(new_db: Callable[[], str]) -> None:
    fresh, described = new_db(), new_db()
    migrate.upgrade(fresh)
    engine = sa.create_engine(described, poolclass=sa.NullPool)
    try:
        with engine.begin() as conn:
            metadata.create_all(conn)
    finally:
        engine.dispose()

    # Everything but what metadata does not hold (the triggers, their function, the version markers).
    tables = frozenset({"alembic_version", "ledger_schema_version"})
    ours = {k: v for k, v in catalog(fresh, without=tables).items() if k not in ("triggers", "functions")}
    assert ours == {k: v for k, v in catalog(described).items() if k not in ("triggers", "functions")}
    assert autogenerate_diff(fresh) == []
    # The comparison can fail: without an index the metadata declares, autogenerate reports it.
    execute(fresh, "DROP INDEX ix_events_outcome_input_hash")
    assert [d[0] for d in autogenerate_diff(fresh)] == ["add_index"]


def autogenerate_diff(url: str) -> list[Any]:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn,
                opts={
                    "include_name": migrate.include_name,
                    "compare_type": True,
                    "compare_server_default": True,
                },
            )
            return list(compare_metadata(context, metadata))
    finally:
        engine.dispose()


# --- the start-up check -----------------------------------------------------------------------------------


def test_check_refuses_a_database_without_a_schema(new_db: Callable[[], str]) -> None:
    url = new_db()
    with pytest.raises(SchemaMismatch) as refused:
        migrate.check(url)
    assert str(refused.value) == "the ledger database has no schema: run `ledgerflow db upgrade`"
    assert isinstance(refused.value, LedgerError)
    assert migrate.current(url) is None
    assert migrate.current_lines(url) == [
        "ledger database: no schema",
        f"this ledgerflow: revision {HEAD}",
        "the ledger database has no schema: run `ledgerflow db upgrade`",
    ]


def test_check_refuses_a_database_behind_this_ledgerflow(
    new_db: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = new_db()
    migrate.upgrade(url)
    monkeypatch.setattr(migrate, "HEAD", "9999")  # this ledgerflow as a later release would build it

    with pytest.raises(SchemaMismatch) as refused:
        migrate.check(url)

    assert str(refused.value) == (
        f"the ledger database is at revision {HEAD}, this ledgerflow needs 9999: run `ledgerflow db upgrade`"
    )


def test_check_and_upgrade_refuse_a_database_a_newer_ledgerflow_wrote(new_db: Callable[[], str]) -> None:
    url = new_db()
    migrate.upgrade(url)
    execute(url, "UPDATE alembic_version SET version_num = 'f00d'")
    message = (
        f"the ledger database is at revision f00d, newer than this ledgerflow (knows up to {HEAD}):"
        " upgrade ledgerflow"
    )

    with pytest.raises(SchemaMismatch) as refused:
        migrate.check(url)
    assert str(refused.value) == message
    with pytest.raises(SchemaMismatch, match="newer than this ledgerflow"):
        migrate.upgrade(url)
    rec = Recorder(url, pool_size=1)
    try:
        with pytest.raises(SchemaMismatch, match="newer than this ledgerflow"):
            rec.check_schema()
    finally:
        rec.dispose()

    assert migrate.current(url) == "f00d"  # nothing was changed
    assert migrate.current_lines(url)[-1] == message


def test_check_on_a_current_database_is_one_query(new_db: Callable[[], str]) -> None:
    url = new_db()
    migrate.upgrade(url)
    engine = sa.create_engine(url)
    statements: list[str] = []
    try:
        with engine.connect():
            pass  # the dialect's first-connect queries are not the check's
        sa.event.listen(engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
        migrate.check(engine)
    finally:
        engine.dispose()
    assert statements == ["SELECT version_num FROM alembic_version ORDER BY version_num"]


def test_check_of_an_unreachable_database_is_ledger_unavailable() -> None:
    with pytest.raises(LedgerUnavailable):
        migrate.check(f"postgresql+psycopg://postgres@127.0.0.1:{pg.free_port()}/postgres")


def test_schema_mismatch_keeps_its_arguments_across_pickling() -> None:
    error = SchemaMismatch("f00d", HEAD, True)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.database, copy.needed, copy.newer, copy.earlier, str(copy)) == (
        "f00d",
        HEAD,
        True,
        None,
        str(error),
    )


def test_head_is_the_newest_revision_of_the_scripts() -> None:
    assert migrate.heads() == [HEAD]
    assert migrate.known_revisions()[0] == HEAD
