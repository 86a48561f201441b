"""Vendor routes, shared by every worker and task: pauses, circuit breakers, observations, quota slots.

A route's state lives in its own tables (``route_events``, ``route_breakers``, ``route_observations``,
``route_slots``, ``route_waiters``, ``route_changes``), decided by ``rules.routing``. A routed dispatch's
INTENT chooses its route inside the recorder's fenced append: the fencing statement also reads the routes'
rows (``ROUTED_EXTRAS``), and ``routed`` claims a probe or canary and takes a quota slot on that append's
connection, so the INTENT and its route's change commit together or not at all. The operation's result gives
its slot back the same way (``free_slot``). ``RouteStore`` is the part of the recorder that pauses and
resumes routes, records observations and qualifications, and reads route health.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import (
    Connection,
    Engine,
    Text,
    and_,
    any_,
    bindparam,
    case,
    delete,
    func,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, distinct_on
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ledger.errors import RouteContended, RouteWaiting
from ledger.pgerrors import translated
from ledger.schema import (
    events,
    route_breakers,
    route_changes,
    route_events,
    route_observations,
    route_slots,
    route_waiters,
)
from rules.envelope import NewEvent
from rules.keys import key_fraction
from rules.operation import SEND_AHEAD
from rules.routing import (
    FAILURES,
    BreakerPolicy,
    BreakerState,
    Candidate,
    Observation,
    RouteHealth,
    Waiter,
    Window,
    choose,
    claimed,
    grant,
    observed,
)


@dataclass(frozen=True, slots=True)
class RouteState:
    """A route's latest event: ``paused`` True until a person resumes it."""

    route: str
    paused: bool
    reason: str
    actor: str
    at: datetime


@dataclass(frozen=True)
class Routing:
    """What a routed dispatch's INTENT asks of ``append_fenced``: the executor, its routes (primary first),
    the operation's key (a probe's or canary's claim names it) and, for routes with a concurrency quota,
    ``(route, limit, aging_s)`` with the dispatch's place in their queues (priority, deadline), and for
    routes with a monthly spend cap, ``(route, cap)`` (``ledger.accounts.hold_route``). ``ahead`` names the
    routes whose INTENT is also the write-ahead of the operation's first send, ``(route, window_s)``: where
    the vendor deduplicates on our key and finds a job by it (``activities.stages``), so the INTENT, not a
    ``submitting`` marker of its own, says from when, and until when, the first send may create a job."""

    executor: str
    chain: tuple[Candidate, ...]
    key: str
    task_id: str = ""
    quotas: tuple[tuple[str, int, float], ...] = ()
    priority: str = "standard"
    deadline: datetime | None = None
    caps: tuple[tuple[str, Decimal], ...] = ()
    ahead: tuple[tuple[str, float], ...] = ()


# A waiter not seen again for this long (its task ended, its worker died) no longer holds its place.
WAITER_STALE: Final = timedelta(seconds=30)

ROUTE_STATE: Final = (
    select(route_events.c.kind, route_events.c.reason, route_events.c.actor, route_events.c.recorded_at)
    .where(route_events.c.route == bindparam("b_route"))
    .order_by(route_events.c.id.desc())
    .limit(1)
)
_ROUTE_STATES: Final = (
    select(
        route_events.c.route,
        route_events.c.kind,
        route_events.c.reason,
        route_events.c.actor,
        route_events.c.recorded_at,
    )
    .ext(distinct_on(route_events.c.route))
    .order_by(route_events.c.route, route_events.c.id.desc())
)
# One event per change of state: many workers meeting the same rotated key record one pause, not hundreds.
# The advisory lock serialises the check and the insert for one route: two pausers never both insert.
_ROUTE_LOCK: Final = text("SELECT pg_advisory_xact_lock(hashtext('route:' || :route))")

