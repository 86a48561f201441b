"""Review phase 1: compliance and technical checks as pure functions, chosen from an explicit whitelist.

Facts in, check results out. The activity that runs a review (or a static gate) gathers the facts: the
projection says what each node was asked to make, what it must be (its stage's ``output``) and which artifact
was registered; the only I/O, reading each artifact file and hashing it, happens there, in parallel. No check
reads a file, a clock or the network, so a verdict can be recomputed from the record and the same bytes.

Compliance runs first. A BLOCK there short-circuits: the technical checks are skipped (a blocked task is
never repaired, so judging its quality would only add noise) and so is phase 2, the paid model judgement.
Each check's name is the prefix of its findings (``"compliance.terms: shots/S02 uses 'unlicensed'"``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from rules.events import ArtifactRef, Media
from rules.plan import BANNED_TERMS, OutputSpec
from rules.projection import NodeStatus, Projection
from rules.verdicts import CheckResult, Severity

# What "rights metadata present" means: the vendor named the licence and who holds it.
RIGHTS_FIELDS: Final = ("license", "holder")


@dataclass(frozen=True)
class ArtifactFacts:
    """A registered artifact as found on disk."""

    sha256: str  # what the ledger registered
    actual_sha256: str | None  # what the file hashes to now; None: the file is missing
    media: Media | None = None  # what the file is (probed on arrival, for media), with the vendor's rights
    claimed: Media | None = None  # what the vendor said, where that disagrees with the file


@dataclass(frozen=True)
class NodeFacts:
    """One node: what it was asked to make, what its output must be, and its artifact if it has one."""

    node: str
    input: Mapping[str, Any]
    output: OutputSpec | None = None
    artifact: ArtifactFacts | None = None  # None: no registered artifact (the node has not succeeded)


@dataclass(frozen=True)
class Facts:
    """Everything phase 1 judges. ``gated``: the node a static gate is about to run (no artifact yet)."""

    nodes: tuple[NodeFacts, ...]
    require_rights: bool = True
    banned_terms: tuple[str, ...] = BANNED_TERMS
    gated: str | None = None


class Kind(StrEnum):
    COMPLIANCE = "compliance"  # a failure is a BLOCK: never repaired automatically
    TECHNICAL = "technical"  # a failure is REWORK of the flagged node


@dataclass(frozen=True)
class Check:
    name: str
    kind: Kind
    run: Callable[[Facts], list[CheckResult]]


def _rights(facts: Facts) -> list[CheckResult]:
    if not facts.require_rights:
        return []
    out = []
    for n in facts.nodes:
        if n.artifact is None:
            continue  # nothing delivered, nothing to license (technical.hash flags a missing artifact)
        rights = n.artifact.media.rights if n.artifact.media is not None else None
        if not rights:
            out.append(
                CheckResult(RIGHTS.name, Severity.BLOCK, f"{n.node} has no rights metadata", (n.node,))
            )
            continue
        missing = [f for f in RIGHTS_FIELDS if not rights.get(f, "").strip()]
        if missing:
            message = f"{n.node} rights metadata lacks {', '.join(missing)}"
            out.append(CheckResult(RIGHTS.name, Severity.BLOCK, message, (n.node,)))
    return out


def _terms(facts: Facts) -> list[CheckResult]:
    out = []
    for n in facts.nodes:
        text = json.dumps(n.input, sort_keys=True, ensure_ascii=False, default=str).lower()
        for term in facts.banned_terms:
            if term.lower() in text:
                out.append(CheckResult(TERMS.name, Severity.BLOCK, f"{n.node} uses {term!r}", (n.node,)))
    return out


def _integrity(nodes: Sequence[NodeFacts], check: str, severity: Severity, what: str) -> list[CheckResult]:
    out = []
    for n in nodes:
        a = n.artifact
        if a is None:
            problem = "has no artifact"
        elif a.actual_sha256 is None:
            problem = "artifact missing"
        elif a.actual_sha256 != a.sha256:
            problem = "artifact does not match its registered sha256"
        else:
            continue
        out.append(CheckResult(check, severity, f"{what}{n.node} {problem}", (n.node,)))
    return out


def _hash(facts: Facts) -> list[CheckResult]:
    return _integrity(facts.nodes, HASH.name, Severity.REWORK, "")


def _inputs_intact(facts: Facts) -> list[CheckResult]:
    inputs = [n for n in facts.nodes if n.node != facts.gated]
    return _integrity(inputs, INPUTS.name, Severity.BLOCK, "input ")


def media_problems(spec: OutputSpec, media: Media) -> list[str]:
    """How ``media`` falls outside ``spec`` (empty if it does not); a bounded value left unreported counts."""
    problems = []
    if spec.formats and (media.format or "").lower() not in spec.formats:
        problems.append(f"format {media.format or 'unknown'} is not one of {', '.join(spec.formats)}")
    if spec.duration is not None:
        low, high = spec.duration
        if media.duration_s is None:
            problems.append("duration unknown")
        elif not low <= media.duration_s <= high:
            problems.append(f"duration {media.duration_s:g}s is outside {low:g}-{high:g}s")
    for side, minimum, actual in (
        ("width", spec.min_width, media.width),
        ("height", spec.min_height, media.height),
    ):
        if minimum is None:
            continue
        if actual is None:
            problems.append(f"{side} unknown")
        elif actual < minimum:
            problems.append(f"{side} {actual} is below {minimum}")
    return problems


def claim_disagrees(found: Media, claimed: Media) -> list[str]:
    """How the vendor's claim about a file differs from what the file is (empty if it does not)."""
    out = []
    if claimed.format and found.format and claimed.format.lower() != found.format.lower():
        out.append(f"format {claimed.format} claimed, {found.format} found")
    said_s, real_s = claimed.duration_s, found.duration_s
    if said_s is not None and real_s is not None and abs(said_s - real_s) > max(0.1, 0.02 * real_s):
        out.append(f"duration {said_s:g}s claimed, {real_s:g}s found")
    for side, said, real in (("width", claimed.width, found.width), ("height", claimed.height, found.height)):
        if said is not None and real is not None and said != real:
            out.append(f"{side} {said} claimed, {real} found")
    return out


