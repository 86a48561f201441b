"""``ledgerflow quote``: what a plan should cost and take, learned from the ledger, before it runs.

Per stage, from the last results of the route that serves its executor (``ledger.prices.route_history``: the
same learned prices admission reads):

* **spend** per node = the learned ratio (actual ÷ the plan's estimate, p50 and p95) × the stage's estimate,
  rounded up; a stage whose estimate is 0 is priced at the route's actual cost percentiles instead. A stage's
  spend = its nodes (the fan-out width, ``rules.plan.Stage.items``) × the per-node figure. Fewer than
  ``LEARN_MIN_RESULTS`` results on the route is too little history to say: the plan's estimate, and the
  quote says so.
* **duration** per node = from the INTENT to its result (p50, p95); a stage runs its nodes ``concurrency`` at
  a time, so it takes ``ceil(nodes / concurrency)`` node durations. The plan's duration is the longest path
  through the stages (compose and review included); waits for people are not in it.
* the route's **retry rate** (share of its attempts that failed), **rework rate** (share of its outputs a
  later rework round invalidated) and, for the review, its **first-pass rate**.

The total is the stages' sum plus the inference reserve admission always keeps aside (``rules.plan``); a
p95 total is the sum of the stages' p95s (a conservative bound, not the p95 of the sum). Retries and rework
are shown as rates, not added to the spend.

``submit --budget-from-quote p50|p95`` sets the plan's ceiling to that total and records the quote in the
plan (``rules.plan.PlanQuote``, in TaskCreated); ``quote --drift TASK`` compares the task's spend with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import ROUND_CEILING, Decimal
from typing import Any, Final

from rich import box
from rich.table import Table

from ledger.prices import RouteHistory, route_history
from ledgerflow import client as lf
from ledgerflow.errors import ClientError
from rules.envelope import StoredEvent
from rules.money import QUANTUM
from rules.plan import INFERENCE_RESERVE, Plan, PlanQuote, Stage, validate_plan
from rules.pricing import LEARN_MIN_RESULTS
from rules.projection import fold
from runtime.settings import Settings
from vendors.routes import deployment_table

PERCENTILES: Final = ("p50", "p95")
LAST: Final = 50  # results per route: what admission learns from (ledger.prices)


@dataclass(frozen=True)
class StageQuote:
    stage: str
    route: str
    nodes: int
    estimate: Decimal  # the plan's, per node
    results: int  # settled results of the route counted
    learned: bool  # enough history: the figures are learned, not the plan's estimate
    node_p50: Decimal
    node_p95: Decimal
    duration_p50_s: float | None  # the stage's, its waves included; None: too little history
    duration_p95_s: float | None
    retry_rate: float | None = None
    rework_rate: float | None = None
    first_pass_rate: float | None = None
    ratio: tuple[Decimal, Decimal] | None = None  # learned actual ÷ estimate, p50 and p95 (None: not used)
    note: str = ""

    @property
    def spend_p50(self) -> Decimal:
        return self.node_p50 * self.nodes

    @property
    def spend_p95(self) -> Decimal:
        return self.node_p95 * self.nodes

    def spend(self, percentile: str) -> Decimal:
        return self.spend_p50 if percentile == "p50" else self.spend_p95

    def as_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "route": self.route,
            "nodes": self.nodes,
            "estimate": _j(self.estimate),
            "results": self.results,
            "learned": self.learned,
            "ratio": None if self.ratio is None else {"p50": _j(self.ratio[0]), "p95": _j(self.ratio[1])},
            "node_spend": {"p50": _j(self.node_p50), "p95": _j(self.node_p95)},
            "spend": {"p50": _j(self.spend_p50), "p95": _j(self.spend_p95)},
            "duration_s": None
            if self.duration_p50_s is None
            else {"p50": self.duration_p50_s, "p95": self.duration_p95_s},
            "retry_rate": self.retry_rate,
            "rework_rate": self.rework_rate,
            "first_pass_rate": self.first_pass_rate,
            "note": self.note,
        }


@dataclass(frozen=True)
class Quote:
    goal: str
    project: str | None  # whose history (None: every project's)
    stages: list[StageQuote]
    estimated_total: Decimal  # the plan's own estimates, summed
    duration_p50_s: float
    duration_p95_s: float
    computed_at: datetime
    reserve: Decimal = INFERENCE_RESERVE
    unknown_durations: tuple[str, ...] = field(default=())  # stages whose duration is not known

    def total(self, percentile: str) -> Decimal:
        return sum((s.spend(percentile) for s in self.stages), Decimal(0)) + self.reserve

    def plan_quote(self, percentile: str) -> PlanQuote:
        return PlanQuote(
            percentile=percentile,  # checked by the caller: p50 or p95
            total=self.total(percentile),
            stages={s.stage: s.spend(percentile) for s in self.stages},
            computed_at=self.computed_at,
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "goal": self.goal,
            "history": self.project or "every project",
            "computed_at": self.computed_at.isoformat(),
            "stages": [s.as_json() for s in self.stages],
            "inference_reserve": _j(self.reserve),
            "total": {"p50": _j(self.total("p50")), "p95": _j(self.total("p95"))},
            "estimated_total": _j(self.estimated_total + self.reserve),
            "duration_s": {"p50": self.duration_p50_s, "p95": self.duration_p95_s},
            "duration_unknown_for": list(self.unknown_durations),
        }


def _j(value: Decimal) -> str:
    """Money in JSON: a string at the ledger's scale."""
    return str(value.quantize(QUANTUM))


