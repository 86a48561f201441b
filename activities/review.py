"""The framework's own stages: compose, the two-phase review, and the static compliance gate.

Each reads the ledger (folding it with the same pure ``rules`` code the workflow uses), checks the artifacts
on disk against their registered hashes, and writes exactly one result through the idempotent path.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
from decimal import Decimal
from pathlib import Path
from urllib.parse import urlparse

from temporalio import activity

from activities.artifacts import LocalArtifactStore
from activities.llm import ChatClient, parse_json_object
from activities.models import GateInput, StageInput
from ledger.recorder import Recorder
from rules.envelope import StoredEvent
from rules.events import ArtifactRef, ExecutionResult, Outcome, Verdict, to_new
from rules.plan import COMPOSE, REVIEW
from rules.projection import NodeStatus, Projection, fold
from rules.verdicts import CheckResult, Severity, aggregate, score_results

BANNED_TERMS = ("[banned]", "unlicensed")

REVIEW_SYSTEM = (
    "You review a finished production against its goal. Answer with one JSON object "
    '{"scores": {dimension: 0..1}, "blame": {dimension: [node ids]}, "reasons": [text]}.'
)


def _artifact_ok(artifact: dict[str, object] | None) -> bool:
    """The registered artifact exists on disk and still hashes to its registered sha256."""
    if not artifact:
        return False
    path = Path(urlparse(str(artifact["uri"])).path)
    return path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == artifact["sha256"]


def technical_checks(p: Projection) -> list[CheckResult]:
    """Phase 1, technical: every business node has a registered, intact artifact."""
    out = []
    for node_id, spec in p.graph.nodes.items():
        if spec.stage.id in (COMPOSE, REVIEW):
            continue
        view = p.nodes[node_id]
        if view.status != NodeStatus.SUCCEEDED or not _artifact_ok(view.artifact):
            out.append(
                CheckResult("technical.artifact", Severity.REWORK, f"{node_id} artifact missing", (node_id,))
            )
    return out


def compliance_checks(p: Projection, nodes: list[str]) -> list[CheckResult]:
    """Phase 1, compliance: no banned term in what the nodes were asked to make."""
    out = []
    for node_id in nodes:
        text = json.dumps(p.graph.nodes[node_id].stage.input).lower()
        for term in BANNED_TERMS:
            if term in text:
                out.append(
                    CheckResult("compliance.terms", Severity.BLOCK, f"{node_id} uses {term!r}", (node_id,))
                )
    return out


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
        business = [n for n, s in p.graph.nodes.items() if s.stage.id not in (COMPOSE, REVIEW)]
        results = compliance_checks(p, business) + technical_checks(p)
        scores: dict[str, float] = {}
        cost = 0
        if not any(r.severity == Severity.BLOCK for r in results):
            parts = {n: p.nodes[n].versions for n in business}
            reply = await self.chat.complete(REVIEW_SYSTEM, json.dumps({"goal": p.plan.goal, "parts": parts}))
            cost = reply.cost
            judgement, problem = parse_json_object(reply.content)
            if judgement is None:
                results.append(CheckResult("content.model", Severity.SOFT, f"judgement unusable: {problem}"))
            else:
                scores, blame = _scores(judgement), _blame(judgement, set(business))
                results += score_results(scores, blame)
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
        deps = list(p.graph.nodes[inp.node].deps)
        results = compliance_checks(p, [inp.node, *deps])
        results += [
            CheckResult("gate.inputs", Severity.BLOCK, f"input {d} is not intact", (d,))
            for d in deps
            if not _artifact_ok(p.nodes[d].artifact)
        ]
        event = ExecutionResult(
            kind="gate",
            node=inp.node,
            operation_key=inp.operation_key,
            passed=not results,
            input_version=inp.input_version,
            findings=tuple(f"{r.check}: {r.message}" for r in results),
        )
        return await self._record(inp.task_id, inp.operation_key, event)


def _scores(judgement: dict[str, object]) -> dict[str, float]:
    raw = judgement.get("scores")
    if not isinstance(raw, dict):
        return {}
    out = {}
    for k, v in list(raw.items())[:20]:
        if isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= 1:
            out[k[:40]] = float(v)
    return out


def _blame(judgement: dict[str, object], known: set[str]) -> dict[str, tuple[str, ...]]:
    raw = judgement.get("blame")
    if not isinstance(raw, dict):
        return {}
    return {
        str(k)[:40]: tuple(n for n in v if isinstance(n, str) and n in known)
        for k, v in list(raw.items())[:20]
        if isinstance(v, list)
    }
