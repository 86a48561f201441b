"""Approvals: the shared queue of open requests to people, the registry of approvers' keys, and the reviewer
page's logouts.

``human_queue`` holds one row per open request of any task (rules.pressure): the recorder's append paths
call ``track_queue`` on the connection of the append that opens or closes a request, so the queue changes in
the event's own transaction, and a dispatch's or a decision's fencing statement counts its project's rows
with ``HUMAN_LOAD``. ``approver_keys`` is the append-only log of the keys people sign decisions with
(rules.approvers). ``review_logouts`` holds the reviewer page's logged-out sessions (revision 0008).
``ApprovalStore`` is the part of the recorder that reads the queue, keeps the keys and the logouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Final

from sqlalchemy import Connection, Engine, Text, any_, bindparam, delete, func, select, text
from sqlalchemy.dialects.postgresql import ARRAY

from ledger.errors import LedgerError
from ledger.pgerrors import translated, violated
from ledger.schema import (
    APPROVER_KEY_CONSTRAINT,
    approver_keys,
    human_queue,
    releases,
    review_logouts,
    task_leases,
)
from rules.approvers import KeyRecord, registry
from rules.envelope import NewEvent, StoredEvent
from rules.pressure import queue_changes
from rules.projection import fold

# A dispatch's INTENT and a person's decision read their project's open human requests (rules.pressure): a
# scalar subquery, correlated to the lease row being fenced (its first budget scope is the project's, like
# the rows).
HUMAN_LOAD: Final = (
    select(func.count())
    .select_from(human_queue)
    .where(human_queue.c.scope == task_leases.c.budget_scopes[1])
    .correlate(task_leases)
    .scalar_subquery()
    .label("human_load")
)

_QUEUE_CLOSE_ALL: Final = delete(human_queue).where(human_queue.c.task_id == bindparam("b_task_id"))
_QUEUE_CLOSE: Final = delete(human_queue).where(
    human_queue.c.task_id == bindparam("b_task_id"),
    human_queue.c.request_id == any_(bindparam("b_requests", type_=ARRAY(Text))),
)
# An open request's row names the task's project scope (the first of its budget scopes). ON CONFLICT DO
# NOTHING: a request already open keeps its row, and its wait is measured from when it was first asked.
_QUEUE_OPEN: Final = text(
    "INSERT INTO human_queue (task_id, request_id, kind, scope)"
    " SELECT task_id, :b_request, :b_kind, coalesce(budget_scopes[1], '') FROM task_leases"
    " WHERE task_id = :b_task_id ON CONFLICT DO NOTHING"
)
_OPEN_BY_PROJECT: Final = select(human_queue.c.scope, func.count()).group_by(human_queue.c.scope)

_KEY_LOG: Final = select(approver_keys).order_by(approver_keys.c.seq)
# When this database began keeping every decision's signature (revision 0006; the owner's function).
_SIGNED_SINCE: Final = text("SELECT ledger_decisions_signed_since()")
# Serialises the read and the revoke of one key id: two revokers never both append a revoke.
_KEY_LOCK: Final = text("SELECT pg_advisory_xact_lock(hashtext('approver_key:' || :key_id))")
_LOGGED_OUT: Final = select(review_logouts.c.session_id).where(
    review_logouts.c.session_id == bindparam("b_session")
)
# A second logout of one session (two tabs, two replicas) keeps the first row.
_LOG_OUT: Final = text(
    "INSERT INTO review_logouts (session_id, expires_at) VALUES (:b_session, :b_until) ON CONFLICT DO NOTHING"
)


def track_queue(conn: Connection, task_id: str, written: Sequence[NewEvent]) -> None:
    """Open and close people's requests in ``human_queue`` as the events just written say (in order)."""
    for event in written:
        change = queue_changes(event.type, event.payload)
        if change is None:
            continue
        if change.close_all:
            conn.execute(_QUEUE_CLOSE_ALL, {"b_task_id": task_id})
        if change.closed:
            conn.execute(_QUEUE_CLOSE, {"b_task_id": task_id, "b_requests": list(change.closed)})
        for request, kind in change.opened:
            _open(conn, task_id, request, kind)


def resync_queue(conn: Connection, task_id: str, events: Sequence[StoredEvent]) -> int:
    """Make the task's rows of ``human_queue`` what its ``events`` say (its open requests, none once it
    ended); how many rows that changed. The caller holds the task's lease row lock."""
    p = fold(events) if events else None
    want = (
        {}
        if p is None or p.terminal
        else {rid: r.request.kind.value for rid, r in p.requests.items() if r.open}
    )
    mine = human_queue.c.task_id == task_id
    have = dict(conn.execute(select(human_queue.c.request_id, human_queue.c.kind).where(mine)).all())
    stale = [rid for rid in have if rid not in want]
    if stale:
        conn.execute(_QUEUE_CLOSE, {"b_task_id": task_id, "b_requests": stale})
    missing = [(rid, kind) for rid, kind in want.items() if rid not in have]
    for rid, kind in missing:
        _open(conn, task_id, rid, kind)
    return len(stale) + len(missing)


def _open(conn: Connection, task_id: str, request: str, kind: str) -> None:
    conn.execute(_QUEUE_OPEN, {"b_task_id": task_id, "b_request": request, "b_kind": kind})


