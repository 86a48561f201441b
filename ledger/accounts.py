"""Budget accounts: the money a task may still draw, one mutable row per scope, changed with the events.

``budget_accounts`` holds each scope's ceiling and its reserved and spent totals (``rules.scopes`` names
them: ``project:P`` ⊃ ``episode:P/E`` ⊃ ``task:T``); a task's scopes are listed, outermost first, on its
lease row. The recorder's two append paths call ``reserve`` and ``settle`` (and ``raise_on``) on the
connection of the append that explains the change, so an account moves in the same transaction as its
event, or not at all. ``AccountStore`` is the part of the recorder that opens accounts and reads them.

Lock order: an account is locked only after its task's lease row and new event rows, and a task's accounts
are locked together in ``scope COLLATE "C"`` order (see ``_LOCK_ACCOUNTS``).

A route with a ``monthly_cap`` (vendors.routes) has one more account per calendar month, ``route:R:YYYY-MM``
(rules.scopes.route_month), shared by every task: ``hold_route`` reserves an operation's amount there in its
INTENT's transaction (created on first use with the cap as its ceiling) and records the hold in
``route_holds``; ``settle_route`` settles it with the operation's one result (or adds a late charge). A
route-month account is always the LAST lock a transaction takes — after the task's own accounts — and a
transaction holds at most one: whoever holds one waits for no other lock, so it cannot close a cycle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Final

from sqlalchemy import Connection, Engine, Numeric, Text, any_, bindparam, func, select, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert

from ledger.errors import BudgetRefused, InvalidAmount, LedgerError, TaskNotFound
from ledger.pgerrors import translated
from ledger.schema import budget_accounts, route_holds, task_leases
from rules import scopes as scope_names
from rules.money import MONEY_SCALE, parse_amount


@dataclass(frozen=True, slots=True)
class Account:
    """A budget scope's enforcement state: ``ceiling`` None means unlimited."""

    scope: str
    ceiling: Decimal | None
    reserved: Decimal
    spent: Decimal
    updated_at: datetime

    @property
    def remaining(self) -> Decimal | None:
        """``ceiling - spent - reserved`` (negative once actual spend passed the ceiling); None: unlimited."""
        return None if self.ceiling is None else self.ceiling - self.spent - self.reserved


_SCOPES: Final = ARRAY(Text)
_MONEY: Final = Numeric(20, MONEY_SCALE, asdecimal=True)

_ACCOUNT_COLUMNS: Final = (
    budget_accounts.c.scope,
    budget_accounts.c.ceiling,
    budget_accounts.c.reserved,
    budget_accounts.c.spent,
    budget_accounts.c.updated_at,
)
# COLLATE "C": byte order, the same on every database and equal to Python's sorted() over str, so the lock
# order below and the insert order in open_budget agree whatever the database's default collation is.
_BY_SCOPE: Final = budget_accounts.c.scope.collate("C")

# The task's accounts, locked in one fixed global order. Deadlock-free: a transaction that locks accounts has
# first locked its own task's lease row (that one only) and inserted its events, and locks accounts last,
# always ascending. One waiting for a lease row holds nothing yet; one waiting for an event row (a dedup key
# being inserted elsewhere) holds no account; one waiting for an account waits only for a scope above every
# scope it holds. So no cycle of waits can close. FOR UPDATE under READ COMMITTED returns each row's newest
# committed version once its lock is granted, so the figures checked are the ones the UPDATE then changes.
# (LockRows runs above the Sort, so the rows are locked in this order.)
_LOCK_ACCOUNTS: Final = (
    select(*_ACCOUNT_COLUMNS)
    .where(budget_accounts.c.scope == any_(bindparam("b_scopes", type_=_SCOPES)))
    .order_by(_BY_SCOPE)
    .with_for_update()
)

