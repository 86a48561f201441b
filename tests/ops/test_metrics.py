"""The worker's /metrics and /healthz on real servers (runtime/metrics.py).

Every business metric is checked against the ledger it is derived from: a project of its own per test (the
database is shared by the session), a handful of tasks that leave each kind of fact behind (a spend above
the estimate, failures, an operation in flight, open and decided requests, a first review that passed and
one that did not, a delivered episode), then one scrape.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from decimal import Decimal
from typing import Any

import httpx
import pytest
from metricskit import exporter, fresh_ledger, scrape
from temporalio.client import Client

from ledger.recorder import Recorder
from ledgerflow.stack.pg import free_port
from ledgerflow.views import people
from rules.actions import RequestKind
from rules.events import FailureKind, parse
from rules.projection import fold
from rules.scopes import ScopeKind
from runtime.metrics import (
    LedgerCollector,
    MetricsServer,
    MetricsSettings,
    known_routes,
    sdk_runtime,
    serve_metrics,
)
from runtime.settings import ConfigError
from runtime.signing import demo_key
from vendors.routes import RouteTable, deployment_table

DONE = """
goal: a two-shot clip, delivered
project: {project}
budget_ceiling: 20
compose: {{video: [clip]}}
stages:
  - {{id: art, executor: image.keyframe, estimate: 1}}
  - {{id: clip, executor: video.motion, estimate: 0.5, fan_out: 2, canary: false, depends_on: [art],
      input: {{format: mp4, duration_s: 1, width: 64, height: 36}}}}
"""
APPROVALS = """
goal: two boards a person approves
project: {project}
budget_ceiling: 10
approval: {{timeout: 1h, policy: escalate}}
stages:
  - {{id: board1, executor: llm.text, estimate: 0.5, approval: true}}
  - {{id: board2, executor: llm.text, estimate: 0.5, approval: true}}
"""
DEAD_LETTER = """
goal: a mix the vendor always fails
project: {project}
budget_ceiling: 10
stages:
  - {{id: mix, executor: audio.mix, estimate: 0.2, retries: 1}}
"""
REWORK = """
goal: a title card nobody likes ({token})
project: {project}
budget_ceiling: 10
rework_limit: 0
stages:
  - {{id: card, executor: graphics.render, estimate: 0.2}}
"""
PLAIN = """
goal: one paragraph
project: {project}
budget_ceiling: 1
stages:
  - {{id: text, executor: llm.text, estimate: 0.1}}
"""
IN_FLIGHT = """
goal: subtitles that take a while
project: {project}
budget_ceiling: 10
stages:
  - {{id: subs, executor: subtitle.render, estimate: 0.3}}
