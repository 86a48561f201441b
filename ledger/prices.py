"""Learned prices: what a route's recent operations really cost, against what their plans estimated.

One aggregate query over the ledger (the style of ``ledger.reports``), read by admission (``rules.pricing``,
through the worker's price book) and by ``ledgerflow quote``, so both see the same figures.

An operation counts for a route when its INTENT is a Dispatch (not a reuse: nothing was sent) and it has its
one result (``{op}:result``: an Outcome, a Failure or an ExecutionResult; a void sent nothing and teaches
nothing). Its route is the INTENT's ``route`` — the route that served it, a fallback included — or, on an
INTENT written before routes were recorded, the Dispatch's ``executor``. Per route only the last ``last``
results count (newest by the result's ``recorded_at``: a window function).

* **cost**: every settled cost of the operation: its result's ``actual_cost`` (a failure's too) plus any
  ``late_charge`` recorded against it;
* **ratio**: cost ÷ the plan's estimate, over the results whose estimate is above 0. The plan's estimate is
  the Dispatch's ``plan_estimate`` where admission reserved more than the author's figure, else its
  ``estimate``: a learned ratio is always against the author's figure, never against an earlier learned one
  (which would compound);
* **duration**: from the INTENT's ``recorded_at`` to the result's (both the database's clock).

Percentiles are ``percentile_disc``: an observed figure, never an interpolated one (the nearest-rank rule of
``ledgerflow stats``); money is rounded up to the ledger's scale.

Cost: the events table has no index on ``type`` or on the INTENT's route, so the query reads every INTENT
row once (a sequential scan) and looks each result up by its unique ``dedup_key``; late charges, reworks and
earlier reviews are looked up only for the rows inside the window (``ix_events_operation_key`` and the
primary key). Its caller bounds it (the worker caches it, ``ledgerflow quote`` runs it once).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import Any, Final

from sqlalchemy import Engine, text

from ledger.pgerrors import translated
from rules.keys import result_key
from rules.money import QUANTUM

__all__ = ["LearnedPrice", "RouteHistory", "learned_prices", "route_history"]


@dataclass(frozen=True, slots=True)
class LearnedPrice:
    """What a route's last settled results cost. ``ratio_*`` are 0 when none of them had an estimate above 0
    (:attr:`RouteHistory.priced` says how many had)."""

    route: str
    results: int  # settled results counted (the route's last `last`)
    ratio_p50: Decimal  # actual cost ÷ the plan's estimate, over results whose estimate > 0
    ratio_p95: Decimal
    cost_p50: Decimal  # actual cost
    cost_p95: Decimal


@dataclass(frozen=True, slots=True)
class RouteHistory:
    """A route's learned price and what else its last results tell (``ledgerflow quote``)."""

    price: LearnedPrice
    priced: int  # results whose plan estimate was above 0: the ratio's basis
    failures: int  # results that were a Failure (each asks for a retry, or a person)
    outcomes: int  # results that were an Outcome
    reworked: int  # … of which a later rework round invalidated the node
    first_reviews: int  # review results that were their task's first review (the ``review`` route's)
    first_passes: int  # … whose verdict was Pass or SoftWarning
    duration_p50_s: float  # from the INTENT to the result
    duration_p95_s: float

    @property
    def retry_rate(self) -> float:
        return self.failures / self.price.results if self.price.results else 0.0

    @property
    def rework_rate(self) -> float | None:
        return self.reworked / self.outcomes if self.outcomes else None

    @property
    def first_pass_rate(self) -> float | None:
        return self.first_passes / self.first_reviews if self.first_reviews else None


_ROUTE: Final = "COALESCE(i.payload->>'route', i.payload->'action'->>'executor')"
_PLAN_ESTIMATE: Final = (
    "COALESCE(i.payload->'action'->>'plan_estimate', i.payload->'action'->>'estimate')::numeric"
)
# A task's project is its plan's (TaskCreated is every task's seq 1): a primary-key lookup per INTENT.
_BY_PROJECT: Final = """
    JOIN events c ON c.task_id = i.task_id AND c.seq = 1 AND c.type = 'TaskCreated'
                 AND c.payload->'plan'->>'project' = :project"""

