"""The ledger's own error hierarchy.

Driver errors (psycopg, SQLAlchemy) are translated into these exactly once, at the recorder boundary, so no
caller ever has to know which driver the ledger runs on. Each error keeps its constructor arguments as
attributes and pickles cleanly (``__reduce__``), because errors cross process boundaries in tests and workers.
"""

from __future__ import annotations

from typing import Any


class LedgerError(Exception):
    """Base class of every error the ledger raises."""


class StaleEpoch(LedgerError):
    """A fenced write came from a run whose epoch is no longer the task's current one.

    Nothing was written. The run that holds ``expected`` has been superseded by a newer run (``actual``)
    and must stop: retrying cannot succeed.
    """

    def __init__(self, task_id: str, expected: int, actual: int) -> None:
        super().__init__(
            f"task {task_id!r}: write fenced at epoch {expected}, but the current epoch is {actual}"
        )
        self.task_id = task_id
        self.expected = expected
        self.actual = actual

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.task_id, self.expected, self.actual))


class DuplicateEvent(LedgerError):
    """A write hit an existing dedup key where a duplicate is not acceptable; nothing of it was written."""

    def __init__(self, dedup_key: str) -> None:
        super().__init__(f"an event with dedup key {dedup_key!r} already exists")
        self.dedup_key = dedup_key

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.dedup_key,))


class TaskNotFound(LedgerError):
    """The task has no lease row: nobody ever took a lease on it, so nothing may be appended to it."""

    def __init__(self, task_id: str) -> None:
        super().__init__(f"task {task_id!r} has no lease (take_lease was never called for it)")
        self.task_id = task_id

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.task_id,))


class LedgerUnavailable(LedgerError):
    """The database could not be reached or the connection broke mid-call.

    Whether the interrupted write committed is unknown: callers retry, and the dedup keys make the retry
    safe.
    """
