"""Data flow through the DAG: which upstream outputs a node receives, and the hash of what it was asked.

A stage declares its data inputs by name (``inputs: {keyframe: keyframes, refs: [character_refs, location]}``)
and may name any ancestor stage, not only a direct dependency (E001's motion depends on the ``keyframe_qc``
gate but takes its picture from ``keyframes``). Without a declaration a stage receives its direct
dependencies' outputs, each under the dependency's id. The mapping per name:

* ``name: stage`` — one stage. Between fan-outs of the same width the mapping is item to item
  (``motion/S07`` ← ``keyframes/S07``), so reworking one item changes only its own lineage's input hashes; a
  single node, or a fan-out consumed by a single node (a join), receives every item in order (a list).
* ``name: [a, b]`` — every output of every listed stage, in order (always a list).

A node's request carries each input as an artifact reference (store URI, sha256, size, media, the producing
node and the seq that registered it). Its **input hash** is the hash of the request with each reference
reduced to its sha256: the stage input, the fan-out item, the feedback (findings, previous errors) and the
bytes of every input — never a URI, so the same bytes in another store (or a presigned URL) hash the same.
An output whose input hash equals a new request's is what that request would make again (``rules.table``
reuses it instead of paying for it). Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from rules.dag import Graph, NodeSpec
    from rules.plan import Plan, Stage


def declared(stage: Stage) -> dict[str, str | tuple[str, ...]]:
    """The stage's data inputs: its declaration, or each direct dependency under its own id."""
    if stage.inputs is not None:
        return dict(stage.inputs)
    return {dep: dep for dep in stage.depends_on}


def check_inputs(plan: Plan) -> str | None:
    """The first problem with the plan's data inputs, as one line naming the stage, or None.

    Each named stage must exist and be upstream of the consumer; ``name: stage`` between two fan-outs needs
    the same width (item to item); a list names a join explicitly.
    """
    by_id = {s.id: s for s in plan.stages}
    ancestors: dict[str, set[str]] = {}

    def upstream(sid: str) -> set[str]:
        if sid not in ancestors:
            ancestors[sid] = set()
            for dep in by_id[sid].depends_on:
                ancestors[sid] |= {dep, *upstream(dep)}
        return ancestors[sid]

    for s in plan.stages:
        if s.inputs is None:
            continue
        for name, source in s.inputs.items():
            names = (source,) if isinstance(source, str) else source
            for src in names:
                if src not in by_id:
                    return f"stage {s.id!r}: input {name!r} names unknown stage {src!r}"
                if src not in upstream(s.id):
                    return f"stage {s.id!r}: input {name!r} names {src!r}, which is not upstream of it"
            if isinstance(source, str) and s.fan_out is not None and by_id[source].fan_out is not None:
                mine, theirs = len(s.items()), len(by_id[source].items())
                if mine != theirs:
                    return (
                        f"stage {s.id!r}: input {name!r} maps {source!r} item to item, but it has {theirs} "
                        f"items and {s.id!r} has {mine} (write [{source}] to receive all of them)"
                    )
    return None


def sources(graph: Graph, spec: NodeSpec) -> dict[str, str | list[str]]:
    """The nodes each input name of ``spec`` reads: one node (item to item, or a single node) or a list.

    Item to item pairs fan-out items by position (the i-th shot reads the i-th keyframe), so two fan-outs
    may name their items differently; it applies only between fan-outs of one width (``check_inputs`` refuses
    a declared mapping between different widths; an undeclared one joins instead).
    """
    out: dict[str, str | list[str]] = {}
    mine = graph.stage_nodes[spec.stage.id]
    for name, source in declared(spec.stage).items():
        if isinstance(source, str):
            producers = graph.stage_nodes[source]
            if graph.nodes[producers[0]].stage.fan_out is None:
                out[name] = producers[0]
            elif spec.item is not None and len(producers) == len(mine):
                out[name] = producers[mine.index(spec.id)]
            else:
                out[name] = list(producers)  # a join: every item, in order
        else:
            out[name] = [n for src in source for n in graph.stage_nodes[src]]
    return out


def reference(node: str, artifact: dict[str, Any], seq: int) -> dict[str, Any]:
    """An input artifact reference, as a request carries it."""
    ref = {k: artifact.get(k) for k in ("uri", "sha256", "size", "media") if artifact.get(k) is not None}
    return {**ref, "node": node, "seq": seq}


def input_hash(request: dict[str, Any], *, node: str = "", executor: str = "", output: Any = None) -> str:
    """The hash of what a request asks: everything in it, each artifact reference reduced to its sha256, and
    who is asked for what (the node, its executor, its output bounds) — so an output is only ever reused
    for the same node, made by the same route, held to the same bounds."""
    what = {"node": node, "executor": executor, "output": output, "request": _reduced(request)}
    canonical = json.dumps(what, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def is_ref(value: Any) -> bool:
    """Whether a request value is an artifact reference (a mapping with a ``uri`` and a ``sha256``)."""
    return (
        isinstance(value, dict) and isinstance(value.get("uri"), str) and isinstance(value.get("sha256"), str)
    )


def refs(value: Any) -> list[dict[str, Any]]:
    """Every artifact reference in a request value, in order."""
    return [ref for _, ref in ref_paths(value)]


def ref_paths(value: Any, where: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every artifact reference in ``value`` with its path (``input.style.refs[1]``), in document order.
    Iterative: a deep value costs steps, never a recursion."""
    todo: list[tuple[Any, str]] = [(value, where)]
    while todo:
        item, path = todo.pop()
        if is_ref(item):
            yield path, item
        elif isinstance(item, dict):
            todo.extend((v, _key(path, k)) for k, v in reversed(list(item.items())))
        elif isinstance(item, list | tuple):
            todo.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(item))))


_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")


def _key(path: str, key: Any) -> str:
    text = str(key)
    return f"{path}.{text}" if _NAME.fullmatch(text) else f"{path}[{text[:40]!r}]"


def _reduced(value: Any) -> Any:
    if is_ref(value):
        return value["sha256"]
    if isinstance(value, dict):
        return {k: _reduced(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_reduced(v) for v in value]
    return value
