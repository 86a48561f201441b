"""A route's spend cap per calendar month: ``route_holds``, what each operation reserved on its route's month.

A route with a ``monthly_cap`` (vendors.routes) has a budget account per calendar month, ``route:R:YYYY-MM``
(rules.scopes), created by the first INTENT that month with the cap as its ceiling. ``route_holds`` has one
row per operation served by a capped route: the month's scope and the amount its INTENT reserved there
(inserted in the INTENT's transaction), settled by the operation's one result in its transaction
(``settled_at``, ``spent``) and kept afterwards, so a late charge finds the month it counts on. The accounts
themselves are ``budget_accounts`` rows like any other. Idempotent like the baseline (IF NOT EXISTS).

Grants as revision 0006 grants ``route_slots``: the worker inserts a hold and settles it (never deletes one);
every role reads the table; nobody else writes it.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_NOW = sa.text("clock_timestamp()")
_MONEY = sa.Numeric(20, 6, asdecimal=True)  # rules.money.MONEY_SCALE, frozen here
_ROLES = ("ledgerflow_worker", "ledgerflow_operator", "ledgerflow_reader")


def upgrade() -> None:
    op.create_table(
        "route_holds",
        sa.Column("operation_key", sa.Text, primary_key=True),
        sa.Column("scope", sa.Text, nullable=False),
        sa.Column("amount", _MONEY, nullable=False),
        sa.Column("spent", _MONEY, nullable=False, server_default=sa.text("0")),
        sa.Column("held_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=_NOW),
        sa.Column("settled_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.CheckConstraint("amount > 0", name="ck_route_holds_amount_positive"),
        sa.CheckConstraint("spent >= 0", name="ck_route_holds_spent_non_negative"),
        if_not_exists=True,
    )
    op.create_index("ix_route_holds_scope", "route_holds", ["scope"], if_not_exists=True)
    op.execute("REVOKE ALL ON route_holds FROM PUBLIC")
    op.execute(f"GRANT SELECT ON route_holds TO {', '.join(_ROLES)}")
    op.execute("GRANT INSERT (operation_key, scope, amount) ON route_holds TO ledgerflow_worker")
    op.execute("GRANT UPDATE (spent, settled_at) ON route_holds TO ledgerflow_worker")


def downgrade() -> None:
    op.drop_table("route_holds")
