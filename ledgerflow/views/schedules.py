"""``ledgerflow schedules``: the Temporal Schedules that run the scans by themselves (issue 27 §2).

One Schedule per scan and task queue (``ledgerflow-<scan>-<queue>``), run by that queue's workers:

- ``orphan-scan`` (every 60 s): a task whose ledger is open and whose workflow is gone is taken over by a new
  run (``reconcile.scans.scan_orphans``);
- ``route-holds`` (every 60 s): route slots and probe/canary claims held by dead runs — reported while their
  operation is open (the takeover's run gives them back with its result), released once it is closed; a
  dead task's queue places dropped (``scan_route_holds``);
- ``consistency`` (every 300 s): the ledger (open) against Temporal (running), both ways, reported
  (``check_consistency``);
- ``billing-reconciliation`` (``LEDGERFLOW_RECONCILE_EVERY_SECONDS``, 300 s): every vendor charge matched to
  one operation (``ledgerflow.views.billing``).

``ensure_schedules`` creates each or updates it to this spec (idempotent: run it as often as you like; a
second call changes nothing but the spec); ``ledgerflow up`` calls it, and on a cluster ``ledgerflow
schedules apply`` does. Each run is a workflow whose result records what it found and did (Temporal's history
of the run, ``ledgerflow schedules list``); ``last_success`` is when each last completed, for ``/metrics``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from temporalio.client import Client, Schedule

    from runtime.settings import Settings


@dataclass(frozen=True)
class Scan:
    name: str  # the Schedule's id is ledgerflow-<name>-<task queue>
    workflow: str  # the workflow type each run starts
    every: timedelta
    note: str


ORPHANS: Final = Scan(
    "orphan-scan",
    "OrphanScan",
    timedelta(seconds=60),
    "ledgerflow: take over tasks whose ledger is open and whose workflow is gone (docs/operations.md)",
)
ROUTE_HOLDS: Final = Scan(
    "route-holds",
    "RouteHoldsScan",
    timedelta(seconds=60),
    "ledgerflow: route slots and claims held by dead runs (docs/operations.md)",
)
CONSISTENCY: Final = Scan(
    "consistency",
    "ConsistencyCheck",
    timedelta(seconds=300),
    "ledgerflow: the ledger (open) against Temporal (running), both ways (docs/operations.md)",
)
BILLING: Final = Scan(
    "billing-reconciliation",
    "BillingReconciliation",
    timedelta(seconds=300),
    "ledgerflow: match every vendor charge to one operation (docs/operations.md)",
)
SCANS: Final = (ORPHANS, ROUTE_HOLDS, CONSISTENCY, BILLING)
BY_NAME: Final = {s.name: s for s in SCANS}


def schedule_id(scan: Scan | str, task_queue: str) -> str:
    """The Schedule of one scan for one task queue (deployments sharing a namespace differ by queue)."""
    return f"ledgerflow-{scan if isinstance(scan, str) else scan.name}-{task_queue}"


async def upsert_schedule(client: Client, sid: str, schedule: Schedule) -> str:
    """Create the Schedule ``sid``, or update it to ``schedule`` if it exists: "created" or "updated"."""
    from temporalio.client import ScheduleAlreadyRunningError, ScheduleUpdate, ScheduleUpdateInput

    try:
        await client.create_schedule(sid, schedule)
        return "created"
    except ScheduleAlreadyRunningError:

        def replace(_: ScheduleUpdateInput) -> ScheduleUpdate:
            return ScheduleUpdate(schedule=schedule)

        await client.get_schedule_handle(sid).update(replace)
        return "updated"


def scan_schedule(
    scan: Scan, task_queue: str, every: timedelta, *, include_unknown: bool = False
) -> Schedule:
    """The Schedule of a scan (not billing's: ``views.billing.schedule_reconciliation``)."""
    from temporalio.client import (
        Schedule,
        ScheduleActionStartWorkflow,
        ScheduleIntervalSpec,
        ScheduleOverlapPolicy,
        SchedulePolicy,
        ScheduleSpec,
        ScheduleState,
    )

    from reconcile.scans import ScanInput

    return Schedule(
        action=ScheduleActionStartWorkflow(
            scan.workflow,
            ScanInput(include_unknown=include_unknown),
            id=schedule_id(scan, task_queue),  # each run's id is this and its scheduled time
            task_queue=task_queue,
            execution_timeout=timedelta(minutes=30),
        ),
        spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=every)]),
        # A run still going when the next is due: the next is skipped. After an outage, one run catches up.
        policy=SchedulePolicy(
            overlap=ScheduleOverlapPolicy.SKIP, catchup_window=max(every, timedelta(minutes=1))
        ),
        state=ScheduleState(note=scan.note),
    )


async def ensure_schedules(
    client: Client,
    settings: Settings,
    *,
    scans: Collection[str] | None = None,
    every: dict[str, timedelta] | None = None,
    include_unknown: bool = False,
) -> list[str]:
    """Create or update the Schedule of each scan (``scans``: these names only) on ``settings.task_queue``;
    one line per Schedule saying which. ``every``: intervals by scan name (default: each scan's)."""
    from ledgerflow.views.billing import schedule_reconciliation
    from reconcile.billing import ReconcileSettings

    every = every or {}
    lines = []
    for scan in SCANS:
        if scans is not None and scan.name not in scans:
            continue
        queue = settings.task_queue
        if scan is BILLING:
            period = every.get(scan.name) or timedelta(seconds=ReconcileSettings().every_seconds)
            line = await schedule_reconciliation(
                client, settings, every=period, schedule=schedule_id(scan, queue)
            )
            lines.append(line)
            continue
        period = every.get(scan.name) or scan.every
        sid = schedule_id(scan, queue)
        done = await upsert_schedule(
            client, sid, scan_schedule(scan, queue, period, include_unknown=include_unknown)
        )
        lines.append(f"schedule {sid}: {done}, every {period.total_seconds():g} s on task queue {queue}")
    return lines


