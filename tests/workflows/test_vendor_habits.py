"""Every way a real vendor loses or doubles a charge, end to end: real Temporal, real Postgres, the simulator.

Each test turns on one habit of real paid vendors (the simulator's switches) and checks the money from the
vendor's own billing, never from our ledger alone: at most one charge per OperationKey, the ledger's total
equal to the vendor's or every difference matched by a recorded cost anomaly, no reservation left, nothing
left open. Each names the behaviour that was broken before the Operation lifecycle (what the old code did).

Every test runs its own route (``video.<test>``), so a route one test pauses never touches another's.
"""

from __future__ import annotations

import asyncio
import uuid
from decimal import Decimal
from typing import Any

import pytest

from rules.events import parse, vendor_spend
from rules.keys import operation_key
from rules.money import vendor_amount
from vendors.routes import AdapterKind, RouteSpec, RouteTable, Timeouts, VendorMode
from vendors.simulator import Draw, ExecutorProfile

PLAN = """
goal: one paid shot
budget_ceiling: 20
time_ceiling: {ceiling}
review: {{reviewers: [compliance.rules]}}
stages:
  - {{id: shot, executor: {executor}, estimate: 1.5, retries: {retries}}}
"""


def route_name() -> str:
    return f"video.{uuid.uuid4().hex[:8]}"


def routes(name: str, **spec: Any) -> RouteTable:
    return RouteTable(routes={name: RouteSpec(**spec)})


def plan_for(lf: Any, executor: str, *, ceiling: str = "1h", retries: int = 2) -> Any:
    return lf.plan(PLAN.format(executor=executor, ceiling=ceiling, retries=retries))


def events_of(lf: Any, task_id: str, type_: str) -> list[Any]:
    return [parse(e) for e in lf.recorder.read_events(task_id) if e.type == type_]


def anomalies(lf: Any, task_id: str) -> list[Any]:
    return [m for m in events_of(lf, task_id, "SystemMarker") if m.kind == "cost_anomaly"]


async def assert_money(lf: Any, sim: Any, task_id: str) -> None:
    """≤ one charge per key; ledger = vendor, or each difference flagged; nothing reserved or open."""
    events = lf.recorder.read_events(task_id)
    charges = await sim.charges(f"{task_id}:")
    keys = [c["idempotency_key"] for c in charges]
    assert len(keys) == len(set(keys)), f"charged twice: {keys}"
    ops = {e.operation_key for e in events if e.type == "Intent" and e.operation_key}
    assert ops, "no operation was recorded: nothing to check"
    for op in ops:
        billed = sum(
            (vendor_amount(c["amount"]).amount or Decimal(0) for c in charges if c["idempotency_key"] == op),
            Decimal(0),
        )
        recorded = vendor_spend(e for e in events if e.operation_key == op)
        if billed != recorded:
            flagged = [e for e in events if e.operation_key == op and e.payload.get("kind") == "cost_anomaly"]
            assert flagged, f"{op}: ledger {recorded} vs vendor {billed}, and no cost anomaly says why"
        results = [e for e in events if e.operation_key == op and e.dedup_key == f"{op}:result"]
        assert len(results) == 1, f"{op} has {len(results)} results"
    account = lf.recorder.account(f"task:{task_id}")
    assert account is not None and account.reserved == 0, f"still reserved: {account}"


async def until(predicate: Any, timeout: float = 20.0, what: str = "") -> None:
    async def loop() -> None:
        while not predicate():
            await asyncio.sleep(0.05)

    try:
        await asyncio.wait_for(loop(), timeout)
    except TimeoutError:
        raise AssertionError(f"not {what or predicate} within {timeout:g}s") from None


def seed_where(key: str, profile: ExecutorProfile, flag: str) -> int:
    """A simulator seed whose draw sets ``flag`` on the first POST of ``key`` and not on the second."""
    return next(
        seed
        for seed in range(10_000)
        if getattr(Draw.for_attempt(seed, key, 0, profile), flag)
        and not getattr(Draw.for_attempt(seed, key, 1, profile), flag)
    )


