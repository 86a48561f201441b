"""Releases: ``releases``, one row per release of a task's final output (``ledgerflow release``).

A release is a signed provenance manifest the operator writes with the CLI (docs/releases.md). The manifest
itself is the proof, checked without this database (``ledgerflow verify``); this table is the deployment's
index of what was released, which retention reads: a released task keeps every artifact it names
(``ledgerflow.retention``). Append-only like the other records (the baseline's ``ledger_refuse_change``).

Grants: every role of revision 0006 reads it; ``ledgerflow_operator`` (the CLI's) inserts, column by column
(never ``id`` or ``released_at``, which the sequence and the database's clock write). A forged row can only
make retention keep artifacts longer.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_NOW = sa.text("clock_timestamp()")
_READERS = ("ledgerflow_worker", "ledgerflow_operator", "ledgerflow_reader")
_TRIGGER = "releases_append_only"
_COLUMNS = "task_id, output_sha256, manifest_sha256, key_id"


def upgrade() -> None:
    op.create_table(
        "releases",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("released_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=_NOW),
        sa.Column("task_id", sa.Text, nullable=False),
        sa.Column("output_sha256", sa.Text, nullable=False),
        sa.Column("manifest_sha256", sa.Text, nullable=False),
        sa.Column("key_id", sa.Text, nullable=False),
        if_not_exists=True,
    )
    op.create_index("ix_releases_task_id", "releases", ["task_id"], if_not_exists=True)
    op.execute(f"DROP TRIGGER IF EXISTS {_TRIGGER} ON releases")
    op.execute(
        f"CREATE TRIGGER {_TRIGGER} BEFORE UPDATE OR DELETE OR TRUNCATE ON releases"
        " FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change()"
    )
    op.execute("REVOKE ALL ON releases FROM PUBLIC")
    op.execute(f"GRANT SELECT ON releases TO {', '.join(_READERS)}")
    op.execute(f"GRANT INSERT ({_COLUMNS}) ON releases TO ledgerflow_operator")
    op.execute("GRANT USAGE ON SEQUENCE releases_id_seq TO ledgerflow_operator")


def downgrade() -> None:
    raise NotImplementedError(
        "releases is append-only: a downgrade would lose the record of what was released"
    )
