"""The framework's own stages: compose, the two-phase review, and the static compliance gate.

Each reads the ledger (folding it with the same pure ``rules`` code the workflow uses), gathers the facts its
checks need (each registered artifact hashed on disk, in parallel: the only I/O), lets the pure checks of
``rules.checks`` judge them, and writes exactly one result through the idempotent path.

Each heartbeats for as long as it runs (``_heartbeating``): the workflow schedules them with a heartbeat
timeout so a dead worker's attempt is retried within seconds, and a model call may well take longer than
that. The review's paid judgement also rides in the heartbeat details, so an attempt retried after the
model answered (its worker died before the verdict was recorded) reuses the answer instead of paying again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
from collections.abc import AsyncIterator, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from temporalio import activity

from activities.artifacts import LocalArtifactStore
from activities.llm import ChatClient, ChatReply
from activities.models import GateInput, StageInput
from ledger.recorder import Recorder
from rules import checks
from rules.envelope import StoredEvent
from rules.events import ArtifactRef, ExecutionResult, Outcome, Verdict, to_new
from rules.plan import COMPOSE, REVIEW
from rules.projection import Projection, fold
from rules.verdicts import (
    CheckResult,
    Severity,
    aggregate,
    judgement_schema,
    parse_judgement,
    score_results,
)

CONTENT_REVIEWER = "content.llm"  # the plan's review.reviewers entry that enables phase 2
REVIEW_SYSTEM = (
    "You review a finished production against its goal. `parts` gives each part's version, `artifacts` "
    "each part's registered artifact (uri, sha256, media metadata), `checks` the automatic checks' "
    "warnings. Answer with one JSON object "
    '{"scores": {dimension: 0..1}, "blame": {dimension: [node ids]}, "reasons": [text]}.'
)


class _Heartbeat:
    """What this attempt heartbeats; a retry reads it back (``activity.info().heartbeat_details``)."""

    def __init__(self) -> None:
        previous = activity.info().heartbeat_details
        self.details: Any = previous[0] if previous else None


@contextlib.asynccontextmanager
async def _heartbeating() -> AsyncIterator[_Heartbeat]:
    """Heartbeat every third of the heartbeat timeout while the body runs.

    A heartbeat only says the worker is alive, which it is while it waits on the model; a dead worker still
    misses its heartbeats and its attempt is retried within the timeout, and a cancellation (the task ended)
    is delivered. The details sent are the latest ``beat.details`` (the previous attempt's until replaced).
    """
    beat = _Heartbeat()
    timeout = activity.info().heartbeat_timeout
    if not timeout:
        yield beat
        return

    interval = max(0.05, timeout.total_seconds() / 3)

    async def loop() -> None:
        while True:
            activity.heartbeat(*(() if beat.details is None else (beat.details,)))
            await asyncio.sleep(interval)

    task = asyncio.create_task(loop())
    try:
        yield beat
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _file_sha256(uri: str) -> str | None:
    """What the artifact file at ``uri`` hashes to now, or None if it is gone."""
    path = Path(urlparse(uri).path)
    try:
        with path.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


async def _facts(p: Projection, nodes: Sequence[str], *, gated: str | None = None) -> checks.Facts:
    """The facts phase 1 judges: the projection's, plus every registered artifact hashed, in parallel."""
    refs = {n: ref for n in nodes if n != gated and (ref := checks.registered_artifact(p, n)) is not None}
    hashes = await asyncio.gather(*(asyncio.to_thread(_file_sha256, ref.uri) for ref in refs.values()))
    found = {n: (ref, sha) for (n, ref), sha in zip(refs.items(), hashes, strict=True)}
    return checks.facts_for(p, nodes, found, gated=gated)


def _business(p: Projection) -> list[str]:
    return [n for n, s in p.graph.nodes.items() if s.stage.id not in (COMPOSE, REVIEW)]


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


def _cached_reply(details: Any, question: str) -> ChatReply | None:
    """The judgement a previous attempt paid for, if it was for this very question."""
    if not isinstance(details, dict) or details.get("question") != question:
        return None
    try:
        return ChatReply(
            content=str(details["content"]),
            tokens_in=int(details["tokens_in"]),
            tokens_out=int(details["tokens_out"]),
            cost=Decimal(str(details["cost"])),
            prompt_hash=str(details["prompt_hash"]),
            model=str(details["model"]),
        )
    except (KeyError, TypeError, ValueError, ArithmeticError):
        return None


def _question_id(system: str, user: str) -> str:
    return hashlib.sha256(json.dumps([system, user]).encode()).hexdigest()


class ReviewActivities:
    def __init__(self, recorder: Recorder, store: LocalArtifactStore, chat: ChatClient):
        self.recorder = recorder
        self.store = store
        self.chat = chat

    async def _record(
        self, task_id: str, key: str, event: Outcome | ExecutionResult, *, release: Decimal = Decimal(0)
    ) -> StoredEvent:
        """Write the one result of this operation, settling its reservation at the actual cost."""
        new = to_new(event, dedup_key=f"{key}:result", operation_key=key)
        append = functools.partial(
            self.recorder.append_idempotent, task_id, new, release=release, spend=event.actual_cost
        )
        stored, _inserted = await asyncio.to_thread(append)
        return stored

    async def _projection(self, task_id: str) -> Projection:
        return fold(await asyncio.to_thread(self.recorder.read_events, task_id))

    @activity.defn(name="compose.run")
    async def compose(self, inp: StageInput) -> StoredEvent:
        """Assemble the business outputs into one manifest artifact (versioned by its content)."""
        async with _heartbeating():
            return await self._compose(inp)

    async def _compose(self, inp: StageInput) -> StoredEvent:
        p = await self._projection(inp.task_id)
        manifest = {
            n: {"sha256": v.artifact["sha256"], "version": v.versions}
            for n, v in p.nodes.items()
            if v.artifact and n not in (COMPOSE, REVIEW)
        }
        data = json.dumps(
            {"task": inp.task_id, "goal": p.plan.goal, "parts": manifest}, sort_keys=True
        ).encode()
        digest = hashlib.sha256(data).hexdigest()
        uri = await asyncio.to_thread(self.store.put, data, digest)
        event = Outcome(
            node=inp.node,
            operation_key=inp.operation_key,
            artifact=ArtifactRef(uri=uri, sha256=digest, size=len(data)),
            actual_cost=0,
        )
        return await self._record(inp.task_id, inp.operation_key, event, release=inp.estimate)

    @activity.defn(name="review.run")
    async def review(self, inp: StageInput) -> StoredEvent:
        """Phase 1 (pure checks, short-circuit on a block), then phase 2 (model judgement); one verdict."""
        async with _heartbeating() as beat:
            return await self._review(inp, beat)

    async def _review(self, inp: StageInput, beat: _Heartbeat) -> StoredEvent:
        key = inp.operation_key
        existing = await asyncio.to_thread(self.recorder.find_by_dedup_key, f"{key}:result")
        if existing is not None:
            return existing  # a retry after the verdict was recorded: never pay for the judgement twice
        p = await self._projection(inp.task_id)
        business = _business(p)
        results = checks.phase1(await _facts(p, business))
        scores: dict[str, float] = {}
        cost = Decimal(0)
        judged = CONTENT_REVIEWER in p.plan.review.reviewers  # phase 1 always runs; phase 2 if listed
        if judged and not any(r.severity == Severity.BLOCK for r in results):
            soft = [r for r in results if r.severity == Severity.SOFT]
            reply = await self._judge(review_prompt(p, business, soft), beat)
            cost = reply.cost
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
            operation_key=key,
            passed=verdict in (Verdict.PASS, Verdict.SOFT_WARNING),
            verdict=verdict,
            flagged=flagged,
            findings=findings,
            scores=scores,
            actual_cost=cost,
        )
        return await self._record(inp.task_id, key, event, release=inp.estimate)

    async def _judge(self, question: str, beat: _Heartbeat) -> ChatReply:
        """The model's judgement of ``question``: the one a previous attempt already paid for, if any (it
        rode in the heartbeat details), else a new call, whose answer is heartbeated at once for a retry."""
        qid = _question_id(REVIEW_SYSTEM, question)
        cached = _cached_reply(beat.details, qid)
        if cached is not None:
            return cached
        reply = await self.chat.complete(
            REVIEW_SYSTEM, question, schema=judgement_schema(), schema_name="judgement"
        )
        beat.details = {
            "question": qid,
            "content": reply.content,
            "tokens_in": reply.tokens_in,
            "tokens_out": reply.tokens_out,
            "cost": str(reply.cost),
            "prompt_hash": reply.prompt_hash,
            "model": reply.model,
        }
        activity.heartbeat(beat.details)
        return reply

    @activity.defn(name="gate.run")
    async def gate(self, inp: GateInput) -> StoredEvent:
        """The static compliance gate of a high-cost node, anchored to its input version."""
        async with _heartbeating():
            return await self._gate(inp)

    async def _gate(self, inp: GateInput) -> StoredEvent:
        p = await self._projection(inp.task_id)
        nodes = [inp.node, *p.graph.nodes[inp.node].deps]
        results = checks.gate(await _facts(p, nodes, gated=inp.node))
        event = ExecutionResult(
            kind="gate",
            node=inp.node,
            operation_key=inp.operation_key,
            passed=not results,
            input_version=inp.input_version,
            findings=tuple(f"{r.check}: {r.message}" for r in results),
        )
        return await self._record(inp.task_id, inp.operation_key, event)
