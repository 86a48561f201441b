"""Vendor callbacks: ``vendor_callbacks``, one row per call the webhook receiver got, and its own role.

A vendor that calls back (a Replicate prediction's ``webhook``) reaches ``ledgerflow webhooks serve``
(``ledgerflow.webhooks``), a process of its own. Every call is recorded with the receiver's verdict and why —
refused ones too (forged, stale, malformed, unknown route), so an attack or a misconfigured vendor is seen in
the ledger, not only in a log. An accepted one only wakes the worker waiting on its operation (NOTIFY
``ledgerflow_callbacks``); its body is kept for the record but never trusted for money or output.

A delivery is accepted once: a UNIQUE partial index on ``(route, delivery_id)`` over accepted rows, so a
replayed (or retried) delivery is recorded as ``replayed``. Append-only like the other records (the
baseline's ``ledger_refuse_change``).

Grants: every role of revision 0006 reads the table; a new NOLOGIN group ``ledgerflow_receiver`` (login user
``lf_receiver``, ``ledgerflow db roles``) may insert a callback and nothing else on any table: it reads no
task, no event, not even the callbacks. To say *when* a replayed delivery was first accepted it calls
``ledger_callback_accepted_at(route, delivery_id)``, the owner's function that answers exactly that.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_NOW = sa.text("clock_timestamp()")
_READERS = ("ledgerflow_worker", "ledgerflow_operator", "ledgerflow_reader")
RECEIVER = "ledgerflow_receiver"
_TRIGGER = "vendor_callbacks_append_only"
_VERDICTS = "verdict IN ('accepted', 'replayed', 'forged', 'stale', 'malformed', 'unknown_route')"
_COLUMNS = "route, operation_key, delivery_id, verdict, reason, body_sha256, claimed_status, body"

# SECURITY DEFINER: the receiver may not read the table, only learn when one delivery it was refused for
# was accepted. search_path pinned, pg_temp last, so a temporary table cannot stand in for the real one.
_ACCEPTED_AT = """
CREATE OR REPLACE FUNCTION ledger_callback_accepted_at(p_route text, p_delivery_id text)
RETURNS timestamptz LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = {schema}, pg_catalog, pg_temp AS $$
    SELECT received_at FROM vendor_callbacks
    WHERE route = p_route AND delivery_id = p_delivery_id AND verdict = 'accepted'
$$
"""


def upgrade() -> None:
    conn = op.get_bind()
    schema = conn.execute(sa.text("SELECT quote_ident(current_schema())")).scalar_one()
    op.create_table(
        "vendor_callbacks",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("received_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=_NOW),
        sa.Column("route", sa.Text, nullable=False),
        sa.Column("operation_key", sa.Text, nullable=True),
        sa.Column("delivery_id", sa.Text, nullable=False),
        sa.Column("verdict", sa.Text, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("body_sha256", sa.Text, nullable=False),
        sa.Column("claimed_status", sa.Text, nullable=True),
        sa.Column("body", JSONB, nullable=True),
        sa.CheckConstraint(_VERDICTS, name="ck_vendor_callbacks_verdict"),
        if_not_exists=True,
    )
    op.create_index(
        "uq_vendor_callbacks_accepted",
        "vendor_callbacks",
        ["route", "delivery_id"],
        unique=True,
        postgresql_where=sa.text("verdict = 'accepted'"),
        if_not_exists=True,
    )
    op.create_index(
        "ix_vendor_callbacks_operation_key",
        "vendor_callbacks",
        ["operation_key", "id"],
        if_not_exists=True,
    )
    # Append-only by the database (the baseline's function), statement-level like the events table's.
    op.execute(f"DROP TRIGGER IF EXISTS {_TRIGGER} ON vendor_callbacks")
    op.execute(
        f"CREATE TRIGGER {_TRIGGER} BEFORE UPDATE OR DELETE OR TRUNCATE ON vendor_callbacks"
        " FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change()"
    )
    # Roles are the server's: made once, whichever database of it migrates first (as revision 0006's).
    op.execute(
        f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{RECEIVER}')"
        f" THEN CREATE ROLE {RECEIVER} NOLOGIN; END IF; END $$"
    )
    op.execute(f"GRANT USAGE ON SCHEMA {schema} TO {RECEIVER}")
    op.execute("REVOKE ALL ON vendor_callbacks FROM PUBLIC")
    op.execute(f"GRANT SELECT ON vendor_callbacks TO {', '.join(_READERS)}")
    # Column-level: never received_at (the database's clock writes it) nor id (the sequence does).
    op.execute(f"GRANT INSERT ({_COLUMNS}) ON vendor_callbacks TO {RECEIVER}")
    sequence = conn.execute(sa.text("SELECT pg_get_serial_sequence('vendor_callbacks', 'id')")).scalar_one()
    op.execute(f"GRANT USAGE ON SEQUENCE {sequence} TO {RECEIVER}")
    op.execute(_ACCEPTED_AT.format(schema=schema))
    op.execute("REVOKE ALL ON FUNCTION ledger_callback_accepted_at(text, text) FROM PUBLIC")
    op.execute(f"GRANT EXECUTE ON FUNCTION ledger_callback_accepted_at(text, text) TO {RECEIVER}")


def downgrade() -> None:
    raise NotImplementedError("vendor_callbacks is append-only: a downgrade would lose the callbacks' record")
