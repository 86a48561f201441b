"""Least privilege in the ledger's database: three group roles, each granted what its processes do.

* ``ledgerflow_worker`` — the workers. It appends
  events (INSERT; never UPDATE, DELETE or TRUNCATE, and never its own ``recorded_at``: the database's clock
  writes it), moves the lease rows it fences on, reserves and settles money (UPDATE of ``reserved``,
  ``spent``, ``updated_at``), keeps the route tables and the queue of open requests, records the billing
  reconciliation's findings, and only *reads* ``approver_keys``.
* ``ledgerflow_operator`` — the CLI's key, budget and route commands: registers and revokes keys, sets and
  raises ceilings, pauses and resumes routes, records a fallback's qualification; reads everything. It never
  writes an event.
* ``ledgerflow_reader`` — reads everything, writes nothing (the reviewer page, ``ledgerflow audit``,
  dashboards).

The owner is whichever role runs ``ledgerflow db upgrade`` (it owns the tables, the triggers and their
functions; only an owner can alter or disable a trigger). It needs CREATEROLE, not SUPERUSER. The roles are
NOLOGIN groups, created here only if absent (roles belong to the whole server, so a second database on it
finds them made); login users are made members of them, with passwords, by ``ledgerflow db roles``
(``ledger.roles``) — a migration holds no secret, and a password rotates without a revision.

A worker raises a ceiling legitimately in one case: a person's signed ``add_budget`` decision, recorded in
the same transaction (``Recorder.append_idempotent(raise_ceiling=...)``). So ``ceiling`` is granted to the
worker but guarded by ``budget_accounts_ceiling_guard``: for anyone who is not an operator or the owner, a
change of a ceiling must be exactly the amount of an ``add_budget`` HumanDecision on that scope that this
very transaction inserted, carrying the signed message and signature that ``ledgerflow audit`` re-verifies.
A bare ``UPDATE budget_accounts SET ceiling = …`` with a worker's credentials is refused.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

WORKER = "ledgerflow_worker"
OPERATOR = "ledgerflow_operator"
READER = "ledgerflow_reader"
ROLES = (WORKER, OPERATOR, READER)

# Table -> (worker's privileges, operator's); SELECT on every table is granted to all three roles below.
# A column list is a column-level grant. Frozen here: a later table is granted by its own revision.
_EVENT_COLUMNS = "task_id, seq, type, schema_version, epoch, dedup_key, operation_key, payload"
_GRANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "events": ((f"INSERT ({_EVENT_COLUMNS})",), ()),
    "task_leases": (
        (
            "INSERT (task_id, epoch, holder, next_seq, budget_scopes)",
            "UPDATE (epoch, holder, next_seq, renewed_at, budget_scopes)",
        ),
        (),
    ),
    "budget_accounts": (
        ("INSERT (scope, ceiling)", "UPDATE (reserved, spent, updated_at, ceiling)"),
        ("INSERT (scope, ceiling)", "UPDATE (ceiling, updated_at)"),
    ),
    "approver_keys": (
        (),
        (
            "INSERT (key_id, action, approver, public_key, kinds, scopes, not_before, expires_at, reason,"
            " actor)",
        ),
    ),
    "route_events": (("INSERT (route, kind, reason, actor)",), ("INSERT (route, kind, reason, actor)",)),
    "route_breakers": (("INSERT", "UPDATE"), ("INSERT", "UPDATE")),
    "route_observations": (("INSERT (route, kind, operation_key)", "DELETE"), ()),
    "route_changes": (
        ("INSERT (route, kind, reason, operation_key, detail)",),
        ("INSERT (route, kind, reason, operation_key, detail)",),
    ),
    "route_slots": (("INSERT (operation_key, route, task_id)", "DELETE"), ()),
    "route_waiters": (("INSERT", "UPDATE", "DELETE"), ()),
    "human_queue": (("INSERT (task_id, request_id, kind, scope)", "DELETE"), ()),
    "billing_reconciliation": (
        (
            "INSERT (dedup_key, kind, route, account, job_id, line_key, operation_key, amount, charged_at,"
            " run_id, evidence)",
        ),
        (
            "INSERT (dedup_key, kind, route, account, job_id, line_key, operation_key, amount, charged_at,"
            " run_id, evidence)",
        ),
    ),
}
# The sequences behind the id columns each role inserts into (USAGE: nextval only).
_SEQUENCES = {
    WORKER: ("route_events", "route_observations", "route_changes", "billing_reconciliation"),
    OPERATOR: ("route_events", "route_changes", "billing_reconciliation", "approver_keys"),
}
_SEQUENCE_COLUMN = {"approver_keys": "seq"}

# SECURITY INVOKER on purpose: ``current_user`` is the one changing the row, and the worker may read what
# the check reads. Its search_path puts pg_temp last, so a temporary table named ``events`` cannot stand in.
_GUARD_FUNCTION = """
CREATE OR REPLACE FUNCTION ledger_guard_ceiling() RETURNS trigger
LANGUAGE plpgsql SET search_path = {schema}, pg_catalog, pg_temp AS $$
DECLARE
    me xid := (pg_current_xact_id()::text::numeric % 4294967296)::text::xid;
