"""Errors raised by vendor adapters, classified by what the caller may safely do next.

The adapter never retries: Temporal's activity retry policy does. These types exist so that policy (and the
reconciler) can tell "retry later", "look the job up before resubmitting" and "give up" apart. Messages never
contain the API key, because Temporal stores exception messages in workflow history.
"""

from __future__ import annotations


class VendorError(Exception):
    """Base class of every error a vendor adapter raises."""

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class VendorUnavailable(VendorError):
    """A 5xx answer, a refused connection or a timeout.

    The outcome of the request is unknown: a submit may have been accepted and charged even though no job came
    back (a dropped response). Look the job up by its operation key before submitting again.
    """


class VendorRateLimited(VendorError):
    """A 429 answer: nothing was accepted or charged; try again after ``retry_after`` seconds."""

    def __init__(self, retry_after: float, message: str | None = None) -> None:
        super().__init__(
            message or f"vendor rate limited the request; retry after {retry_after}s", status_code=429
        )
        self.retry_after = retry_after


class VendorRejected(VendorError):
    """A 4xx answer other than 429: the request itself is wrong, so repeating it cannot help."""


class VendorNotFound(VendorRejected):
    """A 404 answer: the vendor has no such job."""


class VendorConflict(VendorRejected):
    """A 409 answer: the operation key was already used with a different request body."""


class VendorCannotTell(VendorError):
    """The vendor cannot look jobs up by operation key (501), so a lost submit cannot be reconciled."""


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
