"""What a task's workflow takes and returns, and its id: the contract with every client (CLI, plain Temporal).

Kept out of ``workflows/task.py`` so the workflow's sandbox imports it once, passed through, instead of
building these pydantic models again for every workflow run.
"""

from __future__ import annotations

from typing import Any, Final

from pydantic import BaseModel, Field
from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes

from rules.plan import Plan
from rules.projection import TaskState

# The task's custom search attributes: filter tasks in the Temporal UI or with
# `temporal workflow list --query 'LedgerflowProject="p1" AND LedgerflowWaitingOnPerson=true'`.
# Registered on the embedded dev server at start (ledgerflow.stack.services, tests/conftest.py) and by every
# worker when missing (workflows.visibility); where a worker may not, once by hand (docs/operations.md).
PROJECT: Final = SearchAttributeKey.for_keyword("LedgerflowProject")
EPISODE: Final = SearchAttributeKey.for_keyword("LedgerflowEpisode")
STATE: Final = SearchAttributeKey.for_keyword("LedgerflowTaskState")
SPENT: Final = SearchAttributeKey.for_float("LedgerflowSpent")
VERDICT: Final = SearchAttributeKey.for_keyword("LedgerflowVerdict")
WAITING: Final = SearchAttributeKey.for_bool("LedgerflowWaitingOnPerson")
SEARCH_ATTRIBUTES: Final = (PROJECT, EPISODE, STATE, SPENT, VERDICT, WAITING)


def starting_story(plan: Plan) -> dict[str, Any]:
    """``start_workflow``'s memo and search attributes for a task: its goal and project, and the search
    attributes as they stand before the run does anything (Queued, nothing spent). In the start event, they
    cost no history event of their own, a task is found by its project from the moment it is submitted, and
    a run recorded with ``STEADY_PATCHES_V3`` upserts only what changed since (``workflows.task._tell``)."""
    return {
        "memo": {"goal": plan.goal, "project": plan.project},
        "search_attributes": TypedSearchAttributes(
            [
                SearchAttributePair(PROJECT, plan.project),
                SearchAttributePair(EPISODE, plan.episode or ""),
                SearchAttributePair(STATE, TaskState.QUEUED.value),
                SearchAttributePair(SPENT, 0.0),
                SearchAttributePair(VERDICT, ""),
                SearchAttributePair(WAITING, False),
            ]
        ),
    }


class TaskInput(BaseModel):
    task_id: str
    plan: Plan
    # How long an executor may go without heartbeating before Temporal hands its activity to another worker.
    heartbeat_timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    # A run continues as new once its history holds this many events (or Temporal suggests it): far below
    # Temporal's hard limit of 51,200, which in-flight work drains into (workflows/task.py).
    max_history_events: int = Field(default=10_000, ge=50, le=40_000)
    continued: int = Field(default=0, ge=0)  # how many runs of this task continued as new before this one


class TaskResult(BaseModel):
    task_id: str
    state: str
    summary: dict[str, Any]


class DecisionRuling(BaseModel):
    """The answer to a ``decide`` Update: the ruling on the decision, as recorded in the ledger.

    ``status``: ``accepted`` (``detail``: what, by whom), ``already resolved`` (by what) or ``rejected``
    (why). A decision the Update's validator refuses (malformed, naming no open request) gets no ruling: the
    Update fails with the reason and nothing is recorded, in the ledger or in Temporal's history.
    """

    decision_id: str
    status: str
    detail: str


DECIDE = "decide"  # the Update people's decisions are sent as (and the signal that stays for raw use)
CHANGE = "change"  # the Update people's signed changes to a running task are sent as (rules.changes)
ADMITTED = "admitted"  # the signal that wakes a task waiting for admission (ledger.admission): ask again now
DECISION_REFUSED = "DecisionRefused"  # the ApplicationError type of a decision the Update's validator refuses


def workflow_id(task_id: str) -> str:
    """One workflow per task: its id is derived from the task id (never random)."""
    return f"ledgerflow-task-{task_id}"
