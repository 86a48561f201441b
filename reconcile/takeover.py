"""The takeover scan: tasks the ledger says are unfinished but whose workflow is not running.

Such a task lost its run (terminated, reset, a namespace restored from an older snapshot). ``ledgerflow
reconcile`` lists them and ``--apply`` resumes each from the ledger alone: a new run takes a new fencing
epoch and adopts every open operation, which its executor reconciles (``reconcile.operations``) before
anything is sent.

A task whose end is recorded but whose run was lost before it closed its open operations is one too: each of
them still holds its reservation and its route's quota slot. Slots are never freed behind an operation's back
(its job may still be running at the vendor, and the route's quota is the vendor's): the new run closes the
operation from the vendor (``operation.close``), and the result gives the slot back in its own transaction.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError

from ledger.recorder import Recorder
from rules.envelope import StoredEvent
from rules.projection import Projection, fold


def needs_a_run(p: Projection) -> bool:
    """Whether a run still has work for the task: it is unfinished (a task still compensating is), or its end
    is recorded but an operation is still open — its run ended (was terminated) before ``operation.close``
    resolved it. An open operation holds its reservation and its route's quota slot (given back only with its
    one result), so a new run must close it: a takeover's run finds the end recorded and closes every open
    operation from the vendor (workflows/task.py, ``_stop_in_flight``)."""
    return not p.finished or bool(p.in_flight())


def task_histories(
    rec: Recorder,
    *,
    keep: Callable[[Projection], bool] | None = None,
    only: Collection[str] | None = None,
) -> list[tuple[Projection, list[StoredEvent]]]:
    """Every task in the ledger (or the ``only`` ones), folded — those ``keep`` keeps, if given (a history it
    drops is not held); histories that do not start with TaskCreated (leases taken by something other than a
    task) are not tasks and are skipped."""
    out = []
    for task_id in rec.task_ids() if only is None else sorted(only):
        events = rec.read_events(task_id)
        if not events or events[0].type != "TaskCreated":
            continue
        p = fold(events)
        if keep is None or keep(p):
            out.append((p, events))
    return out


def unfinished(p: Projection) -> bool:
    """A task some run still has to finish (one compensating is unfinished too)."""
    return not p.finished


async def orphaned_tasks(
    rec: Recorder,
    client: Client,
    workflow_id: Callable[[str], str],
    *,
    only: Collection[str] | None = None,
) -> list[str]:
    """Tasks that need a run (``needs_a_run``) whose workflow (``workflow_id(task_id)``) is not running:
    candidates for takeover. ``only``: look at these tasks alone."""
    orphans = []
    for p, _ in task_histories(rec, keep=needs_a_run, only=only):
        try:
            described = await client.get_workflow_handle(workflow_id(p.task_id)).describe()
        except RPCError:
            orphans.append(p.task_id)
            continue
        if described.status != WorkflowExecutionStatus.RUNNING:
            orphans.append(p.task_id)
    return orphans
