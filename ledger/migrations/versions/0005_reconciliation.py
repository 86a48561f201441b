"""The scheduled billing reconciliation's own record: ``billing_reconciliation``, append-only.

What the reconciliation found that belongs to no task — a charge no operation knows, a charge two operations
claim, a credit against the operation it refunds — and a row per run. A vendor's line is recorded once
(UNIQUE ``dedup_key``); UPDATE, DELETE and TRUNCATE are refused by the baseline's ``ledger_refuse_change``
trigger, as on ``events``. Idempotent like the baseline (IF NOT EXISTS, DROP then CREATE of the trigger).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_NOW = sa.text("clock_timestamp()")
_TRIGGER = "billing_reconciliation_append_only"


def upgrade() -> None:
    op.create_table(
        "billing_reconciliation",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("dedup_key", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("route", sa.Text, nullable=True),
        sa.Column("account", sa.Text, nullable=True),
        sa.Column("job_id", sa.Text, nullable=True),
        sa.Column("line_key", sa.Text, nullable=True),
        sa.Column("operation_key", sa.Text, nullable=True),
        sa.Column("amount", sa.Text, nullable=True),
        sa.Column("charged_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("run_id", sa.Text, nullable=True),
        sa.Column("evidence", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("recorded_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=_NOW),
        sa.UniqueConstraint("dedup_key", name="uq_billing_reconciliation_dedup_key"),
        sa.CheckConstraint(
            "kind IN ('unknown_charge', 'ambiguous_charge', 'credit', 'run')",
            name="ck_billing_reconciliation_kind",
        ),
        if_not_exists=True,
    )
    op.create_index(
        "ix_billing_reconciliation_kind", "billing_reconciliation", ["kind", "route"], if_not_exists=True
    )
    # Append-only by the database (the baseline's function), statement-level like the events table's.
    op.execute(f"DROP TRIGGER IF EXISTS {_TRIGGER} ON billing_reconciliation")
    op.execute(
        f"CREATE TRIGGER {_TRIGGER} BEFORE UPDATE OR DELETE OR TRUNCATE ON billing_reconciliation"
        " FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change()"
    )


def downgrade() -> None:
    op.drop_table("billing_reconciliation")
