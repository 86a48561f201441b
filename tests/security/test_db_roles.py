"""Issue 24 §3: least privilege in the ledger's database (revision 0006, ``ledger.roles``).

Whoever holds a worker's database credentials must not be able to register an approver key, raise a
ceiling, change or delete a recorded event, or touch a trigger; the operator's credentials change keys and
ceilings but never events; and a worker on its own login still runs a whole task, a person's add_budget
included. On the session's real Postgres, with the logins ``ledgerflow db roles`` makes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
import sqlalchemy as sa
from peoplekit import wait_open

from ledger import roles
from ledger.errors import LedgerError
from ledger.recorder import Recorder
from ledgerflow.views import people
from rules.approvers import KeyRecord
from rules.events import TaskCreated, to_new
from rules.plan import load_plan
from rules.projection import TaskState, fold
from runtime.settings import Settings
from runtime.signing import demo_key, generate
from vendors.routes import deployment_table

PLAN = """
goal: a task the roles' tests write around
budget_ceiling: 10
stages:
  - {id: a, executor: llm.text, estimate: 1}
"""
PASSWORDS = {name: f"test-{kind}-password-0123456789" for kind, name in roles.ENV.items()}


@pytest.fixture(scope="module")
def logins(recorder: Recorder, pg_url: str) -> dict[str, str]:
    """kind -> a database URL logging in as that kind's user (made by ``ledgerflow db roles``'s code)."""
    roles.ensure_logins(pg_url, PASSWORDS)
    base = sa.engine.make_url(pg_url)
    return {
        kind: base.set(username=user, password=PASSWORDS[roles.ENV[kind]]).render_as_string(
            hide_password=False
        )
        for kind, user in roles.USERS.items()
    }


@pytest.fixture
def as_worker(logins: dict[str, str]) -> Iterator[sa.Engine]:
    engine = sa.create_engine(logins["worker"], poolclass=sa.pool.NullPool)
    yield engine
    engine.dispose()


def refused(engine: sa.Engine, sql: str, **params: object) -> str:
    """Run ``sql`` on its own transaction; the server's refusal (its first line). Fails if it ran."""
    with pytest.raises(sa.exc.DBAPIError) as caught, engine.begin() as conn:
        conn.execute(sa.text(sql), params)
    return str(caught.value.orig).splitlines()[0]


def cli(tmp_path: Path, *args: str, env: dict[str, str]) -> tuple[int, str, str]:
    """``ledgerflow ARGS`` as a subprocess: (exit code, stdout, stderr); a traceback fails the test."""
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "ledgerflow"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "LEDGERFLOW_STATE_DIR": str(tmp_path), **env},
        timeout=60,
    )
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    return proc.returncode, proc.stdout, proc.stderr


def a_task(recorder: Recorder, ceiling: Decimal = Decimal(10)) -> str:
    """A task in the shared ledger: its lease, its TaskCreated (so every fold of the ledger reads it), its
    budget account."""
    task_id = f"roles-{uuid.uuid4().hex[:10]}"
    plan = load_plan(PLAN, deployment_table(Settings()).names(), task_id=task_id)
    epoch = recorder.take_lease(task_id, "tests")
    recorder.append_fenced(task_id, epoch, [to_new(TaskCreated(plan=plan), dedup_key=f"{task_id}:created")])
    recorder.open_budget(task_id, [(f"task:{task_id}", ceiling)])
    return task_id


def test_a_worker_cannot_register_an_approver_key(recorder, as_worker):
    why = refused(
        as_worker,
        "INSERT INTO approver_keys (key_id, action, approver, public_key, actor)"
        " VALUES ('mallory-1', 'add', 'director', :pk, 'worker')",
        pk=generate("director", "mallory-1").public_key,
    )
    assert "permission denied for table approver_keys" in why
    assert "mallory-1" not in recorder.key_registry()
    worker = Recorder(as_worker.url.render_as_string(hide_password=False))
    try:  # the recorder's own method, on a worker's login: one clear ledger error, nothing written
        with pytest.raises(LedgerError, match="permission denied for table approver_keys"):
            worker.add_key(KeyRecord("mallory-2", "director", generate("x", "y").public_key), actor="w")
        assert "demo-director" in worker.key_registry()  # it still reads the registry it verifies with
    finally:
        worker.dispose()


