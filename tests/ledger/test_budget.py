"""Budget accounts enforced by the database: reservations with the INTENT, settlement once, every scope."""

from __future__ import annotations

import pickle
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.errors import BudgetRefused, InvalidAmount, LedgerError, StaleEpoch
from ledger.recorder import Account, Recorder
from rules.envelope import NewEvent

D = Decimal


def uid() -> str:
    return uuid.uuid4().hex[:12]


def intent(task: str, n: int | str) -> NewEvent:
    return NewEvent(type="Intent", dedup_key=f"{task}:intent:{n}", operation_key=f"{task}:op:{n}")


def outcome(task: str, n: int | str) -> NewEvent:
    return NewEvent(type="Outcome", dedup_key=f"{task}:outcome:{n}", operation_key=f"{task}:op:{n}")


@dataclass
class Task:
    id: str
    epoch: int
    scopes: list[str]

    @property
    def scope(self) -> str:
        return self.scopes[-1]


def open_task(
    recorder: Recorder, project: str, ceiling: Decimal | None, *, episode: str | None = None
) -> Task:
    """Take a lease and open the task's budget under ``project`` (and ``episode``), like ledger.open_task."""
    task = f"t-{uid()}"
    epoch = recorder.take_lease(task, "run-a")
    scopes: list[tuple[str, Decimal | None]] = [(project, None)]
    if episode is not None:
        scopes.append((episode, None))
    scopes.append((f"task:{task}", ceiling))
    recorder.open_budget(task, scopes)
    return Task(task, epoch, [s for s, _ in scopes])


def figures(recorder: Recorder, scope: str) -> tuple[Decimal | None, Decimal, Decimal]:
    account = recorder.account(scope)
    assert account is not None
    return account.ceiling, account.reserved, account.spent


@pytest.fixture
def project(recorder: Recorder) -> str:
    return f"project:p-{uid()}"


# --- reservation with the INTENT ----------------------------------------------------------------------------


def test_a_refused_reservation_writes_nothing_and_a_fitting_one_writes_both(
    recorder: Recorder, project: str
) -> None:
    t = open_task(recorder, project, D("2.00"))

    with pytest.raises(BudgetRefused) as caught:
        recorder.append_fenced(t.id, t.epoch, [intent(t.id, 1)], reserve=D("2.50"))
    assert caught.value.scope == t.scope
    assert recorder.read_events(t.id) == []
    assert figures(recorder, t.scope) == (D(2), D(0), D(0))
    assert figures(recorder, project) == (None, D(0), D(0))

    [stored] = recorder.append_fenced(t.id, t.epoch, [intent(t.id, 1)], reserve=D("1.50"))
    assert stored.seq == 1  # the refused write consumed no seq
    assert figures(recorder, t.scope) == (D(2), D("1.5"), D(0))
    assert figures(recorder, project) == (None, D("1.5"), D(0))
    # Exactly the ceiling fits (<=), one micro-unit more does not.
    recorder.append_fenced(t.id, t.epoch, [intent(t.id, 2)], reserve=D("0.50"))
    with pytest.raises(BudgetRefused):
        recorder.append_fenced(t.id, t.epoch, [intent(t.id, 3)], reserve=D("0.000001"))
    assert figures(recorder, t.scope) == (D(2), D(2), D(0))


def test_every_scope_is_checked_and_the_refusal_names_the_short_one(recorder: Recorder, project: str) -> None:
    recorder.set_ceiling(project, D("5.00"))
    a, b, c = (open_task(recorder, project, D("10")) for _ in range(3))
    recorder.append_fenced(a.id, a.epoch, [intent(a.id, 1)], reserve=D("4.10"))
    recorder.append_idempotent(a.id, outcome(a.id, 1), release=D("4.10"), spend=D("4.10"))
    recorder.append_fenced(b.id, b.epoch, [intent(b.id, 1)], reserve=D("0.50"))

    with pytest.raises(BudgetRefused) as caught:
        recorder.append_fenced(c.id, c.epoch, [intent(c.id, 1)], reserve=D("1.00"))  # c's own ceiling is 10

    refused = caught.value
    assert str(refused) == (
        f"budget refused: {project} has 0.40 left of 5.00 (spent 4.10, reserved 0.50), needs 1.00"
    )
    assert (refused.scope, refused.ceiling, refused.spent, refused.reserved, refused.amount) == (
        project,
        D(5),
        D("4.1"),
        D("0.5"),
        D(1),
    )
    assert refused.remaining == D("0.4")
    assert recorder.read_events(c.id) == []
    assert figures(recorder, c.scope) == (D(10), D(0), D(0))
    assert figures(recorder, project) == (D(5), D("0.5"), D("4.1"))
    recorder.append_fenced(c.id, c.epoch, [intent(c.id, 1)], reserve=D("0.40"))  # what is left still fits


