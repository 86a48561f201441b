"""The framework's own stages: compose, the two-phase review, and the static compliance gate.

Each runs inside the Operation lifecycle (``activities/operation.py``): it reads the ledger (folding it with
the same pure ``rules`` code the workflow uses), gathers the facts its checks need (each registered artifact
re-hashed from the store, in parallel: the only I/O), lets the pure checks of ``rules.checks`` judge them, and
writes exactly one result. Compose really assembles the episode when the plan says what to assemble
(``compose: {video: […], audio: …}``): the shots and the audio go through the local adapter's
``media.assemble`` into one MP4; otherwise it records a manifest of every output. The review's model call is
paid: a ``submitting`` marker is written (fenced) before it, like before any paid call.

Each heartbeats for as long as it runs (``_heartbeating``): the workflow schedules them with a heartbeat
timeout so a dead worker's attempt is retried within seconds, and a model call may well take longer than
that. The review's paid judgement also rides in the heartbeat details, so an attempt retried after the
model answered (its worker died before the verdict was recorded) reuses the answer instead of paying again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any

from temporalio import activity

from activities.contracts import Activity, GateInput, StageInput
from activities.llm import ChatClient, ChatReply, LlmRefused, cached_reply, reply_details
from activities.operation import Heartbeat, Operation, recorded
from activities.outputs import probed
from artifacts.store import ArtifactError, ArtifactStore, sha256_of
from ledger import txcount
from ledger.recorder import Recorder
from media import MediaInvalid, probe
from reconcile.operations import OperationState
from rules import checks
from rules.envelope import StoredEvent
from rules.events import ArtifactRef, ExecutionResult, FailureKind, Media, Outcome, Verdict
from rules.inputs import refs
from rules.money import VendorAmount
from rules.plan import COMPOSE, REVIEW
from rules.projection import Projection, fold
from rules.routing import Observation, first_reviews
from rules.verdicts import (
    CheckResult,
    Severity,
    aggregate,
    judgement_schema,
    parse_judgement,
    score_results,
)
from vendors.adapter import JobStatus
from vendors.registry import Adapters

CONTENT_REVIEWER = "content.llm"  # the plan's review.reviewers entry that enables phase 2
REVIEW_SYSTEM = (
    "You review a finished production against its goal. `parts` gives each part's version, `artifacts` "
    "each part's registered artifact (uri, sha256, media metadata), `checks` the automatic checks' "
    "warnings. Answer with one JSON object "
    '{"scores": {dimension: 0..1}, "blame": {dimension: [node ids]}, "reasons": [text]}.'
)


def _stored_sha256(store_for: Callable[[str], ArtifactStore], uri: str) -> str | None:
    """What the stored artifact at ``uri`` hashes to now (streamed), or None if it is gone."""
    try:
        return sha256_of(store_for(uri).open_read(uri))[0]
    except ArtifactError:
        return None


async def _facts(
    p: Projection,
    nodes: Sequence[str],
    store_for: Callable[[str], ArtifactStore],
    *,
    gated: str | None = None,
) -> checks.Facts:
    """The facts phase 1 judges: the projection's, plus every registered artifact hashed, in parallel."""
    refs = {n: ref for n in nodes if n != gated and (ref := checks.registered_artifact(p, n)) is not None}
    hashes = await asyncio.gather(
        *(asyncio.to_thread(_stored_sha256, store_for, ref.uri) for ref in refs.values())
    )
    found = {n: (ref, sha) for (n, ref), sha in zip(refs.items(), hashes, strict=True)}
    return checks.facts_for(p, nodes, found, gated=gated)


def _business(p: Projection) -> list[str]:
    # A node a person skipped (rules.changes) made nothing: there is nothing of it to judge.
    return [
        n for n, s in p.graph.nodes.items() if s.stage.id not in (COMPOSE, REVIEW) and not p.nodes[n].skipped
    ]


def review_prompt(p: Projection, business: Sequence[str], soft: Sequence[CheckResult]) -> str:
    """Phase 2's question: the goal, each part's version (``parts``, the shape scripted answers match on), its
    registered artifact (uri, sha256, media metadata), phase 1's warnings and, in a rework round, the previous
    review's findings. Deterministic for one ledger state, so a retry asks exactly the same question."""
    artifacts = {
        n: {k: v for k, v in art.items() if k in ("uri", "sha256", "media") and v is not None}
        for n in business
        if (art := p.nodes[n].artifact) is not None
    }
    question: dict[str, Any] = {
        "goal": p.plan.goal,
        "parts": {n: p.nodes[n].versions for n in business},
        "artifacts": artifacts,
        "checks": [f"{r.check}: {r.message}" for r in soft],
    }
    if p.nodes[REVIEW].rework_findings:
        # A review rerun in a rework round (e.g. the last one blamed no node) sees what it said before, so it
        # is never the unchanged question (which a deterministic model would answer the same way again).
        question["previous_findings"] = list(p.nodes[REVIEW].rework_findings)
    return json.dumps(question)