# A routed dispatch's INTENT (rules.routing) reads every route of its executor in the same statement that
# fences it: the rows as JSON, and the database's clock the choice is made at.
_rb = route_breakers.alias("rb")
_BREAKERS_OF: Final = (
    select(func.coalesce(func.json_agg(func.row_to_json(_rb.table_valued())), text("'[]'::json")))
    .where(_rb.c.route == any_(bindparam("b_routes", type_=ARRAY(Text))))
    .scalar_subquery()
)
# … and whether the INTENT is already written (a retry of its executor): then nothing is chosen, claimed or
# queued again — a retry must not count its own quota slot, nor claim a canary it cannot keep.
_WRITTEN_ALREADY: Final = (
    select(events.c.seq).where(events.c.dedup_key == bindparam("b_intent_key")).scalar_subquery()
)
# What the fencing statement returns besides the seq, always last (the recorder reads them as ``fence[-3:]``).
ROUTED_EXTRAS: Final = (_WRITTEN_ALREADY, _BREAKERS_OF, func.clock_timestamp())

BREAKER_ROW: Final = (
    select(func.row_to_json(_rb.table_valued())).where(_rb.c.route == bindparam("b_route")).scalar_subquery()
)
_seen = route_observations.alias("seen")
# Whether the observed key's task (the key's part before its first ':') already has an ``anomaly`` on the
# route within the breaker's call window: one task's overbilled fan-out counts as one failed call per window.
_TASK_ANOMALY_COUNTED: Final = (
    select(1)
    .where(
        _seen.c.route == bindparam("b_route"),
        _seen.c.kind == Observation.ANOMALY.value,
        func.split_part(_seen.c.operation_key, ":", 1) == func.split_part(bindparam("b_key"), ":", 1),
        _seen.c.recorded_at > func.clock_timestamp() - bindparam("b_window"),
    )
    .exists()
)
_ROUTE_TASK_LOCK: Final = text("SELECT pg_advisory_xact_lock(hashtext(:k))")
# An observation, and in the same statement the route's row, the clock and the kind recorded (most need
# nothing more). A task's repeated anomaly is recorded as ``ok``, in the insert itself (its task's lock,
# taken just before, orders two of them: no race remains).
_OBSERVE: Final = (
    route_observations.insert()
    .values(
        route=bindparam("b_route"),
        kind=case(
            (
                and_(bindparam("b_kind") == Observation.ANOMALY.value, _TASK_ANOMALY_COUNTED),
                Observation.OK.value,
            ),
            else_=bindparam("b_kind"),
        ),
        operation_key=bindparam("b_key"),
    )
    .returning(BREAKER_ROW, func.clock_timestamp(), route_observations.c.id, route_observations.c.kind)
)
# Observations older than any window of the route are never read again: every PRUNE_EVERY-th insert deletes
# the route's rows older than twice its widest window (at least RETAIN_OBSERVATIONS), by the route's index.
PRUNE_EVERY: Final = 500
RETAIN_OBSERVATIONS: Final = timedelta(hours=1)
_PRUNE_OBSERVATIONS: Final = delete(route_observations).where(
    route_observations.c.route == bindparam("b_route"),
    route_observations.c.recorded_at < bindparam("b_before"),
)


def _insert_observation(
    conn: Connection, route: str, what: Observation, key: str | None, policy: BreakerPolicy
) -> tuple[Any, datetime, Observation]:
    """One observation row (and, every PRUNE_EVERY-th, the prune of the route's rows no window reads any
    more); the route's breaker row as the insert read it, the database's clock, and the kind recorded (a
    task's anomaly already counted in the window is recorded as ok)."""
    params = {
        "b_route": route,
        "b_kind": what.value,
        "b_key": key,
        "b_window": timedelta(seconds=policy.window_s),
    }
    row, now, seq, kind = conn.execute(_OBSERVE, params).one()
    if seq % PRUNE_EVERY == 0:
        keep = max(RETAIN_OBSERVATIONS, 2 * timedelta(seconds=policy.widest_s))
        conn.execute(_PRUNE_OBSERVATIONS, {"b_route": route, "b_before": now - keep})
    return row, now, Observation(kind)


