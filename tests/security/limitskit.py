"""Inputs beyond the plan caps, shared by the tests of tests/security (imported as ``limitskit``, the way
tests/unit imports ``helpers``: pytest puts a test file's folder on ``sys.path``)."""

from __future__ import annotations

from typing import Any


def nested(depth: int) -> dict[str, Any]:
    """A mapping ``depth`` levels deep (itself counted)."""
    value: dict[str, Any] = {"leaf": 1}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def billion_laughs(levels: int = 9) -> str:
    """The classic alias bomb inside a stage's input: each level lists the previous one 9 times."""
    lines = ['      l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"      l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    head = "goal: a bomb\nbudget_ceiling: 10\nstages:\n  - id: boom\n    executor: llm.text\n"
    head += "    estimate: 1\n"
    return head + "    input:\n" + "\n".join(lines) + "\n"


def fan_outs(stages: int, width: int = 500) -> dict[str, Any]:
    """A chain of ``stages`` stages, each fanned out ``width`` wide: ``stages * width + 2`` nodes."""
    return {
        "goal": "wide",
        "budget_ceiling": "1000000",
        "stages": [
            {
                "id": f"s{i}",
                "executor": "llm.text",
                "estimate": "0.01",
                "fan_out": width,
                "depends_on": [f"s{i - 1}"] if i else [],
            }
            for i in range(stages)
        ],
    }
