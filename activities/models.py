"""Inputs of the executor activities (one parameter object each, so fields can be added compatibly)."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from pydantic import BaseModel

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


class GateInput(BaseModel):
    task_id: str
    node: str
    operation_key: str
    input_version: int


class RecordDecisionInput(BaseModel):
    """A signalled human decision, exactly as received (validated by the activity, not by the model)."""

    task_id: str
    decision: Any
    after: int


class LlmDecideInput(BaseModel):
    """An open question: the task's fold at ``watermark``, decided at ``decided_at`` (workflow time)."""

    task_id: str
    watermark: int
    summary: dict[str, Any]
    allowed: list[str]
    # Optional for inputs scheduled before it existed: without it, only the output's shape is recorded.
    decided_at: datetime | None = None