class ApprovalStore:
    """The recorder's people methods: the open requests per project, and the approver key registry."""

    _engine: Engine  # the Recorder's: one short transaction per write
    _reader: Engine  # the same pool in AUTOCOMMIT, for single-statement reads

    def open_requests_by_project(self) -> dict[str, int]:
        """Open human requests per project scope (``human_queue``, rules.pressure)."""
        with translated(), self._reader.connect() as conn:
            return {scope: n for scope, n in conn.execute(_OPEN_BY_PROJECT)}

    def add_release(self, task_id: str, output_sha256: str, manifest_sha256: str, key_id: str) -> None:
        """Record that ``task_id``'s final output was released under a manifest signed by ``key_id``."""
        row = {
            "task_id": task_id,
            "output_sha256": output_sha256,
            "manifest_sha256": manifest_sha256,
            "key_id": key_id,
        }
        with translated(), self._engine.begin() as conn:
            conn.execute(releases.insert().values(**row))

    def released_tasks(self) -> set[str]:
        """The tasks whose final output was ever released."""
        with translated(), self._reader.connect() as conn:
            return set(conn.execute(select(releases.c.task_id).distinct()).scalars())

    def add_key(self, key: KeyRecord, *, actor: str, reason: str = "") -> None:
        """Register a public key. LedgerError if its key id was ever registered (ids are never reused)."""
        row = {
            "key_id": key.key_id,
            "action": "add",
            "approver": key.approver,
            "public_key": key.public_key,
            "kinds": list(key.kinds),
            "scopes": list(key.scopes),
            "not_before": key.not_before,
            "expires_at": key.expires_at,
            "reason": reason[:1000],
            "actor": actor[:200],
        }
        try:
            with translated(), self._engine.begin() as conn:
                conn.execute(approver_keys.insert().values(**row))
        except LedgerError as e:
            if violated(e.__cause__) == APPROVER_KEY_CONSTRAINT:
                raise LedgerError(f"key {key.key_id} is already registered (a key id is used once)") from None
            raise

    def revoke_key(self, key_id: str, *, actor: str, reason: str) -> KeyRecord | None:
        """Revoke a registered key; the revoked record, or None if no such key is registered. A key already
        revoked stays revoked as it was (nothing is written)."""
        with translated(), self._engine.begin() as conn:
            conn.execute(_KEY_LOCK, {"key_id": key_id})
            keys = registry(dict(r._mapping) for r in conn.execute(_KEY_LOG))
            found = keys.get(key_id)
            if found is None or found.revoked_at is not None:
                return found
            row = {
                "key_id": key_id,
                "action": "revoke",
                "approver": found.approver,
                "public_key": found.public_key,
                "reason": reason[:1000],
                "actor": actor[:200],
            }
            conn.execute(approver_keys.insert().values(**row))
            return registry(dict(r._mapping) for r in conn.execute(_KEY_LOG)).get(key_id)

    def endorse_key(self, key_id: str, root: str, signature: str, *, actor: str, reason: str) -> KeyRecord:
        """Record a root key's endorsement of ``key_id``'s entry (checked by the caller: see
        ``ledgerflow.views.keys.add_endorsement``); the key's record with it. LedgerError if no such key."""
        with translated(), self._engine.begin() as conn:
            conn.execute(_KEY_LOCK, {"key_id": key_id})
            found = registry(dict(r._mapping) for r in conn.execute(_KEY_LOG)).get(key_id)
            if found is None:
                raise LedgerError(f"no key {key_id!r} in the registry")
            row = {
                "key_id": key_id,
                "action": "endorse",
                "approver": found.approver,
                "public_key": found.public_key,
                "endorsed_by": root,
                "endorsement": signature,
                "reason": reason[:1000],
                "actor": actor[:200],
            }
            conn.execute(approver_keys.insert().values(**row))
            return registry(dict(r._mapping) for r in conn.execute(_KEY_LOG))[key_id]

    def decisions_signed_since(self) -> datetime:
        """Since when every recorded decision carries its signed message and signature (revision 0006): the
        audit fails a decision recorded since without them, and only flags an older one."""
        with translated(), self._reader.connect() as conn:
            since: datetime = conn.execute(_SIGNED_SINCE).scalar_one()
            return since

    def key_registry(self) -> dict[str, KeyRecord]:
        """Every registered key, as of now (folded from the registry's log)."""
        with translated(), self._reader.connect() as conn:
            return registry(dict(r._mapping) for r in conn.execute(_KEY_LOG))

    def log_out_session(self, session_id: str, until: datetime) -> None:
        """Record that the reviewer page's session ``session_id`` is over (its cookie would expire at
        ``until`` anyway): every replica refuses its cookie from now on (``session_logged_out``)."""
        with translated(), self._engine.begin() as conn:
            conn.execute(_LOG_OUT, {"b_session": session_id, "b_until": until})

    def session_logged_out(self, session_id: str) -> bool:
        """Whether the reviewer page's session ``session_id`` was logged out, on any replica."""
        with translated(), self._reader.connect() as conn:
            return conn.execute(_LOGGED_OUT, {"b_session": session_id}).first() is not None