def observe_ok(conn: Connection, route: str, key: str, policy: BreakerPolicy) -> None:
    """An ``ok`` observation of ``route`` by operation ``key``, in the caller's transaction (the operation's
    result: one commit for both). What ``observe`` does for an ok that is no probe's or canary's: the insert
    alone; the caller checks that it is neither."""
    _insert_observation(conn, route, Observation.OK, key, policy)


_WINDOW: Final = text(
    "SELECT"
    " count(*) FILTER (WHERE kind IN ('ok', 'error', 'timeout', 'anomaly') AND recorded_at > :now - :calls),"
    " count(*) FILTER (WHERE kind IN ('error', 'timeout', 'anomaly') AND recorded_at > :now - :calls),"
    " count(*) FILTER (WHERE kind IN ('review_pass', 'review_fail')),"
    " count(*) FILTER (WHERE kind = 'review_pass')"
    " FROM route_observations WHERE route = :route AND recorded_at > :now - :widest"
)
_FREE_SLOT: Final = delete(route_slots).where(route_slots.c.operation_key == bindparam("b_key"))
_HEALTH_COLUMNS: Final = (
    "state",
    "since",
    "opened_at",
    "reason",
    "probe_key",
    "canary_key",
    "canary_outage",
    "canary_passed",
    "qualified_at",
    "version",
)


def health(route: str, row: Any) -> RouteHealth:
    """A ``route_breakers`` row (JSON from row_to_json, or a mapping) as rules.routing reads it."""
    if not row:
        return RouteHealth(route)
    return RouteHealth.from_basis(route, {k: row.get(k) for k in _HEALTH_COLUMNS})


def routed(conn: Connection, routing: Routing, intent: NewEvent, rows: Any, now: datetime) -> NewEvent:
    """The INTENT with its route chosen (and claimed) on the rows read by the fence, in its transaction.

    Raises:
        RouteWaiting: No route serves now.
        RouteContended: The chosen route's row changed since the fence read it.
        QueueFull: The chosen route's quota is full; the caller records the waiter after the rollback.
    """
    healths = {r["route"]: health(r["route"], r) for r in rows or []}
    choice = choose(routing.chain, healths, now, routing.key)
    if choice.route is None:
        raise RouteWaiting(routing.executor, choice.reason, choice.retry_s)
    if choice.claim is not None:
        primary = healths.get(routing.chain[0].route)
        before = healths.get(choice.route) or RouteHealth(choice.route)
        outage = primary.opened_at if primary is not None else None
        after = claimed(before, choice, routing.key, now, outage)
        if not _swap(conn, before, after):
            raise RouteContended(routing.executor, f"{choice.route} changed meanwhile", 0.1)
        if choice.claim == "probe":
            kind, reason = "half_opened", f"probe {routing.key} after {before.reason}"
        else:
            kind = "switched" if before.canary_outage != outage else "canary_claimed"
            reason = f"{routing.chain[0].route} → {choice.route}: {choice.reason}"
        _log_change(conn, choice.route, kind, reason, routing.key, {"executor": routing.executor})
    quota = next((q for q in routing.quotas if q[0] == choice.route), None)
    granted = _take_slot(conn, routing, quota, now) if quota is not None else None
    basis = {c.route: (healths.get(c.route) or RouteHealth(c.route)).as_basis() for c in routing.chain}
    payload = {
        **intent.payload,
        "route": choice.route,
        "route_claim": choice.claim,
        "route_reason": choice.reason,
        "route_basis": basis,
        "route_chain": [[c.route, c.open_for_s, c.max_age_s] for c in routing.chain],
        "route_at": now.isoformat(),
    }
    if granted is not None:
        payload["route_quota"] = granted
    if (window := dict(routing.ahead).get(choice.route)) is not None:
        payload[SEND_AHEAD] = window  # rules.operation: send 1, from the INTENT's time, for this long
    return intent.model_copy(update={"payload": payload})


