"""Budget scopes are built and read in one place (rules.scopes)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from rules import scopes
from rules.approvers import SCOPE
from rules.plan import budget_scopes, load_plan
from rules.scopes import Scope, ScopeKind
from vendors.routes import DEFAULT_ROUTES


def test_a_task_draws_on_its_project_episode_and_own_scope_outermost_first() -> None:
    assert scopes.chain("p1", "e7", "t-1", Decimal("10")) == [
        ("project:p1", None),
        ("episode:p1/e7", None),
        ("task:t-1", Decimal("10")),
    ]
    assert scopes.chain("p1", None, "t-1", None) == [("project:p1", None), ("task:t-1", None)]


def test_the_plans_budget_scopes_are_the_chain() -> None:
    text = (
        "goal: g\nproject: p1\nepisode: e7\nbudget_ceiling: 5\n"
        "stages:\n  - {id: a, executor: llm.text, estimate: 1}\n"
    )
    plan = load_plan(text, DEFAULT_ROUTES, task_id="t-1")
    assert budget_scopes(plan, "t-1") == scopes.chain("p1", "e7", "t-1", Decimal("5"))


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("project:p1", Scope(ScopeKind.PROJECT, "p1")),
        ("episode:p1/e7", Scope(ScopeKind.EPISODE, "p1/e7")),
        ("task:t-1.x", Scope(ScopeKind.TASK, "t-1.x")),
        ("project:", None),
        ("episode:p1", None),  # an episode names its project
        ("task:a b", None),
        ("tenant:p1", None),
        ("project:p1\n", None),
        ("*", None),  # everything: a key's scope, never an account's
    ],
)
def test_parse_accepts_exactly_the_account_scopes(text: str, parsed: Scope | None) -> None:
    assert scopes.parse(text) == parsed
    if parsed is not None:
        assert str(parsed) == text


def test_a_scope_knows_its_project_and_a_key_scope_may_be_everything() -> None:
    assert Scope(ScopeKind.EPISODE, "p1/e7").project == "p1"
    assert Scope(ScopeKind.TASK, "t-1").project is None
    assert SCOPE.fullmatch("*") and SCOPE.fullmatch("episode:p1/e7") and not SCOPE.fullmatch("tenant:x")
