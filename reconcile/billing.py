"""Billing reconciled continuously: every charge a vendor lists matched to exactly one operation.

The scheduled reconciliation (``workflows/reconciliation.py`` starts it every few minutes, through the
activity
in ``activities/billing.py``; ``ledgerflow billing reconcile`` runs it once) lists, for every billing account
of the deployment's route table — the routes that share an adapter, a base URL and a credential share one
listing — the charges of the last ``window``, and matches each line to the operations of the ledger by the
key it carries and by its job id (``rules.operation`` folds them, as the audit does):

* exactly one operation claims it: matched. A negative line (a credit, a refund) is then recorded against
  that operation, with the vendor's line and what the ledger counted the operation at;
* no operation claims it — or the one its key names was served by a route of another billing account (a
  charge at a vendor the ledger never sent it to) — an **unknown charge**;
* two operations claim it (its key names one, its job id is another's): an **ambiguous charge**.

Unknown and ambiguous lines and credits go to the reconciliation's own append-only record
(``ledger.reconciliation``: they belong to no task), once per vendor line however many runs see it;
``/metrics`` counts them (``ledgerflow_billing_unknown_charges_total{route}`` …). A line with no key is
unknown only once it
is older than ``grace``: its job id reaches the ledger only after the vendor created (and billed) the job.

Routes whose vendor API cannot list charges per call (the OpenAI-compatible usage API reports totals per time
bucket), and the review's and planner's model calls, are named in the result: they are checked against the
vendor's invoice by the request ids they were sent with.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any, Final

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy import Engine

from ledger import reconciliation as store
from ledger.reconciliation import Finding
from rules.envelope import StoredEvent
from rules.operation import OperationRecord, fold_operations, served_by
from runtime.settings import ConfigError
from vendors.adapter import ChargeListing, VendorAdapter, VendorCharge
from vendors.errors import VendorError
from vendors.routes import AdapterKind, RouteError, RouteTable
from vendors.traced import TracedAdapter

MODEL_CALLS: Final = "model calls"
MODEL_CALLS_WHY: Final = (
    "the chat API lists no charges per call: the review's and the planner's calls are checked by their "
    "request ids against the vendor's invoice"
)


class ReconcileSettings(BaseSettings):
    """The schedule's period as ``ledgerflow up`` creates it (``LEDGERFLOW_BILLING_EVERY_SECONDS``)."""

    model_config = SettingsConfigDict(env_prefix="LEDGERFLOW_BILLING_", extra="ignore")

    every_seconds: float = Field(default=300.0, ge=10)


@dataclass(frozen=True)
class Account:
    """One billing account: the routes sharing an adapter, a base URL and a credential, listed once."""

    id: str
    route: str  # the first of its routes: what the record and the metrics name it by
    routes: tuple[str, ...]
    label: str


