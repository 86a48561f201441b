"""Ending a paid stage's operations from outside their run: ``operation.close`` and ``operation.sweep``.

``operation.close`` resolves an operation left open when its task ended, or whose executor gave up without a
result, from the record and the vendor and never by submitting: a known job is cancelled and counted at what
it cost (registered, if it finished meanwhile), a maybe-sent request is looked up where the vendor can,
anything else is an unknown outcome at the estimate. ``operation.sweep`` finds jobs a vendor created for a
key after its operation was voided, and records their charges. A stage's own run ends its operation the same
way when the workflow cancels it (``activities.stages``, which extends these activities).

Closing is fenced like every other write of a run (issue 24 §7): it never sends anything new, but it decides
an operation's one result and cancels its job, and a run that lost its task must do neither — the newer run
adopted the operation and reconciles it itself. Every write a close makes is fenced by the closing run's epoch
in the write's own statement, and the epoch is checked before the vendor is asked to cancel anything. A close
carries its run's epoch when its executor gave up; at the task's end the workflow sends none, and the run's
epoch is the lease's while that run (its Temporal run id) is the lease's holder.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable
from decimal import Decimal

from temporalio import activity

from activities.boundary import NotYetProvable, RoutePaused, cross
from activities.contracts import Activity, CloseInput, StageInput, SweepInput
from activities.operation import Operation
from activities.outputs import Outputs, cancel
from artifacts.store import ArtifactStore
from ledger.errors import LedgerError, StaleEpoch
from ledger.recorder import Recorder
from reconcile.operations import Next, OperationState, reconcile, sent_of, stop_step
from rules.envelope import StoredEvent
from rules.events import FailureKind
from rules.operation import OperationRecord, fold_operations
from vendors.adapter import Capabilities, JobStatus, VendorAdapter, job_amount
from vendors.errors import VendorAuthError, VendorCannotTell, VendorError
from vendors.registry import Adapters
from vendors.routes import RouteSpec

# operation.close asks an unreachable vendor this many times before counting the operation at its estimate.
CLOSE_VENDOR_ATTEMPTS = 6  # with CLOSE_RETRY's backoff: about half a minute of trying
# Framework work (compose, review, gate) has no route: nothing to look up, and only the review pays (a model
# call, which cannot be looked up either).
FRAMEWORK = Capabilities(can_lookup=False, can_cancel=False, synchronous=True, has_billing=False)


class ClosingActivities:
    def __init__(
        self,
        recorder: Recorder,
        adapters: Adapters,
        store: ArtifactStore,
        *,
        store_for: Callable[[str], ArtifactStore] | None = None,
        pause_retry_s: float = 30.0,
    ):
        self.recorder = recorder
        self.adapters = adapters
        self.outputs = Outputs(recorder, store, store_for or (lambda uri: store))
        self.pause_retry_s = pause_retry_s
        self.actor = f"worker {socket.gethostname()}:{os.getpid()}"

    def _operation(
        self, inp: StageInput | CloseInput, route: str | None, *, epoch: int | None = None
    ) -> Operation:
        """The operation ``inp`` names; with ``epoch`` (a close), every write fenced by it."""
        return Operation(
            self.recorder,
            task_id=inp.task_id,
            node=inp.node,
            key=inp.operation_key,
            epoch=inp.epoch if epoch is None else epoch,
            estimate=inp.estimate,
            route=route,
            pause_retry_s=self.pause_retry_s,
            fence_writes=epoch is not None,
        )

    async def _pause(self, route: str, error: VendorError) -> RoutePaused:
        """A credentials (or address) error: the route pauses for every worker and task, a person is paged."""
        await asyncio.to_thread(self.recorder.pause_route, route, str(error), self.actor)
        return RoutePaused(route, str(error), self.pause_retry_s)

    @activity.defn(name=Activity.OPERATION_CLOSE)
    async def close(self, inp: CloseInput) -> StoredEvent:
        """Resolve an operation left open when its task ended, or whose executor gave up without a result.

        From the record and the vendor, never from a guess: a known job is cancelled and counted at what it
        cost; a maybe-sent request is looked up where the vendor can (and waited for until it is provably
        absent); otherwise it is an unknown outcome at the estimate with a cost anomaly. Never zero for a
        charge that may have happened.
        """
        route = inp.executor
        try:
            op = self._operation(inp, None, epoch=inp.epoch or await self._run_epoch(inp.task_id))
            try:
                state = await op.open(fenced=False)
                if state.result is not None:
                    return state.result
                # The route its INTENT chose (a fallback's operation is closed at the fallback), if this
                # worker's table has it (else: not routed, or the workflow wrote the INTENT).
                if state.route is not None and state.route in self.adapters.table.routes:
                    route = state.route
                return await self._stop(op, inp.as_stage(route), None, gave_up=inp.gave_up, state=state)
            except (NotYetProvable, StaleEpoch):
                raise
            except Exception as e:
                if isinstance(e, VendorAuthError):
                    await self._pause(route, e)
                elif activity.info().attempt < CLOSE_VENDOR_ATTEMPTS:
                    raise
                # The vendor cannot answer (its key is refused, or it stayed unreachable, or its answers make
                # no sense): the operation is counted at its estimate with a cost anomaly — never at zero —
                # for a person to check against the vendor's invoice.
                return await op.unknown(f"the vendor could not answer while closing {op.key}: {e}")
        except Exception as e:
            cross(e)

    async def _run_epoch(self, task_id: str) -> int:
        """The epoch of the workflow run this close belongs to: the lease's, while that run holds it.

        StaleEpoch if another run took the task since (the lease names its holder, the run that took the
        epoch: ``open_task``)."""
        run_id = activity.info().workflow_run_id or ""
        mine, current = await asyncio.to_thread(self.recorder.run_epoch, task_id, run_id)
        if current is None:
            raise LedgerError(f"task {task_id!r} has no lease: nothing to close")
        if mine is None:
            activity.logger.warning("fenced off: run %s no longer holds task %s", run_id, task_id)
            raise StaleEpoch(task_id, 0, current)
        return mine

    async def _stop(
        self,
        op: Operation,
        stage: StageInput,
        heartbeat_job: str | None,
        *,
        gave_up: str | None = None,
        state: OperationState | None = None,
    ) -> StoredEvent:
        """End an open operation now, never submitting: cancel its job and record what it cost.

        ``stage``: the node's request and bounds, so a job that succeeded meanwhile is checked and registered
        like any other output. Fenced by ``op``'s epoch: checked before the vendor is asked anything, and in
        every write (StaleEpoch: a run that lost the task closes nothing). ``gave_up``: why its executor ended
        without a result (the task goes on): an operation that never reached the vendor is then a technical
        Failure (counted against the node's retries, so a bug cannot loop through voids), not a void.
        ``state``: the operation as already opened (unfenced), if it was.
        """
        executor = stage.executor
        op.fence_writes = True  # from here on, every write of the close is fenced by the run's epoch
        if state is None:
            state = await op.open(fenced=False)
        if state.result is not None:
            return state.result
        op.check_fence()
        try:
            adapter: VendorAdapter | None = self.adapters.get(executor)
        except Exception:
            adapter = None  # framework work (compose, review, gate): no route
        if adapter is None:
            step = stop_step(state, RouteSpec(), FRAMEWORK, heartbeat_job)
        else:
            step = await reconcile(adapter, adapter.route, state, op.key, heartbeat_job, stopping=True)
        why = f"its executor gave up ({gave_up})" if gave_up else "the task ended"
        if step.next == Next.VOID and gave_up:
            return await op.failure(FailureKind.TECHNICAL, f"{why}; nothing reached the vendor", Decimal(0))
        if step.next == Next.VOID:
            return await op.void(f"{why}: {step.why}")
        if step.next == Next.UNKNOWN or adapter is None:
            return await op.unknown(f"{why}: {step.why}")
        if step.next == Next.WAIT:
            raise NotYetProvable(step.why, step.wait_s)
        assert step.job_id is not None
        got = step.job or await self.outputs.get(op, adapter, step.job_id)
        if isinstance(got, StoredEvent):
            return got
        job = got
        if job.status == JobStatus.RUNNING and adapter.capabilities.can_cancel:
            job = await cancel(adapter, job.id)
        if job.status == JobStatus.SUCCEEDED:
            return await self.outputs.settle(op, adapter, stage, job)
        cost = await op.settle_cost(job_amount(adapter.route, job))
        shown = f"{job.progress:.0%}" if job.progress is not None else "?"
        error = f"cancelled: {why} while job {job.id} was {job.status} at {shown}"
        return await op.failure(FailureKind.TECHNICAL, error, cost, job_id=job.id)

    @activity.defn(name=Activity.OPERATION_SWEEP)
    async def sweep(self, inp: SweepInput) -> int:
        """Find jobs the vendor created under a key after its operation was voided; record their charges.

        A void is proof of absence only while the vendor keeps its promised acceptance window; a job that
        appears later still cost money. Run when the task ends: every voided operation that may have been sent
        is looked up (where the route can) and every job found is cancelled and its charge recorded. Returns
        how many late jobs were found.
        """
        try:
            events = await asyncio.to_thread(self.recorder.read_events, inp.task_id)
            found = 0
            for key, record in fold_operations(events).items():
                found += await self._sweep_one(inp, key, record)
            return found
        except Exception as e:
            cross(e)

    async def _sweep_one(self, inp: SweepInput, key: str, record: OperationRecord) -> int:
        executor = record.route or record.executor
        if not record.voided or not record.dispatched or executor is None:
            return 0
        try:
            adapter = self.adapters.get(executor)
        except Exception:
            return 0
        # A send refused with a 5xx (a route's ``refused_statuses``, or a record from before they were opt-in)
        # is looked up too: a status is evidence only where the vendor says so, and a lookup is cheap.
        sent = bool(record.maybe_sent) or bool(record.refused_5xx)
        if not sent or not adapter.capabilities.can_lookup or adapter.capabilities.free:
            return 0
        try:
            jobs = await adapter.find_by_key(key, sent=sent_of(record, adapter.route))
        except VendorCannotTell:
            return 0  # the vendor cannot say (its listing is cut): nothing more to learn here
        op = Operation(
            self.recorder,
            task_id=inp.task_id,
            node=record.node or "",
            key=key,
            epoch=0,
            estimate=record.reservation,
        )
        await self.outputs.charge_extras(op, adapter, jobs, "created after its operation was voided")
        return len(jobs)
