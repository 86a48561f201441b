"""The stored shape of a ledger event, shared by the ledger, the workflow and the audit.

The envelope is deliberately untyped in its payload (a JSON object): the ledger stores and returns facts
without interpreting them; ``rules.events.parse`` turns a payload into its typed event model.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field


class NewEvent(BaseModel, frozen=True):
    """An event about to be appended: the ledger assigns ``seq``, ``epoch`` and ``recorded_at``."""

    type: str
    dedup_key: str = Field(min_length=1, max_length=400)
    operation_key: str | None = None
    schema_version: int = 1
    payload: dict[str, Any] = Field(default_factory=dict)

    def stored(self, task_id: str, seq: int, epoch: int, recorded_at: datetime) -> StoredEvent:
        """This event as the ledger would hold it at ``seq`` (for folds that run ahead of the ledger: the LLM
        planner's check, the rule tests' histories, the decision benchmark)."""
        return StoredEvent(
            task_id=task_id,
            seq=seq,
            type=self.type,
            schema_version=self.schema_version,
            epoch=epoch,
            dedup_key=self.dedup_key,
            operation_key=self.operation_key,
            payload=self.payload,
            recorded_at=recorded_at,
        )


class StoredEvent(BaseModel, frozen=True):
    """An event as the ledger holds it. ``recorded_at`` is the database server's clock."""

    task_id: str
    seq: int
    type: str
    schema_version: int
    epoch: int
    dedup_key: str
    operation_key: str | None
    payload: dict[str, Any]
    recorded_at: datetime
