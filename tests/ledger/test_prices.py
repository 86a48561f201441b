"""Learned prices (ledger.prices): what a route's last settled results cost against their plans' estimates,
read from a history recorded through the recorder's own append paths on the real Postgres."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from historykit import D, History, uid

from ledger.prices import learned_prices, route_history
from ledger.recorder import Recorder
from rules.actions import Dispatch
from rules.events import (
    Intent,
    Verdict,
    to_new,
)
from rules.keys import intent_key, operation_key


@pytest.fixture
def project() -> str:
    return f"p-{uid()}"


@pytest.fixture
def history(recorder: Recorder, project: str) -> History:
    return History(recorder, project)


def test_ratios_and_costs_are_observed_percentiles_of_the_settled_results(
    recorder: Recorder, history: History
) -> None:
    route = f"r-{uid()}"
    for cost in ("0.50", "1.00", "1.50", "2.00", "2.50", "3.00", "3.50", "4.00", "4.50", "5.00"):
        history.op(route, "1.00", cost)
    [price] = learned_prices(recorder.reader, [route]).values()
    assert price.route == route
    assert price.results == 10
    # percentile_disc: the 5th of 10 for p50, the 10th for p95 (an observed figure, never interpolated).
    assert (price.ratio_p50, price.ratio_p95) == (D("2.5"), D("5"))
    assert (price.cost_p50, price.cost_p95) == (D("2.5"), D("5"))


def test_only_the_routes_last_results_count(recorder: Recorder, history: History) -> None:
    route = f"r-{uid()}"
    for _ in range(4):
        history.op(route, "1.00", "9.00")  # older: out of the window
    for cost in ("1.00", "1.10", "1.20"):
        history.op(route, "1.00", cost)
    price = learned_prices(recorder.reader, [route], last=3)[route]
    assert price.results == 3
    assert (price.cost_p50, price.cost_p95) == (D("1.1"), D("1.2"))
    assert learned_prices(recorder.reader, [route], last=7)[route].cost_p95 == D("9")


def test_the_ratio_is_against_the_plans_estimate_not_the_reserved_price(
    recorder: Recorder, history: History
) -> None:
    route = f"r-{uid()}"
    history.op(route, "3.00", "2.00", plan_estimate="1.00")  # admission reserved 3, the plan said 1
    price = learned_prices(recorder.reader, [route])[route]
    assert (price.ratio_p50, price.ratio_p95) == (D("2"), D("2"))


def test_a_ratio_finer_than_the_money_scale_is_rounded_up(recorder: Recorder, history: History) -> None:
    route = f"r-{uid()}"
    history.op(route, "3.00", "1.00")
    price = learned_prices(recorder.reader, [route])[route]
    assert price.ratio_p50 == D("0.333334")


def test_an_intent_served_by_a_fallback_counts_for_the_fallback_and_an_old_one_for_its_executor(
    recorder: Recorder, history: History
) -> None:
    primary, fallback = f"r-{uid()}", f"r-{uid()}"
    history.op(fallback, "1.00", "4.00", executor=primary)  # served by the fallback
    history.op(None, "1.00", "2.00", executor=primary)  # an INTENT from before routes were recorded
    learned = learned_prices(recorder.reader, [primary, fallback])
    assert learned[fallback].cost_p50 == D("4") and learned[fallback].results == 1
    assert learned[primary].cost_p50 == D("2") and learned[primary].results == 1


def test_a_failures_cost_and_a_late_charge_are_settled_costs_of_the_route(
    recorder: Recorder, history: History
) -> None:
    route = f"r-{uid()}"
    history.op(route, "1.00", "0.40", result="Failure")
    history.op(route, "1.00", "1.00", late="0.50")  # the vendor billed a late job for the same key
    price = learned_prices(recorder.reader, [route])[route]
    assert price.results == 2
    assert (price.cost_p50, price.cost_p95) == (D("0.4"), D("1.5"))
    assert (price.ratio_p50, price.ratio_p95) == (D("0.4"), D("1.5"))


def test_a_zero_estimate_is_left_out_of_the_ratio_but_not_of_the_cost(
    recorder: Recorder, history: History
) -> None:
    route = f"r-{uid()}"
    history.op(route, "0", "5.00")
    history.op(route, "2.00", "3.00")
    h = route_history(recorder.reader, [route])[route]
    assert (h.price.results, h.priced) == (2, 1)
    assert (h.price.ratio_p50, h.price.ratio_p95) == (D("1.5"), D("1.5"))
    assert (h.price.cost_p50, h.price.cost_p95) == (D("3"), D("5"))


def test_routes_without_a_settled_result_are_absent(recorder: Recorder, history: History) -> None:
    voided, reused, open_, never = (f"r-{uid()}" for _ in range(4))
    history.op(voided, "1.00", "0", result="void")  # nothing was sent
    history.op(reused, "0", "0", reuse=True)  # an earlier output registered again: nothing was sent
    op = operation_key(history.task_id, "s/open", 99)
    dispatch = Dispatch(node="s/open", attempt=99, operation_key=op, executor=open_, estimate=D(1))
    intent = Intent(action=dispatch, rule="R3", watermark=99, decided_at=datetime.now(UTC), route=open_)
    recorder.append_fenced(
        history.task_id, history.epoch, [to_new(intent, intent_key(history.task_id, 99, 0), op)]
    )
    assert learned_prices(recorder.reader, [voided, reused, open_, never]) == {}
    assert learned_prices(recorder.reader, []) == {}


def test_retries_reworks_first_reviews_and_durations_come_from_the_same_results(
    recorder: Recorder, project: str
) -> None:
    route, review = f"r-{uid()}", f"review-{uid()}"
    a, b = History(recorder, project), History(recorder, project)
    sent, settled = a.op(route, "1.00", "1.00", node="s/S1")
    durations = [(settled.recorded_at - sent.recorded_at).total_seconds()]
    for h, node, result in ((a, "s/S2", "Failure"), (b, "s/S1", "Outcome"), (b, "s/S2", "Outcome")):
        sent, settled = h.op(route, "1.00", "1.00", node=node, result=result)
        durations.append((settled.recorded_at - sent.recorded_at).total_seconds())
    b.rework("s/S1")  # the review sent b's s/S1 back
    b.op(review, "0.05", "0.02", node="review", result="review", verdict=Verdict.QUALITY_REWORK)
    b.op(review, "0.05", "0.02", node="review", result="review", verdict=Verdict.PASS)  # not a first review
    a.op(review, "0.05", "0.02", node="review", result="review", verdict=Verdict.SOFT_WARNING)
    got = route_history(recorder.reader, [route, review])
    h = got[route]
    assert (h.price.results, h.failures, h.outcomes, h.reworked) == (4, 1, 3, 1)
    assert (h.retry_rate, h.rework_rate, h.first_pass_rate) == (0.25, 1 / 3, None)
    ordered = sorted(durations)
    assert (h.duration_p50_s, h.duration_p95_s) == (round(ordered[1], 3), round(ordered[3], 3))
    r = got[review]
    assert (r.first_reviews, r.first_passes, r.first_pass_rate) == (2, 1, 0.5)


def test_a_project_learns_from_its_own_tasks_only(recorder: Recorder, project: str) -> None:
    route = f"r-{uid()}"
    History(recorder, project).op(route, "1.00", "1.00")
    History(recorder, f"other-{uid()}").op(route, "1.00", "7.00")
    assert route_history(recorder.reader, [route], project=project)[route].price.cost_p95 == D("1")
    assert route_history(recorder.reader, [route])[route].price.cost_p95 == D("7")


def test_a_window_below_one_is_refused(recorder: Recorder) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        learned_prices(recorder.reader, ["any"], last=0)
