"""The soak report's fairness figures (issue 28): durations by value, time to the first completed task, and
how closely tasks finish in the order they started."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from ledgerflow.runs.soak import SoakReport

T0 = datetime(2026, 12, 2, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_tasks_finishing_in_start_order_score_one_and_reversed_minus_one() -> None:
    spans = [(f"t{n}", at(n), at(100 + n)) for n in range(10)]
    assert SoakReport(spans=spans).order() == 1.0
    reversed_spans = [(f"t{n}", at(n), at(100 - n)) for n in range(10)]
    assert SoakReport(spans=reversed_spans).order() == -1.0


def test_durations_are_split_by_value_and_unfinished_tasks_left_out() -> None:
    report = SoakReport(
        spans=[("a", at(0), at(50)), ("b", at(1), at(31)), ("c", at(2), None), ("d", at(3), at(13))],
        heroes={"d"},
    )
    assert report.durations(heroes=False) == [50.0, 30.0]
    assert report.durations(heroes=True) == [10.0]
    assert report.first_done() == 13.0  # from the first start (0) to the first end (13)
    assert report.order() == -1.0  # three ended: started a, b, d; ended d, b, a