# Applied to rows already locked by _LOCK_ACCOUNTS in the same transaction: no new waits, no re-check.
_ADD_RESERVED: Final = (
    update(budget_accounts)
    .where(budget_accounts.c.scope == any_(bindparam("b_scopes", type_=_SCOPES)))
    .values(
        reserved=budget_accounts.c.reserved + bindparam("b_amount", type_=_MONEY),
        updated_at=func.clock_timestamp(),
    )
)
_SETTLE: Final = (
    update(budget_accounts)
    .where(budget_accounts.c.scope == any_(bindparam("b_scopes", type_=_SCOPES)))
    .values(
        reserved=budget_accounts.c.reserved - bindparam("b_release", type_=_MONEY),
        spent=budget_accounts.c.spent + bindparam("b_spend", type_=_MONEY),
        updated_at=func.clock_timestamp(),
    )
)

# Records the task's scopes on its lease row (taking that row's lock first, as every path does). Matches only
# if none are recorded yet or the same list is: a task never moves to other scopes, or its reservations would
# be released on accounts that never held them.
_SET_TASK_SCOPES: Final = (
    update(task_leases)
    .where(
        task_leases.c.task_id == bindparam("b_task_id"),
        (func.cardinality(task_leases.c.budget_scopes) == 0)
        | (task_leases.c.budget_scopes == bindparam("b_scopes", type_=_SCOPES)),
    )
    .values(budget_scopes=bindparam("b_scopes", type_=_SCOPES))
    .returning(task_leases.c.task_id)
)
_TASK_SCOPES: Final = select(task_leases.c.budget_scopes).where(
    task_leases.c.task_id == bindparam("b_task_id")
)

# ON CONFLICT DO NOTHING: an existing account keeps its ceiling and totals (re-opening a task changes nothing,
# and a project shared by many tasks is created once). It takes no lock on an existing row.
_OPEN_ACCOUNT: Final = pg_insert(budget_accounts).on_conflict_do_nothing(
    index_elements=[budget_accounts.c.scope]
)

_ceiling_insert = pg_insert(budget_accounts).values(
    scope=bindparam("b_scope"), ceiling=bindparam("b_ceiling", type_=_MONEY)
)
# ON CONFLICT DO UPDATE: create or overwrite in one statement; it row-locks the one account it touches and
# nothing else, so it cannot join a cycle.
_SET_CEILING: Final = _ceiling_insert.on_conflict_do_update(
    index_elements=[budget_accounts.c.scope],
    set_={"ceiling": _ceiling_insert.excluded.ceiling, "updated_at": func.clock_timestamp()},
)
# NULL + amount is NULL: an unlimited scope stays unlimited. One row, one lock, as above.
_RAISE_CEILING: Final = (
    update(budget_accounts)
    .where(budget_accounts.c.scope == bindparam("b_scope"))
    .values(
        ceiling=budget_accounts.c.ceiling + bindparam("b_amount", type_=_MONEY),
        updated_at=func.clock_timestamp(),
    )
    .returning(budget_accounts.c.scope)
)

_ACCOUNT: Final = select(*_ACCOUNT_COLUMNS).where(budget_accounts.c.scope == bindparam("b_scope"))

