"""Reports: facts re-derived from the whole ledger by aggregate queries, for the worker's ``/metrics``.

``facts`` runs every query in one read-only snapshot and returns plain rows; what they become as metrics
(names, labels, ratios) is ``runtime.metrics``'s business. Each query groups in SQL: it returns rows per
project, executor and kind, never per event. It still reads the ledger's result, marker and INTENT rows,
so its cost grows with the ledger: its caller bounds it with a statement timeout.

A task's project is its plan's (``TaskCreated``, seq 1). An operation's executor is its INTENT's: a
Dispatch's ``executor``, ``gate`` for a static gate, and ``planner`` for the LLM planner's calls (which have
no INTENT). Money is in the plan's currency units.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any, Final, NamedTuple, TypeVar

from sqlalchemy import Connection, Engine, text

from ledger.pgerrors import translated
from rules.keys import resolution_key, result_key
from rules.scopes import PROJECT_PREFIX, TASK_PREFIX


class Spend(NamedTuple):
    """Every recorded cost: Outcome, Failure and ExecutionResult ``actual_cost``, Decision ``cost``,
    ``late_charge`` markers' ``amount`` (what the budget accounts' ``spent`` sums)."""

    project: str
    executor: str
    cost: Decimal


class OpenOperations(NamedTuple):
    """INTENTs of an operation (a Dispatch or static gate) with no result yet, and what they reserved."""

    project: str
    executor: str
    operations: int
    reserved: Decimal


class Failures(NamedTuple):
    """Failure events by kind: each is an attempt that failed."""

    project: str
    executor: str
    kind: str
    failures: int


class Anomalies(NamedTuple):
    """``cost_anomaly`` markers."""

    project: str
    executor: str
    anomalies: int


class OpenRequests(NamedTuple):
    """Open requests to people (in tasks not ended), and the age of the oldest (database clock)."""

    project: str
    kind: str
    requests: int
    oldest_s: float


class DecidedWaits(NamedTuple):
    """Decided requests, and their waits summed: each HumanDecision's time minus its request's."""

    project: str
    kind: str
    decided: int
    waited_s: float


class FirstReviews(NamedTuple):
    """Tasks by the verdict of their first review."""

    project: str
    verdict: str
    tasks: int


class UsableOutput(NamedTuple):
    """Completed tasks' delivered seconds (their last ``compose`` Outcome's ``duration_s``) and their whole
    spend (their ``task:`` budget accounts: retries, reworks and review included)."""

    project: str
    seconds: float
    spent: Decimal


class RouteBreaker(NamedTuple):
    """A route's shared breaker (rules.routing): its state, and when it last qualified as a fallback."""

    route: str
    state: str
    qualified_at: datetime | None


@dataclass(frozen=True, slots=True)
class Facts:
    """Every report, read from one snapshot of the ledger (so they agree with each other)."""

    spend: list[Spend]
    open_operations: list[OpenOperations]
    failures: list[Failures]
    anomalies: list[Anomalies]
    projects: list[str]  # every project with a budget account
    open_requests: list[OpenRequests]
    decided_waits: list[DecidedWaits]
    first_reviews: list[FirstReviews]
    usable_output: list[UsableOutput]
    route_breakers: list[RouteBreaker]
    attempts: list[tuple[str, str, int]]  # (project, executor, INTENTs of operations)
    oldest_open: list[tuple[str, str, float]]  # (project, executor, age of the oldest open operation, s)
    unfinished: list[tuple[str, int, float]]  # (project, unfinished tasks, the longest no-progress age, s)
    over_ceiling: list[
        tuple[str, int, Decimal]
    ]  # (scope kind, accounts spent past their ceiling, by how much)
    unmatched: list[tuple[str, str, Decimal]]  # (route, kind, money on unknown or ambiguous charge lines)
    # (task queue, tasks waiting for admission, tasks admitted, the oldest wait in s): ledger.admission
    admission: list[tuple[str, int, int, float]] = field(default_factory=list)


