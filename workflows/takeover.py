"""Starting a task's takeover run from the ledger alone, on a client the caller has (the orphan scan's
activity, given it by the worker: ``reconcile`` sits below this layer and never imports it)."""

from __future__ import annotations

from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy

from rules.projection import Projection
from workflows.contracts import TaskInput, workflow_id
from workflows.task import TaskWorkflow


async def start_takeover(
    client: Client, p: Projection, *, task_queue: str, heartbeat_timeout_seconds: float
) -> str:
    """Start a new run of ``p``'s task from the ledger alone (what ``ledgerflow resume`` does, on a client
    the caller has): it takes a new fencing epoch and adopts every open operation. Returns its run id.

    Raises:
        WorkflowAlreadyStartedError: a run of the task is running (started meanwhile).
    """
    plan = p.plan.model_copy(update={"task_id": p.task_id})
    handle = await client.start_workflow(
        TaskWorkflow.run,
        TaskInput(task_id=p.task_id, plan=plan, heartbeat_timeout_seconds=heartbeat_timeout_seconds),
        id=workflow_id(p.task_id),
        task_queue=task_queue,
        # The old run is closed or unknown to the namespace: a new run of the same id is the takeover.
        id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
        id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
    )
    return handle.result_run_id or ""