# A route-month account: created on first use with the route's cap (ON CONFLICT DO NOTHING: an existing
# month keeps its ceiling — an operator's `budget set` for that month stands, and a worker may not change a
# ceiling anyway, revision 0006's guard), then locked (one row, after every other account of the append).
_OPEN_ROUTE_MONTH: Final = (
    pg_insert(budget_accounts)
    .values(scope=bindparam("b_scope"), ceiling=bindparam("b_ceiling", type_=_MONEY))
    .on_conflict_do_nothing(index_elements=[budget_accounts.c.scope])
)
_LOCK_ACCOUNT: Final = _ACCOUNT.with_for_update()
_HOLD: Final = route_holds.insert().values(
    operation_key=bindparam("b_key"), scope=bindparam("b_scope"), amount=bindparam("b_amount", type_=_MONEY)
)
# The operation's one result settles its hold, once (a repeat of the result writes nothing, so never comes
# here; ``settled_at IS NULL`` guards anyway). Returns what to settle on which account.
_SETTLE_HOLD: Final = (
    update(route_holds)
    .where(route_holds.c.operation_key == bindparam("b_key"), route_holds.c.settled_at.is_(None))
    .values(spent=route_holds.c.spent + bindparam("b_spend", type_=_MONEY), settled_at=func.clock_timestamp())
    .returning(route_holds.c.scope, route_holds.c.amount)
)
# A charge recorded beside the result (a late charge: a job the vendor created after it) counts on the
# month the operation held, whenever it arrives.
_CHARGE_HOLD: Final = (
    update(route_holds)
    .where(route_holds.c.operation_key == bindparam("b_key"))
    .values(spent=route_holds.c.spent + bindparam("b_spend", type_=_MONEY))
    .returning(route_holds.c.scope)
)
# One row, already the last lock of its transaction: release must fit (a hold released twice is a bug).
_SETTLE_ONE: Final = (
    update(budget_accounts)
    .where(
        budget_accounts.c.scope == bindparam("b_scope"),
        budget_accounts.c.reserved >= bindparam("b_release", type_=_MONEY),
    )
    .values(
        reserved=budget_accounts.c.reserved - bindparam("b_release", type_=_MONEY),
        spent=budget_accounts.c.spent + bindparam("b_spend", type_=_MONEY),
        updated_at=func.clock_timestamp(),
    )
    .returning(budget_accounts.c.scope)
)
_HOLDS_OF: Final = select(
    route_holds.c.operation_key,
    route_holds.c.scope,
    route_holds.c.amount,
    route_holds.c.spent,
    route_holds.c.held_at,
    route_holds.c.settled_at,
)
_ACCOUNTS: Final = select(*_ACCOUNT_COLUMNS).order_by(_BY_SCOPE)
_ACCOUNTS_UNDER: Final = _ACCOUNTS.where(func.starts_with(budget_accounts.c.scope, bindparam("b_prefix")))

# @> rather than = ANY(...): the containment operator is the one the GIN index on budget_scopes serves.
_TASKS_IN_SCOPE: Final = (
    select(task_leases.c.task_id)
    .where(task_leases.c.budget_scopes.contains(bindparam("b_scope_list", type_=_SCOPES)))
    .order_by(task_leases.c.created_at, task_leases.c.task_id)
)


def as_money(name: str, value: object) -> Decimal:
    """``value`` as money, or InvalidAmount.

    A Decimal or int (not bool, str or float), finite, 0 to MAX_AMOUNT, and exact in the accounts' six
    decimals (rounding would make an account differ from the events it is audited against).
    """
    if isinstance(value, bool) or not isinstance(value, Decimal | int):
        raise InvalidAmount(name, value, f"must be a Decimal or an int, not {type(value).__name__}")
    try:
        return parse_amount(value)  # the one money type's rules (rules.money)
    except ValueError as e:
        raise InvalidAmount(name, value, str(e)) from None


def reserve(
    conn: Connection,
    task_id: str,
    scopes: list[str] | None,
    amount: Decimal,
    *,
    task_overdraw: Decimal | None = None,
) -> None:
    """Reserve ``amount`` on every scope, or raise BudgetRefused for the first it does not fit. With
    ``task_overdraw`` (an undo) the task's own scope may go that far past its ceiling; the others may not."""
    own = scope_names.task(task_id)
    for a in _lock_accounts(conn, task_id, scopes):
        allowance = task_overdraw if task_overdraw is not None and a.scope == own else Decimal(0)
        if a.ceiling is not None and a.spent + a.reserved + amount > a.ceiling + allowance:
            raise BudgetRefused(a.scope, a.ceiling, a.spent, a.reserved, amount)
    conn.execute(_ADD_RESERVED, {"b_scopes": scopes, "b_amount": amount})


def settle(
    conn: Connection, task_id: str, scopes: list[str] | None, release: Decimal, spend: Decimal
) -> None:
    """Move a reservation to actual spend on every scope; spend is never refused, whatever the ceiling."""
    for a in _lock_accounts(conn, task_id, scopes):
        if release > a.reserved:
            raise LedgerError(
                f"task {task_id!r}: releasing {release} on {a.scope} exceeds its reservation {a.reserved}"
            )
    conn.execute(_SETTLE, {"b_scopes": scopes, "b_release": release, "b_spend": spend})


