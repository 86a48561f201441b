"""Work is never redone without cause, and a bad artifact is never handed on (real servers, the simulator).

* an input found missing or corrupt in the store is recorded lost and made again, never sent to a vendor;
* a resubmitted plan of the same project (``reuse: project``) pays for nothing it already has;
* a vendor file that does not decode is ``invalid_output`` with the probe's reason, retried with the problem.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from decimal import Decimal
from typing import Any

from artifacts.local import path_of
from rules.events import parse, vendor_spend
from rules.keys import operation_key
from vendors.simulator import Draw, ExecutorProfile


def events_of(lf: Any, task_id: str, type_: str) -> list[Any]:
    return [parse(e) for e in lf.recorder.read_events(task_id) if e.type == type_]


TWO_STAGES = """
goal: a frame, then a shot made from it
budget_ceiling: 20
approval: {{timeout: 2s, policy: approve}}
project: {project}
reuse: {reuse}
stages:
  - {{id: frame, executor: image.keyframe, estimate: 0.4, approval: true,
      input: {{format: png, width: 64, height: 36}}}}
  - {{id: shot, executor: video.motion, estimate: 1.2, depends_on: [frame],
      input: {{format: mp4, duration_s: 1, width: 64, height: 36}}}}
"""


async def test_a_corrupted_input_is_fetched_again_and_never_handed_to_the_vendor(lf, sim):
    """The frame's file is damaged while the shot waits (on the frame's approval): the shot's executor finds
    it does not hash to its record and, the vendor still holding the frame's job, fetches it again (verified
    by its sha256, nothing paid) before anything is sent; the frame is not made again (issue 27 §4; made
    again, with a person's approval of the cost, only where the vendor purged it: test_lost_artifacts)."""
    plan = lf.plan(TWO_STAGES.format(project="lost", reuse="task"))
    handle = await lf.start(plan)

    async def frame_made() -> None:
        while not events_of(lf, plan.task_id, "Outcome"):
            await asyncio.sleep(0.05)

    await asyncio.wait_for(frame_made(), 30)
    [first] = events_of(lf, plan.task_id, "Outcome")
    path = path_of(first.artifact.uri)
    path.write_bytes(b"not the frame any more")  # the store's copy is damaged behind the ledger's back
    result = await handle.result()

    assert result.state == "Completed", result.summary
    markers = events_of(lf, plan.task_id, "SystemMarker")
    assert [m for m in markers if m.kind == "artifact_lost"] == []
    [refetched] = [m for m in markers if m.kind == "artifact_refetched"]
    assert refetched.node == "frame" and refetched.detail.startswith(first.artifact.sha256)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == first.artifact.sha256, (
        "the store's copy is healed"
    )
    assert [o.node for o in events_of(lf, plan.task_id, "Outcome")].count("frame") == 1, "never made again"
    shots = [
        i.action for i in events_of(lf, plan.task_id, "Intent") if getattr(i.action, "node", "") == "shot"
    ]
    charged = {c["idempotency_key"] for c in await sim.charges(f"{plan.task_id}:")}
    assert len(shots) == 1 and shots[0].operation_key in charged, "one shot, sent once"
    assert shots[0].input["inputs"]["frame"]["sha256"] == first.artifact.sha256  # the good frame


async def test_a_resubmitted_plan_of_the_same_project_reuses_every_output_and_pays_nothing(lf, sim):
    first = lf.plan(TWO_STAGES.format(project="again", reuse="project"))
    assert (await lf.run(first)).state == "Completed"
    paid_once = await sim.total(first.task_id)

    second = lf.plan(TWO_STAGES.format(project="again", reuse="project"))
    result = await lf.run(second)

    assert result.state == "Completed" and paid_once > 0
    assert await sim.charges(f"{second.task_id}:") == [], "nothing sent to a vendor the second time"
    reused = {
        o.node: o.reused_from for o in events_of(lf, second.task_id, "Outcome") if o.node in ("frame", "shot")
    }
    assert reused == {
        "frame": operation_key(first.task_id, "frame", 1),
        "shot": operation_key(first.task_id, "shot", 1),
    }
    # Nothing paid to a generation vendor: the only spend is the review's own model call.
    assert vendor_spend(lf.recorder.read_events(second.task_id)) == 0


async def test_a_vendor_file_that_does_not_decode_is_invalid_output_and_retried_with_the_reason(lf, sim):
    plan = lf.plan(TWO_STAGES.format(project="bad-files", reuse="task"))
    key = functools.partial(operation_key, plan.task_id)
    profile = ExecutorProfile(truncated=0.5)
    seed = next(
        s
        for s in range(10_000)
        if Draw.for_attempt(s, key("shot", 1), 0, profile).truncated
        and not Draw.for_attempt(s, key("shot", 2), 0, profile).truncated
        and not Draw.for_attempt(s, key("frame", 1), 0, profile).truncated
    )
    await sim.configure(seed=seed, executors={"video.motion": {"truncated": 0.5}})
    result = await lf.run(plan)

    assert result.state == "Completed", result.summary
    [failure] = events_of(lf, plan.task_id, "Failure")
    assert failure.kind == "invalid_output" and "truncated" in failure.error
    assert failure.actual_cost == Decimal("1.2")  # it was paid for
    [retry] = [
        i.action
        for i in events_of(lf, plan.task_id, "Intent")
        if getattr(i.action, "operation_key", "") == key("shot", 2)
    ]
    assert "truncated" in str(retry.input["feedback"]["previous_errors"])  # the problem is in the new request
