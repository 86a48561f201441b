"""Starting a task with the plain Temporal client (or the UI, or another SDK) is a first-class path: the
plan is validated exactly as ``ledgerflow submit`` validates it, and an invalid one fails the workflow at
once, with the problem named and nothing written to the ledger."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError

from rules.plan import Plan
from workflows.contracts import TaskInput, workflow_id
from workflows.task import TaskWorkflow


def _raw(**change: object) -> dict[str, object]:
    raw: dict[str, object] = {
        "goal": "started by a plain client",
        "budget_ceiling": "10",
        "stages": [
            {"id": "a", "executor": "llm.text", "estimate": "1", "depends_on": ["b"]},
            {"id": "b", "executor": "llm.text", "estimate": "1", "depends_on": ["a"]},
        ],
    }
    return {**raw, **change}


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (_raw(), "invalid plan: stage 'a': dependency cycle a -> b -> a"),
        (
            _raw(stages=[{"id": "a", "executor": "video.nope", "estimate": "1"}]),
            "invalid plan: stage 'a': executor 'video.nope'",
        ),
        (
            _raw(budget_ceiling="0.5", stages=[{"id": "a", "executor": "llm.text", "estimate": "1"}]),
            "invalid plan: budget_ceiling 0.5 is below the plan's estimated total 1.10",
        ),
    ],
    ids=["cycle", "unknown-route", "over-budget"],
)
async def test_an_invalid_plan_started_with_the_plain_client_fails_at_once_naming_the_problem(
    lf, raw, problem
):
    task_id = f"plain-{abs(hash(str(raw))) % 10**8}-{lf.task_queue[-6:]}"
    plan = Plan.model_validate({**raw, "task_id": task_id})  # the model alone does not see the problem
    handle = await lf.client.start_workflow(
        TaskWorkflow.run,
        TaskInput(task_id=task_id, plan=plan),
        id=workflow_id(task_id),
        task_queue=lf.task_queue,
    )
    with pytest.raises(WorkflowFailureError) as failed:
        await asyncio.wait_for(handle.result(), 20)
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "PlanInvalid" and cause.non_retryable
    assert problem in str(cause), str(cause)
    assert lf.recorder.current_epoch(task_id) is None  # nothing written: no lease, no budget, no event
    assert lf.recorder.read_events(task_id) == []