def raise_on(
    conn: Connection, task_id: str, scopes: list[str] | None, scope: str, amount: Decimal, *, locked: bool
) -> None:
    """Raise one of the task's scopes' ceiling by ``amount``, its accounts locked in the fixed order."""
    if scope not in (scopes or []):
        raise LedgerError(f"task {task_id!r} does not draw on {scope!r}: its ceiling cannot be raised here")
    if not locked:
        _lock_accounts(conn, task_id, scopes)
    conn.execute(_RAISE_CEILING, {"b_scope": scope, "b_amount": amount})


def hold_route(
    conn: Connection,
    operation_key: str,
    caps: Sequence[tuple[str, Decimal]],
    route: str,
    now: datetime,
    amount: Decimal,
) -> str | None:
    """Reserve ``amount`` on ``route``'s account for the month of ``now`` (the database's clock) if the route
    has a cap in ``caps``, and record the hold; BudgetRefused (naming the route-month scope) if it does not
    fit. Call after the task's accounts were reserved, on the INTENT's connection. Returns the scope held,
    or None (the route has no cap, or nothing is reserved)."""
    cap = next((c for r, c in caps if r == route), None)
    if cap is None or not amount:
        return None
    scope = scope_names.route_month(route, now)
    conn.execute(_OPEN_ROUTE_MONTH, {"b_scope": scope, "b_ceiling": as_money(f"monthly_cap of {route}", cap)})
    a = Account(*conn.execute(_LOCK_ACCOUNT, {"b_scope": scope}).one())
    if a.ceiling is not None and a.spent + a.reserved + amount > a.ceiling:
        raise BudgetRefused(a.scope, a.ceiling, a.spent, a.reserved, amount)
    conn.execute(_ADD_RESERVED, {"b_scopes": [scope], "b_amount": amount})
    conn.execute(_HOLD, {"b_key": operation_key, "b_scope": scope, "b_amount": amount})
    return scope


def settle_route(conn: Connection, operation_key: str, spend: Decimal, *, result: bool) -> str | None:
    """Settle the operation's route-month hold, if it has one: its one ``result`` releases what the hold
    reserved and spends ``spend`` (a void spends 0: the hold is released); a later charge adds ``spend``.
    Call after the task's accounts were settled, on the result's connection. Returns the scope, or None."""
    if not result and not spend:
        return None
    row = conn.execute(
        _SETTLE_HOLD if result else _CHARGE_HOLD, {"b_key": operation_key, "b_spend": spend}
    ).first()
    if row is None:
        return None
    scope: str = row[0]
    release: Decimal = row[1] if result else Decimal(0)
    if conn.execute(_SETTLE_ONE, {"b_scope": scope, "b_release": release, "b_spend": spend}).first() is None:
        raise LedgerError(f"{operation_key}: releasing {release} on {scope} exceeds its reservation")
    return scope


def _lock_accounts(conn: Connection, task_id: str, scopes: list[str] | None) -> list[Account]:
    """Lock the task's accounts (after its lease row), in the fixed order; every one must exist."""
    if not scopes:
        raise LedgerError(f"task {task_id!r} has no budget accounts (open_budget was never called for it)")
    accounts = [Account(*r) for r in conn.execute(_LOCK_ACCOUNTS, {"b_scopes": scopes})]
    if len(accounts) != len(scopes):
        missing = sorted(set(scopes) - {a.scope for a in accounts})
        raise LedgerError(f"task {task_id!r}: budget accounts {missing!r} are missing")
    return accounts


