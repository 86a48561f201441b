"""The paid executor: one business attempt of one node at a "submit, then poll" vendor.

Life of an operation: INTENT (already fenced by the workflow) → submit with the OperationKey as the vendor's
idempotency key → Progress(job id) → poll, heartbeating the job id → artifact fetched, hash-verified, stored
atomically → Outcome(actual cost). Every write is idempotent on a key derived from the OperationKey, and the
result key ``{op}:result`` is shared by Outcome and Failure, so one operation has exactly one result.
"""

from __future__ import annotations

import asyncio
import functools
from datetime import timedelta
from decimal import Decimal

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.artifacts import ArtifactCorrupt, LocalArtifactStore
from activities.models import StageInput
from ledger.recorder import Recorder
from rules.envelope import NewEvent, StoredEvent
from rules.events import (
    ArtifactRef,
    Failure,
    FailureKind,
    MarkerKind,
    Outcome,
    Progress,
    SystemMarker,
    to_new,
)
from vendors.errors import (
    ArtifactHashMismatch,
    VendorConflict,
    VendorRateLimited,
    VendorRejected,
    VendorUnavailable,
)
from vendors.http import HttpJobVendor, JobStatus, VendorJob


class StageActivities:
    def __init__(
        self, recorder: Recorder, vendor: HttpJobVendor, store: LocalArtifactStore, poll_interval: float
    ):
        self.recorder = recorder
        self.vendor = vendor
        self.store = store
        self.poll_interval = poll_interval

    async def _write(
        self, task_id: str, event: NewEvent, *, release: Decimal = Decimal(0), spend: Decimal = Decimal(0)
    ) -> StoredEvent:
        stored, _inserted = await asyncio.to_thread(
            functools.partial(self.recorder.append_idempotent, task_id, event, release=release, spend=spend)
        )
        return stored

    @activity.defn(name="stage.run")
    async def run(self, inp: StageInput) -> StoredEvent:
        """Run the attempt; returns the recorded result event (the ledger's copy, for the loop to fold)."""
        key = inp.operation_key
        epoch, settled = await asyncio.to_thread(self.recorder.preflight, inp.task_id, f"{key}:result")
        if settled is not None:
            return settled  # a retry after the result was written: nothing left to do
        if epoch != inp.epoch:
            # A zombie attempt of a run that lost the task must never start new vendor work.
            raise ApplicationError(
                f"epoch {inp.epoch} is stale (current {epoch})", type="StaleEpoch", non_retryable=True
            )
        try:
            job = await self._submit_or_resume(inp)
            if job.status == JobStatus.RUNNING:
                job = await self.vendor.wait(
                    job.id, poll_interval=self.poll_interval, on_poll=lambda j: activity.heartbeat(j.id)
                )
            return await self._settle(inp, job)
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

    async def _submit_or_resume(self, inp: StageInput) -> VendorJob:
        details = activity.info().heartbeat_details
        if details:
            # A retry of this activity: resume polling the job we already have instead of submitting.
            return await self.vendor.get(str(details[0]))
        job = await self.vendor.submit(
            operation_key=inp.operation_key, executor=inp.executor, input=inp.input, estimate=inp.estimate
        )
        activity.heartbeat(job.id)
        if job.status == JobStatus.RUNNING:
            progress = Progress(node=inp.node, operation_key=inp.operation_key, job_id=job.id)
            await self._write(
                inp.task_id,
                to_new(progress, dedup_key=f"{inp.operation_key}:progress", operation_key=inp.operation_key),
            )
        return job

    async def _settle(self, inp: StageInput, job: VendorJob) -> StoredEvent:
        key = inp.operation_key
        event: Outcome | Failure
        if job.status == JobStatus.SUCCEEDED:
            try:
                data = await self.vendor.fetch_result(job)
                assert job.result is not None
                uri = await asyncio.to_thread(self.store.put, data, job.result.sha256)
            except (ArtifactHashMismatch, ArtifactCorrupt) as e:
                event = Failure(
                    node=inp.node,
                    operation_key=key,
                    kind=FailureKind.INVALID_OUTPUT,
                    error=str(e),
                    actual_cost=job.cost,
                )
            else:
                artifact = ArtifactRef(uri=uri, sha256=job.result.sha256, size=len(data))
                event = Outcome(
                    node=inp.node, operation_key=key, job_id=job.id, artifact=artifact, actual_cost=job.cost
                )
        else:
            kind = FailureKind.TECHNICAL
            if job.error is not None and job.error.kind == "content_rejected":
                kind = FailureKind.CONTENT
            message = job.error.message if job.error is not None else f"job {job.id} ended {job.status}"
            event = Failure(node=inp.node, operation_key=key, kind=kind, error=message, actual_cost=job.cost)
        result = to_new(event, dedup_key=f"{key}:result", operation_key=key)
        # The result settles the attempt's reservation at the actual cost, in the same transaction, once.
        stored = await self._write(inp.task_id, result, release=inp.estimate, spend=job.cost)
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


def _delay(seconds: float) -> timedelta:
    return timedelta(seconds=max(0.1, seconds))
