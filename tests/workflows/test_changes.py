"""Issue 26 §2: people steer a running task with signed changes — first kinds, pause and resume.

Real Temporal, Postgres, worker and simulator. A change is sent as the task's ``change`` Update, verified and
recorded by ``people.record_changes`` (a ``TaskChange`` with the signed message), and applied by the rules at
the loop's next decision: a paused task dispatches nothing new, what is in flight finishes and is recorded,
and a resume lets it go on. The audit recomputes every decision made around it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from peoplekit import cli, wait_open
from temporalio.client import WorkflowUpdateFailedError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from ledgerflow.views import people
from ledgerflow.views.audit import Signatures, audit_signatures
from rules.events import Intent, MarkerKind, SystemMarker, TaskChange, parse
from rules.people import Keys
from rules.projection import NodeStatus, fold
from rules.recompute import recompute
from runtime.signing import demo_key, verify
from vendors.routes import Price, RouteSpec, RouteTable
from workflows.contracts import CHANGE, DecisionRuling, workflow_id
from workflows.task import TaskWorkflow

# Two shots one after the other: the first is in flight when the pause arrives.
TWO_SHOTS = """
goal: two shots, one after the other
budget_ceiling: 10
approval: {{approvers: [director, producer]}}
stages:
  - {{id: first, executor: {executor}, estimate: 1}}
  - {{id: second, executor: {executor}, estimate: 1, depends_on: [first]}}