def test_a_worker_cannot_raise_a_ceiling_by_update_or_by_upsert(recorder, as_worker):
    task_id = a_task(recorder)
    scope = f"task:{task_id}"
    why = refused(as_worker, "UPDATE budget_accounts SET ceiling = ceiling + 1000 WHERE scope = :s", s=scope)
    assert why.startswith(f"ledger: the ceiling of {scope} may change only by an operator")
    why = refused(as_worker, "UPDATE budget_accounts SET ceiling = NULL WHERE scope = :s", s=scope)
    assert "may change only by an operator" in why
    why = refused(
        as_worker,
        "INSERT INTO budget_accounts (scope, ceiling) VALUES (:s, 5000)"
        " ON CONFLICT (scope) DO UPDATE SET ceiling = excluded.ceiling",
        s=scope,
    )
    assert "may change only by an operator" in why
    # Deleting the account (to open it again unlimited) is not the worker's either.
    assert "permission denied" in refused(as_worker, "DELETE FROM budget_accounts WHERE scope = :s", s=scope)
    account = recorder.account(scope)
    assert account is not None and account.ceiling == Decimal(10)
    # What the worker does need still works: reserving and settling money.
    with as_worker.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE budget_accounts SET reserved = reserved + 1, updated_at = now() WHERE scope = :s"
            ),
            {"s": scope},
        )
    assert recorder.account(scope).reserved == Decimal(1)


def test_an_add_budget_decision_recorded_in_an_earlier_transaction_raises_nothing(recorder, as_worker):
    """The guard counts only a decision this very transaction inserted: one already recorded (a real one,
    replayed by hand) cannot be spent again on the ceiling."""
    task_id = a_task(recorder)
    scope = f"task:{task_id}"
    with as_worker.begin() as conn:  # a forged add_budget, as a worker's credentials can insert one
        seq = conn.execute(
            sa.text("UPDATE task_leases SET next_seq = next_seq + 1 WHERE task_id = :t RETURNING next_seq"),
            {"t": task_id},
        ).scalar_one()
        conn.execute(
            sa.text(
                "INSERT INTO events (task_id, seq, type, epoch, dedup_key, payload) VALUES"
                " (:t, :seq, 'HumanDecision', 1, :k, CAST(:p AS jsonb))"
            ),
            {
                "t": task_id,
                "seq": seq - 1,
                "k": f"{task_id}:forged",
                "p": f'{{"decision": "add_budget", "scope": "{scope}", "amount": "1000",'
                ' "signed": "x", "signature": "y", "request_id": "r", "approver": "a"}',
            },
        )
    why = refused(as_worker, "UPDATE budget_accounts SET ceiling = ceiling + 1000 WHERE scope = :s", s=scope)
    assert "may change only by an operator" in why
    assert recorder.account(scope).ceiling == Decimal(10)


def test_a_worker_cannot_update_delete_or_truncate_an_event_or_write_its_time(recorder, as_worker):
    task_id = a_task(recorder)
    count = sa.text("SELECT count(*) FROM events WHERE task_id = :t")
    with as_worker.begin() as conn:
        before = conn.execute(count, {"t": task_id}).scalar_one()
    for sql in (
        "UPDATE events SET payload = '{}' WHERE task_id = :t",
        "DELETE FROM events WHERE task_id = :t",
        "TRUNCATE events",
        "DELETE FROM task_leases WHERE task_id = :t",
        "INSERT INTO events (task_id, seq, type, epoch, dedup_key, payload, recorded_at)"
        " VALUES (:t, 99, 'X', 1, :t, '{}', '2000-01-01')",
    ):
        assert "permission denied" in refused(as_worker, sql, t=task_id), sql
    with as_worker.begin() as conn:
        assert conn.execute(count, {"t": task_id}).scalar_one() == before > 0  # none gone, none added