_HISTORY: Final = """
WITH settled AS MATERIALIZED (  -- the few fields needed, so the window sorts small rows, not payloads
    SELECT i.task_id, i.operation_key, i.payload->'action'->>'node' AS node, {route} AS route,
           {estimate} AS estimate, i.recorded_at AS sent_at,
           r.seq AS result_seq, r.type AS result_type, r.recorded_at AS settled_at,
           r.payload->>'actual_cost' AS actual_cost, r.payload->>'kind' AS result_kind,
           r.payload->>'verdict' AS verdict
    FROM events i
    JOIN events r ON r.dedup_key = i.operation_key || :result_suffix {project}
    WHERE i.type = 'Intent' AND i.operation_key IS NOT NULL
      AND i.payload->'action'->>'kind' = 'Dispatch'
      AND jsonb_typeof(i.payload->'action'->'reuse') IS DISTINCT FROM 'object'
      AND {route} = ANY(:routes)
      AND r.type IN ('Outcome', 'Failure', 'ExecutionResult')
),
ranked AS (
    SELECT s.*, row_number() OVER (
               PARTITION BY s.route ORDER BY s.settled_at DESC, s.task_id DESC, s.result_seq DESC
           ) AS n
    FROM settled s
),
w AS (
    SELECT g.route, g.estimate,
           COALESCE(g.actual_cost::numeric, 0) + COALESCE(late.amount, 0) AS cost,
           extract(epoch FROM g.settled_at - g.sent_at)::float8 AS duration,
           g.result_type,
           g.result_type = 'Outcome' AND EXISTS (
               SELECT 1 FROM events b
               WHERE b.task_id = g.task_id AND b.seq > g.result_seq AND b.type = 'Rollback'
                 AND b.payload->'invalidated' @> jsonb_build_array(g.node)
           ) AS reworked,
           g.result_type = 'ExecutionResult' AND g.result_kind = 'review'
               AND g.verdict IS NOT NULL AND NOT EXISTS (
               SELECT 1 FROM events e
               WHERE e.task_id = g.task_id AND e.seq < g.result_seq AND e.type = 'ExecutionResult'
                 AND e.payload->>'kind' = 'review' AND e.payload->>'verdict' IS NOT NULL
           ) AS first_review,
           g.verdict IN ('Pass', 'SoftWarning') AS passed
    FROM ranked g
    LEFT JOIN LATERAL (
        SELECT sum((m.payload->>'amount')::numeric) AS amount FROM events m
        WHERE m.operation_key = g.operation_key AND m.type = 'SystemMarker'
          AND m.payload->>'kind' = 'late_charge'
    ) late ON true
    WHERE g.n <= :last
)
SELECT route, count(*) AS results,
       count(*) FILTER (WHERE estimate > 0) AS priced,
       percentile_disc(0.5) WITHIN GROUP (ORDER BY cost / NULLIF(estimate, 0)),
       percentile_disc(0.95) WITHIN GROUP (ORDER BY cost / NULLIF(estimate, 0)),
       percentile_disc(0.5) WITHIN GROUP (ORDER BY cost),
       percentile_disc(0.95) WITHIN GROUP (ORDER BY cost),
       count(*) FILTER (WHERE result_type = 'Failure'),
       count(*) FILTER (WHERE result_type = 'Outcome'),
       count(*) FILTER (WHERE reworked),
       count(*) FILTER (WHERE first_review),
       count(*) FILTER (WHERE first_review AND passed),
       percentile_disc(0.5) WITHIN GROUP (ORDER BY duration),
       percentile_disc(0.95) WITHIN GROUP (ORDER BY duration)
FROM w GROUP BY route
"""


def history_sql(*, project: bool) -> str:
    """The query (for ``EXPLAIN``): per route, the aggregates of its last ``:last`` settled results."""
    return _HISTORY.format(route=_ROUTE, estimate=_PLAN_ESTIMATE, project=_BY_PROJECT if project else "")


def route_history(
    engine: Engine, routes: Iterable[str], *, last: int = 50, project: str | None = None
) -> dict[str, RouteHistory]:
    """Per route (of ``routes``) with at least one settled result: its learned price and history, from its
    last ``last`` results (of tasks of ``project`` only, if given). One statement.

    Raises:
        ValueError: ``last`` is below 1.
        LedgerUnavailable: the database could not be reached, or the query ran past a statement timeout.
        LedgerError: any other database error.
    """
    if last < 1:
        raise ValueError(f"last must be at least 1, got {last}")
    names = sorted(set(routes))
    if not names:
        return {}
    params: dict[str, Any] = {"routes": names, "last": last, "result_suffix": result_key("")}
    if project is not None:
        params["project"] = project
    with translated(), engine.connect() as conn:
        rows = conn.execute(text(history_sql(project=project is not None)), params).all()
    return {row[0]: _history(row) for row in rows}


def learned_prices(engine: Engine, routes: Iterable[str], *, last: int = 50) -> dict[str, LearnedPrice]:
    """Per route (of ``routes``) with at least one settled result, what its last ``last`` results cost
    against their plans' estimates; routes with none are absent."""
    return {route: h.price for route, h in route_history(engine, routes, last=last).items()}


def _up(value: Any) -> Decimal:
    """A figure as money: rounded up to the ledger's scale (None: 0)."""
    return Decimal(0) if value is None else Decimal(value).quantize(QUANTUM, rounding=ROUND_CEILING)


def _history(row: Any) -> RouteHistory:
    route, results, priced, r50, r95, c50, c95, failures, outcomes, reworked, reviews, passes, d50, d95 = row
    return RouteHistory(
        price=LearnedPrice(
            route=route,
            results=int(results),
            ratio_p50=_up(r50),
            ratio_p95=_up(r95),
            cost_p50=_up(c50),
            cost_p95=_up(c95),
        ),
        priced=int(priced),
        failures=int(failures),
        outcomes=int(outcomes),
        reworked=int(reworked),
        first_reviews=int(reviews),
        first_passes=int(passes),
        duration_p50_s=round(float(d50 or 0.0), 3),
        duration_p95_s=round(float(d95 or 0.0), 3),
    )
