"""Baseline: the ledger's schema as the releases before migrations made it (their schema version 4).

Every statement is idempotent (IF NOT EXISTS, CREATE OR REPLACE, DROP then CREATE of the triggers), so this
revision both creates a new database and adopts one made by an earlier release: there it adds only what that
release lacked (budgets, route events, approver keys, their indexes and triggers), then Alembic records it.

Revision ID: 0001
Revises:
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# Written out, not taken from ledger.schema: a revision is frozen, the metadata moves on.
_MONEY = sa.Numeric(20, 6)
_NOW = sa.text("clock_timestamp()")

_REFUSE_FUNCTION = """
CREATE OR REPLACE FUNCTION ledger_refuse_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'ledger: % on table % is refused (the ledger is append-only)', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation', HINT = 'record a new event instead of changing an old one';
END;
$$
"""

_REFUSE = "EXECUTE FUNCTION ledger_refuse_change()"
# Statement-level, so a statement is refused even when it matches no row (and TRUNCATE has no rows at all).
_TRIGGERS = (
    ("events_append_only", "BEFORE UPDATE OR DELETE OR TRUNCATE ON events"),
    ("task_leases_never_deleted", "BEFORE DELETE OR TRUNCATE ON task_leases"),
    ("route_events_append_only", "BEFORE UPDATE OR DELETE OR TRUNCATE ON route_events"),
    ("approver_keys_append_only", "BEFORE UPDATE OR DELETE OR TRUNCATE ON approver_keys"),
)


def upgrade() -> None:
    op.create_table(
        "task_leases",
        sa.Column("task_id", sa.Text, primary_key=True),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("holder", sa.Text, nullable=True),
        sa.Column("next_seq", sa.BigInteger, nullable=False, server_default=sa.text("1")),
        sa.Column("renewed_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=_NOW),
        sa.Column("created_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=_NOW),
        sa.CheckConstraint("epoch >= 1", name="ck_task_leases_epoch_positive"),
        sa.CheckConstraint("next_seq >= 1", name="ck_task_leases_next_seq_positive"),
        if_not_exists=True,
    )
    # Budgets came after the first release: a separate statement, so a task_leases of that release gets it.
    # A constant default: Postgres adds the column without rewriting a row.
    op.execute("ALTER TABLE task_leases ADD COLUMN IF NOT EXISTS budget_scopes text[] NOT NULL DEFAULT '{}'")
    # tasks_in_scope: which tasks draw on a scope (budget_scopes @> ARRAY[scope]).
    op.create_index(
        "ix_task_leases_budget_scopes",
        "task_leases",
        ["budget_scopes"],
        postgresql_using="gin",
        if_not_exists=True,
    )

    op.create_table(
        "budget_accounts",
        sa.Column("scope", sa.Text, primary_key=True),
        sa.Column("ceiling", _MONEY, nullable=True),
        sa.Column("reserved", _MONEY, nullable=False, server_default=sa.text("0")),
        sa.Column("spent", _MONEY, nullable=False, server_default=sa.text("0")),
        sa.Column("updated_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=_NOW),
        sa.CheckConstraint("reserved >= 0", name="ck_budget_accounts_reserved_non_negative"),
        sa.CheckConstraint("spent >= 0", name="ck_budget_accounts_spent_non_negative"),
        sa.CheckConstraint("ceiling >= 0", name="ck_budget_accounts_ceiling_non_negative"),
        if_not_exists=True,
    )

    op.create_table(
        "events",
        sa.Column("task_id", sa.Text, sa.ForeignKey("task_leases.task_id"), primary_key=True),
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("type", sa.Text, nullable=False),
        sa.Column("schema_version", sa.Integer, nullable=False, server_default=sa.text("1")),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("dedup_key", sa.Text, nullable=False),
        sa.Column("operation_key", sa.Text, nullable=True),
        sa.Column("payload", JSONB, nullable=False),
        sa.Column("recorded_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=_NOW),
        sa.UniqueConstraint("dedup_key", name="uq_events_dedup_key"),
        sa.CheckConstraint("seq >= 1", name="ck_events_seq_positive"),
        if_not_exists=True,
    )
    op.create_index("ix_events_operation_key", "events", ["operation_key"], if_not_exists=True)
    op.create_index(
        "ix_events_outcome_input_hash",
        "events",
        [sa.text("(payload ->> 'input_hash')")],
        postgresql_where=sa.text("type = 'Outcome'"),
        if_not_exists=True,
    )

    op.create_table(
        "route_events",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("route", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("reason", sa.Text, nullable=False, server_default=sa.text("''")),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("recorded_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=_NOW),
        sa.CheckConstraint("kind IN ('paused', 'resumed')", name="ck_route_events_kind"),
        if_not_exists=True,
    )
    op.create_index("ix_route_events_route", "route_events", ["route", "id"], if_not_exists=True)

    op.create_table(
        "approver_keys",
        sa.Column("seq", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("key_id", sa.Text, nullable=False),
        sa.Column("action", sa.Text, nullable=False),
        sa.Column("approver", sa.Text, nullable=False),
        sa.Column("public_key", sa.Text, nullable=False),
        sa.Column("kinds", ARRAY(sa.Text), nullable=False, server_default=sa.text("'{}'")),
        sa.Column("scopes", ARRAY(sa.Text), nullable=False, server_default=sa.text("'{*}'")),
        sa.Column("not_before", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("expires_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("reason", sa.Text, nullable=False, server_default=sa.text("''")),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("recorded_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=_NOW),
        sa.CheckConstraint("action IN ('add', 'revoke')", name="ck_approver_keys_action"),
        if_not_exists=True,
    )
    # A key id is added once; revokes repeat it.
    op.create_index(
        "uq_approver_keys_add",
        "approver_keys",
        ["key_id"],
        unique=True,
        postgresql_where=sa.text("action = 'add'"),
        if_not_exists=True,
    )

    # Append-only by the database, not by convention.
    op.execute(_REFUSE_FUNCTION)
    for name, timing in _TRIGGERS:
        table = timing.rsplit(" ", 1)[1]
        op.execute(f"DROP TRIGGER IF EXISTS {name} ON {table}")
        op.execute(f"CREATE TRIGGER {name} {timing} FOR EACH STATEMENT {_REFUSE}")

    # The version marker of the releases before migrations, kept at their last version: one of them started
    # against this database (a rollback) finds its own schema and runs no DDL. A later revision that such a
    # release cannot run on should make it refuse here: CHECK (version > 4), which its INSERT of 4 fails.
    op.execute("CREATE TABLE IF NOT EXISTS ledger_schema_version (version integer PRIMARY KEY)")
    op.execute("INSERT INTO ledger_schema_version VALUES (4) ON CONFLICT DO NOTHING")


def downgrade() -> None:
    raise NotImplementedError("the baseline is not downgraded: that would drop the ledger's record")
