"""The audit: does the record agree with itself, with the rules, with Temporal and with the vendors' bills?

``ledgerflow audit TASK`` (``--all``: every task in the ledger) checks, for each task:

* **decisions** — every INTENT recomputed from ``fold(events <= watermark)``, its pending INTENTs and its
  time, with the rule table that decided it; every LLM decision re-validated (``rules.recompute``). Where an
  older table decided, today's decides too, and a difference is reported apart (informational);
* **accounts** — budget accounts are enforcement state updated in the same transactions as the events; the
  events are the record. A task's account must equal the fold of its events; a project's or episode's, the
  sum over every task in it (``audit_budget``);
* **people's decisions** — every recorded ``HumanDecision`` re-verified: its stored signature over its
  stored message, with the key the registry held as of its arrival, the message saying what the event says,
  its issued-at within the window (``audit_signatures``, ``rules.people.reverify``). A decision recorded
  before decisions kept their signature is flagged, not failed;
* **histories** — every run of the task's workflow replays on today's workflow code (Temporal's Replayer);
  a history Temporal no longer holds (retention) is reported, not failed;
* **billing** (``--billing``) — every charge the vendors' own billing lists (``VendorAdapter.charges``) is
  matched to exactly one operation, by its key or its job id; charges no operation explains (paid for,
  unknown to the ledger) and operations whose recorded cost differs from what the vendor billed are
  problems. A route whose vendor cannot list its charges is named, not failed.

Pure parts (operations from events, the matching) are functions of their inputs; the rest reads the ledger,
Temporal and the vendors.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import httpx

from ledger.recorder import Recorder
from rules.changes import reverify_change
from rules.envelope import StoredEvent
from rules.money import vendor_amount
from rules.operation import OperationRecord, fold_operations, served_by
from rules.people import Keys, reverify
from rules.plan import COMPOSE, REVIEW
from rules.projection import fold
from rules.recompute import Divergence, Recomputation, audit_decisions
from runtime.settings import ConfigError, Settings
from runtime.signing import verify
from vendors.adapter import ChargeListing, VendorAdapter, VendorCharge
from vendors.errors import VendorError
from vendors.routes import AdapterKind, RouteError, RouteTable, deployment_table
from vendors.traced import TracedAdapter

# Charges are listed from a little before the oldest audited task was created: the vendor's clock is not the
# database's.
CLOCK_SLACK = timedelta(minutes=10)


# ── money: accounts ───────────────────────────────────────────────────────────────────────────────────
@dataclass(frozen=True)
class Check:
    scope: str
    what: str
    account: Decimal
    folded: Decimal

    @property
    def ok(self) -> bool:
        return self.account == self.folded

    def __str__(self) -> str:
        return (
            f"account {self.scope} {self.what} is {self.account}, the fold of its events gives {self.folded}"
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "scope": self.scope,
            "what": self.what,
            "account": str(self.account),
            "folded": str(self.folded),
            "ok": self.ok,
        }


def audit_budget(
    recorder: Recorder, task_id: str, folded: dict[str, tuple[Decimal, Decimal]] | None = None
) -> list[Check]:
    """Compare every account the task draws on with the fold of the events of the tasks in it.

    ``folded``: (reserved, spent) by task id, already known (and filled in here), so auditing many tasks of
    one project folds each task once.
    """
    checks: list[Check] = []
    known = folded if folded is not None else {}

    def totals(tid: str) -> tuple[Decimal, Decimal]:
        if tid not in known:
            p = fold(recorder.read_events(tid))
            known[tid] = (p.reserved, p.spent)
        return known[tid]

    for scope in recorder.task_scopes(task_id):
        account = recorder.account(scope)
        if account is None:
            checks.append(Check(scope, "account exists", Decimal(0), Decimal(1)))
            continue
        tasks = [task_id] if scope.startswith("task:") else recorder.tasks_in_scope(scope)
        reserved = sum((totals(t)[0] for t in tasks), Decimal(0))
        spent = sum((totals(t)[1] for t in tasks), Decimal(0))
        checks.append(Check(scope, "reserved", account.reserved, reserved))
        checks.append(Check(scope, "spent", account.spent, spent))
    return checks


# ── money: the vendors' bills ─────────────────────────────────────────────────────────────────────────
def operations(task_id: str, events: Iterable[StoredEvent]) -> dict[str, OperationRecord]:
    """Every operation a task dispatched (by OperationKey), from its events: what it was for, which jobs it
    had (each one a vendor may bill it for) and what it counts as paid (``rules.operation``)."""
    ops = fold_operations(e for e in events if e.task_id == task_id)
    return {key: op for key, op in ops.items() if op.dispatched}


@dataclass(frozen=True)
class Listed:
    """A charge, and the billing account (route) that listed it."""

    account: str
    charge: VendorCharge

    def __str__(self) -> str:
        c = self.charge
        key = f"key {c.operation_key}" if c.operation_key else "no key"
        return f"job {c.job_id} ({key}) charged {c.amount} by {self.account}"


@dataclass(frozen=True)
class CostDiff:
    operation: str
    recorded: Decimal
    vendor: str  # the vendor's total, or its figures where one is unusable
    charges: int
    anomaly: bool

    def __str__(self) -> str:
        note = "; a cost anomaly is on record" if self.anomaly else ""
        n = f"{self.charges} charge" + ("" if self.charges == 1 else "s")
        return f"operation {self.operation} recorded {self.recorded}, vendor billed {self.vendor} ({n}{note})"


@dataclass
class Billing:
    """What matching the vendors' charges to the ledger's operations found."""

    matched: int = 0  # charges matched to an operation
    operations: int = 0  # operations compared with what their vendor billed
    unmatched: list[Listed] = field(default_factory=list)  # paid for, unknown to the ledger
    ambiguous: list[str] = field(default_factory=list)  # a charge two operations claim
    differs: list[CostDiff] = field(default_factory=list)
    unlisted: list[str] = field(default_factory=list)  # routes whose charges cannot be listed, and why
    open: int = 0  # operations still without a result: not compared
    inference: Decimal = Decimal(0)  # spent on model calls (review, planner), which no listing names

    def problems(self) -> list[str]:
        return (
            [f"billing: unmatched charge: {u}" for u in self.unmatched]
            + [f"billing: {a}" for a in self.ambiguous]
            + [f"billing: {d}" for d in self.differs]
        )

    def notes(self) -> list[str]:
        out = [f"billing: cannot list charges: {u}" for u in self.unlisted]
        if self.open:
            out.append(f"billing: {self.open} operations still open, not compared")
        if self.inference:
            out.append(f"billing: {self.inference} of inference (model calls) is not in any vendor listing")
        return out

    def summary(self) -> str:
        text = f"billing: {self.matched} charges matched to {self.operations} operations"
        if self.unmatched:
            text += f", {len(self.unmatched)} unmatched"
        if self.differs:
            text += f", {len(self.differs)} differ"
        if self.unlisted:
            text += f", {_count(len(self.unlisted), 'route')} not listable"
        return text

    def as_json(self) -> dict[str, Any]:
        return {
            "matched": self.matched,
            "operations": self.operations,
            "unmatched": [{"account": u.account, **u.charge.model_dump(mode="json")} for u in self.unmatched],
            "ambiguous": self.ambiguous,
            "differs": [
                {
                    "operation": d.operation,
                    "recorded": str(d.recorded),
                    "vendor": d.vendor,
                    "charges": d.charges,
                    "cost_anomaly": d.anomaly,
                }
                for d in self.differs
            ],
            "not_listable": self.unlisted,
            "open": self.open,
            "inference": str(self.inference),
        }


def match_charges(
    ops: Sequence[OperationRecord],
    listed: Sequence[Listed],
    *,
    served: Callable[[OperationRecord], str | None],
    attributable: Callable[[VendorCharge], bool],
) -> Billing:
    """Match every charge to exactly one operation of the billing account that listed it, by its key or its
    job id, and compare the amounts.

    Args:
        ops: The audited tasks' operations.
        listed: The charges the vendors listed (every charge of their accounts since the tasks began), each
            with the account (``Listed.account``) that listed it.
        served: The account whose listing holds an operation's charges: that of the route that served it
            (its INTENT's route, a fallback included); None where that listing cannot be read, and then its
            cost is not compared.
        attributable: Whether a charge no operation claims is the audited tasks' (one task: its keys; every
            task: any charge) and so unmatched, rather than somebody else's.
    """
    billing = Billing()
    accounts: dict[str, tuple[dict[str, OperationRecord], dict[str, list[OperationRecord]]]] = {}
    compared: list[OperationRecord] = []
    for op in ops:
        if op.executor == REVIEW:
            billing.inference += op.recorded
            continue
        account = served(op)
        if account is None:
            continue
        compared.append(op)
        by_key, by_job = accounts.setdefault(account, ({}, {}))
        by_key[op.key] = op
        for job in op.job_ids:
            by_job.setdefault(job, []).append(op)
    charged: dict[str, list[VendorCharge]] = {}
    for item in listed:
        c = item.charge
        by_key, by_job = accounts.get(item.account, ({}, {}))
        claims: dict[str, OperationRecord] = {}  # the operations that claim it, each once, the key's first
        keyed = by_key.get(c.operation_key) if c.operation_key else None
        if keyed is not None:
            claims[keyed.key] = keyed
        claims.update((op.key, op) for op in by_job.get(c.job_id, ()))
        if len(claims) > 1:
            billing.ambiguous.append(f"{item} is claimed by operations {' and '.join(claims)}")
            continue
        if not claims:
            if attributable(c):
                billing.unmatched.append(item)
            continue
        [op] = claims.values()
        billing.matched += 1
        charged.setdefault(op.key, []).append(c)
    for op in compared:
        if not op.resolved:
            billing.open += 1
            continue
        billing.operations += 1
        charges = charged.get(op.key, [])
        total = vendor_total(charges)
        vendor = " + ".join(c.amount for c in charges) if total is None else str(total)
        if not charges and op.recorded == 0:
            continue
        if total is None or total != op.recorded:
            billing.differs.append(CostDiff(op.key, op.recorded, vendor, len(charges), bool(op.anomalies)))
    return billing


def vendor_total(charges: Iterable[VendorCharge]) -> Decimal | None:
    """What the charges add up to, as money (None: one of their amounts is not money)."""
    amounts = [vendor_amount(c.amount).amount for c in charges]
    if any(a is None for a in amounts):
        return None
    return sum((a for a in amounts if a is not None), Decimal(0))


async def audit_billing(
    settings: Settings,
    ops: Sequence[OperationRecord],
    since: datetime,
    task_ids: Iterable[str],
    *,
    every: bool,
) -> Billing:
    """List the charges since ``since`` of every billing account the operations ``ops`` of the tasks
    ``task_ids`` were served by — the route each INTENT recorded, fallbacks included, and every other route
    that could have served their executors — and match each charge to one operation of its own account.

    ``every``: the audit covers the whole ledger, so a charge no operation claims is unmatched whoever made
    it; else only a charge under one of these tasks' keys is theirs.
    """
    table = deployment_table(settings)
    unlisted: dict[str, str] = {}  # route -> why its charges cannot be listed
    routes: set[str] = set()
    for op in ops:
        name = served_by(op)
        if name is None:
            if op.executor not in (REVIEW, COMPOSE):
                unlisted[f"operation {op.key}"] = f"operation {op.key} (no route on record)"
            continue
        routes.add(name)
        if op.executor is not None and op.executor in table.routes:
            routes.update(c.route for c in table.chain(op.executor))  # a stray charge may be at any of them
    accounts: dict[tuple[str, str, str], tuple[str, list[str]]] = {}  # account -> (label, its routes)
    for name in sorted(routes):
        try:
            route = table.route(name)
        except RouteError:
            unlisted[name] = f"route {name} (no such route in this deployment's table)"
            continue
        if route.adapter == AdapterKind.LOCAL:
            continue  # work the worker does itself: no vendor, no bill
        base = route.base_url or settings.vendor_url_or_none() or ""
        account = (route.adapter, base, route.credential_env)
        accounts.setdefault(account, (f"{route.adapter} at {base}", []))[1].append(name)
    listed: list[Listed] = []
    listable: dict[str, str] = {}  # route -> the account that listed its charges (Listed.account)
    async with httpx.AsyncClient(timeout=30.0) as http:
        adapters = _adapters(settings, table, http)
        for label, names in accounts.values():
            charges = await list_charges(adapters, names[0], since)
            if isinstance(charges, str):
                for name in names:
                    unlisted[name] = f"route {name} ({charges})"
                continue
            account_label = f"{label} ({', '.join(names)})"
            listed.extend(Listed(account_label, c) for c in charges)
            listable.update((name, account_label) for name in names)
    prefixes = tuple(f"{tid}:" for tid in task_ids)

    def attributable(c: VendorCharge) -> bool:
        return every or (c.operation_key or "").startswith(prefixes)

    def served(op: OperationRecord) -> str | None:
        name = served_by(op)
        return listable.get(name) if name is not None else None

    billing = match_charges(ops, listed, served=served, attributable=attributable)
    billing.unlisted = sorted(set(unlisted.values()))
    return billing


class NotListable(str):
    """Why a route's charges cannot be listed: its vendor's API lists none per call (``list_charges``)."""


async def list_charges(
    adapters: Callable[[str], VendorAdapter], route: str, since: datetime
) -> list[VendorCharge] | str:
    """Every charge the billing account of ``route`` (not a local one) lists since ``since``, or why they
    cannot be listed: a :class:`NotListable` where its vendor's API lists none, else the error."""
    try:
        adapter = adapters(route)
        # The listing is the adapter's own (``vendors.traced`` spans only the calls of an operation).
        listing = adapter.inner if isinstance(adapter, TracedAdapter) else adapter
        if not adapter.capabilities.can_list_charges or not isinstance(listing, ChargeListing):
            return NotListable(f"the {adapter.route.adapter} API lists no charges per call")
        return await listing.charges(since)
    except (VendorError, ConfigError, RouteError) as e:  # RouteError: no base URL
        return str(e)


