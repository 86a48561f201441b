"""``BillingReconciliation``: the small workflow a Temporal Schedule starts every few minutes.

It runs one activity (``billing.reconcile``, ``activities/billing.py``) and returns its summary; every
decision
is the activity's, made from the ledger and the vendors' listings, so the workflow has nothing to replay but
that one call. Its run id is its workflow id (the Schedule makes one per run: ``SCHEDULE_ID-<time>``), which
is how the reconciliation's record names the run that found each line.

The Schedule itself is created by ``ledgerflow up`` and by ``ledgerflow billing schedule``
(``ledgerflow/views/billing.py``).
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from activities.billing import RECONCILE_BILLING, ReconcileInput, ReconcileResult

# One listing per billing account: minutes at most; a run that fails is retried a little, then the next
# scheduled run takes over.
RECONCILE_TIMEOUT = timedelta(minutes=15)
RECONCILE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=2), maximum_attempts=3)


@workflow.defn(name="BillingReconciliation")
class BillingReconciliationWorkflow:
    @workflow.run
    async def run(self, inp: ReconcileInput) -> ReconcileResult:
        run_id = inp.run_id or workflow.info().workflow_id
        result: ReconcileResult = await workflow.execute_activity(
            RECONCILE_BILLING,
            inp.model_copy(update={"run_id": run_id}),
            result_type=ReconcileResult,
            start_to_close_timeout=RECONCILE_TIMEOUT,
            retry_policy=RECONCILE_RETRY,
        )
        return result


# ── the scans a Schedule runs (reconcile/scans.py; the Schedules: ledgerflow/views/schedules.py) ─────────
with workflow.unsafe.imports_passed_through():
    from reconcile.scans import (
        SCAN_CONSISTENCY,
        SCAN_ORPHANS,
        SCAN_ROUTE_HOLDS,
        ScanInput,
        ScanReport,
    )

# A scan reads the ledger and asks Temporal about each open task: minutes at most. One that fails is retried a
# little; the next scheduled run takes over after that (its failure is what "last success" measures).
SCAN_TIMEOUT = timedelta(minutes=10)
SCAN_HEARTBEAT = timedelta(seconds=60)
SCAN_RETRY = RetryPolicy(initial_interval=timedelta(seconds=2), maximum_attempts=3)


async def _scan(activity: str, inp: ScanInput) -> ScanReport:
    # A Schedule's run's workflow id is its id and its time to the second: two triggers in one second share
    # it, so the record names the run by both ids.
    info = workflow.info()
    run_id = inp.run_id or f"{info.workflow_id}/{info.run_id}"
    report: ScanReport = await workflow.execute_activity(
        activity,
        inp.model_copy(update={"run_id": run_id}),
        result_type=ScanReport,
        start_to_close_timeout=SCAN_TIMEOUT,
        heartbeat_timeout=SCAN_HEARTBEAT,
        retry_policy=SCAN_RETRY,
    )
    return report


@workflow.defn(name="OrphanScan")
class OrphanScanWorkflow:
    """Take over the tasks whose ledger is open and whose workflow is gone; the result says which."""

    @workflow.run
    async def run(self, inp: ScanInput) -> ScanReport:
        return await _scan(SCAN_ORPHANS, inp)


@workflow.defn(name="RouteHoldsScan")
class RouteHoldsScanWorkflow:
    """Find the route slots and claims dead runs hold; release those whose operation is closed."""

    @workflow.run
    async def run(self, inp: ScanInput) -> ScanReport:
        return await _scan(SCAN_ROUTE_HOLDS, inp)


@workflow.defn(name="ConsistencyCheck")
class ConsistencyCheckWorkflow:
    """Report where the ledger (open) and Temporal (running) disagree."""

    @workflow.run
    async def run(self, inp: ScanInput) -> ScanReport:
        return await _scan(SCAN_CONSISTENCY, inp)


SCAN_WORKFLOWS = (OrphanScanWorkflow, RouteHoldsScanWorkflow, ConsistencyCheckWorkflow)
