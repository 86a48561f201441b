"""Errors raised by vendor adapters, classified by what is known about the request that failed.

The adapter never retries: Temporal's activity retry policy does, and the operation lifecycle decides what an
error means for the operation (``activities/boundary.py``). Two facts matter and every type states them:

* ``refused``: the vendor answered in a way that proves it did not accept the request (429, 408, 401, 403,
  400, 422 …): nothing was created, nothing charged. A refused submit clears the "maybe sent" state.
* everything else after a submit (a timeout, a reset connection, a 5xx, a 409, an unreadable 2xx) may have
  been accepted and charged: the operation must be reconciled before anything is sent again.

Messages never contain the API key, because Temporal stores exception messages in workflow history.
"""

from __future__ import annotations


class VendorError(Exception):
    """Base class of every error a vendor adapter raises."""

    refused = False  # True: the vendor provably did not accept this request

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class VendorUnavailable(VendorError):
    """A 5xx answer, a refused or reset connection, or a timeout: the outcome of the request is unknown.

    A submit may have been accepted and charged even though no job came back (a dropped response, or a job the
    vendor creates after the client gave up): reconcile before submitting again.

    ``timed_out``: no answer came within the client's timeout. A route's breaker counts that apart from an
    error answer, so it is a flag rather than a subclass: the error keeps its one type name wherever it is
    told apart by name (Temporal's ApplicationError ``type``, the histories that hold it).
    """

    def __init__(self, message: str, *, status_code: int | None = None, timed_out: bool = False) -> None:
        super().__init__(message, status_code=status_code)
        self.timed_out = timed_out


class VendorOverloaded(VendorUnavailable):
    """A 5xx the route lists in ``refused_statuses`` (none by default): its vendor documents that this status
    means it is down or overloaded and did not take the request. Nothing was accepted: the request may go
    elsewhere. A 5xx the route does not list is a ``VendorUnavailable``: maybe accepted."""

    refused = True


class VendorRateLimited(VendorError):
    """A 429 answer: nothing was accepted or charged; try again after ``retry_after`` seconds."""

    refused = True

    def __init__(self, retry_after: float, message: str | None = None) -> None:
        super().__init__(
            message or f"vendor rate limited the request; retry after {retry_after}s", status_code=429
        )
        self.retry_after = retry_after


class VendorRequestTimeout(VendorError):
    """A 408 answer: the vendor gave up reading the request; nothing was accepted. Retry."""

    refused = True


class VendorAuthError(VendorError):
    """A 401 or 403 answer: the credential is wrong, expired or rotated. The route pauses for a person.

    Nothing this request asked for was done; a job accepted earlier keeps running (and its charge stands).
    """

    refused = True


class VendorRejected(VendorError):
    """A 4xx answer that refuses the request itself (400, 422 …): repeating it unchanged cannot help."""

    refused = True


class VendorNotFound(VendorError):
    """A 404 or 410: the vendor has no such job or output (any more: outputs and records get purged)."""


class VendorConflict(VendorError):
    """A 409: the key is already in use (another body, or a request still in flight): a job may exist."""


class VendorBadResponse(VendorError):
    """A 2xx whose body is not what the protocol promises: the request may well have been accepted."""


class VendorCannotTell(VendorError):
    """The vendor cannot look jobs up by operation key (501, or an adapter without lookup)."""


class UnsafeResultUrl(VendorError):
    """A result URL that cannot be parsed, is not http(s), or resolves to a loopback, private, link-local or
    metadata address its route does not allow-list: it is never fetched (nor sent a credential)."""


class ResultUnavailable(VendorError):
    """A result download refused or misdirected: a 401/403 from a CDN (an expired presigned URL), another 4xx,
    a redirect loop. That output fails (at its job's cost); the route is never paused for it: a route pauses
    only when the vendor's API refuses our credentials."""


class ResultTooLarge(VendorError):
    """A result larger than the route's ``max_result_bytes``: refused, never stored."""


class VendorWaitTimeout(VendorError):
    """A job was still not terminal when the caller's wait deadline passed."""

    def __init__(self, job_id: str, waited: float) -> None:
        super().__init__(f"job {job_id} still not finished after {waited:.1f}s")
        self.job_id = job_id
        self.waited = waited


class ArtifactHashMismatch(VendorError):
    """The downloaded artifact's sha256 differs from the one the vendor advertised for the job."""

    def __init__(self, job_id: str, expected: str, actual: str) -> None:
        super().__init__(f"artifact of job {job_id} has sha256 {actual}, vendor advertised {expected}")
        self.job_id = job_id
        self.expected = expected
        self.actual = actual