def free_slot(conn: Connection, operation_key: str) -> None:
    """Give back the operation's route slot, if it holds one (its one result is being written on ``conn``)."""
    conn.execute(_FREE_SLOT, {"b_key": operation_key})


class QueueFull(RouteWaiting):
    """The chosen route's quota is full for this dispatch: its waiter row is written after the rollback."""

    def __init__(self, executor: str, reason: str, retry_s: float, waiter: dict[str, Any]) -> None:
        super().__init__(executor, reason, retry_s)
        self.waiter = waiter

    def __reduce__(self) -> tuple[Any, ...]:
        return (RouteWaiting, (self.executor, self.reason, self.retry_s))


def wait_in_line(engine: Engine, waiter: dict[str, Any]) -> None:
    """Record (or refresh) a dispatch's place in a full route's queue, in its own transaction: it outlives
    the INTENT's, which rolled back."""
    stmt = pg_insert(route_waiters).values(**waiter)
    # ON CONFLICT DO UPDATE: a dispatch asking again keeps its place in the queue (``since``); only the time
    # it was last seen moves.
    stmt = stmt.on_conflict_do_update(
        index_elements=[route_waiters.c.operation_key], set_={"seen_at": stmt.excluded.seen_at}
    )
    with engine.begin() as conn:
        conn.execute(stmt)
        conn.execute(
            delete(route_waiters).where(route_waiters.c.seen_at < waiter["seen_at"] - 10 * WAITER_STALE)
        )


def _swap(conn: Connection, before: RouteHealth, after: RouteHealth) -> bool:
    """Write ``after`` over the route's row if it is still ``before`` (its version); False if it moved."""
    values = {k: getattr(after, k) for k in _HEALTH_COLUMNS} | {"state": after.state.value}
    if before.version == 0:
        # ON CONFLICT DO NOTHING: another writer may insert the route's first row meanwhile; then the
        # versioned UPDATE below decides, and moves the row only if it is still at ``before``'s version.
        inserted = conn.execute(
            pg_insert(route_breakers)
            .values(route=after.route, **values)
            .on_conflict_do_nothing()
            .returning(route_breakers.c.route)
        ).first()
        if inserted is not None:
            return True
    done = conn.execute(
        update(route_breakers)
        .where(route_breakers.c.route == after.route, route_breakers.c.version == before.version)
        .values(**values)
    )
    return done.rowcount == 1


def _log_change(
    conn: Connection,
    route: str,
    kind: str,
    reason: str,
    key: str | None,
    detail: dict[str, Any] | None = None,
) -> None:
    conn.execute(
        route_changes.insert().values(
            route=route, kind=kind, reason=reason[:1000], operation_key=key, detail=detail
        )
    )


