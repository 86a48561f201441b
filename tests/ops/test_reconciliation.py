"""Billing reconciled continuously (issue 23 §4), on the real servers: a Temporal Schedule runs the
reconciliation, which lists every listable route's charges at the vendor (the simulator), matches each to
exactly one operation of the ledger, and records what it cannot match — a charge nobody knows, one two
operations claim — and every credit, in its own append-only record (``billing_reconciliation``), which
``/metrics`` counts.

The simulator's billing account is shared by the whole session (other tests leave charges in it that no
operation knows), so each test names its own charges and reads the counter before and after.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from metricskit import scrape
from peoplekit import cli
from temporalio.client import ScheduleActionStartWorkflow

from activities.billing import ReconcileInput
from ledger import reconciliation as store
from ledgerflow.stack.pg import free_port
from ledgerflow.views.billing import reconcile_once, schedule_id, schedule_reconciliation
from ledgerflow.views.schedules import SCANS
from ledgerflow.views.schedules import schedule_id as scans_schedule_id
from reconcile.billing import accounts
from rules.events import parse
from runtime.metrics import MetricsSettings, serve_metrics
from vendors.routes import AdapterKind, Price, RouteSpec, RouteTable, deployment_table
from workflows.reconciliation import BillingReconciliationWorkflow

PIPELINE = """
goal: frames to reconcile
budget_ceiling: 20
review: {{reviewers: [compliance.rules], estimate: 0, require_rights: false}}
stages:
  - {{id: frames, executor: {image}, estimate: 0.50, fan_out: 3, canary: false}}
"""
UNKNOWN = "ledgerflow_billing_unknown_charges_total"


def routes(tag: str, *, extra: dict[str, RouteSpec] | None = None) -> RouteTable:
    return RouteTable(routes={f"image.{tag}": RouteSpec(adapter=AdapterKind.JOBS), **(extra or {})})


async def finished_task(lf: Any, tag: str) -> str:
    plan = lf.plan(PIPELINE.format(image=f"image.{tag}"))
    result = await lf.run(plan)
    assert result.state == "Completed", result.summary
    return str(plan.task_id)


async def inject(sim: Any, job_id: str, *, key: str | None = None, protocol: str = "jobs") -> None:
    body = {"protocol": protocol, "job_id": job_id, "amount": "0.2500"}
    if key is not None:
        body["idempotency_key"] = key
    (await sim.http.post("/admin/charges", json=body)).raise_for_status()


def rows(lf: Any, **match: str) -> list[store.Finding]:
    return [
        f for f in store.findings(lf.recorder.reader) if all(getattr(f, k) == v for k, v in match.items())
    ]


async def reconcile(lf: Any, **options: Any) -> Any:
    return await reconcile_once(lf.settings, lf.recorder, ReconcileInput(**options))


def jobs_of(lf: Any, task: str) -> dict[str, list[str]]:
    """The task's operations on the frames stage and the job ids each recorded."""
    found: dict[str, list[str]] = {}
    for e in lf.recorder.read_events(task):
        if e.operation_key and ":frames/" in e.operation_key and (job := e.payload.get("job_id")):
            found.setdefault(e.operation_key, [])
            if job not in found[e.operation_key]:
                found[e.operation_key].append(job)
    return found


