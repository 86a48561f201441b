"""The paid executor: one business attempt of one node at a "submit, then poll" vendor.

Life of an operation: INTENT (already fenced by the workflow) → reconcile (``reconcile.operations``) →
submit with the OperationKey as the vendor's idempotency key → Progress(job id) → poll, heartbeating the job
id, under the stall watchdog → artifact fetched, hash-verified, stored atomically → Outcome(actual cost).
Every write is idempotent on a key derived from the OperationKey, and ``{op}:result`` is shared by Outcome,
Failure and the void marker, so one operation has exactly one resolution, settled exactly once.

When the task ends while an operation is in flight (abort, compliance block, time ceiling), the workflow
cancels its executor and waits: the executor cancels the vendor job and records a Failure at what the job
cost (or voids an operation that never reached the vendor), so its reservation is settled on every scope.
"""

from __future__ import annotations

import asyncio
import functools
import time
from datetime import timedelta
from decimal import Decimal

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.artifacts import ArtifactCorrupt, LocalArtifactStore
from activities.models import StageInput
from ledger.recorder import Recorder
from ledgerflow.faults import mark
from reconcile.operations import Next, VendorMode, operation_state, reconcile
from reconcile.watchdog import StallWatch
from rules.checks import output_problems
from rules.envelope import NewEvent, StoredEvent
from rules.events import (
    ArtifactRef,
    Failure,
    FailureKind,
    MarkerKind,
    Media,
    Outcome,
    Progress,
    SystemMarker,
    to_new,
)
from vendors.errors import (
    ArtifactHashMismatch,
    VendorCannotTell,
    VendorConflict,
    VendorError,
    VendorRateLimited,
    VendorRejected,
    VendorUnavailable,
)
from vendors.http import HttpJobVendor, JobStatus, VendorJob


class _Attempt:
    """How far this attempt got at the vendor: what a cancellation has to stop and account for."""

    def __init__(self) -> None:
        self.job_id: str | None = None
        self.sent = False  # a submit was (or may have been) sent


