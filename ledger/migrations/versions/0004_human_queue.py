"""The shared queue of open human requests, for backpressure (rules.pressure).

``human_queue``: one row per request a person has not answered yet (task, request id, kind, the task's project
scope), written in the transaction of the event that opens or closes it. A dispatch's INTENT reads its
project's count in its fencing statement. Idempotent like the baseline (IF NOT EXISTS). The queue starts
empty: requests already open when a database is upgraded are added by ``ledgerflow db sync-queue`` (from each
task's ledger; also a repair).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "human_queue",
        sa.Column("task_id", sa.Text, primary_key=True),
        sa.Column("request_id", sa.Text, primary_key=True),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("scope", sa.Text, nullable=False),
        sa.Column(
            "opened_at",
            sa.TIMESTAMP(timezone=True),
            nullable=False,
            server_default=sa.text("clock_timestamp()"),
        ),
        if_not_exists=True,
    )
    op.create_index("ix_human_queue_scope", "human_queue", ["scope"], if_not_exists=True)


def downgrade() -> None:
    op.drop_table("human_queue")
