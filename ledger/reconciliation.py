"""The billing reconciliation's store: its own append-only record, and the ledger reads it matches with.

``billing_reconciliation`` (``ledger.schema``) holds what the scheduled reconciliation (``reconcile.billing``)
found that belongs to no task: a charge no operation knows, one two operations claim, a credit against the
operation it refunds, and one row per run. Every write is one ``INSERT … ON CONFLICT (dedup_key) DO NOTHING``:
the first run to see a vendor line records it, every later run (or a run racing it) finds it recorded.

The reads the matching needs are the operations' own events, by OperationKey (``ix_events_operation_key``)
and,
for a line whose key no operation holds, by job id (a scan of the events carrying that job id).

Every function takes an engine (``Recorder.reader``, AUTOCOMMIT: each call is one statement).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from sqlalchemy import Engine, bindparam, func, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.types import Text

from ledger.pgerrors import translated
from ledger.schema import EVENT_COLUMNS, events, stored_event
from ledger.schema import billing_reconciliation as table
from rules.envelope import StoredEvent


@dataclass(frozen=True)
class Finding:
    """One row of the record (``id`` and ``recorded_at`` are None until it is stored)."""

    dedup_key: str
    kind: str
    route: str | None = None
    account: str | None = None
    job_id: str | None = None
    line_key: str | None = None
    operation_key: str | None = None
    amount: str | None = None
    charged_at: datetime | None = None
    run_id: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    id: int | None = None
    recorded_at: datetime | None = None

    def row(self) -> dict[str, Any]:
        return {
            "dedup_key": self.dedup_key,
            "kind": self.kind,
            "route": self.route,
            "account": self.account,
            "job_id": self.job_id,
            "line_key": self.line_key,
            "operation_key": self.operation_key,
            "amount": self.amount,
            "charged_at": self.charged_at,
            "run_id": self.run_id,
            "evidence": self.evidence,
        }


_COLUMNS: Final = tuple(table.c)
_FIELDS: Final = tuple(c.name for c in _COLUMNS)


def record(engine: Engine, found: Sequence[Finding]) -> list[Finding]:
    """Append ``found``; returns those that were new (a line already recorded is skipped, not an error)."""
    if not found:
        return []
    statement = (
        pg_insert(table)
        .values([f.row() for f in found])
        .on_conflict_do_nothing(index_elements=[table.c.dedup_key])
        .returning(*_COLUMNS)
    )
    with translated(), engine.connect() as conn:
        rows = conn.execute(statement).all()
    return [_finding(r) for r in rows]


_ALL: Final = select(*_COLUMNS).order_by(table.c.id)


def findings(engine: Engine, *, kind: str | None = None, since_id: int = 0) -> list[Finding]:
    """The record in order (of ``kind``, after row ``since_id``)."""
    query = _ALL.where(table.c.id > since_id)
    if kind is not None:
        query = query.where(table.c.kind == kind)
    with translated(), engine.connect() as conn:
        return [_finding(r) for r in conn.execute(query)]


_COUNTS: Final = (
    select(table.c.kind, table.c.route, func.count())
    .where(table.c.kind != "run")
    .group_by(table.c.kind, table.c.route)
    .order_by(table.c.kind, table.c.route)
)
# The newest run by its id (the primary key): a run row is added every period, for ever.
_LAST_RUN: Final = (
    select(table.c.recorded_at).where(table.c.kind == "run").order_by(table.c.id.desc()).limit(1)
)


@dataclass(frozen=True)
class Counts:
    """What ``/metrics`` exports: recorded lines by kind and route, and when the last run was recorded."""

    by_kind: list[tuple[str, str, int]]  # (kind, route, n)
    last_run: datetime | None


def counts(engine: Engine) -> Counts:
    with translated(), engine.connect() as conn:
        by_kind = [(str(k), str(r or ""), int(n)) for k, r, n in conn.execute(_COUNTS)]
        return Counts(by_kind, conn.execute(_LAST_RUN).scalar_one_or_none())


# ── the ledger's side ────────────────────────────────────────────────────────────────────────────────────

_BY_KEYS: Final = (
    select(*EVENT_COLUMNS)
    .where(events.c.operation_key == func.any(bindparam("b_keys", type_=ARRAY(Text))))
    .order_by(events.c.task_id, events.c.seq)
)
_KEYS_BY_JOBS: Final = (
    select(events.c.operation_key)
    .where(
        events.c.operation_key.is_not(None),
        events.c.payload["job_id"].astext == func.any(bindparam("b_jobs", type_=ARRAY(Text))),
    )
    .distinct()
)


def operation_events(engine: Engine, keys: Sequence[str]) -> list[StoredEvent]:
    """Every event of the operations ``keys`` (by task and seq): one indexed read for any number of keys."""
    if not keys:
        return []
    with translated(), engine.connect() as conn:
        rows = conn.execute(_BY_KEYS, {"b_keys": sorted(set(keys))}).all()
    return [stored_event(r) for r in rows]


def operations_with_jobs(engine: Engine, job_ids: Sequence[str]) -> list[str]:
    """The OperationKeys whose events record one of ``job_ids`` (a scan: asked only for lines no key
    explains)."""
    if not job_ids:
        return []
    with translated(), engine.connect() as conn:
        return [str(k) for k in conn.execute(_KEYS_BY_JOBS, {"b_jobs": sorted(set(job_ids))}).scalars()]


def _finding(row: Sequence[Any]) -> Finding:
    return Finding(**dict(zip(_FIELDS, row, strict=True)))
