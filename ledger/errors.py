"""The ledger's own error hierarchy.

Driver errors (psycopg, SQLAlchemy) are translated into these exactly once, at the ledger's boundary
(``ledger.pgerrors``), so no caller ever has to know which driver the ledger runs on. Each error keeps its
constructor arguments as attributes and pickles cleanly (``__reduce__``), because errors cross process
boundaries in tests and workers.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any, Final

from rules.scopes import ROUTE_PREFIX


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


class BudgetRefused(LedgerError):
    """A reservation does not fit one of the task's budget scopes: nothing was written (no event, no reserve).

    ``scope`` is the first scope (in lock order) that is short; the figures are that account's, as locked.
    """

    def __init__(
        self, scope: str, ceiling: Decimal, spent: Decimal, reserved: Decimal, amount: Decimal
    ) -> None:
        left = ceiling - spent - reserved
        # A route's monthly cap is the vendor contract's, not one of the task's budgets: a person's add_budget
        # cannot raise it, so the message says who can.
        hint = (
            f"; {scope} is the route's monthly cap (the vendor contract's), not one of the task's budgets:"
            f" an operator raises it with `ledgerflow budget set {scope} N`, then the task is resumed"
            if scope.startswith(ROUTE_PREFIX)
            else ""
        )
        super().__init__(
            f"budget refused: {scope} has {_money(left)} left of {_money(ceiling)}"
            f" (spent {_money(spent)}, reserved {_money(reserved)}), needs {_money(amount)}{hint}"
        )
        self.scope = scope
        self.ceiling = ceiling
        self.spent = spent
        self.reserved = reserved
        self.amount = amount

    @property
    def remaining(self) -> Decimal:
        """``ceiling - spent - reserved``: what was left (negative once spend passed the ceiling)."""
        return self.ceiling - self.spent - self.reserved

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.scope, self.ceiling, self.spent, self.reserved, self.amount))


class InvalidAmount(LedgerError, ValueError):
    """An amount given to a budget method is not money: not a Decimal or int, negative, not finite, absurdly
    large, or finer than the ledger's six decimal places. Nothing was written."""

    def __init__(self, name: str, value: object, reason: str) -> None:
        super().__init__(f"{name}: {reason}, got {value!r:.60}")
        self.name = name
        self.value = value
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.name, self.value, self.reason))


class AlreadyResolved(LedgerError):
    """A write-ahead marker was refused because its operation already has its one result (nothing written):
    whoever resolved it (the task's end closing it, another attempt) decided; nothing may be sent now."""

    def __init__(self, dedup_key: str) -> None:
        super().__init__(f"{dedup_key} is already recorded: the operation is resolved")
        self.dedup_key = dedup_key

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.dedup_key,))


class SchemaMismatch(LedgerError):
    """The ledger database is not at the schema revision this ledgerflow needs; nothing was changed.

    ``database`` is the revision recorded there, or None: then ``earlier`` describes the schema of a release
    before migrations found there ("schema version 4"), or is None too when there is no ledger schema at all.
    ``newer``: ``database`` is a revision this ledgerflow does not know, so a newer ledgerflow wrote it.
    """

    def __init__(
        self, database: str | None, needed: str, newer: bool = False, earlier: str | None = None
    ) -> None:
        upgrade = "run `ledgerflow db upgrade`"
        at = f"the ledger database is at revision {database}"
        if newer:
            message = f"{at}, newer than this ledgerflow (knows up to {needed}): upgrade ledgerflow"
        elif database is not None:
            message = f"{at}, this ledgerflow needs {needed}: {upgrade}"
        elif earlier is not None:
            message = (
                f"the ledger database has the schema of a ledgerflow from before migrations ({earlier}),"
                f" this ledgerflow needs revision {needed}: {upgrade}"
            )
        else:
            message = f"the ledger database has no schema: {upgrade}"
        super().__init__(message)
        self.database = database
        self.needed = needed
        self.newer = newer
        self.earlier = earlier

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.database, self.needed, self.newer, self.earlier))


_CENT: Final = Decimal("0.01")


def _money(amount: Decimal) -> str:
    """``4.100000`` -> ``4.10``: at least two decimals, more only when they carry something."""
    try:
        cents = amount.quantize(_CENT)
    except InvalidOperation:  # beyond the context's precision: show it as it is
        return str(amount)
    return str(cents) if cents == amount else f"{amount.normalize():f}"


class RouteWaiting(Exception):
    """No route can take this dispatch now (the primary's breaker is open and no qualified fallback serves,
    or a fallback's canary has not passed yet): nothing was written; ask again after ``retry_s``. Not a
    LedgerError: it is retried, never a stop."""

    def __init__(self, executor: str, reason: str, retry_s: float) -> None:
        super().__init__(f"{executor}: no route serves now ({reason[:300]})")
        self.executor, self.reason, self.retry_s = executor, reason, retry_s

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.executor, self.reason, self.retry_s))


class RouteContended(RouteWaiting):
    """Another dispatch changed the route's row between this one's read and its claim: ask again at once."""
