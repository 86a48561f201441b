"""A task whose history grows long continues as new, as often as it needs: it stops dispatching, lets what
is in flight finish, and a new run re-opens the task from the ledger. Forced here with a low threshold,
mid-fan-out, with an approval and a rework round in between: the task completes once, with exact money.
Two fan-outs one after the other: a ledger longer than a page for the last runs to open, and no more in
flight at once than one fan-out."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

from peoplekit import wait_open
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from ledgerflow.views import people
from rules.events import vendor_spend
from rules.projection import fold
from rules.recompute import recompute
from runtime.signing import demo_key
from workflows.contracts import TaskInput, workflow_id
from workflows.task import LEDGER_PAGE, TaskWorkflow

PLAN = """
goal: a board a person approves, then sixty shots, one of them reworked, and sixty frames
budget_ceiling: 40
stages:
  - {id: board, executor: llm.text, estimate: 0.5, approval: true}
  - {id: shots, executor: image.keyframe, estimate: 0.4, depends_on: [board], fan_out: 60, canary: false}
  - {id: frames, executor: image.keyframe, estimate: 0.1, depends_on: [shots], fan_out: 60, canary: false}
  - {id: edit, executor: edit.assembly, estimate: 0.2, depends_on: [frames]}
"""
LIMIT = 150  # events per run: several runs for this task, the later ones opening a ledger of pages
REWORK_S03 = json.dumps({"scores": {"visual": 0.4}, "blame": {"visual": ["shots/S03"]}, "reasons": ["off"]})
PASS = json.dumps({"scores": {"visual": 0.9}, "blame": {}, "reasons": []})


async def test_a_long_task_continues_as_new_several_times_and_completes_with_exact_money(lf, sim):
    await sim.configure(
        executors={"image.keyframe": {"latency_seconds": 0.2}},
        chat_default=REWORK_S03,
        chat_script=[{"match": '"shots/S03": 2', "content": PASS}],
    )
    plan = lf.plan(PLAN)
    tid = plan.task_id
    handle = await lf.client.start_workflow(
        TaskWorkflow.run,
        TaskInput(task_id=tid, plan=plan, max_history_events=LIMIT),
        id=workflow_id(tid),
        task_queue=lf.task_queue,
    )
    rid = await wait_open(lf, tid, "approval:board")
    sent = await people.decide(lf.settings, demo_key("director"), tid, rid, "approve")
    assert sent.status == "accepted"
    result = await asyncio.wait_for(handle.result(), 120)  # follows the runs to the last one
    assert result.state == "Completed", result.summary

    runs = [w async for w in lf.client.list_workflows(f'WorkflowId="{workflow_id(tid)}"')]
    assert len(runs) >= 3, len(runs)  # continued as new at least twice
    events = lf.recorder.read_events(tid)
    p = fold(events)
    assert p.rework_rounds == 1 and p.nodes["shots/S03"].versions == 2
    # Money: every operation charged once at the vendor, and the ledger says exactly what the vendor billed.
    charges = await sim.charges(f"{tid}:")
    assert all(n == 1 for n in Counter(c["idempotency_key"] for c in charges).values())
    assert vendor_spend(events) == await sim.total(f"{tid}:")
    assert not p.in_flight() and p.reserved == 0
    # Each run took the next epoch; every decision on record is recomputable; every run's history replays.
    assert sorted({e.epoch for e in events}) == list(range(1, len(runs) + 1))
    last = max(e.epoch for e in events)
    assert min(e.seq for e in events if e.epoch == last) > LEDGER_PAGE  # it opened a ledger in pages
    assert recompute(events) == []
    replayer = Replayer(workflows=[TaskWorkflow], data_converter=pydantic_data_converter)
    for run in runs:
        history = await lf.client.get_workflow_handle(run.id, run_id=run.run_id).fetch_history()
        assert len(history.events) < LIMIT + 60  # the threshold, plus what drained into it
        await replayer.replay_workflow(history)


def test_opening_and_reading_a_long_ledger_come_in_pages(lf):
    """The ledger's local activities never return more than a page when asked for one."""
    from activities.contracts import OpenTaskInput, ReadInput
    from activities.ledger import LedgerActivities
    from rules.events import SystemMarker, to_new

    plan = lf.plan(PLAN)
    tid = plan.task_id
    ledger = LedgerActivities(lf.recorder)
    opened = ledger.open_task(OpenTaskInput(task_id=tid, plan=plan, holder="test", limit=10))
    assert opened.complete and len(opened.events) == 1  # TaskCreated
    markers = [to_new(SystemMarker(kind="lease", detail=str(i)), dedup_key=f"{tid}:m{i}") for i in range(25)]
    lf.recorder.append_fenced(tid, opened.epoch, markers)
    again = ledger.open_task(OpenTaskInput(task_id=tid, plan=plan, holder="test", limit=10))
    assert not again.complete and [e.seq for e in again.events] == list(range(1, 11))
    page = ledger.read(ReadInput(task_id=tid, after=10, limit=10))
    assert [e.seq for e in page] == list(range(11, 21))
    assert [e.seq for e in ledger.read(ReadInput(task_id=tid, after=20, limit=10))] == list(range(21, 27))
