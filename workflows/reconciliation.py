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