def test_an_episode_between_project_and_task_is_checked_too(recorder: Recorder, project: str) -> None:
    episode = f"episode:{project.removeprefix('project:')}/E001"
    t = open_task(recorder, project, D(10), episode=episode)
    recorder.set_ceiling(episode, D(1))
    assert recorder.task_scopes(t.id) == [project, episode, t.scope]
    with pytest.raises(BudgetRefused) as caught:
        recorder.append_fenced(t.id, t.epoch, [intent(t.id, 1)], reserve=D(2))
    assert caught.value.scope == episode
    recorder.append_fenced(t.id, t.epoch, [intent(t.id, 1)], reserve=D(1))
    assert [recorder.account(s).reserved for s in t.scopes] == [D(1)] * 3  # type: ignore[union-attr]


def test_unlimited_scopes_never_refuse(recorder: Recorder, project: str) -> None:
    t = open_task(recorder, project, None)
    for i in range(5):
        recorder.append_fenced(t.id, t.epoch, [intent(t.id, i)], reserve=D(1_000_000_000))
    assert figures(recorder, project) == (None, D(5_000_000_000), D(0))
    assert figures(recorder, t.scope) == (None, D(5_000_000_000), D(0))
    assert recorder.account(t.scope).remaining is None  # type: ignore[union-attr]


def test_a_stale_epoch_reserves_nothing(recorder: Recorder, project: str) -> None:
    t = open_task(recorder, project, D(5))
    new = recorder.take_lease(t.id, "run-b")
    with pytest.raises(StaleEpoch):
        recorder.append_fenced(t.id, t.epoch, [intent(t.id, 1)], reserve=D(1))
    assert figures(recorder, t.scope) == (D(5), D(0), D(0))
    assert figures(recorder, project) == (None, D(0), D(0))
    recorder.append_fenced(t.id, new, [intent(t.id, 1)], reserve=D(1))
    assert figures(recorder, t.scope) == (D(5), D(1), D(0))


def test_reserving_without_budget_accounts_is_refused(recorder: Recorder) -> None:
    task = f"t-{uid()}"
    epoch = recorder.take_lease(task, "run-a")
    with pytest.raises(LedgerError, match="open_budget was never called"):
        recorder.append_fenced(task, epoch, [intent(task, 1)], reserve=D(1))
    assert recorder.read_events(task) == []
    recorder.append_fenced(task, epoch, [intent(task, 1)])  # without money the task needs no accounts


# --- settlement ---------------------------------------------------------------------------------------------


def test_settlement_happens_once_however_often_the_outcome_is_appended(
    recorder: Recorder, project: str
) -> None:
    t = open_task(recorder, project, D(5))
    recorder.append_fenced(t.id, t.epoch, [intent(t.id, 1)], reserve=D("1.00"))

    first, inserted = recorder.append_idempotent(t.id, outcome(t.id, 1), release=D("1.00"), spend=D("0.80"))
    again, again_inserted = recorder.append_idempotent(
        t.id, outcome(t.id, 1), release=D("1.00"), spend=D("0.80")
    )

    assert (inserted, again_inserted, again) == (True, False, first)
    for scope in t.scopes:
        assert figures(recorder, scope)[1:] == (D(0), D("0.8"))


