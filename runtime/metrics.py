"""The worker's ``/metrics`` and ``/healthz``: the ledger's business metrics and the Temporal SDK's own.

Off unless ``LEDGERFLOW_METRICS_PORT`` is set. Then the worker serves, on ``LEDGERFLOW_METRICS_HOST``
(default 127.0.0.1) and that port:

* ``/metrics``: the business metrics below, then the SDK's runtime metrics. The SDK (Temporal's Rust core)
  exports those on its own Prometheus endpoint, bound to 127.0.0.1 on ``LEDGERFLOW_METRICS_SDK_PORT``
  (default: the metrics port + 1); ``/metrics`` fetches it and appends its text, so one scrape target per
  worker carries both and the SDK's port never needs to be reachable from outside. SDK metrics keep the
  SDK's names (``temporal_…``, durations in seconds, counters without ``_total``).
* ``/healthz``: 200 ``{"status": "ok"}`` when a gRPC health check of Temporal's frontend and ``SELECT 1``
  on the ledger both succeed within ~2 s; else 503 with a one-line JSON reason naming what failed.

Business metrics are facts of the ledger, not of one process: they are computed when scraped, by the
aggregate queries of ``ledger.reports`` in one read-only snapshot (so the numbers agree with each other),
on a connection opened for the scrape and closed after it. Shared state is exported once: only a process
with ``LEDGERFLOW_METRICS_LEDGER`` true (the default) serves them; on a deployment of several workers, set
it false on all but one, the exporter, and scrape every worker — each serves its worker-local metrics (the
SDK's) and ``ledgerflow_metrics_ledger_exporter`` (1 on the exporter, else 0), so an alert can check that
exactly one exports (docs/runbooks.md#one-exporter). A scrape returns rows per project, executor and kind,
never per event, but its cost grows with the ledger; ``ledgerflow_ledger_scrape_seconds`` shows it, and a
statement timeout caps it. A task's project, an operation's executor and the money's units are as
``ledger.reports`` says.

Every family is exported for its known label sets, at 0 where the ledger has nothing (not missing while
idle): the route file's routes (``routes``, passed by the worker) and every route the ledger names; every
project with a budget account or a task; every (project, executor) pair the ledger has an operation or a
cost for; the fixed kinds (request kinds, failure kinds, verdicts, budget scope kinds). Only the two ratios
are left out where they are undefined (no review yet, no second delivered). Unix-time gauges read 0 for
"never".

=======================================================  ==================================================
metric                                                   derived from
=======================================================  ==================================================
``ledgerflow_spend_total{project,executor}``             every recorded cost: Outcome, Failure and
                                                         ExecutionResult ``actual_cost``, Decision
                                                         ``cost``, ``late_charge`` markers' ``amount``
                                                         (what the budget accounts' ``spent`` sums)
``ledgerflow_reserved{project,executor}``                the reservations of open operations
``ledgerflow_open_operations{project,executor}``         INTENTs of an operation (a Dispatch or static gate)
                                                         with no ``{op}:result`` event yet
``ledgerflow_failures_total{project,executor,kind}``     Failure events by kind: each is an attempt that
                                                         failed; ``technical`` ones are retried, the others
                                                         go to a person
``ledgerflow_cost_anomalies_total{project,executor}``    ``cost_anomaly`` markers
``ledgerflow_human_queue_depth{project,kind}``           open requests to people: a request's INTENT with
                                                         no ``{task}:resolution:{id}`` event (a decision or
                                                         the timeout marker), in a task not ended
                                                         (Complete, or a terminal Escalation); 0 for every
                                                         kind of every project with a budget account
``ledgerflow_dead_letters_open{project}``                the same, kind ``dead_letter``
``ledgerflow_human_oldest_wait_seconds{project,kind}``   age of the oldest open request (database clock)
``ledgerflow_human_wait_seconds{project,kind}``          summary (count, sum) of decided requests' waits:
                                                         the HumanDecision's time minus its request's
``ledgerflow_first_reviews_total{project,verdict}``      tasks by the verdict of their first review
``ledgerflow_review_first_pass_ratio{project}``          the share of those whose first verdict passed
                                                         (Pass or SoftWarning)
``ledgerflow_usable_output_seconds_total{project}``      completed tasks' delivered duration: the last
                                                         ``compose`` Outcome's probed ``duration_s``
``ledgerflow_cost_per_usable_second{project}``           those tasks' whole spend (their ``task:`` budget
                                                         accounts: retries, reworks and review included)
                                                         divided by their delivered seconds
``ledgerflow_billing_unknown_charges_total{route}``      the billing reconciliation's record
                                                         (``ledger.reconciliation``): vendor charge lines no
                                                         operation knows, each once; ``…_ambiguous_charges``
                                                         (two operations claim it), ``…_credits``; by the
                                                         route whose billing account listed them
``ledgerflow_billing_unmatched_amount_total``            the money on those unknown and ambiguous lines,
``{route,kind}``                                         by route and finding kind
``ledgerflow_billing_reconciled_at``                     when its last run was recorded (unix time; 0: never)
``ledgerflow_attempts_total{project,executor}``          INTENTs with an OperationKey: attempts started (the
                                                         retry rate is technical failures over these)
``ledgerflow_open_operation_oldest_seconds``              age of the oldest open operation (database clock)
``{project,executor}``
``ledgerflow_tasks_unfinished{project}``                 tasks with no Complete INTENT nor terminal
                                                         Escalation
``ledgerflow_task_no_progress_seconds{project}``         the longest time such a task, waiting on no person
                                                         and with no operation open, has recorded nothing
``ledgerflow_budget_accounts_over_ceiling{kind}``        budget accounts whose spent exceeds their ceiling,
                                                         by scope kind (project, episode, task, route)
``ledgerflow_budget_overrun{kind}``                      how far past their ceilings, summed
``ledgerflow_admission_waiting{queue}``                  tasks waiting for a place to run
                                                         (``LEDGERFLOW_ACTIVE_TASKS``), per task queue; 0 for
                                                         this worker's queue when none wait
``ledgerflow_admission_admitted{queue}``                 tasks holding a place (a task stopped for a person
                                                         holds one but does not count against the bound)
``ledgerflow_admission_oldest_wait_seconds{queue}``      how long the longest-waiting task has waited
``ledgerflow_route_fallback_qualified{route}``           per fallback route (of the route file): 1 if its
                                                         qualification is younger than its
                                                         ``qualification_max_age``, else 0
``ledgerflow_metrics_ledger_exporter``                   1 if this process exports the families above
                                                         (``LEDGERFLOW_METRICS_LEDGER``), else 0
``ledgerflow_ledger_up``                                 1 if the queries succeeded on this scrape, else 0
``ledgerflow_ledger_scrape_seconds``                     how long the queries took
=======================================================  ==================================================
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Mapping
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from datetime import datetime, timedelta
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool
from temporalio.client import Client
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

from ledger import reconciliation, reports
from ledger.errors import LedgerError
from rules.actions import RequestKind
from rules.events import FailureKind, Verdict
from rules.scopes import ScopeKind
from runtime.settings import ConfigError

log = logging.getLogger("ledgerflow.metrics")

HEALTH_TIMEOUT_S: Final = 2.0
QUERY_TIMEOUT_MS: Final = 10_000  # a scrape that takes longer reports ledgerflow_ledger_up 0, not a hang


class MetricsSettings(BaseSettings):
    """Where the worker serves /metrics and /healthz. None (the default): nowhere, nothing changes."""

    model_config = SettingsConfigDict(env_prefix="LEDGERFLOW_", extra="ignore")

    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    metrics_host: str = "127.0.0.1"
    # The SDK's own exporter, always on loopback (/metrics relays it). None: metrics_port + 1.
    metrics_sdk_port: int | None = Field(default=None, ge=1, le=65535)
    # Whether this process exports the ledger's families (shared state: exactly one process should). A
    # deployment of several workers sets it false on all but one (or runs one worker as the exporter).
    metrics_ledger: bool = True

    def sdk_port(self) -> int | None:
        if self.metrics_port is None:
            return None
        return self.metrics_sdk_port or self.metrics_port + 1


def sdk_runtime(settings: MetricsSettings) -> Runtime | None:
    """A Temporal runtime exporting the SDK's metrics on loopback, or None (the default runtime) when off."""
    port = settings.sdk_port()
    if port is None:
        return None
    prometheus = PrometheusConfig(bind_address=f"127.0.0.1:{port}", durations_as_seconds=True)
    try:
        return Runtime(telemetry=TelemetryConfig(metrics=prometheus))
    except ValueError as e:  # the exporter could not bind its port
        raise ConfigError(f"LEDGERFLOW_METRICS_SDK_PORT {port}: {e}") from None