def _adapters(
    settings: Settings, table: RouteTable, http: httpx.AsyncClient
) -> Callable[[str], VendorAdapter]:
    from vendors.registry import Adapters  # builds every adapter kind (the local one imports media)

    def no_store(uri: str) -> Any:
        raise ConfigError("the audit reads no artifacts")

    built = Adapters(
        table,
        vendor_url=settings.vendor_url_or_none(),
        credential=settings.credential,
        client=http,
        store_for=no_store,
    )
    return built.get


# ── Temporal: the histories replay ────────────────────────────────────────────────────────────────────
@dataclass
class Replay:
    replayed: int = 0
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


async def replay_task(client: Any, task_id: str) -> Replay:
    """Replay every run of the task's workflow against today's workflow code."""
    from temporalio.client import WorkflowHistory
    from temporalio.contrib.pydantic import pydantic_data_converter
    from temporalio.service import RPCError, RPCStatusCode
    from temporalio.worker import Replayer

    from workflows.contracts import workflow_id
    from workflows.task import TaskWorkflow

    wid = workflow_id(task_id)
    out = Replay()
    try:
        runs = [w.run_id async for w in client.list_workflows(f'WorkflowId = "{wid}"')]
    except RPCError as e:
        out.notes.append(f"the runs of {wid} could not be listed ({e.message[:200]}): not replayed")
        return out
    if not runs:
        out.notes.append(f"no Temporal history of {wid} (past retention, or never started): not replayed")
        return out
    histories: list[WorkflowHistory] = []
    for run_id in runs:
        try:
            histories.append(await client.get_workflow_handle(wid, run_id=run_id).fetch_history())
        except RPCError as e:
            if e.status != RPCStatusCode.NOT_FOUND:
                raise
            out.notes.append(f"the history of run {run_id} of {wid} is gone (retention): not replayed")

    async def each() -> AsyncIterator[WorkflowHistory]:
        for h in histories:
            yield h

    replayer = Replayer(workflows=[TaskWorkflow], data_converter=pydantic_data_converter)
    results = await replayer.replay_workflows(each(), raise_on_replay_failure=False)
    out.replayed = len(histories)
    for run_id, error in results.replay_failures.items():
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        out.failures.append(f"run {run_id} of {wid} does not replay: {first[:300]}")
    return out


