"""What to do with an operation whose INTENT has no result yet (design.md §7), before anything is sent.

An executor reaches an open operation in three ways: its first attempt, a Temporal retry (the worker died or
the vendor call failed), or a takeover (a new run resumed the task from the ledger). Only the ledger and the
vendor know how far the operation got, so the decision is made from them, never from local memory:

* a job id is known (heartbeat detail or a Progress event) → resume polling that job;
* the vendor honours idempotency keys → submit again under the same key: the vendor returns the existing job
  and charges nothing new, so a resubmission *is* the lookup;
* the operation never reached the vendor (no ``submitting`` marker) → submit;
* the vendor can look jobs up by key → found: adopt it; provably absent: void the INTENT (the loop decides
  afresh, under a new OperationKey);
* the vendor can do neither → the outcome is unknown: a person decides, and the possible duplicate charge
  is flagged as a cost anomaly. Never a blind resubmit.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from rules.envelope import StoredEvent
from vendors.errors import VendorCannotTell
from vendors.http import HttpJobVendor, VendorJob


class VendorMode(StrEnum):
    """What the vendor can do for us after a crash."""

    IDEMPOTENT = "idempotent"  # same key → same job, no new charge (and lookup)
    LOOKUP_ONLY = "lookup_only"  # no deduplication, but jobs can be found by key
    NONE = "none"  # neither: after a crash the vendor cannot say whether it ran


class Next(StrEnum):
    RESUME = "resume"
    SUBMIT = "submit"
    VOID = "void"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class OperationState:
    """How far the ledger says an operation got."""

    result: StoredEvent | None
    job_id: str | None
    submitting: bool  # a submit may have been sent (the marker is written just before the call)


def operation_state(events: list[StoredEvent]) -> OperationState:
    result = next((e for e in events if e.dedup_key.endswith(":result")), None)
    job_id = next((str(e.payload["job_id"]) for e in reversed(events) if e.type == "Progress"), None)
    submitting = any(e.type == "SystemMarker" and e.payload.get("kind") == "submitting" for e in events)
    return OperationState(result=result, job_id=job_id, submitting=submitting)


@dataclass(frozen=True)
class Resolution:
    next: Next
    job: VendorJob | None = None
    why: str = ""


async def reconcile(
    vendor: HttpJobVendor, mode: VendorMode, operation_key: str, state: OperationState, job_id: str | None
) -> Resolution:
    """Decide how an open operation continues. ``job_id`` is the heartbeat's, if this is a retry."""
    known = job_id or state.job_id
    if known is not None:
        return Resolution(Next.RESUME, await vendor.get(known), "job id on record")
    if mode == VendorMode.IDEMPOTENT:
        return Resolution(Next.SUBMIT, why="the vendor deduplicates on the key")
    if not state.submitting:
        return Resolution(Next.SUBMIT, why="never sent to the vendor")
    if mode == VendorMode.LOOKUP_ONLY:
        try:
            jobs = await vendor.find_by_key(operation_key)
        except VendorCannotTell:
            return Resolution(Next.UNKNOWN, why="the vendor could not look the key up")
        if jobs:
            return Resolution(Next.RESUME, jobs[0], "found at the vendor by key")
        return Resolution(Next.VOID, why="provably not at the vendor")
    return Resolution(Next.UNKNOWN, why="the vendor can neither deduplicate nor look up")