class AccountStore:
    """The recorder's budget methods: open a task's accounts, set and raise ceilings, read the accounts."""

    _engine: Engine  # the Recorder's: one short transaction per write
    _reader: Engine  # the same pool in AUTOCOMMIT, for single-statement reads

    def open_budget(self, task_id: str, scopes: Sequence[tuple[str, Decimal | None]]) -> None:
        """Create the task's budget accounts if absent and record its scopes, outermost first. Idempotent.

        ``scopes`` is ``rules.scopes.chain(...)``, e.g. ``[("project:P", None), ("episode:P/E", None),
        ("task:T", plan_ceiling)]``; a ceiling applies only when the account is created (None: unlimited);
        an existing one is left as it is.

        Raises:
            TaskNotFound: The task has no lease (call ``take_lease`` first).
            InvalidAmount: A ceiling is not a valid amount.
            LedgerError: ``scopes`` is empty or repeats a scope, or the task already has other scopes.
        """
        names = [scope for scope, _ in scopes]
        if not names or len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise LedgerError(
                f"task {task_id!r}: budget scopes must be distinct non-empty names, got {names!r}"
            )
        rows = [
            {"scope": scope, "ceiling": None if ceiling is None else as_money(f"ceiling of {scope}", ceiling)}
            for scope, ceiling in sorted(scopes, key=lambda sc: sc[0])  # ascending, as _LOCK_ACCOUNTS
        ]
        with translated(), self._engine.begin() as conn:
            params = {"b_task_id": task_id, "b_scopes": names}
            if conn.execute(_SET_TASK_SCOPES, params).first() is None:
                recorded = conn.execute(_TASK_SCOPES, {"b_task_id": task_id}).scalar_one_or_none()
                if recorded is None:
                    raise TaskNotFound(task_id)
                raise LedgerError(f"task {task_id!r} already draws on {recorded!r}, not {names!r}")
            conn.execute(_OPEN_ACCOUNT, rows)

    def set_ceiling(self, scope: str, ceiling: Decimal | None) -> None:
        """Set the scope's ceiling (None: unlimited), creating its account if absent.

        A ceiling below what is already spent and reserved is allowed: it refuses every further reservation.
        """
        value = None if ceiling is None else as_money("ceiling", ceiling)
        with translated(), self._engine.begin() as conn:
            conn.execute(_SET_CEILING, {"b_scope": scope, "b_ceiling": value})

    def raise_ceiling(self, scope: str, amount: Decimal) -> None:
        """Add ``amount`` to the scope's ceiling (AddBudget); an unlimited scope stays unlimited.

        Raises:
            LedgerError: The scope has no account.
        """
        value = as_money("amount", amount)
        with translated(), self._engine.begin() as conn:
            if conn.execute(_RAISE_CEILING, {"b_scope": scope, "b_amount": value}).first() is None:
                raise LedgerError(f"no budget account {scope!r}")

    def accounts(self, prefix: str | None = None) -> list[Account]:
        """Every account, or those whose scope starts with ``prefix`` (literally), ordered by scope."""
        with translated(), self._reader.connect() as conn:
            if prefix is None:
                rows = conn.execute(_ACCOUNTS).all()
            else:
                rows = conn.execute(_ACCOUNTS_UNDER, {"b_prefix": prefix}).all()
        return [Account(*r) for r in rows]

    def account(self, scope: str) -> Account | None:
        """The scope's account, if it exists."""
        with translated(), self._reader.connect() as conn:
            row = conn.execute(_ACCOUNT, {"b_scope": scope}).first()
        return None if row is None else Account(*row)

    def task_scopes(self, task_id: str) -> list[str]:
        """The task's budget scopes, outermost first; empty if it has none (or no lease)."""
        with translated(), self._reader.connect() as conn:
            scopes: list[str] | None = conn.execute(_TASK_SCOPES, {"b_task_id": task_id}).scalar_one_or_none()
        return [] if scopes is None else list(scopes)

    def route_holds(self, scope: str) -> list[dict[str, object]]:
        """The holds on a route-month account (``route:R:YYYY-MM``): which operations reserved and spent what
        there, oldest first."""
        stmt = _HOLDS_OF.where(route_holds.c.scope == bindparam("b_scope")).order_by(route_holds.c.held_at)
        with translated(), self._reader.connect() as conn:
            return [dict(r) for r in conn.execute(stmt, {"b_scope": scope}).mappings()]

    def tasks_in_scope(self, scope: str) -> list[str]:
        """Every task drawing on ``scope``, oldest first."""
        with translated(), self._reader.connect() as conn:
            return list(conn.execute(_TASKS_IN_SCOPE, {"b_scope_list": [scope]}).scalars())
