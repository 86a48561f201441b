"""rules.routing: the route a dispatch takes, and how a shared breaker moves — pure, no servers."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from rules.envelope import StoredEvent
from rules.routing import (
    BreakerPolicy,
    BreakerState,
    Candidate,
    Observation,
    RouteHealth,
    Window,
    choose,
    claimed,
    convert,
    first_reviews,
    observed,
)

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
CHAIN = (Candidate("video.motion", open_for_s=30), Candidate("motion.backup", open_for_s=30, max_age_s=3600))
POLICY = BreakerPolicy(window_s=60, min_calls=4, error_rate=0.5, quality_min_reviews=4, quality_pass_rate=0.5)


def opened(at: datetime = T0) -> RouteHealth:
    return RouteHealth(
        "video.motion", BreakerState.OPEN, since=at, opened_at=at, reason="3 of 4 failed", version=3
    )


def backup(**kw: object) -> RouteHealth:
    return RouteHealth("motion.backup", qualified_at=T0 - timedelta(minutes=5), version=1, **kw)  # type: ignore[arg-type]


def test_a_closed_primary_serves_without_a_claim() -> None:
    choice = choose(CHAIN, {}, T0, "t:a:1")
    assert (choice.route, choice.claim) == ("video.motion", None)


def test_an_open_primary_switches_to_the_qualified_fallback_whose_first_dispatch_is_the_canary() -> None:
    rows = {"video.motion": opened(), "motion.backup": backup()}
    first = choose(CHAIN, rows, T0 + timedelta(seconds=1), "t:a:1")
    assert (first.route, first.claim) == ("motion.backup", "canary")

    after = claimed(rows["motion.backup"], first, "t:a:1", T0 + timedelta(seconds=1), T0)
    rows["motion.backup"] = after
    waiting = choose(CHAIN, rows, T0 + timedelta(seconds=2), "t:b:1")
    assert waiting.route is None and "waits for its canary t:a:1" in waiting.reason
    assert choose(CHAIN, rows, T0 + timedelta(seconds=2), "t:a:1").route == "motion.backup"  # its own retry

    rows["motion.backup"] = observed(after, Observation.OK, "t:a:1", Window(), POLICY, T0)[0]
    assert choose(CHAIN, rows, T0 + timedelta(seconds=3), "t:b:1").route == "motion.backup"


def test_a_new_outage_needs_a_new_canary() -> None:
    passed = backup(canary_key="t:a:1", canary_outage=T0, canary_passed=True)
    later = T0 + timedelta(minutes=30)
    rows = {"video.motion": opened(later), "motion.backup": passed}
    assert choose(CHAIN, rows, later, "t:z:1").claim == "canary"


def test_an_unqualified_or_stale_fallback_never_serves_the_dispatch_waits_out_the_rest() -> None:
    rows = {"video.motion": opened(), "motion.backup": RouteHealth("motion.backup")}
    never = choose(CHAIN, rows, T0 + timedelta(seconds=10), "t:a:1")
    assert never.route is None and "motion.backup is not qualified" in never.reason
    assert never.retry_s == 20  # the primary's rest left

    rows["motion.backup"] = RouteHealth("motion.backup", qualified_at=T0 - timedelta(hours=2))  # max age 1 h
    assert choose(CHAIN, rows, T0 + timedelta(seconds=10), "t:a:1").route is None


def test_after_its_rest_the_primary_takes_one_probe_the_others_keep_to_the_fallback() -> None:
    rows = {
        "video.motion": opened(),
        "motion.backup": backup(canary_key="k", canary_outage=T0, canary_passed=True),
    }
    now = T0 + timedelta(seconds=31)
    probe = choose(CHAIN, rows, now, "t:p:1")
    assert (probe.route, probe.claim) == ("video.motion", "probe")

    rows["video.motion"] = claimed(rows["video.motion"], probe, "t:p:1", now, T0)
    assert rows["video.motion"].state == BreakerState.HALF_OPEN
    assert choose(CHAIN, rows, now, "t:q:1").route == "motion.backup"
    assert choose(CHAIN, rows, now, "t:p:1").route == "video.motion"  # the probe's own retry


def test_the_same_rows_time_and_key_give_the_same_choice() -> None:
    rows = {"video.motion": opened(), "motion.backup": backup()}
    basis = {name: h.as_basis() for name, h in rows.items()}
    again = {name: RouteHealth.from_basis(name, raw) for name, raw in basis.items()}
    assert again == rows
    assert choose(CHAIN, again, T0, "t:a:1") == choose(CHAIN, rows, T0, "t:a:1")


def test_the_breaker_opens_at_the_error_rate_once_enough_calls_were_seen() -> None:
    closed = RouteHealth("video.motion")
    few = observed(closed, Observation.ERROR, "k", Window(calls=3, failures=3), POLICY, T0)
    assert few == (closed, None)
    low = observed(closed, Observation.ERROR, "k", Window(calls=10, failures=4), POLICY, T0)
    assert low == (closed, None)

    h, change = observed(closed, Observation.TIMEOUT, "k", Window(calls=4, failures=2), POLICY, T0)
    assert change == "opened" and h.state == BreakerState.OPEN and h.opened_at == T0
    assert h.reason == "2 of 4 calls failed in 60s" and h.version == 1


def test_a_collapsing_first_pass_review_rate_opens_it_although_every_call_succeeded() -> None:
    closed = RouteHealth("video.motion")
    window = Window(calls=20, failures=0, reviews=5, passed=2)
    h, change = observed(closed, Observation.REVIEW_FAIL, "k", window, POLICY, T0)
    assert change == "opened" and "quality collapse: 2 of 5 outputs passed" in h.reason
    fine = Window(calls=20, reviews=5, passed=3)
    assert observed(closed, Observation.REVIEW_FAIL, "k", fine, POLICY, T0) == (closed, None)


def test_the_probe_closes_or_reopens_it_and_only_the_probe_does() -> None:
    half = RouteHealth(
        "video.motion", BreakerState.HALF_OPEN, since=T0, opened_at=T0 - timedelta(minutes=1), probe_key="p"
    )
    assert observed(half, Observation.OK, "other", Window(), POLICY, T0) == (half, None)

    ok, change = observed(half, Observation.OK, "p", Window(), POLICY, T0)
    assert (
        change == "closed"
        and ok.state == BreakerState.CLOSED
        and ok.opened_at is None
        and ok.probe_key is None
    )

    bad, change = observed(half, Observation.ERROR, "p", Window(), POLICY, T0)
    assert change == "opened" and bad.state == BreakerState.OPEN and bad.since == T0
    assert bad.opened_at == half.opened_at  # the same outage: its fallback's canary still stands


def test_a_failed_canary_frees_the_claim_for_the_next_dispatch() -> None:
    out = backup(canary_key="c", canary_outage=T0)
    h, change = observed(out, Observation.ERROR, "c", Window(), POLICY, T0)
    assert change == "canary_failed" and h.canary_key is None
    rows = {"video.motion": opened(), "motion.backup": h}
    assert choose(CHAIN, rows, T0 + timedelta(seconds=1), "next").claim == "canary"


def test_convert_renames_the_fields_a_fallback_names_differently() -> None:
    assert convert({"aspect": "16:9", "prompt": "x"}, {"aspect": "ratio", "seed": "s"}) == {
        "ratio": "16:9",
        "prompt": "x",
    }


def _ev(seq: int, type_: str, key: str | None, **payload: object) -> StoredEvent:
    return StoredEvent(
        task_id="t",
        seq=seq,
        type=type_,
        schema_version=1,
        epoch=1,
        dedup_key=f"d{seq}",
        operation_key=key,
        payload=dict(payload),
        recorded_at=T0,
    )


def test_first_reviews_are_the_routed_outputs_made_since_the_previous_review() -> None:
    events = [
        _ev(1, "Intent", "t:a:1", route="video.motion"),
        _ev(2, "Outcome", "t:a:1", node="a"),
        _ev(3, "Intent", "t:b:1", route="motion.backup"),
        _ev(4, "Outcome", "t:b:1", node="b"),
        _ev(5, "Intent", "t:c:1"),  # not routed (local work)
        _ev(6, "Outcome", "t:c:1", node="c"),
        _ev(7, "ExecutionResult", "t:review:1", kind="review"),
        _ev(8, "Intent", "t:b:2", route="motion.backup"),
        _ev(9, "Outcome", "t:b:2", node="b"),
        _ev(10, "Outcome", "t:a:9", node="a", reused_from="t:a:1"),  # reused: not a new output
    ]
    assert first_reviews(events[:6], flagged=["b"]) == [  # read before the review was written
        ("video.motion", "t:a:1", True),
        ("motion.backup", "t:b:1", False),
    ]
    assert first_reviews(events, flagged=[]) == [("motion.backup", "t:b:2", True)]


def test_a_canary_or_probe_that_ends_without_an_output_for_any_reason_ends_unproven() -> None:
    out = backup(canary_key="c", canary_outage=T0)
    h, change = observed(out, Observation.SETTLED, "c", Window(), POLICY, T0)
    assert change == "canary_failed" and h.canary_key is None
    half = RouteHealth("video.motion", BreakerState.HALF_OPEN, since=T0, opened_at=T0, probe_key="p")
    assert observed(half, Observation.SETTLED, "p", Window(), POLICY, T0)[1] == "opened"
    closed = RouteHealth("video.motion")
    assert observed(closed, Observation.SETTLED, "x", Window(calls=9, failures=9), POLICY, T0) == (
        closed,
        None,
    )


def test_a_full_route_serves_hero_before_standard_before_background_then_the_earlier_deadline() -> None:
    from rules.routing import Waiter, grant, rank

    soon, late = T0 + timedelta(hours=1), T0 + timedelta(hours=9)
    hero = Waiter("h", "hero", late, T0)
    std_soon, std_late = Waiter("s1", "standard", soon, T0), Waiter("s2", "standard", late, T0)
    bg = Waiter("b", "background", soon, T0)
    order = sorted([bg, std_late, hero, std_soon], key=lambda w: rank(w, T0, 60))
    assert [w.key for w in order] == ["h", "s1", "s2", "b"]

    waiting = [hero, std_soon, bg]
    assert not grant(bg, used=1, limit=2, waiters=waiting, now=T0, aging_s=60).granted  # 2 rank before it
    assert grant(hero, used=1, limit=2, waiters=waiting, now=T0, aging_s=60).granted
    assert grant(std_soon, used=0, limit=2, waiters=waiting, now=T0, aging_s=60).granted  # 2 free, 1 ahead


def test_waiting_moves_a_dispatch_up_so_background_work_never_starves() -> None:
    from rules.routing import Waiter, grant

    old = Waiter("b", "background", None, T0)
    now = T0 + timedelta(seconds=150)  # 2.5 classes of aging at 60 s
    fresh_hero = Waiter("h", "hero", None, now)
    assert grant(old, used=0, limit=1, waiters=[fresh_hero, old], now=now, aging_s=60).granted
    assert not grant(fresh_hero, used=0, limit=1, waiters=[fresh_hero, old], now=now, aging_s=60).granted
