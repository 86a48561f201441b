"""The framework's own stages: compose, the two-phase review, and the static compliance gate.

Each reads the ledger (folding it with the same pure ``rules`` code the workflow uses), gathers the facts its
checks need (each registered artifact hashed on disk, in parallel: the only I/O), lets the pure checks of
``rules.checks`` judge them, and writes exactly one result through the idempotent path.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path
from urllib.parse import urlparse

from temporalio import activity

from activities.artifacts import LocalArtifactStore
from activities.llm import ChatClient
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

REVIEW_SYSTEM = (
    "You review a finished production against its goal. Answer with one JSON object "
    '{"scores": {dimension: 0..1}, "blame": {dimension: [node ids]}, "reasons": [text]}.'
)


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
    return checks.facts_for(p, nodes, dict(zip(refs, hashes, strict=True)), gated=gated)


def _business(p: Projection) -> list[str]:
    return [n for n, s in p.graph.nodes.items() if s.stage.id not in (COMPOSE, REVIEW)]


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
        key = inp.operation_key
        existing = await asyncio.to_thread(self.recorder.find_by_dedup_key, f"{key}:result")
        if existing is not None:
            return existing  # a retry after the verdict was recorded: never pay for the judgement twice
        p = await self._projection(inp.task_id)
        business = _business(p)
        results = checks.phase1(await _facts(p, business))
        scores: dict[str, float] = {}
        cost = Decimal(0)
        if not any(r.severity == Severity.BLOCK for r in results):
            parts = {n: p.nodes[n].versions for n in business}
            reply = await self.chat.complete(
                REVIEW_SYSTEM,
                json.dumps({"goal": p.plan.goal, "parts": parts}),
                schema=judgement_schema(),
                schema_name="judgement",
            )
            cost = reply.cost
            judgement, problem = parse_judgement(reply.content)
            if judgement is None:
                results.append(CheckResult("content.model", Severity.SOFT, f"judgement unusable: {problem}"))
            else:
                scores = dict(judgement.scores)
                results += score_results(scores, judgement.blamed(set(business)))
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

    @activity.defn(name="gate.run")
    async def gate(self, inp: GateInput) -> StoredEvent:
        """The static compliance gate of a high-cost node, anchored to its input version."""
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