"""


def plan_of(lf: Any) -> Any:
    plan = lf.plan(TWO_SHOTS.format(executor="image.keyframe"))
    assert plan.task_id is not None
    return plan


def dispatched(lf: Any, task_id: str) -> list[str]:
    return [
        e.payload["action"]["node"]
        for e in lf.recorder.read_events(task_id)
        if e.type == "Intent" and e.payload["action"]["kind"] == "Dispatch"
    ]


def first_done(lf: Any, task_id: str) -> bool:
    return fold(lf.recorder.read_events(task_id)).nodes["first"].status == NodeStatus.SUCCEEDED


def change(task_id: str, kind: str, approver: str = "director", **kw: Any) -> dict:
    return people.signed_change(demo_key(approver), task_id, kind, **kw)


async def until(predicate: Any, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_paused_task_dispatches_nothing_new_finishes_what_is_in_flight_and_goes_on_after_resume(
    lf, sim
):
    await sim.configure(executors={"image.keyframe": {"latency_seconds": 1.0}})
    plan = plan_of(lf)
    handle = await lf.start(plan)
    await until(lambda: dispatched(lf, plan.task_id) == ["first"], what="the first shot's dispatch")
    paused = await people.send_change(lf.settings, plan.task_id, change(plan.task_id, "pause"), timeout=10)
    assert (paused.status, paused.detail) == ("accepted", "pause by director"), paused
    # The first shot was in flight: it finishes and is recorded; the second is never dispatched.
    await until(lambda: first_done(lf, plan.task_id), what="the first shot's Outcome")
    await asyncio.sleep(1.5)  # the loop has seen the Outcome (its executor returned it) and decided again
    assert dispatched(lf, plan.task_id) == ["first"], "nothing new while paused"
    status = await handle.query("status")
    assert status["paused_by"] == "director" and status["state"] == "Running", status
    resumed = await people.send_change(lf.settings, plan.task_id, change(plan.task_id, "resume"), timeout=10)
    assert (resumed.status, resumed.detail) == ("accepted", "resume by director")
    result = await handle.result()
    assert result.state == "Completed", result.summary
    events = lf.recorder.read_events(plan.task_id)
    changes = [parse(e) for e in events if e.type == "TaskChange"]
    assert [(c.kind.value, c.approver) for c in changes] == [("pause", "director"), ("resume", "director")]
    assert all(isinstance(c, TaskChange) and c.signed.startswith("ledgerflow-change-v1") for c in changes)
    assert recompute(events) == [], "every decision recomputes, around the pause too"
    # The audit re-verifies each change's signature, as of its arrival.
    registry = lf.recorder.key_registry()
    keys = Keys(registry, verify, lf.settings.decision_window)
    assert audit_signatures(plan.task_id, events, keys, None) == Signatures(2)
    director = registry["demo-director"]
    revoked = replace(director, revoked_at=changes[0].received_at - timedelta(seconds=1))
    found = audit_signatures(plan.task_id, events, Keys({**registry, "demo-director": revoked}, verify), None)
    assert len(found.problems) == 2 and all("was revoked" in why for why in found.problems), found
    replayer = Replayer(workflows=[TaskWorkflow], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(await handle.fetch_history())


async def test_two_people_pausing_at_once_one_wins_and_the_other_is_told_by_whom(lf, sim):
    await sim.configure(executors={"image.keyframe": {"latency_seconds": 1.0}})
    plan = plan_of(lf)
    handle = await lf.start(plan)
    await until(lambda: dispatched(lf, plan.task_id) == ["first"], what="the first dispatch")
    a, b = await asyncio.gather(
        people.send_change(lf.settings, plan.task_id, change(plan.task_id, "pause", "director"), timeout=10),
        people.send_change(lf.settings, plan.task_id, change(plan.task_id, "pause", "producer"), timeout=10),
    )
    [won] = [s for s in (a, b) if s.status == "accepted"]
    [lost] = [s for s in (a, b) if s.status != "accepted"]
    winner = won.detail.removeprefix("pause by ")
    assert (lost.status, lost.detail) == ("rejected", f"already paused by {winner}"), lost
    changes = [parse(e) for e in lf.recorder.read_events(plan.task_id) if e.type == "TaskChange"]
    assert [c.approver for c in changes] == [winner], "one pause recorded"
    await people.send_change(lf.settings, plan.task_id, change(plan.task_id, "resume", winner), timeout=10)
    assert (await handle.result()).state == "Completed"


async def test_a_forged_unauthorised_or_replayed_change_is_refused_on_record_and_changes_nothing(lf, sim):
    await sim.configure(executors={"image.keyframe": {"latency_seconds": 1.0}})
    plan = plan_of(lf)
    handle = await lf.start(plan)
    await until(lambda: dispatched(lf, plan.task_id) == ["first"], what="the first dispatch")
    forged = {**change(plan.task_id, "pause"), "signature": "0" * 128}
    told = await handle.execute_update(CHANGE, forged, result_type=DecisionRuling)
    assert told.status == "rejected" and "bad signature" in told.detail, told
    outsider = change(plan.task_id, "pause", "editor")  # a registered key, not one of the plan's approvers
    told = await handle.execute_update(CHANGE, outsider, result_type=DecisionRuling)
    assert told.status == "rejected" and "editor may not change this task" in told.detail, told
    running = change(plan.task_id, "edit", node="first", edit={"prompt": "something else"})
    with pytest.raises(WorkflowUpdateFailedError) as refused:  # judged before anything is recorded
        await handle.execute_update(CHANGE, running, result_type=DecisionRuling)
    assert "node first is running" in str(refused.value.cause)
    replayed = change(plan.task_id, "pause", issued_at=datetime.now(UTC) - timedelta(hours=1))
    told = await handle.execute_update(CHANGE, replayed, result_type=DecisionRuling)
    assert told.status == "rejected" and "outside the" in told.detail, told
    refusals = [
        m.detail.partition(": ")[0]
        for e in lf.recorder.read_events(plan.task_id)
        if isinstance(m := parse(e), SystemMarker) and m.kind == MarkerKind.REJECTED_INPUT
    ]
    assert refusals == [forged["change_id"], outsider["change_id"], replayed["change_id"]], "each on record"
    result = await handle.result()
    assert result.state == "Completed", "neither paused anything"
    assert "paused_by" not in result.summary


async def test_a_pause_outlives_its_worker_and_the_next_worker_keeps_it(lf_with, sim):
    """A crash between the change's event and its effect: the pause is in the ledger; the worker that took it
    is gone before the loop acted on it; the next worker's run folds it and dispatches nothing new."""
    await sim.configure(executors={"image.keyframe": {"latency_seconds": 1.0}})
    async with lf_with() as lf:
        plan = plan_of(lf)
        handle = await lf.start(plan)
        queue = lf.task_queue
        await until(lambda: dispatched(lf, plan.task_id) == ["first"], what="the first dispatch")
        paused = await people.send_change(
            lf.settings, plan.task_id, change(plan.task_id, "pause"), timeout=10
        )
        assert paused.status == "accepted"
    # That worker is gone. The next one takes the task (its workflow task times out to it).
    async with lf_with(task_queue=queue) as again:
        await until(lambda: first_done(again, plan.task_id), what="the first Outcome")
        await asyncio.sleep(1.5)
        assert dispatched(again, plan.task_id) == ["first"], "the pause held across the worker's end"
        resumed = await people.send_change(
            again.settings, plan.task_id, change(plan.task_id, "resume"), timeout=10
        )
        assert resumed.status == "accepted"
        result = await again.client.get_workflow_handle(workflow_id(plan.task_id)).result()
    assert result["state"] == "Completed"
    del handle


