"""Shared route health: a circuit breaker per route, its observations, and its append-only story.

``route_breakers`` (one mutable row per route: breaker state, probe and canary claims, qualification),
``route_observations`` (insert-only: what each call and each first review told) and ``route_changes``
(append-only: every breaker transition, switch, canary result and qualification, with its reason).

Idempotent like the baseline (IF NOT EXISTS; the trigger dropped and made again): a database adopted from a
release before migrations may be upgraded over tables this revision made.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_NOW = sa.text("clock_timestamp()")


def upgrade() -> None:
    op.create_table(
        "route_breakers",
        sa.Column("route", sa.Text, primary_key=True),
        sa.Column("state", sa.Text, nullable=False, server_default=sa.text("'closed'")),
        sa.Column("since", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("opened_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("reason", sa.Text, nullable=False, server_default=sa.text("''")),
        sa.Column("probe_key", sa.Text, nullable=True),
        sa.Column("canary_key", sa.Text, nullable=True),
        sa.Column("canary_outage", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("canary_passed", sa.Boolean, nullable=False, server_default=sa.text("false")),
        sa.Column("qualified_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("version", sa.BigInteger, nullable=False, server_default=sa.text("0")),
        sa.CheckConstraint("state IN ('closed', 'open', 'half_open')", name="ck_route_breakers_state"),
        if_not_exists=True,
    )
    op.create_table(
        "route_observations",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("route", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("operation_key", sa.Text, nullable=True),
        sa.Column("recorded_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=_NOW),
        if_not_exists=True,
    )
    op.create_index(
        "ix_route_observations_route", "route_observations", ["route", "recorded_at"], if_not_exists=True
    )
    op.create_table(
        "route_changes",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("route", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("reason", sa.Text, nullable=False, server_default=sa.text("''")),
        sa.Column("operation_key", sa.Text, nullable=True),
        sa.Column("detail", JSONB, nullable=True),
        sa.Column("recorded_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=_NOW),
        if_not_exists=True,
    )
    op.create_index("ix_route_changes_route", "route_changes", ["route", "id"], if_not_exists=True)
    op.execute("DROP TRIGGER IF EXISTS route_changes_append_only ON route_changes")
    op.execute(
        "CREATE TRIGGER route_changes_append_only BEFORE UPDATE OR DELETE OR TRUNCATE ON route_changes"
        " FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change()"
    )


def downgrade() -> None:
    op.drop_table("route_changes")
    op.drop_table("route_observations")
    op.drop_table("route_breakers")
