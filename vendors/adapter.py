"""The one small protocol every vendor adapter speaks, and the normalised job it reports.

An adapter turns one vendor's wire protocol into :class:`VendorJob` and :mod:`vendors.errors`; it never
retries (Temporal's retry policy does), never decides what a failure means for the task (the operation
lifecycle does, ``activities/operation.py``) and never sees the ledger. What an adapter can do after a crash
is declared by :class:`Capabilities`, which reconciliation (``reconcile/operations.py``) reads.

Kinds: ``jobs`` (submit / poll with an Idempotency-Key), ``predictions`` (Replicate's API: no key, found again
by what it asked), ``openai`` (synchronous chat and image generation), ``queue`` (a queue-style API: submit,
status, result; nothing to find a lost submit by), ``local`` (work the worker does itself).

The protocol is a public, versioned interface: adapters are plugins found by name through the entry point
group ``ledgerflow.adapters`` (``vendors.plugins``). :data:`ADAPTER_PROTOCOL_VERSION` is its major version; a
plugin declares the one it was written for and is refused if that major differs. What each method must
guarantee for the money promises is written down in ``docs/vendor-plugins.md``.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from enum import StrEnum
from typing import Annotated, Any, Protocol, runtime_checkable

from pydantic import BaseModel, Field, ValidationError, ValidatorFunctionWrapHandler, field_validator

from rules.money import VendorAmount, priced_amount, usage_problem, vendor_amount
from vendors.routes import RouteSpec, VendorMode

# The adapter protocol's major version (VendorAdapter, Capabilities, VendorJob, vendors.errors, the factory's
# AdapterContext): bumped only by a change an adapter written for the previous one could break under.
ADAPTER_PROTOCOL_VERSION = 1


class JobStatus(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self is not JobStatus.RUNNING


class JobErrorKind(StrEnum):
    """Why a vendor says its job failed (rules.events.FailureKind is how the rules then treat the attempt)."""

    TECHNICAL = "technical"  # worth retrying with the same input
    CONTENT_REJECTED = "content_rejected"  # the same input will be rejected again


class JobError(BaseModel, frozen=True):
    kind: JobErrorKind
    message: str = Field(max_length=4000)


class MediaInfo(BaseModel, frozen=True):
    """What the vendor says the artifact is; every field optional, unknown fields ignored."""

    format: str | None = Field(default=None, max_length=32)
    duration_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    width: int | None = Field(default=None, ge=0)
    height: int | None = Field(default=None, ge=0)
    rights: dict[str, Annotated[str, Field(max_length=200)]] | None = Field(default=None, max_length=20)


class ResultFile(BaseModel, frozen=True):
    """Where a finished job's output can be downloaded, and what the vendor says it is."""

    url: str = Field(max_length=4000)
    sha256: str | None = None  # None: the vendor advertises no hash (the download is hashed as it arrives)
    size: int | None = None
    media: MediaInfo | None = None  # None: no media metadata (or none we could read)

    @field_validator("media", mode="wrap")
    @classmethod
    def _unreadable_media_is_none(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # Metadata that does not parse must not strand a paid artifact: it is reported as absent, and the
        # checks (rights, media bounds, the probe of the file itself) judge the artifact without it.
        try:
            return handler(value)
        except ValidationError:
            return None


class VendorJob(BaseModel, frozen=True):
    """A vendor job as last reported, normalised across adapters.

    ``cost`` is the vendor's own figure exactly as reported (a string: it may be odd, negative, "NaN"); use
    :meth:`amount` to make it money. ``inline`` carries the output of a synchronous call (a chat answer, an
    image returned in the body) instead of a ``result`` URL.
    """

    id: str = Field(min_length=1, max_length=200)
    status: JobStatus
    progress: float | None = None  # 0..1, None when the vendor reports none (or nonsense)
    idempotency_key: str | None = None
    cost: str | None = None  # None: the vendor reports no cost (it is priced from the route)
    seconds: float | None = None  # compute / output seconds the vendor bills, where it says
    tokens_in: int = 0
    tokens_out: int = 0
    error: JobError | None = None
    result: ResultFile | None = None
    inline: bytes | None = None

    @field_validator("progress", mode="before")
    @classmethod
    def _sane_progress(cls, value: Any) -> float | None:
        # A NaN or out-of-range progress must never reach the ledger (JSONB refuses NaN); it is no signal.
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            return None
        try:
            number = float(value)
        except ValueError:
            return None
        return number if math.isfinite(number) and 0 <= number <= 1 else None

    @field_validator("cost", mode="before")
    @classmethod
    def _cost_as_reported(cls, value: Any) -> str | None:
        return None if value is None else str(value)[:100]


class VendorCharge(BaseModel, frozen=True):
    """One charge as the vendor's own billing lists it: what it billed, for which job, under which key.

    ``operation_key`` is the key the call carried (the jobs protocol's Idempotency-Key, a prediction's
    ``metadata.operation_key``), where the vendor keeps it. ``amount`` is the vendor's figure as written
    (``rules.money.vendor_amount`` makes it money, the way the ledger made the job's cost money).
    """

    job_id: str = Field(min_length=1, max_length=200)
    operation_key: str | None = Field(default=None, max_length=400)
    amount: str = Field(max_length=100)
    at: datetime | None = None


@dataclass(frozen=True, slots=True)
class Sent:
    """What was sent under an OperationKey, as its INTENT recorded it (``rules.actions.Dispatch``): the
    executor and the request, artifact references unresolved (their URLs are made per send, never recorded).
    A vendor that keeps no key of ours (Replicate) can only find its job again by what was asked."""

    executor: str
    request: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What an adapter can do for reconciliation after a crash, and what it costs to redo."""

    can_lookup: bool  # find_by_key works: a maybe-sent submit can be found or proven absent
    can_cancel: bool
    synchronous: bool  # submit returns the finished result (no job to poll, no late creation)
    has_billing: bool  # charged() reads the vendor's own billing record
    free: bool = False  # no vendor money is involved: redoing the work is harmless (the local adapter)
    # The protocol sends an idempotency key the vendor deduplicates on (a resubmission is a lookup). Without
    # one, a route's ``idempotent`` (the default of a route that states no mode) cannot hold.
    deduplicates: bool = False
    # charges() lists the vendor's own billing record, each charge with its job id and key: what the audit
    # (``ledgerflow audit --billing``) matches to operations.
    can_list_charges: bool = False


class VendorAdapter(Protocol):
    """One vendor protocol. Every method raises only :mod:`vendors.errors` types."""

    route: RouteSpec

    @property
    def capabilities(self) -> Capabilities: ...

    async def submit(
        self,
        *,
        operation_key: str,
        executor: str,
        request: dict[str, Any],
        estimate: Decimal,
        files: dict[str, str] | None = None,
    ) -> VendorJob:
        """Send one request under ``operation_key``; returns the job (finished, for a synchronous adapter).

        ``files``: sha256 → a URL the vendor can fetch that input from, sent beside the request (a presigned
        URL changes on every retry and must not make a resubmission look like another request).
        """
        ...

    async def get(self, job_id: str) -> VendorJob: ...

    async def find_by_key(
        self, operation_key: str, *, since: datetime | None = None, sent: Sent | None = None
    ) -> list[VendorJob]:
        """Every job the vendor holds for ``operation_key``, oldest first (VendorCannotTell if it cannot).

        ``since``: no send of it left before this. ``sent``: what was sent (None where the record does not
        say): an adapter whose vendor keeps no key matches jobs by it, and raises VendorCannotTell rather
        than claim a job another operation may own.
        """
        ...

    async def cancel(self, job_id: str) -> VendorJob:
        """Stop a job; one that already finished is returned as it is."""
        ...

    async def download(self, job: VendorJob, sink: Callable[[bytes], Awaitable[None] | None]) -> None:
        """Stream a succeeded job's output into ``sink`` chunk by chunk (the caller hashes and stores it)."""
        ...

    async def charged(self, operation_key: str, job_id: str | None) -> str | None:
        """The vendor's own billing record of what it charged (raw figure), or None where it has none."""
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class ChargeListing(Protocol):
    """What an adapter whose vendor can list its own billing adds (``Capabilities.can_list_charges``).

    Optional, and kept apart from :class:`VendorAdapter`: no operation needs it (``charged`` reads one
    operation's bill), only the audit (``ledgerflow audit --billing``) does.
    """

    async def charges(self, since: datetime) -> list[VendorCharge]:
        """Every charge the vendor's billing lists since ``since``, oldest first: the account's, not only
        ledgerflow's (VendorCannotTell where the vendor cannot list them)."""
        ...


def job_amount(route: RouteSpec, job: VendorJob) -> VendorAmount:
    """What a job cost, as money: the vendor's own figure, else the route's price for what the job used.

    The vendor's figure is made money by ``vendor_amount`` (rounded up, odd figures flagged). A priced figure
    is ours: rounded up to the ledger's scale without a flag. No figure and no price that yields one (a route
    without a price, a price per second for a job that reports no seconds) is unusable: the caller counts the
    estimate and flags it — never a silent zero for a call that was charged.
    """
    if job.cost is not None:
        return vendor_amount(job.cost)
    if (bad := usage_problems(job)) is not None:
        return VendorAmount(None, f"{bad[0]}: the job cannot be priced from it", bad[1])
    if (priced := _declared_cost(route, job)) is None:
        return VendorAmount(None, "the vendor reports no cost and the route's price gives none for this job")
    return priced_amount(priced)


def usage_problems(job: VendorJob) -> tuple[str, str] | None:
    """The first usage figure of ``job`` (seconds, tokens) that cannot price it, and its raw value; or None.

    Through the money gate (``rules.money.usage_problem``): negative, NaN, infinite or absurd is unusable.
    """
    figures = (("seconds", job.seconds), ("tokens_in", job.tokens_in), ("tokens_out", job.tokens_out))
    for what, raw in figures:
        if raw is not None and (problem := usage_problem(raw, what=what)) is not None:
            return problem, str(raw)[:60]
    return None


def price_bound(route: RouteSpec, job: VendorJob) -> Decimal | None:
    """What the route's own declared price says ``job`` should cost, or None where it cannot say.

    None: the route declares no price, or its price needs a usage figure (seconds) the job does not report
    validly. This — not a plan's estimate — is what a charge is held against to judge the vendor's billing.
    """
    return None if usage_problems(job) is not None else _declared_cost(route, job)


def _declared_cost(route: RouteSpec, job: VendorJob) -> Decimal | None:
    """The route's declared price for what ``job`` used (its usage figures already checked), or None where
    it gives none: no price, or a price per second for a job that reports no seconds."""
    price = route.price
    if price.per_second > 0 and job.seconds is None:
        return None
    cost = price.cost(seconds=job.seconds or 0.0, tokens_in=job.tokens_in, tokens_out=job.tokens_out)
    return cost if cost > 0 else None


def mode_of(route: RouteSpec, caps: Capabilities) -> VendorMode:
    """The mode reconciliation works with: the route's, never more than the adapter can do.

    A route that states no mode is ``idempotent``; on an adapter that sends no idempotency key (predictions,
    openai) trusting that would resubmit a maybe-sent request, and every resubmission is billed again.
    """
    if caps.free:
        return VendorMode.IDEMPOTENT
    mode = route.mode
    if mode == VendorMode.IDEMPOTENT and not caps.deduplicates:
        mode = VendorMode.LOOKUP_ONLY
    if mode == VendorMode.LOOKUP_ONLY and not caps.can_lookup:
        mode = VendorMode.NONE
    return mode