def test_actual_above_the_reservation_is_recorded_and_the_reservation_released_exactly(
    recorder: Recorder, project: str
) -> None:
    t = open_task(recorder, project, D("1.00"))
    recorder.append_fenced(t.id, t.epoch, [intent(t.id, 1)], reserve=D("1.00"))
    recorder.append_idempotent(t.id, outcome(t.id, 1), release=D("1.00"), spend=D("1.75"))

    account = recorder.account(t.scope)
    assert account is not None
    assert (account.reserved, account.spent, account.remaining) == (D(0), D("1.75"), D("-0.75"))
    assert figures(recorder, project)[1:] == (D(0), D("1.75"))
    # Spent past the ceiling: nothing more fits, and the refusal shows the overrun honestly.
    with pytest.raises(BudgetRefused, match=r"has -0\.75 left of 1\.00 \(spent 1\.75, reserved 0\.00\)"):
        recorder.append_fenced(t.id, t.epoch, [intent(t.id, 2)], reserve=D("0.01"))
    # Spend with no reservation at all (inference) is recorded too, never blocked.
    recorder.append_idempotent(t.id, outcome(t.id, "llm"), spend=D("0.25"))
    assert figures(recorder, t.scope)[1:] == (D(0), D(2))


def test_releasing_more_than_is_reserved_is_a_caller_bug_and_writes_nothing(
    recorder: Recorder, project: str
) -> None:
    t = open_task(recorder, project, D(5))
    recorder.append_fenced(t.id, t.epoch, [intent(t.id, 1)], reserve=D(1))
    with pytest.raises(LedgerError, match="exceeds its reservation"):
        recorder.append_idempotent(t.id, outcome(t.id, 1), release=D(2), spend=D(1))
    assert recorder.find_by_dedup_key(f"{t.id}:outcome:1") is None
    assert figures(recorder, t.scope) == (D(5), D(1), D(0))
    # The retry with the right figures goes through, and takes the next seq (none was lost).
    stored, inserted = recorder.append_idempotent(t.id, outcome(t.id, 1), release=D(1), spend=D(1))
    assert (inserted, stored.seq) == (True, 2)


# --- concurrency --------------------------------------------------------------------------------------------


def test_ten_concurrent_reservations_on_a_shared_project_never_overshoot(
    recorder: Recorder, project: str
) -> None:
    started = time.monotonic()
    episode = f"episode:{project.removeprefix('project:')}/E1"
    recorder.set_ceiling(project, D("5.00"))
    # Half the tasks also share an episode: in C order "episode:" < "project:" < "task:", so the lock order is
    # not the recorded (outermost first) order, and tasks lock different sets of shared rows.
    tasks = [open_task(recorder, project, D("2.00"), episode=episode if i % 2 else None) for i in range(10)]
    samples: list[Account] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            account = recorder.account(project)
            if account is not None:
                samples.append(account)
            time.sleep(0.002)

    barrier = threading.Barrier(len(tasks))

    def reserve(t: Task) -> bool:
        barrier.wait()
        try:
            recorder.append_fenced(t.id, t.epoch, [intent(t.id, 1)], reserve=D("1.00"))
        except BudgetRefused as refused:
            assert refused.scope == project
            return False
        return True

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(max_workers=len(tasks)) as pool:
            won = list(pool.map(reserve, tasks, timeout=10))
        time.sleep(0.02)
    finally:
        stop.set()
        sampler.join()

    assert sum(won) == 5
    assert samples and all(a.ceiling is not None and a.spent + a.reserved <= a.ceiling for a in samples)
    assert figures(recorder, project) == (D(5), D(5), D(0))
    winners = [t for t, w in zip(tasks, won, strict=True) if w]
    for t, w in zip(tasks, won, strict=True):
        assert len(recorder.read_events(t.id)) == int(w)
        assert figures(recorder, t.scope)[1] == (D(1) if w else D(0))

    costs = [D("0.80"), D("1.20"), D("1.00"), D("0.50"), D("1.30")]
    for t, cost in zip(winners, costs, strict=True):
        recorder.append_idempotent(t.id, outcome(t.id, 1), release=D(1), spend=cost)
    assert figures(recorder, project) == (D(5), D(0), sum(costs))
    assert sum(figures(recorder, t.scope)[2] for t in tasks) == sum(costs)
    in_episode = [t for t in winners if episode in t.scopes]
    assert figures(recorder, episode)[2] == sum(
        (c for t, c in zip(winners, costs, strict=True) if t in in_episode), D(0)
    )
    assert time.monotonic() - started < 10


