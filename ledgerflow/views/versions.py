"""Content versions: the projection at any point of the record (time travel) and review scores per version."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.table import Table

from ledgerflow.client import ClientError, events
from rules.events import ExecutionResult, parse_as
from rules.projection import fold, summary
from runtime.settings import Settings


def show_at(settings: Settings, task_id: str, at: int | None) -> dict[str, Any]:
    """The task's status as the rules saw it after event ``at`` (all events when None)."""
    rows = events(settings, task_id)
    if at is not None:
        if at < 1 or at > rows[-1].seq:
            raise ClientError(f"--at {at} is outside task {task_id!r}'s record (1..{rows[-1].seq})")
        rows = [e for e in rows if e.seq <= at]
    return summary(fold(rows))


@dataclass(frozen=True)
class Evaluation:
    seq: int
    version: int  # the composition version the review judged
    verdict: str
    scores: dict[str, float]
    regressions: dict[str, tuple[float, float]]  # dimension -> (previous, now), when it dropped too far


def evals(settings: Settings, task_id: str, threshold: float = 0.1) -> list[Evaluation]:
    """Every review's per-dimension scores, in order, with regressions flagged.

    A regression is a score more than ``threshold`` below the best earlier score of its dimension, so a slow
    drift is caught as well as a single step down.
    """
    out: list[Evaluation] = []
    best_before: dict[str, float] = {}
    compositions = 0
    for stored in events(settings, task_id):
        if stored.type == "Outcome" and stored.payload.get("node") == "compose":
            compositions += 1
        if stored.type != "ExecutionResult" or stored.payload.get("kind") != "review":
            continue
        result = parse_as(stored, ExecutionResult)
        regressions = {
            dim: (best_before[dim], score)
            for dim, score in result.scores.items()
            if dim in best_before and best_before[dim] - score > threshold
        }
        out.append(
            Evaluation(stored.seq, compositions, str(result.verdict), dict(result.scores), regressions)
        )
        for dim, score in result.scores.items():
            best_before[dim] = max(best_before.get(dim, score), score)
    return out


def evals_table(task_id: str, rows: list[Evaluation]) -> Table:
    dims = sorted({d for r in rows for d in r.scores})
    table = Table(title=f"review scores of {task_id} per composition version", title_justify="left")
    for col in ("seq", "version", "verdict", *dims, "regression"):
        table.add_column(col)
    for r in rows:
        flags = ", ".join(f"{d} {a:.2f}→{b:.2f}" for d, (a, b) in r.regressions.items())
        cells = [f"{r.scores[d]:.2f}" if d in r.scores else "—" for d in dims]
        table.add_row(str(r.seq), str(r.version), r.verdict, *cells, f"[red]{flags}[/red]" if flags else "")
    return table