# Shared pieces. The project join is a primary-key lookup per group (TaskCreated is every task's seq 1);
# rows of a task without one (not written by a workflow) are left out. The executor join goes through
# ix_events_operation_key.
_PROJECT: Final = """
    JOIN events c ON c.task_id = g.task_id AND c.seq = 1 AND c.type = 'TaskCreated'"""
_EXECUTOR: Final = """
    LEFT JOIN LATERAL (
        SELECT CASE i.payload->'action'->>'kind' WHEN 'StaticGate' THEN 'gate'
                    ELSE i.payload->'action'->>'executor' END AS executor
        FROM events i WHERE i.operation_key = g.operation_key AND i.type = 'Intent' LIMIT 1
    ) x ON true"""
_BY_PROJECT_EXECUTOR: Final = (
    "SELECT c.payload->'plan'->>'project' AS project, COALESCE(x.executor, 'planner') AS executor"
)

# Grouped by operation first, so each executor lookup happens once per operation, not once per event.
_SPEND: Final = f"""
WITH g AS (
    SELECT task_id, operation_key,
           sum(CASE type WHEN 'Decision' THEN (payload->>'cost')::numeric
                         WHEN 'SystemMarker' THEN (payload->>'amount')::numeric
                         ELSE (payload->>'actual_cost')::numeric END) AS cost
    FROM events
    WHERE type IN ('Outcome', 'Failure', 'ExecutionResult', 'Decision')
       OR (type = 'SystemMarker' AND payload->>'kind' = 'late_charge')
    GROUP BY task_id, operation_key
)
{_BY_PROJECT_EXECUTOR}, COALESCE(sum(g.cost), 0) FROM g {_PROJECT} {_EXECUTOR}
GROUP BY 1, 2"""

_FAILURES: Final = f"""
WITH g AS (
    SELECT task_id, operation_key, payload->>'kind' AS kind, count(*) AS n
    FROM events WHERE type = 'Failure' GROUP BY task_id, operation_key, kind
)
{_BY_PROJECT_EXECUTOR}, g.kind, sum(g.n)::bigint FROM g {_PROJECT} {_EXECUTOR}
GROUP BY 1, 2, 3"""

_ANOMALIES: Final = f"""
WITH g AS (
    SELECT task_id, operation_key, count(*) AS n
    FROM events WHERE type = 'SystemMarker' AND payload->>'kind' = 'cost_anomaly'
    GROUP BY task_id, operation_key
)
{_BY_PROJECT_EXECUTOR}, sum(g.n)::bigint FROM g {_PROJECT} {_EXECUTOR}
GROUP BY 1, 2"""

_ROUTE_BREAKERS: Final = "SELECT route, state, qualified_at FROM route_breakers ORDER BY route"

# An operation is open from its INTENT until its one result (Outcome, Failure, ExecutionResult or void) is
# written under the unique dedup key ``{op}:result``: an index lookup per INTENT.
_OPEN_OPERATIONS: Final = f"""
WITH g AS (
    SELECT DISTINCT ON (i.operation_key) i.task_id, i.operation_key,
           COALESCE((i.payload->>'reservation')::numeric, 0) AS reservation
    FROM events i
    WHERE i.type = 'Intent' AND i.operation_key IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM events r WHERE r.dedup_key = i.operation_key || :result_suffix)
)
{_BY_PROJECT_EXECUTOR}, count(*), sum(g.reservation) FROM g {_PROJECT} {_EXECUTOR}
GROUP BY 1, 2"""

# A request's one resolution (a person's decision or the timeout marker) has the unique dedup key
# ``{task}:resolution:{request}`` (rules.keys.resolution_key). A request left open in a task that ended is
# in no queue (ledgerflow.views.queue.open_items), so the end is checked on the task's own rows.
_REQUESTS: Final = """
WITH requests AS (
    SELECT i.task_id, i.recorded_at, i.payload->'action'->'request'->>'kind' AS kind,
           i.task_id || :resolution_infix || (i.payload->'action'->'request'->>'id') AS resolution_key
    FROM events i
    WHERE i.type = 'Intent' AND i.payload->'action'->>'kind' IN ('SuspendForHuman', 'Escalate')
      AND jsonb_typeof(i.payload->'action'->'request') = 'object'
)"""

