"""The audit: does the ledger agree with itself? (first part: money)

Budget accounts are enforcement state updated in the same transactions as the events; the events are the
record. For a task, its account must equal what folding its events gives; for a project or episode, the sum
over every task in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from ledger.recorder import Recorder
from rules.projection import fold


@dataclass(frozen=True)
class Check:
    scope: str
    what: str
    account: Decimal
    folded: Decimal

    @property
    def ok(self) -> bool:
        return self.account == self.folded


def audit_budget(recorder: Recorder, task_id: str) -> list[Check]:
    """Compare every account the task draws on with the fold of the events of the tasks in it."""
    checks: list[Check] = []
    folded: dict[str, tuple[Decimal, Decimal]] = {}

    def totals(tid: str) -> tuple[Decimal, Decimal]:
        if tid not in folded:
            p = fold(recorder.read_events(tid))
            folded[tid] = (p.reserved, p.spent)
        return folded[tid]

    for scope in recorder.task_scopes(task_id):
        account = recorder.account(scope)
        if account is None:
            checks.append(Check(scope, "account exists", Decimal(0), Decimal(1)))
            continue
        tasks = [task_id] if scope.startswith("task:") else recorder.tasks_in_scope(scope)
        reserved = sum((totals(t)[0] for t in tasks), Decimal(0))
        spent = sum((totals(t)[1] for t in tasks), Decimal(0))
        checks.append(Check(scope, "reserved", account.reserved, reserved))
        checks.append(Check(scope, "spent", account.spent, spent))
    return checks