# --- amounts, ceilings and reads ----------------------------------------------------------------------------

BAD_AMOUNTS = [
    D(-1),
    -1,
    D("NaN"),
    D("sNaN"),
    D("Infinity"),
    D("1e308"),
    D("1000000000.000001"),
    "5",
    5.0,
    True,
]
BAD_IDS = ["-1", "int-1", "nan", "snan", "inf", "1e308", "over-max", "str", "float", "bool"]


@pytest.mark.parametrize("amount", BAD_AMOUNTS, ids=BAD_IDS)
def test_bad_amounts_are_refused_before_anything_is_written(
    recorder: Recorder, project: str, amount: Any
) -> None:
    recorder.set_ceiling(project, D(3))
    with pytest.raises(InvalidAmount):
        recorder.set_ceiling(project, amount)
    with pytest.raises(InvalidAmount):
        recorder.raise_ceiling(project, amount)
    t = open_task(recorder, project, D(5))
    with pytest.raises(InvalidAmount):
        recorder.append_fenced(t.id, t.epoch, [intent(t.id, 1)], reserve=amount)
    with pytest.raises(InvalidAmount):
        recorder.append_idempotent(t.id, outcome(t.id, 1), spend=amount)
    with pytest.raises(InvalidAmount):
        recorder.open_budget(t.id, [(project, None), (t.scope, amount)])
    assert recorder.read_events(t.id) == []
    assert figures(recorder, project) == (D(3), D(0), D(0))


def test_amounts_finer_than_a_micro_unit_are_refused_and_ints_accepted(
    recorder: Recorder, project: str
) -> None:
    with pytest.raises(InvalidAmount, match="at most 6 decimal places"):
        recorder.set_ceiling(project, D("1.0000001"))
    recorder.set_ceiling(project, D("1.0000010000"))  # trailing zeros are exact
    recorder.raise_ceiling(project, 2)  # type: ignore[arg-type]  # ints are accepted at run time too
    assert figures(recorder, project)[0] == D("3.000001")
    error = InvalidAmount("reserve", D("NaN"), "must be finite")
    assert isinstance(error, ValueError) and isinstance(error, LedgerError)


def test_set_and_raise_ceiling(recorder: Recorder, project: str) -> None:
    recorder.set_ceiling(project, D("5.5"))  # creates the account
    recorder.raise_ceiling(project, D("1.25"))
    assert figures(recorder, project) == (D("6.75"), D(0), D(0))
    recorder.set_ceiling(project, None)
    recorder.raise_ceiling(project, D(10))  # unlimited stays unlimited
    assert figures(recorder, project)[0] is None
    recorder.set_ceiling(project, D(0))
    assert recorder.account(project).remaining == D(0)  # type: ignore[union-attr]
    with pytest.raises(LedgerError, match="no budget account"):
        recorder.raise_ceiling(f"project:absent-{uid()}", D(1))