_OPEN_REQUESTS: Final = f"""{_REQUESTS}
SELECT c.payload->'plan'->>'project', g.kind, count(*),
       max(extract(epoch FROM now() - g.recorded_at))::float8
FROM requests g {_PROJECT}
WHERE NOT EXISTS (SELECT 1 FROM events d WHERE d.dedup_key = g.resolution_key)
  AND NOT EXISTS (
      SELECT 1 FROM events t
      WHERE t.task_id = g.task_id
        AND ((t.type = 'Intent' AND t.payload->'action'->>'kind' = 'Complete')
             OR (t.type = 'Escalation' AND t.payload->>'terminal' = 'true')))
GROUP BY 1, 2"""

_DECIDED_WAITS: Final = f"""{_REQUESTS}
SELECT c.payload->'plan'->>'project', g.kind, count(*),
       sum(extract(epoch FROM d.recorded_at - g.recorded_at))::float8
FROM requests g JOIN events d ON d.dedup_key = g.resolution_key AND d.type = 'HumanDecision' {_PROJECT}
GROUP BY 1, 2"""

_PROJECT_SCOPES: Final = "SELECT scope FROM budget_accounts WHERE starts_with(scope, :project_prefix)"

_FIRST_REVIEWS: Final = f"""
WITH g AS (
    SELECT DISTINCT ON (task_id) task_id, payload->>'verdict' AS verdict
    FROM events
    WHERE type = 'ExecutionResult' AND payload->>'kind' = 'review' AND payload->>'verdict' IS NOT NULL
    ORDER BY task_id, seq
)
SELECT c.payload->'plan'->>'project', g.verdict, count(*) FROM g {_PROJECT}
GROUP BY 1, 2"""

_USABLE_OUTPUT: Final = f"""
WITH g AS (
    SELECT DISTINCT task_id FROM events
    WHERE type = 'Intent' AND payload->'action'->>'kind' = 'Complete'
)
SELECT c.payload->'plan'->>'project', sum(o.duration), sum(a.spent)
FROM g {_PROJECT}
JOIN LATERAL (
    SELECT (e.payload->'artifact'->'media'->>'duration_s')::float8 AS duration
    FROM events e WHERE e.task_id = g.task_id AND e.type = 'Outcome' AND e.payload->>'node' = 'compose'
    ORDER BY e.seq DESC LIMIT 1
) o ON o.duration > 0
JOIN budget_accounts a ON a.scope = :task_prefix || g.task_id
GROUP BY 1"""

# The names the queries look rows up by, built where every name is built: dedup keys by rules.keys, budget
# scopes by rules.scopes.
# The metrics' families beyond the reports above (runtime.metrics), read by the same rules.
_ATTEMPTS: Final = f"""
WITH g AS (
    SELECT task_id, operation_key, count(*) AS n
    FROM events WHERE type = 'Intent' AND operation_key IS NOT NULL GROUP BY task_id, operation_key
)
{_BY_PROJECT_EXECUTOR}, sum(g.n)::bigint FROM g {_PROJECT} {_EXECUTOR}
GROUP BY 1, 2"""

_OLDEST_OPEN: Final = f"""
WITH g AS (
    SELECT DISTINCT ON (i.operation_key) i.task_id, i.operation_key, i.recorded_at
    FROM events i
    WHERE i.type = 'Intent' AND i.operation_key IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM events r WHERE r.dedup_key = i.operation_key || :result_suffix)
    ORDER BY i.operation_key, i.seq
)
{_BY_PROJECT_EXECUTOR}, max(extract(epoch FROM now() - g.recorded_at))::float8
FROM g {_PROJECT} {_EXECUTOR}
GROUP BY 1, 2"""

