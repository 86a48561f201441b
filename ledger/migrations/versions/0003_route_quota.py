"""A route's concurrency quota across every task and worker, and its queue.

``route_slots`` (one row per operation holding a slot: taken with its INTENT, given back with its result) and
``route_waiters`` (the dispatches waiting for a slot, with their priority, deadline and since when).
Idempotent like the baseline (IF NOT EXISTS).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_NOW = sa.text("clock_timestamp()")


def upgrade() -> None:
    op.create_table(
        "route_slots",
        sa.Column("operation_key", sa.Text, primary_key=True),
        sa.Column("route", sa.Text, nullable=False),
        sa.Column("task_id", sa.Text, nullable=False),
        sa.Column("taken_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=_NOW),
        if_not_exists=True,
    )
    op.create_index("ix_route_slots_route", "route_slots", ["route"], if_not_exists=True)
    op.create_table(
        "route_waiters",
        sa.Column("operation_key", sa.Text, primary_key=True),
        sa.Column("route", sa.Text, nullable=False),
        sa.Column("task_id", sa.Text, nullable=False),
        sa.Column("priority", sa.Text, nullable=False),
        sa.Column("deadline", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("since", sa.TIMESTAMP(timezone=True), nullable=False),
        sa.Column("seen_at", sa.TIMESTAMP(timezone=True), nullable=False),
        if_not_exists=True,
    )
    op.create_index("ix_route_waiters_route", "route_waiters", ["route"], if_not_exists=True)


def downgrade() -> None:
    op.drop_table("route_waiters")
    op.drop_table("route_slots")
