"""``ledgerflow release TASK``: rebuild a finished task's final output, compare, and sign its provenance.

The final output is the compose node's current artifact. It is made again from what the ledger recorded, the
way compose made it (``activities.review``):

* **an assembled episode** (the plan's ``compose: {video: …, audio: …}``): the compose dispatch's recorded
  inputs (every shot and the audio, by store URI and sha256) are each re-hashed from the content store, then
  assembled again by the same local ``media.assemble`` body (``vendors.local``), which is deterministic;
* **a manifest of every output** (no ``compose:``): the same JSON, re-derived from the fold of the events
  compose read (every event before its Outcome).

The release is refused (``ReleaseRefused``, one line naming the difference) unless the rebuilt bytes hash to
the sha256 the final Outcome recorded and the stored output still does too. Then the output and its manifest
(``ledgerflow.release.manifest``) are written, signed with a registered release key: a registry entry whose
kinds include ``release`` and whose public key is the key file's (revoked, expired or not yet valid keys are
refused; a demo key only in dev mode; with ``LEDGERFLOW_KEY_ROOTS``, only an endorsed entry).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any, Final

from artifacts import ArtifactError, ArtifactStore, open_store, store_for_uri
from artifacts.store import sha256_of
from ledger.recorder import Recorder
from ledgerflow.errors import ClientError
from ledgerflow.release import manifest as mf
from rules.approvers import KeyRecord, endorsement_message
from rules.envelope import StoredEvent
from rules.events import (
    Decision,
    Escalation,
    ExecutionResult,
    HumanDecision,
    Intent,
    MarkerKind,
    Outcome,
    PartialResolution,
    SystemMarker,
    TaskChange,
    parse,
    vendor_spend,
)
from rules.inputs import refs
from rules.plan import COMPOSE, REVIEW
from rules.projection import Projection, fold
from rules.table import RULES_VERSION
from runtime.settings import Settings
from runtime.signing import DEMO_APPROVERS, ApproverKey, demo_key, verify
from vendors.adapter import JobStatus
from vendors.routes import LOCAL_EXECUTORS, AdapterKind, deployment_table

RELEASE_KIND: Final = "release"  # the registry kind a key needs to sign releases
ASSEMBLER: Final = "media.assemble"
AI_MEDIA: Final = "http://cv.iptc.org/newscodes/digitalsourcetype/trainedAlgorithmicMedia"
COMPOSITE: Final = "http://cv.iptc.org/newscodes/digitalsourcetype/compositeWithTrainedAlgorithmicMedia"
_MIME: Final = {
    "mp4": "video/mp4",
    "mov": "video/quicktime",
    "webm": "video/webm",
    "png": "image/png",
    "jpg": "image/jpeg",
    "jpeg": "image/jpeg",
    "webp": "image/webp",
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "json": "application/json",
    "txt": "text/plain",
    "md": "text/markdown",
    "srt": "application/x-subrip",
}


class ReleaseRefused(Exception):
    """The ledger and the store do not give the recorded output back; the message names the difference."""


@dataclass(frozen=True)
class Release:
    task_id: str
    sha256: str
    method: str  # "media.assemble" or "manifest"
    output: Path
    manifest: Path
    document: dict[str, Any]


def mime(fmt: str | None) -> str:
    return _MIME.get((fmt or "").lower(), "application/octet-stream")


# ── the release key ────────────────────────────────────────────────────────────────────────────────────
def release_key_refusal(
    key: ApproverKey, registry: dict[str, KeyRecord], settings: Settings, at: datetime
) -> str | None:
    """Why ``key`` may not sign a release now (None if it may)."""
    kid = key.key_id
    record = registry.get(kid)
    if record is None:
        return f"key {kid} is not in the key registry: register its public key with kind {RELEASE_KIND}"
    if record.public_key != key.public_key:
        return f"key {kid}: the registry holds another public key than this key file's"
    if RELEASE_KIND not in record.kinds:
        kinds = ", ".join(record.kinds) or "every request kind"
        return f"key {kid} is registered for {kinds}, not {RELEASE_KIND}"
    if record.revoked_at is not None and record.revoked_at <= at:
        return f"key {kid} was revoked at {record.revoked_at.isoformat()}"
    if record.not_before is not None and at < record.not_before:
        return f"key {kid} is not valid before {record.not_before.isoformat()}"
    if record.expires_at is not None and at >= record.expires_at:
        return f"key {kid} expired at {record.expires_at.isoformat()}"
    demo = {demo_key(a).public_key for a in (*DEMO_APPROVERS, RELEASE_KIND)}
    if not settings.dev and key.public_key in demo:
        return f"key {kid} is a demo key (its private half is public): only in dev mode (LEDGERFLOW_ENV=dev)"
    roots = settings.root_keys()
    if roots:
        message = endorsement_message(record.entry())
        if not any(r in roots and verify(r, message, s) for r, s in record.endorsements):
            return f"key {kid} is not endorsed by a root key (LEDGERFLOW_KEY_ROOTS)"
    return None


# ── the rebuild ────────────────────────────────────────────────────────────────────────────────────────
def _dispatch_inputs(events: Sequence[StoredEvent], operation_key: str) -> dict[str, Any] | None:
    """The recorded request of the dispatch whose key is ``operation_key`` (its INTENT's action input)."""
    for e in events:
        if e.type != "Intent":
            continue
        action = e.payload.get("action") or {}
        if action.get("kind") == "Dispatch" and action.get("operation_key") == operation_key:
            return dict(action.get("input") or {})
    return None


def _stored_sha(store_for: Callable[[str], ArtifactStore], uri: str) -> str | None:
    try:
        return sha256_of(store_for(uri).open_read(uri))[0]
    except ArtifactError:
        return None


def _check_stored(store_for: Callable[[str], ArtifactStore], ref: dict[str, Any], what: str) -> None:
    found = _stored_sha(store_for, str(ref["uri"]))
    if found is None:
        raise ReleaseRefused(f"{what} ({str(ref['sha256'])[:16]}…) is missing from the store: {ref['uri']}")
    if found != ref["sha256"]:
        raise ReleaseRefused(
            f"{what}: the stored bytes at {ref['uri']} hash to {found}, the ledger recorded {ref['sha256']}"
            " (altered or corrupt)"
        )


def _manifest_bytes(events: Sequence[StoredEvent], before_seq: int, task_id: str) -> bytes:
    """Compose's manifest as compose wrote it: from the fold of every event before its Outcome."""
    p = fold([e for e in events if e.seq < before_seq])
    parts = {
        n: {"sha256": v.artifact["sha256"], "version": v.versions}
        for n, v in p.nodes.items()
        if v.artifact and n not in (COMPOSE, REVIEW)
    }
    return json.dumps({"task": task_id, "goal": p.plan.goal, "parts": parts}, sort_keys=True).encode()


async def _assemble(
    settings: Settings, store_for: Callable[[str], ArtifactStore], inputs: dict[str, Any]
) -> bytes:
    """The episode assembled again by the same local body compose ran (``vendors.local``)."""
    from vendors.local import LocalAdapter

    route = deployment_table(settings).route(ASSEMBLER)
    if route.adapter != AdapterKind.LOCAL:
        raise ReleaseRefused(
            f"the {ASSEMBLER} route is {route.adapter}, not local: it cannot be rebuilt here"
        )
    request = {"shots": inputs["shots"], "audio": inputs.get("audio")}
    job = await LocalAdapter(route, store_for).submit(
        operation_key="release", executor=ASSEMBLER, request=request, estimate=Decimal(0)
    )
    if job.status != JobStatus.SUCCEEDED or job.inline is None:
        error = job.error.message if job.error is not None else "assembly produced nothing"
        raise ReleaseRefused(f"the rebuild failed: {error}")
    return job.inline


# ── the manifest's contents ────────────────────────────────────────────────────────────────────────────
@dataclass
class _Output:
    node: str
    stage: str
    executor: str
    version: int
    seq: int
    event: Outcome
    recorded_at: datetime
    route: str | None
    current: bool = False

    def entry(self) -> dict[str, Any]:
        a = self.event.artifact
        media = a.media.model_dump(mode="json", exclude_none=True) if a.media else None
        return {
            "node": self.node,
            "stage": self.stage,
            "version": self.version,
            "operation_key": self.event.operation_key,
            "vendor_job_id": self.event.job_id,
            "executor": self.executor,
            "route": self.route,
            "sha256": a.sha256,
            "size": a.size,
            "media": media,
            "input_hash": self.event.input_hash,
            "reused_from": self.event.reused_from,
            "cost": str(self.event.actual_cost),
            "recorded_at": self.recorded_at.isoformat(),
            "current": self.current,
        }


def _stage_of(p: Projection, node: str) -> str:
    spec = p.graph.nodes.get(node)
    return spec.stage.id if spec is not None else node.split("/")[0]


def _outputs(p: Projection, events: Iterable[StoredEvent]) -> list[_Output]:
    """Every output the task registered, in order, each with its node's version number and its route."""
    routes: dict[str, str | None] = {}
    out: list[_Output] = []
    counts: dict[str, int] = defaultdict(int)
    current = {v.artifact_seq for v in p.nodes.values() if v.artifact}
    for e in events:
        event = parse(e)
        if isinstance(event, Intent) and event.action.kind == "Dispatch":
            routes[event.action.operation_key] = event.route
        elif isinstance(event, Outcome):
            counts[event.node] += 1
            stage = _stage_of(p, event.node)
            spec = p.graph.nodes.get(event.node)
            executor = spec.stage.executor if spec is not None else "?"
            route = routes.get(event.operation_key)
            out.append(
                _Output(event.node, stage, executor, counts[event.node], e.seq, event, e.recorded_at, route)
            )
            out[-1].current = e.seq in current
    return out


def _costs(p: Projection, events: Sequence[StoredEvent]) -> dict[str, Any]:
    """What each stage cost, as the ledger recorded it: vendors' figures (each Outcome's and Failure's cost,
    late charges) and model inference (reviews, gates, LLM decisions), per stage and in total."""
    stages: dict[str, dict[str, Decimal]] = defaultdict(
        lambda: {"vendor": Decimal(0), "inference": Decimal(0), "operations": Decimal(0)}
    )
    for e in events:
        pay = e.payload
        if e.type in ("Outcome", "Failure"):
            stages[_stage_of(p, str(pay["node"]))]["vendor"] += Decimal(str(pay.get("actual_cost") or "0"))
            stages[_stage_of(p, str(pay["node"]))]["operations"] += 1
        elif e.type == "SystemMarker" and pay.get("kind") == MarkerKind.LATE_CHARGE:
            where = _stage_of(p, str(pay["node"])) if pay.get("node") else "unattributed"
            stages[where]["vendor"] += Decimal(str(pay.get("amount") or "0"))
        elif e.type == "ExecutionResult":
            stages[_stage_of(p, str(pay["node"]))]["inference"] += Decimal(str(pay.get("actual_cost") or "0"))
        elif e.type == "Decision":
            stages["decisions"]["inference"] += Decimal(str(pay.get("cost") or "0"))
    table = {
        s: {
            "vendor": str(c["vendor"]),
            "inference": str(c["inference"]),
            "operations": int(c["operations"]),
            "total": str(c["vendor"] + c["inference"]),
        }
        for s, c in sorted(stages.items())
    }
    total = sum((c["vendor"] + c["inference"] for c in stages.values()), Decimal(0))
    return {
        "units": "the plan's budget units, as recorded (vendor-billed figures as the ledger settled them)",
        "stages": table,
        "total": str(total),
        "vendor_spend": str(vendor_spend(events)),
        "ledger_spent": str(p.spent),
        "budget_ceiling": str(p.plan.budget_ceiling),
    }


def _decisions(events: Sequence[StoredEvent], registry: dict[str, KeyRecord]) -> dict[str, Any]:
    """Every decision about the task: people's (signed message, signature, key id and the key's public key),
    policies', the models', and the reviews' verdicts."""
    people, changes, policy, models, reviews = [], [], [], [], []
    for e in events:
        event = parse(e)
        at = e.recorded_at.isoformat()
        if isinstance(event, HumanDecision):
            key = registry.get(event.key_id) if event.key_id else None
            people.append(
                {
                    "request_id": event.request_id,
                    "decision": str(event.decision),
                    "approver": event.approver,
                    "note": event.note,
                    "amount": None if event.amount is None else str(event.amount),
                    "scope": event.scope,
                    "key_id": event.key_id,
                    "public_key": key.public_key if key else None,
                    "signed": event.signed,
                    "signature": event.signature,
                    "issued_at": event.issued_at.isoformat() if event.issued_at else None,
                    "recorded_at": at,
                }
            )
        elif isinstance(event, TaskChange):
            key = registry.get(event.key_id)
            changes.append(
                {
                    "change_id": event.change_id,
                    "kind": str(event.kind),
                    "node": event.node,
                    "approver": event.approver,
                    "note": event.note,
                    "key_id": event.key_id,
                    "public_key": key.public_key if key else None,
                    "signed": event.signed,
                    "signature": event.signature,
                    "issued_at": event.issued_at.isoformat(),
                    "recorded_at": at,
                }
            )
        elif isinstance(event, SystemMarker) and event.kind in (
            MarkerKind.TIMEOUT,
            MarkerKind.BACKUPS_OFFERED,
        ):
            policy.append(
                {"kind": str(event.kind), "request_id": event.request_id, "detail": event.detail, "at": at}
            )
        elif isinstance(event, Escalation | PartialResolution):
            policy.append({"kind": event.type, **event.model_dump(mode="json", exclude={"type"}), "at": at})
        elif isinstance(event, Decision):
            models.append(
                {
                    "model": event.model,
                    "prompt_hash": event.prompt_hash,
                    "valid": event.valid,
                    "action": event.action.kind if event.action is not None else None,
                    "tokens_in": event.tokens_in,
                    "tokens_out": event.tokens_out,
                    "cost": str(event.cost),
                    "at": at,
                }
            )
        elif isinstance(event, ExecutionResult):
            reviews.append(
                {
                    "kind": event.kind,
                    "node": event.node,
                    "operation_key": event.operation_key,
                    "passed": event.passed,
                    "verdict": None if event.verdict is None else str(event.verdict),
                    "flagged": list(event.flagged),
                    "findings": list(event.findings),
                    "scores": event.scores,
                    "cost": str(event.actual_cost),
                    "at": at,
                }
            )
    return {"decisions": people, "changes": changes, "policy": policy, "models": models, "reviews": reviews}


def _actions(outputs: list[_Output], final: _Output, method: str, released_at: str) -> dict[str, Any]:
    """``c2pa.actions``: each current output created (by its route, generative unless made locally), the final
    output assembled from them, then published by this release."""
    actions: list[dict[str, Any]] = []
    for o in outputs:
        if not o.current or o is final or o.node == REVIEW:
            continue
        action: dict[str, Any] = {
            "action": "c2pa.created",
            "when": o.recorded_at.isoformat(),
            "softwareAgent": {"name": o.route or o.executor},
            "parameters": {
                "ledgerflow.node": o.node,
                "ledgerflow.operation_key": o.event.operation_key,
                "ledgerflow.vendor_job_id": o.event.job_id,
                "ledgerflow.sha256": o.event.artifact.sha256,
            },
        }
        if o.executor not in LOCAL_EXECUTORS:
            action["digitalSourceType"] = AI_MEDIA
        actions.append(action)
    actions.append(
        {
            "action": "c2pa.placed",
            "when": final.recorded_at.isoformat(),
            "softwareAgent": {"name": f"ledgerflow compose ({method})"},
            "digitalSourceType": COMPOSITE,
            "parameters": {
                "ledgerflow.node": final.node,
                "ledgerflow.operation_key": final.event.operation_key,
                "ledgerflow.sha256": final.event.artifact.sha256,
            },
        }
    )
    actions.append(
        {"action": "c2pa.published", "when": released_at, "softwareAgent": {"name": "ledgerflow release"}}
    )
    return {"actions": actions}


def _ingredient(o: _Output, direct: set[str]) -> dict[str, Any]:
    a = o.event.artifact
    fmt = a.media.format if a.media else None
    return {
        "title": o.node,
        "format": mime(fmt),
        "instance_id": f"ledgerflow:{o.event.operation_key}",
        "relationship": "componentOf" if a.sha256 in direct else "inputTo",
        "hash": {"alg": "sha256", "sha256": a.sha256, "hash": mf.hash_b64(a.sha256)},
        "ledgerflow": o.entry(),
    }


def _rights(outputs: list[_Output]) -> dict[str, Any]:
    held, none = [], []
    for o in outputs:
        if not o.current or o.node in (COMPOSE, REVIEW):
            continue
        rights = o.event.artifact.media.rights if o.event.artifact.media else None
        if rights:
            held.append({"node": o.node, "sha256": o.event.artifact.sha256, "rights": rights})
        else:
            none.append({"node": o.node, "sha256": o.event.artifact.sha256})
    return {"records": held, "without_rights": none}


def _rules(events: Sequence[StoredEvent]) -> dict[str, Any]:
    versions: set[int] = set()
    schemas: dict[str, set[int]] = defaultdict(set)
    for e in events:
        schemas[e.type].add(e.schema_version)
        if e.type == "Intent":
            versions.add(int(e.payload.get("rules") or 1))
    return {
        "rule_table_versions": sorted(versions),
        "rule_table_version_now": RULES_VERSION,
        "event_schema_versions": {t: sorted(v) for t, v in sorted(schemas.items())},
    }


def _embed_c2pa(
    output: Path,
    where: Path,
    task_id: str,
    key: ApproverKey,
    chain: bytes,
    anchor: bytes | None,
    claim: dict[str, Any],
    current: list[_Output],
) -> dict[str, Any]:
    """Write ``TASK.c2pa.mp4`` (and the CA to trust, if given); what the signed claim says of it."""
    from ledgerflow.release import c2pa_embed

    c2pa_embed.check_chain(chain, key)
    dest = where / f"{task_id}.c2pa.mp4"
    binding = {
        "generator": claim["claim_generator"],
        "task": task_id,
        "output_sha256": claim["output"]["sha256"],
        "release_key": {"key_id": key.key_id, "public_key": key.public_key},
        "ingredients": [{"node": o.node, "sha256": o.event.artifact.sha256} for o in current],
    }
    c2pa_embed.embed(output, dest, key, chain, title=str(claim["title"]), binding=binding)
    described: dict[str, Any] = {
        "name": dest.name,
        "sha256": mf.sha256_file(dest),
        "size": dest.stat().st_size,
    }
    if anchor is not None:
        (where / f"{task_id}.c2pa-ca.pem").write_bytes(anchor)
        described["trust_anchor"] = f"{task_id}.c2pa-ca.pem"
    return described


# ── the release ────────────────────────────────────────────────────────────────────────────────────────
def _version() -> str:
    from ledgerflow import installed_version

    return installed_version() or "unknown"


async def release(
    settings: Settings,
    recorder: Recorder,
    task_id: str,
    key: ApproverKey,
    out_dir: Path | None = None,
    *,
    c2pa_chain: bytes | None = None,
    c2pa_anchor: bytes | None = None,
) -> Release:
    """Rebuild, compare, and write the signed release of ``task_id`` (see the module's docstring). With
    ``c2pa_chain`` (a PEM chain certifying the release key), an MP4 output is also written with a C2PA
    manifest embedded (``ledgerflow.release.c2pa_embed``), its sha256 in the signed claim; ``c2pa_anchor``,
    the CA a verifier should trust for it, is written beside it.

    Raises:
        ClientError: no such task, an unusable key (one line).
        ReleaseRefused: the task is not complete, or the rebuilt or stored output is not what was recorded.
    """
    now = datetime.now(UTC)
    registry = await asyncio.to_thread(recorder.key_registry)
    refusal = release_key_refusal(key, registry, settings, now)
    if refusal is not None:
        raise ClientError(refusal)
    events = await asyncio.to_thread(recorder.read_events, task_id)
    if not events:
        raise ClientError(f"no task {task_id!r} in the ledger")
    p = fold(events)
    if not p.completed:
        why = p.terminal_reason or p.escalation_reason or "it has not finished"
        raise ReleaseRefused(f"task {task_id} did not complete ({why}): only a completed task is released")
    compose = p.nodes.get(COMPOSE)
    if compose is None or compose.artifact is None:
        raise ReleaseRefused(f"task {task_id} has no final output (compose registered nothing)")
    outputs = _outputs(p, events)
    by_seq = {o.seq: o for o in outputs}
    final = by_seq[compose.artifact_seq]
    # The Outcome that made the bytes: the final one, or the one whose output it reused.
    origin = final
    while origin.event.reused_from:
        made = [o for o in outputs if o.event.operation_key == origin.event.reused_from]
        if not made:
            raise ReleaseRefused(
                f"the final output reuses {origin.event.reused_from}, which the ledger lacks"
            )
        origin = made[0]
    stores = [open_store(settings.store_location())]

    def store_for(uri: str) -> ArtifactStore:
        return store_for_uri(uri, stores)

    recorded = final.event.artifact
    inputs = (_dispatch_inputs(events, origin.event.operation_key) or {}).get("inputs") or {}
    checked = 0
    if p.plan.compose is not None and inputs.get("shots"):
        method = ASSEMBLER
        for i, ref in enumerate(refs(inputs)):
            node = str(ref.get("node") or f"input {i}")
            await asyncio.to_thread(_check_stored, store_for, ref, f"input {node}")
            checked += 1
        data = await _assemble(settings, store_for, inputs)
    else:
        method = "manifest"
        data = _manifest_bytes(events, origin.seq, task_id)
    rebuilt = hashlib.sha256(data).hexdigest()
    if rebuilt != recorded.sha256:
        raise ReleaseRefused(
            f"the rebuilt output ({method}) hashes to {rebuilt}, the final Outcome (seq {final.seq},"
            f" {final.event.operation_key}) recorded {recorded.sha256}"
        )
    stored = await asyncio.to_thread(_stored_sha, store_for, recorded.uri)
    if stored is None:
        raise ReleaseRefused(f"the final output is missing from the store: {recorded.uri}")
    if stored != recorded.sha256:
        raise ReleaseRefused(
            f"the stored final output at {recorded.uri} hashes to {stored}, the final Outcome"
            f" (seq {final.seq}) recorded {recorded.sha256} (altered or corrupt)"
        )

    fmt = recorded.media.format if recorded.media and recorded.media.format else "json"
    name = f"{task_id}.{'json' if method == 'manifest' else fmt}"
    if c2pa_chain is not None and fmt != "mp4":
        raise ClientError(f"a C2PA manifest is embedded only in an MP4 output; {task_id}'s is {fmt}")
    released_at = now.isoformat()
    direct = {str(r["sha256"]) for r in refs(inputs)}
    assertions: list[tuple[str, dict[str, Any]]] = [
        (
            mf.HASH_DATA,
            {
                "alg": "sha256",
                "hash": mf.hash_b64(rebuilt),
                "sha256": rebuilt,
                "name": name,
                "exclusions": [],
            },
        ),
        (mf.ACTIONS, _actions(outputs, final, method, released_at)),
    ]
    current = [o for o in outputs if o.current and o.node not in (COMPOSE, REVIEW)]
    assertions += [(mf.INGREDIENT, _ingredient(o, direct)) for o in current]
    assertions += [
        ("ledgerflow.outputs", {"outputs": [o.entry() for o in outputs]}),
        ("ledgerflow.rights", _rights(outputs)),
        (mf.DECISIONS, _decisions(events, registry)),
        (mf.COST, _costs(p, events)),
        ("ledgerflow.rules", _rules(events)),
        (
            "ledgerflow.rebuild",
            {
                "method": method,
                "final_outcome": {"seq": final.seq, "operation_key": final.event.operation_key},
                "made_by": {"seq": origin.seq, "operation_key": origin.event.operation_key},
                "recorded_sha256": recorded.sha256,
                "rebuilt_sha256": rebuilt,
                "stored_sha256": stored,
                "inputs_rehashed": checked,
            },
        ),
    ]
    plan_json = p.plan.model_dump(mode="json")
    claim = {
        "claim_generator": f"ledgerflow/{_version()}",
        "title": f"{task_id}: final output",
        "task": task_id,
        "project": p.plan.project,
        "episode": p.plan.episode,
        "goal": p.plan.goal,
        "plan_sha256": mf.digest(plan_json),
        "released_at": released_at,
        "output": {
            "name": name,
            "format": mime(fmt),
            "sha256": rebuilt,
            "size": len(data),
            "node": COMPOSE,
            "version": final.version,
            "operation_key": final.event.operation_key,
            "media": recorded.media.model_dump(mode="json", exclude_none=True) if recorded.media else None,
        },
        "signer": {"key_id": key.key_id, "holder": key.approver},
    }
    where = out_dir if out_dir is not None else settings.state_dir / "releases" / task_id
    where.mkdir(parents=True, exist_ok=True)
    output_path = where / name
    manifest_path = where / f"{task_id}.release.json"
    output_path.write_bytes(data)
    if c2pa_chain is not None:
        claim["embedded_c2pa"] = _embed_c2pa(
            output_path, where, task_id, key, c2pa_chain, c2pa_anchor, claim, current
        )
    document = mf.sign(claim, mf.labelled(assertions), key)
    manifest_path.write_text(mf.text(document))
    # The deployment's index of what was released (retention keeps a released task's artifacts); the
    # manifest itself is the proof and needs no database.
    await asyncio.to_thread(recorder.add_release, task_id, rebuilt, mf.sha256_file(manifest_path), key.key_id)
    return Release(task_id, rebuilt, method, output_path, manifest_path, document)