def _up(value: Decimal) -> Decimal:
    return value.quantize(QUANTUM, rounding=ROUND_CEILING)


def stage_quote(stage: Stage, history: RouteHistory | None, concurrency: int) -> StageQuote:
    """One stage's quote from its route's history (None: no settled result on it)."""
    nodes = len(stage.items()) or 1
    results = history.price.results if history is not None else 0
    if history is None or results < LEARN_MIN_RESULTS:
        return StageQuote(
            stage=stage.id,
            route=stage.executor,
            nodes=nodes,
            estimate=stage.estimate,
            results=results,
            learned=False,
            node_p50=stage.estimate,
            node_p95=stage.estimate,
            duration_p50_s=None,
            duration_p95_s=None,
            note=f"too little history: {results} result{'' if results == 1 else 's'} on route "
            f"{stage.executor} (fewer than {LEARN_MIN_RESULTS}): the plan's estimate",
        )
    price = history.price
    if stage.estimate > 0 and history.priced > 0:
        ratio: tuple[Decimal, Decimal] | None = (price.ratio_p50, price.ratio_p95)
        node_p50, node_p95 = _up(stage.estimate * price.ratio_p50), _up(stage.estimate * price.ratio_p95)
        note = ""
    else:
        ratio = None
        node_p50, node_p95 = price.cost_p50, price.cost_p95
        note = (
            "the stage's estimate is 0: the route's actual costs"
            if stage.estimate == 0
            else "no result had an estimate: the route's actual costs"
        )
    waves = math.ceil(nodes / min(concurrency, nodes))
    return StageQuote(
        stage=stage.id,
        route=stage.executor,
        nodes=nodes,
        estimate=stage.estimate,
        results=results,
        learned=True,
        node_p50=node_p50,
        node_p95=node_p95,
        duration_p50_s=round(waves * history.duration_p50_s, 3),
        duration_p95_s=round(waves * history.duration_p95_s, 3),
        retry_rate=round(history.retry_rate, 4),
        rework_rate=None if history.rework_rate is None else round(history.rework_rate, 4),
        first_pass_rate=None if history.first_pass_rate is None else round(history.first_pass_rate, 4),
        ratio=ratio,
        note=note,
    )


def compute(
    plan: Plan, histories: dict[str, RouteHistory], *, now: datetime, project: str | None = None
) -> Quote:
    """The plan's quote from its routes' histories (route -> history; pure)."""
    stages = plan.all_stages()
    quotes = [stage_quote(s, histories.get(s.executor), plan.concurrency) for s in stages]
    by_id = {q.stage: q for q in quotes}
    deps = {s.id: s.depends_on for s in stages}

    def longest(which: str) -> float:
        memo: dict[str, float] = {}

        def finish(sid: str) -> float:
            if sid not in memo:
                q = by_id[sid]
                own = (q.duration_p50_s if which == "p50" else q.duration_p95_s) or 0.0
                memo[sid] = own + max((finish(d) for d in deps[sid]), default=0.0)
            return memo[sid]

        return round(max(finish(s.id) for s in stages), 3)

    return Quote(
        goal=plan.goal,
        project=project,
        stages=quotes,
        estimated_total=sum((s.estimate * q.nodes for s, q in zip(stages, quotes, strict=True)), Decimal(0)),
        duration_p50_s=longest("p50"),
        duration_p95_s=longest("p95"),
        computed_at=now,
        unknown_durations=tuple(q.stage for q in quotes if q.duration_p50_s is None),
    )