# A task is unfinished until a Complete INTENT or a terminal Escalation (as for the human queue). Its progress
# is its newest event; it is expected to be quiet while it waits on a person (a row in ``human_queue``) or on
# an operation in flight (an INTENT without its result: ``ledgerflow_open_operation_oldest_seconds`` watches
# those), so only the others count for the no-progress age.
_TASKS: Final = f"""
WITH g AS (
    SELECT e.task_id, max(e.recorded_at) AS last FROM events e
    GROUP BY e.task_id
    HAVING NOT bool_or((e.type = 'Intent' AND e.payload->'action'->>'kind' = 'Complete')
                       OR (e.type = 'Escalation' AND e.payload->>'terminal' = 'true'))
)
SELECT c.payload->'plan'->>'project', count(*),
       COALESCE(max(extract(epoch FROM now() - g.last)) FILTER (
           WHERE NOT EXISTS (SELECT 1 FROM human_queue q WHERE q.task_id = g.task_id)
             AND NOT EXISTS (
                 SELECT 1 FROM events i
                 WHERE i.task_id = g.task_id AND i.type = 'Intent' AND i.operation_key IS NOT NULL
                   AND NOT EXISTS (SELECT 1 FROM events r
                                   WHERE r.dedup_key = i.operation_key || :result_suffix))),
           0)::float8
FROM g {_PROJECT}
GROUP BY 1"""

_BUDGETS: Final = """
SELECT split_part(scope, ':', 1), count(*) FILTER (WHERE spent > ceiling),
       COALESCE(sum(spent - ceiling) FILTER (WHERE spent > ceiling), 0)
FROM budget_accounts GROUP BY 1"""

_UNMATCHED: Final = r"""
SELECT COALESCE(route, ''), kind, COALESCE(sum(abs(amount::numeric)), 0)
FROM billing_reconciliation
WHERE kind IN ('unknown_charge', 'ambiguous_charge') AND amount ~ '^-?[0-9]+(\.[0-9]+)?$'
GROUP BY 1, 2"""

_ADMISSION: Final = """
SELECT queue, count(*) FILTER (WHERE admitted_at IS NULL), count(admitted_at),
       COALESCE(max(extract(epoch FROM now() - asked_at)) FILTER (WHERE admitted_at IS NULL), 0)::float8
FROM task_admission GROUP BY 1"""


_NAMES: Final = {
    "result_suffix": result_key(""),
    "resolution_infix": resolution_key("", ""),
    "project_prefix": PROJECT_PREFIX,
    "task_prefix": TASK_PREFIX,
}

_Row = TypeVar("_Row")


def facts(engine: Engine) -> Facts:
    """Every report, from one read-only snapshot of the ledger.

    Raises:
        LedgerUnavailable: the database could not be reached, or a query ran past the statement timeout.
        LedgerError: any other database error.
    """
    with translated(), engine.connect() as conn:
        # REPEATABLE READ: one snapshot for every query, so the numbers agree with each other; read-only:
        # nothing here may ever write to the ledger.
        conn = conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
        return Facts(
            spend=_rows(conn, _SPEND, Spend),
            open_operations=_rows(conn, _OPEN_OPERATIONS, OpenOperations),
            failures=_rows(conn, _FAILURES, Failures),
            anomalies=_rows(conn, _ANOMALIES, Anomalies),
            projects=[
                scope.removeprefix(PROJECT_PREFIX)
                for scope in conn.execute(text(_PROJECT_SCOPES), _NAMES).scalars()
            ],
            open_requests=_rows(conn, _OPEN_REQUESTS, OpenRequests),
            decided_waits=_rows(conn, _DECIDED_WAITS, DecidedWaits),
            first_reviews=_rows(conn, _FIRST_REVIEWS, FirstReviews),
            usable_output=_rows(conn, _USABLE_OUTPUT, UsableOutput),
            route_breakers=_rows(conn, _ROUTE_BREAKERS, RouteBreaker),
            attempts=_tuples(conn, _ATTEMPTS),
            oldest_open=_tuples(conn, _OLDEST_OPEN),
            unfinished=_tuples(conn, _TASKS),
            over_ceiling=_tuples(conn, _BUDGETS),
            unmatched=_tuples(conn, _UNMATCHED),
            admission=_tuples(conn, _ADMISSION),
        )


def _rows(conn: Connection, sql: str, row: Callable[..., _Row]) -> list[_Row]:
    return [row(*r) for r in conn.execute(text(sql), _NAMES)]


def _tuples(conn: Connection, sql: str) -> list[Any]:
    return [tuple(r) for r in conn.execute(text(sql), _NAMES)]
