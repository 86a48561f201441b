"""The stall watchdog end to end (issue 27 §2): a vendor job that hangs — running, no progress, forever — is
cancelled at the vendor once its stage's ``stall_after`` passes without progress, recorded as a ``stalled``
failure at what it cost, and the node is retried (a new attempt, a new key) and completes.

Real Temporal, Postgres, worker and simulator. The simulator draws each call's fate from (seed, key); the seed
is chosen so the first attempt's job hangs and the retry's does not.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from rules.events import Failure, FailureKind, Outcome, parse, vendor_spend
from rules.keys import operation_key
from vendors.simulator import Draw, ExecutorProfile

STALL_AFTER = 1.5
PLAN = """
goal: a shot whose first job hangs at the vendor
budget_ceiling: 10
stages:
  - {{id: shot, executor: {route}, estimate: 1, stall_after: {stall}s}}
"""


def seed_hanging_first(task_id: str, profile: ExecutorProfile) -> int:
    first, second = operation_key(task_id, "shot", 1), operation_key(task_id, "shot", 2)
    return next(
        seed
        for seed in range(10_000)
        if Draw.for_attempt(seed, first, 0, profile).hang
        and not Draw.for_attempt(seed, second, 0, profile).hang
    )


async def test_a_hung_job_is_cancelled_after_stall_after_and_the_node_retries(lf, sim: Any) -> None:
    route = "image.keyframe"
    profile = ExecutorProfile(latency_seconds=0.2, hang=0.5, cost=Decimal("0.40"))
    plan = lf.plan(PLAN.format(route=route, stall=STALL_AFTER))
    await sim.configure(
        seed=seed_hanging_first(plan.task_id, profile), executors={route: profile.model_dump(mode="json")}
    )
    result = await lf.run(plan)
    assert result.state == "Completed", result.summary
    events = lf.recorder.read_events(plan.task_id)
    first = operation_key(plan.task_id, "shot", 1)
    # The INTENT is the send's write-ahead (the job's id reaches the ledger with its failure: it stalled
    # before RECORD_RUNNING_AFTER_S): the job was accepted after it, so it waited at least this long.
    [intent] = [e for e in events if e.type == "Intent" and e.operation_key == first]
    [stalled] = [e for e in events if e.type == "Failure" and e.operation_key == first]
    failure = parse(stalled)
    assert isinstance(failure, Failure) and failure.kind == FailureKind.STALLED, failure
    assert f"no progress for {STALL_AFTER:g}s" in failure.error
    waited = (stalled.recorded_at - intent.recorded_at).total_seconds()
    assert STALL_AFTER <= waited < STALL_AFTER + 8, f"cancelled {waited:.1f}s after it was sent"
    assert failure.job_id is not None
    job = (await sim.http.get(f"/jobs/{failure.job_id}")).json()
    assert job["status"] == "cancelled", "the hung job was cancelled at the vendor"
    second = operation_key(plan.task_id, "shot", 2)
    [outcome] = [parse(e) for e in events if e.type == "Outcome" and e.operation_key == second]
    assert isinstance(outcome, Outcome)
    # The money, from the vendor's own billing: both jobs were billed, the ledger says so.
    billed = await sim.total(plan.task_id)
    assert billed == Decimal("0.80") and vendor_spend(events) == billed
