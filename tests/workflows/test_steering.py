"""Issue 26 §2: skip, waive and restore — the changes that decide what a task keeps — on the real servers.

Real Temporal, Postgres, worker and simulator (the model too). Each change is signed, sent as the task's
``change`` Update, recorded as a ``TaskChange`` and applied by the fold and the rules at the loop's next
decision; the vendor's own charges say what was paid, and every decision recomputes with the table that made
it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from ledgerflow import client
from ledgerflow.views import people
from ledgerflow.views.audit import audit_signatures
from rules.events import Intent, PartialResolution, TaskChange, parse
from rules.people import Keys
from rules.projection import NodeStatus, fold, node_state
from rules.recompute import recompute
from runtime.signing import demo_key, verify
from workflows.task import TaskWorkflow

REVIEWED = """
goal: a board, a shot made from it, and an edit ({token})
budget_ceiling: 20
rework_limit: {limit}
stages:
  - {{id: board, executor: image.keyframe, estimate: 0.4, input: {{prompt: a lighthouse}}}}
  - {{id: shot, executor: image.keyframe, estimate: 0.4, depends_on: [board], inputs: {{board: board}}}}
"""

ITEMS = """
goal: three frames and a clip of each, one at a time ({token})
budget_ceiling: 20
concurrency: 1
stages:
  - {{id: frames, executor: image.keyframe, estimate: 0.4, fan_out: 3, canary: false}}
  - {{id: clips, executor: image.keyframe, estimate: 0.4, fan_out: 3, canary: false, depends_on: [frames],
      inputs: {{frame: frames}}}}
