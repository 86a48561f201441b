"""The ledger's tables, and the database-side rules that keep ``events`` append-only.

``events`` holds every fact, keyed by ``(task_id, seq)`` with a gapless per-task ``seq``; ``task_leases``
holds one row per task (never deleted) with the fencing ``epoch`` and the next ``seq`` to hand out.
Append-only is enforced by triggers in the database, not by convention: UPDATE, DELETE and TRUNCATE of
``events`` raise, and so do DELETE and TRUNCATE of ``task_leases`` (the triggers are in the migrations).

``budget_accounts`` is different: mutable enforcement state, one row per scope (``project:P``,
``episode:P/E``, ``task:T``) with its ceiling and its reserved and spent totals, updated in the same
transactions as the events that explain each change. The events stay the record; the audit compares the two.
A task's scopes are listed, outermost first, in ``task_leases.budget_scopes``.

These tables describe the schema; they do not create it. The database is created and changed only by the
migrations in ``ledger/migrations`` (``ledger.migrate``), and a test keeps the two equal: a change here is a
new revision there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from sqlalchemy import (
    TIMESTAMP,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Numeric,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from rules.envelope import StoredEvent
from rules.money import MONEY_SCALE

metadata: Final = MetaData()

task_leases: Final = Table(
    "task_leases",
    metadata,
    Column("task_id", Text, primary_key=True),
    Column("epoch", BigInteger, nullable=False),
    Column("holder", Text, nullable=True),
    Column("next_seq", BigInteger, nullable=False, server_default=text("1")),
    Column("renewed_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Column("created_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    # The task's budget scopes, outermost first (added after the first release: see the baseline revision).
    Column("budget_scopes", ARRAY(Text), nullable=False, server_default=text("'{}'")),
    CheckConstraint("epoch >= 1", name="ck_task_leases_epoch_positive"),
    CheckConstraint("next_seq >= 1", name="ck_task_leases_next_seq_positive"),
    # tasks_in_scope: which tasks draw on a scope (budget_scopes @> ARRAY[scope]).
    Index("ix_task_leases_budget_scopes", "budget_scopes", postgresql_using="gin"),
)

# Money in micro-units (rules.money: one scale for the plan, the adapters and the ledger), up to 10^14.

budget_accounts: Final = Table(
    "budget_accounts",
    metadata,
    Column("scope", Text, primary_key=True),
    Column("ceiling", Numeric(20, MONEY_SCALE, asdecimal=True), nullable=True),  # NULL = unlimited
    Column("reserved", Numeric(20, MONEY_SCALE, asdecimal=True), nullable=False, server_default=text("0")),
    Column("spent", Numeric(20, MONEY_SCALE, asdecimal=True), nullable=False, server_default=text("0")),
    Column("updated_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    CheckConstraint("reserved >= 0", name="ck_budget_accounts_reserved_non_negative"),
    CheckConstraint("spent >= 0", name="ck_budget_accounts_spent_non_negative"),
    CheckConstraint("ceiling >= 0", name="ck_budget_accounts_ceiling_non_negative"),
)

events: Final = Table(
    "events",
    metadata,
    Column("task_id", Text, ForeignKey("task_leases.task_id"), primary_key=True),
    Column("seq", BigInteger, primary_key=True, autoincrement=False),
    Column("type", Text, nullable=False),
    Column("schema_version", Integer, nullable=False, server_default=text("1")),
    Column("epoch", BigInteger, nullable=False),
    Column("dedup_key", Text, nullable=False),
    Column("operation_key", Text, nullable=True),
    Column("payload", JSONB, nullable=False),
    # clock_timestamp(), not now(): now() is frozen at transaction start, so rows of one batch would share it.
    Column("recorded_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    # Named, because the recorder recognises a dedup conflict by this constraint's name.
    UniqueConstraint("dedup_key", name="uq_events_dedup_key"),
    CheckConstraint("seq >= 1", name="ck_events_seq_positive"),
    Index("ix_events_operation_key", "operation_key"),
)

# Reuse across a project: the outputs registered for a given input hash (rules.inputs).
Index(
    "ix_events_outcome_input_hash",
    events.c.payload["input_hash"].astext,
    postgresql_where=events.c.type == "Outcome",
)

DEDUP_CONSTRAINT: Final = "uq_events_dedup_key"

# An event row as every reader selects it, and that row as a StoredEvent (``stored_event``).
EVENT_COLUMNS: Final = (
    events.c.task_id,
    events.c.seq,
    events.c.type,
    events.c.schema_version,
    events.c.epoch,
    events.c.dedup_key,
    events.c.operation_key,
    events.c.payload,
    events.c.recorded_at,
)
_EVENT_FIELDS: Final = tuple(c.name for c in EVENT_COLUMNS)


def stored_event(row: Sequence[Any]) -> StoredEvent:
    """A row of ``EVENT_COLUMNS`` as the event it stores."""
    # Validating a plain dict in pydantic-core measured ~3x faster than the pure-Python model_construct, and
    # zip over the tuple-like row ~3x faster than Row._asdict().
    return StoredEvent.model_validate(dict(zip(_EVENT_FIELDS, row, strict=True)))


# What happened to each vendor route, append-only: a credentials error pauses it (every worker and task sees
# it at once), a person resumes it after fixing the key. A route's state is its latest event.
route_events: Final = Table(
    "route_events",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("route", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("reason", Text, nullable=False, server_default=text("''")),
    Column("actor", Text, nullable=False),
    Column("recorded_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    CheckConstraint("kind IN ('paused', 'resumed')", name="ck_route_events_kind"),
    Index("ix_route_events_route", "route", "id"),
)

# Every route's shared circuit breaker and fallback state (rules.routing.RouteHealth), one mutable row per
# route: read in the same statement that fences and reserves a dispatch's INTENT (and recorded in it), changed
# only by optimistic UPDATEs (``version``) — the breaker's transitions, a probe's or a canary's claim, a
# qualification. Every change is also logged, append-only, in ``route_changes``.
route_breakers: Final = Table(
    "route_breakers",
    metadata,
    Column("route", Text, primary_key=True),
    Column("state", Text, nullable=False, server_default=text("'closed'")),
    Column("since", TIMESTAMP(timezone=True), nullable=True),
    Column("opened_at", TIMESTAMP(timezone=True), nullable=True),
    Column("reason", Text, nullable=False, server_default=text("''")),
    Column("probe_key", Text, nullable=True),
    Column("canary_key", Text, nullable=True),
    Column("canary_outage", TIMESTAMP(timezone=True), nullable=True),
    Column("canary_passed", Boolean, nullable=False, server_default=text("false")),
    Column("qualified_at", TIMESTAMP(timezone=True), nullable=True),
    Column("version", BigInteger, nullable=False, server_default=text("0")),
    CheckConstraint("state IN ('closed', 'open', 'half_open')", name="ck_route_breakers_state"),
)

# What each call to a route, and each first review of its outputs, told (rules.routing.Observation): the
# breaker's windows are counted from here when a failure arrives. Insert-only (no row lock is shared).
route_observations: Final = Table(
    "route_observations",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("route", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("operation_key", Text, nullable=True),
    Column("recorded_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Index("ix_route_observations_route", "route", "recorded_at"),
)

# A route's concurrency quota, shared by every task and worker: one row per operation holding a slot (taken
# with its INTENT, given back with its result, in the same transactions), and the dispatches waiting for one.
route_slots: Final = Table(
    "route_slots",
    metadata,
    Column("operation_key", Text, primary_key=True),
    Column("route", Text, nullable=False),
    Column("task_id", Text, nullable=False),
    Column("taken_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Index("ix_route_slots_route", "route"),
)
# A capped route's hold per operation (ledger.accounts.hold_route): the route-month account
# (``route:R:YYYY-MM``, rules.scopes) and the amount the operation's INTENT reserved on it, inserted in the
# INTENT's transaction; the operation's one result settles it (``settled_at``, ``spent``) in the result's
# transaction, and a late charge adds to ``spent`` on the same scope. Kept after settling: the month an
# operation counted on.
route_holds: Final = Table(
    "route_holds",
    metadata,
    Column("operation_key", Text, primary_key=True),
    Column("scope", Text, nullable=False),
    Column("amount", Numeric(20, MONEY_SCALE, asdecimal=True), nullable=False),
    Column("spent", Numeric(20, MONEY_SCALE, asdecimal=True), nullable=False, server_default=text("0")),
    Column("held_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Column("settled_at", TIMESTAMP(timezone=True), nullable=True),
    CheckConstraint("amount > 0", name="ck_route_holds_amount_positive"),
    CheckConstraint("spent >= 0", name="ck_route_holds_spent_non_negative"),
    Index("ix_route_holds_scope", "scope"),
)
route_waiters: Final = Table(
    "route_waiters",
    metadata,
    Column("operation_key", Text, primary_key=True),
    Column("route", Text, nullable=False),
    Column("task_id", Text, nullable=False),
    Column("priority", Text, nullable=False),
    Column("deadline", TIMESTAMP(timezone=True), nullable=True),
    Column("since", TIMESTAMP(timezone=True), nullable=False),
    Column("seen_at", TIMESTAMP(timezone=True), nullable=False),
    Index("ix_route_waiters_route", "route"),
)

# The route's story, append-only: breaker opened / half-open / closed, a switch to a fallback, a canary's
# result, a qualification run with its scores — each with its reason.
route_changes: Final = Table(
    "route_changes",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("route", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("reason", Text, nullable=False, server_default=text("''")),
    Column("operation_key", Text, nullable=True),
    Column("detail", JSONB, nullable=True),
    Column("recorded_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Index("ix_route_changes_route", "route", "id"),
)

# The open human requests of every task (rules.pressure), one row each: inserted with the INTENT that asks
# the request, deleted with the decision, the timeout or the task's end that closes it — in the same
# transactions. ``scope`` is the task's project scope: a dispatch's INTENT counts its project's rows.
human_queue: Final = Table(
    "human_queue",
    metadata,
    Column("task_id", Text, primary_key=True),
    Column("request_id", Text, primary_key=True),
    Column("kind", Text, nullable=False),
    Column("scope", Text, nullable=False),
    Column("opened_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Index("ix_human_queue_scope", "scope"),
)

# Admission at the task level (ledger.admission): one row per task that entered a bounded queue — waiting
# (``admitted_at`` NULL) or admitted — deleted when the task ends. ``queue`` is the Temporal task queue whose
# workers the bound protects; ``rank`` orders the waiting (1 a hero task, 3 standard, 5 background), then
# ``asked_at``. Counted as running: admitted rows of tasks not stopped for a person (no open task-stopping
# request in human_queue: an escalation, a refused LLM proposal).
task_admission: Final = Table(
    "task_admission",
    metadata,
    Column("task_id", Text, primary_key=True),
    Column("queue", Text, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("asked_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Column("admitted_at", TIMESTAMP(timezone=True), nullable=True),
    # Whose change admitted it: ``release:<task>`` (a task's end), or the asking task's id.
    Column("admitted_by", Text, nullable=True),
    Index("ix_task_admission_queue", "queue", "rank", "asked_at"),
)

# The approver key registry (rules.approvers), append-only: ``add`` registers a public key with what it may
# sign, ``revoke`` ends it, ``endorse`` records a root key's signature over an entry (``endorsed_by``: the
# root's public key; ``endorsement``: its signature over rules.approvers.endorsement_message; revision 0009).
# Written only by ``ledgerflow keys`` (its actor and reason are the audit trail); a key id is added once
# (rotation is a new key id, then a revoke of the old one).
approver_keys: Final = Table(
    "approver_keys",
    metadata,
    Column("seq", BigInteger, primary_key=True, autoincrement=True),
    Column("key_id", Text, nullable=False),
    Column("action", Text, nullable=False),
    Column("approver", Text, nullable=False),
    Column("public_key", Text, nullable=False),
    Column("kinds", ARRAY(Text), nullable=False, server_default=text("'{}'")),
    Column("scopes", ARRAY(Text), nullable=False, server_default=text("'{*}'")),
    Column("not_before", TIMESTAMP(timezone=True), nullable=True),
    Column("expires_at", TIMESTAMP(timezone=True), nullable=True),
    Column("reason", Text, nullable=False, server_default=text("''")),
    Column("actor", Text, nullable=False),
    Column("recorded_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Column("endorsed_by", Text, nullable=True),  # an endorse row: the root's public key (revision 0009)
    Column(
        "endorsement", Text, nullable=True
    ),  # … and its signature over rules.approvers.endorsement_message
    CheckConstraint("action IN ('add', 'revoke', 'endorse')", name="ck_approver_keys_action"),
    Index("uq_approver_keys_add", "key_id", unique=True, postgresql_where=text("action = 'add'")),
)
APPROVER_KEY_CONSTRAINT: Final = "uq_approver_keys_add"

# The reviewer page's logouts (ledgerflow.review.auth): one row per session id logged out, until when its
# cookie would have been good anyway. Shared by every replica of the page and kept across restarts, so a copy
# of a logged-out cookie is refused everywhere. The page's role inserts rows, never updates or deletes one.
review_logouts: Final = Table(
    "review_logouts",
    metadata,
    Column("session_id", Text, primary_key=True),
    Column("expires_at", TIMESTAMP(timezone=True), nullable=False),
    Column(
        "logged_out_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")
    ),
)

# The scheduled billing reconciliation's own record (ledger/reconciliation.py), append-only: what matching the
# vendors' charge listings to the ledger's operations found that no task holds — a charge no operation knows
# (``unknown_charge``), one two operations claim (``ambiguous_charge``), a credit or refund against the
# operation it refunds (``credit``) — and one ``run`` row per reconciliation with its summary. A vendor line
# is recorded once however many runs see it (``dedup_key``: its billing account and the line's identity).
billing_reconciliation: Final = Table(
    "billing_reconciliation",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("dedup_key", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("route", Text, nullable=True),  # the route whose billing account listed the line
    Column("account", Text, nullable=True),
    Column("job_id", Text, nullable=True),
    Column("line_key", Text, nullable=True),  # the key the vendor's line carried
    Column("operation_key", Text, nullable=True),  # the operation a credit refunds
    Column("amount", Text, nullable=True),  # the vendor's figure as written
    Column("charged_at", TIMESTAMP(timezone=True), nullable=True),  # the vendor's clock
    Column("run_id", Text, nullable=True),
    Column("evidence", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("recorded_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    UniqueConstraint("dedup_key", name="uq_billing_reconciliation_dedup_key"),
    CheckConstraint(
        "kind IN ('unknown_charge', 'ambiguous_charge', 'credit', 'run')",
        name="ck_billing_reconciliation_kind",
    ),
    Index("ix_billing_reconciliation_kind", "kind", "route"),
)

# Every call the webhook receiver got from a vendor (ledger/callbacks.py, ledgerflow.webhooks), append-only,
# with its verdict and why: accepted ones wake the worker waiting on the operation (NOTIFY), refused ones
# (forged, stale, malformed, unknown route, replayed) are the record of who tried what. ``delivery_id`` is the
# Standard Webhooks ``webhook-id``, or the body's SHA-256 for a scheme without one; a delivery is accepted
# once (``uq_vendor_callbacks_accepted``). ``body`` (accepted ones, up to 64 kB) is kept for the record only:
# the worker reads the job from the vendor, never from a callback.
vendor_callbacks: Final = Table(
    "vendor_callbacks",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("received_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Column("route", Text, nullable=False),
    Column("operation_key", Text, nullable=True),
    Column("delivery_id", Text, nullable=False),
    Column("verdict", Text, nullable=False),
    Column("reason", Text, nullable=False),
    Column("body_sha256", Text, nullable=False),
    Column("claimed_status", Text, nullable=True),  # the body's top-level status, as the vendor claims it
    Column("body", JSONB, nullable=True),
    CheckConstraint(
        "verdict IN ('accepted', 'replayed', 'forged', 'stale', 'malformed', 'unknown_route')",
        name="ck_vendor_callbacks_verdict",
    ),
    Index(
        "uq_vendor_callbacks_accepted",
        "route",
        "delivery_id",
        unique=True,
        postgresql_where=text("verdict = 'accepted'"),
    ),
    Index("ix_vendor_callbacks_operation_key", "operation_key", "id"),
)

# Every release of a task's final output (``ledgerflow release``, docs/releases.md), append-only: the
# deployment's index of what was released (retention keeps a released task's artifacts). The signed manifest
# is the proof, checked without this table.
releases: Final = Table(
    "releases",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("released_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Column("task_id", Text, nullable=False),
    Column("output_sha256", Text, nullable=False),
    Column("manifest_sha256", Text, nullable=False),
    Column("key_id", Text, nullable=False),
    Index("ix_releases_task_id", "task_id"),
)
