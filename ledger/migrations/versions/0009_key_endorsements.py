"""Approver keys endorsed by an offline root key: ``approver_keys`` gains ``endorse`` rows.

Whoever holds the operator's credentials registers approver keys (revision 0006 grants it): without more, that
credential alone can make an approver. An ``endorse`` row records a root key's signature over a registry
entry (``rules.approvers.endorsement_message``: key id, approver, public key, kinds, scopes, validity), in
``endorsed_by`` (the root's public key) and ``endorsement`` (the signature). A deployment that configures its
roots (``LEDGERFLOW_KEY_ROOTS``, never in the database) trusts only endorsed entries, in the worker and the
audit; the roots' private halves stay offline (``ledgerflow keys endorse``). The operator may insert an
endorse row (carrying what the custodian signed); one it made up verifies against no configured root.

The registry stays append-only (revision 0001's trigger); the operator's column-level INSERT grant gains the
two columns.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("approver_keys", sa.Column("endorsed_by", sa.Text, nullable=True), if_not_exists=True)
    op.add_column("approver_keys", sa.Column("endorsement", sa.Text, nullable=True), if_not_exists=True)
    op.drop_constraint("ck_approver_keys_action", "approver_keys", type_="check")
    op.create_check_constraint(
        "ck_approver_keys_action", "approver_keys", "action IN ('add', 'revoke', 'endorse')"
    )
    op.execute("GRANT INSERT (endorsed_by, endorsement) ON approver_keys TO ledgerflow_operator")


def downgrade() -> None:
    raise NotImplementedError("the key registry is append-only: a downgrade would lose its endorse rows")