def ledger_engine(database_url: str) -> Engine:
    """An engine that keeps no connection between uses (NullPool): a scrape or a health check connects,
    runs, and disconnects, so an idle metrics endpoint holds nothing on the ledger's database."""
    return create_engine(
        database_url,
        poolclass=NullPool,
        connect_args={
            "connect_timeout": int(HEALTH_TIMEOUT_S),
            "options": f"-c statement_timeout={QUERY_TIMEOUT_MS}",
            "application_name": "ledgerflow-metrics",
        },
    )


# ── the ledger's metrics ───────────────────────────────────────────────────────────────────────────────────
PASSING_VERDICTS: Final = frozenset({"Pass", "SoftWarning"})


# The deployment's routes, as the composition root knows them from the route file: each route's name, and
# for a route some other route lists as a fallback, its ``qualification_max_age`` in seconds (else None).
Routes = Mapping[str, float | None]


def known_routes(table: Any) -> dict[str, float | None]:
    """``Routes`` from a ``vendors.routes.RouteTable`` (duck-typed: runtime imports nothing above it)."""
    fallbacks = {fb for spec in table.routes.values() for fb in spec.fallbacks}
    return {
        name: (float(spec.qualification_max_age) if name in fallbacks else None)
        for name, spec in table.routes.items()
    }