def accounts(table: RouteTable, vendor_url: str | None) -> tuple[list[Account], dict[str, str]]:
    """The billing accounts of ``table``'s vendor routes (local work has no bill), and each route's."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for name in sorted(table.routes):
        spec = table.routes[name]
        if spec.adapter == AdapterKind.LOCAL:
            continue
        base = spec.base_url or vendor_url or ""
        groups.setdefault((spec.adapter, base, spec.credential_env), []).append(name)
    found = [
        Account(f"{kind} {base} {cred}", names[0], tuple(names), f"{kind} at {base}")
        for (kind, base, cred), names in groups.items()
    ]
    return found, {r: a.id for a in found for r in a.routes}


@dataclass(frozen=True)
class Line:
    """A charge line as one account listed it, with its identity there."""

    account: Account
    charge: VendorCharge
    id: str

    @property
    def credit(self) -> bool:
        try:
            return Decimal(self.charge.amount) < 0
        except InvalidOperation:
            return False

    def evidence(self) -> dict[str, Any]:
        return {
            "line": self.charge.model_dump(mode="json"),
            "account": self.account.label,
            "routes": list(self.account.routes),
        }

    def __str__(self) -> str:
        c = self.charge
        key = f"key {c.operation_key}" if c.operation_key else "no key"
        what = "credited" if self.credit else "charged"
        return f"job {c.job_id} ({key}) {what} {c.amount} by {self.account.label} ({self.account.route})"


def lines_of(account: Account, charges: Sequence[VendorCharge]) -> list[Line]:
    """Each charge with an identity stable across listings: its account, job, key, amount and time, and its
    rank among lines identical in all of those (a vendor may list one figure twice, and mean it)."""
    seen: dict[str, int] = {}
    out = []
    for c in charges:
        fields = [account.id, c.job_id, c.operation_key or "", c.amount, c.at.isoformat() if c.at else ""]
        base = json.dumps(fields)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.append(Line(account, c, hashlib.sha256(f"{base}#{n}".encode()).hexdigest()[:32]))
    return out


@dataclass(frozen=True)
class Known:
    """The ledger's operations that the listed lines name, by key, with the task of each, and the keys
    claiming each job id."""

    ops: dict[str, tuple[str, OperationRecord]]
    by_job: dict[str, set[str]]

    @classmethod
    def of(cls, events: Sequence[StoredEvent]) -> Known:
        by_task: dict[str, list[StoredEvent]] = {}
        for e in events:
            by_task.setdefault(e.task_id, []).append(e)
        ops = {k: (t, op) for t, evs in by_task.items() for k, op in fold_operations(evs).items()}
        by_job: dict[str, set[str]] = {}
        for key, (_, op) in ops.items():
            for job in op.job_ids:
                by_job.setdefault(job, set()).add(key)
        return cls(ops, by_job)

    def claims(self, line: Line, route_account: dict[str, str]) -> dict[str, OperationRecord]:
        """The operations of the line's billing account claiming its charge, each once, the key's first —
        as the audit matches (``audit --billing``): another account's operation never claims it, even with
        the same job id. An operation whose route this table no longer has keeps its claim."""
        c = line.charge
        keyed = [c.operation_key] if c.operation_key and c.operation_key in self.ops else []
        out: dict[str, OperationRecord] = {}
        for key in [*keyed, *sorted(self.by_job.get(c.job_id, ()))]:
            op = self.ops[key][1]
            served = served_by(op)
            if served is None or route_account.get(served, line.account.id) == line.account.id:
                out[key] = op
        return out


@dataclass
class Reconciliation:
    """What one run found: counts over every listed line, and the findings recorded for the first time."""

    run_id: str
    since: datetime
    listed: int = 0
    matched: int = 0
    credits: int = 0
    unknown: int = 0
    ambiguous: int = 0
    pending: int = 0  # lines without a key still within their grace
    recorded: list[str] = field(default_factory=list)  # the new findings, one line each
    not_listable: dict[str, str] = field(default_factory=dict)  # route -> why its charges cannot be listed
    failed: dict[str, str] = field(default_factory=dict)  # route -> why its listing failed this time
    seconds: float = 0.0

    @property
    def new(self) -> int:
        return len(self.recorded)

    def summary(self) -> dict[str, Any]:
        return {
            "since": self.since.isoformat(),
            "listed": self.listed,
            "matched": self.matched,
            "credits": self.credits,
            "unknown": self.unknown,
            "ambiguous": self.ambiguous,
            "pending": self.pending,
            "new": self.new,
            "not_listable": self.not_listable,
            "failed": self.failed,
            "seconds": round(self.seconds, 3),
        }


async def list_account(adapter: VendorAdapter, since: datetime) -> list[VendorCharge] | str:
    """The account's charges since ``since`` — or, as a string, why its vendor lists none per call."""
    listing = adapter.inner if isinstance(adapter, TracedAdapter) else adapter  # spans are per operation
    if not adapter.capabilities.can_list_charges or not isinstance(listing, ChargeListing):
        return f"the {adapter.route.adapter} API lists no charges per call"
    return await listing.charges(since)