def quote(settings: Settings, plan: Plan, project: str | None = None) -> Quote:
    """The plan's quote from this deployment's ledger (of ``project``'s tasks only, if given)."""
    rec = lf.recorder(settings)
    try:
        routes = {s.executor for s in plan.all_stages()}
        histories = route_history(rec.reader, routes, last=LAST, project=project)
    finally:
        rec.dispose()
    return compute(plan, histories, now=datetime.now(UTC), project=project)


def budget_from_quote(settings: Settings, plan: Plan, percentile: str) -> tuple[Plan, Quote]:
    """The plan with its ceiling set to the quote's total at ``percentile`` and the quote recorded in it."""
    which = percentile.strip().lower()
    if which not in PERCENTILES:
        raise ClientError(f"--budget-from-quote must be p50 or p95, got {percentile[:20]!r}")
    q = quote(settings, plan)
    total = q.total(which)
    floor = q.estimated_total + q.reserve
    if total < floor:
        raise ClientError(
            f"the quote's {which} total {money_text(total)} is below the plan's estimated total "
            f"{money_text(floor)}: "
            "admission reserves at least each estimate, so the task could not finish; use p95 or lower the "
            "estimates"
        )
    raw = plan.model_dump(mode="json", exclude_unset=True)
    raw.update(budget_ceiling=str(total), quote=q.plan_quote(which).model_dump(mode="json"))
    return validate_plan(raw, deployment_table(settings).names(), task_id=plan.task_id), q


def money_text(value: Decimal) -> str:
    """Money as the quote writes it: two decimals when exact to the cent, else every digit."""
    return f"{value:.2f}" if value == value.quantize(Decimal("0.01")) else str(value.normalize())