class LedgerCollector(Collector):
    """The business metrics, read from the ledger at each scrape (see the module docstring).

    Every family is exported for its known label sets, at 0 when the ledger has nothing for one: ``routes``
    (the route file's) and every route the ledger names; every project with a budget account or a task;
    every (project, executor) pair the ledger has an operation or cost for; the fixed kinds (request kinds,
    failure kinds, verdicts, budget scope kinds). The two ratios are the exception: undefined (no review, no
    delivered second), they are left out rather than shown as a false 0.
    """

    def __init__(self, engine: Engine, routes: Routes | None = None, queues: tuple[str, ...] = ()) -> None:
        self._engine = engine
        self._known = dict(routes or {})
        self._queues = queues  # task queues exported at 0 while none of their tasks waits (admission)

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        try:
            facts = reports.facts(self._engine)
            billing = reconciliation.counts(self._engine)
            families = list(self._families(facts, billing))
            up = 1.0
        except LedgerError as e:
            log.warning("ledger metrics unavailable: %s", one_line(e))
            families, up = [], 0.0
        yield from families
        yield GaugeMetricFamily("ledgerflow_ledger_up", "1 if the ledger's metrics were read.", value=up)
        yield GaugeMetricFamily(
            "ledgerflow_ledger_scrape_seconds",
            "Time taken by the ledger's metric queries on this scrape.",
            value=time.perf_counter() - started,
        )

    def _families(self, facts: reports.Facts, billing: reconciliation.Counts) -> Iterator[Metric]:
        projects = sorted(
            {*facts.projects, *(r.project for r in facts.spend), *(p for p, _, _ in facts.unfinished)}
        )
        pairs = sorted(
            {(r.project, r.executor) for r in facts.spend}
            | {(r.project, r.executor) for r in facts.open_operations}
            | {(r.project, r.executor) for r in facts.failures}
            | {(r.project, r.executor) for r in facts.anomalies}
            | {(p, x) for p, x, _ in facts.attempts}
        )
        yield from self._money(facts, pairs)
        yield from self._operations(facts, pairs, projects)
        yield from self._people(facts, projects)
        yield from self._quality(facts, projects)
        yield from self._routes(facts, billing)
        yield from self._billing(billing, facts.unmatched)
        yield from self._admission(facts.admission)

    def _admission(self, rows: list[tuple[str, int, int, float]]) -> Iterator[Metric]:
        q = ["queue"]
        waiting = GaugeMetricFamily(
            "ledgerflow_admission_waiting", "Tasks waiting for a place to run, per task queue.", labels=q
        )
        admitted = GaugeMetricFamily(
            "ledgerflow_admission_admitted", "Tasks holding a place to run, per task queue.", labels=q
        )
        oldest = GaugeMetricFamily(
            "ledgerflow_admission_oldest_wait_seconds",
            "How long the longest-waiting task of the queue has waited; 0 when none waits.",
            labels=q,
        )
        by_queue = {queue: (w, a, age) for queue, w, a, age in rows}
        for queue in sorted({*self._queues, *by_queue}):
            w, a, age = by_queue.get(queue, (0, 0, 0.0))
            waiting.add_metric([queue], float(w))
            admitted.add_metric([queue], float(a))
            oldest.add_metric([queue], float(age))
        yield waiting
        yield admitted
        yield oldest

    @staticmethod
    def _pair_family(
        family: GaugeMetricFamily | CounterMetricFamily,
        pairs: list[tuple[str, str]],
        values: dict[tuple[str, str], float],
    ) -> GaugeMetricFamily | CounterMetricFamily:
        for pair in pairs:
            family.add_metric(list(pair), values.get(pair, 0.0))
        return family

    def _money(self, facts: reports.Facts, pairs: list[tuple[str, str]]) -> Iterator[Metric]:
        pe = ["project", "executor"]
        spend = {(r.project, r.executor): float(r.cost) for r in facts.spend}
        yield self._pair_family(
            CounterMetricFamily("ledgerflow_spend", "Money spent, as the ledger records it.", labels=pe),
            pairs,
            spend,
        )
        reserved = {(r.project, r.executor): float(r.reserved) for r in facts.open_operations}
        yield self._pair_family(
            GaugeMetricFamily("ledgerflow_reserved", "Money reserved by open operations.", labels=pe),
            pairs,
            reserved,
        )
        anomalies = {(r.project, r.executor): float(r.anomalies) for r in facts.anomalies}
        yield self._pair_family(
            CounterMetricFamily("ledgerflow_cost_anomalies", "cost_anomaly markers.", labels=pe),
            pairs,
            anomalies,
        )
        over = GaugeMetricFamily(
            "ledgerflow_budget_accounts_over_ceiling",
            "Budget accounts whose spent exceeds their ceiling, by scope kind.",
            labels=["kind"],
        )
        overrun = GaugeMetricFamily(
            "ledgerflow_budget_overrun",
            "How far those accounts' spent exceeds their ceilings, summed, by scope kind.",
            labels=["kind"],
        )
        by_kind = {kind: (n, amount) for kind, n, amount in facts.over_ceiling}
        for kind in ScopeKind:
            n, amount = by_kind.get(kind.value, (0, Decimal(0)))
            over.add_metric([kind.value], float(n))
            overrun.add_metric([kind.value], float(amount))
        yield over
        yield overrun

    def _operations(
        self, facts: reports.Facts, pairs: list[tuple[str, str]], projects: list[str]
    ) -> Iterator[Metric]:
        pe = ["project", "executor"]
        opened = {(r.project, r.executor): float(r.operations) for r in facts.open_operations}
        yield self._pair_family(
            GaugeMetricFamily(
                "ledgerflow_open_operations", "Operations with an INTENT and no result yet.", labels=pe
            ),
            pairs,
            opened,
        )
        oldest = {(p, x): float(age) for p, x, age in facts.oldest_open}
        yield self._pair_family(
            GaugeMetricFamily(
                "ledgerflow_open_operation_oldest_seconds",
                "Age of the oldest open operation (database clock); 0 when none is open.",
                labels=pe,
            ),
            pairs,
            oldest,
        )
        attempts = {(p, x): float(n) for p, x, n in facts.attempts}
        yield self._pair_family(
            CounterMetricFamily(
                "ledgerflow_attempts", "Operations started: INTENTs with an OperationKey.", labels=pe
            ),
            pairs,
            attempts,
        )
        failures = CounterMetricFamily(
            "ledgerflow_failures", "Failed attempts by failure kind.", labels=[*pe, "kind"]
        )
        failed = {(r.project, r.executor, r.kind): float(r.failures) for r in facts.failures}
        kinds = sorted({*(k.value for k in FailureKind), *(r.kind for r in facts.failures)})
        for project, executor in pairs:
            for kind in kinds:
                failures.add_metric([project, executor, kind], failed.get((project, executor, kind), 0.0))
        yield failures

        tasks = {p: (n, age) for p, n, age in facts.unfinished}
        unfinished = GaugeMetricFamily(
            "ledgerflow_tasks_unfinished",
            "Tasks without a Complete INTENT or a terminal Escalation.",
            labels=["project"],
        )
        idle = GaugeMetricFamily(
            "ledgerflow_task_no_progress_seconds",
            "The longest time an unfinished task not waiting on a person has recorded nothing (database "
            "clock); 0 when there is none.",
            labels=["project"],
        )
        for project in projects:
            n, age = tasks.get(project, (0, 0.0))
            unfinished.add_metric([project], float(n))
            idle.add_metric([project], float(age))
        yield unfinished
        yield idle

    def _billing(
        self, counts: reconciliation.Counts, money_on_lines: list[tuple[str, str, Decimal]]
    ) -> Iterator[Metric]:
        """The scheduled billing reconciliation's record (ledger.reconciliation): lines it could not match
        and credits, each counted once however many runs saw it, and when it last ran."""
        families = {
            "unknown_charge": CounterMetricFamily(
                "ledgerflow_billing_unknown_charges",
                "Vendor charges no operation of the ledger knows, by the route whose account listed them.",
                labels=["route"],
            ),
            "ambiguous_charge": CounterMetricFamily(
                "ledgerflow_billing_ambiguous_charges",
                "Vendor charges two operations claim, by the route whose account listed them.",
                labels=["route"],
            ),
            "credit": CounterMetricFamily(
                "ledgerflow_billing_credits", "Credits and refunds the vendors listed.", labels=["route"]
            ),
        }
        found = {(kind, route): float(n) for kind, route, n in counts.by_kind}
        unmatched = {(route, kind): float(amount) for route, kind, amount in money_on_lines}
        routes = sorted({*self._known, *(r for _, r, _ in counts.by_kind), *(r for r, _ in unmatched)})
        for kind, family in families.items():
            for route in routes:
                family.add_metric([route], found.get((kind, route), 0.0))
        yield from families.values()
        money = CounterMetricFamily(
            "ledgerflow_billing_unmatched_amount",
            "Money on vendor charge lines the ledger cannot match to exactly one operation, by the route "
            "whose account listed them and the finding's kind (unknown_charge, ambiguous_charge).",
            labels=["route", "kind"],
        )
        for route in routes:
            for kind in ("ambiguous_charge", "unknown_charge"):
                money.add_metric([route, kind], unmatched.get((route, kind), 0.0))
        yield money
        yield GaugeMetricFamily(
            "ledgerflow_billing_reconciled_at",
            "When the billing reconciliation last ran (unix time); 0: never.",
            value=counts.last_run.timestamp() if counts.last_run is not None else 0.0,
        )

    def _routes(self, facts: reports.Facts, counts: reconciliation.Counts) -> Iterator[Metric]:
        """Each route's shared breaker (rules.routing): 1 on its current state's series, 0 on the others.
        A route of the route file with no row yet has never failed a call: closed."""
        breaker = GaugeMetricFamily(
            "ledgerflow_route_breaker",
            "A route's circuit breaker: 1 for its current state.",
            labels=["route", "state"],
        )
        qualified = GaugeMetricFamily(
            "ledgerflow_route_qualified_at",
            "When a fallback route last passed its regression set (unix time); 0: never.",
            labels=["route"],
        )
        usable = GaugeMetricFamily(
            "ledgerflow_route_fallback_qualified",
            "1 if a fallback route's qualification is younger than its qualification_max_age, else 0.",
            labels=["route"],
        )
        rows = {r.route: (r.state, r.qualified_at) for r in facts.route_breakers}
        now = time.time()
        for route in sorted({*self._known, *rows}):
            state, at = rows.get(route, ("closed", None))
            for s in ("closed", "open", "half_open"):
                breaker.add_metric([route, s], 1.0 if s == state else 0.0)
            stamp = at.timestamp() if at is not None else 0.0
            qualified.add_metric([route], stamp)
            max_age = self._known.get(route)
            if max_age is not None:
                usable.add_metric([route], 1.0 if at is not None and now - stamp <= max_age else 0.0)
        yield breaker
        yield qualified
        yield usable

    def _people(self, facts: reports.Facts, projects: list[str]) -> Iterator[Metric]:
        pk = ["project", "kind"]
        kinds = [k.value for k in RequestKind]
        # A queue that empties shows 0, not a gap.
        depth: dict[tuple[str, str], float] = {(p, k): 0.0 for p in projects for k in kinds}
        oldest_of: dict[tuple[str, str], float] = dict.fromkeys(depth, 0.0)
        for project, kind, n, age in facts.open_requests:
            depth[(project, kind)] = float(n)
            oldest_of[(project, kind)] = float(age)
        queue = GaugeMetricFamily("ledgerflow_human_queue_depth", "Open requests to people.", labels=pk)
        oldest = GaugeMetricFamily(
            "ledgerflow_human_oldest_wait_seconds",
            "Age of the oldest open request to a person; 0 when none is open.",
            labels=pk,
        )
        dead = GaugeMetricFamily(
            "ledgerflow_dead_letters_open", "Open dead-letter requests.", labels=["project"]
        )
        for (project, kind), depth_n in sorted(depth.items()):
            queue.add_metric([project, kind], depth_n)
            oldest.add_metric([project, kind], oldest_of[(project, kind)])
            if kind == RequestKind.DEAD_LETTER:
                dead.add_metric([project], depth_n)
        yield queue
        yield dead
        yield oldest
        waits = SummaryMetricFamily(
            "ledgerflow_human_wait_seconds", "How long decided requests waited for a person.", labels=pk
        )
        decided = {(p, k): (int(n), float(s)) for p, k, n, s in facts.decided_waits}
        for key in sorted({*depth, *decided}):
            n, seconds = decided.get(key, (0, 0.0))
            waits.add_metric(list(key), count_value=n, sum_value=seconds)
        yield waits

    def _quality(self, facts: reports.Facts, projects: list[str]) -> Iterator[Metric]:
        first = CounterMetricFamily(
            "ledgerflow_first_reviews",
            "Tasks by the verdict of their first review.",
            labels=["project", "verdict"],
        )
        reviewed = {(p, v): n for p, v, n in facts.first_reviews}
        verdicts = sorted({*(v.value for v in Verdict), *(v for _, v, _ in facts.first_reviews)})
        passed: dict[str, list[int]] = {}
        for project in sorted({*projects, *(p for p, _ in reviewed)}):
            for verdict in verdicts:
                n = reviewed.get((project, verdict), 0)
                first.add_metric([project, verdict], float(n))
                if n:
                    counts = passed.setdefault(project, [0, 0])
                    counts[0] += n if verdict in PASSING_VERDICTS else 0
                    counts[1] += n
        yield first
        ratio = GaugeMetricFamily(
            "ledgerflow_review_first_pass_ratio",
            "Share of reviewed tasks whose first review passed (Pass or SoftWarning).",
            labels=["project"],
        )
        for project, (ok, total) in sorted(passed.items()):
            ratio.add_metric([project], ok / total)
        yield ratio
        seconds = CounterMetricFamily(
            "ledgerflow_usable_output_seconds",
            "Seconds of output delivered by completed tasks (their composed episodes).",
            labels=["project"],
        )
        per_second = GaugeMetricFamily(
            "ledgerflow_cost_per_usable_second",
            "Completed tasks' whole spend per second of output they delivered.",
            labels=["project"],
        )
        delivered = {project: (duration, spent) for project, duration, spent in facts.usable_output}
        for project in sorted({*projects, *delivered}):
            duration, spent = delivered.get(project, (0.0, Decimal(0)))
            seconds.add_metric([project], float(duration))
            if duration:
                per_second.add_metric([project], float(spent) / duration)
        yield seconds
        yield per_second


