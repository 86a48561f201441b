"""How wide a task runs: the soft limit (one node in flight per stage above it) and the per-task cap."""

from __future__ import annotations

from helpers import History, make_plan, stage

from rules.actions import Dispatch
from rules.table import MAX_IN_FLIGHT, decide, ready_nodes


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


def test_in_flight_work_is_capped_per_task_below_temporals_pending_activity_limit() -> None:
    # Three independent 400-wide fan-outs, each allowed 400 in flight: 1,200 would be pending at once.
    plan = make_plan(
        *(stage(s, fan_out=400, canary=False, estimate="0.01") for s in ("a", "b", "c")),
        concurrency=400,
        budget_ceiling="1000",
    )
    h = History(plan)
    while isinstance((decided := decide(h.view, h.now)) and decided[1], Dispatch):
        assert decided is not None
        h.record(*decided)
    assert len(h.view.in_flight()) == MAX_IN_FLIGHT == 1000
    assert ready_nodes(h.fold()) == []
