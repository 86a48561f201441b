"""Admission at the task level, end to end (ledger.admission): with ``active_tasks`` = 1, three tasks started
together run one after another, in the order they asked; each waiting task is woken by the ending one's
signal (not by its recheck timer), a waiting task says so in its status, and every history replays. Real
Temporal, real Postgres, the simulator."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from ledger.recorder import Recorder
from ledgerflow.views.report import status_table
from rules.envelope import StoredEvent
from rules.events import vendor_spend
from rules.recompute import recompute
from workflows.policies import ADMISSION_RECHECK_MIN_S
from workflows.task import TaskWorkflow

PLAN = """
goal: two quick stages
budget_ceiling: 5
stages:
  - {id: draft, executor: llm.text, estimate: 0.5}
  - {id: polish, executor: llm.text, estimate: 0.5, depends_on: [draft]}
"""


def span(events: list[StoredEvent]) -> tuple[float, float]:
    """From the task's first INTENT (its work started) to its last event (its end), on the ledger's clock."""
    first = next(e for e in events if e.type == "Intent")
    return first.recorded_at.timestamp(), events[-1].recorded_at.timestamp()


async def test_past_the_bound_tasks_wait_for_a_place_and_run_in_the_order_they_asked(
    lf_with: Any, sim: Any, recorder: Recorder
) -> None:
    await sim.configure(executors={"llm.text": {"latency_seconds": 0.5}})
    async with lf_with(active_tasks=1) as lf:
        plans = [lf.plan(PLAN) for _ in range(3)]
        handles = []
        for plan in plans:  # one after another, so the order they asked in is known
            handles.append(await lf.start(plan))
            await lf.wait_state(handles[-1], {"Queued", "Running"})
        status = await handles[2].query("status")
        assert status["admission"] == {"waiting": True, "ahead": 1}
        assert "waiting for admission, 1 ahead" in str(status_table(status).title)  # ledgerflow status
        results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 120)
    assert [r.state for r in results] == ["Completed"] * 3

    spans = [span(recorder.read_events(str(p.task_id))) for p in plans]
    for (_, ended), (started, _) in itertools.pairwise(spans):
        assert started >= ended  # one at a time, in the order they asked
        # Woken by the ending task's signal, not by the recheck's timer (30 s at least).
        assert started - ended < ADMISSION_RECHECK_MIN_S / 3, started - ended
    replayer = Replayer(workflows=[TaskWorkflow], data_converter=pydantic_data_converter)
    signalled = []
    for plan, handle in zip(plans, handles, strict=True):
        events = recorder.read_events(str(plan.task_id))
        assert vendor_spend(events) == await sim.total(f"{plan.task_id}:")
        assert recompute(events) == []
        history = await handle.fetch_history()
        signalled.append(
            sum(e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED for e in history.events)
        )
        await replayer.replay_workflow(history)
    assert signalled == [0, 1, 1]
    with recorder._engine.connect() as conn:  # every place given back
        left = conn.exec_driver_sql(
            "SELECT count(*) FROM task_admission WHERE task_id = ANY(%(t)s)",
            {"t": [str(p.task_id) for p in plans]},
        ).scalar_one()
    assert left == 0


async def test_a_task_terminated_while_it_waited_passes_its_place_to_the_next(
    lf_with: Any, sim: Any, recorder: Recorder
) -> None:
    """Bound 1: A runs, B and C wait; B's workflow is terminated. When A ends the ledger gives B the place,
    the signal finds no B, and A gives B's place back for it: C starts at once, not at its recheck."""
    await sim.configure(executors={"llm.text": {"latency_seconds": 0.5}})
    async with lf_with(active_tasks=1) as lf:
        plans = [lf.plan(PLAN) for _ in range(3)]
        handles = []
        for plan in plans:
            handles.append(await lf.start(plan))
            await lf.wait_state(handles[-1], {"Queued", "Running"})
        assert (await handles[1].query("status"))["admission"]["waiting"]
        await handles[1].terminate("the test: gone while it waited")
        first, third = await asyncio.wait_for(asyncio.gather(handles[0].result(), handles[2].result()), 120)
        history = await handles[0].fetch_history()
    assert (first.state, third.state) == ("Completed", "Completed")
    (_, ended), (started, _) = (span(recorder.read_events(str(plans[n].task_id))) for n in (0, 2))
    assert 0 <= started - ended < ADMISSION_RECHECK_MIN_S / 3, started - ended
    failed = EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_FAILED
    assert sum(e.event_type == failed for e in history.events) == 1  # B's wake-up, which found no B
    with recorder._engine.connect() as conn:
        left = conn.exec_driver_sql(
            "SELECT count(*) FROM task_admission WHERE task_id = ANY(%(t)s)",
            {"t": [str(p.task_id) for p in plans]},
        ).scalar_one()
    assert left == 0
    await Replayer(workflows=[TaskWorkflow], data_converter=pydantic_data_converter).replay_workflow(history)


async def test_without_a_bound_a_task_asks_nothing_and_its_history_is_unchanged(
    lf_with: Any, sim: Any, recorder: Recorder
) -> None:
    """``active_tasks`` 0 (the default): no row, no admission activity, no signal in the history."""
    await sim.configure(executors={"llm.text": {"latency_seconds": 0.1}})
    async with lf_with() as lf:
        plan = lf.plan(PLAN)
        handle = await lf.start(plan)
        assert (await handle.result()).state == "Completed"
        history = await handle.fetch_history()
    names = {
        e.marker_recorded_event_attributes.details["data"].payloads[0].data
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
        and e.marker_recorded_event_attributes.marker_name == "core_local_activity"
    }
    assert any(b"ledger.open_task" in n for n in names)  # the probe sees the local activities
    assert not any(b"ledger.admit" in n or b"ledger.release" in n for n in names)
    with recorder._engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT count(*) FROM task_admission WHERE task_id = %(t)s", {"t": str(plan.task_id)}
        ).scalar_one()
    assert rows == 0