async def test_the_cli_pauses_and_resumes_a_task_and_refuses_a_second_pause_in_one_line(lf, sim, tmp_path):
    await sim.configure(executors={"image.keyframe": {"latency_seconds": 1.0}})
    plan = plan_of(lf)
    handle = await lf.start(plan)
    await until(lambda: dispatched(lf, plan.task_id) == ["first"], what="the first dispatch")
    code, out, _ = await cli(lf, tmp_path, "change", "pause", plan.task_id, "--as", "director")
    assert (code, out.strip()) == (0, "accepted (pause by director)")
    code, _, err = await cli(lf, tmp_path, "change", "pause", plan.task_id, "--as", "producer")
    assert code == 1 and err.strip() == "rejected: already paused by director", err
    code, out, _ = await cli(lf, tmp_path, "change", "resume", plan.task_id, "--as", "producer")
    assert (code, out.strip()) == (0, "accepted (resume by producer)")
    assert (await handle.result()).state == "Completed"


# ── edit: the dead-letter recovery ────────────────────────────────────────────────────────────────────────
REFUSED_SHOT = """
goal: a keyframe the vendor refuses until a person edits its prompt
budget_ceiling: 10
approval: {timeout: 1h, policy: escalate}
stages:
  - id: shot
    executor: image.keyframe
    estimate: 1
    retries: 0
    input: {prompt: a storm at sea, format: png}
"""


async def test_an_edit_resolves_a_dead_letter_and_the_node_runs_again_with_the_edited_request(
    lf, sim, tmp_path
):
    await sim.configure(executors={"image.keyframe": {"reject_content": 1.0}})
    plan = lf.plan(REFUSED_SHOT)
    handle = await lf.start(plan)
    rid = await wait_open(lf, plan.task_id, "dead_letter:")
    # A running node cannot be edited, nor a field the rules make, nor an artifact reference smuggled in.
    for edit, why in (
        ({"inputs": {}}, "input.inputs is made by the rules"),
        ({"style": {"uri": "file:///etc/passwd", "sha256": "0" * 64}}, "is an artifact reference"),
    ):
        refused = await people.send_change(
            lf.settings, plan.task_id, change(plan.task_id, "edit", node="shot", edit=edit), timeout=10
        )
        assert refused.status == "rejected" and why in refused.detail, refused
    await sim.configure()  # the vendor takes the edited request
    code, out, err = await cli(
        lf,
        tmp_path,
        "change",
        "edit",
        plan.task_id,
        "--node",
        "shot",
        "--set",
        "prompt=a calm evening at sea",
        "--note",
        "the filter trips on 'storm'",
        "--as",
        "director",
    )
    assert (code, out.strip()) == (0, "accepted (edit by director)"), err
    result = await handle.result()
    assert result.state == "Completed", result.summary
    events = lf.recorder.read_events(plan.task_id)
    shots = [
        parse(e).action
        for e in events
        if e.type == "Intent"
        and e.payload["action"].get("node") == "shot"
        and e.payload["action"]["kind"] == "Dispatch"
    ]
    assert [s.input["prompt"] for s in shots] == ["a storm at sea", "a calm evening at sea"]
    assert shots[1].input["feedback"]["people"] == ["director (edit): the filter trips on 'storm'"]
    [resolved] = [parse(e) for e in events if e.type == "PartialResolution"]
    assert (resolved.node, resolved.resolution) == ("shot", "request edited (prompt) by director")
    assert resolved.note == "the filter trips on 'storm'"
    view = fold(events).requests[rid]
    assert (view.decision.value, view.decided_by) == ("resume", "director"), (
        "the edit resolved the dead letter"
    )
    assert recompute(events) == [], "every decision recomputes (table 6 for the edited dispatch)"
    keys = Keys(lf.recorder.key_registry(), verify, lf.settings.decision_window)
    assert audit_signatures(plan.task_id, events, keys, None).problems == ()


