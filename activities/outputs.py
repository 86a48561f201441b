"""What a paid stage's vendor job comes to in the ledger: its output registered, or what it cost.

A finished job's output is streamed into the artifact store (hashed as it arrives, probed if it is media, held
to the node's output bounds) and registered as the operation's Outcome at the job's actual cost. After
acceptance the charge stands whatever happens next: a job that 404s (purged records), an output that is gone,
unreadable or outside its bounds is a Failure at the job's cost — from the vendor's billing where the adapter
has it, else at the estimate with a cost anomaly — never at zero; so is every job found beyond the one the
operation keeps. An earlier output of an equal request may stand in for a new call (reuse): nothing is sent.

Shared by the stage's run (``activities.stages``) and by closing an operation (``activities.closing``): a
job that finished while its task was ending is registered like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterable
from decimal import Decimal
from pathlib import Path
from typing import Any

from temporalio import activity

from activities.contracts import StageInput
from activities.operation import Operation
from artifacts.store import ArtifactCorrupt, ArtifactMissing, ArtifactStore, read_chunks, sha256_of
from ledger.recorder import Recorder
from media import MediaInvalid, MediaProbe, probe
from rules.checks import claim_disagrees, output_problems
from rules.envelope import StoredEvent
from rules.events import ArtifactRef, FailureKind, Media, Outcome
from rules.money import vendor_amount
from rules.projection import fold
from runtime.faults import mark
from vendors.adapter import JobStatus, MediaInfo, VendorAdapter, VendorJob, job_amount, price_bound
from vendors.errors import ResultTooLarge, ResultUnavailable, UnsafeResultUrl, VendorError, VendorNotFound
from vendors.registry import Adapters

MEDIA_FORMATS = frozenset({"png", "jpg", "jpeg", "webp", "gif", "mp4", "mov", "webm", "wav", "mp3", "m4a"})


class ResultProblem(Exception):
    """The output of a finished, paid job cannot be registered: recorded as a Failure at the job's cost."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Outputs:
    """A stage's artifacts and its jobs' charges, for the activities that run and close its operations."""

    def __init__(self, recorder: Recorder, store: ArtifactStore, store_for: Callable[[str], ArtifactStore]):
        self.recorder = recorder
        self.store = store
        self.store_for = store_for

    # ── a job's end ───────────────────────────────────────────────────────────────────────────────────
    async def settle(
        self, op: Operation, adapter: VendorAdapter, inp: StageInput, job: VendorJob
    ) -> StoredEvent:
        """Record the finished job as the operation's result; if another result stands (another attempt, or
        the task's end, resolved it meanwhile), this job was paid for all the same: record its charge."""
        stored = await self._settle_job(op, adapter, inp, job)
        if stored.payload.get("job_id") != job.id:  # every result written here names its job
            await op.late_charge(
                job.id, job_amount(adapter.route, job), "finished after another result stood"
            )
        return stored

    async def _settle_job(
        self, op: Operation, adapter: VendorAdapter, inp: StageInput, job: VendorJob
    ) -> StoredEvent:
        amount = job_amount(adapter.route, job)
        if job.status != JobStatus.SUCCEEDED:
            cost = await op.settle_cost(amount)
            content = job.error is not None and job.error.kind == "content_rejected"
            message = job.error.message if job.error is not None else f"job {job.id} ended {job.status}"
            kind = FailureKind.CONTENT if content else FailureKind.TECHNICAL
            return await op.failure(kind, message, cost, job_id=job.id)
        try:
            artifact = await self._store_output(op, adapter, inp, job)
        except ResultProblem as e:
            return await op.failure(e.kind, str(e), await op.settle_cost(amount), job_id=job.id)
        # The vendor's billing is judged by the route's own price, not by a plan's estimate.
        cost = await op.settle_cost(amount, price_bound=price_bound(adapter.route, job))
        # The node check: an artifact outside its stage's output bounds is never registered as the node's
        # version; it is paid for, and the rules retry with the problem in the request.
        if problems := output_problems(inp.output, artifact.media):
            error = f"{inp.node} {'; '.join(problems)}"
            return await op.failure(FailureKind.INVALID_OUTPUT, error, cost, job_id=job.id)
        outcome = Outcome(
            node=inp.node,
            operation_key=op.key,
            job_id=job.id,
            artifact=artifact,
            actual_cost=cost,
            input_hash=inp.input_hash,
        )
        return await op.resolve(outcome, spend=cost)

    async def get(self, op: Operation, adapter: VendorAdapter, job_id: str) -> VendorJob | StoredEvent:
        """The job as the vendor has it now; one the vendor no longer knows is a Failure at its charge."""
        try:
            return await adapter.get(job_id)
        except VendorNotFound as e:
            return await self._charge_stands(op, adapter, job_id, f"job {job_id} is gone at the vendor ({e})")

    async def _charge_stands(
        self, op: Operation, adapter: VendorAdapter, job_id: str, why: str
    ) -> StoredEvent:
        """The vendor accepted and billed the job: its cost comes from its billing, else the estimate."""
        raw = None
        if adapter.capabilities.has_billing:
            try:
                raw = await adapter.charged(op.key, job_id)
            except VendorError:
                raw = None
        if raw is not None:
            cost = await op.settle_cost(vendor_amount(raw))
        else:
            cost = op.estimate
            await op.anomaly(
                f"{why}; its charge cannot be read from the vendor: counted at the estimate {cost}", "billing"
            )
        return await op.failure(FailureKind.TECHNICAL, why, cost, job_id=job_id)

    async def charge_extras(
        self, op: Operation, adapter: VendorAdapter, jobs: Iterable[VendorJob], why: str
    ) -> None:
        """Jobs of this operation beyond the one it keeps: stop each, and record what it cost."""
        for job in jobs:
            if job.status == JobStatus.RUNNING and adapter.capabilities.can_cancel:
                job = await cancel(adapter, job.id)
            await op.late_charge(job.id, job_amount(adapter.route, job), why)

    # ── the output ────────────────────────────────────────────────────────────────────────────────────
    async def _store_output(
        self, op: Operation, adapter: VendorAdapter, inp: StageInput, job: VendorJob
    ) -> ArtifactRef:
        """Stream the output into the store (hashed as it arrives), probe it if it is media, publish it."""
        expected = job.result.sha256 if job.result is not None else None
        claimed = job.result.media if job.result is not None else None
        if adapter.route.rights and (claimed is None or not claimed.rights):
            # The route's declared terms stand in for rights metadata its vendor's answers never carry.
            claimed = (claimed or MediaInfo()).model_copy(update={"rights": dict(adapter.route.rights)})
        if expected is not None and (kept := await self._already_stored(inp, expected, claimed)) is not None:
            # Stored before a crash (the bytes the vendor promised, verified): never fetched again, so an
            # output the vendor purged meanwhile is not lost, and nothing is paid for twice.
            return kept
        inline = job.inline
        if inline is None and job.result is None and inp.undo:
            # An undo (unpublish, delete) often finishes with no file: its receipt is the artifact on record.
            receipt = {"job_id": job.id, "status": job.status.value, "undoes": inp.input.get("compensates")}
            inline = json.dumps(receipt, sort_keys=True).encode()
        with self.store.staging(op.key) as staging:
            try:
                if inline is not None:
                    staging.write(inline)
                else:
                    await adapter.download(job, staging.write)
            except VendorNotFound as e:
                raise ResultProblem(FailureKind.TECHNICAL, f"the output of job {job.id} is gone ({e})") from e
            except ResultUnavailable as e:
                # A CDN's 401/403 (an expired presigned URL), a redirect loop: this output fails, at its job's
                # cost; the route is not paused (that is for the vendor's API refusing our key).
                why = f"the output of job {job.id} cannot be downloaded ({e})"
                raise ResultProblem(FailureKind.TECHNICAL, why) from e
            except (UnsafeResultUrl, ResultTooLarge) as e:
                raise ResultProblem(FailureKind.INVALID_OUTPUT, str(e)) from e
            if expected is not None and staging.sha256 != expected:
                raise ResultProblem(
                    FailureKind.INVALID_OUTPUT,
                    f"artifact hash {staging.sha256[:12]}… does not match the vendor's {expected[:12]}…",
                )
            media, claim = await self._media(inp, staging.path, claimed)
            try:
                stored = await asyncio.to_thread(self.store.publish, staging, expected, operation_key=op.key)
            except ArtifactCorrupt as e:
                raise ResultProblem(FailureKind.INVALID_OUTPUT, str(e)) from e
        mark("artifact_stored", op=op.key, sha=stored.sha256[:12])
        return ArtifactRef(uri=stored.uri, sha256=stored.sha256, size=stored.size, media=media, claimed=claim)

    async def refetch(self, op: Operation, adapters: Adapters, ref: dict[str, Any]) -> bool:
        """Put an input whose bytes are gone or changed in the store back, fetched again from the vendor job
        that made it, if the vendor still holds its output and it hashes to the recorded sha256 — nothing
        paid, nothing made again; the ledger records it (``artifact_refetched``). False: it could not be
        (no vendor job on record, the vendor purged it, other bytes): the caller records it lost.

        The job is the producing Outcome's, found by the input's sha256; its route is the one the producing
        INTENT dispatched to (a person's re-route since does not change where it was made)."""
        sha256, node = str(ref["sha256"]), str(ref.get("node") or "")
        events = await asyncio.to_thread(self.recorder.read_events, op.task_id)
        made = next(
            (
                e
                for e in reversed(events)
                if e.type == "Outcome"
                and e.payload.get("node") == node
                and (e.payload.get("artifact") or {}).get("sha256") == sha256
                and e.payload.get("job_id")
                and not e.payload.get("reused_from")
            ),
            None,
        )
        intent = next(
            (
                e
                for e in events
                if made is not None and e.type == "Intent" and e.operation_key == made.operation_key
            ),
            None,
        )
        executor = (intent.payload.get("action") or {}).get("executor") if intent is not None else None
        if made is None or not executor:
            return False
        job_id = str(made.payload["job_id"])
        try:
            adapter = adapters.get(str(executor))
            job = await adapter.get(job_id)
            if job.inline is None and job.result is None:
                return False
            with self.store.staging(op.key) as staging:
                if job.inline is not None:
                    staging.write(job.inline)
                else:
                    await adapter.download(job, staging.write)
                await asyncio.to_thread(self.store.publish, staging, sha256, operation_key=op.key)
        except (VendorError, ArtifactCorrupt, KeyError) as e:
            activity.logger.warning("input %s (%s…) could not be fetched again: %s", node, sha256[:12], e)
            return False
        await op.refetched(node, sha256, job_id)
        return True

    async def _already_stored(self, inp: StageInput, sha256: str, claimed: Any) -> ArtifactRef | None:
        """These bytes as the store holds them, intact and probed, if it does (one read of the object)."""
        uri = await asyncio.to_thread(self.store.find, sha256)
        if uri is None:
            return None
        with contextlib.ExitStack() as stack:
            try:
                path = await asyncio.to_thread(stack.enter_context, self.store.local_copy(uri))
            except ArtifactMissing:
                return None
            digest, size = await asyncio.to_thread(_file_sha256, path)
            if digest != sha256:
                return None  # changed in the store: fetched again from the vendor
            media, claim = await self._media(inp, path, claimed)
        return ArtifactRef(uri=uri, sha256=sha256, size=size, media=media, claimed=claim)

    async def _media(self, inp: StageInput, path: Any, claimed: Any) -> tuple[Media | None, Media | None]:
        """What the file is, probed (never only what the vendor says), with the vendor's rights metadata.

        A stage that bounds its output, or a file the vendor or the request calls media, is decoded: one that
        does not decode (truncated, another type) is ``invalid_output`` with the probe's reason; a claim that
        disagrees with the file is kept beside it (``claimed``), for the review to report.
        """
        said = Media.model_validate(claimed.model_dump()) if claimed is not None else None
        fmt = (said.format if said else None) or inp.input.get("format")
        if inp.output is None and str(fmt).lower() not in MEDIA_FORMATS:
            return said, None
        try:
            found = await asyncio.to_thread(probe, path)
        except MediaInvalid as e:
            raise ResultProblem(FailureKind.INVALID_OUTPUT, f"the output is not valid media: {e}") from e
        media = probed(found, rights=said.rights if said else None)
        return media, said if said is not None and claim_disagrees(media, said) else None

    # ── an earlier output instead ─────────────────────────────────────────────────────────────────────
    async def reuse(self, op: Operation, inp: StageInput) -> StoredEvent | None:
        """Register an earlier output of an equal request (same input hash) instead of paying again.

        The rules name this task's reusable output in the Dispatch; with ``reuse: project`` an earlier task of
        the project may hold one too. The bytes are verified first: a missing or corrupt output is recorded as
        lost and this attempt voided (the next one is a real dispatch), never handed on.
        """
        candidate = inp.reuse
        if candidate is None and inp.reuse_project and inp.input_hash:
            candidate = await self._project_output(inp)
        if candidate is None:
            return None
        artifact = ArtifactRef.model_validate(candidate["artifact"])
        store = self.store_for(artifact.uri)
        if not await asyncio.to_thread(store.verify, artifact.uri, artifact.sha256):
            await op.lost(inp.node, artifact.sha256)
            return await op.void(f"the output of {candidate['operation_key']} to reuse is missing or corrupt")
        outcome = Outcome(
            node=inp.node,
            operation_key=op.key,
            artifact=artifact,
            actual_cost=Decimal(0),
            input_hash=inp.input_hash,
            reused_from=candidate["operation_key"],
        )
        return await op.resolve(outcome, spend=Decimal(0))

    async def _project_output(self, inp: StageInput) -> dict[str, Any] | None:
        """A reusable output of an earlier task of the project for this input hash, if one exists.

        An output is offered only if no task that has it — its maker, any task that reused it, and this task —
        found it lost, had it blamed by a review or undid it (a failed task's compensation): each task records
        that in its own ledger, so all of them are read, not only the one that made it.
        """
        assert inp.input_hash is not None and inp.reuse_project is not None
        found = await asyncio.to_thread(
            self.recorder.outputs_by_input_hash, inp.input_hash, inp.reuse_project
        )
        refused: set[str] = set()
        offers: list[dict[str, Any]] = []
        for task_id in {inp.task_id, *(e.task_id for e in found)}:
            p = fold(await asyncio.to_thread(self.recorder.read_events, task_id))
            refused.update(str(u.sha256) for u in p.compensations.values() if u.done)
            for node in p.nodes.values():
                for out in node.outputs:
                    sha = str(out.artifact.get("sha256"))
                    if out.flagged or out.lost:
                        refused.add(sha)
                    elif task_id != inp.task_id and node.id == inp.node and out.input_hash == inp.input_hash:
                        offers.append({"operation_key": out.operation_key, "artifact": out.artifact})
        usable = [o for o in offers if o["artifact"].get("sha256") not in refused]
        # The node's own bounds still hold: an output made under looser ones is not reused.
        usable = [o for o in usable if not output_problems(inp.output, _media_of(o["artifact"]))]
        return usable[-1] if usable else None


async def cancel(adapter: VendorAdapter, job_id: str) -> VendorJob:
    """Cancel a job and return it as it ends: if the answer carries no cost (a vendor that cancels
    asynchronously, or prices by metrics it reports only once done), read it once more."""
    job = await adapter.cancel(job_id)
    if job.cost is None and job.seconds is None:
        # On failure the cancel's answer is all there is: job_amount flags what it cannot price.
        with contextlib.suppress(VendorError):
            job = await adapter.get(job_id)
    return job


def probed(found: MediaProbe, rights: dict[str, str] | None = None) -> Media:
    """A file's media metadata as the ledger records it: what the probe found (plus the vendor's rights)."""
    return Media(
        format=found.format,
        duration_s=round(found.duration_s, 3) if found.duration_s is not None else None,
        width=found.width,
        height=found.height,
        codec=found.codec,
        frames=found.frames,
        rights=rights,
    )


def _file_sha256(path: Path) -> tuple[str, int]:
    with path.open("rb") as f:
        return sha256_of(read_chunks(f))


def _media_of(artifact: dict[str, Any]) -> Media | None:
    media = artifact.get("media")
    return Media.model_validate(media) if isinstance(media, dict) else None
