"""A workflow reset while a paid activity is in flight: the new run adopts the open INTENT, pays once."""

from __future__ import annotations

import asyncio
import uuid
from decimal import Decimal

from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType, ResetReapplyType
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest

from rules.events import parse
from rules.projection import fold
from workflows.contracts import TaskResult

ONE_SHOT = """
goal: one slow paid shot
budget_ceiling: 10
stages:
  - {id: shot, executor: video.motion, estimate: 1.50}
"""


async def test_reset_mid_activity_adopts_the_open_operation_and_pays_once(lf, sim):
    await sim.configure(executors={"video.motion": {"latency_seconds": 2.0}})
    plan = lf.plan(ONE_SHOT)
    handle = await lf.start(plan)
    op = f"{plan.task_id}:shot:a1"
    while not await sim.charges(op):  # the vendor has accepted (and charged) the job
        await asyncio.sleep(0.05)
    history = await handle.fetch_history()
    first_task_done = next(
        e.event_id for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
    )
    reset = await lf.client.workflow_service.reset_workflow_execution(
        ResetWorkflowExecutionRequest(
            namespace=lf.client.namespace,
            workflow_execution=WorkflowExecution(workflow_id=handle.id, run_id=handle.result_run_id),
            reason="test: reset while the paid activity is in flight",
            workflow_task_finish_event_id=first_task_done,
            request_id=str(uuid.uuid4()),
            reset_reapply_type=ResetReapplyType.RESET_REAPPLY_TYPE_NONE,
        )
    )
    new_run = lf.client.get_workflow_handle(handle.id, run_id=reset.run_id, result_type=TaskResult)
    assert (await new_run.result()).state == "Completed"
    events = lf.recorder.read_events(plan.task_id)
    epochs = {e.epoch for e in events if e.type == "Intent"}
    assert len(epochs) >= 2  # the reset run took the task over with a new epoch
    charges = await sim.charges(op)
    assert (
        len(charges) == 1 and [c["idempotency_key"] for c in await sim.charges(plan.task_id)].count(op) == 1
    )
    outcomes = [parse(e) for e in events if e.type == "Outcome" and e.payload["node"] == "shot"]
    assert [o.operation_key for o in outcomes] == [op] and outcomes[0].job_id == charges[0]["job_id"]
    assert sum((parse(e).actual_cost for e in events if e.type == "Outcome"), Decimal(0)) == await sim.total(
        plan.task_id
    )
    assert fold(events).reserved == 0
