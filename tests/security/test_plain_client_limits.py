"""Issue 24 §6.4 on the real servers: a workflow started by a plain Temporal client (default JSON converter,
the plan as a raw mapping) with a deeply nested plan fails at once with PlanInvalid and nothing written.

Before the caps, an input 195 levels deep was accepted by open_task, whose result (the TaskCreated, a few
levels deeper) the workflow could then not decode (pydantic's JSON parser stops at about 200 levels): the
workflow task failed, was retried, and open_task took the lease again, forever. An input 33 deep ran."""

from __future__ import annotations

import asyncio
import time

import pytest
from limitskit import nested
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ApplicationError

from workflows.contracts import workflow_id


@pytest.mark.parametrize("depth", [33, 195])
async def test_a_deeply_nested_plan_from_a_plain_client_fails_fast_with_plan_invalid(lf, depth):
    plain = Client(lf.client.service_client, namespace=lf.client.namespace)  # the SDK's default converter
    task_id = f"deep-{depth}-{lf.task_queue[-6:]}"
    raw = {
        "task_id": task_id,
        "goal": "nested too deep",
        "budget_ceiling": "10",
        "stages": [{"id": "deep", "executor": "llm.text", "estimate": "1", "input": nested(depth)}],
    }
    started = time.monotonic()
    handle = await plain.start_workflow(
        "TaskWorkflow", {"task_id": task_id, "plan": raw}, id=workflow_id(task_id), task_queue=lf.task_queue
    )
    try:
        with pytest.raises(WorkflowFailureError) as failed:
            await asyncio.wait_for(handle.result(), 20)
    finally:
        if time.monotonic() - started >= 20:
            await handle.terminate("test: the run never ended")
    assert time.monotonic() - started < 10
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "PlanInvalid" and cause.non_retryable
    assert "invalid plan: stage 'deep': input is nested deeper than 32 levels" in str(cause), str(cause)
    assert lf.recorder.current_epoch(task_id) is None  # open_task never took a lease: nothing written
    assert lf.recorder.read_events(task_id) == []