# ── §2.1: a task that ends never writes an open operation off at zero ────────────────────────────────────
async def test_a_task_that_ends_counts_an_open_operation_at_its_cost_never_zero(lf_with, sim):
    """Old: after two heartbeat timeouts the loop wrote Failure(actual_cost=0) while the vendor kept the 1.50.

    The task's time ceiling passes while its executor is backing off between retries (the vendor's key was
    rotated mid-job: every poll is refused). The operation is closed from the record and the vendor; the
    vendor cannot answer, so it is counted at its estimate with a cost anomaly — the 1.50 the vendor billed.
    """
    name = route_name()
    async with lf_with(routes=routes(name), route_pause_retry_seconds=0.3) as lf:
        await sim.configure(executors={name: {"latency_seconds": 30}})
        plan = plan_for(lf, name, ceiling="4s")
        handle = await lf.start(plan)
        await until(lambda: events_of(lf, plan.task_id, "Progress"), what="the job accepted")
        await sim.configure(executors={name: {"latency_seconds": 30}}, accepted_keys=["a-rotated-key"])
        result = await handle.result()
    assert result.state == "Failed" and "time ceiling" in (result.summary["terminal_reason"] or "")
    [failure] = events_of(lf, plan.task_id, "Failure")
    assert failure.kind == "unknown_outcome" and failure.actual_cost == Decimal("1.5")
    assert (await sim.total(plan.task_id)) == Decimal("1.5")
    assert anomalies(lf, plan.task_id), "the uncertain charge is flagged for a person"
    assert lf.recorder.route_states()[name].paused, "the rotated key paused the route"
    await assert_money(lf, sim, plan.task_id)


# ── §2.2: a 4xx after the job exists is not "refused before any job" ──────────────────────────────────────
async def test_an_output_purged_before_it_was_fetched_is_a_technical_failure_at_what_the_job_cost(
    lf_with, sim
):
    """Old: the 404 on the result was non-retryable: Failure[content] at cost 0, dead-lettered."""
    name = route_name()
    async with lf_with(routes=routes(name)) as lf:
        await sim.configure(executors={name: {"latency_seconds": 0.2, "purge_after_seconds": 0}})
        plan = plan_for(lf, name, retries=0)
        handle = await lf.start(plan)
        await lf.wait_state(handle, {"WaitingHuman"})
    [failure] = events_of(lf, plan.task_id, "Failure")
    assert failure.kind == "technical" and "gone" in failure.error
    assert failure.actual_cost == Decimal("1.5") == await sim.total(plan.task_id)
    await assert_money(lf, sim, plan.task_id)


async def test_a_job_the_vendor_forgot_is_counted_from_its_billing(lf_with, sim):
    """Old: GET /jobs/{id} → 404 was "refused before any job": Failure[content] at cost 0."""
    name = route_name()
    async with lf_with(routes=routes(name)) as lf:
        await sim.configure(
            executors={name: {"latency_seconds": 0.3, "forget_after_seconds": 0, "cost": "1.25"}}
        )
        plan = plan_for(lf, name, retries=0)
        handle = await lf.start(plan)
        await lf.wait_state(handle, {"WaitingHuman"})
    [failure] = events_of(lf, plan.task_id, "Failure")
    assert failure.kind == "technical" and failure.actual_cost == Decimal(
        "1.25"
    )  # the bill, not the estimate
    await assert_money(lf, sim, plan.task_id)


async def test_a_prediction_the_vendor_forgot_with_no_billing_to_ask_is_counted_at_its_estimate(lf_with, sim):
    """Old: the "charge cannot be read" path called the cost anomaly wrongly (a TypeError): a non-retryable
    bug failure instead of the job's charge at its estimate with the anomaly that says so."""
    name = route_name()
    route = routes(name, adapter=AdapterKind.PREDICTIONS, mode=VendorMode.LOOKUP_ONLY)
    async with lf_with(routes=route) as lf:
        await sim.configure(executors={name: {"latency_seconds": 0.3, "forget_after_seconds": 0}})
        plan = plan_for(lf, name, retries=0)
        handle = await lf.start(plan)
        await lf.wait_state(handle, {"WaitingHuman"})
    [failure] = events_of(lf, plan.task_id, "Failure")
    assert failure.kind == "technical" and "gone at the vendor" in failure.error
    assert failure.actual_cost == Decimal("1.5")  # no billing API: the estimate, never zero
    assert any("cannot be read from the vendor" in a.detail for a in anomalies(lf, plan.task_id))
    await assert_money(lf, sim, plan.task_id)


async def test_a_rotated_key_pauses_the_route_until_a_person_resumes_it_and_fails_no_node(lf_with, sim):
    """Old: 401 meant "the request is wrong": Failure[content] at cost 0, dead-lettered."""
    name = route_name()
    async with lf_with(routes=routes(name), route_pause_retry_seconds=0.3) as lf:
        # Long enough that the job's id reaches the ledger (RECORD_RUNNING_AFTER_S) before it ends.
        await sim.configure(executors={name: {"latency_seconds": 3.0}})
        plan = plan_for(lf, name)
        handle = await lf.start(plan)
        await until(lambda: events_of(lf, plan.task_id, "Progress"), what="the job accepted")
        await sim.configure(executors={name: {"latency_seconds": 3.0}}, accepted_keys=["a-rotated-key"])
        await until(lambda: name in lf.recorder.route_states(), what="the route paused")
        await asyncio.sleep(2.0)  # the job finishes at the vendor meanwhile; the node must not fail
        assert not events_of(lf, plan.task_id, "Failure")
        assert (await handle.query("status"))["state"] == "Running"
        await sim.configure(executors={name: {"latency_seconds": 3.0}})  # the person fixes the key …
        assert lf.recorder.resume_route(name, "ops@example")  # … and resumes the route
        result = await handle.result()
    assert result.state == "Completed"
    assert len(await sim.charges(f"{plan.task_id}:shot")) == 1
    await assert_money(lf, sim, plan.task_id)


