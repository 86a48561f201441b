"""``ledgerflow billing dispute OPERATION_KEY``: the evidence for a refund claim on one operation, as JSON.

Everything the ledger holds about the operation (``rules.operation`` folds it): its INTENT (the request it
fixed, what it reserved, the route that served it and why), each numbered send with its time and whether the
vendor refused it, its job ids, its one result (cost, cost anomalies, late charges) and the probe of its
output where one was recorded; beside it, the vendor's own charge lines for that key (or its jobs), read from
the serving route's billing listing where that route can list charges.

Also the scheduled billing reconciliation's client side (``reconcile.billing`` does the matching):
``ledgerflow billing reconcile`` runs one reconciliation here and prints what it found
(``reconcile_once``); ``ledgerflow billing schedule``, ``ledgerflow schedules apply`` and ``ledgerflow up``
create or update the Temporal Schedule that runs it every few minutes on a task queue's workers
(``schedule_reconciliation``; the other scans' Schedules: ``ledgerflow.views.schedules``).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

import httpx

from ledger.recorder import Recorder
from ledgerflow.views.audit import CLOCK_SLACK, NotListable, _adapters, list_charges, vendor_total
from rules.envelope import StoredEvent
from rules.operation import OperationRecord, fold_operation, served_by
from runtime.settings import Settings
from vendors.routes import AdapterKind, RouteError, deployment_table

if TYPE_CHECKING:
    from temporalio.client import Client

    from activities.billing import ReconcileInput, ReconcileResult


class UnknownOperation(LookupError):
    pass


async def dispute(settings: Settings, recorder: Recorder, operation_key: str) -> dict[str, Any]:
    """The evidence bundle of ``operation_key`` (JSON-ready).

    Raises:
        UnknownOperation: no event of the ledger carries that key.
    """
    events = await asyncio.to_thread(recorder.events_by_operation_key, operation_key)
    if not events:
        raise UnknownOperation(f"no operation {operation_key} in the ledger")
    op = fold_operation(events)
    return {
        "operation_key": op.key,
        "task": events[0].task_id,
        "node": op.node,
        "kind": op.kind,
        "intent": _intent(op),
        "sends": [
            {"n": s.n, "at": s.at.isoformat(), "timeout_s": s.timeout_s, "refused": s.n in op.refused}
            for s in op.sends
        ],
        "job_ids": list(op.job_ids),
        "result": _result(op),
        "probe": _probe(op.result),
        "vendor_charges": await _vendor_charges(settings, op, events[0]),
    }


def _intent(op: OperationRecord) -> dict[str, Any] | None:
    intent = op.intent
    if intent is None:
        return None
    action = intent.payload.get("action") or {}
    return {
        "seq": intent.seq,
        "recorded_at": intent.recorded_at.isoformat(),
        "rule": intent.payload.get("rule"),
        "executor": op.executor,
        "route": op.route,
        "route_claim": intent.payload.get("route_claim"),
        "route_reason": intent.payload.get("route_reason") or "",
        "reservation": str(op.reservation),
        "estimate": action.get("estimate"),
        "request": action.get("input") or {},
        "input_hash": action.get("input_hash"),
    }


def _result(op: OperationRecord) -> dict[str, Any]:
    r = op.result
    out: dict[str, Any] = {
        "resolved": r is not None,
        "type": None if r is None else ("void" if op.voided else r.type),
        "recorded_at": None if r is None else r.recorded_at.isoformat(),
        "cost": str(op.cost),
        "recorded_total": str(op.recorded),  # the result's cost and every late charge
        "anomalies": list(op.anomalies),
        "late_charges": [{"job_id": c.job_id, "amount": str(c.amount)} for c in op.late_charges],
    }
    if r is not None:
        for field in ("job_id", "kind", "error", "detail"):
            if r.payload.get(field) not in (None, ""):
                out[field] = r.payload[field]
    return out


def _probe(result: StoredEvent | None) -> dict[str, Any] | None:
    """What the output was found to be when it was registered (and what the vendor claimed, where that
    differed), if the result recorded it."""
    artifact = result.payload.get("artifact") if result is not None else None
    if not isinstance(artifact, dict) or not (artifact.get("media") or artifact.get("claimed")):
        return None
    return {
        "uri": artifact.get("uri"),
        "sha256": artifact.get("sha256"),
        "size": artifact.get("size"),
        "media": artifact.get("media"),
        "claimed": artifact.get("claimed"),
    }


async def _vendor_charges(settings: Settings, op: OperationRecord, first: StoredEvent) -> dict[str, Any]:
    """The serving route's charge lines for the operation's key or one of its jobs, or why there are none."""
    route = served_by(op)
    found: dict[str, Any] = {"route": route, "lines": None, "total": None, "cannot_list": None}
    if route is None:
        found["cannot_list"] = "framework work (no vendor bills it)"
        return found
    table = deployment_table(settings)
    try:
        spec = table.route(route)
    except RouteError:
        found["cannot_list"] = f"no route {route} in this deployment's table"
        return found
    if spec.adapter == AdapterKind.LOCAL:
        found["cannot_list"] = "work the worker does itself: no vendor, no bill"
        return found
    jobs = set(op.job_ids)
    async with httpx.AsyncClient(timeout=30.0) as http:
        charges = await list_charges(_adapters(settings, table, http), route, first.recorded_at - CLOCK_SLACK)
    if isinstance(charges, NotListable):
        found["cannot_list"] = (
            f"{charges}: reconcile against the vendor's invoice by the OperationKey {op.key}"
        )
        return found
    if isinstance(charges, str):
        found["cannot_list"] = charges
        return found
    lines = [c for c in charges if c.operation_key == op.key or c.job_id in jobs]
    total = vendor_total(lines)
    found["lines"] = [c.model_dump(mode="json") for c in lines]
    if total is not None:
        found["total"] = str(total)
    return found


# ── the scheduled reconciliation ─────────────────────────────────────────────────────────────────────────
SCHEDULE_PREFIX: Final = "ledgerflow-billing-reconciliation"


def schedule_id(task_queue: str) -> str:
    """The Schedule of a task queue's deployment: one per queue, so deployments sharing a namespace differ."""
    return f"{SCHEDULE_PREFIX}-{task_queue}"


