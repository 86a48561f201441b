"""The S12 crash drill (docs/design.md#the-s12-crash-drill): a 12-shot motion batch crashes at S12, and
recovery reads the task's records.

The kill state, exactly: S01–S08 registered (Outcome); S09–S10 finished (and paid) at the vendor but never
registered; S11 mid-upload (its artifact's bytes in a temp file of the store, not renamed into place); S12
never called. Then a fresh worker must: leave S01–S08 alone (no new event, no new charge), verify and register
S09–S10 without paying again, delete S11's temp file and fetch its artifact again (no new charge), call S12
exactly once, and complete the batch.

How the state is built with one worker, one hold point and a simulator whose latency is per executor:

* ``concurrency: 3`` — the only way S12 can still be uncalled while S01–S08 are done is that all three free
  slots are held by S09, S10 and S11 (with 11 slots, S12 would take S01's as soon as S01 finished);
* a simulator seed, searched for this task's OperationKeys, under which the vendor refuses (HTTP 500, nothing
  accepted or charged) S09's first two submits and S10's first one, and nothing else: Temporal's activity
  retry backoff then shifts their acceptance by d10 = initial and d09 = initial·(1 + coefficient);
* a job latency L = (d09 + d10) / 2, so that S11 (dispatched with S10, accepted at once) finishes and stages
  its artifact while S09 and S10 are accepted and still running, each with a margin of ≥ 1 s either side;
* ``LEDGERFLOW_HOLD_AT=artifact_staged`` for S11: the worker freezes there; the test waits until S09 and S10
  finish at the vendor (the frozen worker cannot notice), checks the state above, and SIGKILLs it.
"""

from __future__ import annotations

import asyncio
import time
from decimal import Decimal

from faultkit import (
    assert_artifact,
    assert_invariants,
    dispatch_intents,
    op_key,
    resolutions,
    vendor_job,
)

from vendors.simulator import Draw, ExecutorProfile
from workflows.task import STAGE_RETRY

DRILL = """
goal: the S12 crash drill, a 12-shot motion batch
budget_ceiling: 100
concurrency: 3
stages:
  - {id: motion, executor: video.motion, estimate: 1.2, fan_out: 12, canary: false}
"""
SHOTS = [f"S{i:02d}" for i in range(1, 13)]
REFUSED = {"S09": 2, "S10": 1}  # submits the vendor refuses (500) before it accepts the shot
SERVER_ERROR_RATE = 0.2


def backoff() -> tuple[float, float]:
    """(d10, d09): how much later than its slot opens S10 / S09 is accepted, from the stage retry policy."""
    first = STAGE_RETRY.initial_interval.total_seconds()
    return first, first * (1 + STAGE_RETRY.backoff_coefficient)


def find_seed(task_id: str) -> int:
    """A simulator seed under which exactly the submits in REFUSED are refused (before the kill)."""
    profile = ExecutorProfile(server_error=SERVER_ERROR_RATE)

    def refused(seed: int, shot: str, attempt: int) -> bool:
        key = op_key(task_id, f"motion/{shot}")
        return Draw.for_attempt(seed, key, attempt, profile).server_error

    accepted_first = [s for s in SHOTS[:11] if s not in REFUSED]
    for seed in range(1_000_000):
        if any(refused(seed, s, 0) for s in accepted_first):
            continue
        if all(
            all(refused(seed, s, a) for a in range(n)) and not refused(seed, s, n) for s, n in REFUSED.items()
        ):
            return seed
    raise AssertionError("no simulator seed gives the drill's refusals")


async def test_s12_crash_drill(rig, sim):
    plan = rig.plan(DRILL)
    tid = plan.task_id
    op = {s: op_key(tid, f"motion/{s}") for s in SHOTS}
    d10, d09 = backoff()
    latency = (d09 + d10) / 2
    assert d10 < latency < d09 < 2 * latency, "the retry policy no longer allows this timeline"
    seed = find_seed(tid)
    profile = {"latency_seconds": latency, "server_error": SERVER_ERROR_RATE}
    await sim.configure(seed=seed, executors={"video.motion": profile})

    w1 = await rig.spawn(hold_at="artifact_staged", hold_op=op["S11"])
    await rig.start(plan)
    held = await w1.held("artifact_staged", op["S11"], timeout=90)

    # ── the kill state ───────────────────────────────────────────────────────────────────────────────
    charged = {s: await sim.charges(op[s]) for s in SHOTS}
    for s in ("S09", "S10"):
        assert len(charged[s]) == 1, f"setup: {s} not accepted before the freeze: {charged[s]}\n{rig.logs()}"
        job = charged[s][0]["job_id"]
        deadline = time.monotonic() + latency + 5
        while (await vendor_job(sim, job))["status"] != "succeeded":
            assert time.monotonic() < deadline, f"setup: {s}'s job {job} never finished at the vendor"
            await asyncio.sleep(0.05)
    seen = rig.events(tid)
    done = resolutions(seen)
    for s in SHOTS[:8]:
        assert op[s] in done and done[op[s]].type == "Outcome", f"setup: {s} not registered\n{rig.logs()}"
    for s in ("S09", "S10", "S11"):
        assert op[s] not in done, f"setup: {s} already resolved: {done.get(op[s])}"
        assert len(charged[s]) == 1
    temp = rig.temp_dir / held.fields["tmp"]
    assert temp.is_file(), f"setup: S11's staged temp file {temp} is missing"
    assert op["S12"] not in {e.operation_key for e in dispatch_intents(seen)}, "setup: S12 was dispatched"
    assert charged["S12"] == [] and w1.find("submitting", op["S12"]) == []

    await rig.crash(w1)
    # The vendor stops refusing (and S12 needs no long job): only the recovery is under test now.
    await sim.configure(seed=seed, executors={"video.motion": {"latency_seconds": 0.3}})
    w2 = await rig.spawn()

    # ── recovery ─────────────────────────────────────────────────────────────────────────────────────
    await assert_invariants(rig.recorder, sim, [tid], seen=seen, rig=rig)
    events = rig.events(tid)
    after = resolutions(events)
    for s in SHOTS[:8]:  # untouched: not one new event, not one new charge
        assert [e for e in events if e.operation_key == op[s]] == [
            e for e in seen if e.operation_key == op[s]
        ]
        assert await sim.charges(op[s]) == charged[s]
    for s in ("S09", "S10"):  # verified against the vendor's hash and registered, without paying again
        outcome = after[op[s]]
        job = charged[s][0]["job_id"]
        assert outcome.type == "Outcome" and outcome.payload["job_id"] == job
        assert outcome.payload["artifact"]["sha256"] == (await vendor_job(sim, job))["result"]["sha256"]
        assert_artifact(outcome)
        assert await sim.charges(op[s]) == charged[s]
    # S11: the interrupted upload's temp file is gone; the artifact was fetched and staged again, unpaid.
    assert not temp.exists(), f"S11's temp file {temp} survived the recovery"
    assert w2.find("vendor_completed", op["S11"]) and w2.find("artifact_staged", op["S11"])
    assert after[op["S11"]].type == "Outcome"
    assert after[op["S11"]].payload["job_id"] == charged["S11"][0]["job_id"]
    assert_artifact(after[op["S11"]])
    assert await sim.charges(op["S11"]) == charged["S11"]
    # S12: called exactly once, after the recovery.
    assert len(w2.find("submitting", op["S12"])) == 1
    assert len(await sim.charges(op["S12"])) == 1 and after[op["S12"]].type == "Outcome"
    assert sum((Decimal(c["amount"]) for c in await sim.charges(f"{tid}:")), Decimal(0)) == Decimal("14.4")