def _take_slot(
    conn: Connection, routing: Routing, quota: tuple[str, int, float], now: datetime
) -> dict[str, Any]:
    """A slot on a quota'd route for this dispatch, or QueueFull (the transaction rolls back; the caller
    records its place in the queue)."""
    route, limit, aging = quota
    # Grants on one route are serialized, so two dispatches never both count the same last free slot.
    conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:k))"), {"k": f"route-quota:{route}"})
    used = conn.execute(
        select(func.count()).select_from(route_slots).where(route_slots.c.route == route)
    ).scalar_one()
    rows = (
        conn.execute(
            select(route_waiters).where(
                route_waiters.c.route == route, route_waiters.c.seen_at > now - WAITER_STALE
            )
        )
        .mappings()
        .all()
    )
    waiters = [Waiter(r["operation_key"], r["priority"], r["deadline"], r["since"]) for r in rows]
    mine = next((w for w in waiters if w.key == routing.key), None)
    me = Waiter(routing.key, routing.priority, routing.deadline, mine.since if mine else now)
    g = grant(me, used, limit, waiters, now, aging)
    if not g.granted:
        waiter = {
            "operation_key": routing.key,
            "route": route,
            "task_id": routing.task_id,
            "priority": routing.priority,
            "deadline": routing.deadline,
            "since": me.since,
            "seen_at": now,
        }
        # Asked again soon, a little later the further back it stands (never all at once: a full route
        # must not turn its queue into a storm of retries).
        retry = min(10.0, 0.5 + 0.25 * g.ahead) * (1 + 0.5 * key_fraction(routing.key))
        raise QueueFull(routing.executor, f"{route}: {g.reason}", retry, waiter)
    conn.execute(route_slots.insert().values(operation_key=routing.key, route=route, task_id=routing.task_id))
    conn.execute(delete(route_waiters).where(route_waiters.c.operation_key == routing.key))
    assert me.since is not None  # its first ask, or now
    return {
        "used": g.used,
        "limit": g.limit,
        "ahead": g.ahead,
        "priority": routing.priority,
        "waited_s": (now - me.since).total_seconds(),
    }


class RouteStore:
    """The recorder's route methods: pauses, the shared breakers' observations and qualifications, reads."""

    _engine: Engine  # the Recorder's: one short transaction per write
    _reader: Engine  # the same pool in AUTOCOMMIT, for single-statement reads

    def pause_route(self, route: str, reason: str, actor: str) -> bool:
        """Pause ``route`` for every worker and task (no-op if already paused); True if this call did."""
        return self._route_event(route, "paused", reason, actor)

    def resume_route(self, route: str, actor: str, reason: str = "") -> bool:
        """Resume a paused route; True if it was paused."""
        return self._route_event(route, "resumed", reason, actor)

    def _route_event(self, route: str, kind: str, reason: str, actor: str) -> bool:
        with translated(), self._engine.begin() as conn:
            conn.execute(_ROUTE_LOCK, {"route": route})
            latest = conn.execute(ROUTE_STATE, {"b_route": route}).first()
            current = latest[0] if latest is not None else "resumed"
            if current == kind:
                return False
            row = {"route": route, "kind": kind, "reason": reason[:1000], "actor": actor[:200]}
            conn.execute(route_events.insert().values(**row))
        return True

    def route_states(self) -> dict[str, RouteState]:
        """Every route that was ever paused, with its current state."""
        with translated(), self._reader.connect() as conn:
            rows = conn.execute(_ROUTE_STATES).all()
        return {r[0]: RouteState(r[0], r[1] == "paused", r[2], r[3], r[4]) for r in rows}

    def observe(self, route: str, what: Observation, key: str | None, policy: BreakerPolicy) -> str | None:
        """Record what a call to ``route`` (or a first review of its output) told, and move its breaker if
        that calls for it (a failure rate reached, a probe's or canary's result); returns the change logged
        (``opened``, ``closed``, ``canary_passed`` …) or None. Most observations are one statement."""
        with translated(), self._engine.begin() as conn:
            return _observe(conn, route, what, key, policy)

    def observe_all(
        self, observations: Sequence[tuple[str, Observation, str | None, BreakerPolicy]]
    ) -> list[str | None]:
        """``observe`` for each ``(route, what, key, policy)``, in one transaction (a review's first reviews
        of every routed output it judged: one commit, not one per output), routes in a fixed order so two
        reviews never lock each other's routes the other way round; each observation's change, in order."""
        order = sorted(range(len(observations)), key=lambda i: (observations[i][0], i))
        changes: list[str | None] = [None] * len(observations)
        with translated(), self._engine.begin() as conn:
            for i in order:
                changes[i] = _observe(conn, *observations[i])
        return changes

    def record_qualification(
        self, route: str, passed: bool, reason: str, detail: dict[str, Any], actor: str
    ) -> RouteHealth:
        """A regression run's result: a pass qualifies the route as a fallback from now (until it is older
        than its ``max_age``), a failure withdraws any qualification. Logged with its scores."""
        with translated(), self._engine.begin() as conn:
            # ON CONFLICT DO NOTHING: the route may have no row yet, or get one from a dispatch meanwhile.
            conn.execute(pg_insert(route_breakers).values(route=route).on_conflict_do_nothing())
            conn.execute(
                update(route_breakers)
                .where(route_breakers.c.route == route)
                .values(
                    qualified_at=func.clock_timestamp() if passed else None,
                    version=route_breakers.c.version + 1,
                )
            )
            kind = "qualified" if passed else "disqualified"
            _log_change(conn, route, kind, reason, None, {**detail, "actor": actor[:200]})
            row = conn.execute(select(BREAKER_ROW.label("r")), {"b_route": route}).scalar()
        return health(route, row)

    def route_health(self) -> dict[str, RouteHealth]:
        """Every route's shared row (routes without one are closed and unqualified)."""
        with translated(), self._reader.connect() as conn:
            rows = conn.execute(select(route_breakers)).mappings().all()
        return {r["route"]: health(r["route"], dict(r)) for r in rows}

    def observations(self, route: str) -> dict[str, int]:
        """How many observations of each kind ``route`` has had (for drills and reports)."""
        q = (
            select(route_observations.c.kind, func.count())
            .where(route_observations.c.route == route)
            .group_by(route_observations.c.kind)
        )
        with translated(), self._reader.connect() as conn:
            return {str(k): int(n) for k, n in conn.execute(q).all()}

    def route_changes(self, route: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        """The newest ``limit`` changes (of one route, or all), newest first."""
        q = select(route_changes).order_by(route_changes.c.id.desc()).limit(limit)
        if route is not None:
            q = q.where(route_changes.c.route == route)
        with translated(), self._reader.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings().all()]


