"""The one error boundary: how an error inside an executor crosses into Temporal, and what it means there.

Executors resolve every outcome they can account for themselves (a refused request is a Failure at no cost,
a purged output a Failure at what the job cost, an unknown outcome a Failure at the estimate with a cost
anomaly). What is left crosses the boundary here, as an ``ApplicationError`` whose ``type`` is the class name
of the error, so the workflow reads a typed error, never a message:

* **retry later** — the vendor or the ledger is unreachable, rate-limits (after its ``Retry-After``), the
  route is paused for a person, no route serves the executor now (``RouteWaiting``: a breaker is open, a
  fallback's canary is out), or a maybe-sent request cannot be proven absent yet (after that long);
* **stop** — the run was fenced off (``StaleEpoch``: another run holds the task), or a bug (a ledger error
  that is not about availability, an error nobody classified): never retried; the workflow then closes the
  operation from the record and the vendor (``operation.close``), so nothing is left open and nothing is
  written off at zero.

The workflow reads what crossed with ``error_type``, ``refused_scope`` and ``error_text`` (this module is
passed through its sandbox: it is pure, no I/O); the types it tells apart are ``contracts.ErrorType``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import NoReturn

from temporalio.exceptions import ApplicationError, FailureError

from activities.contracts import ErrorType
from artifacts.store import ArtifactError
from ledger.errors import (
    BudgetRefused,
    LedgerError,
    LedgerUnavailable,
    RouteWaiting,
    StaleEpoch,
)
from vendors.errors import VendorError, VendorRateLimited


class RoutePaused(Exception):
    """The route this operation calls is paused (a credentials error): a person must fix it and resume it."""

    def __init__(self, route: str, reason: str, retry_s: float) -> None:
        super().__init__(
            f"route {route} is paused ({reason[:200]}): `ledgerflow routes resume {route}` once fixed"
        )
        self.retry_s = retry_s


class NotYetProvable(Exception):
    """A maybe-sent request could still create a job: look the key up again after ``wait_s``."""

    def __init__(self, why: str, wait_s: float) -> None:
        super().__init__(why)
        self.wait_s = wait_s


def to_application_error(error: BaseException) -> ApplicationError:
    """The ApplicationError an executor raises for ``error`` (its message never carries a secret)."""
    if isinstance(error, ApplicationError):
        return error
    name = type(error).__name__
    message = str(error)[:2000]
    if isinstance(error, StaleEpoch):
        return ApplicationError(message, type=name, non_retryable=True)
    if isinstance(error, BudgetRefused):
        # Not an error of the run: the loop records an escalation naming the scope that is short, read from
        # the details (``refused_scope``), never from the message.
        return ApplicationError(message, error.scope, type=name, non_retryable=True)
    if isinstance(error, LedgerUnavailable):
        return ApplicationError(message, type=name)
    if isinstance(error, LedgerError):
        return ApplicationError(message, type=name, non_retryable=True)
    if isinstance(error, VendorRateLimited):
        return ApplicationError(message, type=name, next_retry_delay=_delay(error.retry_after))
    if isinstance(error, RoutePaused | RouteWaiting):
        return ApplicationError(message, type=name, next_retry_delay=_delay(error.retry_s))
    if isinstance(error, NotYetProvable):
        return ApplicationError(message, type=name, next_retry_delay=_delay(error.wait_s))
    if isinstance(error, VendorError | ArtifactError | OSError):
        # Unavailable, timeouts, 5xx, unreadable answers, a storage hiccup: reconciled on the next attempt.
        return ApplicationError(message, type=name)
    # Anything else is a bug no retry can fix: never retried forever with a reservation held. The workflow
    # closes the operation from the record and the vendor (operation.close), and a person sees the error.
    return ApplicationError(f"{name}: {message}", type=name, non_retryable=True)


def cross(error: Exception) -> NoReturn:
    """Raise ``error`` as it crosses into Temporal: as itself if it already is an ApplicationError (re-raising
    it "from" itself would make its cause chain a cycle), else as ``to_application_error`` makes it."""
    converted = to_application_error(error)
    if converted is error:
        raise error
    raise converted from error


def error_type(error: BaseException) -> str | None:
    """The ``type`` of the ApplicationError an activity raised (itself or in its causes)."""
    cause = _application_error(error)
    return cause.type if cause is not None else None


def refused_scope(error: BaseException) -> str | None:
    """The budget scope a ``BudgetRefused`` error names in its details (None: it names none)."""
    cause = _application_error(error)
    if cause is None or cause.type != ErrorType.BUDGET_REFUSED or not cause.details:
        return None
    scope = cause.details[0]
    return scope if isinstance(scope, str) else None


def error_text(error: BaseException) -> str:
    """The message of the innermost failure an activity reported (the ApplicationError's own), for a
    person to read: never parsed."""
    cause: BaseException | None = error
    while (
        isinstance(cause, FailureError)
        and not isinstance(cause, ApplicationError)
        and cause.cause is not None
    ):
        cause = cause.cause
    return str(cause or error)[:2000]


def _application_error(error: BaseException) -> ApplicationError | None:
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, ApplicationError):
        cause = cause.cause if isinstance(cause, FailureError) else None
    return cause


def _delay(seconds: float) -> timedelta:
    return timedelta(seconds=min(3600.0, max(0.1, seconds)))
