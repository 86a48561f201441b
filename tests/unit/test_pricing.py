"""Admission at a node's worst credible cost (rules.pricing): the price book, the observed price, the bound.

The bound (docs/design.md#a-ceiling-bounds-spend): spend − ceiling ≤ the overrun (actual − reserved, where
positive) of the operations in flight when the last one was admitted. Checked here over arbitrary actual
costs by driving the real rule table and fold (Hypothesis), not a model of them.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest
from helpers import History, make_plan, stage
from hypothesis import given, settings
from hypothesis import strategies as st

from rules.actions import Dispatch, Escalate
from rules.operation import overrun_bound
from rules.plan import REVIEW, Plan, PlanQuote
from rules.pricing import PriceBook, RoutePrice, StagePrice, admission_price, declared_bound, price_book
from rules.projection import summary
from rules.table_versions import table

D = Decimal


def _book(**stages: StagePrice) -> PriceBook:
    return PriceBook(stages=stages)


# ── the price book ───────────────────────────────────────────────────────────────────────────────────
def test_the_dearest_route_of_the_chain_declares_the_bound() -> None:
    plan = make_plan(stage("clip", executor="video.motion", estimate="1", output={"duration": [2, 8]}))
    chain = (
        RoutePrice("video.motion", per_call=D("0.10")),
        RoutePrice("motion.backup", per_call=D("0.05"), per_second=D("0.25")),
    )
    book = price_book(plan, {"video.motion": chain}, {})
    # The fallback: 0.05 + 0.25 × 8 s (the longest output the stage accepts) = 2.05 > the primary's 0.10.
    assert book.stages["clip"] == StagePrice(declared=D("2.05"), declared_route="motion.backup")


def test_a_price_that_cannot_bound_a_call_declares_nothing() -> None:
    s = make_plan(stage("clip", estimate="1")).stages[0]  # no output duration
    assert declared_bound(s, RoutePrice("r", per_second=D("0.3"))) is None  # per second, no longest output
    assert declared_bound(s, RoutePrice("r", per_call=D("1"), per_1k_tokens=D("0.01"))) is None  # tokens
    assert declared_bound(s, RoutePrice("r")) is None  # no price at all
    assert declared_bound(s, RoutePrice("r", free=True)) == D(0)


def test_a_route_teaches_a_price_only_after_enough_results() -> None:
    plan = make_plan(stage("a", estimate="2"))
    chain = {"llm.text": (RoutePrice("llm.text"),)}
    assert price_book(plan, chain, {"llm.text": (D("3"), 4)}).stages["a"].learned_ratio is None
    learned = price_book(plan, chain, {"llm.text": (D("3"), 5)}).stages["a"]
    assert (learned.learned_ratio, learned.learned_route, learned.learned_results) == (D("3"), "llm.text", 5)


def test_the_dearest_figure_prices_the_node_and_is_named() -> None:
    s = make_plan(stage("a", estimate="2")).stages[0]
    book = _book(
        a=StagePrice(declared=D("3"), declared_route="r1", learned_ratio=D("2.5"), learned_route="r1")
    )
    assert admission_price(s, None, D("99")) == (D("2"), "")  # no book: the estimate, as before books
    price, why = admission_price(s, book, None)
    assert price == D("5.000000") and why.startswith("learned: p95 2.5× the estimate")
    assert admission_price(s, book, D("7")) == (D("7"), "observed: the stage's dearest result in this task")
    assert admission_price(s, _book(), None) == (D("2"), "")  # an empty book: the estimate


# ── admission in the rule table ──────────────────────────────────────────────────────────────────────
def _fan_out(width: int, *, estimate: str = "1", ceiling: str = "100", canary: bool = True) -> Plan:
    return make_plan(stage("shots", estimate=estimate, fan_out=width, canary=canary), budget_ceiling=ceiling)


def test_a_dispatch_reserves_the_price_book_s_figure_and_records_why() -> None:
    h = History()
    h.created(_fan_out(2), prices=_book(shots=StagePrice(declared=D("4"), declared_route="r1")))
    _, action = h.act()
    assert isinstance(action, Dispatch)
    assert (action.estimate, action.plan_estimate, action.priced_by) == (
        D("4"),
        D("1"),
        "declared by route r1",
    )
    assert h.fold().reserved == D("4")  # the INTENT reserves the price, not the plan's 1


def test_the_canary_s_real_price_prices_the_rest_of_the_fan_out() -> None:
    h = History()
    h.created(_fan_out(4, ceiling="12"), prices=_book())
    _, canary = h.act()
    assert isinstance(canary, Dispatch) and canary.estimate == D("1")
    h.outcome(canary.node, cost="5")  # the vendor billed 5× the estimate
    _, second = h.act()
    assert isinstance(second, Dispatch) and second.estimate == D("5")
    assert second.priced_by == "observed: the stage's dearest result in this task"
    h.outcome(second.node, cost="5")
    # 10 spent: a third node at 5 would pass the ceiling of 12, so the task asks a person, naming the price,
    # why, and what the rest would cost.
    _, third = h.act()
    assert isinstance(third, Escalate)
    assert "needs 5 (observed: the stage's dearest result in this task; the plan estimated 1)" in third.reason
    assert "the stage's 2 nodes not yet run would cost 10" in third.reason


def test_a_task_opened_before_price_books_is_admitted_at_its_estimates() -> None:
    h = History(_fan_out(4, ceiling="12"))  # TaskCreated without prices
    _, canary = h.act()
    assert isinstance(canary, Dispatch)
    h.outcome(canary.node, cost="5")
    _, second = h.act()
    assert isinstance(second, Dispatch) and second.estimate == D("1") and second.priced_by == ""


def test_rule_table_2_is_today_s_without_the_price_book() -> None:
    h = History()
    h.created(_fan_out(2), prices=_book(shots=StagePrice(declared=D("4"), declared_route="r1")))
    v2 = table(2)
    assert v2 is not None
    p = h.fold()
    book = p.prices
    decided = v2(p, h.now)
    assert decided is not None and isinstance(decided[1], Dispatch) and decided[1].estimate == D("1")
    assert book is not None and p.prices is book  # the table put the book back on the projection it was given


# ── the bound, over arbitrary actual costs ───────────────────────────────────────────────────────────
def _run(plan: Plan, book: PriceBook, costs: list[Decimal], picks: list[int]) -> tuple[Decimal, Decimal]:
    """Drive the real table over ``plan``: every Dispatch is recorded; in-flight operations settle in the
    order ``picks`` chooses, the fan-out's at the next of ``costs``. Returns (spent − ceiling, the bound:
    the overrun of the operations in flight when the last one was admitted)."""
    h = History()
    h.created(plan, prices=book)
    in_flight: dict[str, str] = {}  # op key -> node
    reserved: dict[str, Decimal] = {}
    at_last_admission: set[str] = set()
    actual: dict[str, Decimal] = {}
    step = 0
    for _ in range(400):
        decided = h.decide()
        if decided is not None and isinstance(decided[1], Dispatch) and decided[1].node != REVIEW:
            rule, action = decided
            if action.node.startswith("shots/"):
                # What only the price book gives: a node is never admitted below what its stage really cost.
                settled = [a for k, a in actual.items() if "shots/" in k]
                assert action.estimate >= max(settled, default=D(0)), (action.estimate, settled)
            h.record(rule, action)
            in_flight[action.operation_key] = action.node
            reserved[action.operation_key] = action.estimate
            at_last_admission = set(in_flight)
            continue
        if not in_flight:
            break  # the review, an escalation, or nothing left: the stage's spend is final
        key = sorted(in_flight)[picks[step % len(picks)] % len(in_flight)]
        node = in_flight.pop(key)
        # The fan-out's nodes are billed ``costs``; the framework's own (compose) what was reserved.
        actual[key] = costs[step % len(costs)] if node.startswith("shots/") else reserved[key]
        h.outcome(node, op_key=key, cost=actual[key])
        step += 1
    p = h.fold()
    bound = sum((max(D(0), actual[k] - reserved[k]) for k in at_last_admission), D(0))
    assert overrun_bound(h.events) == bound  # what the drill and the docs compute it with, from the record
    return p.spent - p.ceiling, bound


money = st.decimals(min_value=D("0"), max_value=D("30"), places=2)


@settings(max_examples=150, deadline=None)
@given(
    width=st.integers(1, 8),
    canary=st.booleans(),
    estimate=st.decimals(min_value=D("0.10"), max_value=D("5"), places=2),
    slack=st.decimals(min_value=D("0.05"), max_value=D("30"), places=2),
    costs=st.lists(money, min_size=1, max_size=12),
    picks=st.lists(st.integers(0, 7), min_size=1, max_size=12),
)
def test_spend_passes_a_ceiling_by_at_most_what_was_in_flight_at_the_last_admission(
    width: int, canary: bool, estimate: Decimal, slack: Decimal, costs: list[Decimal], picks: list[int]
) -> None:
    ceiling = estimate * width + slack + D("0.05")  # a plan's ceiling covers its estimates and the reserve
    plan = _fan_out(width, estimate=str(estimate), ceiling=str(ceiling), canary=canary)
    over, bound = _run(plan, _book(), costs, picks)
    assert over <= bound


@settings(max_examples=100, deadline=None)
@given(
    width=st.integers(2, 10),
    estimate=st.decimals(min_value=D("0.10"), max_value=D("2"), places=2),
    factor=st.integers(1, 10),
    slack=st.decimals(min_value=D("0.05"), max_value=D("30"), places=2),
)
def test_with_a_canary_and_a_vendor_that_holds_its_price_only_the_canary_can_overrun(
    width: int, estimate: Decimal, factor: int, slack: Decimal
) -> None:
    ceiling = estimate * width + slack + D("0.05")
    price = estimate * factor  # what the vendor bills every node, whatever the plan says
    over, _ = _run(_fan_out(width, estimate=str(estimate), ceiling=str(ceiling)), _book(), [price], [0])
    assert over <= max(D(0), price - estimate)  # one node's overrun: the canary's


# ── validation ───────────────────────────────────────────────────────────────────────────────────────
def test_a_paid_route_without_a_price_needs_an_estimate() -> None:
    from rules.plan import PlanError, validate_plan
    from vendors.routes import Price, RouteSpec, RouteTable, default_table

    raw = {"goal": "g", "budget_ceiling": "5", "stages": [{"id": "a", "executor": "image.asset"}]}
    with pytest.raises(PlanError) as refused:
        validate_plan(raw, default_table().names())
    assert str(refused.value) == (
        "stage 'a': estimate is 0 and route 'image.asset' is paid with no declared price: "
        "give the stage an estimate or the route a price"
    )
    priced = RouteTable(routes={"image.asset": RouteSpec(price=Price(per_call=D("0.20")))})
    assert validate_plan(raw, priced.names()).stages[0].estimate == 0  # its price bounds it
    local = {**raw, "stages": [{"id": "a", "executor": "code.validate"}]}
    assert validate_plan(local, default_table().names()).stages[0].estimate == 0  # free: nothing to bound


def test_the_summary_reports_spend_drift_from_the_quote_the_ceiling_came_from() -> None:
    quote = PlanQuote(percentile="p95", total=D("3.00"), computed_at=datetime(2026, 12, 1, tzinfo=UTC))
    h = History()
    h.created(_fan_out(2, ceiling="3.00").model_copy(update={"quote": quote}), prices=_book())
    for _ in range(2):
        _, action = h.act()
        assert isinstance(action, Dispatch)
        h.outcome(action.node, cost="1.40")
    assert summary(h.fold())["quote"] == {"percentile": "p95", "total": "3.00", "drift": "-0.20"}
    assert "quote" not in summary(History(_fan_out(2)).fold())  # no quote, no drift
