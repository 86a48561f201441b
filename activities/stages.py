"""The paid executor: one business attempt of one node at its route's vendor, inside the Operation lifecycle.

    INTENT, choosing the route → open (epoch, route state, the operation's record) → reconcile
    → [submit, write-ahead and fenced] → Progress(job id) → poll, heartbeating the job id, under the stall
    watchdog → the output registered as the Outcome, or a Failure at what the job cost (activities.outputs)

What is known about a vendor error decides what it means (``vendors.errors``): a refusal before acceptance
(429, 408, 401/403, 400) clears the "maybe sent" state; after acceptance the charge stands whatever happens
next. A credentials error pauses the route for every worker and task until a person resumes it. What the
call showed of the route (an answer, an error, a timeout, a bill far above its estimate) goes to the route's
shared breaker. Ending an operation from outside its run (``operation.close``, ``operation.sweep``) is
``activities.closing``, which these activities extend: a cancelled run stops its job the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any, Final

from temporalio import activity

from activities.boundary import NotYetProvable, cross
from activities.callbacks import CallbackWaker
from activities.closing import ClosingActivities
from activities.contracts import Activity, StageInput
from activities.operation import Heartbeat, Operation, heartbeating, routed
from activities.outputs import cancel
from artifacts.store import ArtifactStore
from ledger import txcount
from ledger.errors import AlreadyResolved
from ledger.recorder import Recorder, Routing
from reconcile.operations import Next, OperationState, after_lookup, reconcile
from reconcile.watchdog import StallWatch
from rules.envelope import StoredEvent
from rules.events import FailureKind
from rules.inputs import refs
from rules.routing import BreakerPolicy, BreakerState, Observation, convert
from runtime.faults import mark
from vendors.adapter import JobStatus, Sent, VendorAdapter, VendorJob, job_amount, mode_of
from vendors.errors import (
    VendorAuthError,
    VendorConflict,
    VendorError,
    VendorNotFound,
    VendorRejected,
    VendorUnavailable,
)
from vendors.registry import Adapters
from vendors.routes import AdapterKind, VendorMode

# What an INTENT's write-ahead window (``_ahead_window``) allows beyond the send's own timeout, for the work
# between the INTENT and the send (the operation's read, looking for an equal output): a send that would
# not fit any more writes its own ``submitting`` marker (uploading inputs first may take that long).
AHEAD_SLACK_S: Final = 2.0
# Where the vendor finds a job by our key, its id reaches the ledger once the job has run this long, or with
# its result: most jobs of a quick vendor end before, one write fewer each (a crash loses nothing: the key).
RECORD_RUNNING_AFTER_S: Final = 2.0


class _Attempt:
    """How far this attempt got at the vendor: what a cancellation has to stop and account for."""

    def __init__(self) -> None:
        self.job_id: str | None = None
        self.beat: Heartbeat | None = None
        # A job the vendor took, its id not yet in the ledger (``_submit``: where the vendor finds jobs by
        # our key, the id is written by the first poll that sees the job still running after
        # RECORD_RUNNING_AFTER_S, or with its result), and when (time.monotonic) the vendor took it.
        self.unrecorded: str | None = None
        self.unrecorded_at = 0.0

    def accepted(self, job_id: str) -> None:
        """The vendor holds this job: heartbeat its id from now on, so a retry resumes it."""
        self.job_id = job_id
        if self.beat is not None:
            self.beat.beat(job_id)


class StageActivities(ClosingActivities):
    def __init__(
        self,
        recorder: Recorder,
        adapters: Adapters,
        store: ArtifactStore,
        poll_interval: float,
        *,
        store_for: Callable[[str], ArtifactStore] | None = None,
        pause_retry_s: float = 30.0,
        max_poll_interval: float = 5.0,
        human_capacity: int = 0,
        waker: CallbackWaker | None = None,
    ):
        super().__init__(recorder, adapters, store, store_for=store_for, pause_retry_s=pause_retry_s)
        self.poll_interval = poll_interval
        # Wakes the attempts of routes whose vendor calls back (None: every route is polled).
        self.waker = waker
        self.max_poll_interval = max_poll_interval
        # Open requests each project's people can hold (rules.pressure); 0: no backpressure, nothing read.
        self.human_capacity = human_capacity

    @activity.defn(name=Activity.STAGE_RUN)
    async def run(self, inp: StageInput) -> StoredEvent | list[StoredEvent]:
        """Write the dispatch's INTENT (where the workflow left it to the executor), then run (or resume) the
        attempt; returns the operation's rows (or, for an INTENT the workflow wrote, its resolution)."""
        capacity = self.human_capacity or None  # 0: backpressure off, nothing read
        with txcount.labelled("node"):  # a paid node's own ledger writes (make bench counts them)
            return await routed(
                self.recorder, inp, lambda route: self._run(inp, route), self._routing(inp), capacity
            )

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
        ahead = tuple((c.route, w) for c in chain if (w := self._ahead_window(c.route)) is not None)
        return Routing(
            inp.executor,
            chain,
            inp.operation_key,
            task_id=inp.task_id,
            quotas=quotas,
            priority=inp.priority,
            deadline=inp.deadline,
            caps=table.caps(inp.executor),
            ahead=ahead,
        )

    def _ahead_window(self, route: str) -> float | None:
        """How long after its INTENT the first send of an operation at ``route`` may leave and be answered,
        where the INTENT is that send's write-ahead (None: a marker of its own precedes each send). Only where
        the vendor deduplicates on our key and finds a job by it: an INTENT that reads "maybe sent" when
        nothing was is then resolved by a resubmission under the key, or a lookup, never by a second job."""
        try:
            adapter = self.adapters.get(route)
        except Exception:  # a fallback whose adapter cannot be built: no claim; its dispatch will say why
            return None
        if adapter.capabilities.free or not _found_by_key(adapter):
            return None
        return adapter.route.timeouts.request + AHEAD_SLACK_S

    async def _run(self, inp: StageInput, chosen: str | None) -> StoredEvent:
        route = chosen or inp.executor
        if route != inp.executor:
            # A fallback: its own adapter, its own name for the job, the request in its field names.
            spec = self.adapters.table.route(route)
            inp = inp.model_copy(update={"executor": route, "input": convert(inp.input, spec.convert)})
        op = self._operation(inp, inp.executor)
        if (policy := self._policy(inp.executor)) is not None:
            op.observing = (inp.executor, policy)
        attempt = _Attempt()
        try:
            adapter = self.adapters.get(inp.executor)  # a span per vendor call (vendors.traced)
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
            if not op.observed:  # an ok its result's transaction did not already record
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

    def _policy(self, route: str) -> BreakerPolicy | None:
        """The breaker policy that judges ``route``'s calls; None for local work, which no breaker judges."""
        spec = self.adapters.table.routes.get(route)
        if spec is None or spec.adapter == AdapterKind.LOCAL:
            return None
        return spec.breaker.policy()

    async def _observe(self, inp: StageInput, what: Observation) -> None:
        """Tell the route's shared breaker what this call showed (never fails the attempt: the breaker is
        advice for the next dispatches, the operation's own record is already written)."""
        policy = self._policy(inp.executor)
        if policy is None:
            return
        try:
            change = await asyncio.to_thread(
                self.recorder.observe, inp.executor, what, inp.operation_key, policy
            )
        except Exception as e:  # advice only: logged, the attempt's result stands
            activity.logger.warning("route %s: observation %s not recorded: %s", inp.executor, what.value, e)
            return
        if change is not None:
            activity.logger.warning("route %s: breaker %s after %s", inp.executor, change, what.value)

    async def _attempt(
        self, op: Operation, adapter: VendorAdapter, inp: StageInput, state: OperationState, attempt: _Attempt
    ) -> StoredEvent:
        assert attempt.beat is not None
        heartbeat_job = str(attempt.beat.details) if attempt.beat.details is not None else None
        if not state.sends and heartbeat_job is None and state.job_id is None:
            # Nothing was ever sent for this operation: an equal request's output may stand in for it.
            reused = await self.outputs.reuse(op, inp)
            if reused is not None:
                return reused
        # Its route stopped serving while a send of it may have landed (a 5xx its route does not list as a
        # refusal, a timeout, a reset): never resend into the outage; look it up, and void it — so its node
        # can go elsewhere — only once it is proven absent (no send can land any more), like any maybe-sent.
        prove = _stopped_serving(op) and bool(state.maybe_sent) and adapter.capabilities.can_lookup
        step = await reconcile(adapter, adapter.route, state, op.key, heartbeat_job, stopping=prove)
        if step.next == Next.VOID:
            return await op.void(step.why)
        if step.next == Next.UNKNOWN:
            return await op.unknown(step.why)
        if step.next == Next.WAIT:
            raise NotYetProvable(step.why, step.wait_s)
        if step.next == Next.RESUME:
            assert step.job_id is not None
            attempt.accepted(step.job_id)
            await self.outputs.charge_extras(
                op, adapter, step.extra, "a second job found under the operation's key"
            )
            got = step.job or await self.outputs.get(op, adapter, step.job_id)
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
            polled = await self._poll(op, adapter, inp, job, attempt)
            if isinstance(polled, StoredEvent):
                return polled
            job = polled
        if job.status == JobStatus.RUNNING:  # the watchdog gave up on it
            return await self._stalled(op, adapter, inp, job)
        mark("vendor_completed", op=op.key, job=job.id)
        return await self.outputs.settle(op, adapter, inp, job)

    # ── the vendor side ───────────────────────────────────────────────────────────────────────────────
    async def _submit(
        self, op: Operation, adapter: VendorAdapter, inp: StageInput, state: OperationState, attempt: _Attempt
    ) -> VendorJob | StoredEvent:
        caps = adapter.capabilities
        try:
            files = await self._input_urls(op, inp)
        except VendorRejected as e:
            if isinstance(e, VendorAuthError):
                raise await self._pause(inp.executor, e) from e
            # An input the vendor will not take (too large, a type it refuses): nothing was sent or charged,
            # and sending it again changes nothing — a person decides, as for a refused request.
            return await op.failure(FailureKind.CONTENT, f"an input was not taken: {e}", Decimal(0))
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
                    estimate=inp.quoted,
                    files=files,
                )
        except TimeoutError:
            raise VendorUnavailable(
                f"submit of {op.key}: no answer within {timeout:g}s", timed_out=True
            ) from None
        except VendorError as e:
            if e.refused and send is not None:
                await op.refused(send, str(e), e.status_code)  # provably not accepted: not "maybe sent"
            earlier = bool(state.maybe_sent) and not caps.free
            sent = Sent(inp.executor, inp.input)  # what a lookup matches, where the vendor keeps no key
            if isinstance(e, VendorNotFound):
                # A 404 to a submit is the route's address, not the request: nothing was accepted; pause the
                # route for a person instead of retrying a wrong URL forever.
                if send is not None:
                    await op.refused(send, str(e), e.status_code)
                raise await self._pause(inp.executor, e) from e
            if isinstance(e, VendorRejected) and not isinstance(e, VendorAuthError):
                if earlier:
                    # An earlier send may have been accepted (and this one refused because of it): its charge
                    # is not zero. Find it, or ask a person.
                    return await self._after_refusal(op, adapter, state, e, attempt, sent)
                # The request itself is refused: resending it unchanged cannot help. Nothing was accepted.
                return await op.failure(
                    FailureKind.CONTENT, f"the vendor refused the request: {e}", Decimal(0)
                )
            if isinstance(e, VendorConflict):
                # The key is in use at the vendor (a request still in flight, or an earlier send): adopt what
                # it holds under the key, or look again shortly; never resubmit into a conflict.
                return await self._after_refusal(op, adapter, state, e, attempt, sent)
            raise
        attempt.accepted(job.id)
        mark("vendor_accepted", op=op.key, job=job.id)
        if job.status == JobStatus.RUNNING:
            if _found_by_key(adapter):
                # The job id is written with the first poll that finds the job still running after
                # RECORD_RUNNING_AFTER_S, or with the result when it ends by then (one write fewer for a
                # quick job); until then a crash loses nothing: the vendor deduplicates on the key and finds
                # the job by it (reconcile).
                attempt.unrecorded, attempt.unrecorded_at = job.id, time.monotonic()
            else:
                await op.progress(job.id, job.progress)
        return job

    async def _after_refusal(
        self,
        op: Operation,
        adapter: VendorAdapter,
        state: OperationState,
        e: VendorError,
        attempt: _Attempt,
        sent: Sent,
    ) -> VendorJob | StoredEvent:
        """A submit refused because of what the vendor already holds under the key: adopt it, or wait until
        it shows (while a send could still land), or — nothing to look it up with — ask a person."""
        if not adapter.capabilities.can_lookup:
            return await op.unknown(f"the vendor refused a resubmission ({e}) and cannot look the key up")
        found = await adapter.find_by_key(op.key, sent=sent)
        step = after_lookup(state, adapter.route, found)
        if step.job is not None:
            attempt.accepted(step.job.id)
            await self.outputs.charge_extras(
                op, adapter, step.extra, "a second job found under the operation's key"
            )
            return step.job
        if step.next == Next.WAIT:
            why = f"the key is in use at the vendor ({e}) but no job is visible yet"
            raise NotYetProvable(why, min(1.0, step.wait_s + 0.1)) from e
        # Absent, and no send can land any more — yet the vendor refused the key: something holds it.
        return await op.unknown(f"the vendor refused the key ({e}) but no job of it can be found")

    async def _input_urls(self, op: Operation, inp: StageInput) -> dict[str, str] | StoredEvent:
        """Every input, verified against its recorded sha256, and a URL the vendor can fetch it from.

        The URLs are made here, just before the call, and never recorded (a presigned URL is a credential).
        An input whose bytes are gone or changed is never handed on: it is recorded as lost (its producer
        makes it again) and this attempt is voided, nothing sent.
        """
        inputs = refs(inp.input.get("inputs"))
        refetch = functools.partial(self.outputs.refetch, op, self.adapters)
        if (lost := await op.check_inputs(inputs, self.outputs.store_for, refetch)) is not None:
            return lost
        route = self.adapters.table.routes.get(inp.executor)
        if route is not None and route.inputs == "upload":
            return {r["sha256"]: await self._upload(inp.executor, r) for r in inputs}
        return {
            r["sha256"]: await asyncio.to_thread(self.outputs.store_for(r["uri"]).fetch_url, r["uri"])
            for r in inputs
        }

    async def _upload(self, executor: str, ref: dict[str, Any]) -> str:
        """One input, its bytes read from the store and checked against its sha256 again, POSTed to the
        vendor (``inputs: upload``); the URL the vendor answered."""
        store = self.outputs.store_for(ref["uri"])
        data = await asyncio.to_thread(lambda: b"".join(store.open_read(ref["uri"])))
        if hashlib.sha256(data).hexdigest() != ref["sha256"]:
            raise VendorRejected(f"input {ref['sha256'][:12]}… changed in the store; not uploaded")
        adapter = self.adapters.get(executor)
        upload = getattr(adapter, "upload", None)
        if upload is None:
            raise VendorRejected(f"route {executor}'s adapter takes no uploads; nothing was sent")
        name = f"{ref.get('node') or 'input'}-{ref['sha256'][:12]}".replace("/", "-")
        url: str = await upload(data, filename=name, content_type="application/octet-stream")
        return url

    async def _poll(
        self, op: Operation, adapter: VendorAdapter, inp: StageInput, job: VendorJob, attempt: _Attempt
    ) -> VendorJob | StoredEvent:
        """Poll until the job ends or stalls, heartbeating its id: a retry resumes it, never resubmits."""
        callback = adapter.route.callback
        if callback is not None and self.waker is not None:
            return await self._await_callback(op, adapter, inp, job, self.waker, callback.window)
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
            got = await self.outputs.get(op, adapter, job.id)
            if isinstance(got, StoredEvent):
                return got
            job = got
            if (
                job.status == JobStatus.RUNNING
                and attempt.unrecorded is not None
                and time.monotonic() - attempt.unrecorded_at >= RECORD_RUNNING_AFTER_S
            ):
                await op.progress(attempt.unrecorded, job.progress)  # not quick: on record from now on
                attempt.unrecorded = None
        return job

    async def _await_callback(
        self,
        op: Operation,
        adapter: VendorAdapter,
        inp: StageInput,
        job: VendorJob,
        waker: CallbackWaker,
        window: float,
    ) -> VendorJob | StoredEvent:
        """Wait for the vendor's callback, reading the job from the vendor each time one wakes this attempt
        or ``window`` passes without one (the polling fallback), under the stall watchdog.

        The callback only wakes (``activities.callbacks``): what the job is — its status, output and cost — is
        always the vendor's answer to our own authenticated read, never the callback's body.
        """
        watch = StallWatch(inp.stall_after)
        mark("awaiting_callback", op=op.key, job=job.id)
        async with waker.waiting(op.key) as woken:
            # Read once the waiter is registered: a callback accepted before that would otherwise be missed.
            got = await self.outputs.get(op, adapter, job.id)
            if isinstance(got, StoredEvent):
                return got
            job = got
            while job.status == JobStatus.RUNNING:  # the job id is heartbeated (attempt.accepted)
                if watch.stalled(job.progress, time.monotonic()):
                    return job
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), min(window, inp.stall_after))
                woken.clear()
                got = await self.outputs.get(op, adapter, job.id)
                if isinstance(got, StoredEvent):
                    return got
                job = got
        return job

    async def _stalled(
        self, op: Operation, adapter: VendorAdapter, inp: StageInput, job: VendorJob
    ) -> StoredEvent:
        """Cancel a stalled job at the vendor and record the failure with what it cost so far."""
        cancelled = await cancel(adapter, job.id)
        cost = await op.settle_cost(job_amount(adapter.route, cancelled))
        shown = f"{cancelled.progress:.0%}" if cancelled.progress is not None else "unknown progress"
        error = f"no progress for {inp.stall_after:g}s at {shown}: cancelled job {job.id}"
        return await op.failure(FailureKind.STALLED, error, cost, job_id=job.id)

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