def test_a_worker_cannot_disable_drop_or_replace_a_trigger(as_worker):
    attempts = {
        "ALTER TABLE events DISABLE TRIGGER events_append_only": "must be owner of table events",
        "ALTER TABLE events DISABLE TRIGGER ALL": "must be owner of table events",
        "DROP TRIGGER events_append_only ON events": "must be owner of relation events",
        "DROP TRIGGER budget_accounts_ceiling_guard ON budget_accounts": "must be owner of relation",
        "CREATE OR REPLACE FUNCTION ledger_refuse_change() RETURNS trigger LANGUAGE plpgsql"
        " AS $$ BEGIN RETURN NULL; END $$": "permission denied for schema public",
        "CREATE OR REPLACE FUNCTION ledger_guard_ceiling() RETURNS trigger LANGUAGE plpgsql"
        " AS $$ BEGIN RETURN NEW; END $$": "permission denied for schema public",
        "SET session_replication_role = replica": "permission denied to set parameter",
        "CREATE TABLE shadow (x int)": "permission denied for schema public",
    }
    for sql, why in attempts.items():
        assert why in refused(as_worker, sql), sql
    with as_worker.begin() as conn:
        triggers = conn.execute(
            sa.text(
                "SELECT tgname, tgenabled FROM pg_trigger WHERE tgname IN ('events_append_only',"
                " 'budget_accounts_ceiling_guard') ORDER BY tgname"
            )
        ).all()
    assert triggers == [("budget_accounts_ceiling_guard", "O"), ("events_append_only", "O")]


def test_the_operator_sets_ceilings_and_keys_but_never_writes_an_event(recorder, logins):
    task_id = a_task(recorder)
    operator = Recorder(logins["operator"])
    try:
        operator.set_ceiling(f"task:{task_id}", Decimal(25))
        operator.add_key(KeyRecord(f"op-{task_id}", "director", generate("d", "k").public_key), actor="op")
        assert recorder.account(f"task:{task_id}").ceiling == Decimal(25)
        assert f"op-{task_id}" in recorder.key_registry()
    finally:
        operator.dispose()
    engine = sa.create_engine(logins["operator"], poolclass=sa.pool.NullPool)
    try:
        insert = (
            "INSERT INTO events (task_id, seq, type, epoch, dedup_key, payload)"
            " VALUES (:t, 99, 'X', 1, :t, '{}')"
        )
        assert "permission denied for table events" in refused(engine, insert, t=task_id)
        spend = "UPDATE budget_accounts SET spent = 0 WHERE scope = :t"
        assert "permission denied for table budget_accounts" in refused(engine, spend, t=f"task:{task_id}")
    finally:
        engine.dispose()