"""


@contextmanager
def metrics_server(database_url: str, client: Client) -> Iterator[MetricsServer]:
    settings = MetricsSettings(metrics_port=free_port())
    with serve_metrics(settings, database_url, client, asyncio.get_running_loop(), sdk=False) as server:
        yield server


def executors(events: list[Any]) -> dict[str, str]:
    """Operation key -> the executor its INTENT names (``gate`` for a static gate)."""
    out = {}
    for e in events:
        if e.type == "Intent" and e.operation_key:
            action = e.payload["action"]
            out[e.operation_key] = "gate" if action["kind"] == "StaticGate" else action["executor"]
    return out


def spend_by_executor(recorder: Recorder, task_ids: list[str]) -> dict[str, Decimal]:
    """Every cost the ledger records for these tasks, by executor: computed here from the events."""
    total: dict[str, Decimal] = defaultdict(Decimal)
    for task_id in task_ids:
        events = recorder.read_events(task_id)
        executor_of = executors(events)
        for e in events:
            if e.type in ("Outcome", "Failure", "ExecutionResult"):
                cost = e.payload["actual_cost"]
            elif e.type == "Decision":
                cost = e.payload["cost"]
            elif e.type == "SystemMarker" and e.payload["kind"] == "late_charge":
                cost = e.payload["amount"]
            else:
                continue
            total[executor_of.get(e.operation_key or "", "planner")] += Decimal(cost)
    return dict(total)


async def wait_for(what: str, check: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    return found


def nonzero(series: dict[Any, float]) -> dict[Any, float]:
    """The samples of a series that are not 0 (every known label set is exported, at 0 when empty)."""
    return {k: v for k, v in series.items() if v}


def open_request(recorder: Recorder, task_id: str, request_id: str) -> bool:
    r = fold(recorder.read_events(task_id)).requests.get(request_id)
    return r is not None and r.open


async def test_metrics_are_the_ledgers_numbers_for_a_project(lf, sim):
    project, token = f"m{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    blame = {"scores": {"visual": 0.4}, "blame": {"visual": ["card"]}, "reasons": ["off brand"]}
    await sim.configure(
        executors={
            "image.keyframe": {"cost": "1.5"},  # above its estimate of 1: a cost anomaly
            "audio.mix": {"fail_technical": 1.0},  # two attempts fail: a dead letter
            "subtitle.render": {"latency_seconds": 60},  # in flight while we scrape
        },
        chat_script=[{"match": token, "content": json.dumps(blame)}],  # the first review asks for rework
    )
    plans = {
        name: lf.plan(text.format(project=project, token=token))
        for name, text in [
            ("done", DONE),
            ("approvals", APPROVALS),
            ("dead", DEAD_LETTER),
            ("rework", REWORK),
            ("flight", IN_FLIGHT),
        ]
    }
    ids = {name: plan.task_id for name, plan in plans.items()}
    handles = {name: await lf.start(plan) for name, plan in plans.items()}

    assert (await handles["done"].result()).state == "Completed"
    await lf.wait_state(handles["dead"], {"WaitingHuman"})
    await lf.wait_state(handles["rework"], {"Escalated"})
    for board in ("approval:board1:v1", "approval:board2:v1"):
        await wait_for(board, lambda b=board: open_request(lf.recorder, ids["approvals"], b))
    await people.decide(lf.settings, demo_key("director"), ids["approvals"], "approval:board1:v1", "approve")

    def in_flight() -> str | None:
        ops = executors(lf.recorder.read_events(ids["flight"]))
        return next(iter(ops), None)

    await wait_for("the slow operation's INTENT", in_flight)

    with metrics_server(lf.settings.resolved_database_url(), lf.client) as server:
        before = datetime.now().astimezone()
        m = await scrape(server.url)
        after = datetime.now().astimezone()

    assert m.value("ledgerflow_ledger_up") == 1

    # Spend: what the events record, by executor; in all, what the project's budget account says it spent.
    tasks = list(ids.values())
    expected = spend_by_executor(lf.recorder, tasks)
    spend = m.series("ledgerflow_spend_total", project=project)
    assert spend == {(("executor", k),): float(v) for k, v in expected.items()} | {
        (("executor", "subtitle.render"),): 0.0
    }
    assert spend[(("executor", "subtitle.render"),)] == 0  # in flight: nothing settled yet, shown as 0
    # Every (project, executor) family has the same label sets: a pair the ledger knows is never a gap.
    pairs = set(spend)
    for family in ("ledgerflow_reserved", "ledgerflow_open_operations", "ledgerflow_cost_anomalies_total"):
        assert set(m.series(family, project=project)) == pairs, family
    assert spend[(("executor", "image.keyframe"),)] == 1.5
    account = lf.recorder.account(f"project:{project}")
    assert account is not None
    assert sum(expected.values()) == account.spent
    assert sum(spend.values()) == pytest.approx(float(account.spent))

    # Anomalies and failures: the one charge above its estimate; both attempts of the mix.
    assert nonzero(m.series("ledgerflow_cost_anomalies_total", project=project)) == {
        (("executor", "image.keyframe"),): 1
    }
    failures = m.series("ledgerflow_failures_total", project=project)
    assert nonzero(failures) == {(("executor", "audio.mix"), ("kind", "technical")): 2}
    assert len(failures) == len(pairs) * len(FailureKind)  # every kind of every pair, 0 where none

    # In flight: the slow subtitles, holding their estimate; what the project's account holds reserved.
    assert nonzero(m.series("ledgerflow_open_operations", project=project)) == {
        (("executor", "subtitle.render"),): 1
    }
    assert nonzero(m.series("ledgerflow_reserved", project=project)) == {
        (("executor", "subtitle.render"),): 0.3
    }
    assert account.reserved == Decimal("0.3")

    # People: board2 still open (board1 decided), the dead letter, the rework-limit escalation.
    assert m.series("ledgerflow_human_queue_depth", project=project) == {
        (("kind", "approval"),): 1,
        (("kind", "dead_letter"),): 1,
        (("kind", "escalation"),): 1,
        (("kind", "invalid_decision"),): 0,
    }
    assert m.value("ledgerflow_dead_letters_open", project=project) == 1
    asked = {
        parse(e).action.request.id: e.recorded_at  # type: ignore[union-attr]
        for e in lf.recorder.read_events(ids["approvals"])
        if e.type == "Intent" and e.payload["action"]["kind"] == "SuspendForHuman"
    }
    oldest = m.value("ledgerflow_human_oldest_wait_seconds", project=project, kind="approval")
    slack = 0.5  # the database's clock and ours, read a moment apart
    assert (before - asked["approval:board2:v1"]).total_seconds() - slack <= oldest
    assert oldest <= (after - asked["approval:board2:v1"]).total_seconds() + slack
    decided = next(e for e in lf.recorder.read_events(ids["approvals"]) if e.type == "HumanDecision")
    waited = (decided.recorded_at - asked["approval:board1:v1"]).total_seconds()
    assert nonzero(m.series("ledgerflow_human_wait_seconds_count", project=project)) == {
        (("kind", "approval"),): 1
    }
    assert m.value("ledgerflow_human_wait_seconds_sum", project=project, kind="approval") == pytest.approx(
        waited, abs=1e-6
    )

    # Reviews: the delivered clip passed first time; the title card's first review asked for rework.
    assert nonzero(m.series("ledgerflow_first_reviews_total", project=project)) == {
        (("verdict", "Pass"),): 1,
        (("verdict", "QualityRework"),): 1,
    }
    assert m.value("ledgerflow_review_first_pass_ratio", project=project) == 0.5

    # Delivered output: the composed clip (two shots of 1 s), and what the whole task cost per second of it.
    compose = [
        e
        for e in lf.recorder.read_events(ids["done"])
        if e.type == "Outcome" and e.payload["node"] == "compose"
    ]
    seconds = compose[-1].payload["artifact"]["media"]["duration_s"]
    assert seconds == pytest.approx(2.0, abs=0.1)
    task_account = lf.recorder.account(f"task:{ids['done']}")
    assert task_account is not None
    assert m.value("ledgerflow_usable_output_seconds_total", project=project) == seconds
    assert m.value("ledgerflow_cost_per_usable_second", project=project) == pytest.approx(
        float(task_account.spent) / seconds
    )

    for name in ("approvals", "dead", "rework", "flight"):
        await handles[name].terminate("test over")


async def test_healthz_is_ready_only_with_temporal_and_the_ledger(temporal, pg_url):
    async with httpx.AsyncClient(timeout=10) as http:
        with metrics_server(pg_url, temporal) as server:
            r = await http.get(f"{server.url}/healthz")
            assert (r.status_code, r.json()) == (200, {"status": "ok"})

        bad_ledger = f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/ledger"
        with metrics_server(bad_ledger, temporal) as server:
            r = await http.get(f"{server.url}/healthz")
            assert r.status_code == 503 and r.json()["reason"].startswith("ledger: ")
            assert r.text.count("\n") == 1  # one line
            m = await scrape(server.url)  # still answers, and says the ledger's numbers are missing
            assert m.value("ledgerflow_ledger_up") == 0
            assert not m.series("ledgerflow_spend_total")

        nowhere = await Client.connect(f"127.0.0.1:{free_port()}", lazy=True)
        with metrics_server(pg_url, nowhere) as server:
            r = await http.get(f"{server.url}/healthz")
            assert r.status_code == 503 and r.json()["reason"].startswith("temporal: ")

        with metrics_server(pg_url, temporal) as server:
            assert (await http.get(f"{server.url}/nothing")).status_code == 404


def test_metrics_are_off_unless_a_port_is_set(monkeypatch):
    for name in ("LEDGERFLOW_METRICS_PORT", "LEDGERFLOW_METRICS_SDK_PORT"):
        monkeypatch.delenv(name, raising=False)
    settings = MetricsSettings()
    assert settings.metrics_port is None and sdk_runtime(settings) is None  # the default runtime, no server
    monkeypatch.setenv("LEDGERFLOW_METRICS_PORT", "9464")
    assert MetricsSettings().sdk_port() == 9465


async def test_a_taken_port_is_a_one_line_config_error(temporal, pg_url):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        settings = MetricsSettings(metrics_port=port)
        with (
            pytest.raises(ConfigError, match=f"^LEDGERFLOW_METRICS_PORT {port}: "),
            serve_metrics(settings, pg_url, temporal, asyncio.get_running_loop(), sdk=False),
        ):
            pass


def with_fallback(table: RouteTable) -> RouteTable:
    """``table`` with a fallback for video.motion (``video.motion.backup``, qualified for an hour)."""
    routes = {name: spec.model_dump() for name, spec in table.routes.items()}
    routes["video.motion"]["fallbacks"] = ["video.motion.backup"]
    routes["video.motion.backup"] = routes["video.motion"] | {
        "fallbacks": [],
        "regression": "motion.yaml",
        "qualification_max_age": 3600.0,
    }
    return RouteTable.model_validate(table.model_dump() | {"routes": routes})


# The families a ledger with nothing in flight, no request, no failure and no billing finding still exports,
# each of its samples at 0 (beside them: spend, attempts, output seconds, the first review, the timestamps).
IDLE_ZERO = (
    "ledgerflow_reserved",
    "ledgerflow_open_operations",
    "ledgerflow_open_operation_oldest_seconds",
    "ledgerflow_failures_total",
    "ledgerflow_cost_anomalies_total",
    "ledgerflow_tasks_unfinished",
    "ledgerflow_task_no_progress_seconds",
    "ledgerflow_human_queue_depth",
    "ledgerflow_dead_letters_open",
    "ledgerflow_human_oldest_wait_seconds",
    "ledgerflow_human_wait_seconds_count",
    "ledgerflow_human_wait_seconds_sum",
    "ledgerflow_budget_accounts_over_ceiling",
    "ledgerflow_budget_overrun",
    "ledgerflow_billing_unknown_charges_total",
    "ledgerflow_billing_ambiguous_charges_total",
    "ledgerflow_billing_credits_total",
    "ledgerflow_billing_unmatched_amount_total",
    "ledgerflow_billing_reconciled_at",
    "ledgerflow_route_qualified_at",
    "ledgerflow_route_fallback_qualified",
)


async def test_an_idle_ledger_exports_every_family_at_zero_for_its_known_label_sets(lf_on, pg_url, sim):
    """A fresh ledger, then the same ledger after one task completed: every family has a sample for each
    known label set (the route file's routes, the project that has a task, the fixed kinds), at 0 where the
    ledger has nothing, instead of no sample at all."""
    project = f"z{uuid.uuid4().hex[:10]}"
    with fresh_ledger(pg_url) as url:
        async with lf_on(url) as lf:
            table = with_fallback(deployment_table(lf.settings))
            routes = known_routes(table)
            with exporter(url, lf.client, routes=routes) as server:
                empty = await scrape(server.url)
                plan = lf.plan(PLAIN.format(project=project))
                assert (await lf.run(plan)).state == "Completed"
                idle = await scrape(server.url)

    # Empty: no project yet, so what is keyed by route or by a fixed kind is there, at 0 (a breaker: closed).
    assert empty.value("ledgerflow_ledger_up") == 1
    for route in table.routes:
        assert empty.series("ledgerflow_route_breaker", route=route) == {
            (("state", "closed"),): 1,
            (("state", "open"),): 0,
            (("state", "half_open"),): 0,
        }
        assert empty.value("ledgerflow_route_qualified_at", route=route) == 0
        for family in ("unknown_charges", "ambiguous_charges", "credits"):
            assert empty.value(f"ledgerflow_billing_{family}_total", route=route) == 0
    assert empty.series("ledgerflow_route_fallback_qualified") == {(("route", "video.motion.backup"),): 0}
    assert empty.series("ledgerflow_budget_accounts_over_ceiling") == {
        (("kind", k.value),): 0 for k in ScopeKind
    }
    assert empty.value("ledgerflow_billing_reconciled_at") == 0

    # Idle, after one task: the project's families too, each of their samples at 0.
    assert idle.value("ledgerflow_human_queue_depth", project=project, kind="dead_letter") == 0
    assert idle.value("ledgerflow_dead_letters_open", project=project) == 0
    opened = idle.series("ledgerflow_open_operations", project=project)
    assert (("executor", "llm.text"),) in opened and set(opened.values()) == {0}  # compose, review too
    assert idle.value("ledgerflow_task_no_progress_seconds", project=project) == 0
    assert idle.value("ledgerflow_tasks_unfinished", project=project) == 0
    assert idle.value("ledgerflow_spend_total", project=project, executor="llm.text") > 0
    assert idle.value("ledgerflow_attempts_total", project=project, executor="llm.text") == 1
    for family in IDLE_ZERO:
        values = list(idle.series(family).values())
        assert values, f"{family} has no sample"
        assert set(values) == {0}, family
    assert len(idle.series("ledgerflow_human_oldest_wait_seconds", project=project)) == len(RequestKind)
    assert len(idle.series("ledgerflow_failures_total", project=project)) == len(opened) * len(FailureKind)
    # A ratio with nothing to divide is left out, not a false 0 (no review ran, no second was delivered).
    assert not idle.series("ledgerflow_cost_per_usable_second", project=project)


async def test_only_the_exporter_serves_the_ledgers_families(temporal, pg_url):
    with exporter(pg_url, temporal, ledger=False) as server:
        local = await scrape(server.url)
    with exporter(pg_url, temporal) as server:
        leader = await scrape(server.url)
    assert local.value("ledgerflow_metrics_ledger_exporter") == 0
    assert {n for n in local.names if n.startswith("ledgerflow_")} == {"ledgerflow_metrics_ledger_exporter"}
    assert leader.value("ledgerflow_metrics_ledger_exporter") == 1
    assert leader.value("ledgerflow_ledger_up") == 1
    assert "ledgerflow_spend_total" in leader.names


def test_the_ledger_exporter_is_on_unless_turned_off(monkeypatch):
    monkeypatch.delenv("LEDGERFLOW_METRICS_LEDGER", raising=False)
    assert MetricsSettings().metrics_ledger
    monkeypatch.setenv("LEDGERFLOW_METRICS_LEDGER", "false")
    assert not MetricsSettings().metrics_ledger


def test_admission_is_exported_per_task_queue(recorder: Recorder) -> None:
    """Waiting and admitted tasks and the oldest wait, per task queue (ledger.admission); the worker's own
    queue at 0 while nothing of it waits."""
    q, idle = f"q-{uuid.uuid4().hex[:10]}", f"idle-{uuid.uuid4().hex[:10]}"
    recorder.admit(f"{q}-a", q, 3, 1, enter=True)
    recorder.admit(f"{q}-b", q, 3, 1, enter=True)
    time.sleep(0.05)  # the wait is measured on the database's clock
    families = {f.name: f for f in LedgerCollector(recorder._engine, queues=(idle,)).collect()}

    def value(name: str, queue: str) -> float:
        return next(s.value for s in families[name].samples if s.labels == {"queue": queue})

    try:
        assert (value("ledgerflow_admission_waiting", q), value("ledgerflow_admission_admitted", q)) == (1, 1)
        assert value("ledgerflow_admission_oldest_wait_seconds", q) >= 0.05
        assert value("ledgerflow_admission_waiting", idle) == 0
        assert value("ledgerflow_admission_oldest_wait_seconds", idle) == 0
    finally:
        for t in (f"{q}-a", f"{q}-b"):
            recorder.release_admission(t, q, 1)