async def test_a_409_while_the_first_request_is_still_in_flight_adopts_the_job_it_creates(lf_with, sim):
    """Old: a 409 after a maybe-accepted submit was an unknown outcome at cost 0, with no anomaly.

    Idempotent vendor, slow intake: the first POST creates its job only after the client gave up; the retry
    meets "request in progress" (409). The operation looks the key up until the job appears, then adopts it.
    """
    name = route_name()
    route = routes(name, timeouts=Timeouts(request=0.4), max_accept_seconds=4)
    async with lf_with(routes=route) as lf:
        conflicts = (await sim.http.get("/admin/stats")).json()["conflicts"]
        await sim.configure(executors={name: {"late_accept": 1.0, "late_accept_seconds": 2.5}})
        plan = plan_for(lf, name)
        result = await lf.run(plan)
    assert result.state == "Completed"
    assert len(await sim.charges(f"{plan.task_id}:shot")) == 1
    assert not events_of(lf, plan.task_id, "Failure")
    assert (await sim.http.get("/admin/stats")).json()["conflicts"] > conflicts, "a retry met the 409"
    await assert_money(lf, sim, plan.task_id)


async def test_a_408_is_retried_and_never_a_content_failure(lf_with, sim):
    """Old: 408 was a VendorRejected: Failure[content], dead-lettered."""
    name = route_name()
    async with lf_with(routes=routes(name)) as lf:
        plan = plan_for(lf, name)
        profile = {"request_timeout": 0.5}
        seed = seed_where(
            operation_key(plan.task_id, "shot", 1), ExecutorProfile(**profile), "request_timeout"
        )
        await sim.configure(seed=seed, executors={name: profile})
        result = await lf.run(plan)
    assert result.state == "Completed" and not events_of(lf, plan.task_id, "Failure")
    refused = [m for m in events_of(lf, plan.task_id, "SystemMarker") if m.kind == "refused"]
    assert len(refused) == 1 and "408" in refused[0].detail
    await assert_money(lf, sim, plan.task_id)


# ── §2.3: "not found by key" is proof only after the request can no longer land ─────────────────────────
async def test_a_job_created_after_the_client_gave_up_is_adopted_not_paid_twice(lf_with, sim):
    """Old: the retry found nothing by key, voided, dispatched a2 — then the vendor created and charged a1."""
    name = route_name()
    route = routes(name, mode=VendorMode.LOOKUP_ONLY, timeouts=Timeouts(request=0.4), max_accept_seconds=3)
    async with lf_with(routes=route) as lf:
        await sim.configure(
            mode="lookup_only", executors={name: {"late_accept": 1.0, "late_accept_seconds": 1.2}}
        )
        plan = plan_for(lf, name)
        result = await lf.run(plan)
    assert result.state == "Completed"
    assert [c["idempotency_key"] for c in await sim.charges(f"{plan.task_id}:")] == [
        operation_key(plan.task_id, "shot", 1)
    ]
    voids = [m for m in events_of(lf, plan.task_id, "SystemMarker") if m.kind == "void"]
    assert not voids, "nothing was voided while a send could still land"
    op = operation_key(plan.task_id, "shot", 1)
    [send] = [e for e in lf.recorder.read_events(plan.task_id) if e.dedup_key == f"{op}:submitting:1"]
    [progress] = [e for e in lf.recorder.read_events(plan.task_id) if e.type == "Progress"]
    assert (progress.recorded_at - send.recorded_at).total_seconds() >= 1.0, "the job really came late"
    await assert_money(lf, sim, plan.task_id)


# ── §2.5: amounts ─────────────────────────────────────────────────────────────────────────────────────────
async def test_a_cost_finer_than_the_ledger_is_recorded_rounded_up_with_the_raw_figure(lf_with, sim):
    """Old: 0.3999999 failed the ledger's scale check and the settlement was retried forever."""
    name = route_name()
    async with lf_with(routes=routes(name)) as lf:
        await sim.configure(executors={name: {"cost_decimals": 7}})
        plan = plan_for(lf, name)
        result = await lf.run(plan)
    assert result.state == "Completed"
    [outcome] = [o for o in events_of(lf, plan.task_id, "Outcome") if o.node == "shot"]
    [charge] = await sim.charges(f"{plan.task_id}:shot")
    assert charge["amount"] == "1.4999999" and outcome.actual_cost == Decimal("1.500000")
    assert any("1.4999999" in a.detail for a in anomalies(lf, plan.task_id))
    await assert_money(lf, sim, plan.task_id)