class LocalCollector(Collector):
    """What is this process's own: whether it exports the ledger's families (exactly one process should)."""

    def __init__(self, exports_ledger: bool) -> None:
        self._exports = exports_ledger

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "ledgerflow_metrics_ledger_exporter",
            "1 if this process exports the ledger's metrics (LEDGERFLOW_METRICS_LEDGER), else 0.",
            value=1.0 if self._exports else 0.0,
        )


# The scans that run themselves (ledgerflow schedules): when each last succeeded, read from Temporal by a
# function the worker gives (``ledgerflow.views.schedules.last_success`` on its queue; runtime sits below it).
ScanReader = Callable[[], Awaitable[Mapping[str, datetime | None]]]


class ScanCollector(Collector):
    """``ledgerflow_scan_last_success_timestamp_seconds{scan}``: when each scheduled scan last completed (0:
    never). Read from Temporal on the worker's event loop at scrape time; left out of that scrape if Temporal
    does not answer in time."""

    def __init__(self, read: ScanReader, loop: asyncio.AbstractEventLoop) -> None:
        self._read = read
        self._loop = loop

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "ledgerflow_scan_last_success_timestamp_seconds",
            "When each scheduled scan (ledgerflow schedules) last completed, unix seconds (0: never).",
            labels=["scan"],
        )
        try:
            future = asyncio.run_coroutine_threadsafe(_awaited(self._read), self._loop)
            found = future.result(HEALTH_TIMEOUT_S)
        except Exception as e:  # a timeout, a closed loop, Temporal's refusal: a scrape never fails on it
            log.warning("the scans' last successes are unavailable: %s", one_line(e))
            return
        for scan, at in sorted(found.items()):
            family.add_metric([scan], at.timestamp() if at is not None else 0.0)
        yield family