BEGIN
    IF pg_has_role(current_user, 'ledgerflow_operator', 'USAGE')
       OR pg_has_role(current_user, (SELECT relowner FROM pg_class WHERE oid = TG_RELID), 'USAGE') THEN
        RETURN NEW;
    END IF;
    IF OLD.ceiling IS NOT NULL AND NEW.ceiling IS NOT NULL AND NEW.ceiling > OLD.ceiling AND EXISTS (
        SELECT 1
        FROM task_leases l
        JOIN events e ON e.task_id = l.task_id AND e.seq = l.next_seq - 1
        WHERE l.budget_scopes @> ARRAY[NEW.scope]
          AND l.xmin = me AND e.xmin = me
          AND e.type = 'HumanDecision'
          AND e.payload ->> 'decision' = 'add_budget'
          AND e.payload ->> 'scope' = NEW.scope
          AND (e.payload ->> 'amount')::numeric = NEW.ceiling - OLD.ceiling
          AND coalesce(e.payload ->> 'signature', '') <> ''
          AND coalesce(e.payload ->> 'signed', '') <> ''
    ) THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'ledger: the ceiling of % may change only by an operator, or by a signed add_budget'
        ' decision recorded in the same transaction', NEW.scope
        USING ERRCODE = 'insufficient_privilege',
              HINT = 'ledgerflow budget set (operator), or an approver''s add_budget decision';
END;
$$
"""
_GUARD = "budget_accounts_ceiling_guard"

# From this revision on, every HumanDecision keeps its signed message and signature (rules.events). The
# audit must tell a decision recorded before (accepted as recorded then) from one recorded since without a
# signature (nothing proves a person made it). The instant is the comment of a function only the owner may
# change (the function's own text stays the same in every database); events.recorded_at is the database's
# clock (no role but the owner may write it).
_SIGNED_SINCE = """
DO $$ BEGIN
    IF to_regprocedure('ledger_decisions_signed_since()') IS NULL THEN
        CREATE FUNCTION ledger_decisions_signed_since() RETURNS timestamptz LANGUAGE sql STABLE
            AS 'SELECT obj_description(''ledger_decisions_signed_since()''::regprocedure,'
               ' ''pg_proc'')::timestamptz';
        EXECUTE format('COMMENT ON FUNCTION ledger_decisions_signed_since() IS %L', clock_timestamp());
    END IF;
END $$
"""


def upgrade() -> None:
    conn = op.get_bind()
    schema = conn.execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    for role in ROLES:
        # Roles are the server's: made once, whichever database of it migrates first.
        op.execute(
            f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}')"
            f" THEN CREATE ROLE {role} NOLOGIN; END IF; END $$"
        )
    everyone = ", ".join(ROLES)
    op.execute(f"GRANT USAGE ON SCHEMA {schema} TO {everyone}")
    # Nothing but what is granted here: no role may create objects (a shadowing table, a function).
    op.execute(f"REVOKE CREATE ON SCHEMA {schema} FROM PUBLIC")
    for table in ("alembic_version", "ledger_schema_version", *_GRANTS):
        op.execute(f"REVOKE ALL ON {table} FROM PUBLIC")
        op.execute(f"GRANT SELECT ON {table} TO {everyone}")
    for table, (worker, operator) in _GRANTS.items():
        for role, privileges in ((WORKER, worker), (OPERATOR, operator)):
            for privilege in privileges:
                op.execute(f"GRANT {privilege} ON {table} TO {role}")
    for role, tables in _SEQUENCES.items():
        for table in tables:
            column = _SEQUENCE_COLUMN.get(table, "id")
            found = conn.execute(text(f"SELECT pg_get_serial_sequence('{table}', '{column}')"))
            sequence = found.scalar_one()
            op.execute(f"GRANT USAGE ON SEQUENCE {sequence} TO {role}")
    # Only the owner runs the triggers' functions' DDL; nobody else needs to call them directly.
    op.execute("REVOKE ALL ON FUNCTION ledger_refuse_change() FROM PUBLIC")
    op.execute(_GUARD_FUNCTION.format(schema=schema))
    op.execute("REVOKE ALL ON FUNCTION ledger_guard_ceiling() FROM PUBLIC")
    op.execute(f"GRANT EXECUTE ON FUNCTION ledger_guard_ceiling() TO {WORKER}, {OPERATOR}")
    op.execute(_SIGNED_SINCE)
    op.execute(f"DROP TRIGGER IF EXISTS {_GUARD} ON budget_accounts")
    op.execute(
        f"CREATE TRIGGER {_GUARD} BEFORE UPDATE OF ceiling ON budget_accounts FOR EACH ROW"
        " WHEN (NEW.ceiling IS DISTINCT FROM OLD.ceiling) EXECUTE FUNCTION ledger_guard_ceiling()"
    )


def downgrade() -> None:
    op.execute(f"DROP TRIGGER IF EXISTS {_GUARD} ON budget_accounts")
    op.execute("DROP FUNCTION IF EXISTS ledger_guard_ceiling()")
    op.execute("DROP FUNCTION IF EXISTS ledger_decisions_signed_since()")
    # The roles stay (other databases on the server may use them); this database grants them nothing more.
    for table in ("alembic_version", "ledger_schema_version", *_GRANTS):
        op.execute(f"REVOKE ALL ON {table} FROM {', '.join(ROLES)}")
