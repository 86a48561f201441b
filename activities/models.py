"""Inputs of the executor activities (one parameter object each, so fields can be added compatibly)."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from pydantic import BaseModel

from rules.envelope import NewEvent
from rules.plan import OutputSpec


class StageInput(BaseModel):
    """One business attempt of one node: everything the executor needs, and no secrets."""

    task_id: str
    node: str
    operation_key: str
    attempt: int
    epoch: int
    executor: str
    estimate: Decimal
    input: dict[str, Any] = {}
    stall_after: float = 600.0  # seconds without progress before the watchdog cancels the job
    output: OutputSpec | None = None  # the stage's output bounds: the node check an artifact must pass
    input_hash: str | None = None  # the request's input hash (recorded with the Outcome)
    # An earlier output of this node made from an equal request (rules.table): registered again, nothing sent.
    reuse: dict[str, Any] | None = None
    # The plan opted in to reuse across its project: the executor may look for an earlier task's output.
    reuse_project: str | None = None
    # The dispatch's INTENT, for the executor to write as its first step (activities.operation.recorded); None
    # when the workflow wrote it (histories recorded before executors did).
    intent: NewEvent | None = None
    # Its place in a full route's queue (rules.routing.rank): the plan's priority and the task's deadline.
    priority: str = "standard"
    deadline: datetime | None = None
    # A failed task's compensation (rules.table R12): not held back by its route's breaker, and a finished job
    # that names no file is recorded with its receipt.
    undo: bool = False


class CloseInput(BaseModel):
    """An operation to resolve now (its task ended, or its executor gave up without a result)."""

    task_id: str
    node: str
    operation_key: str
    executor: str
    estimate: Decimal
    epoch: int = 0  # closing never calls a vendor to create anything: it is not fenced
    gave_up: str | None = None  # why its executor ended without a result (None: the task ended)
    output: OutputSpec | None = None  # the node's bounds, for a job that succeeded meanwhile
    input_hash: str | None = None


class SweepInput(BaseModel):
    task_id: str


class GateInput(BaseModel):
    task_id: str
    node: str
    operation_key: str
    input_version: int
    epoch: int | None = None  # None: scheduled before gates were fenced (opened unfenced)


class RecordDecisionInput(BaseModel):
    """A signalled human decision, exactly as received (validated by the activity, not by the model)."""

    task_id: str
    decision: Any
    after: int


class Received(BaseModel):
    """One signalled decision, exactly as received, and when it reached the workflow: the signal's own
    event time in Temporal's history when it was handled after its request's deadline (``people.arrivals``),
    else the workflow time it was handled at (which is never before it arrived)."""

    decision: Any
    received_at: datetime


class RecordDecisionsInput(BaseModel):
    """A batch of signalled decisions, ruled on and recorded in one local activity."""

    task_id: str
    decisions: list[Received]
    after: int


class ArrivalsInput(BaseModel):
    """Which signalled decisions (by ``rules.people.decision_ref``) to find in the run's history."""

    workflow_id: str
    run_id: str
    refs: list[str]


class LlmDecideInput(BaseModel):
    """An open question: the task's fold at ``watermark``, decided at ``decided_at`` (workflow time)."""

    task_id: str
    watermark: int
    summary: dict[str, Any]
    allowed: list[str]
    # Optional for inputs scheduled before it existed: without it, only the output's shape is recorded.
    decided_at: datetime | None = None
    epoch: int | None = None  # the run's fencing epoch: the paid call is made only while it is current
