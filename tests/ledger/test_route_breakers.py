"""Shared route health in Postgres: every worker and task sees one breaker per route, the route a dispatch
takes is chosen (and claimed) in the same append as its INTENT, and recorded there to be recomputed."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import pytest
import sqlalchemy as sa

from ledger.errors import RouteWaiting
from ledger.recorder import PRUNE_EVERY, Recorder, Routing
from rules.envelope import NewEvent
from rules.routing import BreakerPolicy, BreakerState, Candidate, Observation, recompute

POLICY = BreakerPolicy(window_s=60, min_calls=3, error_rate=0.5, open_for_s=0.5)


def names() -> tuple[str, str]:
    u = uuid.uuid4().hex[:8]
    return f"mo-{u}", f"mo-{u}-backup"


def chain(primary: str, backup: str) -> tuple[Candidate, ...]:
    return (Candidate(primary, open_for_s=POLICY.open_for_s), Candidate(backup, 30.0, max_age_s=3600.0))


def task(recorder: Recorder) -> tuple[str, int]:
    tid = f"rb-{uuid.uuid4().hex[:10]}"
    epoch = recorder.take_lease(tid, "test")
    recorder.open_budget(tid, [(f"task:{tid}", Decimal(100))])
    return tid, epoch


def intent_of(tid: str, n: int) -> tuple[str, NewEvent]:
    key = f"{tid}:shots/S{n:02d}:1"
    payload = {"action": {"kind": "Dispatch", "operation_key": key}}
    return key, NewEvent(type="Intent", dedup_key=f"{key}:intent", operation_key=key, payload=payload)


def dispatch(recorder: Recorder, tid: str, epoch: int, n: int, routes: tuple[Candidate, ...]) -> dict:
    key, intent = intent_of(tid, n)
    (row,) = recorder.append_fenced(
        tid, epoch, [intent], reserve=Decimal(1), routing=Routing(routes[0].route, routes, key)
    )
    return row.payload


def trip(recorder: Recorder, route: str) -> None:
    for i in range(3):
        recorder.observe(route, Observation.ERROR, f"x:{i}", POLICY)
    assert recorder.route_health()[route].state == BreakerState.OPEN


def test_failures_seen_by_one_worker_open_the_breaker_for_another_workers_dispatch(
    recorder: Recorder, pg_url: str
) -> None:
    one, other = Recorder(pg_url, pool_size=1), Recorder(pg_url, pool_size=1)
    primary, backup = names()
    try:
        assert one.observe(primary, Observation.OK, "a", POLICY) is None
        assert one.observe(primary, Observation.ERROR, "b", POLICY) is None  # 1 of 2: too few calls
        assert one.observe(primary, Observation.TIMEOUT, "c", POLICY) == "opened"  # 2 of 3 failed

        tid, epoch = task(other)
        with pytest.raises(RouteWaiting, match=f"{backup} is not qualified"):
            dispatch(other, tid, epoch, 1, chain(primary, backup))
        assert other.read_events(tid) == []  # nothing written: no INTENT, no reservation
        assert other.account(f"task:{tid}").reserved == 0  # type: ignore[union-attr]
        (change,) = other.route_changes(primary)
        assert change["kind"] == "opened" and change["reason"] == "2 of 3 calls failed in 60s"
    finally:
        one.dispose()
        other.dispose()


def test_a_qualified_fallback_takes_one_canary_then_the_rest_once_it_passed(recorder: Recorder) -> None:
    primary, backup = names()
    routes = chain(primary, backup)
    trip(recorder, primary)
    recorder.record_qualification(backup, True, "4 of 4 passed", {"scores": [0.9]}, "test")
    tid, epoch = task(recorder)

    first = dispatch(recorder, tid, epoch, 1, routes)
    assert (first["route"], first["route_claim"]) == (backup, "canary")
    with pytest.raises(RouteWaiting, match="waits for its canary"):
        dispatch(recorder, tid, epoch, 2, routes)

    assert (
        recorder.observe(backup, Observation.OK, first["action"]["operation_key"], POLICY) == "canary_passed"
    )
    second = dispatch(recorder, tid, epoch, 2, routes)
    assert (second["route"], second["route_claim"]) == (backup, None)
    kinds = [c["kind"] for c in reversed(recorder.route_changes(backup))]
    assert kinds == ["qualified", "switched", "canary_passed"]
    switched = recorder.route_changes(backup)[1]
    assert switched["reason"].startswith(f"{primary} → {backup}")


def test_every_routed_intent_records_what_its_choice_is_recomputed_from(recorder: Recorder) -> None:
    primary, backup = names()
    routes = chain(primary, backup)
    tid, epoch = task(recorder)
    closed = dispatch(recorder, tid, epoch, 1, routes)
    trip(recorder, primary)
    recorder.record_qualification(backup, True, "passed", {}, "test")
    canary = dispatch(recorder, tid, epoch, 2, routes)

    for payload in (closed, canary):
        again = recompute(payload)
        assert again is not None
        assert (again.route, again.claim) == (payload["route"], payload["route_claim"])
    assert set(closed["route_basis"]) == {primary, backup}  # every route of the chain, as read
    assert closed["route_basis"][primary]["state"] == "closed" and closed["route_claim"] is None
    assert canary["route_basis"][primary]["state"] == "open"


def test_after_its_rest_one_dispatch_probes_the_primary_and_its_success_closes_it(recorder: Recorder) -> None:
    primary, backup = names()
    routes = chain(primary, backup)
    trip(recorder, primary)
    tid, epoch = task(recorder)
    time.sleep(POLICY.open_for_s + 0.1)

    probe = dispatch(recorder, tid, epoch, 1, routes)
    assert (probe["route"], probe["route_claim"]) == (primary, "probe")
    with pytest.raises(RouteWaiting, match="half-open"):  # the backup is not qualified: the rest wait
        dispatch(recorder, tid, epoch, 2, routes)

    assert recorder.observe(primary, Observation.OK, probe["action"]["operation_key"], POLICY) == "closed"
    after = dispatch(recorder, tid, epoch, 2, routes)
    assert (after["route"], after["route_claim"]) == (primary, None)
    assert [c["kind"] for c in reversed(recorder.route_changes(primary))] == [
        "opened",
        "half_opened",
        "closed",
    ]


def test_two_dispatches_racing_for_the_canary_claim_get_one_canary(pg_url: str) -> None:
    primary, backup = names()
    routes = chain(primary, backup)
    recorders = [Recorder(pg_url, pool_size=2) for _ in range(2)]
    try:
        trip(recorders[0], primary)
        recorders[0].record_qualification(backup, True, "passed", {}, "test")
        tasks = [task(r) for r in recorders]

        def go(i: int) -> str:
            try:
                return str(dispatch(recorders[i], *tasks[i], 1, routes)["route_claim"])
            except RouteWaiting as e:
                return type(e).__name__

        with ThreadPoolExecutor(2) as pool:
            got = sorted(pool.map(go, range(2)))
        assert got[0] in ("RouteContended", "RouteWaiting") and got[1] == "canary"
        assert [c["kind"] for c in recorders[1].route_changes(backup)].count("switched") == 1
    finally:
        for r in recorders:
            r.dispose()


def test_a_route_changes_row_is_never_rewritten(recorder: Recorder, pg_url: str) -> None:
    import sqlalchemy as sa

    primary, _ = names()
    trip(recorder, primary)
    engine = sa.create_engine(pg_url)
    try:
        with pytest.raises(sa.exc.DBAPIError, match="append-only"), engine.begin() as conn:
            conn.execute(sa.text("UPDATE route_changes SET reason = 'x'"))
    finally:
        engine.dispose()


def quota_dispatch(
    recorder: Recorder, tid: str, epoch: int, n: int, route: str, limit: int, priority: str = "standard"
) -> dict:
    key, intent = intent_of(tid, n)
    routing = Routing(
        route, (Candidate(route),), key, task_id=tid, quotas=((route, limit, 60.0),), priority=priority
    )
    (row,) = recorder.append_fenced(tid, epoch, [intent], reserve=Decimal(1), routing=routing)
    return row.payload


def result(recorder: Recorder, tid: str, key: str) -> None:
    recorder.append_idempotent(
        tid,
        NewEvent(type="SystemMarker", dedup_key=f"{key}:result", operation_key=key, payload={"kind": "void"}),
    )


def test_a_route_quota_holds_across_tasks_and_a_result_gives_its_slot_back(recorder: Recorder) -> None:
    route, _ = names()
    (t1, e1), (t2, e2) = task(recorder), task(recorder)
    first = quota_dispatch(recorder, t1, e1, 1, route, limit=2)
    quota_dispatch(recorder, t2, e2, 1, route, limit=2)
    assert first["route_quota"] == {
        "used": 0,
        "limit": 2,
        "ahead": 0,
        "priority": "standard",
        "waited_s": 0.0,
    }
    with pytest.raises(RouteWaiting, match="2 of 2 slots in use"):
        quota_dispatch(recorder, t2, e2, 2, route, limit=2)
    assert len(recorder.read_events(t2)) == 1  # the refused INTENT was not written

    result(recorder, t1, first["action"]["operation_key"])
    third = quota_dispatch(recorder, t2, e2, 2, route, limit=2)
    assert third["route_quota"]["used"] == 1 and third["route_quota"]["waited_s"] > 0


def test_a_freed_slot_goes_to_the_hero_task_though_the_background_one_asked_first(recorder: Recorder) -> None:
    route, _ = names()
    (t1, e1), (bg, ebg), (hero, ehero) = task(recorder), task(recorder), task(recorder)
    holder = quota_dispatch(recorder, t1, e1, 1, route, limit=1)
    with pytest.raises(RouteWaiting):
        quota_dispatch(recorder, bg, ebg, 1, route, limit=1, priority="background")
    with pytest.raises(RouteWaiting, match="1 of 1 slots in use, 0 waiting before it"):
        quota_dispatch(recorder, hero, ehero, 1, route, limit=1, priority="hero")

    result(recorder, t1, holder["action"]["operation_key"])
    with pytest.raises(RouteWaiting, match="0 of 1 slots in use, 1 waiting before it"):
        quota_dispatch(recorder, bg, ebg, 1, route, limit=1, priority="background")
    assert (
        quota_dispatch(recorder, hero, ehero, 1, route, limit=1, priority="hero")["route_quota"]["ahead"] == 0
    )


def test_observations_older_than_every_window_are_pruned_as_new_ones_arrive(
    recorder: Recorder, pg_url: str
) -> None:
    route, _ = names()
    engine = sa.create_engine(pg_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO route_observations (route, kind, recorded_at)"
                    " VALUES (:r, 'ok', clock_timestamp() - interval '3 hours')"
                ),
                {"r": route},
            )
        for i in range(PRUNE_EVERY):  # some insert among the next PRUNE_EVERY takes an id divisible by it
            recorder.observe(route, Observation.OK, f"k{i}", POLICY)  # widest window 1 h: 2 h kept
        with engine.connect() as conn:
            old, recent = conn.execute(
                sa.text(
                    "SELECT count(*) FILTER (WHERE recorded_at < clock_timestamp() - interval '2 hours'),"
                    " count(*) FILTER (WHERE recorded_at >= clock_timestamp() - interval '2 hours')"
                    " FROM route_observations WHERE route = :r"
                ),
                {"r": route},
            ).one()
    finally:
        engine.dispose()
    assert (old, recent) == (0, PRUNE_EVERY)


def test_a_tasks_billing_anomalies_count_once_per_window_however_many_workers_see_them(recorder):
    """One task's overbilled fan-out is one failed call per breaker window, counted in the ledger: its later
    anomalies are recorded as ok calls, from any worker at once; another task's anomaly counts again."""
    route, _ = names()
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(
            pool.map(
                lambda n: recorder.observe(route, Observation.ANOMALY, f"t1:shot/S0{n}:a1", POLICY), range(4)
            )
        )
    assert recorder.observations(route) == {"anomaly": 1, "ok": 3}
    recorder.observe(route, Observation.ANOMALY, "t2:shot/S01:a1", POLICY)
    assert recorder.observations(route) == {"anomaly": 2, "ok": 3}
