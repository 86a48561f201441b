"""Issue 29 §3, end to end: E001 with its motion shots at a Replicate-style vendor that calls back.

Real parts: Temporal, Postgres, the simulator's Replicate dialect calling webhooks (Standard Webhooks,
signed) and the webhook receiver in a process of its own (``ledgerflow webhooks serve``, logged in as
``lf_receiver``). The worker's motion attempts wait on the receiver's wake-up with a window (60 s) far longer
than the whole run may take, so every shot finishing within seconds of its callback proves the callbacks
drove the task; a forged and a replayed callback are refused, recorded, and change nothing; the money is
checked from the vendor's own billing. With callbacks lost, the polling fallback finishes the task.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import yaml

from ledger import roles
from ledger.callbacks import callbacks_for, open_engine
from ledger.recorder import Recorder
from ledgerflow.webhooks.signatures import sign_standard
from rules.events import parse, vendor_spend
from rules.keys import operation_key
from vendors.routes import AdapterKind, CallbackSpec, Price, RouteSpec, VendorMode, default_table
from vendors.simulator.config import WebhookFate, WebhookHabits
from vendors.simulator.predictions import PRICE_PER_SECOND

ROOT = Path(__file__).resolve().parents[2]
E001 = (ROOT / "examples" / "e001_video.yaml").read_text()
SECRET = "whsec_" + "ZTAwMS13ZWJob29rLXNlY3JldC0wMTIzNDU2Nzg5YWI="
SECRET_ENV = "LF_TEST_E001_HOOK"
PASSWORD = "test-e001-receiver-password-0123"
WINDOW = 10.0  # seconds a motion attempt waits for its callback before it polls the vendor anyway


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def receiver(routes_file: Path, database_url: str) -> Iterator[str]:
    """``ledgerflow webhooks serve`` in its own process; its base URL."""
    port = free_port()
    env = {
        **os.environ,
        "LEDGERFLOW_ROUTES_FILE": str(routes_file),
        "LEDGERFLOW_DATABASE_URL": database_url,
        SECRET_ENV: SECRET,
    }
    argv = [sys.executable, "-m", "ledgerflow.cli", "webhooks", "serve", "--port", str(port)]
    log = (routes_file.parent / "receiver.log").open("wb")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                log.close()
                pytest.fail(f"the receiver exited: {Path(log.name).read_text()[-2000:]}")
            assert time.monotonic() < deadline, "the receiver did not start"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def motion_route(hook: str, window: float) -> RouteSpec:
    table = default_table()
    base = table.routes["video.motion"]
    return base.model_copy(
        update={
            "adapter": AdapterKind.PREDICTIONS.value,
            "mode": VendorMode.LOOKUP_ONLY,
            "webhook_url": f"{hook}/callbacks/video.motion?operation_key={{operation_key}}",
            "callback": CallbackSpec(secret_env=SECRET_ENV, window=window),
            # Replicate's answers carry no rights metadata: the route declares the terms its outputs come
            # under (the E001 plan's compliance check requires them).
            "rights": {"license": "vendor-commercial", "holder": "ledgerflow-demo"},
            "price": Price(per_second=PRICE_PER_SECOND),  # Replicate states no cost: predict_time is priced
        }
    )


@pytest.fixture
def receiver_login(recorder: Recorder, pg_url: str) -> str:
    roles.ensure_logins(pg_url, {roles.ENV["receiver"]: PASSWORD})
    url = sa.engine.make_url(pg_url).set(username=roles.USERS["receiver"], password=PASSWORD)
    return url.render_as_string(hide_password=False)


@pytest.fixture
def owner(pg_url: str) -> Iterator[sa.Engine]:
    engine = open_engine(pg_url, pool_size=1)
    yield engine
    engine.dispose()


def seed_with_every_habit(task_id: str, habits: WebhookHabits) -> int:
    """A simulator seed under which this task's 19 motion predictions draw each misbehaviour at least once
    (each prediction's fate is drawn from the seed and its OperationKey): the test never depends on luck. A
    replay is a genuine delivery sent twice: a forged one sent twice is refused as forged both times (seen: a
    task id whose only duplicates were forgeries, no "replayed" verdict to find)."""
    keys = [operation_key(task_id, f"motion/S{i:02d}", 1) for i in range(1, 20)]
    for seed in range(10_000):
        fates = [WebhookFate.for_prediction(seed, key, 0, habits) for key in keys]
        replayed = any(f.duplicate and not f.forge for f in fates)
        if replayed and all(any(getattr(f, habit) for f in fates) for habit in ("forge", "early")):
            return seed
    raise AssertionError("no seed draws every habit")


def outcome_at(events: list[Any], op: str) -> Any:
    [at] = [e.recorded_at for e in events if e.type == "Outcome" and e.operation_key == op]
    return at


def table_with(route: RouteSpec) -> Any:
    table = default_table()
    return table.model_copy(update={"routes": {**table.routes, "video.motion": route}})


async def test_e001_completes_on_callbacks_with_a_forged_and_a_replayed_one_refused(
    lf_with: Any, sim: Any, receiver_login: str, owner: sa.Engine, tmp_path: Path
) -> None:
    routes_file = tmp_path / "receiver-routes.yaml"
    table = table_with(motion_route("https://hooks.example.com", WINDOW))
    routes_file.write_text(yaml.safe_dump(table.model_dump(mode="json")))
    with receiver(routes_file, receiver_login) as url:
        # The vendor calls the public hook URL; here that host is the receiver's address (rewrite_host).
        # Some deliveries are sent twice (a replay), some signed with another key (a forgery), some preceded
        # by a signed "succeeded" while the prediction still runs (a lie).
        habits = WebhookHabits(secret=SECRET, rewrite_host=url, duplicate=0.25, forge=0.15, early=0.2)
        async with lf_with(routes=table) as lf:
            plan = lf.plan(E001)
            await sim.configure(
                seed=seed_with_every_habit(plan.task_id, habits),
                webhooks=habits.model_dump(mode="json"),
                executors={"video.motion": {"latency_seconds": 0.3}},
            )
            result = await lf.run(plan)

    events = lf.recorder.read_events(plan.task_id)
    assert result.state == "Completed", [
        (e.type, e.payload) for e in events if e.type in ("Failure", "ExecutionResult", "Escalation")
    ][:6]
    outcomes = {
        e.operation_key: parse(e)
        for e in events
        if e.type == "Outcome" and e.payload.get("node", "").startswith("motion/")
    }
    assert len(outcomes) == 19, f"19 motion shots, got {len(outcomes)}"
    deliveries = (await sim.http.get("/admin/webhooks")).json()
    forged_sent = [d for d in deliveries if d["forged"]]
    replays_sent = [d for d in deliveries if d["duplicate_of"]]
    assert forged_sent and replays_sent, "the vendor forged and replayed at least one callback each"

    by_verdict: dict[str, int] = {}
    woken_by: dict[str, Any] = {}
    for op in outcomes:
        rows = callbacks_for(owner, op)
        for row in rows:
            by_verdict[row.verdict] = by_verdict.get(row.verdict, 0) + 1
        accepted = [r for r in rows if r.verdict == "accepted"]
        ids = [r.delivery_id for r in accepted]
        assert len(ids) == len(set(ids)), f"{op}: a delivery was accepted twice"
        if any(r.claimed_status == "succeeded" for r in accepted[-1:]) and not [
            d for d in deliveries if d["webhook_id"] == accepted[-1].delivery_id and d["early"]
        ]:
            woken_by[op] = accepted[-1]  # the genuine end (an early lie may have come before it)
    assert by_verdict.get("forged", 0) >= len({d["prediction_id"] for d in forged_sent}) >= 1
    assert by_verdict.get("replayed", 0) >= 1, by_verdict
    lied = {d["prediction_id"] for d in deliveries if d["early"]}
    assert lied, "the vendor sent at least one early lie"
    # A lie woke its shot early, and changed nothing: the shot read the prediction (still running) and
    # waited on; no Outcome is recorded before the prediction really ended (its genuine callback).
    for op, row in woken_by.items():
        lies = [r for r in callbacks_for(owner, op) if r.received_at < row.received_at]
        for lie in lies:
            assert outcome_at(events, op) > lie.received_at
    # Each shot whose callback was accepted ended well within the window after it: the callback woke its
    # attempt, which read the prediction from the vendor itself. A shot whose only callback was forged ended
    # by the polling fallback, a window after its prediction was accepted.
    ended = {e.operation_key: e.recorded_at for e in events if e.type == "Outcome"}
    accepted_at = {e.operation_key: e.recorded_at for e in events if e.type == "Progress"}
    assert woken_by, "no callback was accepted"
    lags = []
    for op, row in woken_by.items():
        lag = (ended[op] - row.received_at).total_seconds()
        lags.append(lag)
        assert -1.0 < lag < WINDOW / 2, f"{op}: recorded {lag:.1f}s after its callback"
    unheard = set(outcomes) - set(woken_by)
    assert unheard, "a forged delivery left at least one shot without a genuine callback"
    waits = []
    for op in unheard:
        waited = (ended[op] - accepted_at[op]).total_seconds()
        waits.append(waited)
        assert waited >= WINDOW - 0.5, f"{op}: no genuine callback, yet it ended {waited:.1f}s after its job"
    print(
        f"{len(lags)} shots woken by their callback: Outcome {max(lags):.2f}s after it at most; "
        f"{len(waits)} without one: ended {min(waits):.1f}-{max(waits):.1f}s after their job "
        f"(window {WINDOW:g}s)"
    )

    # The money, from the vendor's own billing: one charge per operation, ledger = vendor.
    charges = await sim.charges(f"{plan.task_id}:")
    keys = [c["idempotency_key"] for c in charges]
    assert len(keys) == len(set(keys)), "charged twice"
    assert vendor_spend(events) == await sim.total(plan.task_id)


async def test_a_forged_callback_aimed_at_a_waiting_shot_is_refused_and_changes_nothing(
    receiver_login: str, owner: sa.Engine, tmp_path: Path
) -> None:
    """An attacker who knows an operation's key but not the secret is refused and recorded; a genuine
    delivery is accepted once, and the same delivery again is a replay."""
    routes_file = tmp_path / "receiver-routes.yaml"
    table = table_with(motion_route("https://hooks.example.com", WINDOW))
    routes_file.write_text(yaml.safe_dump(table.model_dump(mode="json")))
    op = f"t-attack-{time.time_ns()}:motion/S01:1"
    body = b'{"id": "pred_x", "status": "succeeded", "metrics": {"predict_time": 0.001}}'
    with receiver(routes_file, receiver_login) as url:
        other_key = "whsec_" + "d3Jvbmcta2V5LTAxMjM0NTY3ODlhYmNkZWY="
        forged = sign_standard(other_key, "msg_1", int(time.time()), body)
        genuine = sign_standard(SECRET, "msg_2", int(time.time()), body)
        async with httpx.AsyncClient(base_url=url, params={"operation_key": op}) as client:
            answers = [
                (await client.post("/callbacks/video.motion", content=body, headers=headers)).status_code
                for headers in (forged, genuine, genuine)
            ]
    assert answers == [401, 204, 200]
    assert [(r.verdict, r.delivery_id) for r in callbacks_for(owner, op)] == [
        ("forged", "msg_1"),
        ("accepted", "msg_2"),
        ("replayed", "msg_2"),
    ]