def _observe(
    conn: Connection, route: str, what: Observation, key: str | None, policy: BreakerPolicy
) -> str | None:
    """``RouteStore.observe``'s body, on the caller's transaction."""
    if what == Observation.ANOMALY and key is not None:
        # One task's anomalies on a route are taken one at a time: the insert sees any before it.
        conn.execute(_ROUTE_TASK_LOCK, {"k": f"route-anomaly:{route}:{key.split(':', 1)[0]}"})
    if what in FAILURES or what == Observation.REVIEW_FAIL:
        # A route's failures are judged one at a time: two at once, each blind to the other's
        # uncommitted row, would each count one and neither open a breaker two of them should (seen:
        # two tasks' simultaneous overcharges, 2 failures of 4 calls, the breaker still closed).
        conn.execute(_ROUTE_TASK_LOCK, {"k": f"route-failures:{route}"})
    row, now, what = _insert_observation(conn, route, what, key, policy)
    h = health(route, row)
    counted = what in FAILURES or what == Observation.REVIEW_FAIL
    if not (counted or (key is not None and key in (h.probe_key, h.canary_key))):
        return None
    # A concurrent change of the row (its version moved) is read again and the observation re-applied.
    for _ in range(3):
        window = Window()
        if counted and h.state == BreakerState.CLOSED:
            calls, failures, reviews, passed = conn.execute(
                _WINDOW,
                {
                    "route": route,
                    "now": now,
                    "calls": timedelta(seconds=policy.window_s),
                    "widest": timedelta(seconds=policy.widest_s),
                },
            ).one()
            window = Window(calls, failures, reviews, passed)
        new, change = observed(h, what, key or "", window, policy, now)
        if change is None:
            return None
        if _swap(conn, h, new):
            _log_change(conn, route, change, new.reason if change != "canary_passed" else "", key)
            return change
        h = health(route, conn.execute(select(BREAKER_ROW.label("r")), {"b_route": route}).scalar())
    return None
