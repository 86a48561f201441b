"""Issue 23 §4: a route's spend cap per calendar month is a budget scope of its own, ``route:R:YYYY-MM``,
reserved with every INTENT the route serves and settled with the operation's one result — across tasks, in
the same transactions, on the real Postgres. Every test has its own route names, so months never mix."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from decimal import Decimal
from pathlib import Path

import pytest
import sqlalchemy as sa

from ledger import roles
from ledger.errors import BudgetRefused
from ledger.recorder import Recorder, Routing
from ledgerflow.views.money import parse_scope, show
from ledgerflow.views.routes import route_rows
from rules import scopes
from rules.envelope import NewEvent
from rules.keys import late_charge_key, result_key
from rules.routing import Candidate
from runtime.settings import Settings

D = Decimal


def route_name() -> str:
    return f"cap-{uuid.uuid4().hex[:8]}"


def task(recorder: Recorder, ceiling: Decimal = D(100)) -> tuple[str, int]:
    tid = f"rc-{uuid.uuid4().hex[:10]}"
    epoch = recorder.take_lease(tid, "test")
    recorder.open_budget(tid, [(f"task:{tid}", ceiling)])
    return tid, epoch


def dispatch(
    recorder: Recorder,
    tid: str,
    epoch: int,
    n: int,
    chain: tuple[Candidate, ...],
    caps: tuple[tuple[str, Decimal], ...],
    amount: Decimal = D(1),
) -> tuple[str, dict]:
    """A routed dispatch's INTENT reserving ``amount``: (its operation key, the INTENT's payload)."""
    key = f"{tid}:shots/S{n:02d}:1"
    intent = NewEvent(
        type="Intent",
        dedup_key=f"{key}:intent",
        operation_key=key,
        payload={"action": {"kind": "Dispatch", "operation_key": key}},
    )
    routing = Routing(chain[0].route, chain, key, task_id=tid, caps=caps)
    (row,) = recorder.append_fenced(tid, epoch, [intent], reserve=amount, routing=routing)
    return key, row.payload


def resolve(recorder: Recorder, tid: str, key: str, release: Decimal, spend: Decimal) -> bool:
    """The operation's one result (an Outcome; spend 0 is a void's): True if this call wrote it."""
    result = NewEvent(type="Outcome", dedup_key=result_key(key), operation_key=key)
    _, inserted = recorder.append_idempotent(tid, result, release=release, spend=spend)
    return inserted


def month_of(recorder: Recorder, route: str) -> tuple[str, Decimal | None, Decimal, Decimal]:
    (account,) = recorder.accounts(f"route:{route}:")
    return account.scope, account.ceiling, account.reserved, account.spent


def test_reservations_past_a_routes_monthly_cap_are_refused_across_tasks_naming_the_route_month(
    recorder: Recorder,
) -> None:
    route = route_name()
    chain, caps = (Candidate(route),), ((route, D(3)),)
    first, e1 = task(recorder)
    second, e2 = task(recorder)
    key, payload = dispatch(recorder, first, e1, 1, chain, caps)
    dispatch(recorder, first, e1, 2, chain, caps)
    dispatch(recorder, second, e2, 1, chain, caps)

    with pytest.raises(BudgetRefused) as refused:
        dispatch(recorder, second, e2, 2, chain, caps)

    # The month is the database's clock's (UTC) at the reservation: the one the INTENT's choice was made at.
    scope = scopes.route_month(route, datetime.fromisoformat(payload["route_at"]))
    assert refused.value.scope == scope == month_of(recorder, route)[0]
    assert (refused.value.ceiling, refused.value.reserved, refused.value.amount) == (D(3), D(3), D(1))
    assert f"`ledgerflow budget set {scope} N`" in str(refused.value)  # what a person is told to do
    assert month_of(recorder, route)[1:] == (D(3), D(3), D(0))
    # Nothing of the refused dispatch was written: no INTENT, no task reservation, no hold.
    assert len(recorder.read_events(second)) == 1
    assert recorder.account(f"task:{second}").reserved == D(1)  # type: ignore[union-attr]
    holds = recorder.route_holds(scope)
    assert sorted(h["operation_key"] for h in holds) == sorted(
        [key, f"{first}:shots/S02:1", f"{second}:shots/S01:1"]
    )
    assert all(h["amount"] == D(1) and h["settled_at"] is None for h in holds)


def test_concurrent_dispatches_of_many_tasks_never_hold_more_than_the_cap(recorder: Recorder) -> None:
    route = route_name()
    chain, caps = (Candidate(route),), ((route, D("2.50")),)
    tasks = [task(recorder) for _ in range(8)]

    def attempt(t: tuple[str, int]) -> bool:
        try:
            dispatch(recorder, t[0], t[1], 1, chain, caps, D("0.50"))
            return True
        except BudgetRefused as e:
            assert e.scope.startswith(f"route:{route}:")
            return False

    with ThreadPoolExecutor(8) as pool:
        admitted = list(pool.map(attempt, tasks))

    assert admitted.count(True) == 5
    scope, ceiling, reserved, spent = month_of(recorder, route)
    assert (ceiling, reserved, spent) == (D("2.50"), D("2.50"), D(0))
    assert len(recorder.route_holds(scope)) == 5


def test_the_result_moves_the_hold_from_reserved_to_spent_exactly_once(recorder: Recorder) -> None:
    route = route_name()
    chain, caps = (Candidate(route),), ((route, D(10)),)
    tid, epoch = task(recorder)
    key, _ = dispatch(recorder, tid, epoch, 1, chain, caps, D(2))

    assert resolve(recorder, tid, key, D(2), D("1.75"))
    assert not resolve(recorder, tid, key, D(2), D("1.75"))  # a retried result: nothing settled again

    scope, _, reserved, spent = month_of(recorder, route)
    assert (reserved, spent) == (D(0), D("1.75"))
    (hold,) = recorder.route_holds(scope)
    assert (hold["amount"], hold["spent"]) == (D(2), D("1.75")) and hold["settled_at"] is not None
    # Spend above the hold is recorded as it is (never refused), like every scope's.
    other, _ = dispatch(recorder, tid, epoch, 2, chain, caps, D(1))
    assert resolve(recorder, tid, other, D(1), D(3))
    assert month_of(recorder, route)[2:] == (D(0), D("4.75"))


def test_a_void_releases_the_hold_and_a_late_charge_counts_on_the_month_it_held(recorder: Recorder) -> None:
    route = route_name()
    chain, caps = (Candidate(route),), ((route, D(1)),)
    tid, epoch = task(recorder)
    key, _ = dispatch(recorder, tid, epoch, 1, chain, caps)
    with pytest.raises(BudgetRefused):
        dispatch(recorder, tid, epoch, 2, chain, caps)

    assert resolve(recorder, tid, key, D(1), D(0))  # a void: nothing spent
    assert month_of(recorder, route)[2:] == (D(0), D(0))
    again, _ = dispatch(recorder, tid, epoch, 2, chain, caps)  # the released room is there again

    late = NewEvent(type="SystemMarker", dedup_key=late_charge_key(key, "job-9"), operation_key=key)
    recorder.append_idempotent(tid, late, spend=D("0.40"))
    scope, _, reserved, spent = month_of(recorder, route)
    assert (reserved, spent) == (D(1), D("0.40"))
    assert {h["operation_key"]: h["spent"] for h in recorder.route_holds(scope)} == {key: D("0.40"), again: 0}


def test_only_the_chosen_route_is_held_and_an_uncapped_route_holds_nothing(recorder: Recorder) -> None:
    capped, free = route_name(), route_name()
    tid, epoch = task(recorder)

    dispatch(recorder, tid, epoch, 1, (Candidate(free), Candidate(capped)), ((capped, D(5)),))

    assert recorder.accounts(f"route:{capped}:") == [] == recorder.accounts(f"route:{free}:")
    assert recorder.account(f"task:{tid}").reserved == D(1)  # type: ignore[union-attr]


def test_an_operator_raises_this_months_cap_with_budget_set_and_a_changed_file_cap_waits_for_next_month(
    recorder: Recorder, pg_url: str, tmp_path: Path
) -> None:
    route = route_name()
    chain = (Candidate(route),)
    tid, epoch = task(recorder)
    dispatch(recorder, tid, epoch, 1, chain, ((route, D(1)),))
    scope = month_of(recorder, route)[0]
    with pytest.raises(BudgetRefused):  # a larger cap in the route file does not move this month's account
        dispatch(recorder, tid, epoch, 2, chain, ((route, D(5)),))

    recorder.set_ceiling(parse_scope(scope), D(2))  # `ledgerflow budget set route:R:YYYY-MM 2`
    dispatch(recorder, tid, epoch, 2, chain, ((route, D(1)),))

    (row,) = show(Settings(database_url=pg_url), scope)  # `ledgerflow budget show route:R:YYYY-MM`
    assert row.as_json() == {
        "scope": scope,
        "ceiling": "2.000000",
        "reserved": "2.000000",
        "spent": "0.000000",
        "remaining": "0.000000",
    }
    routes_file = tmp_path / "routes.yaml"  # `ledgerflow routes`: the file's cap, this month's figures
    routes_file.write_text(f"routes:\n  {route}:\n    monthly_cap: 1\n")
    rows = route_rows(Settings(database_url=pg_url, routes_file=routes_file))
    (mine,) = [r for r in rows if r["route"] == route]
    assert (mine["monthly_cap"], mine["month_scope"], mine["month_ceiling"]) == ("1", scope, "2.000000")
    assert (mine["month_spent"], mine["month_reserved"]) == ("0.000000", "2.000000")


def test_a_worker_on_its_own_login_holds_and_settles_a_capped_route(recorder: Recorder, pg_url: str) -> None:
    # The same passwords as tests/security/test_db_roles.py: one set of logins per server.
    passwords = {name: f"test-{kind}-password-0123456789" for kind, name in roles.ENV.items()}
    roles.ensure_logins(pg_url, passwords)
    url = sa.engine.make_url(pg_url).set(
        username=roles.USERS["worker"], password=passwords[roles.ENV["worker"]]
    )
    worker = Recorder(url.render_as_string(hide_password=False), pool_size=1)
    route = route_name()
    try:
        tid, epoch = task(recorder)  # opened as the tests' owner; the worker reserves and settles
        key, _ = dispatch(worker, tid, epoch, 1, (Candidate(route),), ((route, D(2)),))
        assert resolve(worker, tid, key, D(1), D("0.80"))
    finally:
        worker.dispose()
    scope, ceiling, reserved, spent = month_of(recorder, route)
    assert (ceiling, reserved, spent) == (D(2), D(0), D("0.80"))
    assert [h["spent"] for h in recorder.route_holds(scope)] == [D("0.80")]