def _question_id(system: str, user: str) -> str:
    return hashlib.sha256(json.dumps([system, user]).encode()).hexdigest()


class ReviewActivities:
    def __init__(
        self,
        recorder: Recorder,
        store: ArtifactStore,
        chat: ChatClient,
        *,
        adapters: Adapters | None = None,
        store_for: Callable[[str], ArtifactStore] | None = None,
    ):
        self.recorder = recorder
        self.store = store
        self.chat = chat
        self.adapters = adapters
        self.store_for = store_for or (lambda uri: store)

    def _operation(self, inp: StageInput | GateInput, estimate: Decimal) -> Operation:
        return Operation(
            self.recorder,
            task_id=inp.task_id,
            node=inp.node,
            key=inp.operation_key,
            epoch=inp.epoch if inp.epoch is not None else 0,
            estimate=estimate,
        )

    async def _projection(self, task_id: str) -> Projection:
        return fold(await asyncio.to_thread(self.recorder.read_events, task_id))

    @activity.defn(name=Activity.COMPOSE_RUN)
    async def compose(self, inp: StageInput) -> StoredEvent | list[StoredEvent]:
        """Assemble the business outputs: the episode itself where the plan says how, else a manifest."""
        op = self._operation(inp, inp.estimate)
        return await recorded(self.recorder, inp, lambda: op.run(lambda state, beat: self._compose(op, inp)))

    async def _compose(self, op: Operation, inp: StageInput) -> StoredEvent:
        p = await self._projection(inp.task_id)
        inputs = inp.input.get("inputs") or {}
        if p.plan.compose is not None and self.adapters is not None and inputs.get("shots"):
            assembler = self.adapters.get("media.assemble")
            if not assembler.capabilities.free:
                # compose spends nothing (its estimate is 0): an assembler that costs money needs a stage.
                error = "the media.assemble route must be local (free); make paid assembly a stage of its own"
                return await op.failure(FailureKind.INVALID_OUTPUT, error, Decimal(0))
            # A shot whose bytes are gone or changed is never assembled: its producer makes it again.
            if (lost := await op.check_inputs(refs(inputs), self.store_for)) is not None:
                return lost
            request = {"shots": inputs["shots"], "audio": inputs.get("audio")}
            job = await assembler.submit(
                operation_key=op.key, executor="media.assemble", request=request, estimate=Decimal(0)
            )
            if job.status != JobStatus.SUCCEEDED or job.inline is None:
                error = job.error.message if job.error is not None else "assembly produced nothing"
                return await op.failure(FailureKind.TECHNICAL, error, Decimal(0))
            with self.store.staging(op.key) as staging:
                staging.write(job.inline)
                try:
                    media: Media | None = probed(await asyncio.to_thread(probe, staging.path))
                except MediaInvalid:
                    media = None
                stored = await asyncio.to_thread(self.store.publish, staging, None, operation_key=op.key)
        else:
            manifest = {
                n: {"sha256": v.artifact["sha256"], "version": v.versions}
                for n, v in p.nodes.items()
                if v.artifact and n not in (COMPOSE, REVIEW)
            }
            data = json.dumps(
                {"task": inp.task_id, "goal": p.plan.goal, "parts": manifest}, sort_keys=True
            ).encode()
            media = None
            stored = await asyncio.to_thread(self.store.put_bytes, data, None, operation_key=op.key)
        artifact = ArtifactRef(uri=stored.uri, sha256=stored.sha256, size=stored.size, media=media)
        event = Outcome(
            node=inp.node,
            operation_key=op.key,
            artifact=artifact,
            actual_cost=Decimal(0),
            input_hash=inp.input_hash,
        )
        return await op.resolve(event, spend=Decimal(0))

    @activity.defn(name=Activity.REVIEW_RUN)
    async def review(self, inp: StageInput) -> StoredEvent | list[StoredEvent]:
        """Phase 1 (pure checks, short-circuit on a block), then phase 2 (model judgement); one verdict."""
        op = self._operation(inp, inp.estimate)
        # A retry after the verdict was recorded returns it: the judgement is never paid for twice.
        with txcount.labelled("review"):  # the review node's own ledger writes (make bench counts them)
            return await recorded(
                self.recorder, inp, lambda: op.run(lambda state, beat: self._review(op, state, inp, beat))
            )

    async def _review(
        self, op: Operation, state: OperationState, inp: StageInput, beat: Heartbeat
    ) -> StoredEvent:
        events = await asyncio.to_thread(self.recorder.read_events, inp.task_id)
        p = fold(events)
        business = _business(p)
        results = checks.phase1(await _facts(p, business, self.store_for))
        scores: dict[str, float] = {}
        cost = Decimal(0)
        judged = CONTENT_REVIEWER in p.plan.review.reviewers  # phase 1 always runs; phase 2 if listed
        if judged and not any(r.severity == Severity.BLOCK for r in results):
            soft = [r for r in results if r.severity == Severity.SOFT]
            reply = await self._judge(op, state, review_prompt(p, business, soft), beat)
            # The model call's spend settles like every operation's: through the money gate, at the
            # estimate (flagged, with the raw figure) when its usage cannot price it.
            cost = await op.settle_cost(reply.amount())
            judgement, problem = parse_judgement(reply.content)
            if judgement is None:
                results.append(CheckResult("content.model", Severity.SOFT, f"judgement unusable: {problem}"))
            else:
                scores = dict(judgement.scores)
                results += score_results(scores, judgement.blamed(set(business)), judgement.reasons)
        verdict, flagged, findings = aggregate(results)
        event = ExecutionResult(
            kind="review",
            node=inp.node,
            operation_key=op.key,
            passed=verdict in (Verdict.PASS, Verdict.SOFT_WARNING),
            verdict=verdict,
            flagged=flagged,
            findings=findings,
            scores=scores,
            actual_cost=cost,
        )
        resolved = await op.resolve(event, spend=cost)
        if resolved.type == "ExecutionResult" and resolved.payload.get("kind") == "review":
            await self._observe_quality(first_reviews(events, resolved.payload.get("flagged") or ()))
        return resolved

    async def _observe_quality(self, judged: list[tuple[str, str, bool]]) -> None:
        """Each routed output's first review, to its route's breaker (a collapsing first-pass rate trips it),
        all in one transaction. Advice only: a failure to record them is logged, the verdict stands."""
        table = self.adapters.table if self.adapters is not None else None
        observations = [
            (
                route,
                Observation.REVIEW_PASS if passed else Observation.REVIEW_FAIL,
                key,
                spec.breaker.policy(),
            )
            for route, key, passed in judged
            if table is not None and (spec := table.routes.get(route)) is not None
        ]
        if not observations:
            return
        try:
            changes = await asyncio.to_thread(self.recorder.observe_all, observations)
        except Exception as e:  # advice only: logged, the verdict stands
            activity.logger.warning(
                "review observations of %d outputs not recorded: %s", len(observations), e
            )
            return
        for (route, what, _, _), change in zip(observations, changes, strict=True):
            if change is not None:
                activity.logger.warning("route %s: breaker %s after %s", route, change, what.value)

    async def _judge(self, op: Operation, state: OperationState, question: str, beat: Heartbeat) -> ChatReply:
        """The model's judgement of ``question``: the one a previous attempt already paid for, if any (it
        rode in the heartbeat details), else a new call — fenced and written ahead like every paid call —
        whose answer is heartbeated at once for a retry."""
        qid = _question_id(REVIEW_SYSTEM, question)
        cached = cached_reply(beat.details, question=qid)
        if cached is not None:
            return cached
        for earlier in state.maybe_sent:
            # An earlier attempt asked and its answer was lost with it: the model may have billed that call.
            lost = VendorAmount(None, "an answer lost with its attempt", "")
            await op.late_charge(
                f"send-{earlier.n}", lost, "a model call whose answer was lost may have been billed"
            )
        send = await op.sending(state, self.chat.timeout)
        try:
            reply = await self.chat.complete(
                REVIEW_SYSTEM, question, schema=judgement_schema(), schema_name="judgement", request_id=op.key
            )
        except LlmRefused as e:
            await op.refused(send, str(e))  # provably not run: no longer "maybe sent", never a charge
            raise
        beat.beat(reply_details(reply, question=qid))
        return reply

    @activity.defn(name=Activity.GATE_RUN)
    async def gate(self, inp: GateInput) -> StoredEvent:
        """The static compliance gate of a high-cost node, anchored to its input version."""
        op = self._operation(inp, Decimal(0))
        # Unfenced: a gate scheduled before gates were fenced carries no epoch.
        return await op.run(lambda state, beat: self._gate(op, inp), fenced=inp.epoch is not None)

    async def _gate(self, op: Operation, inp: GateInput) -> StoredEvent:
        p = await self._projection(inp.task_id)
        nodes = [inp.node, *p.graph.nodes[inp.node].deps]
        results = checks.gate(await _facts(p, nodes, self.store_for, gated=inp.node))
        event = ExecutionResult(
            kind="gate",
            node=inp.node,
            operation_key=op.key,
            passed=not results,
            input_version=inp.input_version,
            findings=tuple(f"{r.check}: {r.message}" for r in results),
        )
        return await op.resolve(event, spend=Decimal(0))