def _seconds(value: float | None) -> str:
    if value is None:
        return "—"
    if value < 120:
        return f"{value:.1f}s"
    if value < 7200:
        return f"{value / 60:.1f}m"
    return f"{value / 3600:.1f}h"


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def tables(q: Quote) -> list[Any]:
    """What ``ledgerflow quote`` prints: spend per stage and in total, time and quality per stage, notes."""
    history = f"project {q.project}'s history" if q.project else "every project's history"
    spend = Table(
        title=f"quote: {q.goal[:60]} (last {LAST} results per route, {history})",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for col in ("stage", "route", "nodes", "results", "× estimate", "spend p50", "spend p95"):
        spend.add_column(col, justify="left" if col in ("stage", "route") else "right", no_wrap=True)
    time = Table(title="time and quality", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("stage", "time p50", "time p95", "retry rate", "rework rate", "review 1st pass"):
        time.add_column(col, justify="left" if col == "stage" else "right", no_wrap=True)
    for s in q.stages:
        mark = "" if s.learned else " *"
        spend.add_row(
            s.stage,
            s.route,
            str(s.nodes),
            str(s.results),
            "—" if s.ratio is None else " – ".join(f"{r.normalize():f}" for r in s.ratio),
            money_text(s.spend_p50) + mark,
            money_text(s.spend_p95) + mark,
        )
        time.add_row(
            s.stage,
            _seconds(s.duration_p50_s),
            _seconds(s.duration_p95_s),
            _rate(s.retry_rate),
            _rate(s.rework_rate),
            _rate(s.first_pass_rate),
        )
    spend.add_row("reserve", "inference", "", "", "", money_text(q.reserve), money_text(q.reserve))
    spend.add_section()
    spend.add_row("total", "", "", "", "", money_text(q.total("p50")), money_text(q.total("p95")))
    time.add_section()
    time.add_row("total", _seconds(q.duration_p50_s), _seconds(q.duration_p95_s), "", "", "")
    notes = [f"* {s.stage}: {s.note}" for s in q.stages if not s.learned]
    notes += [f"{s.stage}: {s.note}" for s in q.stages if s.learned and s.note]
    notes.append(f"the plan's own estimates: {money_text(q.estimated_total + q.reserve)} (reserve included)")
    if q.unknown_durations:
        notes.append(
            f"duration leaves out {', '.join(q.unknown_durations)} (no history) and waits for people"
        )
    else:
        notes.append("duration leaves out waits for people")
    notes.append("retries and rework are shown as rates, not added to the spend")
    return [spend, time, *notes]


# --- drift: a task's spend against the quote it was submitted with --------------------------------------


@dataclass(frozen=True)
class DriftRow:
    stage: str
    quoted: Decimal | None  # None: not in the quote (the planner's inference)
    actual: Decimal

    @property
    def drift(self) -> Decimal | None:
        return None if self.quoted is None else self.actual - self.quoted

    def as_json(self) -> dict[str, Any]:
        drift = self.drift
        return {
            "stage": self.stage,
            "quoted": None if self.quoted is None else _j(self.quoted),
            "actual": _j(self.actual),
            "drift": None if drift is None else _j(drift),
        }


@dataclass(frozen=True)
class Drift:
    task_id: str
    state: str
    finished: bool
    quote: PlanQuote
    rows: list[DriftRow]

    @property
    def actual(self) -> Decimal:
        return sum((r.actual for r in self.rows), Decimal(0))

    @property
    def drift(self) -> Decimal:
        return self.actual - self.quote.total

    def as_json(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "state": self.state,
            "finished": self.finished,
            "percentile": self.quote.percentile,
            "computed_at": self.quote.computed_at.isoformat(),
            "stages": [r.as_json() for r in self.rows],
            "quoted": _j(self.quote.total),
            "actual": _j(self.actual),
            "drift": _j(self.drift),
        }


PLANNER: Final = "(planner)"


def stage_spend(events: list[StoredEvent]) -> dict[str, Decimal]:
    """Every recorded cost of the task by stage (a node ``stage/ITEM`` is its stage's): results' actual costs
    (failures' too), late charges, and the planner's inference (``(planner)``) — what its accounts spent."""
    spent: dict[str, Decimal] = {}
    for e in events:
        if e.type in ("Outcome", "Failure", "ExecutionResult"):
            amount = e.payload.get("actual_cost")
        elif e.type == "SystemMarker" and e.payload.get("kind") == "late_charge":
            amount = e.payload.get("amount")
        elif e.type == "Decision":
            amount = e.payload.get("cost")
        else:
            continue
        node = e.payload.get("node") if e.type != "Decision" else None
        stage = str(node).split("/", 1)[0] if node else PLANNER
        spent[stage] = spent.get(stage, Decimal(0)) + Decimal(str(amount or "0"))
    return spent


def drift(settings: Settings, task_id: str) -> Drift:
    """The task's spend, by stage, against the quote recorded in its plan."""
    events = lf.events(settings, task_id)  # ClientError naming the task if the ledger has none
    p = fold(events)
    q = p.plan.quote
    if q is None:
        raise ClientError(
            f"task {task_id!r} has no quote: it was not submitted with --budget-from-quote "
            f"(ledgerflow quote PLAN shows one)"
        )
    spent = stage_spend(events)
    rows = [DriftRow(s, amount, spent.pop(s, Decimal(0))) for s, amount in q.stages.items()]
    rows += [DriftRow(s, None, amount) for s, amount in sorted(spent.items())]
    return Drift(task_id, p.state.value, p.finished, q, rows)


def drift_table(d: Drift) -> Table:
    state = d.state if d.finished else f"{d.state}, not finished: spend so far"
    t = Table(
        title=f"{d.task_id} ({state}) against its {d.quote.percentile} quote of "
        f"{d.quote.computed_at.isoformat(timespec='seconds')}",
        title_justify="left",
    )
    for col in ("stage", "quoted", "actual", "drift"):
        t.add_column(col, justify="left" if col == "stage" else "right")
    for r in d.rows:
        drift = r.drift
        t.add_row(
            r.stage,
            "—" if r.quoted is None else money_text(r.quoted),
            money_text(r.actual),
            "—" if drift is None else _signed(drift),
        )
    t.add_section()
    t.add_row("total", money_text(d.quote.total), money_text(d.actual), _signed(d.drift))
    return t


def _signed(value: Decimal) -> str:
    return ("+" if value > 0 else "") + money_text(value)