async def _awaited(read: ScanReader) -> Mapping[str, datetime | None]:
    return await read()


# ── health ───────────────────────────────────────────────────────────────────────────────────────────────
class Readiness:
    """Readiness: Temporal's frontend answers its health check and the ledger answers ``SELECT 1``.

    ``check`` is called from the server's thread; the Temporal call runs on the worker's event loop (the
    client belongs to it), so a loop too busy to answer within the timeout is reported too.
    """

    def __init__(self, client: Client, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        self._client = client
        self._engine = engine
        self._loop = loop

    def check(self) -> str | None:
        """None when ready, else a one-line reason."""
        call = self._client.service_client.check_health(timeout=timedelta(seconds=HEALTH_TIMEOUT_S))
        try:
            future = asyncio.run_coroutine_threadsafe(call, self._loop)
        except RuntimeError:  # the worker's loop has closed
            call.close()
            return "temporal: the worker's event loop is not running"
        try:
            if not future.result(timeout=HEALTH_TIMEOUT_S + 0.5):
                return "temporal: the workflow service is not serving"
        except FutureTimeout:
            future.cancel()
            return f"temporal: no answer within {HEALTH_TIMEOUT_S:g} s"
        except Exception as e:  # any failure to reach Temporal means not ready; its text says why
            return f"temporal: {one_line(e)}"
        try:
            with self._engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except SQLAlchemyError as e:
            return f"ledger: {one_line(e)}"
        return None


def one_line(e: BaseException) -> str:
    """An error as one short line (a driver's message can span several)."""
    first = (str(getattr(e, "orig", None) or e) or type(e).__name__).strip().splitlines()
    return (first[0] if first else type(e).__name__)[:300]


# ── the server ───────────────────────────────────────────────────────────────────────────────────────────
class MetricsServer(ThreadingHTTPServer):
    """A small threaded HTTP server for ``/metrics`` and ``/healthz``, run on a thread of its own: stdlib
    only, so it never touches the worker's signal handlers, and its SQL never blocks the worker's loop."""

    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], registry: CollectorRegistry, health: Readiness, sdk_url: str | None
    ) -> None:
        super().__init__(address, _Handler)
        self.registry = registry
        self.health = health
        self.sdk_url = sdk_url

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def metrics(self) -> bytes:
        """The ledger's metrics, then the SDK's exporter's text as it is (its names are temporal_…)."""
        body = generate_latest(self.registry)
        if self.sdk_url is not None:
            try:
                with urllib.request.urlopen(self.sdk_url, timeout=HEALTH_TIMEOUT_S) as r:
                    body += r.read()
            except OSError as e:
                log.warning("the SDK's metrics are unavailable at %s: %s", self.sdk_url, one_line(e))
        return body


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, CONTENT_TYPE_PLAIN_0_0_4, self.server.metrics())
        elif path == "/healthz":
            reason = self.server.health.check()
            doc = {"status": "ok"} if reason is None else {"status": "unavailable", "reason": reason}
            self._send(200 if reason is None else 503, "application/json", json.dumps(doc).encode() + b"\n")
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found: /metrics or /healthz\n")

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not worth a log line