async def reconcile_once(
    settings: Settings, recorder: Recorder, inp: ReconcileInput | None = None
) -> ReconcileResult:
    """One reconciliation from here (no workflow): what ``ledgerflow billing reconcile`` runs."""
    from activities.billing import ReconcileInput, run_reconciliation

    table = deployment_table(settings)
    async with httpx.AsyncClient(timeout=30.0) as http:
        return await run_reconciliation(
            recorder,
            table,
            _adapters(settings, table, http),
            inp or ReconcileInput(),
            vendor_url=settings.vendor_url_or_none(),
        )


def reconcile_lines(result: ReconcileResult) -> list[str]:
    """The run as lines: each new finding, each route it could not list and why, then one summary line."""
    out = list(result.recorded)
    out += [f"cannot list charges: route {r} ({why})" for r, why in sorted(result.not_listable.items())]
    out += [f"listing failed: route {r} ({why})" for r, why in sorted(result.failed.items())]
    parts = [f"{result.listed} charges listed", f"{result.matched} matched to one operation"]
    for n, what in (
        (result.unknown, "unknown"),
        (result.ambiguous, "claimed twice"),
        (result.credits, "credits"),
        (result.pending, "without a key, within their grace"),
    ):
        if n:
            parts.append(f"{n} {what}")
    parts.append(f"{result.new} newly recorded")
    out.append(f"billing reconciliation: {', '.join(parts)} ({result.seconds:.2f} s, run {result.run_id})")
    return out


async def schedule_reconciliation(
    client: Client,
    settings: Settings,
    *,
    every: timedelta,
    schedule: str | None = None,
    window: timedelta | None = None,
    grace: timedelta | None = None,
) -> str:
    """Create the Schedule that reconciles billing every ``every`` on ``settings.task_queue`` (its workers run
    it), or update it to this spec if it exists; returns one line saying which."""
    from temporalio.client import (
        Schedule,
        ScheduleActionStartWorkflow,
        ScheduleIntervalSpec,
        ScheduleOverlapPolicy,
        SchedulePolicy,
        ScheduleSpec,
        ScheduleState,
    )

    from activities.billing import DEFAULT_GRACE_S, DEFAULT_WINDOW_S, ReconcileInput
    from ledgerflow.views.schedules import upsert_schedule
    from workflows.reconciliation import BillingReconciliationWorkflow

    sid = schedule or schedule_id(settings.task_queue)
    inp = ReconcileInput(
        window_seconds=window.total_seconds() if window is not None else DEFAULT_WINDOW_S,
        grace_seconds=grace.total_seconds() if grace is not None else DEFAULT_GRACE_S,
    )
    spec = Schedule(
        action=ScheduleActionStartWorkflow(
            BillingReconciliationWorkflow.run,
            inp,
            id=sid,  # each run's id is this and its scheduled time
            task_queue=settings.task_queue,
            execution_timeout=timedelta(minutes=30),
        ),
        spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=every)]),
        # A run still going when the next is due: the next is skipped. After an outage, one run catches up.
        policy=SchedulePolicy(
            overlap=ScheduleOverlapPolicy.SKIP, catchup_window=max(every, timedelta(minutes=1))
        ),
        state=ScheduleState(
            note="ledgerflow: match every vendor charge to one operation (docs/operations.md)"
        ),
    )
    seconds = f"{every.total_seconds():g} s"
    done = await upsert_schedule(client, sid, spec)  # the same create-or-update as every scan's
    return f"schedule {sid}: {done}, every {seconds} on task queue {settings.task_queue}"


def ensure_schedule(settings: Settings, *, every: timedelta) -> str:
    """``schedule_reconciliation`` from synchronous code (``ledgerflow up``), on a loop of its own."""
    from ledgerflow import client as lf

    async def go() -> str:
        return await schedule_reconciliation(await lf.connect(settings), settings, every=every)

    with ThreadPoolExecutor(max_workers=1) as pool:  # safe whether or not the caller runs a loop
        return pool.submit(asyncio.run, go()).result()
