"""The scheduled billing reconciliation's activity, and its contract with the workflow that starts it.

``BillingReconciliationWorkflow`` (``workflows/reconciliation.py``, started by a Temporal Schedule) runs one
activity, ``billing.reconcile``: ``reconcile.billing`` lists every listable route's charges, matches each to
one
operation of the ledger and records what it cannot match, and credits, in the reconciliation's own record.

The models here are persisted compatibility data (Temporal's histories hold them): fields are only added, with
defaults. This module imports nothing heavy at load (the workflow's sandbox passes it through): the
reconciliation itself is imported when the activity runs. No secret is in an input or a result.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Final

from pydantic import BaseModel, Field
from temporalio import activity

from activities.contracts import Activity

if TYPE_CHECKING:
    from ledger.recorder import Recorder
    from vendors.adapter import VendorAdapter
    from vendors.routes import RouteTable

RECONCILE_BILLING: Final = Activity.BILLING_RECONCILE
DEFAULT_WINDOW_S: Final = 48 * 3600.0
DEFAULT_GRACE_S: Final = 600.0


class ReconcileInput(BaseModel, frozen=True):
    """One reconciliation: how far back it lists charges, how long a line without a key may wait for its
    job id to reach the ledger, and its run id (the workflow's id; None: the workflow sets it)."""

    window_seconds: float = Field(default=DEFAULT_WINDOW_S, gt=0)
    grace_seconds: float = Field(default=DEFAULT_GRACE_S, ge=0)
    run_id: str | None = Field(default=None, max_length=400)


class ReconcileResult(BaseModel, frozen=True):
    """What the run found (``reconcile.billing.Reconciliation``): counts over every listed line, the findings
    recorded for the first time by this run, and the routes it could not list, each with why."""

    run_id: str
    since: str
    listed: int = 0
    matched: int = 0
    credits: int = 0
    unknown: int = 0
    ambiguous: int = 0
    pending: int = 0
    new: int = 0
    recorded: list[str] = Field(default_factory=list)
    not_listable: dict[str, str] = Field(default_factory=dict)
    failed: dict[str, str] = Field(default_factory=dict)
    seconds: float = 0.0


class BillingActivities:
    """The reconciliation on the worker's ledger and vendor adapters (``worker.build_worker`` wires it)."""

    def __init__(
        self,
        recorder: Recorder,
        table: RouteTable,
        adapter_for: Callable[[str], VendorAdapter],
        *,
        vendor_url: str | None,
    ) -> None:
        self.recorder = recorder
        self.table = table
        self.adapter_for = adapter_for
        self.vendor_url = vendor_url

    @activity.defn(name=Activity.BILLING_RECONCILE)
    async def reconcile(self, inp: ReconcileInput) -> ReconcileResult:
        from activities.boundary import cross

        try:
            return await run_reconciliation(
                self.recorder, self.table, self.adapter_for, inp, vendor_url=self.vendor_url
            )
        except Exception as e:
            cross(e)


async def run_reconciliation(
    recorder: Recorder,
    table: RouteTable,
    adapter_for: Callable[[str], VendorAdapter],
    inp: ReconcileInput,
    *,
    vendor_url: str | None,
) -> ReconcileResult:
    """One reconciliation (the activity's body; ``ledgerflow billing reconcile`` calls it directly)."""
    import uuid

    from reconcile.billing import reconcile_billing

    run = await reconcile_billing(
        recorder.reader,
        table,
        adapter_for,
        vendor_url=vendor_url,
        run_id=inp.run_id or f"manual-{uuid.uuid4().hex[:12]}",
        window=timedelta(seconds=inp.window_seconds),
        grace=timedelta(seconds=inp.grace_seconds),
    )
    summary = run.summary()
    return ReconcileResult(
        run_id=run.run_id,
        recorded=run.recorded,
        **{k: v for k, v in summary.items() if k != "seconds"},
        seconds=run.seconds,
    )
