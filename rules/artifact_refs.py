"""Where an artifact reference may come from: only from ``inputs:`` (an upstream stage's registered output).

A stage's ``input`` (and its compensation's) is free data a plan author types. A value there shaped like an
artifact reference (``rules.inputs.is_ref``: a mapping with a ``uri`` and a ``sha256``) would travel with
the node's request as if a worker had stored it, and anything that trusts references would read whatever
file or object it names. The plan validator refuses it in one line. Pure: no I/O.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Final

from rules.inputs import is_ref

if TYPE_CHECKING:
    from rules.plan import Plan

_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")


def typed_ref(value: Any, where: str) -> str | None:
    """The path (``input.style.refs[1]``) of the first artifact-shaped value in ``value``, or None.

    Iterative, depth first in document order: a deep value costs steps, never a recursion."""
    todo: list[tuple[Any, str]] = [(value, where)]
    while todo:
        item, path = todo.pop()
        if is_ref(item):
            return path
        if isinstance(item, dict):
            todo.extend((v, _key(path, k)) for k, v in reversed(list(item.items())))
        elif isinstance(item, list | tuple):
            todo.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(item))))
    return None


def typed_ref_problem(plan: Plan) -> str | None:
    """One line naming the first stage whose free ``input`` (or compensation ``input``) holds an artifact
    reference, or None."""
    for stage in plan.stages:
        undo = stage.compensation.input if stage.compensation is not None else None
        for field, value in (("input", stage.input), ("compensation.input", undo)):
            path = typed_ref(value, field) if value else None
            if path is not None:
                return (
                    f"stage {stage.id!r}: {path} is an artifact reference (uri and sha256): a stage receives "
                    "artifacts only through inputs: naming an upstream stage"
                )
    return None


def check_typed_refs(plan: Plan) -> None:
    """Raise ``rules.plan.PlanError`` with ``typed_ref_problem``'s line, if there is one."""
    from rules.plan import PlanError  # rules.plan calls this: imported here, not at the top

    problem = typed_ref_problem(plan)
    if problem is not None:
        raise PlanError(problem)


def _key(path: str, key: Any) -> str:
    text = str(key)
    return f"{path}.{text}" if _NAME.fullmatch(text) else f"{path}[{text[:40]!r}]"
