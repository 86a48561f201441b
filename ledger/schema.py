"""The ledger's tables, and the database-side rules that keep ``events`` append-only.

``events`` holds every fact, keyed by ``(task_id, seq)`` with a gapless per-task ``seq``; ``task_leases``
holds one row per task (never deleted) with the fencing ``epoch`` and the next ``seq`` to hand out.
Append-only is enforced by triggers in the database, not by convention: UPDATE, DELETE and TRUNCATE of
``events`` raise, and so do DELETE and TRUNCATE of ``task_leases``.

``budget_accounts`` is different: mutable enforcement state, one row per scope (``project:P``,
``episode:P/E``, ``task:T``) with its ceiling and its reserved and spent totals, updated in the same
transactions as the events that explain each change. The events stay the record; the audit compares the two.
A task's scopes are listed, outermost first, in ``task_leases.budget_scopes``.
"""

from __future__ import annotations

from typing import Final

from sqlalchemy import (
    TIMESTAMP,
    BigInteger,
    CheckConstraint,
    Column,
    Connection,
    Engine,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Numeric,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from rules.money import MONEY_SCALE

metadata: Final = MetaData()

task_leases: Final = Table(
    "task_leases",
    metadata,
    Column("task_id", Text, primary_key=True),
    Column("epoch", BigInteger, nullable=False),
    Column("holder", Text, nullable=True),
    Column("next_seq", BigInteger, nullable=False, server_default=text("1")),
    Column("renewed_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Column("created_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    # The task's budget scopes, outermost first. Added after the first release: create_schema_on also adds it
    # to an existing table (see _UPGRADES).
    Column("budget_scopes", ARRAY(Text), nullable=False, server_default=text("'{}'")),
    CheckConstraint("epoch >= 1", name="ck_task_leases_epoch_positive"),
    CheckConstraint("next_seq >= 1", name="ck_task_leases_next_seq_positive"),
    # tasks_in_scope: which tasks draw on a scope (budget_scopes @> ARRAY[scope]).
    Index("ix_task_leases_budget_scopes", "budget_scopes", postgresql_using="gin"),
)

# Money in micro-units (rules.money: one scale for the plan, the adapters and the ledger), up to 10^14.

budget_accounts: Final = Table(
    "budget_accounts",
    metadata,
    Column("scope", Text, primary_key=True),
    Column("ceiling", Numeric(20, MONEY_SCALE, asdecimal=True), nullable=True),  # NULL = unlimited
    Column("reserved", Numeric(20, MONEY_SCALE, asdecimal=True), nullable=False, server_default=text("0")),
    Column("spent", Numeric(20, MONEY_SCALE, asdecimal=True), nullable=False, server_default=text("0")),
    Column("updated_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    CheckConstraint("reserved >= 0", name="ck_budget_accounts_reserved_non_negative"),
    CheckConstraint("spent >= 0", name="ck_budget_accounts_spent_non_negative"),
    CheckConstraint("ceiling >= 0", name="ck_budget_accounts_ceiling_non_negative"),
)

events: Final = Table(
    "events",
    metadata,
    Column("task_id", Text, ForeignKey("task_leases.task_id"), primary_key=True),
    Column("seq", BigInteger, primary_key=True, autoincrement=False),
    Column("type", Text, nullable=False),
    Column("schema_version", Integer, nullable=False, server_default=text("1")),
    Column("epoch", BigInteger, nullable=False),
    Column("dedup_key", Text, nullable=False),
    Column("operation_key", Text, nullable=True),
    Column("payload", JSONB, nullable=False),
    # clock_timestamp(), not now(): now() is frozen at transaction start, so rows of one batch would share it.
    Column("recorded_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    # Named, because the recorder recognises a dedup conflict by this constraint's name.
    UniqueConstraint("dedup_key", name="uq_events_dedup_key"),
    CheckConstraint("seq >= 1", name="ck_events_seq_positive"),
    Index("ix_events_operation_key", "operation_key"),
)

DEDUP_CONSTRAINT: Final = "uq_events_dedup_key"

# What happened to each vendor route, append-only: a credentials error pauses it (every worker and task sees
# it at once), a person resumes it after fixing the key. A route's state is its latest event.
route_events: Final = Table(
    "route_events",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("route", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("reason", Text, nullable=False, server_default=text("''")),
    Column("actor", Text, nullable=False),
    Column("recorded_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    CheckConstraint("kind IN ('paused', 'resumed')", name="ck_route_events_kind"),
    Index("ix_route_events_route", "route", "id"),
)

# The approver key registry (rules.approvers), append-only: ``add`` registers a public key with what it may
# sign, ``revoke`` ends it. Written only by ``ledgerflow keys`` (its actor and reason are the audit trail);
# a key id is added once (rotation is a new key id, then a revoke of the old one).
approver_keys: Final = Table(
    "approver_keys",
    metadata,
    Column("seq", BigInteger, primary_key=True, autoincrement=True),
    Column("key_id", Text, nullable=False),
    Column("action", Text, nullable=False),
    Column("approver", Text, nullable=False),
    Column("public_key", Text, nullable=False),
    Column("kinds", ARRAY(Text), nullable=False, server_default=text("'{}'")),
    Column("scopes", ARRAY(Text), nullable=False, server_default=text("'{*}'")),
    Column("not_before", TIMESTAMP(timezone=True), nullable=True),
    Column("expires_at", TIMESTAMP(timezone=True), nullable=True),
    Column("reason", Text, nullable=False, server_default=text("''")),
    Column("actor", Text, nullable=False),
    Column("recorded_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    CheckConstraint("action IN ('add', 'revoke')", name="ck_approver_keys_action"),
    Index("uq_approver_keys_add", "key_id", unique=True, postgresql_where=text("action = 'add'")),
)
APPROVER_KEY_CONSTRAINT: Final = "uq_approver_keys_add"

# An arbitrary constant shared by every process creating the schema ("ledger" in ASCII).
_SCHEMA_LOCK_KEY: Final = 0x6C6564676572

_REFUSE_FUNCTION: Final = """
CREATE OR REPLACE FUNCTION ledger_refuse_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'ledger: % on table % is refused (the ledger is append-only)', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation', HINT = 'record a new event instead of changing an old one';
END;
$$
"""

# Statement-level, so a statement is refused even when it matches no row (and TRUNCATE has no rows at all).
_TRIGGERS: Final = (
    ("events_append_only", "BEFORE UPDATE OR DELETE OR TRUNCATE ON events"),
    ("task_leases_never_deleted", "BEFORE DELETE OR TRUNCATE ON task_leases"),
    ("route_events_append_only", "BEFORE UPDATE OR DELETE OR TRUNCATE ON route_events"),
    ("approver_keys_append_only", "BEFORE UPDATE OR DELETE OR TRUNCATE ON approver_keys"),
)


# In-place upgrades of databases created by an earlier release; each is a no-op once applied. create_all
# (checkfirst) skips an existing table whole, so a column or index added to one later must be added here too.
# ALTER TABLE takes an ACCESS EXCLUSIVE lock on task_leases for an instant (a constant default rewrites no
# row), even when the column exists; create_schema runs once per process start.
_UPGRADES: Final = (
    "ALTER TABLE task_leases ADD COLUMN IF NOT EXISTS budget_scopes text[] NOT NULL DEFAULT '{}'",
    "CREATE INDEX IF NOT EXISTS ix_task_leases_budget_scopes ON task_leases USING gin (budget_scopes)",
    # Reuse across a project: the outputs registered for a given input hash (rules.inputs).
    "CREATE INDEX IF NOT EXISTS ix_events_outcome_input_hash ON events ((payload->>'input_hash'))"
    " WHERE type = 'Outcome'",
)


# Bump when the DDL below changes: databases at an older version run it again (it is idempotent).
SCHEMA_VERSION = 4


def create_schema_on(conn: Connection) -> None:
    """Create the tables, the refusing function and its triggers on ``conn``, inside its transaction.

    Idempotent. The caller owns the transaction; ``create_schema`` is the usual entry point.
    """
    # Two processes starting at once would otherwise race on CREATE TABLE IF NOT EXISTS and on replacing the
    # function ("tuple concurrently updated"); the xact lock serializes them and is released at commit.
    conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SCHEMA_LOCK_KEY})
    metadata.create_all(conn, checkfirst=True)
    for statement in _UPGRADES:
        conn.execute(text(statement))
    conn.execute(text(_REFUSE_FUNCTION))
    for name, timing in _TRIGGERS:
        table = timing.rsplit(" ", 1)[1]
        conn.execute(text(f"DROP TRIGGER IF EXISTS {name} ON {table}"))
        conn.execute(
            text(f"CREATE TRIGGER {name} {timing} FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change()")
        )
    conn.execute(text("CREATE TABLE IF NOT EXISTS ledger_schema_version (version integer PRIMARY KEY)"))
    conn.execute(
        text("INSERT INTO ledger_schema_version VALUES (:v) ON CONFLICT DO NOTHING"), {"v": SCHEMA_VERSION}
    )


def schema_version(conn: Connection) -> int | None:
    """The schema version recorded in the database, or None before ledgerflow created its schema there."""
    if conn.execute(text("SELECT to_regclass('ledger_schema_version')")).scalar() is None:
        return None
    version: int | None = conn.execute(text("SELECT max(version) FROM ledger_schema_version")).scalar()
    return version


def create_schema(engine: Engine) -> None:
    """Create or upgrade the ledger schema; safe to repeat, and to race from several processes.

    Every process calls this when it starts (workers, every CLI command), so a current schema costs one read:
    the DDL (it replaces triggers, locking ``events`` exclusively) runs only when the version is behind.
    """
    with engine.connect() as conn:
        if schema_version(conn) == SCHEMA_VERSION:
            return
    with engine.begin() as conn:
        create_schema_on(conn)
