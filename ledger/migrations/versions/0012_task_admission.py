"""Admission at the task level: ``task_admission``, one row per task in a bounded queue (ledger.admission).

With ``LEDGERFLOW_ACTIVE_TASKS`` set, a new task enters its task queue's admission queue when it opens, waits
there until fewer than that many tasks run, and leaves it when it ends. A working table like ``human_queue``
(rows are deleted), not a record: the task's own ledger says when it started its work. It starts empty.

Grants: the worker inserts a row (its task, queue and rank), marks it admitted (when, and by whose change) and
deletes it; every role of revision 0006 reads it.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_READERS = ("ledgerflow_worker", "ledgerflow_operator", "ledgerflow_reader")


def upgrade() -> None:
    op.create_table(
        "task_admission",
        sa.Column("task_id", sa.Text, primary_key=True),
        sa.Column("queue", sa.Text, nullable=False),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column(
            "asked_at",
            sa.TIMESTAMP(timezone=True),
            nullable=False,
            server_default=sa.text("clock_timestamp()"),
        ),
        sa.Column("admitted_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("admitted_by", sa.Text, nullable=True),
        if_not_exists=True,
    )
    op.create_index(
        "ix_task_admission_queue",
        "task_admission",
        ["queue", "rank", "asked_at"],
        if_not_exists=True,
    )
    op.execute("REVOKE ALL ON task_admission FROM PUBLIC")
    op.execute(f"GRANT SELECT ON task_admission TO {', '.join(_READERS)}")
    op.execute(
        "GRANT INSERT (task_id, queue, rank), UPDATE (admitted_at, admitted_by), DELETE ON task_admission"
        " TO ledgerflow_worker"
    )


def downgrade() -> None:
    op.drop_table("task_admission")