# ── reroute: from now on, at the new route's price ───────────────────────────────────────────────────────
THREE_SHOTS = """
goal: three shots, one at a time, moved to another vendor halfway
budget_ceiling: 12
concurrency: 1
stages:
  - {{id: shots, executor: {route}-primary, estimate: 1, fan_out: 3, canary: false}}
"""


async def test_a_reroute_moves_the_stages_next_attempts_and_one_the_budget_cannot_carry_is_refused(
    lf_with, sim
):
    route = f"image.{uuid.uuid4().hex[:8]}"
    table = RouteTable(
        routes={
            f"{route}-primary": RouteSpec(price=Price(per_call=Decimal("1"))),
            f"{route}-cheap": RouteSpec(price=Price(per_call=Decimal("1"))),
            f"{route}-dear": RouteSpec(price=Price(per_call=Decimal("50"))),
        }
    )
    await sim.configure(executors={f"{route}-primary": {"latency_seconds": 1.0, "cost": "1"}})
    async with lf_with(routes=table) as lf:
        plan = lf.plan(THREE_SHOTS.format(route=route))
        handle = await lf.start(plan)
        await until(lambda: dispatched(lf, plan.task_id) == ["shots/S01"], what="the first shot")
        dear = change(plan.task_id, "reroute", node="shots", edit={"route": f"{route}-dear"})
        refused = await people.send_change(lf.settings, plan.task_id, dear, timeout=10)
        assert refused.status == "rejected", refused
        assert refused.detail.startswith(f"task:{plan.task_id} is short by "), refused.detail
        assert f"2 node(s) of stage shots at 50 each on {route}-dear" in refused.detail
        cheap = change(plan.task_id, "reroute", node="shots", edit={"route": f"{route}-cheap"})
        moved = await people.send_change(lf.settings, plan.task_id, cheap, timeout=10)
        assert (moved.status, moved.detail) == ("accepted", "reroute by director"), moved
        result = await handle.result()
    assert result.state == "Completed", result.summary
    events = lf.recorder.read_events(plan.task_id)
    sent = {
        i.action.node: i.action.executor
        for e in events
        if e.type == "Intent" and isinstance(i := parse(e), Intent) and i.action.kind == "Dispatch"
    }
    assert sent["shots/S01"] == f"{route}-primary", "the shot in flight finished where it was"
    assert sent["shots/S02"] == sent["shots/S03"] == f"{route}-cheap", "the rest went to the new route"
    [recorded] = [parse(e) for e in events if e.type == "TaskChange"]
    # Every shot without its output yet moves (the one in flight keeps its attempt: its next one would move).
    assert {"shots/S02", "shots/S03"} <= set(recorded.nodes), recorded.nodes
    assert recorded.route_price == Decimal("1")
    assert recompute(events) == [], "every decision recomputes (table 7 after the re-route)"
    billed = await sim.charges(f"{plan.task_id}:")
    assert len({c["idempotency_key"] for c in billed}) == len(billed) == 3, "each shot paid once"
