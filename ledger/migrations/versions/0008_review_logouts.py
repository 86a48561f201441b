"""The reviewer page's logouts: ``review_logouts``, one row per session id logged out.

Logging out of the reviewer page used to revoke the session id in that process's memory only: another replica
sharing the session secret accepted a copy of the cookie until it expired (12 h), and a restart forgot the
logout. Every replica now checks this table on each logged-in request (a primary-key lookup) and inserts a
row on logout (``ledgerflow.review.auth``). ``expires_at`` is when the cookie would have expired anyway: a
row past it guards nothing and may be pruned by the owner (``DELETE FROM review_logouts WHERE expires_at <
now()``); at ~80 bytes a row, a thousand logouts a day is ~30 MB a year.

Grants as revision 0006's: every role reads the table; the reviewer page runs as ``ledgerflow_reader``, which
may insert a logout and nothing else (no UPDATE, no DELETE: nobody but the owner can take a logout back).
So the reader role writes exactly one thing: that a session is over.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_NOW = sa.text("clock_timestamp()")
_ROLES = ("ledgerflow_worker", "ledgerflow_operator", "ledgerflow_reader")


def upgrade() -> None:
    op.create_table(
        "review_logouts",
        sa.Column("session_id", sa.Text, primary_key=True),
        sa.Column("expires_at", sa.TIMESTAMP(timezone=True), nullable=False),
        sa.Column("logged_out_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=_NOW),
        if_not_exists=True,
    )
    op.execute("REVOKE ALL ON review_logouts FROM PUBLIC")
    op.execute(f"GRANT SELECT ON review_logouts TO {', '.join(_ROLES)}")
    op.execute("GRANT INSERT (session_id, expires_at) ON review_logouts TO ledgerflow_reader")


def downgrade() -> None:
    op.drop_table("review_logouts")
