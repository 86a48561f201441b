"""What a task's workflow takes and returns, and its id: the contract with every client (CLI, plain Temporal).

Kept out of ``workflows/task.py`` so the workflow's sandbox imports it once, passed through, instead of
building these pydantic models again for every workflow run.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from rules.plan import Plan


class TaskInput(BaseModel):
    task_id: str
    plan: Plan
    # How long an executor may go without heartbeating before Temporal hands its activity to another worker.
    heartbeat_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)


class TaskResult(BaseModel):
    task_id: str
    state: str
    summary: dict[str, Any]


def workflow_id(task_id: str) -> str:
    """One workflow per task: its id is derived from the task id (never random)."""
    return f"ledgerflow-task-{task_id}"