@contextmanager
def serve_metrics(
    settings: MetricsSettings,
    database_url: str,
    client: Client,
    loop: asyncio.AbstractEventLoop,
    *,
    sdk: bool,
    routes: Routes | None = None,
    scans: ScanReader | None = None,
    queues: tuple[str, ...] = (),
) -> Iterator[MetricsServer]:
    """Serve /metrics and /healthz on ``settings.metrics_port`` until the block exits.

    ``sdk``: ``client`` was connected with ``sdk_runtime(settings)``'s runtime, whose metrics /metrics then
    relays (without it, /metrics carries the ledger's metrics only). ``routes``: the route file's routes
    (``known_routes(table)``), exported at 0 before the ledger names them. The ledger's families are
    served only when ``settings.metrics_ledger`` (one exporter per deployment);
    ``ledgerflow_metrics_ledger_exporter`` always says which. ``scans``: when each scheduled scan last
    succeeded (the exporter serves it, with the ledger's families). ``queues``: task queues whose admission
    families are exported at 0 while nothing waits (the worker's own). ConfigError (one line) if the port is
    taken.
    """
    if settings.metrics_port is None:
        raise ValueError("serve_metrics needs LEDGERFLOW_METRICS_PORT")
    engine = ledger_engine(database_url)
    registry = CollectorRegistry(auto_describe=False)  # no query when registering: only when scraped
    registry.register(LocalCollector(settings.metrics_ledger))
    if settings.metrics_ledger:
        registry.register(LedgerCollector(engine, routes, queues))
        if scans is not None:
            registry.register(ScanCollector(scans, loop))
    sdk_url = f"http://127.0.0.1:{settings.sdk_port()}/metrics" if sdk else None
    address = (settings.metrics_host, settings.metrics_port)
    try:
        server = MetricsServer(address, registry, Readiness(client, engine, loop), sdk_url)
    except OSError as e:
        engine.dispose()
        raise ConfigError(f"LEDGERFLOW_METRICS_PORT {settings.metrics_port}: {e.strerror or e}") from None
    thread = threading.Thread(target=server.serve_forever, name="ledgerflow-metrics", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
        engine.dispose()
