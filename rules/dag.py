"""The node graph a plan expands into, and the graph questions the rules ask of it.

A stage without fan-out is one node whose id is the stage id; a fan-out stage is one node per item, with id
``stage/ITEM`` (``/`` cannot occur in a stage id, so node ids never collide). A node depends on every node
of every stage its stage depends on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from rules.plan import Plan, Stage


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One schedulable unit of work."""

    id: str
    stage: Stage
    item: str | None
    deps: tuple[str, ...]
    order: int  # position in a topological order: lower runs earlier; ties keep plan order


@dataclass(frozen=True)
class Graph:
    """The expanded DAG of a plan (business stages + compose + review).

    Dependencies are kept per stage, not per node pair: every node of a stage depends on every node of every
    stage its stage depends on, so two chained 500-wide fan-outs are 500 shared ``deps`` tuples and one
    stage edge, never 250,000 node edges. The node-level questions are answered from the stage edges.
    """

    nodes: dict[str, NodeSpec]
    stage_nodes: dict[str, tuple[str, ...]]
    stage_deps: dict[str, tuple[str, ...]]  # stage -> the stages it depends on
    stage_dependents: dict[str, tuple[str, ...]]  # stage -> the stages that depend on it
    stage_order: tuple[str, ...]  # the stages in the order their nodes come in ``nodes`` (topological)
    _desc_cache: dict[str, frozenset[str]] = field(default_factory=dict, compare=False, repr=False)

    def stage_of(self, node: str) -> str:
        return self.nodes[node].stage.id

    def dependents(self, node: str) -> tuple[str, ...]:
        """The nodes that depend on ``node`` directly (in node order)."""
        return tuple(n for s in self.stage_dependents[self.stage_of(node)] for n in self.stage_nodes[s])

    def descendants(self, node: str) -> frozenset[str]:
        """Every node that transitively depends on ``node`` (not including it)."""
        stage = self.stage_of(node)
        if stage not in self._desc_cache:
            self._desc_cache[stage] = frozenset(
                n for s in _closure(stage, self.stage_dependents) for n in self.stage_nodes[s]
            )
        return self._desc_cache[stage]

    def ancestors(self, node: str) -> frozenset[str]:
        """Every node ``node`` transitively depends on (not including it)."""
        stages = _closure(self.stage_of(node), self.stage_deps)
        return frozenset(n for s in stages for n in self.stage_nodes[s])

    def rollback_target(self, flagged: Iterable[str]) -> tuple[tuple[str, ...], frozenset[str]]:
        """Where a merged rework round restarts, and every node that round invalidates.

        The restart points are the most upstream flagged nodes: those no other flagged node is an ancestor
        of. A flagged node below another flagged node is covered by the upstream one's invalidation, so one
        round redoes it once (no duplicate rollbacks: the "most upstream common ancestor" rule of
        docs/design.md#rework-restarts-from-the-most-upstream-flagged-nodes); the invalidated set is the
        restart points and everything built on them, and nothing else. An unflagged common ancestor is never
        redone: if two sibling shots are bad, the two shots are rerun, not the stage all shots came from (the
        reviewer flags that stage when it is the cause).
        Restart points are in topological order, so ``targets[0]`` is the most upstream.
        """
        flagged_set = {n for n in flagged if n in self.nodes}
        if not flagged_set:
            raise ValueError("no known node flagged")
        targets = [n for n in flagged_set if not (self.ancestors(n) & flagged_set)]
        invalid = set(targets)
        for n in targets:
            invalid |= self.descendants(n)
        return tuple(sorted(targets, key=lambda n: self.nodes[n].order)), frozenset(invalid)


def node_id(stage_id: str, item: str | None) -> str:
    return stage_id if item is None else f"{stage_id}/{item}"


def build_graph(plan: Plan) -> Graph:
    """Expand a validated plan into its node graph."""
    stages = plan.all_stages()
    items_of = {s.id: s.items() or (None,) for s in stages}  # a stage's items, expanded once
    stage_nodes = {s.id: tuple(node_id(s.id, i) for i in items_of[s.id]) for s in stages}
    level: dict[str, int] = {}
    for s in stages:  # a plan may list a stage before its dependencies: order nodes by depth
        level[s.id] = _depth(s.id, {x.id: x for x in stages}, level)
    ordered = sorted(stages, key=lambda s: level[s.id])
    nodes: dict[str, NodeSpec] = {}
    for s in ordered:
        deps = tuple(n for d in s.depends_on for n in stage_nodes[d])  # one tuple for all the stage's nodes
        for nid, item in zip(stage_nodes[s.id], items_of[s.id], strict=True):
            nodes[nid] = NodeSpec(id=nid, stage=s, item=item, deps=deps, order=len(nodes))
    dependents: dict[str, list[str]] = {s.id: [] for s in ordered}
    for s in ordered:
        for d in s.depends_on:
            dependents[d].append(s.id)
    return Graph(
        nodes=nodes,
        stage_nodes=stage_nodes,
        stage_order=tuple(s.id for s in ordered),
        stage_deps={s.id: tuple(s.depends_on) for s in ordered},
        stage_dependents={k: tuple(v) for k, v in dependents.items()},
    )


def _closure(stage: str, edges: dict[str, tuple[str, ...]]) -> set[str]:
    """Every stage reachable from ``stage`` along ``edges`` (not including it)."""
    out: set[str] = set()
    todo = list(edges[stage])
    while todo:
        s = todo.pop()
        if s not in out:
            out.add(s)
            todo.extend(edges[s])
    return out


def _depth(stage_id: str, by_id: dict[str, Stage], memo: dict[str, int]) -> int:
    if stage_id not in memo:
        deps = by_id[stage_id].depends_on
        memo[stage_id] = 1 + max((_depth(d, by_id, memo) for d in deps), default=-1)
    return memo[stage_id]