# ── people's decisions: re-verified ───────────────────────────────────────────────────────────────────
@dataclass(frozen=True)
class Signatures:
    """A task's recorded decisions, re-verified against the key registry as of each one's arrival."""

    verified: int
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def audit_signatures(
    task_id: str, events: Sequence[StoredEvent], keys: Keys, signed_since: datetime | None
) -> Signatures:
    """Re-verify every ``HumanDecision`` (``rules.people.reverify``) and every ``TaskChange``
    (``rules.changes.reverify_change``) of the task."""
    decisions = [e for e in events if e.type == "HumanDecision"]
    changes = [e for e in events if e.type == "TaskChange"]
    if not decisions and not changes:
        return Signatures(0)
    p = fold(list(events))
    found = [reverify(task_id, e, p, keys, signed_since) for e in decisions]
    found += [reverify_change(task_id, e, p, keys) for e in changes]  # people's signed changes too
    problems = tuple(f.problem for f in found if f.problem is not None)
    notes = tuple(f.note for f in found if f.note is not None)
    verified = sum(1 for f in found if f.problem is None)
    return Signatures(verified, problems, notes)


# ── one task, and many ────────────────────────────────────────────────────────────────────────────────
@dataclass
class TaskAudit:
    task_id: str
    decisions: Recomputation
    accounts: list[Check]
    replay: Replay | None = None
    billing: Billing | None = None  # the task's own, in a one-task audit with --billing
    signatures: Signatures | None = None  # people's decisions, re-verified

    def problems(self) -> list[str]:
        """Every problem, the decisions' first (the first divergence leads)."""
        out = [str(d) for d in self.decisions.divergences]
        out += list(self.signatures.problems) if self.signatures else []
        out += [str(c) for c in self.accounts if not c.ok]
        out += self.replay.failures if self.replay else []
        out += self.billing.problems() if self.billing else []
        return out

    def notes(self) -> list[str]:
        out = [f"today's table would decide differently: {d}" for d in self.decisions.today]
        out += list(self.decisions.notes)
        out += list(self.signatures.notes) if self.signatures else []
        out += self.replay.notes if self.replay else []
        out += self.billing.notes() if self.billing else []
        return out

    @property
    def ok(self) -> bool:
        return not self.problems()

    def summary(self) -> str:
        d = self.decisions
        parts = [
            _count(d.decisions, "decision") + " recomputed",
            _count(d.llm, "LLM decision") + " re-validated",
            "accounts equal" if all(c.ok for c in self.accounts) else "accounts differ",
        ]
        if self.signatures is not None and (self.signatures.verified or self.signatures.problems):
            parts.insert(2, _count(self.signatures.verified, "signed decision") + " re-verified")
        if self.replay is not None:
            parts.append(_count(self.replay.replayed, "history", "histories") + " replayed")
        if self.billing is not None:
            parts.append(self.billing.summary())
        return ", ".join(parts)

    def as_json(self) -> dict[str, Any]:
        return {
            "task": self.task_id,
            "ok": self.ok,
            "decisions": self.decisions.decisions,
            "llm_decisions": self.decisions.llm,
            "divergences": [d.as_json() for d in self.decisions.divergences],
            "today_differs": [d.as_json() for d in self.decisions.today],
            "accounts_equal": all(c.ok for c in self.accounts),
            "accounts": [c.as_json() for c in self.accounts],
            "signed_decisions_verified": self.signatures.verified if self.signatures else None,
            "histories_replayed": self.replay.replayed if self.replay else None,
            "replay_failures": self.replay.failures if self.replay else [],
            "billing": self.billing.as_json() if self.billing else None,
            "problems": self.problems(),
            "notes": self.notes(),
        }