# ── the schedule ─────────────────────────────────────────────────────────────────────────────────────
async def test_an_unknown_charge_at_the_vendor_becomes_a_record_and_a_metric_within_one_period(lf, sim):
    every = timedelta(seconds=3)
    sid = f"billing-test-{uuid.uuid4().hex[:8]}"
    await schedule_reconciliation(lf.client, lf.settings, every=every, schedule=sid, grace=timedelta(0))
    handle = lf.client.get_schedule_handle(sid)
    [account], _ = accounts(deployment_table(lf.settings), lf.settings.vendor_url_or_none())
    label = account.route  # the default table: every jobs route on the simulator's one account
    try:
        with serve_metrics(
            MetricsSettings(metrics_port=free_port()),
            lf.settings.resolved_database_url(),
            lf.client,
            asyncio.get_running_loop(),
            sdk=False,
        ) as server:
            # Whatever the session's other tests left unknown at the vendor is recorded by a first run.
            await wait_for_runs(lf, sid, 1, timeout=every.total_seconds() * 3 + 20)
            before = (await scrape(server.url)).series(UNKNOWN).get((("route", label),), 0.0)

            ghost = f"job_ghost_{uuid.uuid4().hex[:10]}"
            await inject(sim, ghost, key=f"nobody:{ghost}")
            injected = time.monotonic()
            while not rows(lf, job_id=ghost):
                assert time.monotonic() - injected < every.total_seconds() * 2 + 20, "never recorded"
                await asyncio.sleep(0.2)
            took = time.monotonic() - injected

            [found] = rows(lf, job_id=ghost)
            assert (found.kind, found.route, found.line_key, found.amount) == (
                "unknown_charge",
                label,
                f"nobody:{ghost}",
                "0.2500",
            )
            assert found.run_id is not None and found.run_id.startswith(sid)
            after = (await scrape(server.url)).series(UNKNOWN)[(("route", label),)]
            assert after == before + 1
        # Within one period of the schedule, and the time one run takes.
        run = [r for r in rows(lf, kind="run") if r.run_id == found.run_id]
        assert run and took <= every.total_seconds() + float(run[0].evidence["seconds"]) + 2.0, took
        desc = await handle.describe()
        assert isinstance(desc.schedule.action, ScheduleActionStartWorkflow)
        assert desc.schedule.action.workflow == "BillingReconciliation"
        assert desc.schedule.action.task_queue == lf.task_queue
        assert desc.schedule.spec.intervals[0].every == every
    finally:
        await handle.delete()


async def wait_for_runs(lf: Any, sid: str, n: int, *, timeout: float) -> None:
    started = time.monotonic()
    while len([r for r in rows(lf, kind="run") if (r.run_id or "").startswith(sid)]) < n:
        assert time.monotonic() - started < timeout, f"the schedule {sid} ran fewer than {n} times"
        await asyncio.sleep(0.2)


async def test_billing_schedule_creates_the_schedule_on_a_cluster_and_a_second_call_updates_it(lf, tmp_path):
    queue = f"q-{uuid.uuid4().hex[:8]}"
    env = {"LEDGERFLOW_TASK_QUEUE": queue}
    code, out, _ = await cli(lf, tmp_path, "billing", "schedule", "--every", "300", env=env)
    assert code == 0, out
    sid = schedule_id(queue)
    handle = lf.client.get_schedule_handle(sid)
    try:
        assert out.strip() == f"schedule {sid}: created, every 300 s on task queue {queue}"
        code, out, _ = await cli(lf, tmp_path, "billing", "schedule", "--every", "120", env=env)
        assert (code, out.strip()) == (0, f"schedule {sid}: updated, every 120 s on task queue {queue}")
        desc = await handle.describe()
        assert desc.schedule.spec.intervals[0].every == timedelta(seconds=120)
        assert [s.id async for s in await lf.client.list_schedules() if s.id == sid] == [sid]
    finally:
        await handle.delete()


async def test_ledgerflow_up_creates_the_schedule_on_the_embedded_stack(lf, sim, tmp_path: Path):
    queue = f"q-{uuid.uuid4().hex[:8]}"
    env = {"LEDGERFLOW_VENDOR_URL": sim.url, "LEDGERFLOW_TASK_QUEUE": queue}
    code, out, _ = await cli(lf, tmp_path, "up", "--no-worker", env=env)
    handle = lf.client.get_schedule_handle(schedule_id(queue))
    try:
        assert code == 0, out
        said = f"schedule  {schedule_id(queue)}: created, every 300 s on task queue {queue}"
        assert said in out.splitlines()
        desc = await handle.describe()
        assert isinstance(desc.schedule.action, ScheduleActionStartWorkflow)
        assert desc.schedule.action.task_queue == queue
        assert desc.schedule.spec.intervals[0].every == timedelta(minutes=5)  # the default period
        # and the scans' schedules beside it (ledgerflow.views.schedules)
        for scan in SCANS:
            assert (await lf.client.get_schedule_handle(scans_schedule_id(scan, queue)).describe()).id
    finally:
        for scan in SCANS:  # the billing one is ``handle``'s: each deleted once
            await lf.client.get_schedule_handle(scans_schedule_id(scan, queue)).delete()
        await cli(lf, tmp_path, "down", env=env)


