"""Money: one type with one scale, shared by the plan, the vendor adapters and the ledger.

Every amount ledgerflow records is a ``Decimal`` with at most ``MONEY_SCALE`` (6) decimal places, between 0
and ``MAX_AMOUNT``. The ledger's accounts are ``numeric(20, 6)``; anything finer would make an account
differ from the events it is audited against, so there is exactly one place where a figure becomes money:

* a figure a *person* wrote (a plan's estimate or ceiling, a budget on the CLI) is refused if it is not exact
  money (:func:`parse_amount`): the person is told, nothing is rounded behind their back;
* a figure a *vendor* reported is never refused (the charge happened whatever its shape), but it is recorded
  as money and its oddity as a cost anomaly (:func:`vendor_amount`): a cost finer than the scale is rounded
  *up* (never under-count a charge); a negative, non-numeric, non-finite or absurd one is unusable, and the
  caller counts the operation at its estimate instead, with the raw figure in the anomaly.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal, InvalidOperation
from typing import Annotated, Any, Final

from pydantic import BeforeValidator

MONEY_SCALE: Final = 6  # micro-units: the ledger's numeric(20, 6)
QUANTUM: Final = Decimal(1).scaleb(-MONEY_SCALE)
MAX_AMOUNT: Final = Decimal("1000000000")  # one billion per amount: anything larger is a typo or an attack
MAX_USAGE: Final = Decimal("1E+12")  # tokens or seconds of one call: anything larger is not a real figure


def _decimal(value: Any) -> Decimal:
    """``value`` as a Decimal, or ValueError naming what it is (floats through their repr)."""
    if isinstance(value, bool) or value is None:
        raise ValueError("must be a number")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        value = repr(value)
    if not isinstance(value, int | str | Decimal):
        raise ValueError(f"must be a number, got {type(value).__name__}")
    try:
        amount = Decimal(str(value).strip())
    except InvalidOperation:
        raise ValueError(f"must be a number, got {str(value)[:40]!r}") from None
    if not amount.is_finite():
        raise ValueError("must be a finite number")
    return amount


def parse_amount(value: Any) -> Decimal:
    """An amount a person wrote: finite, 0 to MAX_AMOUNT, exact to MONEY_SCALE decimals; else ValueError."""
    amount = _decimal(value)
    if amount < 0:
        raise ValueError(f"must not be negative, got {amount}")
    if amount > MAX_AMOUNT:
        raise ValueError(f"must be at most {MAX_AMOUNT}, got {amount:.3E}")
    if amount != amount.quantize(QUANTUM):
        raise ValueError(f"must have at most {MONEY_SCALE} decimal places, got {amount}")
    return amount


Amount = Annotated[Decimal, BeforeValidator(parse_amount)]
"""A pydantic field type for money a person wrote (plans, CLI)."""


@dataclass(frozen=True, slots=True)
class VendorAmount:
    """A vendor's figure made money. ``amount`` None: unusable (count the estimate); ``anomaly``: why odd."""

    amount: Decimal | None
    anomaly: str | None = None
    raw: str = ""


def vendor_amount(raw: Any, *, what: str = "cost") -> VendorAmount:
    """A figure a vendor reported, as money: rounded up to the scale if finer, unusable if not a sane number.

    Never raises: a charge happened whatever the figure looks like, so the caller records something and the
    anomaly says what was odd, with the raw value.
    """
    shown = str(raw)[:60]
    amount = _checked(raw, what, MAX_AMOUNT)
    if isinstance(amount, str):
        return VendorAmount(None, amount, shown)
    rounded = amount.quantize(QUANTUM, rounding=ROUND_CEILING)
    if rounded != amount:
        return VendorAmount(
            rounded, f"vendor {what} {shown} is finer than {QUANTUM}: recorded as {rounded}", shown
        )
    return VendorAmount(rounded, None, shown)


def usage_problem(raw: Any, *, what: str) -> str | None:
    """Why a usage figure a vendor reported (tokens, seconds) cannot price a call, or None if it can.

    A usage figure is priced into money, so it is held to the same gate as a cost: finite, not negative, not
    absurd. A bad one makes the priced cost unusable (the caller counts the estimate, flagged), never a
    smaller charge or an exception after the work was paid for.
    """
    figure = _checked(raw, what, MAX_USAGE)
    return figure if isinstance(figure, str) else None


def priced_amount(priced: Decimal, *, what: str = "priced cost") -> VendorAmount:
    """A cost *we* computed from a route's price and valid usage: rounded up to the scale without a flag
    (the fraction is ours, not the vendor's oddity); unusable if negative or above ``MAX_AMOUNT``."""
    shown = str(priced)[:60]
    amount = _checked(priced, what, MAX_AMOUNT)
    if isinstance(amount, str):
        return VendorAmount(None, f"{what} {shown} is unusable", shown)
    return VendorAmount(amount.quantize(QUANTUM, rounding=ROUND_CEILING), None, shown)


def _checked(raw: Any, what: str, limit: Decimal) -> Decimal | str:
    """``raw`` as a Decimal from 0 to ``limit``, or why it is not one (naming ``what`` and the raw value)."""
    shown = str(raw)[:60]
    try:
        figure = _decimal(raw)
    except ValueError as e:
        return f"vendor {what} {shown!r} is unusable ({e})"
    if figure < 0:
        return f"vendor {what} {shown} is negative"
    if figure > limit:
        return f"vendor {what} {shown} is above {limit}"  # 1000000000, or 1E+12 (as MAX_USAGE is written)
    return figure