def output_problems(spec: OutputSpec | None, media: Media | None) -> list[str]:
    """A stage's node check on one arriving artifact: how it misses the stage's ``output`` bounds, if it does.

    The executor runs it before registering an artifact (an artifact that fails it is recorded as
    ``Failure(invalid_output)`` and retried), so a fan-out's canary must pass it before the stage widens;
    the review's ``technical.media`` holds the same bounds again over the composition.
    """
    if spec is None:
        return []
    if media is None:
        return ["has no media metadata to hold to its stage's output bounds"]
    return media_problems(spec, media)


def _media(facts: Facts) -> list[CheckResult]:
    out = []
    for n in facts.nodes:
        if n.artifact is None:
            continue  # nothing delivered (technical.hash flags that)
        a = n.artifact
        if a.claimed is not None and a.media is not None and (wrong := claim_disagrees(a.media, a.claimed)):
            # The file is what counts (it was probed); a vendor whose word differs from its file is worth
            # knowing about, not worth redoing the work for.
            message = f"{n.node}: the vendor's claim disagrees with the file ({'; '.join(wrong)})"
            out.append(CheckResult(MEDIA.name, Severity.SOFT, message, (n.node,)))
        if n.output is not None and (problems := output_problems(n.output, a.media)):
            out.append(CheckResult(MEDIA.name, Severity.REWORK, f"{n.node} {'; '.join(problems)}", (n.node,)))
    return out


RIGHTS: Final = Check("compliance.rights", Kind.COMPLIANCE, _rights)
TERMS: Final = Check("compliance.terms", Kind.COMPLIANCE, _terms)
HASH: Final = Check("technical.hash", Kind.TECHNICAL, _hash)
MEDIA: Final = Check("technical.media", Kind.TECHNICAL, _media)
INPUTS: Final = Check("gate.inputs", Kind.COMPLIANCE, _inputs_intact)

# The review's phase 1: exactly these checks, compliance before technical. Nothing else gives a verdict.
PHASE1: Final = (RIGHTS, TERMS, HASH, MEDIA)
# The static gate before a high-cost node: the same compliance checks on it and its inputs, and its inputs
# intact. It runs before the node spends anything, so every failure is a BLOCK.
GATE: Final = (RIGHTS, TERMS, INPUTS)


def run(checks: Sequence[Check], facts: Facts) -> list[CheckResult]:
    """Run the compliance checks, then (unless one of them blocked) the technical ones.

    The checks are independent pure functions, so their order within a kind never changes the result.
    """
    results = [r for c in checks if c.kind == Kind.COMPLIANCE for r in c.run(facts)]
    if any(r.severity == Severity.BLOCK for r in results):
        return results  # short-circuit: a blocked task is never repaired, so its quality is not judged
    return results + [r for c in checks if c.kind == Kind.TECHNICAL for r in c.run(facts)]


def phase1(facts: Facts) -> list[CheckResult]:
    """The review's phase 1 over ``facts``."""
    return run(PHASE1, facts)


def gate(facts: Facts) -> list[CheckResult]:
    """The static gate over ``facts`` (``facts.gated`` set): every finding is a BLOCK."""
    return run(GATE, facts)


def registered_artifact(p: Projection, node: str) -> ArtifactRef | None:
    """The artifact a node's current success registered, or None if it has not succeeded."""
    view = p.nodes[node]
    if view.status != NodeStatus.SUCCEEDED or not view.artifact:
        return None
    return ArtifactRef.model_validate(view.artifact)


def facts_for(
    p: Projection,
    nodes: Sequence[str],
    artifacts: Mapping[str, tuple[ArtifactRef, str | None]],
    *,
    gated: str | None = None,
) -> Facts:
    """Assemble the facts about ``nodes`` from the projection and what their files hash to now.

    Args:
        artifacts: per node with a registered artifact (:func:`registered_artifact`; never the gated node),
            that artifact and its file's sha256 now, or None if the file is missing.
        gated: the node a static gate is about to run: judged on its request only, never on an old artifact.
    """
    out = []
    for node in nodes:
        stage = p.graph.nodes[node].stage
        artifact = None
        if node in artifacts:
            ref, actual = artifacts[node]
            artifact = ArtifactFacts(ref.sha256, actual, ref.media, ref.claimed)
        out.append(NodeFacts(node, stage.input, stage.output, artifact))
    review = p.plan.review
    return Facts(tuple(out), review.require_rights, review.banned_terms, gated)