def test_open_budget_twice_keeps_existing_accounts_and_reads_find_them(
    recorder: Recorder, project: str
) -> None:
    name = project.removeprefix("project:")
    episode = f"episode:{name}/E001"
    recorder.set_ceiling(project, D(50))
    a = open_task(recorder, project, D(5), episode=episode)
    recorder.append_fenced(a.id, a.epoch, [intent(a.id, 1)], reserve=D(2))
    recorder.append_idempotent(a.id, outcome(a.id, 1), release=D(2), spend=D("1.5"))
    recorder.append_fenced(a.id, a.epoch, [intent(a.id, 2)], reserve=D(1))
    before = {s: figures(recorder, s) for s in a.scopes}

    # Re-opened (a new run), with the plan's ceiling changed and a project ceiling passed: nothing moves.
    recorder.take_lease(a.id, "run-b")
    recorder.open_budget(a.id, [(project, D(1)), (episode, None), (a.scope, D(99))])
    assert (
        {s: figures(recorder, s) for s in a.scopes}
        == before
        == {
            project: (D(50), D(1), D("1.5")),
            episode: (None, D(1), D("1.5")),
            a.scope: (D(5), D(1), D("1.5")),
        }
    )
    with pytest.raises(LedgerError, match="already draws on"):
        recorder.open_budget(a.id, [(project, None), (a.scope, None)])
    with pytest.raises(LedgerError, match="distinct"):
        recorder.open_budget(a.id, [(project, None), (project, None)])

    b = open_task(recorder, project, D(7))
    other = open_task(recorder, f"project:{name}x", D(1))  # a longer name with the same prefix
    assert recorder.task_scopes(a.id) == [project, episode, a.scope]
    assert recorder.task_scopes(f"t-{uid()}") == []
    assert recorder.tasks_in_scope(project) == [a.id, b.id]
    assert recorder.tasks_in_scope(episode) == [a.id]
    assert recorder.tasks_in_scope(other.scope) == [other.id]
    assert [x.scope for x in recorder.accounts(project)] == [project, f"project:{name}x"]
    assert [x.scope for x in recorder.accounts(f"episode:{name}/")] == [episode]
    assert [x.scope for x in recorder.accounts(a.scope)] == [a.scope]
    everything = [x.scope for x in recorder.accounts()]
    assert everything == sorted(everything) and {project, episode, a.scope, b.scope} <= set(everything)
    assert recorder.account(f"project:absent-{uid()}") is None


def test_budget_errors_pickle_with_their_fields() -> None:
    refused = BudgetRefused("project:demo", D("5.00"), D("4.10"), D("0.50"), D("1.00"))
    assert (
        str(refused)
        == "budget refused: project:demo has 0.40 left of 5.00 (spent 4.10, reserved 0.50), needs 1.00"
    )
    copy = pickle.loads(pickle.dumps(refused))
    assert (copy.scope, copy.ceiling, copy.spent, copy.reserved, copy.amount, str(copy)) == (
        "project:demo",
        D("5.00"),
        D("4.10"),
        D("0.50"),
        D("1.00"),
        str(refused),
    )
    assert str(BudgetRefused("task:t", D("1.000000"), D("0.123456"), D(0), D("0.9"))).endswith(
        "has 0.876544 left of 1.00 (spent 0.123456, reserved 0.00), needs 0.90"
    )
    invalid = pickle.loads(pickle.dumps(InvalidAmount("reserve", "5", "must be a Decimal or an int")))
    assert (invalid.name, invalid.value, invalid.reason) == ("reserve", "5", "must be a Decimal or an int")


def test_create_schema_upgrades_a_database_from_before_budgets_in_place(pg_url: str) -> None:
    database = f"lf_budget_{uid()}"
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{database}"'))
        url = sa.make_url(pg_url).set(database=database).render_as_string(hide_password=False)
        rec = Recorder(url, pool_size=1)
        engine = sa.create_engine(url)
        try:
            rec.create_schema()
            old = f"t-{uid()}"
            epoch = rec.take_lease(old, "run-a")
            rec.append_fenced(old, epoch, [intent(old, 1)])
            with engine.begin() as conn:  # back to the schema of the release before budgets
                conn.execute(sa.text("DROP TABLE budget_accounts"))
                conn.execute(sa.text("ALTER TABLE task_leases DROP COLUMN budget_scopes"))
                conn.execute(sa.text("DROP TABLE ledger_schema_version"))  # that release kept no version
                conn.execute(sa.text("DROP TABLE alembic_version"))  # nor had migrations

            rec.create_schema()
            rec.create_schema()

            assert rec.task_scopes(old) == []
            rec.open_budget(old, [("project:up", D(3)), (f"task:{old}", D(2))])
            rec.append_fenced(old, epoch, [intent(old, 2)], reserve=D(2))
            assert [(a.scope, a.reserved) for a in rec.accounts()] == [
                ("project:up", D(2)),
                (f"task:{old}", D(2)),
            ]
            assert [e.seq for e in rec.read_events(old)] == [1, 2]
            with engine.connect() as conn:
                index = conn.execute(
                    sa.text(
                        "SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_task_leases_budget_scopes'"
                    )
                ).scalar_one()
            assert "gin (budget_scopes)" in index
        finally:
            rec.dispose()
            engine.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE "{database}" WITH (FORCE)'))
    finally:
        admin.dispose()