def ensure_schedules_sync(settings: Settings) -> list[str]:
    """``ensure_schedules`` from synchronous code (``ledgerflow up``), on a loop of its own."""
    from ledgerflow import client as lf

    async def go() -> list[str]:
        return await ensure_schedules(await lf.connect(settings), settings)

    with ThreadPoolExecutor(max_workers=1) as pool:  # safe whether or not the caller runs a loop
        return pool.submit(asyncio.run, go()).result()


# ── what ran, and when it last succeeded ────────────────────────────────────────────────────────────────
@dataclass(frozen=True)
class ScheduleRow:
    scan: str
    schedule_id: str
    exists: bool
    every_s: float | None = None
    paused: bool = False
    runs: int = 0  # actions the Schedule has taken
    last_run_at: datetime | None = None
    last_success_at: datetime | None = None
    last_result: Any = None  # the last successful run's result (a ScanReport or a ReconcileResult)


async def _last_completed(
    client: Client, scan: Scan, sid: str, task_queue: str, recent: Sequence[Any]
) -> tuple[datetime | None, str | None, str | None]:
    """(close time, workflow id, run id) of the Schedule's newest completed run: among its last ten
    actions first, else from Temporal's visibility (the newest of the completed runs it lists first)."""
    from temporalio.client import ScheduleActionExecutionStartWorkflow, WorkflowExecutionStatus
    from temporalio.service import RPCError

    for action in reversed(recent):
        run = action.action
        if not isinstance(run, ScheduleActionExecutionStartWorkflow):
            continue
        try:
            d = await client.get_workflow_handle(
                run.workflow_id, run_id=run.first_execution_run_id
            ).describe()
        except RPCError:
            continue
        if d.status == WorkflowExecutionStatus.COMPLETED:
            return d.close_time, d.id, d.run_id
    query = (
        f"WorkflowType = '{scan.workflow}' AND TaskQueue = '{task_queue}'"
        f" AND ExecutionStatus = 'Completed' AND WorkflowId STARTS_WITH '{sid}'"
    )
    best: tuple[datetime | None, str | None, str | None] = (None, None, None)
    try:
        async for wf in client.list_workflows(query, limit=50):
            if wf.close_time is not None and (best[0] is None or wf.close_time > best[0]):
                best = (wf.close_time, wf.id, wf.run_id)
    except RPCError:
        pass
    return best


async def describe_schedules(
    client: Client, task_queue: str, *, results: bool = True, scans: Collection[Scan] = SCANS
) -> list[ScheduleRow]:
    """Each scan's Schedule on ``task_queue``: whether it exists, its interval, its runs, its last success
    (and, with ``results``, what that run found and did)."""
    from temporalio.service import RPCError, RPCStatusCode

    from activities.billing import ReconcileResult
    from reconcile.scans import ScanReport

    rows = []
    for scan in scans:
        sid = schedule_id(scan, task_queue)
        try:
            desc = await client.get_schedule_handle(sid).describe()
        except RPCError as e:
            if e.status != RPCStatusCode.NOT_FOUND:
                raise
            rows.append(ScheduleRow(scan.name, sid, exists=False))
            continue
        intervals = desc.schedule.spec.intervals
        recent = desc.info.recent_actions
        at, wid, rid = await _last_completed(client, scan, sid, task_queue, recent)
        result = None
        if results and wid is not None:
            kind: type[Any] = ReconcileResult if scan is BILLING else ScanReport
            result = await client.get_workflow_handle(wid, run_id=rid, result_type=kind).result()
        rows.append(
            ScheduleRow(
                scan.name,
                sid,
                exists=True,
                every_s=intervals[0].every.total_seconds() if intervals else None,
                paused=desc.schedule.state.paused,
                runs=desc.info.num_actions,
                last_run_at=recent[-1].started_at if recent else None,
                last_success_at=at,
                last_result=result,
            )
        )
    return rows


async def last_success(client: Client, task_queue: str) -> dict[str, datetime | None]:
    """When each scan's scheduled run last completed on ``task_queue`` (None: never, or no Schedule), by
    scan name: what ``/metrics`` exports as ``ledgerflow_scan_last_success_timestamp_seconds{scan}``."""
    rows = await describe_schedules(client, task_queue, results=False)
    return {r.scan: r.last_success_at for r in rows}


def schedule_lines(rows: Sequence[ScheduleRow], *, now: Callable[[], datetime] | None = None) -> list[str]:
    """``ledgerflow schedules list``: one line per Schedule, then what its last successful run reported."""
    out = []
    for r in rows:
        if not r.exists:
            out.append(f"{r.schedule_id}: missing (ledgerflow schedules apply creates it)")
            continue
        every = f"every {r.every_s:g} s" if r.every_s is not None else "no interval"
        ok = r.last_success_at.isoformat(timespec="seconds") if r.last_success_at else "never"
        paused = ", paused" if r.paused else ""
        out.append(f"{r.schedule_id}: {every}{paused}, {r.runs} runs, last success {ok}")
        summary = getattr(r.last_result, "lines", None)
        if callable(summary):
            out += [f"  {line}" for line in summary()[-5:]]
    return out