@dataclass
class Audit:
    tasks: list[TaskAudit]
    every: bool  # --all
    billing: Billing | None = None  # --all --billing: the whole ledger's against the vendors'

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.tasks) and not (self.billing and self.billing.problems())

    def lines(self) -> list[str]:
        """The report: one task's problems (the first divergence first) and notes, then its summary; or, for
        every task, one line per task with a problem and a total."""
        if not self.every:
            [t] = self.tasks
            problems = t.problems()
            head = f"{t.task_id}: " + (f"FAILED: {problems[0]}" if problems else "OK")
            rest = [f"  {p}" for p in problems[1:]] + [f"  note: {n}" for n in t.notes()]
            return [head, *rest, f"  {t.summary()}"]
        out = []
        for t in self.tasks:
            problems = t.problems()
            if problems:
                more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
                out.append(f"{t.task_id}: {problems[0]}{more}")
        if self.billing is not None:
            out += self.billing.problems()
        bad = sum(1 for t in self.tasks if not t.ok)
        d = sum(t.decisions.decisions for t in self.tasks)
        llm = sum(t.decisions.llm for t in self.tasks)
        unequal = sum(1 for t in self.tasks if not all(c.ok for c in t.accounts))
        replayed = sum(t.replay.replayed for t in self.tasks if t.replay)
        total = (
            f"audited {_count(len(self.tasks), 'task')}, {bad} with problems: "
            f"{_count(d, 'decision')} recomputed, {_count(llm, 'LLM decision')} re-validated, "
            + (f"accounts differ in {unequal}" if unequal else "accounts equal")
            + f", {_count(replayed, 'history', 'histories')} replayed"
        )
        if self.billing is not None:
            total += ", " + self.billing.summary()
        return [*out, total]

    def as_json(self) -> dict[str, Any]:
        if not self.every:
            return self.tasks[0].as_json()
        return {
            "ok": self.ok,
            "tasks": [t.as_json() for t in self.tasks],
            "billing": self.billing.as_json() if self.billing else None,
            "total": {
                "tasks": len(self.tasks),
                "with_problems": sum(1 for t in self.tasks if not t.ok),
                "decisions": sum(t.decisions.decisions for t in self.tasks),
                "llm_decisions": sum(t.decisions.llm for t in self.tasks),
                "histories_replayed": sum(t.replay.replayed for t in self.tasks if t.replay),
            },
        }