def test_a_reader_writes_no_task_state(recorder, logins):
    task_id = a_task(recorder)
    engine = sa.create_engine(logins["reader"], poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            assert conn.execute(
                sa.text("SELECT count(*) FROM task_leases WHERE task_id = :t"), {"t": task_id}
            )
        assert "permission denied" in refused(
            engine, "UPDATE task_leases SET holder = 'x' WHERE task_id = :t", t=task_id
        )
        assert "permission denied" in refused(engine, "INSERT INTO human_queue VALUES ('a', 'b', 'c', 'd')")
        # Nor the admission queue (revision 0012): no jumping the line, no freeing a place.
        assert "permission denied" in refused(
            engine, "INSERT INTO task_admission (task_id, queue, rank) VALUES ('a', 'q', 1)"
        )
        assert "permission denied" in refused(engine, "UPDATE task_admission SET admitted_at = now()")
        assert "permission denied" in refused(engine, "DELETE FROM task_admission")
    finally:
        engine.dispose()


def test_the_reader_records_a_logout_and_nobody_but_the_owner_takes_one_back(recorder, logins):
    """The reviewer page runs as the reader: it may record that a session is over (revision 0008), and
    neither it nor a worker may delete or shorten a logout (a stolen cookie would be good again)."""
    sid = f"s-{uuid.uuid4().hex}"
    reader = sa.create_engine(logins["reader"], poolclass=sa.pool.NullPool)
    worker = sa.create_engine(logins["worker"], poolclass=sa.pool.NullPool)
    try:
        page = Recorder(logins["reader"], pool_size=1)  # the reviewer page's own login
        page.log_out_session(sid, datetime.now(UTC) + timedelta(hours=1))
        page.dispose()
        assert recorder.session_logged_out(sid)
        for engine in (reader, worker):
            assert "permission denied" in refused(
                engine, "DELETE FROM review_logouts WHERE session_id = :s", s=sid
            )
            assert "permission denied" in refused(
                engine, "UPDATE review_logouts SET expires_at = now() WHERE session_id = :s", s=sid
            )
        assert "permission denied" in refused(
            worker, "INSERT INTO review_logouts (session_id, expires_at) VALUES ('x', now())"
        )
        assert recorder.session_logged_out(sid)
    finally:
        reader.dispose()
        worker.dispose()


def test_the_receiver_inserts_a_callback_and_nothing_else(recorder, pg_url, logins):
    """The webhook receiver logs in as the receiver (revision 0010): it records a vendor's callback, with its
    NOTIFY, and cannot read events or callbacks, change or delete a callback, or write an event."""
    from ledger.callbacks import callbacks_for, open_engine, record_callback

    key = f"op-{uuid.uuid4().hex}"
    receiver = open_engine(logins["receiver"], pool_size=1)
    fields = {
        "route": "video.motion",
        "operation_key": key,
        "reason": "signature verified (standard)",
        "body_sha256": "0" * 64,
        "claimed_status": "succeeded",
        "body": {"status": "succeeded"},
    }
    try:
        assert record_callback(receiver, delivery_id=key, verdict="accepted", **fields) == "accepted"
        # A replay: refused by the unique index, and recorded as such through the owner's function (the
        # receiver reads no row itself).
        assert record_callback(receiver, delivery_id=key, verdict="accepted", **fields) == "replayed"
        assert "permission denied for table events" in refused(receiver, "SELECT count(*) FROM events")
        assert "permission denied for table vendor_callbacks" in refused(
            receiver, "SELECT count(*) FROM vendor_callbacks"
        )
        assert "permission denied" in refused(
            receiver, "UPDATE vendor_callbacks SET verdict = 'forged' WHERE operation_key = :k", k=key
        )
        assert "permission denied" in refused(
            receiver, "DELETE FROM vendor_callbacks WHERE operation_key = :k", k=key
        )
        assert "permission denied for table events" in refused(
            receiver,
            "INSERT INTO events (task_id, seq, type, epoch, dedup_key, payload)"
            " VALUES ('t', 1, 'Noted', 1, :k, '{}')",
            k=key,
        )
        assert "permission denied" in refused(receiver, "SELECT count(*) FROM task_leases")
    finally:
        receiver.dispose()
    owner = open_engine(pg_url, pool_size=1)
    try:
        rows = callbacks_for(owner, key)
    finally:
        owner.dispose()
    assert [(r.verdict, r.body) for r in rows] == [("accepted", {"status": "succeeded"}), ("replayed", None)]
    assert rows[1].reason.startswith(f"delivery {key} was already accepted at {rows[0].received_at.year}")


def test_db_roles_makes_member_only_logins_with_hashed_passwords_and_refuses_bad_input(
    recorder, pg_url, logins, tmp_path
):
    with sa.create_engine(pg_url, poolclass=sa.pool.NullPool).connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT r.rolname, r.rolsuper, r.rolcreaterole, r.rolcanlogin, left(a.rolpassword, 14),"
                " ARRAY(SELECT g.rolname FROM pg_auth_members m JOIN pg_roles g ON g.oid = m.roleid"
                "       WHERE m.member = r.oid ORDER BY 1)"
                " FROM pg_roles r JOIN pg_authid a ON a.oid = r.oid WHERE r.rolname LIKE 'lf\\_%' ORDER BY 1"
            )
        ).all()
        groups = conn.execute(
            sa.text(
                "SELECT rolname, rolcanlogin FROM pg_roles WHERE rolname LIKE 'ledgerflow\\_%' ORDER BY 1"
            )
        ).all()
    assert [tuple(r) for r in rows] == [
        ("lf_operator", False, False, True, "SCRAM-SHA-256$", ["ledgerflow_operator"]),
        ("lf_reader", False, False, True, "SCRAM-SHA-256$", ["ledgerflow_reader"]),
        ("lf_receiver", False, False, True, "SCRAM-SHA-256$", ["ledgerflow_receiver"]),
        ("lf_worker", False, False, True, "SCRAM-SHA-256$", ["ledgerflow_worker"]),
    ]
    assert [tuple(g) for g in groups] == [
        ("ledgerflow_operator", False),
        ("ledgerflow_reader", False),
        ("ledgerflow_receiver", False),
        ("ledgerflow_worker", False),
    ]
    env = {"LEDGERFLOW_DATABASE_URL": pg_url}
    rc, out, err = cli(tmp_path, "db", "roles", env=env)
    assert (rc, err.strip()) == (
        2,
        "error: no password given: set one or more of " + ", ".join(roles.ENV.values()),
    )
    rc, out, err = cli(tmp_path, "db", "roles", env={**env, "LEDGERFLOW_DB_READER_PASSWORD": "short"})
    assert (rc, err.strip()) == (2, "error: LEDGERFLOW_DB_READER_PASSWORD is shorter than 16 characters")
    rc, out, err = cli(tmp_path, "db", "roles", env={**env, **PASSWORDS})
    assert rc == 0, err
    assert out.splitlines() == [
        f"{user}: password and membership updated (member of {roles.GROUPS[kind]} only)"
        for kind, user in roles.USERS.items()
    ]