def _found_by_key(adapter: VendorAdapter) -> bool:
    """The vendor deduplicates on our key and finds a job by it at any age: a job id lost with its worker is
    found again (reconcile), so it need not reach the ledger before the job's first poll. Not so for a route
    that calls back (its wait may be long) or a vendor that keeps no key of ours."""
    caps = adapter.capabilities
    idempotent = mode_of(adapter.route, caps) == VendorMode.IDEMPOTENT
    return idempotent and caps.can_lookup and adapter.route.callback is None


def _unavailable(error: VendorUnavailable) -> Observation:
    return Observation.TIMEOUT if error.timed_out else Observation.ERROR


def _not_serving(op: Operation, state: OperationState) -> str | None:
    """Why this operation must not go on at its route (None: it may): the route's breaker is open (or
    half-open with another operation as its probe) and nothing of this operation may have been accepted —
    no job, no send that was not refused. An operation that may have been accepted stays, and reconciles
    at its route once the route answers again."""
    h = op.breaker
    if h is None or state.job_id is not None or state.maybe_sent:
        return None
    if _stopped_serving(op):
        why = f"{h.state.value}: {h.reason}"
        return f"route {op.route} stopped serving ({why}); nothing was sent, the node goes again"
    return None


def _stopped_serving(op: Operation) -> bool:
    """The operation's route takes nothing of it now: its breaker is open, or half-open with another
    operation as its probe."""
    h = op.breaker
    if h is None:
        return False
    return h.state == BreakerState.OPEN or (h.state == BreakerState.HALF_OPEN and h.probe_key != op.key)
