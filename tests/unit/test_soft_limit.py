"""The soft limit: above it, a fan-out widens no further (one node in flight per stage)."""

from __future__ import annotations

from helpers import History, make_plan, stage

from rules.actions import Dispatch
from rules.table import ready_nodes


def test_below_the_soft_limit_a_fan_out_widens_to_the_plans_concurrency() -> None:
    h = History(make_plan(stage("shots", fan_out=6, canary=False), budget_ceiling="100", concurrency=4))
    for _ in range(4):
        _rule, action = h.act()
        assert isinstance(action, Dispatch)
    assert ready_nodes(h.fold()) == []  # four in flight: the concurrency bound holds the rest


def test_above_the_soft_limit_a_fan_out_proceeds_one_node_at_a_time() -> None:
    # Soft limit 0.35 × 7.10 = 2.485: two reservations (2.00) stay under it, the third (3.00) passes it.
    plan = make_plan(
        stage("shots", fan_out=6, canary=False), budget_ceiling="7.10", concurrency=6, soft_limit=0.35
    )
    h = History(plan)
    dispatched = []
    while ready_nodes(h.fold()):
        _rule, action = h.act()
        assert isinstance(action, Dispatch)
        dispatched.append(action.node)
    # spent + reserved reaches 3.00 ≥ 0.35 × 7.10 = 2.485 after three dispatches: the fan-out stops widening.
    assert len(dispatched) == 3
    h.outcome(dispatched[0])
    assert [n.id for n in ready_nodes(h.fold())] == []  # still above the soft limit with two in flight
