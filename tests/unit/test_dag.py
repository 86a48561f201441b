"""The node graph: expansion, ids, dependencies, and the rollback target of a merged rework round."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import make_plan, stage
from hypothesis import given, settings
from hypothesis import strategies as st

from rules.dag import Graph, build_graph
from rules.plan import COMPOSE, REVIEW


def test_a_stage_without_fan_out_is_one_node_named_after_the_stage() -> None:
    graph = build_graph(make_plan(stage("a"), stage("b", "a")))
    assert list(graph.nodes) == ["a", "b", COMPOSE, REVIEW]
    assert graph.nodes["b"].item is None
    assert graph.stage_nodes["a"] == ("a",)


def test_fan_out_count_expands_to_numbered_items() -> None:
    # 123 nodes at 1.00 each: the ceiling must cover the plan's estimated total (123.05 with the review)
    # plus the 0.05 inference reserve.
    plan = make_plan(stage("shots", fan_out=3), stage("wide", fan_out=120), budget_ceiling="123.10")
    graph = build_graph(plan)
    assert graph.stage_nodes["shots"] == ("shots/S01", "shots/S02", "shots/S03")
    assert graph.nodes["shots/S02"].item == "S02"
    assert graph.stage_nodes["wide"][0] == "wide/S001"  # zero-padded to the widest number: ids sort
    assert graph.stage_nodes["wide"][-1] == "wide/S120"


def test_fan_out_list_expands_to_the_named_items() -> None:
    graph = build_graph(make_plan(stage("lang", fan_out=["en", "fr"])))
    assert graph.stage_nodes["lang"] == ("lang/en", "lang/fr")


def test_a_node_depends_on_every_node_of_every_stage_its_stage_depends_on() -> None:
    graph = build_graph(
        make_plan(stage("a", fan_out=2), stage("b", fan_out=2), stage("c", "a", "b", fan_out=3))
    )
    expected = ("a/S01", "a/S02", "b/S01", "b/S02")
    assert all(graph.nodes[n].deps == expected for n in graph.stage_nodes["c"])
    assert graph.dependents("a/S01") == graph.stage_nodes["c"]


def test_compose_depends_on_the_sinks_and_review_on_compose() -> None:
    graph = build_graph(make_plan(stage("a"), stage("b", "a", fan_out=2), stage("c", "a")))
    assert graph.nodes[COMPOSE].deps == ("b/S01", "b/S02", "c")
    assert graph.nodes[REVIEW].deps == (COMPOSE,)
    assert graph.dependents(REVIEW) == ()


def test_order_is_topological_even_when_a_stage_is_listed_before_its_dependencies() -> None:
    graph = build_graph(make_plan(stage("late", "mid"), stage("mid", "first"), stage("first")))
    assert list(graph.nodes) == ["first", "mid", "late", COMPOSE, REVIEW]
    assert [graph.nodes[n].order for n in graph.nodes] == [0, 1, 2, 3, 4]


def test_descendants_and_ancestors_are_transitive_and_exclude_the_node() -> None:
    graph = build_graph(make_plan(stage("a"), stage("b", "a", fan_out=2), stage("c", "b"), stage("x")))
    assert graph.descendants("a") == {"b/S01", "b/S02", "c", COMPOSE, REVIEW}
    assert graph.descendants("b/S01") == {"c", COMPOSE, REVIEW}
    assert graph.descendants(REVIEW) == frozenset()
    assert graph.ancestors("c") == {"a", "b/S01", "b/S02"}
    assert graph.ancestors(COMPOSE) == {"a", "b/S01", "b/S02", "c", "x"}
    assert graph.ancestors("a") == frozenset()


def test_rollback_of_one_node_restarts_it_and_invalidates_its_descendants() -> None:
    graph = build_graph(make_plan(stage("a"), stage("b", "a", fan_out=2), stage("c", "b")))
    assert graph.rollback_target(["b/S02"]) == (("b/S02",), frozenset({"b/S02", "c", COMPOSE, REVIEW}))


def test_rollback_of_a_node_and_its_descendant_restarts_from_the_upstream_one() -> None:
    graph = build_graph(make_plan(stage("a"), stage("b", "a"), stage("c", "b")))
    assert graph.rollback_target(["c", "b"]) == (("b",), frozenset({"b", "c", COMPOSE, REVIEW}))


def test_rollback_of_siblings_restarts_both_and_never_their_unflagged_common_ancestor() -> None:
    graph = build_graph(make_plan(stage("a"), stage("k", "a"), stage("m", "k", fan_out=3), stage("q", "m")))
    targets, invalid = graph.rollback_target(["m/S03", "m/S01"])
    assert targets == ("m/S01", "m/S03")  # in topological order; "k" was not flagged, so it is kept
    assert invalid == {"m/S01", "m/S03", "q", COMPOSE, REVIEW}  # m/S02 is not built on either


def test_rollback_of_a_flagged_ancestor_and_its_fan_out_restarts_once_from_the_ancestor() -> None:
    graph = build_graph(make_plan(stage("a"), stage("k", "a"), stage("m", "k", fan_out=3), stage("q", "m")))
    targets, invalid = graph.rollback_target(["m/S01", "k", "m/S03"])
    assert targets == ("k",)
    assert invalid == {"k", "m/S01", "m/S02", "m/S03", "q", COMPOSE, REVIEW}


def test_rollback_of_independent_lineages_invalidates_each_in_one_round() -> None:
    graph = build_graph(make_plan(stage("a"), stage("b"), stage("c", "a"), stage("d", "b")))
    targets, invalid = graph.rollback_target(["d", "c"])
    assert targets == ("c", "d")
    assert invalid == {"c", "d", COMPOSE, REVIEW}


def test_rollback_ignores_unknown_flagged_nodes_but_needs_one_known() -> None:
    graph = build_graph(make_plan(stage("a")))
    assert graph.rollback_target(["a", "ghost"])[0] == ("a",)
    with pytest.raises(ValueError, match="no known node flagged"):
        graph.rollback_target(["ghost"])


# ── Hypothesis: random DAGs ───────────────────────────────────────────────────────────────────────────
@st.composite
def random_graphs(draw: st.DrawFn) -> Graph:
    """Plans whose stages depend only on earlier stages (so they are acyclic), some fanned out."""
    count = draw(st.integers(1, 8))
    stages: list[dict[str, Any]] = []
    for i in range(count):
        deps = draw(st.lists(st.sampled_from(range(i)), unique=True, max_size=3)) if i else []
        fan_out = draw(st.one_of(st.none(), st.integers(1, 3)))
        stages.append(stage(f"s{i}", *(f"s{d}" for d in deps), **({"fan_out": fan_out} if fan_out else {})))
    return build_graph(make_plan(*stages))


def reach(graph: Graph, node: str) -> set[str]:
    """Descendants by walking ``deps`` backwards: independent of Graph.descendants."""
    out: set[str] = set()
    frontier = {node}
    while frontier:
        frontier = {n for n, spec in graph.nodes.items() if set(spec.deps) & frontier} - out
        out |= frontier
    return out


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_rollback_restarts_from_the_most_upstream_flagged_nodes_and_redoes_only_their_lineage(
    data: st.DataObject,
) -> None:
    graph = data.draw(random_graphs())
    flagged = set(data.draw(st.lists(st.sampled_from(sorted(graph.nodes)), min_size=1, max_size=4)))
    targets, invalid = graph.rollback_target(flagged)
    below = {n: reach(graph, n) for n in graph.nodes}

    assert set(targets) <= flagged, "only a flagged node is a restart point: nothing unflagged is redone"
    for f in flagged:
        assert any(f == t or f in below[t] for t in targets), f"{f} is a restart point or below one"
    for t in targets:
        assert not any(t in below[f] for f in flagged), f"{t} is most upstream: no flagged node above it"
    assert invalid == set(targets).union(*(below[t] for t in targets)), "the lineage, all of it, nothing else"
    assert [graph.nodes[t].order for t in targets] == sorted(graph.nodes[t].order for t in targets)


@settings(max_examples=100, deadline=None)
@given(random_graphs())
def test_graph_queries_agree_with_an_independent_walk(graph: Graph) -> None:
    for node, spec in graph.nodes.items():
        assert graph.descendants(node) == reach(graph, node)
        assert all(graph.nodes[d].order < spec.order for d in spec.deps), "order is topological"
        assert all(node in graph.descendants(a) for a in graph.ancestors(node))
    assert graph.descendants(next(iter(graph.nodes))) >= {COMPOSE, REVIEW}
