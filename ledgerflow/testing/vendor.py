"""What the contract kit needs of a vendor's fake: the habits it can be given, and its own billing record.

The kit (``ledgerflow.testing.contract``) proves an adapter's money guarantees by making the vendor misbehave
in each way real vendors do and then reading what the *vendor* billed — never our ledger's word for it. Any
fake that speaks the adapter's wire protocol over real HTTP can serve: the one written with
``ledgerflow.testing.fake`` in a few dozen lines, or ledgerflow's own simulator
(``ledgerflow.testing.simulator``). It only has to take :class:`Habits` for one operation and list that
operation's charges (:class:`FakeVendor`).
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class Habits:
    """How the vendor treats one operation's calls in a scenario (the defaults: it behaves).

    Each is a habit of real paid vendors that costs money when a client handles it badly. "Submit" is the
    call that creates (and bills) a job; every habit is about the operation the scenario drives.
    """

    drop_response: bool = False
    """Every submit is accepted and billed, then its answer is lost (the client sees a 502)."""
    gateway_status: int | None = None
    """Every submit is accepted and billed, then answered this 5xx (a gateway whose upstream timed out)."""
    server_error_first: bool = False
    """The first submit answers 500 and accepts nothing; later ones behave."""
    rate_limit_first: bool = False
    """The first submit answers 429 with ``Retry-After: 1`` and accepts nothing; later ones behave."""
    key_retention_seconds: float | None = None
    """A vendor that deduplicates forgets the key this long after the job was created."""
    purge_after_seconds: float | None = None
    """A finished job's output is gone (404) this long after it finished."""
    late_accept_seconds: float | None = None
    """A submit never answers in time; the job is created (and billed) this long after it arrived."""
    overcharge: Decimal | None = None
    """The job is billed (and reported) at this multiple of its normal price."""


@dataclass(frozen=True, slots=True)
class Charge:
    """One line of the vendor's own billing: the job it billed and what."""

    job_id: str
    amount: Decimal


@runtime_checkable
class FakeVendor(Protocol):
    """A vendor's fake the kit can drive: over real HTTP at ``url``, misbehaving as told, billing honestly."""

    @property
    def url(self) -> str:
        """The base URL the route's adapter calls (a route without ``base_url`` is pointed here)."""
        ...

    async def arrange(self, route: str, operation_key: str, habits: Habits) -> None:
        """Forget earlier scenarios; then treat ``operation_key``'s calls (to ``route``) by ``habits``."""
        ...

    async def charges(self, operation_key: str) -> list[Charge]:
        """What the vendor billed for ``operation_key`` (its own record), in the order it billed."""
        ...
