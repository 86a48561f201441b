"""Review verdict aggregation: many check results converge on exactly one of four verdicts.

Phase 1 (compliance and technical checks) is pure and runs first; a BLOCK there short-circuits: the model
is not asked. Otherwise phase 2 (content judgement by a model) runs too, whatever else phase 1 found (its
SOFT and REWORK results are kept), and the aggregation over both phases is deterministic.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Final

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from rules.events import Verdict


class Severity(StrEnum):
    OK = "ok"
    SOFT = "soft"  # worth a note; does not block
    REWORK = "rework"  # quality problem: the flagged nodes should be redone
    BLOCK = "block"  # compliance problem: never repaired automatically


@dataclass(frozen=True)
class CheckResult:
    """One check's finding. ``nodes`` names the nodes it blames (for a targeted rollback)."""

    check: str
    severity: Severity
    message: str = ""
    nodes: tuple[str, ...] = ()


# Scores below REWORK_BELOW on any dimension ask for rework; below SOFT_BELOW they are a soft warning.
REWORK_BELOW: Final = 0.6
SOFT_BELOW: Final = 0.75


def aggregate(results: list[CheckResult]) -> tuple[Verdict, tuple[str, ...], tuple[str, ...]]:
    """Return (verdict, flagged nodes, findings): the worst severity wins, BLOCK over REWORK over SOFT."""
    order = [Severity.BLOCK, Severity.REWORK, Severity.SOFT]
    verdicts = {
        Severity.BLOCK: Verdict.COMPLIANCE_BLOCK,
        Severity.REWORK: Verdict.QUALITY_REWORK,
        Severity.SOFT: Verdict.SOFT_WARNING,
    }
    for severity in order:
        hits = [r for r in results if r.severity == severity]
        if hits:
            flagged = tuple(dict.fromkeys(n for r in hits for n in r.nodes))
            findings = tuple(f"{r.check}: {r.message}" for r in hits)
            return verdicts[severity], flagged, findings
    return Verdict.PASS, (), ()


# The model's reasons travel with its findings (into a rework's request), bounded: each one, and all of them.
REASON_CHARS: Final = 300
REASONS_CHARS: Final = 800


def score_results(
    scores: dict[str, float], blame: dict[str, tuple[str, ...]], reasons: Sequence[str] = ()
) -> list[CheckResult]:
    """Turn per-dimension model scores into check results (phase 2).

    The model's ``reasons`` are not keyed by dimension: when any dimension falls short they become one more
    finding, ``content.reasons``, at the worst severity among the scores (so it is kept with them by
    :func:`aggregate`), each reason and the whole line bounded in length. No nodes: blame stays per dimension.
    """
    out = []
    for dim, score in sorted(scores.items()):
        if score < REWORK_BELOW:
            out.append(
                CheckResult(f"content.{dim}", Severity.REWORK, f"score {score:.2f}", blame.get(dim, ()))
            )
        elif score < SOFT_BELOW:
            out.append(CheckResult(f"content.{dim}", Severity.SOFT, f"score {score:.2f}"))
    said = [" ".join(r.split())[:REASON_CHARS] for r in reasons]
    said = [r for r in said if r]
    if out and said:
        worst = Severity.REWORK if any(r.severity == Severity.REWORK for r in out) else Severity.SOFT
        out.append(CheckResult("content.reasons", worst, "; ".join(said)[:REASONS_CHARS]))
    return out


Dimension = Annotated[str, StringConstraints(min_length=1, max_length=40)]
# Strict: a JSON number in 0..1, never true/false or "0.9".
Score = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False, strict=True)]
NodeRef = Annotated[str, StringConstraints(max_length=200)]
Reason = Annotated[str, StringConstraints(max_length=1000)]


class Judgement(BaseModel):
    """Phase 2: what the reviewing model answers. Its JSON schema is sent with the request.

    Unknown fields are ignored (models add their own); a missing field is empty.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    scores: dict[Dimension, Score] = Field(default_factory=dict, max_length=20)
    blame: dict[Dimension, Annotated[list[NodeRef], Field(max_length=100)]] = Field(
        default_factory=dict, max_length=20
    )
    reasons: list[Reason] = Field(default_factory=list, max_length=20)

    def blamed(self, known: Collection[str]) -> dict[str, tuple[str, ...]]:
        """Blame per dimension, keeping only node ids of this task (a model may invent others)."""
        return {
            dim: tuple(dict.fromkeys(n for n in nodes if n in known)) for dim, nodes in self.blame.items()
        }


def judgement_schema() -> dict[str, Any]:
    """The JSON schema of :class:`Judgement`, for the model request's structured-output format."""
    return Judgement.model_json_schema()


def parse_judgement(text: str) -> tuple[Judgement | None, str | None]:
    """The model's output as a Judgement, or a short reason why it is not one (never the output itself)."""
    try:
        return Judgement.model_validate_json(text), None
    except ValidationError as e:
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            return None, "output is not valid JSON"
        if first["type"] == "model_type":
            return None, "output is not a JSON object"
        where = ".".join(str(part) for part in first["loc"])[:60]
        return None, f"{where}: {first['msg']}"[:200]