"""

PASS = json.dumps({"scores": {"visual": 0.9}, "blame": {}, "reasons": []})


def blame(*nodes: str) -> str:
    """A judgement asking for rework of ``nodes``."""
    return json.dumps({"scores": {"visual": 0.4}, "blame": {"visual": list(nodes)}, "reasons": ["off"]})


def change(task_id: str, kind: str, approver: str = "director", **kw: Any) -> dict[str, Any]:
    return people.signed_change(demo_key(approver), task_id, kind, **kw)


async def send(lf: Any, task_id: str, kind: str, approver: str = "director", **kw: Any) -> people.Sent:
    return await people.send_change(lf.settings, task_id, change(task_id, kind, approver, **kw), timeout=15)


def dispatched(lf: Any, task_id: str) -> list[str]:
    return [
        i.action.node
        for e in lf.recorder.read_events(task_id)
        if e.type == "Intent" and isinstance(i := parse(e), Intent) and i.action.kind == "Dispatch"
    ]


async def until(predicate: Any, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def finished(handle: Any, timeout: float = 60.0) -> Any:
    """The task's result, or a failure showing where it stands (never a wait until the suite's timeout)."""
    try:
        return await asyncio.wait_for(handle.result(), timeout)
    except TimeoutError:
        raise AssertionError(f"the task did not finish: {await handle.query('status')}") from None


def open_request(lf: Any, task_id: str, prefix: str) -> str | None:
    p = fold(lf.recorder.read_events(task_id))
    return next((rid for rid, r in p.requests.items() if r.open and rid.startswith(prefix)), None)


async def checked(lf: Any, handle: Any, task_id: str) -> list[Any]:
    """The task's events, after the checks every change must pass: each decision recomputes, each change's
    signature verifies as of its arrival, and the workflow's history replays."""
    events = lf.recorder.read_events(task_id)
    assert recompute(events) == [], "every decision recomputes with the table that made it"
    keys = Keys(lf.recorder.key_registry(), verify, lf.settings.decision_window)
    assert audit_signatures(task_id, events, keys, None).problems == ()
    replayer = Replayer(workflows=[TaskWorkflow], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(await handle.fetch_history())
    return events


# ── skip: a fan-out item, and what only it feeds ──────────────────────────────────────────────────────
async def test_a_skipped_item_and_the_clip_only_it_feeds_never_run_and_nothing_is_paid_for_them(lf, sim):
    await sim.configure(executors={"image.keyframe": {"latency_seconds": 0.6}})
    plan = lf.plan(ITEMS.format(token="skip"))
    tid = plan.task_id
    handle = await lf.start(plan)
    await until(lambda: dispatched(lf, tid) == ["frames/S01"], what="the first frame")
    assert (await send(lf, tid, "pause")).status == "accepted"
    # Refused before anything is recorded: the composition, a node that does not exist.
    for node, why in (("compose", "the compose is never skipped"), ("frames/S09", "no node")):
        refused = await send(lf, tid, "skip", node=node)
        assert refused.status == "rejected" and why in refused.detail, refused
    skipped = await send(lf, tid, "skip", node="frames/S03", note="the third frame is cut from the story")
    assert (skipped.status, skipped.detail) == ("accepted", "skip by director"), skipped
    p = fold(lf.recorder.read_events(tid))
    assert {n: node_state(p, p.nodes[n]).value for n in ("frames/S03", "clips/S03", "clips/S02")} == {
        "frames/S03": "cancelled",
        "clips/S03": "cancelled",
        "clips/S02": "pending",
    }
    # The Python client's method signs and sends the same way.
    resumed = await client.change(lf.settings, demo_key("director"), tid, "resume")
    assert (resumed.status, resumed.detail) == ("accepted", "resume by director")
    result = await finished(handle)
    assert result.state == "Completed", result.summary

    events = await checked(lf, handle, tid)
    [recorded] = [parse(e) for e in events if e.type == "TaskChange" and e.payload["kind"] == "skip"]
    assert isinstance(recorded, TaskChange) and recorded.nodes == ("frames/S03", "clips/S03")
    sent = dispatched(lf, tid)
    assert "frames/S03" not in sent and "clips/S03" not in sent, sent
    billed = {c["idempotency_key"].split(":")[1] for c in await sim.charges(f"{tid}:")}
    assert billed == {"frames/S01", "frames/S02", "clips/S01", "clips/S02"}, (
        "the vendor billed no skipped node"
    )
    assert result.summary["nodes"]["clips/S03"]["state"] == "cancelled"


async def test_two_people_skipping_the_same_node_at_once_one_wins_and_the_other_is_told(lf, sim):
    await sim.configure(executors={"image.keyframe": {"latency_seconds": 0.6}})
    plan = lf.plan(ITEMS.format(token="two-skips"))
    tid = plan.task_id
    handle = await lf.start(plan)
    await until(lambda: dispatched(lf, tid) == ["frames/S01"], what="the first frame")
    assert (await send(lf, tid, "pause")).status == "accepted"
    a, b = await asyncio.gather(
        send(lf, tid, "skip", "director", node="frames/S02"),
        send(lf, tid, "skip", "producer", node="frames/S02"),
    )
    [won] = [s for s in (a, b) if s.status == "accepted"]
    [lost] = [s for s in (a, b) if s.status != "accepted"]
    assert (lost.status, lost.detail) == ("rejected", "node frames/S02 is already skipped"), lost
    skips = [
        parse(e)
        for e in lf.recorder.read_events(tid)
        if e.type == "TaskChange" and e.payload["kind"] == "skip"
    ]
    assert [c.approver for c in skips] == [won.detail.removeprefix("skip by ")], "one skip recorded"
    assert (await send(lf, tid, "resume")).status == "accepted"
    assert (await finished(handle)).state == "Completed"


# ── waive: a rework finding accepted as it is ─────────────────────────────────────────────────────────
async def test_a_waiver_of_the_blamed_output_answers_the_rework_limit_and_the_task_completes_unredone(
    lf, sim
):
    token = "waive-all"
    await sim.configure(chat_script=[{"match": token, "content": blame("board")}])
    plan = lf.plan(REVIEWED.format(token=token, limit=0))
    tid = plan.task_id
    handle = await lf.start(plan)
    status = await lf.wait_state(handle, {"Escalated"})
    assert "rework limit of 0" in status["escalation_reason"], status
    rid = open_request(lf, tid, "escalation:")
    assert rid is not None
    # What cannot be waived is refused before it is recorded: an output the review does not blame, a waiver
    # with no reason.
    refused = await send(lf, tid, "waive", node="shot", note="fine by me")
    assert refused.status == "rejected" and "the review does not blame shot" in refused.detail, refused
    unexplained = await send(lf, tid, "waive", node="board")
    assert unexplained.status == "rejected" and "says why" in unexplained.detail, unexplained
    waived = await send(lf, tid, "waive", node="board", note="the lighthouse is meant to look that way")
    assert (waived.status, waived.detail) == ("accepted", "waive by director"), waived
    result = await finished(handle)
    assert (result.state, result.summary["verdict"]) == ("Completed", "QualityRework"), result.summary
    assert result.summary["waived"] == ["board"], "the verdict stands as it was, its finding waived"

    events = await checked(lf, handle, tid)
    [resolved] = [parse(e) for e in events if e.type == "PartialResolution"]
    assert isinstance(resolved, PartialResolution)
    assert (resolved.request_id, resolved.resolution) == (rid, "findings on board waived by director")
    assert fold(events).requests[rid].decided_by == "director"
    for node in ("board", "shot"):
        assert len(await sim.charges(f"{tid}:{node}:")) == 1, f"{node} was never redone"


async def test_waiving_one_of_two_blamed_outputs_redoes_only_the_other(lf, sim):
    token = "waive-one"
    # The review blames both until it sees a second version of the shot.
    await sim.configure(
        chat_script=[
            {"match": '"shot": 2', "content": PASS},
            {"match": token, "content": blame("board", "shot")},
        ]
    )
    plan = lf.plan(REVIEWED.format(token=token, limit=0))
    tid = plan.task_id
    handle = await lf.start(plan)
    await lf.wait_state(handle, {"Escalated"})
    waived = await send(lf, tid, "waive", node="board", note="the board is right; the shot is not")
    assert waived.status == "accepted", waived
    result = await finished(handle)
    assert (result.state, result.summary["verdict"]) == ("Completed", "Pass"), result.summary

    events = await checked(lf, handle, tid)
    [rollback] = [parse(e) for e in events if e.type == "Rollback"]
    assert rollback.targets == ("shot",), "the waived board is kept; only the shot is redone"
    assert len(await sim.charges(f"{tid}:board:")) == 1
    assert len(await sim.charges(f"{tid}:shot:")) == 2
    redo = [i.action for e in events if e.type == "Intent" and isinstance(i := parse(e), Intent)]
    [shot_redo] = [a for a in redo if a.kind == "Dispatch" and a.node == "shot" and a.attempt == 2]
    assert "director (waive): the board is right; the shot is not" not in json.dumps(shot_redo.input)


# ── restore: an earlier version made current again ────────────────────────────────────────────────────
async def test_restoring_an_earlier_version_reuses_what_was_built_on_it_and_pays_nothing_again(lf, sim):
    token = "restore-v1"
    await sim.configure(chat_script=[{"match": token, "content": blame("board")}])
    plan = lf.plan(REVIEWED.format(token=token, limit=1))
    tid = plan.task_id
    handle = await lf.start(plan)
    # Round 1 redoes the board (v2) and the shot built on it; the second review blames the board again.
    await until(lambda: any(e.type == "Rollback" for e in lf.recorder.read_events(tid)), what="round 1")
    v1 = fold(lf.recorder.read_events(tid)).nodes["board"].outputs[0].artifact["sha256"]
    await sim.configure(
        chat_script=[{"match": v1, "content": PASS}, {"match": token, "content": blame("board")}]
    )
    await lf.wait_state(handle, {"Escalated"})
    rid = open_request(lf, tid, "escalation:")
    p = fold(lf.recorder.read_events(tid))
    assert p.nodes["board"].versions == 2 and p.nodes["board"].artifact["sha256"] != v1
    shot_v1 = p.nodes["shot"].outputs[0].artifact["sha256"]
    missing = await send(lf, tid, "restore", node="board", edit={"version": 3})
    assert missing.status == "rejected" and "no version 3" in missing.detail, missing
    assert (await send(lf, tid, "pause")).status == "accepted"  # to read the states the restore leaves
    restored = await send(
        lf, tid, "restore", node="board", edit={"version": 1}, note="the first lighthouse was the one"
    )
    assert (restored.status, restored.detail) == ("accepted", "restore by director"), restored
    states = {n: v["state"] for n, v in (await handle.query("status"))["nodes"].items()}
    assert states == {"board": "succeeded", "shot": "stale", "compose": "stale", "review": "stale"}, states
    assert (await send(lf, tid, "resume")).status == "accepted"
    result = await finished(handle)
    assert (result.state, result.summary["verdict"]) == ("Completed", "Pass"), result.summary

    events = await checked(lf, handle, tid)
    p = fold(events)
    assert p.nodes["board"].artifact["sha256"] == v1, "version 1 is current"
    assert p.nodes["shot"].artifact["sha256"] == shot_v1, "the shot built on version 1 is current again"
    assert p.nodes["shot"].reused, "… reused, not made again"
    [resolved] = [parse(e) for e in events if e.type == "PartialResolution"]
    assert (resolved.request_id, resolved.resolution) == (rid, "version 1 restored by director")
    # The vendor billed two boards and two shots: nothing for the restore or the reuse.
    assert len(await sim.charges(f"{tid}:board:")) == 2
    assert len(await sim.charges(f"{tid}:shot:")) == 2
    assert p.nodes["board"].status == NodeStatus.SUCCEEDED and p.nodes["board"].approved


async def test_a_key_registered_for_some_change_kinds_signs_those_and_is_refused_the_others(
    lf, sim, tmp_path
):
    """``ledgerflow keys add --kind change:skip …``: the registry's kinds bound what a key may change."""
    from peoplekit import cli

    from runtime.signing import generate

    editor = f"editor-{uuid.uuid4().hex[:6]}"
    key = generate(editor, f"{editor}-1")
    key.write(tmp_path / "editor.key.json")
    kinds = ("change:pause", "change:resume", "change:skip")
    args = [a for k in kinds for a in ("--kind", k)]
    key_file = str(tmp_path / "editor.key.json")
    rc, out, err = await cli(
        lf, tmp_path, "keys", "add", "--key-file", key_file, *args, "--as", "sec-ops",
        "--reason", "an editor who may skip",
    )  # fmt: skip
    assert (rc, out.strip()) == (0, f"key {editor}-1 of {editor} registered"), err
    rc, _, err = await cli(
        lf, tmp_path, "keys", "add", "--key-file", key_file, "--kind", "change:all",
        "--as", "sec-ops", "--reason", "r",
    )  # fmt: skip
    assert rc != 0 and "--kind 'change:all' is not one of" in err and "change:restore" in err

    await sim.configure(executors={"image.keyframe": {"latency_seconds": 0.6}})
    plan = lf.plan(ITEMS.format(token="kinds"))
    tid = plan.task_id
    handle = await lf.start(plan)
    await until(lambda: dispatched(lf, tid) == ["frames/S01"], what="the first frame")

    def signed(kind: str, **kw: Any) -> dict[str, Any]:
        return people.signed_change(key, tid, kind, **kw)

    paused = await people.send_change(lf.settings, tid, signed("pause"), timeout=15)
    assert paused.status == "accepted", paused
    moved = await people.send_change(lf.settings, tid, signed("reroute", node="clips", edit={"route": "x"}))
    assert moved.status == "rejected" and "may not decide change:reroute" in moved.detail, moved
    skipped = await people.send_change(lf.settings, tid, signed("skip", node="frames/S03"), timeout=15)
    assert (skipped.status, skipped.detail) == ("accepted", f"skip by {editor}"), skipped
    assert (await people.send_change(lf.settings, tid, signed("resume"), timeout=15)).status == "accepted"
    assert (await finished(handle)).state == "Completed"