class UnknownTask(LookupError):
    pass


async def audit(
    settings: Settings,
    recorder: Recorder,
    client: Any,
    task_ids: Sequence[str] | None,
    *,
    billing: bool = False,
) -> Audit:
    """Audit ``task_ids`` (None: every task in the ledger) against the rules, the accounts, Temporal and,
    with ``billing``, the vendors' charges.

    Raises:
        UnknownTask: a task id the ledger does not know.
    """
    every = task_ids is None
    ids = recorder.task_ids() if task_ids is None else list(task_ids)
    folded: dict[str, tuple[Decimal, Decimal]] = {}
    audits: list[TaskAudit] = []
    ops: list[OperationRecord] = []
    started: list[datetime] = []
    planner = Decimal(0)  # the LLM planner's calls: inference, like the review's
    # The key registry (with every key's added and revoked times) and the window, read once for every task.
    registry = await asyncio.to_thread(recorder.key_registry)
    keys = Keys(registry, verify, settings.decision_window, settings.root_keys())
    signed_since = await asyncio.to_thread(recorder.decisions_signed_since)
    for tid in ids:
        events = await asyncio.to_thread(recorder.read_events, tid)
        if not events:
            if every:
                continue  # a lease without events: nothing was ever recorded
            raise UnknownTask(f"no task {tid!r} in the ledger")
        p = fold(events)
        folded[tid] = (p.reserved, p.spent)
        decided = await asyncio.to_thread(_decisions, events)
        accounts = await asyncio.to_thread(audit_budget, recorder, tid, folded)
        replay = await replay_task(client, tid)
        signatures = await asyncio.to_thread(audit_signatures, tid, events, keys, signed_since)
        audits.append(TaskAudit(tid, decided, accounts, replay, signatures=signatures))
        if billing:
            ops.extend(operations(tid, events).values())
            started.append(events[0].recorded_at)
            planner += p.inference_spent
    result = Audit(audits, every)
    if billing and started:
        found = await audit_billing(settings, ops, min(started) - CLOCK_SLACK, ids, every=every)
        found.inference += planner
        if every:
            result.billing = found
        else:
            audits[0].billing = found
    return result


def _decisions(events: list[StoredEvent]) -> Recomputation:
    """``audit_decisions``, with a record it cannot even read (a bug, a corrupt row) reported as a problem of
    its task rather than ending the audit of every other task."""
    try:
        return audit_decisions(events)
    except Exception as e:  # one task's unreadable record is that task's finding
        seq = events[0].seq if events else 0
        why = f"nothing: the events do not fold ({type(e).__name__}: {str(e)[:300]})"
        problem = Divergence(seq, "the task's events", why)
        return Recomputation(0, 0, (problem,))


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"
