"""``ledgerflow stats``: the production SLOs (docs/design.md#production-slos), computed from the ledger (the
record, not a process's memory), over the tasks created in a window.

* task success rate — Completed / (Completed + Failed) among the window's tasks that ended;
* queue duration — from TaskCreated to the task's first dispatch INTENT (p50, p95);
* first-pass rate — share of tasks whose first review verdict was Pass or SoftWarning;
* retry rate — dispatches beyond each node's first / all dispatches;
* cost per usable second — what Completed tasks spent / the seconds of their composition (probed media);
* human wait — from a question's INTENT to its resolution (a decision or the timeout marker; p50, p95);
* invalidation propagation — from a rework round's Rollback to the first dispatch of a node it invalidated.

The SLO list also names "RC rebuild success": ledgerflow has no release-candidate rebuild step: not shown.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from rich.table import Table

from rules.actions import Dispatch
from rules.envelope import StoredEvent
from rules.events import ExecutionResult, HumanDecision, Intent, MarkerKind, RollbackDone, SystemMarker, parse
from rules.keys import resolution_key
from rules.plan import COMPOSE
from rules.projection import Projection, TaskState

FIRST_PASS = {"Pass", "SoftWarning"}


@dataclass
class Stats:
    tasks: int = 0
    completed: int = 0
    failed: int = 0
    queue_s: list[float] = field(default_factory=list)
    first_verdicts: list[str] = field(default_factory=list)
    dispatches: int = 0
    retries: int = 0
    spent_completed: Decimal = Decimal(0)
    usable_seconds: float = 0.0
    human_wait_s: list[float] = field(default_factory=list)
    propagation_s: list[float] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        ended = self.completed + self.failed
        first = sum(1 for v in self.first_verdicts if v in FIRST_PASS)
        return {
            "tasks": self.tasks,
            "task_success_rate": _ratio(self.completed, ended),
            "queue_duration_s": _quantiles(self.queue_s),
            "first_pass_rate": _ratio(first, len(self.first_verdicts)),
            "retry_rate": _ratio(self.retries, self.dispatches),
            "cost_per_usable_second": (
                str((self.spent_completed / Decimal(str(self.usable_seconds))).quantize(Decimal("0.000001")))
                if self.usable_seconds > 0
                else None
            ),
            "human_wait_s": _quantiles(self.human_wait_s),
            "invalidation_propagation_s": _quantiles(self.propagation_s),
        }


def compute(
    tasks: Iterable[tuple[Projection, Sequence[StoredEvent]]],
    since: datetime | None = None,
    project: str | None = None,
) -> Stats:
    """The SLOs over ``tasks`` (folded, with their events) created at or after ``since`` (of ``project``)."""
    s = Stats()
    for p, events in tasks:
        if (since is not None and p.created_at < since) or (
            project is not None and p.plan.project != project
        ):
            continue
        s.tasks += 1
        if p.state == TaskState.COMPLETED:
            s.completed += 1
        elif p.state == TaskState.FAILED:
            s.failed += 1
        _task(s, p, events)
    return s


def _task(s: Stats, p: Projection, events: Sequence[StoredEvent]) -> None:
    asked: dict[str, datetime] = {}
    rollbacks: list[tuple[datetime, set[str]]] = []
    dispatched: set[str] = set()
    first_verdict: str | None = None
    first_dispatch: datetime | None = None
    prefix = resolution_key(p.task_id, "")
    for stored in events:
        if stored.type == "Intent":
            intent = parse(stored)
            assert isinstance(intent, Intent)
            if isinstance(intent.action, Dispatch):
                node = intent.action.node
                s.dispatches += 1
                s.retries += node in dispatched
                dispatched.add(node)
                first_dispatch = first_dispatch or stored.recorded_at
                for at, nodes in rollbacks:
                    if node in nodes:
                        s.propagation_s.append((stored.recorded_at - at).total_seconds())
                        nodes.clear()  # the round's first dispatch of an invalidated node: propagated
            request = getattr(intent.action, "request", None)
            if request is not None:
                asked[request.id] = stored.recorded_at
        elif stored.type == "Rollback":
            rollback = parse(stored)
            assert isinstance(rollback, RollbackDone)
            rollbacks.append((stored.recorded_at, set(rollback.invalidated)))
        elif stored.type == "ExecutionResult" and first_verdict is None:
            result = parse(stored)
            if isinstance(result, ExecutionResult) and result.kind == "review" and result.verdict is not None:
                first_verdict = result.verdict.value
        if stored.dedup_key.startswith(prefix):
            event = parse(stored)
            resolved = isinstance(event, HumanDecision) or (
                isinstance(event, SystemMarker) and event.kind == MarkerKind.TIMEOUT
            )
            rid = stored.dedup_key[len(prefix) :]
            if resolved and rid in asked:
                s.human_wait_s.append((stored.recorded_at - asked[rid]).total_seconds())
    if first_dispatch is not None:
        s.queue_s.append((first_dispatch - p.created_at).total_seconds())
    if first_verdict is not None:
        s.first_verdicts.append(first_verdict)
    if p.state == TaskState.COMPLETED:
        s.spent_completed += p.spent
        media = ((p.nodes[COMPOSE].artifact or {}).get("media") or {}) if COMPOSE in p.nodes else {}
        s.usable_seconds += float(media.get("duration_s") or 0.0)


def parse_since(text: str | None, now: datetime) -> datetime | None:
    """``--since``: a duration back from now (``90m``, ``24h``, ``7d``) or an ISO 8601 time. ValueError."""
    if text is None:
        return None
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text[-1:] in units and text[:-1].replace(".", "", 1).isdigit():
        return now - timedelta(seconds=float(text[:-1]) * units[text[-1]])
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"--since {text[:40]!r} is not a duration like 24h or an ISO 8601 time") from None
    return t if t.tzinfo is not None else t.replace(tzinfo=now.tzinfo)


def table(stats: dict[str, Any]) -> Table:
    t = Table("SLO", "VALUE", box=None)
    t.add_row("tasks", str(stats["tasks"]))
    for key, label in (
        ("task_success_rate", "task success rate"),
        ("first_pass_rate", "first-pass rate"),
        ("retry_rate", "retry rate"),
        ("cost_per_usable_second", "cost per usable second"),
    ):
        value = stats[key]
        t.add_row(label, "—" if value is None else str(value))
    for key, label in (
        ("queue_duration_s", "queue duration"),
        ("human_wait_s", "human review wait"),
        ("invalidation_propagation_s", "invalidation propagation"),
    ):
        q = stats[key]
        t.add_row(label, "—" if q["n"] == 0 else f"p50 {q['p50']:.1f}s  p95 {q['p95']:.1f}s  (n={q['n']})")
    return t


def _ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0 < q < 1) by nearest rank — an observed value, never an interpolated one — or None
    for no values. The one definition every report here uses (stats, drill, soak, bench)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _quantiles(values: list[float]) -> dict[str, Any]:
    p50, p95 = percentile(values, 0.5), percentile(values, 0.95)
    return {
        "n": len(values),
        "p50": None if p50 is None else round(p50, 3),
        "p95": None if p95 is None else round(p95, 3),
    }