class StageActivities:
    def __init__(
        self,
        recorder: Recorder,
        vendor: HttpJobVendor,
        store: LocalArtifactStore,
        poll_interval: float,
        mode: VendorMode = VendorMode.IDEMPOTENT,
    ):
        self.recorder = recorder
        self.vendor = vendor
        self.store = store
        self.poll_interval = poll_interval
        self.mode = mode

    async def _write(
        self, task_id: str, event: NewEvent, *, release: Decimal = Decimal(0), spend: Decimal = Decimal(0)
    ) -> StoredEvent:
        stored, _inserted = await asyncio.to_thread(
            functools.partial(self.recorder.append_idempotent, task_id, event, release=release, spend=spend)
        )
        return stored

    @activity.defn(name="stage.run")
    async def run(self, inp: StageInput) -> StoredEvent:
        """Run (or resume) the attempt; returns its recorded resolution, the ledger's copy, for the loop."""
        key = inp.operation_key
        epoch, settled = await asyncio.to_thread(self.recorder.preflight, inp.task_id, f"{key}:result")
        if settled is not None:
            return settled  # a retry after the result was written: nothing left to do
        if epoch != inp.epoch:
            # A zombie attempt of a run that lost the task must never start new vendor work.
            raise ApplicationError(
                f"epoch {inp.epoch} is stale (current {epoch})", type="StaleEpoch", non_retryable=True
            )
        attempt = _Attempt()
        try:
            job = await self._reconcile_and_submit(inp, attempt)
            if isinstance(job, StoredEvent):
                return job  # voided, or the outcome is unknown: the loop decides what follows
            if job.status == JobStatus.RUNNING:
                job = await self._poll(inp, job)
            if job.status == JobStatus.RUNNING:  # the watchdog gave up on it
                return await self._stalled(inp, job)
            mark("vendor_completed", op=key, job=job.id)
            return await self._settle(inp, job)
        except asyncio.CancelledError:
            await self._abandon(inp, attempt)
            raise
        except VendorRateLimited as e:
            raise ApplicationError(
                "vendor rate limited", type="VendorRateLimited", next_retry_delay=_delay(e.retry_after)
            ) from e
        except VendorUnavailable as e:
            raise ApplicationError(f"vendor unavailable: {e}", type="VendorUnavailable") from e
        except VendorConflict as e:
            raise ApplicationError(f"vendor conflict: {e}", type="VendorConflict", non_retryable=True) from e
        except VendorRejected as e:
            raise ApplicationError(
                f"vendor rejected the request: {e}", type="VendorRejected", non_retryable=True
            ) from e

    async def _reconcile_and_submit(self, inp: StageInput, attempt: _Attempt) -> VendorJob | StoredEvent:
        key = inp.operation_key
        details = activity.info().heartbeat_details
        heartbeat_job = str(details[0]) if details else None
        if self.mode == VendorMode.IDEMPOTENT and heartbeat_job is None:
            state = None  # resubmitting under the key is the lookup: no need to read the operation's history
        else:
            events = await asyncio.to_thread(self.recorder.events_by_operation_key, key)
            state = operation_state(events)
        if state is not None:
            decision = await reconcile(self.vendor, self.mode, key, state, heartbeat_job)
            if decision.next == Next.RESUME:
                assert decision.job is not None
                attempt.job_id = decision.job.id
                if decision.job.id != state.job_id:
                    await self._progress(inp, decision.job)
                return decision.job
            if decision.next == Next.VOID:
                return await self._void(inp, decision.why)
            if decision.next == Next.UNKNOWN:
                return await self._unknown(inp, decision.why)
            if self.mode != VendorMode.IDEMPOTENT:
                # Write-ahead: after a crash, this marker is what tells "maybe sent" from "never sent".
                marker = SystemMarker(kind=MarkerKind.SUBMITTING, node=inp.node, operation_key=key)
                await self._write(
                    inp.task_id, to_new(marker, dedup_key=f"{key}:submitting", operation_key=key)
                )
        mark("submitting", op=key)
        attempt.sent = True
        job = await self.vendor.submit(
            operation_key=key, executor=inp.executor, input=inp.input, estimate=inp.estimate
        )
        attempt.job_id = job.id
        mark("vendor_accepted", op=key, job=job.id)
        activity.heartbeat(job.id)
        if job.status == JobStatus.RUNNING:
            await self._progress(inp, job)
        return job

    async def _progress(self, inp: StageInput, job: VendorJob) -> None:
        progress = Progress(
            node=inp.node, operation_key=inp.operation_key, job_id=job.id, progress=job.progress
        )
        key = inp.operation_key
        await self._write(
            inp.task_id, to_new(progress, dedup_key=f"{key}:progress:{job.id}", operation_key=key)
        )
        mark("progress_recorded", op=key, job=job.id)

    async def _poll(self, inp: StageInput, job: VendorJob) -> VendorJob:
        """Poll until the job ends or stalls, heartbeating its id: a retry resumes it, never resubmits."""
        watch = StallWatch(inp.stall_after)
        mark("polling", op=inp.operation_key, job=job.id)
        while job.status == JobStatus.RUNNING:
            activity.heartbeat(job.id)
            if watch.stalled(job.progress, time.monotonic()):
                return job
            await asyncio.sleep(self.poll_interval)
            job = await self.vendor.get(job.id)
        return job

    async def _stalled(self, inp: StageInput, job: VendorJob) -> StoredEvent:
        """Cancel a stalled job at the vendor and record the failure with what it cost so far."""
        cancelled = await self.vendor.cancel(job.id)
        failure = Failure(
            node=inp.node,
            operation_key=inp.operation_key,
            kind=FailureKind.STALLED,
            error=f"no progress for {inp.stall_after:g}s at {cancelled.progress:.0%}: cancelled job {job.id}",
            actual_cost=cancelled.cost,
        )
        return await self._resolve(inp, failure, spend=cancelled.cost)

    async def _abandon(self, inp: StageInput, attempt: _Attempt) -> None:
        """The workflow cancelled this attempt (its task ended): stop the job and record what it cost.

        Only for a cancellation the workflow asked for. Any other (the worker shutting down, a heartbeat
        timeout, a run that is gone because it was terminated, reset or taken over) leaves the operation
        open, for the next attempt or the next run to reconcile and adopt. An operation that never reached the
        vendor is voided; a job is cancelled and the operation fails at what the job cost (billed when it was
        accepted). Every write is the operation's idempotent result, settling its reservation: a recorded
        result stands.
        """
        why = activity.cancellation_details()
        if why is None or not why.cancel_requested:
            return
        key = inp.operation_key
        job_id = attempt.job_id
        try:
            if job_id is None and attempt.sent:  # cancelled while submitting: the vendor may have the job
                jobs = await self.vendor.find_by_key(key)
                job_id = jobs[0].id if jobs else None
            if job_id is None:
                await self._void(inp, "cancelled before the vendor had the job: the task ended")
                return
            job = await self.vendor.cancel(job_id)
        except VendorCannotTell:
            await self._unknown(inp, "cancelled while submitting, and the vendor cannot look the key up")
            return
        except VendorError as e:
            await self._unknown(inp, f"cancelled, but job {job_id or '?'} could not be stopped: {e}")
            return
        failure = Failure(
            node=inp.node,
            operation_key=key,
            kind=FailureKind.TECHNICAL,
            error=f"cancelled: the task ended while job {job.id} was {job.status} at {job.progress:.0%}",
            actual_cost=job.cost,
        )
        await self._resolve(inp, failure, spend=job.cost)

    async def _void(self, inp: StageInput, why: str) -> StoredEvent:
        marker = SystemMarker(
            kind=MarkerKind.VOID, node=inp.node, operation_key=inp.operation_key, detail=why
        )
        return await self._resolve(inp, marker, spend=Decimal(0))

    async def _unknown(self, inp: StageInput, why: str) -> StoredEvent:
        key = inp.operation_key
        anomaly = SystemMarker(
            kind=MarkerKind.COST_ANOMALY,
            node=inp.node,
            operation_key=key,
            detail=f"possible duplicate charge: {why}",
        )
        await self._write(inp.task_id, to_new(anomaly, dedup_key=f"{key}:cost_anomaly", operation_key=key))
        # Counted as spent at the reserved estimate: a charge that may have happened is accounted for, never
        # lost (the person who decides can see the anomaly and the vendor's invoice).
        failure = Failure(
            node=inp.node,
            operation_key=key,
            kind=FailureKind.UNKNOWN_OUTCOME,
            error=f"the vendor cannot say whether {key} ran ({why}); not resubmitted",
            actual_cost=inp.estimate,
        )
        return await self._resolve(inp, failure, spend=inp.estimate)

    async def _settle(self, inp: StageInput, job: VendorJob) -> StoredEvent:
        key = inp.operation_key
        event: Outcome | Failure
        if job.status == JobStatus.SUCCEEDED:
            try:
                data = await self.vendor.fetch_result(job)
                assert job.result is not None
                uri = await asyncio.to_thread(self.store.put, data, job.result.sha256, key)
            except (ArtifactHashMismatch, ArtifactCorrupt) as e:
                event = Failure(
                    node=inp.node,
                    operation_key=key,
                    kind=FailureKind.INVALID_OUTPUT,
                    error=str(e),
                    actual_cost=job.cost,
                )
            else:
                media = job.result.media
                artifact = ArtifactRef(
                    uri=uri,
                    sha256=job.result.sha256,
                    size=len(data),
                    media=Media.model_validate(media.model_dump()) if media is not None else None,
                )
                event = Outcome(
                    node=inp.node, operation_key=key, job_id=job.id, artifact=artifact, actual_cost=job.cost
                )
                # The node check: an artifact outside its stage's output bounds is never registered as the
                # node's version; it is paid for, and the rules retry with the problem in the request.
                if problems := output_problems(inp.output, artifact.media):
                    event = Failure(
                        node=inp.node,
                        operation_key=key,
                        kind=FailureKind.INVALID_OUTPUT,
                        error=f"{inp.node} {'; '.join(problems)}",
                        actual_cost=job.cost,
                    )
        else:
            kind = FailureKind.TECHNICAL
            if job.error is not None and job.error.kind == "content_rejected":
                kind = FailureKind.CONTENT
            message = job.error.message if job.error is not None else f"job {job.id} ended {job.status}"
            event = Failure(node=inp.node, operation_key=key, kind=kind, error=message, actual_cost=job.cost)
        stored = await self._resolve(inp, event, spend=job.cost)
        if job.cost > inp.estimate:
            # Recorded as it is, never hidden or blocked: a marker flags it for people and the audit.
            anomaly = SystemMarker(
                kind=MarkerKind.COST_ANOMALY,
                node=inp.node,
                operation_key=key,
                detail=f"actual {job.cost} above the reserved estimate {inp.estimate}",
            )
            await self._write(
                inp.task_id, to_new(anomaly, dedup_key=f"{key}:cost_anomaly", operation_key=key)
            )
        return stored

    async def _resolve(
        self, inp: StageInput, event: Outcome | Failure | SystemMarker, *, spend: Decimal
    ) -> StoredEvent:
        """Write the operation's one resolution, settling its reservation at the actual cost, once."""
        key = inp.operation_key
        stored = await self._write(
            inp.task_id,
            to_new(event, dedup_key=f"{key}:result", operation_key=key),
            release=inp.estimate,
            spend=spend,
        )
        mark("outcome_recorded", op=key, type=stored.type)
        return stored


def _delay(seconds: float) -> timedelta:
    return timedelta(seconds=max(0.1, seconds))
