"""Issue 27 §4, object-store loss: an artifact deleted from the store is detected by its hash before it is
handed on, fetched again from the vendor job that made it while the vendor still holds it (nothing paid, the
ledger records it), and otherwise recorded lost and made again. Real Temporal, Postgres, worker, simulator;
the money is checked against the simulator's own billing."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from peoplekit import wait_open

from artifacts.local import path_of
from ledgerflow.views import people
from rules.events import Intent, parse
from rules.projection import NodeStatus, fold
from rules.recompute import recompute
from runtime.signing import demo_key

PLAN = """
goal: a frame, then a shot made from it ({token})
budget_ceiling: 10
stages:
  - {{id: frame, executor: image.keyframe, estimate: 1, input: {{format: png, width: 320, height: 180}}}}
  - {{id: shot, executor: image.keyframe, estimate: 1, depends_on: [frame], inputs: {{keyframe: frame}}}}
"""


async def until(predicate: Any, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def change(lf: Any, task_id: str, kind: str) -> None:
    payload = people.signed_change(demo_key("director"), task_id, kind)
    sent = await people.send_change(lf.settings, task_id, payload, timeout=15)
    assert sent.status == "accepted", sent


async def frame_made_then_deleted(lf: Any, sim: Any, token: str, **frame: Any) -> tuple[Any, str, str]:
    """Run the task until the frame is made (the task paused before the shot), then delete the frame's bytes
    from the store; returns the handle, the task id and the frame's sha256."""
    await sim.configure(executors={"image.keyframe": {"latency_seconds": 0.5, **frame}})
    plan = lf.plan(PLAN.format(token=token))
    tid = plan.task_id
    handle = await lf.start(plan)

    def dispatched() -> list[str]:
        return [
            i.action.node
            for e in lf.recorder.read_events(tid)
            if e.type == "Intent" and isinstance(i := parse(e), Intent) and i.action.kind == "Dispatch"
        ]

    await until(lambda: dispatched() == ["frame"], what="the frame's dispatch")
    await change(lf, tid, "pause")
    await until(
        lambda: fold(lf.recorder.read_events(tid)).nodes["frame"].status == NodeStatus.SUCCEEDED,
        what="the frame",
    )
    artifact = fold(lf.recorder.read_events(tid)).nodes["frame"].artifact
    assert artifact is not None
    path_of(artifact["uri"]).unlink()  # the store lost it
    return handle, tid, artifact["sha256"]


def markers(lf: Any, task_id: str, kind: str) -> list[Any]:
    return [
        e for e in lf.recorder.read_events(task_id) if e.type == "SystemMarker" and e.payload["kind"] == kind
    ]


async def test_a_deleted_input_is_fetched_again_from_the_vendor_and_nothing_is_paid_twice(lf, sim):
    handle, tid, sha = await frame_made_then_deleted(lf, sim, "refetch")
    await change(lf, tid, "resume")
    result = await asyncio.wait_for(handle.result(), 60)
    assert result.state == "Completed", result.summary

    [refetched] = markers(lf, tid, "artifact_refetched")
    assert refetched.payload["node"] == "frame" and refetched.payload["detail"].startswith(sha)
    assert markers(lf, tid, "artifact_lost") == [], "fetched again, never lost"
    p = fold(lf.recorder.read_events(tid))
    assert p.nodes["frame"].attempts == 1 and path_of(p.nodes["frame"].artifact["uri"]).is_file()
    shot = next(
        i.action
        for e in lf.recorder.read_events(tid)
        if e.type == "Intent"
        and isinstance(i := parse(e), Intent)
        and getattr(i.action, "node", "") == "shot"
    )
    assert shot.input["inputs"]["keyframe"]["sha256"] == sha, "the shot was made from the very same bytes"
    assert len(await sim.charges(f"{tid}:frame:")) == 1, "the frame was paid for once"


async def test_a_deleted_input_the_vendor_purged_is_made_again_only_once_a_person_approves_the_cost(lf, sim):
    handle, tid, sha = await frame_made_then_deleted(lf, sim, "purged", purge_after_seconds=1.0)
    await asyncio.sleep(1.5)  # the vendor's copy is gone too
    await change(lf, tid, "resume")
    rid = await wait_open(lf, tid, "remake:frame:")
    [lost] = markers(lf, tid, "artifact_lost")
    assert (lost.payload["node"], lost.payload["detail"]) == ("frame", sha)
    request = fold(lf.recorder.read_events(tid)).requests[rid].request
    assert "frame's output was lost from the store" in request.reason and "costs about 1" in request.reason
    await asyncio.sleep(1.0)
    assert len(await sim.charges(f"{tid}:frame:")) == 1, "nothing is made again before a person approves"
    told = await people.decide(lf.settings, demo_key("producer"), tid, rid, "resume", note="remake it")
    assert told.status == "accepted", told
    result = await asyncio.wait_for(handle.result(), 60)
    assert result.state == "Completed", result.summary

    assert markers(lf, tid, "artifact_refetched") == []
    events = lf.recorder.read_events(tid)
    assert fold(events).nodes["frame"].attempts == 2, "made again"
    assert len(await sim.charges(f"{tid}:frame:")) == 2, "and paid for again, as the vendor bills it"
    assert recompute(events) == [], "every decision recomputes (table 9 asked, then dispatched)"