# --- the accounts against a model, under random sequences ---------------------------------------------------

MONEY = st.decimals(min_value=D("0.01"), max_value=D("4.00"), places=2)
CEILING = st.one_of(st.none(), st.decimals(min_value=D(0), max_value=D("10.00"), places=2))

steps = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.integers(0, 2), MONEY),
        st.tuples(
            st.just("settle"), st.integers(0, 2), st.decimals(min_value=D(0), max_value=D(5), places=2)
        ),
        st.tuples(st.just("repeat"), st.integers(0, 2), st.just(D(0))),
    ),
    min_size=1,
    max_size=20,
)


@dataclass
class Model:
    """The accounts as a pure fold of the operations: scope -> [ceiling, reserved, spent]."""

    accounts: dict[str, list[Any]]
    outstanding: dict[str, list[tuple[int, Decimal]]] = field(
        default_factory=dict
    )  # task -> open reservations
    settled: dict[str, list[tuple[int, Decimal, Decimal]]] = field(
        default_factory=dict
    )  # task -> settlements

    def short_scope(self, scopes: list[str], amount: Decimal) -> str | None:
        for scope in sorted(scopes):  # the lock order: the first short scope is the one named
            ceiling, reserved, spent = self.accounts[scope]
            if ceiling is not None and spent + reserved + amount > ceiling:
                return scope
        return None

    def move(self, scopes: list[str], reserved: Decimal, spent: Decimal) -> None:
        for scope in scopes:
            self.accounts[scope][1] += reserved
            self.accounts[scope][2] += spent


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(project_ceiling=CEILING, task_ceilings=st.lists(CEILING, min_size=3, max_size=3), ops=steps)
def test_accounts_equal_a_model_of_the_operations(
    recorder: Recorder, project_ceiling: Decimal | None, task_ceilings: list[Decimal | None], ops: list[Any]
) -> None:
    project = f"project:h-{uid()}"
    recorder.set_ceiling(project, project_ceiling)
    tasks = [open_task(recorder, project, c) for c in task_ceilings]
    model = Model({project: [project_ceiling, D(0), D(0)]})
    for t, c in zip(tasks, task_ceilings, strict=True):
        model.accounts[t.scope] = [c, D(0), D(0)]
    for counter, (op, i, amount) in enumerate(ops, start=1):
        t = tasks[i]
        if op == "reserve":
            short = model.short_scope(t.scopes, amount)
            if short is None:
                recorder.append_fenced(t.id, t.epoch, [intent(t.id, counter)], reserve=amount)
                model.move(t.scopes, amount, D(0))
                model.outstanding.setdefault(t.id, []).append((counter, amount))
            else:
                with pytest.raises(BudgetRefused) as caught:
                    recorder.append_fenced(t.id, t.epoch, [intent(t.id, counter)], reserve=amount)
                assert caught.value.scope == short
        elif op == "settle":
            # The oldest open reservation of the task, or (none open) spend with nothing to release.
            n, release = (model.outstanding.get(t.id) or [(counter, D(0))]).pop(0)
            _, inserted = recorder.append_idempotent(t.id, outcome(t.id, n), release=release, spend=amount)
            assert inserted
            model.move(t.scopes, -release, amount)
            model.settled.setdefault(t.id, []).append((n, release, amount))
        elif model.settled.get(t.id):
            n, release, spent = model.settled[t.id][-1]
            _, inserted = recorder.append_idempotent(t.id, outcome(t.id, n), release=release, spend=spent)
            assert not inserted  # settles nothing the second time

        for scope, (ceiling, reserved, spent) in model.accounts.items():
            account = recorder.account(scope)
            assert account is not None
            assert (account.ceiling, account.reserved, account.spent) == (ceiling, reserved, spent)
            assert account.reserved >= 0 and account.spent >= 0
