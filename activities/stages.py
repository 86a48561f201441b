"""The paid executor: one business attempt of one node at its route's vendor, inside the Operation lifecycle.

    open (epoch, route state, the operation's record) → reconcile → [submit, write-ahead and fenced]
    → Progress(job id) → poll, heartbeating the job id, under the stall watchdog
    → the output streamed into the artifact store (hashed as it arrives, probed if it is media)
    → Outcome at the actual cost, or a Failure at what the job cost

What is known about a vendor error decides what it means (``vendors.errors``): a refusal before acceptance
(429, 408, 401/403, 400) clears the "maybe sent" state; after acceptance the charge stands whatever happens
next — a job that 404s (purged records) or whose output is gone is a Failure at its cost (from the vendor's
billing where the adapter has it, else at the estimate with a cost anomaly), never at zero. A credentials
error pauses the route for every worker and task until a person resumes it. ``operation.close`` ends an
operation whose task ended, from the record and the vendor; ``operation.sweep`` finds jobs a vendor created
for a key after the operation was voided and records their charges.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Iterable
from decimal import Decimal
from pathlib import Path
from typing import Any

from temporalio import activity

from activities.boundary import NotYetProvable, RoutePaused, cross
from activities.models import CloseInput, StageInput, SweepInput
from activities.operation import Heartbeat, Operation, chosen_route, heartbeating, recorded
from artifacts.store import ArtifactCorrupt, ArtifactMissing, ArtifactStore, read_chunks, sha256_of
from ledger.errors import AlreadyResolved, StaleEpoch
from ledger.recorder import Recorder, Routing
from media import MediaInvalid, MediaProbe, probe
from reconcile.operations import Next, OperationState, after_lookup, operation_state, reconcile, stop_step
from reconcile.watchdog import StallWatch
from rules.actions import OPERATION_KINDS
from rules.checks import claim_disagrees, output_problems
from rules.envelope import StoredEvent
from rules.events import ArtifactRef, FailureKind, MarkerKind, Media, Outcome
from rules.inputs import refs
from rules.keys import is_result_key
from rules.money import vendor_amount
from rules.projection import fold
from rules.routing import BreakerState, Observation, convert
from runtime.faults import mark
from runtime.telemetry import traced
from vendors.adapter import Capabilities, JobStatus, VendorAdapter, VendorJob, job_amount
from vendors.errors import (
    UnsafeResultUrl,
    VendorAuthError,
    VendorCannotTell,
    VendorConflict,
    VendorError,
    VendorNotFound,
    VendorRejected,
    VendorUnavailable,
)
from vendors.registry import Adapters
from vendors.routes import AdapterKind, RouteSpec

# operation.close asks an unreachable vendor this many times before counting the operation at its estimate.
CLOSE_VENDOR_ATTEMPTS = 6  # with CLOSE_RETRY's backoff: about half a minute of trying
MEDIA_FORMATS = frozenset({"png", "jpg", "jpeg", "webp", "gif", "mp4", "mov", "webm", "wav", "mp3", "m4a"})
# Framework work (compose, review, gate) has no route: nothing to look up, and only the review pays (a model
# call, which cannot be looked up either).
FRAMEWORK = Capabilities(can_lookup=False, can_cancel=False, synchronous=True, has_billing=False)


class _Attempt:
    """How far this attempt got at the vendor: what a cancellation has to stop and account for."""

    def __init__(self) -> None:
        self.job_id: str | None = None
        self.beat: Heartbeat | None = None

    def accepted(self, job_id: str) -> None:
        """The vendor holds this job: heartbeat its id from now on, so a retry resumes it."""
        self.job_id = job_id
        if self.beat is not None:
            self.beat.beat(job_id)


class ResultProblem(Exception):
    """The output of a finished, paid job cannot be registered: recorded as a Failure at the job's cost."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class StageActivities:
    def __init__(
        self,
        recorder: Recorder,
        adapters: Adapters,
        store: ArtifactStore,
        poll_interval: float,
        *,
        store_for: Any = None,
        pause_retry_s: float = 30.0,
        max_poll_interval: float = 5.0,
        human_capacity: int = 0,
    ):
        self.recorder = recorder
        self.adapters = adapters
        self.store = store
        self.store_for = store_for or (lambda uri: store)
        self.poll_interval = poll_interval
        self.max_poll_interval = max_poll_interval
        # Open requests each project's people can hold (rules.pressure); 0: no backpressure, nothing read.
        self.human_capacity = human_capacity
        self.pause_retry_s = pause_retry_s
        self.actor = f"worker {socket.gethostname()}:{os.getpid()}"

    def _operation(self, inp: StageInput | CloseInput, route: str | None) -> Operation:
        return Operation(
            self.recorder,
            task_id=inp.task_id,
            node=inp.node,
            key=inp.operation_key,
            epoch=inp.epoch,
            estimate=inp.estimate,
            route=route,
            pause_retry_s=self.pause_retry_s,
        )

    @activity.defn(name="stage.run")
    async def run(self, inp: StageInput) -> StoredEvent | list[StoredEvent]:
        """Write the dispatch's INTENT (where the workflow left it to the executor), then run (or resume) the
        attempt; returns the operation's rows (or, for an INTENT the workflow wrote, its resolution)."""
        capacity = self.human_capacity or None  # 0: backpressure off, nothing read
        return await recorded(self.recorder, inp, lambda: self._run(inp), self._routing(inp), capacity)

    def _routing(self, inp: StageInput) -> Routing | None:
        """A vendor route's dispatch is routed (its breaker, its fallbacks); local work is not."""
        table = self.adapters.table
        if inp.executor not in table.routes or table.route(inp.executor).adapter == AdapterKind.LOCAL:
            return None
        chain = table.chain(inp.executor)
        quotas = tuple(
            (c.route, spec.concurrency, spec.priority_aging)
            for c in chain
            if (spec := table.route(c.route)).concurrency is not None
        )
        return Routing(
            inp.executor,
            chain,
            inp.operation_key,
            task_id=inp.task_id,
            quotas=quotas,
            priority=inp.priority,
            deadline=inp.deadline,
        )

    async def _run(self, inp: StageInput) -> StoredEvent:
        route = chosen_route() or inp.executor
        if route != inp.executor:
            # A fallback: its own adapter, its own name for the job, the request in its field names.
            spec = self.adapters.table.route(route)
            inp = inp.model_copy(update={"executor": route, "input": convert(inp.input, spec.convert)})
        op = self._operation(inp, inp.executor)
        attempt = _Attempt()
        try:
            adapter = traced(self.adapters.get(inp.executor))  # a span per vendor call
            state = await op.open()
            if state.result is not None:
                return state.result  # a retry after the result was written: nothing left to do
            if not inp.undo and (moved := _not_serving(op, state)) is not None:
                # Its route stopped serving before anything of it was accepted: give the node back to the
                # loop, free (a void), and its next dispatch is routed afresh — to a fallback, or it waits.
                # Not an undo: it has no fallback, and cleaning up a failed task must not wait for a breaker
                # (a route that is really down fails the undo's calls, and they are retried).
                return await op.void(moved)
            # Heartbeat all along (verifying inputs, a long synchronous call, a download), not only while
            # polling: an attempt that stops heartbeating is given to another worker, and two attempts of one
            # operation at once is what a fence cannot fully undo.
            try:
                async with heartbeating() as beat:
                    attempt.beat = beat
                    result = await self._attempt(op, adapter, inp, state, attempt)
            except VendorUnavailable as e:
                await self._observe(inp, _unavailable(e))
                raise
            await self._observe(inp, Observation.ANOMALY if op.billing_off else _told(result))
            return result
        except AlreadyResolved:
            # The operation was resolved while this attempt worked (the task's end closed it, or another
            # attempt did): nothing was sent by this attempt after that; the recorded result stands.
            resolved = await op.open(fenced=False)
            assert resolved.result is not None
            return resolved.result
        except asyncio.CancelledError:
            await self._abandon(op, inp, attempt)
            raise
        except VendorAuthError as e:
            cross(await self._pause(inp.executor, e))
        except Exception as e:
            cross(e)

    async def _observe(self, inp: StageInput, what: Observation) -> None:
        """Tell the route's shared breaker what this call showed (never fails the attempt: the breaker is
        advice for the next dispatches, the operation's own record is already written)."""
        spec = self.adapters.table.routes.get(inp.executor)
        if spec is None or spec.adapter == AdapterKind.LOCAL:
            return
        policy = spec.breaker.policy()
        try:
            change = await asyncio.to_thread(
                self.recorder.observe, inp.executor, what, inp.operation_key, policy
            )
        except Exception as e:  # advice only: logged, the attempt's result stands
            activity.logger.warning("route %s: observation %s not recorded: %s", inp.executor, what.value, e)
            return
        if change is not None:
            activity.logger.warning("route %s: breaker %s after %s", inp.executor, change, what.value)

    async def _pause(self, route: str, error: VendorError) -> RoutePaused:
        """A credentials (or address) error: the route pauses for every worker and task, a person is paged."""
        await asyncio.to_thread(self.recorder.pause_route, route, str(error), self.actor)
        return RoutePaused(route, str(error), self.pause_retry_s)

    async def _attempt(
        self, op: Operation, adapter: VendorAdapter, inp: StageInput, state: OperationState, attempt: _Attempt
    ) -> StoredEvent:
        assert attempt.beat is not None
        heartbeat_job = str(attempt.beat.details) if attempt.beat.details is not None else None
        if not state.sends and heartbeat_job is None and state.job_id is None:
            # Nothing was ever sent for this operation: an equal request's output may stand in for it.
            reused = await self._reuse(op, inp)
            if reused is not None:
                return reused
        step = await reconcile(adapter, adapter.route, state, op.key, heartbeat_job)
        if step.next == Next.VOID:
            return await op.void(step.why)
        if step.next == Next.UNKNOWN:
            return await op.unknown(step.why)
        if step.next == Next.WAIT:
            raise NotYetProvable(step.why, step.wait_s)
        if step.next == Next.RESUME:
            assert step.job_id is not None
            attempt.accepted(step.job_id)
            await self._charge_extras(op, adapter, step.extra, "a second job found under the operation's key")
            got = step.job or await self._get(op, adapter, step.job_id)
            if isinstance(got, StoredEvent):
                return got
            job = got
            if job.id != state.job_id:
                await op.progress(job.id, job.progress)
        else:
            submitted = await self._submit(op, adapter, inp, state, attempt)
            if isinstance(submitted, StoredEvent):
                return submitted
            job = submitted
        if job.status == JobStatus.RUNNING:
            polled = await self._poll(op, adapter, inp, job)
            if isinstance(polled, StoredEvent):
                return polled
            job = polled
        if job.status == JobStatus.RUNNING:  # the watchdog gave up on it
            return await self._stalled(op, adapter, inp, job)
        mark("vendor_completed", op=op.key, job=job.id)
        return await self._settle(op, adapter, inp, job)

    # ── the vendor side ───────────────────────────────────────────────────────────────────────────────
    async def _submit(
        self, op: Operation, adapter: VendorAdapter, inp: StageInput, state: OperationState, attempt: _Attempt
    ) -> VendorJob | StoredEvent:
        caps = adapter.capabilities
        files = await self._input_urls(op, inp)
        if isinstance(files, StoredEvent):
            return files  # an input is gone: nothing was sent, its producer makes it again
        timeout = adapter.route.timeouts.request
        send = None if caps.free else await op.sending(state, timeout)
        mark("submitting", op=op.key)
        try:
            # A deadline for the whole send from the marker on (httpx's timeout is per phase: a pooled
            # connection's wait plus connect plus write could outlast the time the marker promises).
            async with asyncio.timeout(timeout):
                job = await adapter.submit(
                    operation_key=op.key,
                    executor=inp.executor,
                    request=inp.input,
                    estimate=inp.estimate,
                    files=files,
                )
        except TimeoutError:
            raise VendorUnavailable(f"submit of {op.key}: no answer within {timeout:g}s") from None
        except VendorError as e:
            if e.refused and send is not None:
                await op.refused(send, str(e))  # provably not accepted: no longer "maybe sent"
            earlier = bool(state.maybe_sent) and not caps.free
            if isinstance(e, VendorNotFound):
                # A 404 to a submit is the route's address, not the request: nothing was accepted; pause the
                # route for a person instead of retrying a wrong URL forever.
                if send is not None:
                    await op.refused(send, str(e))
                raise await self._pause(inp.executor, e) from e
            if isinstance(e, VendorRejected) and not isinstance(e, VendorAuthError):
                if earlier:
                    # An earlier send may have been accepted (and this one refused because of it): its charge
                    # is not zero. Find it, or ask a person.
                    return await self._after_refusal(op, adapter, state, e, attempt)
                # The request itself is refused: resending it unchanged cannot help. Nothing was accepted.
                return await op.failure(
                    FailureKind.CONTENT, f"the vendor refused the request: {e}", Decimal(0)
                )
            if isinstance(e, VendorConflict):
                # The key is in use at the vendor (a request still in flight, or an earlier send): adopt what
                # it holds under the key, or look again shortly; never resubmit into a conflict.
                return await self._after_refusal(op, adapter, state, e, attempt)
            raise
        attempt.accepted(job.id)
        mark("vendor_accepted", op=op.key, job=job.id)
        if job.status == JobStatus.RUNNING:
            await op.progress(job.id, job.progress)
        return job

    async def _after_refusal(
        self, op: Operation, adapter: VendorAdapter, state: OperationState, e: VendorError, attempt: _Attempt
    ) -> VendorJob | StoredEvent:
        """A submit refused because of what the vendor already holds under the key: adopt it, or wait until
        it shows (while a send could still land), or — nothing to look it up with — ask a person."""
        if not adapter.capabilities.can_lookup:
            return await op.unknown(f"the vendor refused a resubmission ({e}) and cannot look the key up")
        step = after_lookup(state, adapter.route, await adapter.find_by_key(op.key))
        if step.job is not None:
            attempt.accepted(step.job.id)
            await self._charge_extras(op, adapter, step.extra, "a second job found under the operation's key")
            return step.job
        if step.next == Next.WAIT:
            why = f"the key is in use at the vendor ({e}) but no job is visible yet"
            raise NotYetProvable(why, min(1.0, step.wait_s + 0.1)) from e
        # Absent, and no send can land any more — yet the vendor refused the key: something holds it.
        return await op.unknown(f"the vendor refused the key ({e}) but no job of it can be found")

    async def _charge_extras(
        self, op: Operation, adapter: VendorAdapter, jobs: Iterable[VendorJob], why: str
    ) -> None:
        """Jobs of this operation beyond the one it keeps: stop each, and record what it cost."""
        for job in jobs:
            if job.status == JobStatus.RUNNING and adapter.capabilities.can_cancel:
                job = await _cancel(adapter, job.id)
            await op.late_charge(job.id, job_amount(adapter.route, job), why)

    async def _input_urls(self, op: Operation, inp: StageInput) -> dict[str, str] | StoredEvent:
        """Every input, verified against its recorded sha256, and a URL the vendor can fetch it from.

        The URLs are made here, just before the call, and never recorded (a presigned URL is a credential).
        An input whose bytes are gone or changed is never handed on: it is recorded as lost (its producer
        makes it again) and this attempt is voided, nothing sent.
        """
        inputs = refs(inp.input.get("inputs"))
        if (lost := await op.check_inputs(inputs, self.store_for)) is not None:
            return lost
        return {
            r["sha256"]: await asyncio.to_thread(self.store_for(r["uri"]).fetch_url, r["uri"]) for r in inputs
        }

    async def _reuse(self, op: Operation, inp: StageInput) -> StoredEvent | None:
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

    async def _get(self, op: Operation, adapter: VendorAdapter, job_id: str) -> VendorJob | StoredEvent:
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

    async def _poll(
        self, op: Operation, adapter: VendorAdapter, inp: StageInput, job: VendorJob
    ) -> VendorJob | StoredEvent:
        """Poll until the job ends or stalls, heartbeating its id: a retry resumes it, never resubmits."""
        watch = StallWatch(inp.stall_after)
        mark("polling", op=op.key, job=job.id)
        # From poll_interval, half as long again each time, up to max_poll_interval: a quick job is seen at
        # once, a job of minutes costs a poll every few seconds (not 20 a second: a thousand tasks' polls
        # were most of the soak's CPU, the vendor's too).
        delay = self.poll_interval
        while job.status == JobStatus.RUNNING:  # the job id is heartbeated (attempt.accepted)
            if watch.stalled(job.progress, time.monotonic()):
                return job
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, max(self.poll_interval, self.max_poll_interval))
            got = await self._get(op, adapter, job.id)
            if isinstance(got, StoredEvent):
                return got
            job = got
        return job

    async def _stalled(
        self, op: Operation, adapter: VendorAdapter, inp: StageInput, job: VendorJob
    ) -> StoredEvent:
        """Cancel a stalled job at the vendor and record the failure with what it cost so far."""
        cancelled = await _cancel(adapter, job.id)
        cost = await op.settle_cost(job_amount(adapter.route, cancelled))
        shown = f"{cancelled.progress:.0%}" if cancelled.progress is not None else "unknown progress"
        error = f"no progress for {inp.stall_after:g}s at {shown}: cancelled job {job.id}"
        return await op.failure(FailureKind.STALLED, error, cost, job_id=job.id)

    # ── the result ────────────────────────────────────────────────────────────────────────────────────
    async def _settle(
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
        cost = await op.settle_cost(amount, own_job=True)
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

    async def _store_output(
        self, op: Operation, adapter: VendorAdapter, inp: StageInput, job: VendorJob
    ) -> ArtifactRef:
        """Stream the output into the store (hashed as it arrives), probe it if it is media, publish it."""
        expected = job.result.sha256 if job.result is not None else None
        claimed = job.result.media if job.result is not None else None
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
            except UnsafeResultUrl as e:
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

    # ── ending an operation ───────────────────────────────────────────────────────────────────────────
    async def _abandon(self, op: Operation, inp: StageInput, attempt: _Attempt) -> None:
        """The workflow cancelled this attempt (its task ended): stop the job and record what it cost.

        Only for a cancellation the workflow asked for. Any other (the worker shutting down, a heartbeat
        timeout, a run that is gone) leaves the operation open, for the next attempt or run to reconcile.
        """
        why = activity.cancellation_details()
        if why is None or not why.cancel_requested:
            return
        try:
            await self._stop(op, inp, attempt.job_id)
        except Exception:
            # The workflow closes whatever is still open (operation.close), from the record and the vendor.
            activity.logger.warning("could not stop %s on cancellation; the workflow will close it", op.key)

    async def _stop(
        self,
        op: Operation,
        stage: StageInput,
        heartbeat_job: str | None,
        *,
        gave_up: str | None = None,
    ) -> StoredEvent:
        """End an open operation now, never submitting: cancel its job and record what it cost.

        ``stage``: the node's request and bounds, so a job that succeeded meanwhile is checked and registered
        like any other output. ``gave_up``: why its executor ended without a result (the task goes on): an
        operation that never reached the vendor is then a technical Failure (counted against the node's
        retries, so a bug cannot loop through voids), not a void.
        """
        executor = stage.executor
        state = await op.open(fenced=False)
        if state.result is not None:
            return state.result
        try:
            adapter: VendorAdapter | None = traced(self.adapters.get(executor))
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
        got = step.job or await self._get(op, adapter, step.job_id)
        if isinstance(got, StoredEvent):
            return got
        job = got
        if job.status == JobStatus.RUNNING and adapter.capabilities.can_cancel:
            job = await _cancel(adapter, job.id)
        if job.status == JobStatus.SUCCEEDED:
            return await self._settle(op, adapter, stage, job)
        cost = await op.settle_cost(job_amount(adapter.route, job))
        shown = f"{job.progress:.0%}" if job.progress is not None else "?"
        error = f"cancelled: {why} while job {job.id} was {job.status} at {shown}"
        return await op.failure(FailureKind.TECHNICAL, error, cost, job_id=job.id)

    @activity.defn(name="operation.close")
    async def close(self, inp: CloseInput) -> StoredEvent:
        """Resolve an operation left open when its task ended, or whose executor gave up without a result.

        From the record and the vendor, never from a guess: a known job is cancelled and counted at what it
        cost; a maybe-sent request is looked up where the vendor can (and waited for until it is provably
        absent); otherwise it is an unknown outcome at the estimate with a cost anomaly. Never zero for a
        charge that may have happened.
        """
        op = self._operation(inp, None)
        # The route its INTENT chose (a fallback's operation is closed at the fallback).
        route = await asyncio.to_thread(self._route_of, inp.operation_key) or inp.executor
        stage = StageInput(
            task_id=inp.task_id,
            node=inp.node,
            operation_key=inp.operation_key,
            attempt=0,
            epoch=0,
            executor=route,
            estimate=inp.estimate,
            output=inp.output,
            input_hash=inp.input_hash,
        )
        try:
            try:
                return await self._stop(op, stage, None, gave_up=inp.gave_up)
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

    def _route_of(self, operation_key: str) -> str | None:
        """The route an operation's INTENT recorded (None: not routed, or the workflow wrote it)."""
        for e in self.recorder.events_by_operation_key(operation_key):
            if e.type == "Intent":
                route = e.payload.get("route")
                return route if isinstance(route, str) and route in self.adapters.table.routes else None
        return None

    @activity.defn(name="operation.sweep")
    async def sweep(self, inp: SweepInput) -> int:
        """Find jobs the vendor created under a key after its operation was voided; record their charges.

        A void is proof of absence only while the vendor keeps its promised acceptance window; a job that
        appears later still cost money. Run when the task ends: every voided operation that may have been sent
        is looked up (where the route can) and every job found is cancelled and its charge recorded. Returns
        how many late jobs were found.
        """
        try:
            events = await asyncio.to_thread(self.recorder.read_events, inp.task_id)
            by_op: dict[str, list[StoredEvent]] = {}
            for e in events:
                if e.operation_key is not None:
                    by_op.setdefault(e.operation_key, []).append(e)
            found = 0
            for key, op_events in by_op.items():
                found += await self._sweep_one(inp, key, op_events)
            return found
        except Exception as e:
            cross(e)

    async def _sweep_one(self, inp: SweepInput, key: str, op_events: list[StoredEvent]) -> int:
        result = next((e for e in op_events if is_result_key(e.dedup_key)), None)
        void = (
            result is not None
            and result.type == "SystemMarker"
            and result.payload.get("kind") == MarkerKind.VOID
        )
        intent = next((e for e in op_events if e.type == "Intent"), None)
        if not void or intent is None or intent.payload["action"].get("kind") not in OPERATION_KINDS:
            return 0
        assert result is not None
        state = operation_state(op_events, result.recorded_at)  # as it stood when it was voided
        executor = intent.payload.get("route") or intent.payload["action"]["executor"]
        try:
            adapter = traced(self.adapters.get(executor))
        except Exception:
            return 0
        if not state.maybe_sent or not adapter.capabilities.can_lookup or adapter.capabilities.free:
            return 0
        try:
            jobs = await adapter.find_by_key(key)
        except VendorCannotTell:
            return 0  # the vendor cannot say (its listing is cut): nothing more to learn here
        op = Operation(
            self.recorder,
            task_id=inp.task_id,
            node=str(result.payload.get("node")),
            key=key,
            epoch=0,
            estimate=Decimal(str(intent.payload.get("reservation") or "0")),
        )
        await self._charge_extras(op, adapter, jobs, "created after its operation was voided")
        return len(jobs)


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


async def _cancel(adapter: VendorAdapter, job_id: str) -> VendorJob:
    """Cancel a job and return it as it ends: if the answer carries no cost (a vendor that cancels
    asynchronously, or prices by metrics it reports only once done), read it once more."""
    job = await adapter.cancel(job_id)
    if job.cost is None and job.seconds is None:
        # On failure the cancel's answer is all there is: job_amount flags what it cannot price.
        with contextlib.suppress(VendorError):
            job = await adapter.get(job_id)
    return job


def _media_of(artifact: dict[str, Any]) -> Media | None:
    media = artifact.get("media")
    return Media.model_validate(media) if isinstance(media, dict) else None


def _told(result: StoredEvent) -> Observation:
    """What an attempt's result says of its route: an output arrived, or the job failed technically; any
    other end (a refused request, an output outside its bounds, an unknown outcome, a void) says nothing of
    the route's health, but still ends a probe or a canary unproven."""
    if result.type == "Outcome":
        return Observation.OK
    if result.type == "Failure" and result.payload.get("kind") in (
        FailureKind.TECHNICAL,
        FailureKind.STALLED,
    ):
        return Observation.ERROR
    return Observation.SETTLED


def _unavailable(error: VendorUnavailable) -> Observation:
    return (
        Observation.TIMEOUT if "timed out" in str(error) or "no answer" in str(error) else Observation.ERROR
    )


def _not_serving(op: Operation, state: OperationState) -> str | None:
    """Why this operation must not go on at its route (None: it may): the route's breaker is open (or
    half-open with another operation as its probe) and nothing of this operation may have been accepted —
    no job, no send that was not refused. An operation that may have been accepted stays, and reconciles
    at its route once the route answers again."""
    h = op.breaker
    if h is None or state.job_id is not None or state.maybe_sent:
        return None
    if h.state == BreakerState.OPEN or (h.state == BreakerState.HALF_OPEN and h.probe_key != op.key):
        why = f"{h.state.value}: {h.reason}"
        return f"route {op.route} stopped serving ({why}); nothing was sent, the node goes again"
    return None