async def test_a_worker_on_its_own_login_runs_a_whole_task_and_a_signed_add_budget(
    logins, lf_on, recorder, sim
):
    """The whole path on the worker's login: open the task, enter the admission queue, reserve, dispatch,
    settle, escalate on budget, record a person's signed add_budget (the one ceiling change a worker makes),
    resume, complete and give its place back."""
    await sim.configure(executors={"llm.text": {"cost_multiplier": "3"}})
    async with lf_on(logins["worker"], active_tasks=1) as lf:
        assert lf.settings.database_url == logins["worker"]
        plan = lf.plan(
            """
goal: an expensive storyboard, on the worker's own database login
budget_ceiling: 3
stages:
  - {id: board, executor: llm.text, estimate: 1}
  - {id: shots, executor: image.keyframe, estimate: 1, depends_on: [board]}
"""
        )
        handle = await lf.start(plan)
        rid = await wait_open(lf, plan.task_id, "escalation:")
        p = fold(lf.recorder.read_events(plan.task_id))
        assert p.state == TaskState.ESCALATED and "budget exhausted" in (p.escalation_reason or "")
        sent = await people.decide(
            lf.settings, demo_key("producer"), plan.task_id, rid, "add-budget", amount="5"
        )
        assert (sent.status, sent.detail) == ("accepted", "add_budget 5 by producer")
        result = await handle.result()
    assert result.state == "Completed"
    account = lf.recorder.account(f"task:{plan.task_id}")
    assert account is not None and account.ceiling == Decimal(8)
    assert account.reserved == 0 and account.spent == fold(lf.recorder.read_events(plan.task_id)).spent
    with lf.recorder._engine.connect() as conn:  # it entered, was admitted and gave its place back
        left = conn.exec_driver_sql(
            "SELECT count(*) FROM task_admission WHERE task_id = %(t)s", {"t": plan.task_id}
        ).scalar_one()
    assert left == 0


def test_compose_connects_nothing_as_a_superuser():
    """Statically (no Docker engine here): each ledgerflow service logs in as its own role, the owner is made
    CREATEROLE and never SUPERUSER, and the image's bootstrap superuser loses its password on first start."""
    import yaml

    root = Path(__file__).resolve().parents[2]
    compose = yaml.safe_load((root / "docker-compose.yml").read_text())
    users = {
        name: sa.engine.make_url(svc["environment"]["LEDGERFLOW_DATABASE_URL"]).username
        for name, svc in compose["services"].items()
        if "LEDGERFLOW_DATABASE_URL" in (svc.get("environment") or {})
    }
    assert users == {
        "migrate": "ledger_owner",
        "worker": "lf_worker",
        "worker-exporter": "lf_worker",
        "cli": "lf_operator",
        "review": "lf_reader",  # the reviewer page reads, and records logouts
    }
    init = (root / "ops" / "compose" / "ledger-db-init.sh").read_text()
    assert "CREATE ROLE ledger_owner LOGIN CREATEROLE NOSUPERUSER" in init
    assert "ALTER ROLE CURRENT_USER PASSWORD NULL;" in init
    mounts = compose["services"]["ledger-db"]["configs"]
    assert mounts == [
        {"source": "ledger-db-init", "target": "/docker-entrypoint-initdb.d/10-ledger-owner.sh"}
    ]
