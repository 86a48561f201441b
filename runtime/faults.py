"""Named fault points: where a crash test may stop a worker (dbos-style "named fault triggers").

``mark(point, **fields)`` prints ``MARK <point> k=v …`` when ``LEDGERFLOW_MARKS`` is set, so a test that
runs the worker as a subprocess can see exactly how far an operation got. With ``LEDGERFLOW_HOLD_AT=<point>``
(optionally ``LEDGERFLOW_HOLD_OP=<substring of the operation key>``) the worker stops dead right after that
mark — the whole process, not just the task — so a SIGKILL lands exactly there. Off by default: one
environment lookup per call.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

POINTS = (
    "intent_recorded",  # the fenced INTENT committed (ledger.append)
    "submitting",  # about to call the vendor (after the submit marker, if the vendor mode needs one)
    "vendor_accepted",  # the vendor answered the submit: it has the job and has charged
    "progress_recorded",  # Progress(job id) committed
    "polling",  # polling a running job
    "vendor_completed",  # the job is finished at the vendor, nothing fetched yet
    "artifact_staged",  # the artifact's bytes are in a temp file, not yet renamed into place
    "artifact_stored",  # the artifact is in the store, its Outcome not yet recorded
    "outcome_recorded",  # the result (Outcome / Failure) committed
    "change_recorded",  # a person's signed change committed (TaskChange), what it settles not yet
)


def mark(point: str, **fields: object) -> None:
    if _CRASH:
        _maybe_crash(point, " ".join(f"{k}={v}" for k, v in fields.items()))
    if not os.environ.get("LEDGERFLOW_MARKS"):
        return
    detail = " ".join(f"{k}={v}" for k, v in fields.items())
    sys.stdout.write(f"MARK {point} {detail}\n")
    sys.stdout.flush()
    if os.environ.get("LEDGERFLOW_HOLD_AT") == point and os.environ.get("LEDGERFLOW_HOLD_OP", "") in detail:
        sys.stdout.write(f"MARK held {point} {detail}\n")
        sys.stdout.flush()
        # Stop every thread of the process at once (the event loop, Temporal's core, the activity threads):
        # a sleeping thread would leave the rest of the worker running. The test SIGKILLs it (or SIGCONTs it).
        # pthread_kill to this thread: stops the process before the next line of this thread can run
        # (os.kill to the process is delivered asynchronously, and the thread may go on briefly).
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


class SimulatedCrash(BaseException):
    """Raised at a fault point by ``crash_at`` (in-process tests): the worker "dies" right there.

    A BaseException, like a real crash it is never handled by an executor's ``except Exception``: the
    operation is left exactly as far as it got, for the next attempt or run to reconcile.
    """


_CRASH: dict[str, str] = {}


def crash_at(point: str, op: str = "") -> None:
    """Arm a one-shot simulated crash at ``point`` (for an operation key containing ``op``), in-process."""
    _CRASH.clear()
    _CRASH.update(point=point, op=op)


def disarm() -> None:
    """Disarm a crash ``crash_at`` armed that has not fired (a test's leftover would hit another's)."""
    _CRASH.clear()


def _maybe_crash(point: str, detail: str) -> None:
    if _CRASH and _CRASH["point"] == point and _CRASH["op"] in detail:
        _CRASH.clear()
        raise SimulatedCrash(f"simulated crash at {point} {detail}")
