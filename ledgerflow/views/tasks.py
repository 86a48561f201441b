"""``ledgerflow tasks``: every task's workflow, read from Temporal's visibility through the search attributes
each run keeps up to date (workflows.contracts.SEARCH_ATTRIBUTES): state, project, spent, waiting on a person.

One query, no per-task call: a list of thousands of tasks costs what Temporal's list costs. A task whose run
has not told its state yet (it just started) shows Temporal's own status instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from rich import box
from rich.table import Table
from temporalio.client import WorkflowExecution

from ledgerflow import client as lf
from ledgerflow.errors import ClientError
from rules.plan import ID_PATTERN
from runtime.settings import Settings
from workflows.contracts import EPISODE, PROJECT, SPENT, STATE, VERDICT, WAITING, workflow_id

WORKFLOW_TYPE: Final = "TaskWorkflow"
PREFIX: Final = workflow_id("")
_ID_RE: Final = re.compile(ID_PATTERN)


@dataclass(frozen=True)
class TaskRow:
    task_id: str
    state: str
    project: str | None
    episode: str | None
    spent: float | None
    waiting_on_person: bool
    verdict: str | None
    workflow_status: str  # Temporal's: Running, Completed, Terminated …
    started_at: datetime | None
    run_id: str | None

    def as_json(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "state": self.state,
            "project": self.project,
            "episode": self.episode,
            "spent": self.spent,
            "waiting_on_person": self.waiting_on_person,
            "verdict": self.verdict,
            "workflow_status": self.workflow_status,
            "started_at": self.started_at.isoformat() if self.started_at else None,
            "run_id": self.run_id,
        }


def query(project: str | None = None, waiting: bool = False) -> str:
    """The visibility query: the task workflows, of one project and/or waiting on a person if asked."""
    clauses = [f'WorkflowType = "{WORKFLOW_TYPE}"']
    if project is not None:
        if not _ID_RE.fullmatch(project):
            raise ClientError(f"--project {project[:40]!r} is not a project id (A-Z a-z 0-9 _ . -)")
        clauses.append(f'{PROJECT.name} = "{project}"')
    if waiting:
        clauses.append(f"{WAITING.name} = true")
    return " AND ".join(clauses)


def row(execution: WorkflowExecution) -> TaskRow:
    attrs = execution.typed_search_attributes
    status = execution.status.name.title().replace("_", "") if execution.status is not None else "Unknown"
    return TaskRow(
        task_id=execution.id.removeprefix(PREFIX),
        state=attrs.get(STATE) or status,
        project=attrs.get(PROJECT),
        episode=attrs.get(EPISODE) or None,
        spent=attrs.get(SPENT),
        waiting_on_person=bool(attrs.get(WAITING)),
        verdict=attrs.get(VERDICT) or None,
        workflow_status=status,
        started_at=execution.start_time,
        run_id=execution.run_id,
    )


async def list_tasks(
    settings: Settings, project: str | None = None, *, waiting: bool = False, limit: int = 50
) -> list[TaskRow]:
    """The newest ``limit`` tasks (one row per task: its latest run, when it continued as new or was taken
    over), newest first."""
    client = await lf.connect(settings)
    latest: dict[str, TaskRow] = {}
    # Runs that continued as new are listed too (each run is an execution): a task's newest run speaks for it.
    async for execution in client.list_workflows(query(project, waiting), page_size=min(1000, 4 * limit)):
        r = row(execution)
        kept = latest.get(r.task_id)
        if kept is None or (r.started_at and kept.started_at and r.started_at > kept.started_at):
            latest[r.task_id] = r
        if len(latest) > limit and kept is None:
            break
    rows = sorted(latest.values(), key=lambda r: r.started_at or datetime.min, reverse=True)
    return rows[:limit]


def table(rows: list[TaskRow]) -> Table:
    t = Table(
        title=f"{len(rows)} tasks, newest first", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False
    )
    t.add_column("task", no_wrap=True)  # ids are what a person copies: never folded
    t.add_column("state", no_wrap=True)
    t.add_column("project", no_wrap=True)
    t.add_column("spent", justify="right", no_wrap=True)
    t.add_column("person", no_wrap=True)  # waiting on one?
    t.add_column("started", no_wrap=True)
    today = datetime.now().astimezone().date()
    for r in rows:
        started = r.started_at.astimezone() if r.started_at else None
        t.add_row(
            r.task_id,
            state_text(r),
            r.project or "",
            f"{r.spent:.2f}" if r.spent is not None else "",
            "[bold yellow]yes[/bold yellow]" if r.waiting_on_person else "",
            "" if started is None else started.strftime("%H:%M:%S" if started.date() == today else "%b %d"),
        )
    if any(r.workflow_status not in ("Running", "Completed") for r in rows):
        t.caption = (
            "*: its workflow ended (terminated, timed out) before the task did: see ledgerflow reconcile"
        )
    return t


def state_text(r: TaskRow) -> str:
    """The task's state, starred when its workflow ended otherwise than by returning (terminated, timed out
    …): the ledger still holds the task, and ``ledgerflow reconcile`` resumes it (JSON: workflow_status)."""
    if r.workflow_status in ("Running", "Completed"):
        return r.state
    return f"{r.state}*"
