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