async def test_the_schedule_s_workflow_runs_the_reconciliation_and_returns_its_summary(lf, sim):
    ghost = f"job_ghost_{uuid.uuid4().hex[:10]}"
    await inject(sim, ghost, key=f"nobody:{ghost}")
    result = await lf.client.execute_workflow(
        BillingReconciliationWorkflow.run,
        ReconcileInput(grace_seconds=0),
        id=f"billing-reconciliation-{uuid.uuid4().hex[:8]}",
        task_queue=lf.task_queue,
    )
    assert result.listed >= 1 and result.unknown >= 1 and result.new >= 1
    assert [f.kind for f in rows(lf, job_id=ghost)] == ["unknown_charge"]
    assert rows(lf, job_id=ghost)[0].run_id == result.run_id


# ── matching ─────────────────────────────────────────────────────────────────────────────────────────
async def test_the_same_unknown_charge_seen_in_ten_runs_is_recorded_once(lf_with, sim):
    tag = uuid.uuid4().hex[:8]
    async with lf_with(routes=routes(tag)) as lf:
        ghost = f"job_ghost_{uuid.uuid4().hex[:10]}"
        await inject(sim, ghost, key=f"nobody:{ghost}")
        results = [await reconcile(lf, grace_seconds=0) for _ in range(10)]
    assert len(rows(lf, job_id=ghost)) == 1
    assert all(r.unknown >= 1 for r in results)  # seen by every run
    assert [f"nobody:{ghost}" in " ".join(r.recorded) for r in results] == [True] + [False] * 9


async def test_every_charge_of_a_finished_task_matches_exactly_one_operation_and_nothing_is_recorded(
    lf_with, sim
):
    tag = uuid.uuid4().hex[:8]
    async with lf_with(routes=routes(tag)) as lf:
        task = await finished_task(lf, tag)
        result = await reconcile(lf, grace_seconds=0)
    charges = await sim.charges(f"{task}:")
    assert len(charges) == 3
    assert result.matched >= 3
    assert not [f for f in store.findings(lf.recorder.reader) if (f.line_key or "").startswith(f"{task}:")]
    assert not [f for f in store.findings(lf.recorder.reader) if f.job_id in {c["job_id"] for c in charges}]


async def test_a_charge_two_operations_claim_is_recorded_once_naming_both(lf_with, sim):
    tag = uuid.uuid4().hex[:8]
    async with lf_with(routes=routes(tag)) as lf:
        task = await finished_task(lf, tag)
        (a, _), (b, [b_job]) = list(jobs_of(lf, task).items())[:2]
        # The vendor bills operation b's job under operation a's key: both can claim the line.
        await inject(sim, b_job, key=a)
        await reconcile(lf, grace_seconds=0)
        await reconcile(lf, grace_seconds=0)
    [found] = rows(lf, kind="ambiguous_charge", line_key=a)
    assert found.job_id == b_job and found.route == f"image.{tag}"
    assert sorted(found.evidence["claimed_by"]) == sorted([a, b])
    assert found.evidence["line"]["amount"] == "0.2500"


