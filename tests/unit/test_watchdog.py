"""The stall watchdog (``reconcile.watchdog.StallWatch``): a job whose progress stops for longer than its
threshold is stalled; progress that moves keeps it alive; a vendor that reports none is judged by its run time
alone."""

from __future__ import annotations

from reconcile.watchdog import StallWatch


def test_progress_that_keeps_moving_never_stalls_however_long_the_job_runs() -> None:
    watch = StallWatch(threshold=10)
    assert not any(watch.stalled(step / 100, now=step * 9.0) for step in range(100))


def test_progress_that_stops_stalls_once_the_threshold_has_passed_since_it_last_moved() -> None:
    watch = StallWatch(threshold=10)
    assert not watch.stalled(0.2, now=0)
    assert not watch.stalled(0.5, now=30)  # moved: the clock starts again here
    assert not watch.stalled(0.5, now=40)  # exactly the threshold: not yet
    assert watch.stalled(0.5, now=40.5)


def test_progress_going_backwards_is_no_progress() -> None:
    watch = StallWatch(threshold=10)
    watch.stalled(0.6, now=0)
    assert not watch.stalled(0.4, now=5)
    assert watch.stalled(0.5, now=11), "below its best: the job has not moved since 0"


def test_a_vendor_that_reports_no_progress_stalls_after_running_the_threshold() -> None:
    watch = StallWatch(threshold=10)
    assert not watch.stalled(None, now=0)
    assert not watch.stalled(None, now=9)
    assert watch.stalled(None, now=10.5)
