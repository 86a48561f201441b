"""Budget scopes: the one place their names are built and read.

A task's money is checked on nested accounts, outermost first: ``project:P`` ⊃ ``episode:P/E`` ⊃ ``task:T``.
A vendor route with a ``monthly_cap`` (the vendor contract's ceiling) has one more account per calendar month,
``route:R:YYYY-MM`` (UTC), which every operation that route serves reserves on as well; it belongs to no task.
An approver key's scopes use the same names, plus ``*`` for everything. Everything that writes or reads a
scope's name (the plan's accounts, the ledger's SQL, the CLI, the rules, the approver registry) goes
through here instead of an f-string or a regex of its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from enum import StrEnum
from typing import Final

# An identifier (a project, an episode, a task id): rules.plan.ID_PATTERN, repeated here so this module
# imports nothing (rules.plan imports it).
_ID: Final = r"[A-Za-z0-9_.-]{1,64}"

# The shape a received scope must have (a person's decision, an approver key): loose on purpose, since
# decisions recorded under it must keep validating the same way on replay.
SCOPE_TEXT: Final = re.compile(r"(project|episode|task):[A-Za-z0-9_.:/-]{1,200}")
# A route's name (a key of the route file: an executor's name, or a fallback's).
_ROUTE: Final = r"[A-Za-z0-9_./-]{1,128}"
# A well-formed scope of an account: what the CLI accepts for `budget set`. (A route-month scope is not one
# a person's add_budget may name: SCOPE_TEXT above stays as decisions were validated when recorded.)
_EXACT: Final = re.compile(
    rf"(project):({_ID})|(episode):({_ID}/{_ID})|(task):({_ID})|(route):({_ROUTE}:\d{{4}}-(?:0[1-9]|1[0-2]))"
)


class ScopeKind(StrEnum):
    PROJECT = "project"
    EPISODE = "episode"
    TASK = "task"
    ROUTE = "route"  # a route's calendar month: route:R:YYYY-MM


@dataclass(frozen=True, slots=True)
class Scope:
    """One budget scope: its kind and its name (``P``, ``P/E``, ``T`` or ``R:YYYY-MM``)."""

    kind: ScopeKind
    name: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"

    @property
    def project(self) -> str | None:
        """The project a project or episode scope belongs to (a task or route scope does not say)."""
        if self.kind in (ScopeKind.TASK, ScopeKind.ROUTE):
            return None
        return self.name.split("/", 1)[0]


def project(name: str) -> str:
    return f"{ScopeKind.PROJECT}:{name}"


def episode(project_name: str, episode_name: str) -> str:
    return f"{ScopeKind.EPISODE}:{project_name}/{episode_name}"


def task(task_id: str) -> str:
    return f"{ScopeKind.TASK}:{task_id}"


def month(at: datetime) -> str:
    """The calendar month ``YYYY-MM`` (UTC) of an instant: the database's clock when a route-month scope is
    chosen (a naive datetime is taken as UTC)."""
    return (at if at.tzinfo is None else at.astimezone(UTC)).strftime("%Y-%m")


def route_month(route: str, at: datetime) -> str:
    """The account of ``route``'s monthly cap for the month of ``at``: ``route:R:YYYY-MM``."""
    return f"{ScopeKind.ROUTE}:{route}:{month(at)}"


# For SQL that lists a kind's accounts: ``scope LIKE 'project:%'`` and ``substr(scope, len + 1)``.
PROJECT_PREFIX: Final = f"{ScopeKind.PROJECT}:"
TASK_PREFIX: Final = f"{ScopeKind.TASK}:"
ROUTE_PREFIX: Final = f"{ScopeKind.ROUTE}:"


def chain(
    project_name: str, episode_name: str | None, task_id: str, ceiling: Decimal | None
) -> list[tuple[str, Decimal | None]]:
    """The accounts a task draws on, outermost first, with the task's own ceiling (the others' are set by an
    operator and unlimited until then)."""
    scopes: list[tuple[str, Decimal | None]] = [(project(project_name), None)]
    if episode_name is not None:
        scopes.append((episode(project_name, episode_name), None))
    scopes.append((task(task_id), ceiling))
    return scopes


def parse(text: str) -> Scope | None:
    """A well-formed account scope, or None."""
    found = _EXACT.fullmatch(text)
    if found is None:
        return None
    kind, name = next((k, n) for k, n in zip(found.groups()[::2], found.groups()[1::2], strict=True) if k)
    return Scope(ScopeKind(kind), name)
