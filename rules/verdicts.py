"""Review verdict aggregation: many check results converge on exactly one of four verdicts.

Phase 1 (compliance and technical checks) is pure and runs first; a hard failure short-circuits.
Phase 2 (content judgement by a model) only refines a phase-1 pass. The aggregation is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

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


def score_results(scores: dict[str, float], blame: dict[str, tuple[str, ...]]) -> list[CheckResult]:
    """Turn per-dimension model scores into check results (phase 2)."""
    out = []
    for dim, score in sorted(scores.items()):
        if score < REWORK_BELOW:
            out.append(
                CheckResult(f"content.{dim}", Severity.REWORK, f"score {score:.2f}", blame.get(dim, ()))
            )
        elif score < SOFT_BELOW:
            out.append(CheckResult(f"content.{dim}", Severity.SOFT, f"score {score:.2f}"))
    return out
