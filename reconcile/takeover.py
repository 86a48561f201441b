"""The takeover scan: tasks the ledger says are unfinished but whose workflow is not running.

Such a task lost its run (terminated, reset, a namespace restored from an older snapshot). ``ledgerflow
reconcile`` lists them and ``--apply`` resumes each from the ledger alone: a new run takes a new fencing
epoch and adopts every open operation, which its executor reconciles (``reconcile.operations``) before
anything is sent.
"""

from __future__ import annotations

from collections.abc import Callable

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError

from ledger.recorder import Recorder
from rules.envelope import StoredEvent
from rules.projection import Projection, fold


def task_histories(rec: Recorder, *, unfinished: bool) -> list[tuple[Projection, list[StoredEvent]]]:
    """Every task in the ledger, folded (only unfinished ones if asked: a task still compensating is one);
    histories that do not start with TaskCreated (leases taken by something other than a task) are not tasks
    and are skipped."""
    out = []
    for task_id in rec.task_ids():
        events = rec.read_events(task_id)
        if not events or events[0].type != "TaskCreated":
            continue
        p = fold(events)
        if not (unfinished and p.finished):
            out.append((p, events))
    return out


async def orphaned_tasks(rec: Recorder, client: Client, workflow_id: Callable[[str], str]) -> list[str]:
    """Unfinished tasks whose workflow (``workflow_id(task_id)``) is not running: candidates for takeover."""
    orphans = []
    for p, _ in task_histories(rec, unfinished=True):
        try:
            described = await client.get_workflow_handle(workflow_id(p.task_id)).describe()
        except RPCError:
            orphans.append(p.task_id)
            continue
        if described.status != WorkflowExecutionStatus.RUNNING:
            orphans.append(p.task_id)
    return orphans