async def test_a_credit_is_recorded_against_the_operation_it_refunds_with_its_evidence(lf_with, sim):
    tag = uuid.uuid4().hex[:8]
    async with lf_with(routes=routes(tag)) as lf:
        task = await finished_task(lf, tag)
        op, [job] = next(iter(jobs_of(lf, task).items()))
        r = await sim.http.post("/admin/credits", json={"job_id": job, "amount": "0.2000"})
        r.raise_for_status()
        first = await reconcile(lf, grace_seconds=0)
        again = await reconcile(lf, grace_seconds=0)
    [credit] = rows(lf, kind="credit", job_id=job)
    assert (credit.operation_key, credit.amount, credit.route) == (op, "-0.2000", f"image.{tag}")
    result = next(parse(e) for e in lf.recorder.read_events(task) if e.dedup_key == f"{op}:result")
    assert credit.evidence["task"] == task
    assert Decimal(credit.evidence["recorded"]) == result.actual_cost  # what the ledger counted it at
    assert credit.evidence["line"] == {
        "job_id": job,
        "operation_key": op,
        "amount": "-0.2000",
        "at": credit.evidence["line"]["at"],
    }
    assert first.credits >= 1 and again.credits >= 1
    assert not rows(lf, kind="unknown_charge", job_id=job)


async def test_a_charge_without_a_key_is_unknown_only_once_its_grace_has_passed(lf_with, sim):
    tag = uuid.uuid4().hex[:8]
    async with lf_with(routes=routes(tag)) as lf:
        ghost = f"job_ghost_{uuid.uuid4().hex[:10]}"
        await inject(sim, ghost)  # another client of the account: a charge under no key of ours
        early = await reconcile(lf, grace_seconds=3600)
        assert not rows(lf, job_id=ghost) and early.pending >= 1
        await reconcile(lf, grace_seconds=0)
    [found] = rows(lf, job_id=ghost)
    assert (found.kind, found.line_key, found.route) == ("unknown_charge", None, f"image.{tag}")


async def test_routes_that_cannot_list_charges_are_named_in_the_reconciliation_s_output(
    lf_with, sim, tmp_path: Path
):
    tag = uuid.uuid4().hex[:8]
    text = RouteSpec(adapter=AdapterKind.OPENAI, price=Price(per_1k_input_tokens=Decimal("0.001")))
    video = RouteSpec(adapter=AdapterKind.PREDICTIONS, price=Price(per_second=Decimal("0.3")))
    async with lf_with(routes=routes(tag, extra={f"text.{tag}": text, f"video.{tag}": video})) as lf:
        result = await reconcile(lf, grace_seconds=0)
        assert result.not_listable == {
            f"text.{tag}": "the openai API lists no charges per call",
            f"video.{tag}": "the predictions API lists no charges per call",  # Replicate's has no billing API
            "model calls": "the chat API lists no charges per call: the review's and the planner's calls "
            "are checked by their request ids against the vendor's invoice",
        }
        env = {"LEDGERFLOW_VENDOR_URL": sim.url, "LEDGERFLOW_ROUTES_FILE": str(lf.settings.routes_file)}
        code, out, _ = await cli(lf, tmp_path, "billing", "reconcile", "--grace", "0", env=env)
    assert code == 0, out
    lines = out.splitlines()
    assert f"cannot list charges: route text.{tag} (the openai API lists no charges per call)" in lines
    assert lines[-1].startswith("billing reconciliation: ") and " charges listed" in lines[-1]


# ── the record ───────────────────────────────────────────────────────────────────────────────────────
async def test_the_reconciliation_record_refuses_update_delete_and_truncate(lf, sim):
    ghost = f"job_ghost_{uuid.uuid4().hex[:10]}"
    await inject(sim, ghost, key=f"nobody:{ghost}")
    await reconcile(lf, grace_seconds=0)
    engine = sa.create_engine(lf.settings.resolved_database_url(), poolclass=sa.NullPool)
    try:
        for statement in (
            "UPDATE billing_reconciliation SET amount = '0'",
            "DELETE FROM billing_reconciliation",
            "TRUNCATE billing_reconciliation",
        ):
            with pytest.raises(sa.exc.DBAPIError, match="append-only"), engine.begin() as conn:
                conn.execute(sa.text(statement))
    finally:
        engine.dispose()
    assert len(rows(lf, job_id=ghost)) == 1
