"""The scans a Temporal Schedule runs by itself (issue 27 §2): each decides from the ledger and Temporal.

``scan_orphans``: a task the ledger says needs a run (``takeover.needs_a_run``: unfinished, or ended with an
operation still open) whose workflow is not running is taken over — a new run from the ledger alone, which
resumes its open operations through reconciliation (or, its end recorded, closes them from the vendor). A
task whose last run *failed* is reported, not retried every period: a failing run is a bug a person fixes.

``scan_route_holds``: the route slots, probe and canary claims and queue places held by operations of tasks
whose workflow is not running. A slot or claim whose operation is still open is never freed behind its back
(the vendor may still run its job): it is reported, and given back by the takeover's run when that run
records the operation's one result. One whose operation is closed (its result written, the worker gone
before it let go of a probe or canary claim) is released here; a dead task's queue place is dropped.

``check_consistency``: the ledger against Temporal, both ways — a task the ledger says is open whose workflow
is not running, and a task workflow Temporal says is running whose ledger is closed (or has no task at all).
It only reports.

Scope: a scan acts on the tasks whose workflow last ran on its task queue (a namespace can hold several
deployments); a task Temporal has no record of (a namespace restored from an older snapshot) only with
``include_unknown``. Every scan returns a ``ScanReport`` (what it found, what it did): the workflow's result,
kept in Temporal's history of the run the Schedule started (``ledgerflow schedules list`` shows the last).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

import sqlalchemy as sa
from pydantic import BaseModel, Field
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from ledger.recorder import Recorder
from ledger.schema import route_breakers, route_slots, route_waiters
from reconcile.takeover import needs_a_run, task_histories
from rules.operation import fold_operation
from rules.projection import Projection, fold
from rules.routing import BreakerPolicy, Observation
from vendors.routes import RouteTable

SCAN_ORPHANS: Final = "scan.orphans"
SCAN_ROUTE_HOLDS: Final = "scan.route_holds"
SCAN_CONSISTENCY: Final = "scan.consistency"
TASK_WORKFLOW: Final = "TaskWorkflow"


class ScanInput(BaseModel):
    """What one scheduled run looks at (the Schedule's argument; the workflow fills in ``run_id``)."""

    run_id: str = ""
    # Tasks Temporal has no record of belong to this deployment: resume them (orphans), report them
    # (consistency). Off by default: such a task cannot be told apart from another deployment's.
    include_unknown: bool = False
    only: list[str] | None = None  # these tasks alone (None: the whole ledger)
    # Consistency: a workflow started, or a task's last event recorded, less than this ago is not judged
    # (a run between its start and its first ledger write, or between its end's event and its close).
    grace_seconds: float = Field(default=60.0, ge=0)


class ScanFinding(BaseModel):
    task_id: str
    kind: str  # orphan · slot · probe · canary · waiter · ledger_open_not_running · running_ledger_closed …
    detail: str = ""
    operation_key: str | None = None
    route: str | None = None


class ScanAction(BaseModel):
    task_id: str
    did: str  # resumed · closing · released · skipped · failed
    detail: str = ""
    operation_key: str | None = None


class ScanReport(BaseModel):
    """One run: what it found and what it did about it."""

    scan: str
    run_id: str = ""
    found: list[ScanFinding] = Field(default_factory=list)
    did: list[ScanAction] = Field(default_factory=list)
    looked_at: int = 0  # tasks (or holdings) examined
    seconds: float = 0.0

    def lines(self) -> list[str]:
        out = [f"found {f.kind}: task {f.task_id} {f.detail}".rstrip() for f in self.found]
        out += [f"{a.did}: task {a.task_id} {a.detail}".rstrip() for a in self.did]
        out.append(
            f"{self.scan}: {self.looked_at} looked at, {len(self.found)} found, {len(self.did)} acted on"
            f" ({self.seconds:.2f} s, run {self.run_id or 'here'})"
        )
        return out


Status = tuple[WorkflowExecutionStatus | None, str | None]  # (status, task queue); None: Temporal has none


@dataclass(frozen=True)
class Runs:
    """How the scans reach tasks' workflows, given by the worker (``reconcile`` sits below the workflows
    layer and never imports it): a task's workflow id, and the start of a task's takeover run (returning
    its run id; ``workflows.takeover.start_takeover`` bound to the worker's queue)."""

    workflow_id: Callable[[str], str]
    take_over: Callable[[Client, Projection], Awaitable[str]]


async def run_status(client: Client, runs: Runs, task_id: str) -> Status:
    """The status and task queue of the task's latest workflow run, or (None, None) if Temporal has none."""
    try:
        d = await client.get_workflow_handle(runs.workflow_id(task_id)).describe()
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            return None, None
        raise
    return d.status, d.task_queue


def _ours(status: Status, task_queue: str, include_unknown: bool) -> bool:
    return status[1] == task_queue or (status[0] is None and include_unknown)


def _status_name(status: Status) -> str:
    return "unknown to Temporal" if status[0] is None else f"{status[0].name.lower()} on {status[1]}"


def _beat(detail: str) -> None:
    if activity.in_activity():
        activity.heartbeat(detail)


# ── the orphan scan ──────────────────────────────────────────────────────────────────────────────────────
async def scan_orphans(
    rec: Recorder, client: Client, runs: Runs, task_queue: str, inp: ScanInput
) -> ScanReport:
    """Take over every task of this queue that needs a run and has none (see the module's docstring)."""
    started = time.monotonic()
    report = ScanReport(scan="orphans", run_id=inp.run_id)
    histories = await asyncio.to_thread(task_histories, rec, keep=needs_a_run, only=inp.only)
    report.looked_at = len(histories)
    for p, _ in histories:
        _beat(p.task_id)
        status = await run_status(client, runs, p.task_id)
        if status[0] == WorkflowExecutionStatus.RUNNING or not _ours(status, task_queue, inp.include_unknown):
            continue
        # The ledger was read before Temporal was asked: a run that ended in between (its last writes made,
        # then its workflow completed) looks orphaned. Read the ledger again now that the run is known to be
        # over (seen: 112 needless runs of 500 tasks in a loaded soak, each starting, folding, ending).
        again = await asyncio.to_thread(task_histories, rec, keep=needs_a_run, only=[p.task_id])
        if not again:
            continue
        p = again[0][0]
        why = "ended with operations open" if p.finished else f"{p.state.value}"
        report.found.append(
            ScanFinding(task_id=p.task_id, kind="orphan", detail=f"{why}; workflow {_status_name(status)}")
        )
        if status[0] == WorkflowExecutionStatus.FAILED:
            # Its run failed rather than vanished (a bug, not a lost run): a new run every period would fail
            # the same way. A person resumes it (``ledgerflow resume``) once the cause is fixed.
            report.did.append(
                ScanAction(task_id=p.task_id, did="skipped", detail="its last run failed: ledgerflow resume")
            )
            continue
        try:
            run_id = await runs.take_over(client, p)
        except WorkflowAlreadyStartedError:
            report.did.append(ScanAction(task_id=p.task_id, did="skipped", detail="a run started meanwhile"))
            continue
        except RPCError as e:
            report.did.append(ScanAction(task_id=p.task_id, did="failed", detail=e.message[:300]))
            continue
        did = "closing" if p.finished else "resumed"
        report.did.append(ScanAction(task_id=p.task_id, did=did, detail=f"new run {run_id}"))
    report.seconds = time.monotonic() - started
    return report


# ── slots and claims held by dead runs ───────────────────────────────────────────────────────────────────
_SLOTS: Final = sa.select(route_slots.c.operation_key, route_slots.c.route, route_slots.c.task_id)
_WAITERS: Final = sa.select(route_waiters.c.operation_key, route_waiters.c.route, route_waiters.c.task_id)
_CLAIMS: Final = sa.select(
    route_breakers.c.route,
    route_breakers.c.state,
    route_breakers.c.probe_key,
    route_breakers.c.canary_key,
    route_breakers.c.canary_passed,
)


def _holdings(rec: Recorder) -> list[tuple[str, str, str, str | None]]:
    """(kind, operation key, route, task id or None) of every slot, queue place and open claim."""
    with rec.reader.connect() as conn:
        slots = conn.execute(_SLOTS).all()
        waiters = conn.execute(_WAITERS).all()
        claims = conn.execute(_CLAIMS).all()
    out: list[tuple[str, str, str, str | None]] = [("slot", k, r, t) for k, r, t in slots]
    out += [("waiter", k, r, t) for k, r, t in waiters]
    for route, state, probe, canary, passed in claims:
        if state == "half_open" and probe:
            out.append(("probe", probe, route, None))
        if canary and not passed:
            out.append(("canary", canary, route, None))
    return out


def _closed(rec: Recorder, operation_key: str) -> tuple[str | None, bool]:
    """The operation's task and whether its one result is written."""
    events = rec.events_by_operation_key(operation_key)
    if not events:
        return None, False
    return events[0].task_id, fold_operation(events).result is not None


_DROP_SLOT: Final = sa.delete(route_slots).where(
    route_slots.c.operation_key == sa.bindparam("b_key"), route_slots.c.task_id == sa.bindparam("b_task")
)
_DROP_WAITER: Final = sa.delete(route_waiters).where(
    route_waiters.c.operation_key == sa.bindparam("b_key"), route_waiters.c.task_id == sa.bindparam("b_task")
)


async def scan_route_holds(
    rec: Recorder, client: Client, runs: Runs, table: RouteTable, inp: ScanInput
) -> ScanReport:
    """Find what dead runs hold on the routes; release what is safe to release (module docstring)."""
    started = time.monotonic()
    report = ScanReport(scan="route_holds", run_id=inp.run_id)
    holdings = await asyncio.to_thread(_holdings, rec)
    report.looked_at = len(holdings)
    statuses: dict[str, Status] = {}
    for kind, key, route, task in holdings:
        _beat(key)
        owner, closed = await asyncio.to_thread(_closed, rec, key)
        task = task or owner
        if task is None or (inp.only is not None and task not in inp.only):
            continue
        if task not in statuses:
            statuses[task] = await run_status(client, runs, task)
        status = statuses[task]
        if status[0] == WorkflowExecutionStatus.RUNNING:
            continue
        where = f"{kind} on {route} for {key} (workflow {_status_name(status)})"
        if kind == "waiter":
            await asyncio.to_thread(_execute, rec, _DROP_WAITER, {"b_key": key, "b_task": task})
            report.did.append(ScanAction(task_id=task, did="released", detail=where, operation_key=key))
            continue
        if not closed:
            # Its job may still be running at the vendor: the takeover's run closes it and gives it back.
            report.found.append(
                ScanFinding(
                    task_id=task,
                    kind=kind,
                    detail=f"{where}: held until a run records its operation's result",
                    operation_key=key,
                    route=route,
                )
            )
            continue
        if kind == "slot":
            await asyncio.to_thread(_execute, rec, _DROP_SLOT, {"b_key": key, "b_task": task})
        else:
            spec = table.routes.get(route)
            policy = spec.breaker.policy() if spec is not None else BreakerPolicy()
            # Its operation ended without the observation that lets go of the claim: it ends unproven.
            await asyncio.to_thread(rec.observe, route, Observation.SETTLED, key, policy)
        report.did.append(
            ScanAction(
                task_id=task, did="released", detail=f"{where}: its operation is closed", operation_key=key
            )
        )
    report.seconds = time.monotonic() - started
    return report


def _execute(rec: Recorder, statement: sa.Executable, params: dict[str, str]) -> None:
    with rec.reader.connect() as conn:  # one statement: atomic on its own (AUTOCOMMIT)
        conn.execute(statement, params)


# ── the ledger against Temporal ──────────────────────────────────────────────────────────────────────────
async def check_consistency(
    rec: Recorder,
    client: Client,
    runs: Runs,
    task_queue: str,
    inp: ScanInput,
    *,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> ScanReport:
    """Report every task where the ledger and Temporal disagree on whether it is running (reports only)."""
    started = time.monotonic()
    report = ScanReport(scan="consistency", run_id=inp.run_id)
    prefix = runs.workflow_id("")  # every task's workflow id starts so
    grace = timedelta(seconds=inp.grace_seconds)
    only: Collection[str] | None = inp.only
    histories = await asyncio.to_thread(task_histories, rec, keep=needs_a_run, only=only)
    report.looked_at = len(histories)
    for p, events in histories:  # the ledger says open: is a workflow running it?
        _beat(p.task_id)
        status = await run_status(client, runs, p.task_id)
        if status[0] == WorkflowExecutionStatus.RUNNING or not _ours(status, task_queue, inp.include_unknown):
            continue
        if events[-1].recorded_at > now() - grace and status[0] is None:
            continue  # written a moment ago by a run Temporal's visibility has not shown yet
        state = "ended with operations open" if p.finished else p.state.value
        report.found.append(
            ScanFinding(
                task_id=p.task_id,
                kind="ledger_open_not_running",
                detail=f"ledger: {state}; workflow {_status_name(status)}",
            )
        )
    query = f"WorkflowType = '{TASK_WORKFLOW}' AND ExecutionStatus = 'Running' AND TaskQueue = '{task_queue}'"
    async for wf in client.list_workflows(query):  # Temporal says running: does the ledger say open?
        task_id = wf.id.removeprefix(prefix)
        if not wf.id.startswith(prefix) or (only is not None and task_id not in only):
            continue
        report.looked_at += 1
        if wf.start_time > now() - grace:
            continue
        _beat(task_id)
        events = await asyncio.to_thread(rec.read_events, task_id)
        if not events or events[0].type != "TaskCreated":
            report.found.append(
                ScanFinding(
                    task_id=task_id, kind="running_without_ledger", detail=f"workflow {wf.id} running"
                )
            )
            continue
        p = fold(events)
        if not needs_a_run(p) and events[-1].recorded_at < now() - grace:
            report.found.append(
                ScanFinding(
                    task_id=task_id,
                    kind="running_ledger_closed",
                    detail=f"ledger: {p.state.value} since {events[-1].recorded_at:%H:%M:%S}; running",
                )
            )
    report.seconds = time.monotonic() - started
    return report


# ── the activities ───────────────────────────────────────────────────────────────────────────────────────
class ScanActivities:
    """The scans as activities, on a worker's recorder, Temporal client and route table."""

    def __init__(
        self,
        recorder: Recorder,
        client: Client,
        table: RouteTable,
        runs: Runs,
        *,
        task_queue: str,
    ) -> None:
        self._rec = recorder
        self._client = client
        self._table = table
        self._runs = runs
        self._queue = task_queue

    @activity.defn(name=SCAN_ORPHANS)
    async def orphans(self, inp: ScanInput) -> ScanReport:
        return await scan_orphans(self._rec, self._client, self._runs, self._queue, inp)

    @activity.defn(name=SCAN_ROUTE_HOLDS)
    async def route_holds(self, inp: ScanInput) -> ScanReport:
        return await scan_route_holds(self._rec, self._client, self._runs, self._table, inp)

    @activity.defn(name=SCAN_CONSISTENCY)
    async def consistency(self, inp: ScanInput) -> ScanReport:
        return await check_consistency(self._rec, self._client, self._runs, self._queue, inp)