@pytest.mark.parametrize("figure", ["-1", "NaN", "1e12", "abc"])
async def test_an_unusable_cost_is_counted_at_the_estimate_with_the_raw_figure(lf_with, sim, figure):
    """Old: a negative, huge or non-numeric cost was refused by the ledger (or adapter), retried forever."""
    name = route_name()
    async with lf_with(routes=routes(name)) as lf:
        await sim.configure(executors={name: {"cost_override": figure}})
        plan = plan_for(lf, name)
        result = await lf.run(plan)
    assert result.state == "Completed"
    [outcome] = [o for o in events_of(lf, plan.task_id, "Outcome") if o.node == "shot"]
    assert outcome.actual_cost == Decimal("1.5")  # the estimate
    assert any(figure in a.detail for a in anomalies(lf, plan.task_id))
    await assert_money(lf, sim, plan.task_id)  # the bill says something else: flagged, not hidden


# ── §2.6: the vendor key goes only to the vendor ─────────────────────────────────────────────────────────
async def test_results_on_a_cdn_are_fetched_without_the_vendor_key(lf_with, sim):
    """Old: base URL + absolute URL = 'Invalid port', retried forever with the reservation held."""
    name = route_name()
    async with lf_with(routes=routes(name)) as lf:
        await sim.configure(executors={name: {"absolute_urls": True}})
        plan = plan_for(lf, name)
        result = await lf.run(plan)
    assert result.state == "Completed"
    assert (await sim.http.get("/admin/leaks")).json()["count"] == 0
    await assert_money(lf, sim, plan.task_id)


async def test_a_result_url_that_would_smuggle_the_key_to_another_host_never_does(lf_with, sim):
    """Old: base + '@cdn/x' made the CDN the host and sent it the bearer key."""
    name = route_name()
    async with lf_with(routes=routes(name)) as lf:
        await sim.configure(executors={name: {"result_url_template": "@{cdn}/files/{job}"}})
        plan = plan_for(lf, name, retries=0)
        handle = await lf.start(plan)
        await lf.wait_state(handle, {"WaitingHuman"})
    assert (await sim.http.get("/admin/leaks")).json()["count"] == 0
    [failure] = events_of(lf, plan.task_id, "Failure")
    assert failure.actual_cost == Decimal("1.5")  # the job was paid for: its charge stands
    await assert_money(lf, sim, plan.task_id)


async def test_an_unparseable_result_url_is_a_classified_failure_not_a_retry_loop(lf_with, sim):
    name = route_name()
    async with lf_with(routes=routes(name)) as lf:
        await sim.configure(executors={name: {"result_url_template": "http://[::1"}})
        plan = plan_for(lf, name, retries=0)
        handle = await lf.start(plan)
        await lf.wait_state(handle, {"WaitingHuman"})
    [failure] = events_of(lf, plan.task_id, "Failure")
    assert failure.kind == "invalid_output" and "cannot be parsed" in failure.error
    await assert_money(lf, sim, plan.task_id)


# ── §2.7: rate limits in non-idempotent modes ─────────────────────────────────────────────────────────────
@pytest.mark.parametrize("mode", ["lookup_only", "none"])
async def test_a_429_clears_the_maybe_sent_state_and_waits_for_retry_after(lf_with, sim, mode):
    """Old: lookup_only voided and re-dispatched at once, ignoring Retry-After; none: an unknown outcome."""
    name = route_name()
    async with lf_with(routes=routes(name, mode=VendorMode(mode))) as lf:
        plan = plan_for(lf, name)
        profile = {"rate_limit": 0.5}
        seed = seed_where(operation_key(plan.task_id, "shot", 1), ExecutorProfile(**profile), "rate_limited")
        await sim.configure(seed=seed, mode=mode, executors={name: profile})
        result = await lf.run(plan)
    assert result.state == "Completed"
    markers = [m for m in lf.recorder.read_events(plan.task_id) if m.type == "SystemMarker"]
    kinds = [m.payload["kind"] for m in markers]
    assert "void" not in kinds and not events_of(lf, plan.task_id, "Failure")
    sends = [m for m in markers if m.payload["kind"] == "submitting"]
    assert len(sends) == 2 and kinds.count("refused") == 1
    waited = (sends[1].recorded_at - sends[0].recorded_at).total_seconds()
    assert waited >= 1.0, f"the retry came {waited:.2f}s later, before the vendor's Retry-After of 1s"
    assert len(await sim.charges(f"{plan.task_id}:shot")) == 1
    await assert_money(lf, sim, plan.task_id)
