"""The CLI's view of money: budget scopes, accounts and the budget audit."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from rich.table import Table

from ledger.recorder import Account
from ledgerflow.client import ClientError, recorder
from ledgerflow.views.audit import audit_budget
from rules import scopes
from runtime.settings import Settings


def parse_scope(text: str) -> str:
    if scopes.parse(text) is None:
        raise ClientError(
            f"scope {text[:60]!r} is not project:NAME, episode:PROJECT/EPISODE, task:ID"
            " or route:ROUTE:YYYY-MM"
        )
    return text


@dataclass(frozen=True)
class Row:
    account: Account
    depth: int

    def as_json(self) -> dict[str, str | None]:
        a = self.account
        return {
            "scope": a.scope,
            "ceiling": None if a.ceiling is None else str(a.ceiling),
            "reserved": str(a.reserved),
            "spent": str(a.spent),
            "remaining": None if a.remaining is None else str(a.remaining),
        }


def set_ceiling(settings: Settings, scope: str, ceiling: Decimal | None) -> Account:
    rec = recorder(settings)
    try:
        rec.set_ceiling(scope, ceiling)
        account = rec.account(scope)
    finally:
        rec.dispose()
    assert account is not None
    return account


def show(settings: Settings, scope: str | None) -> list[Row]:
    """The scope (or every scope) and, indented, every scope under it."""
    rec = recorder(settings)
    try:
        if scope is None:
            accounts = rec.accounts()
        else:
            parse_scope(scope)
            top = rec.account(scope)
            if top is None:
                raise ClientError(f"no budget account {scope!r}")
            accounts = [top, *_children(rec, scope)]
    finally:
        rec.dispose()
    return [Row(a, _depth(a.scope)) for a in accounts]


def _children(rec, scope: str) -> list[Account]:  # type: ignore[no-untyped-def]
    kind, _, name = scope.partition(":")
    if kind in ("task", "route"):  # a route's month belongs to no task: nothing is nested under it
        return []
    prefix = f"episode:{name}/" if kind == "project" else None
    children = rec.accounts(prefix) if prefix else []
    tasks = {f"task:{t}" for t in rec.tasks_in_scope(scope)}
    return children + [a for a in rec.accounts("task:") if a.scope in tasks]


def _depth(scope: str) -> int:
    return {"project": 0, "episode": 1, "task": 2}.get(scope.partition(":")[0], 0)


def accounts_table(rows: list[Row]) -> Table:
    table = Table(title="budget accounts", title_justify="left")
    for col in ("scope", "ceiling", "reserved", "spent", "remaining"):
        table.add_column(col, justify="left" if col == "scope" else "right")
    for r in rows:
        a = r.account
        table.add_row(
            "  " * r.depth + a.scope,
            "unlimited" if a.ceiling is None else str(a.ceiling),
            str(a.reserved),
            str(a.spent),
            "—" if a.remaining is None else str(a.remaining),
        )
    return table


def audit_report(settings: Settings, task_id: str) -> tuple[bool, Table]:
    rec = recorder(settings)
    try:
        if rec.current_epoch(task_id) is None:
            raise ClientError(f"no task {task_id!r} in the ledger")
        checks = audit_budget(rec, task_id)
    finally:
        rec.dispose()
    ok = all(c.ok for c in checks)
    table = Table(title=f"audit of {task_id}: {'OK' if ok else 'MISMATCH'}", title_justify="left")
    for col in ("scope", "what", "account", "fold of events", ""):
        table.add_column(col)
    for c in checks:
        table.add_row(c.scope, c.what, str(c.account), str(c.folded), "ok" if c.ok else "[red]differs[/red]")
    return ok, table