async def reconcile_billing(
    engine: Engine,
    table: RouteTable,
    adapter_for: Callable[[str], VendorAdapter],
    *,
    vendor_url: str | None,
    run_id: str,
    window: timedelta,
    grace: timedelta,
    now: datetime | None = None,
) -> Reconciliation:
    """One reconciliation: list, match, record (see the module doc); idempotent, run it as often as needed."""
    started = time.perf_counter()
    now = now or datetime.now(UTC)
    run = Reconciliation(run_id, now - window)
    found, route_account = accounts(table, vendor_url)
    lines: list[Line] = []
    for account in found:
        try:
            charges = await list_account(adapter_for(account.route), run.since)
        except (VendorError, ConfigError, RouteError) as e:  # RouteError: no base URL
            run.failed.update((r, str(e)[:300]) for r in account.routes)
            continue
        if isinstance(charges, str):
            run.not_listable.update((r, charges) for r in account.routes)
            continue
        lines.extend(lines_of(account, charges))
    run.not_listable[MODEL_CALLS] = MODEL_CALLS_WHY
    run.listed = len(lines)

    known = await asyncio.to_thread(_known, engine, lines)
    findings: list[tuple[Finding, str]] = []
    for line in lines:
        finding = _judge(run, line, known, route_account, now=now, grace=grace)
        if finding is not None:
            findings.append(finding)
    new = await asyncio.to_thread(store.record, engine, [f for f, _ in findings])
    described = {f.dedup_key: text for f, text in findings}
    run.recorded = [described[f.dedup_key] for f in new]
    run.seconds = time.perf_counter() - started
    summary = Finding(f"run:{run_id}", "run", run_id=run_id, evidence=run.summary())
    await asyncio.to_thread(store.record, engine, [summary])
    return run


def _known(engine: Engine, lines: Sequence[Line]) -> Known:
    """The operations the lines name: by key (indexed), then — for lines no key explains — by job id."""
    events = store.operation_events(
        engine, [ln.charge.operation_key for ln in lines if ln.charge.operation_key]
    )
    known = Known.of(events)
    loose = [
        c.job_id
        for c in (ln.charge for ln in lines)
        if c.operation_key not in known.ops and c.job_id not in known.by_job
    ]
    more = [k for k in store.operations_with_jobs(engine, loose) if k not in known.ops]
    if more:
        found = Known.of(store.operation_events(engine, more))  # only the new ones folded
        known = Known(
            {**known.ops, **found.ops},
            {
                j: known.by_job.get(j, set()) | found.by_job.get(j, set())
                for j in {*known.by_job, *found.by_job}
            },
        )
    return known


def _judge(
    run: Reconciliation,
    line: Line,
    known: Known,
    route_account: dict[str, str],
    *,
    now: datetime,
    grace: timedelta,
) -> tuple[Finding, str] | None:
    """What one line is: matched (None, or a credit to record), unknown or ambiguous (to record)."""
    c = line.charge
    base = Finding(
        dedup_key=f"line:{line.id}",
        kind="unknown_charge",
        route=line.account.route,
        account=line.account.label,
        job_id=c.job_id,
        line_key=c.operation_key or None,
        amount=c.amount,
        charged_at=c.at,
        run_id=run.run_id,
    )
    claims = known.claims(line, route_account)
    if len(claims) > 1:
        run.ambiguous += 1
        tasks = {k: known.ops[k][0] for k in claims}
        evidence = line.evidence() | {"claimed_by": list(claims), "tasks": tasks}
        text = f"ambiguous charge: {line} is claimed by operations {' and '.join(claims)}"
        return _with(base, kind="ambiguous_charge", evidence=evidence), text
    if not claims:
        if not c.operation_key and c.at is not None and now - c.at < grace:
            run.pending += 1  # its job id may not have reached the ledger yet
            return None
        run.unknown += 1
        why = "no operation of the ledger holds its key or its job id"
        return _with(base, evidence=line.evidence() | {"reason": why}), f"unknown charge: {line}"
    [(key, op)] = claims.items()
    served = served_by(op)
    if served is None:
        run.unknown += 1
        why = f"operation {key} is framework work ({op.executor}), which no vendor bills"
        return _with(base, evidence=line.evidence() | {"reason": why}), f"unknown charge: {line}: {why}"
    run.matched += 1
    if not line.credit:
        return None
    run.credits += 1
    task = known.ops[key][0]
    evidence = line.evidence() | {
        "task": task,
        "node": op.node,
        "route": served,
        "recorded": str(op.recorded),  # what the ledger counted the operation at (result and late charges)
        "resolved": op.resolved,
        "job_ids": list(op.job_ids),
        "intent_seq": op.intent.seq if op.intent is not None else None,
    }
    text = f"credit: {line} refunds operation {key} (task {task}, recorded {op.recorded})"
    return _with(base, kind="credit", operation_key=key, evidence=evidence), text


def _with(base: Finding, **changes: Any) -> Finding:
    return replace(base, **changes)
