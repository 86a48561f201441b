"""Vendor callbacks in the ledger: ``vendor_callbacks`` (revision 0010), and the NOTIFY that wakes a worker.

The webhook receiver (``ledgerflow.webhooks``) records every call a vendor made to it, accepted or refused,
with why (``record_callback``). An accepted one is also a ``NOTIFY`` on ``CHANNEL`` carrying its operation
key, in the same transaction: a worker LISTENing for that operation wakes once the row is committed, and then
reads the job from the vendor itself (a callback's body is never trusted for money or output). A delivery is
accepted once: the second time it arrives (a vendor's retry, or a replay) it is recorded as ``replayed`` and
nobody is woken again.

The receiver logs in as ``lf_receiver`` (group ``ledgerflow_receiver``), which may insert here and nothing
else: it cannot read this table, so when a replay is refused it asks the owner's function
``ledger_callback_accepted_at`` when the delivery was first accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal

from sqlalchemy import Engine, create_engine, null, select, text

from ledger.errors import LedgerError
from ledger.pgerrors import translated, violated
from ledger.schema import vendor_callbacks

CHANNEL: Final = "ledgerflow_callbacks"
"""The LISTEN/NOTIFY channel of accepted callbacks; each notification's payload is an operation key."""

Verdict = Literal["accepted", "replayed", "forged", "stale", "malformed", "unknown_route"]
VERDICTS: Final[tuple[Verdict, ...]] = (
    "accepted",
    "replayed",
    "forged",
    "stale",
    "malformed",
    "unknown_route",
)
ACCEPTED_ONCE: Final = "uq_vendor_callbacks_accepted"
MAX_STATUS: Final = 40
MAX_ROUTE: Final = 200
MAX_REASON: Final = 1000

# inline(): no RETURNING of the new id (SQLAlchemy's default), which would need SELECT: the receiver's role
# has only INSERT.
_INSERT: Final = vendor_callbacks.insert().inline()
# pg_notify, not NOTIFY: the channel and payload are parameters. Delivered at commit, and only then: a
# worker is never woken for a row that was rolled back.
_NOTIFY: Final = text("SELECT pg_notify(:channel, :key)")
_ACCEPTED_AT: Final = text("SELECT ledger_callback_accepted_at(:route, :delivery_id)")
_FOR_OPERATION: Final = select(vendor_callbacks).order_by(vendor_callbacks.c.id)


@dataclass(frozen=True)
class CallbackRow:
    """One recorded callback, as ``vendor_callbacks`` holds it."""

    id: int
    received_at: datetime
    route: str
    operation_key: str | None
    delivery_id: str
    verdict: Verdict
    reason: str
    body_sha256: str
    claimed_status: str | None
    body: Any


def open_engine(url: str, *, pool_size: int = 4) -> Engine:
    """An engine for the receiver (``postgresql+psycopg``): one per process, disposed by its owner."""
    return create_engine(url, pool_pre_ping=True, pool_size=pool_size, max_overflow=pool_size)


def record_callback(
    engine: Engine,
    *,
    route: str,
    operation_key: str | None,
    delivery_id: str,
    verdict: Verdict,
    reason: str,
    body_sha256: str,
    claimed_status: str | None,
    body: Any,
) -> Verdict:
    """Record one callback; the verdict it was recorded with.

    An ``accepted`` one is recorded with a NOTIFY on ``CHANNEL`` (payload: ``operation_key``) in the same
    transaction. If that delivery (``route``, ``delivery_id``) was accepted before, it is recorded instead as
    ``replayed`` (saying when it was first accepted), nobody is notified, and ``replayed`` is returned. Only
    an accepted row keeps ``body``.

    Raises:
        LedgerError: the database refused (LedgerUnavailable: it cannot be reached).
    """
    if verdict not in VERDICTS:
        raise ValueError(f"{verdict!r} is not a callback verdict")
    operation_key = _text(operation_key) if operation_key is not None else None
    delivery_id = _text(delivery_id)
    row: dict[str, Any] = {
        "route": _text(route[:MAX_ROUTE]),
        "operation_key": operation_key,
        "delivery_id": delivery_id,
        "verdict": verdict,
        "reason": _text(reason[:MAX_REASON]),
        "body_sha256": body_sha256,
        "claimed_status": _text(claimed_status[:MAX_STATUS]) if claimed_status is not None else None,
        # SQL NULL, not JSON null (what the JSONB type makes of None).
        "body": body if verdict == "accepted" and body is not None else null(),
    }
    if verdict != "accepted":
        with translated(), engine.begin() as conn:
            conn.execute(_INSERT.values(**row))
        return verdict
    if operation_key is None:
        raise ValueError("an accepted callback names its operation key (whom to wake)")
    try:
        with translated(), engine.begin() as conn:
            conn.execute(_INSERT.values(**row))
            conn.execute(_NOTIFY, {"channel": CHANNEL, "key": operation_key})
    except LedgerError as e:
        if violated(e.__cause__) != ACCEPTED_ONCE:
            raise
    else:
        return "accepted"
    # The unique index waited for a concurrent accept of the same delivery to commit, so its row is there.
    with translated(), engine.begin() as conn:
        first = conn.execute(_ACCEPTED_AT, {"route": row["route"], "delivery_id": delivery_id}).scalar()
        when = first.isoformat(timespec="milliseconds") if isinstance(first, datetime) else "an earlier time"
        replay = {
            **row,
            "verdict": "replayed",
            "reason": f"delivery {delivery_id[:200]} was already accepted at {when}",
            "body": null(),
        }
        conn.execute(_INSERT.values(**replay))
    return "replayed"


def _text(value: str) -> str:
    """``value`` as Postgres text can hold it: no NUL, no lone surrogate. What a sender put in a path, a query
    or a body must not make its own record fail (the receiver would answer 503 to it forever)."""
    return value.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")


def callbacks_for(engine: Engine, operation_key: str) -> list[CallbackRow]:
    """Every callback recorded for ``operation_key``, in the order received (needs SELECT: not the
    receiver's login)."""
    query = _FOR_OPERATION.where(vendor_callbacks.c.operation_key == operation_key)
    with translated(), engine.connect() as conn:
        return [CallbackRow(**r._mapping) for r in conn.execute(query)]
