"""Issue 23 §3 and §5, pure: every vendor figure through the money gate; breakers judge vendors, not plans.

The attacks: a priced job's negative token count lowered its cost silently; seconds of NaN or 1e400 raised
``InvalidOperation`` after the output was made and paid (the attempt retried without end); a chat usage the
vendor got wrong made a paid answer unreadable; and a charge above twice a *plan's* estimate counted as a
failed call for the route's shared breaker, so one plan with a tiny estimate opened it for every project.
"""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import Any

import pytest

from activities.llm import ChatReply, usage_amount
from activities.operation import Operation
from rules.money import MAX_AMOUNT, VendorAmount, priced_amount, usage_problem
from vendors.adapter import JobStatus, VendorJob, job_amount, price_bound
from vendors.routes import Price, RouteSpec

TOKENS = RouteSpec(price=Price(per_1k_input_tokens=Decimal("0.01"), per_1k_output_tokens=Decimal("0.03")))
SECONDS = RouteSpec(price=Price(per_second=Decimal("0.30")))
PER_CALL = RouteSpec(price=Price(per_call=Decimal("0.10")))


def job(**figures: Any) -> VendorJob:
    return VendorJob(id="j1", status=JobStatus.SUCCEEDED, **figures)


# ── §3: usage figures through the gate ───────────────────────────────────────────────────────────────────


def test_a_negative_token_count_never_lowers_a_priced_cost() -> None:
    honest = job_amount(TOKENS, job(tokens_in=1000, tokens_out=1000))
    assert honest.amount == Decimal("0.04")
    lying = job_amount(TOKENS, job(tokens_in=-3000, tokens_out=1000))
    # Before: -0.03 + 0.03 → "no cost" at best, or a cost lowered by the negative count; now: unusable, so
    # the operation is counted at its estimate, with the raw figure in the anomaly.
    assert lying.amount is None
    assert lying.anomaly is not None and "tokens_in -3000 is negative" in lying.anomaly
    assert lying.raw == "-3000"
    partly = job_amount(TOKENS, job(tokens_in=-500, tokens_out=2000))
    assert partly.amount is None  # before: 0.055, silently less than the 0.06 the output tokens cost


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), float("1e400"), -4.0, 1e300])
def test_seconds_that_are_not_a_sane_number_are_an_anomaly_not_an_exception(seconds: float) -> None:
    amount = job_amount(SECONDS, job(seconds=seconds))  # before: InvalidOperation (NaN, inf) or < 0
    assert amount.amount is None
    assert amount.anomaly is not None and "seconds" in amount.anomaly
    assert amount.raw == str(seconds)


def test_sane_seconds_and_tokens_are_priced_and_rounded_up_silently() -> None:
    assert job_amount(SECONDS, job(seconds=2.5)) == VendorAmount(Decimal("0.75"), None, "0.750")
    fine = job_amount(TOKENS, job(tokens_in=1, tokens_out=0))
    assert fine.amount == Decimal("0.000010") and fine.anomaly is None
    tiny = job_amount(SECONDS, job(seconds=0.0000001))
    assert tiny.amount == Decimal("0.000001") and tiny.anomaly is None  # ours: rounded up, never down


def test_the_gate_for_usage_figures() -> None:
    assert usage_problem(0, what="tokens_in") is None
    assert usage_problem(12.5, what="seconds") is None
    for bad in (-1, float("nan"), float("inf"), "abc", True, None, 10**13):
        assert usage_problem(bad, what="x") is not None, bad
    assert priced_amount(Decimal("1.0000001")).amount == Decimal("1.000001")
    assert priced_amount(MAX_AMOUNT * 2).amount is None
    assert priced_amount(Decimal(-1)).amount is None


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": -500, "completion_tokens": 100},
        {"prompt_tokens": float("nan"), "completion_tokens": 100},
        {"prompt_tokens": 100, "completion_tokens": float("inf")},
        {"prompt_tokens": 10**20, "completion_tokens": 1},
        "lots",
    ],
)
def test_chat_usage_the_vendor_got_wrong_is_unusable_never_less(usage: Any) -> None:
    tokens_in, tokens_out, amount = usage_amount(usage, Decimal("0.002"))
    assert amount.amount is None and amount.anomaly is not None
    assert (tokens_in, tokens_out) == (0, 0)


def test_chat_usage_is_priced_through_the_gate() -> None:
    assert usage_amount({"prompt_tokens": 1000, "completion_tokens": 500}, Decimal("0.002")) == (
        1000,
        500,
        VendorAmount(Decimal("0.003"), None, "0.003"),
    )
    assert usage_amount(None, Decimal("0.002"))[2].amount == Decimal(0)  # no usage: no tokens, as before


# ── the settle path, with a recorder that only remembers what was written ────────────────────────────────


class FakeRecorder:
    def __init__(self) -> None:
        self.written: list[tuple[Any, Decimal]] = []

    def append_idempotent(self, task_id: str, event: Any, *, spend: Decimal, **_: Any) -> tuple[Any, bool]:
        first = all(e.dedup_key != event.dedup_key for e, _ in self.written)
        if first:
            self.written.append((event, spend))
        return event, first

    def anomalies(self) -> list[str]:
        return [e.payload["detail"] for e, _ in self.written if e.payload.get("kind") == "cost_anomaly"]


def op(rec: FakeRecorder, task: str, node: str, estimate: str, route: str = "video.r") -> Operation:
    return Operation(
        rec,  # type: ignore[arg-type]
        task_id=task,
        node=node,
        key=f"{task}:{node}:1",
        epoch=1,
        estimate=Decimal(estimate),
        route=route,
    )


def test_an_unusable_figure_is_counted_at_the_estimate_with_the_raw_value() -> None:
    rec = FakeRecorder()
    o = op(rec, "t1", "gen", "1.5")
    cost = asyncio.run(o.settle_cost(job_amount(SECONDS, job(seconds=float("nan")))))
    assert cost == Decimal("1.5")
    (detail,) = rec.anomalies()
    assert "nan" in detail and "counted at the estimate 1.5" in detail


def test_a_reply_whose_usage_cannot_price_it_settles_at_the_estimate() -> None:
    # The usage said -500 prompt tokens; ``cost`` is only the bound from the call's bytes (0.5), not a price.
    reply = ChatReply(
        content="{}",
        tokens_in=0,
        tokens_out=0,
        cost=Decimal("0.5"),
        prompt_hash="h",
        model="m",
        anomaly="vendor prompt_tokens -500 is negative",
        unusable=True,
    )
    rec = FakeRecorder()
    cost = asyncio.run(op(rec, "t1", "chat", "1.25").settle_cost(reply.amount()))
    assert cost == Decimal("1.25")  # the estimate, not the byte bound
    assert rec.anomalies() == ["vendor prompt_tokens -500 is negative: counted at the estimate 1.25"]


def test_a_plan_with_a_tiny_estimate_never_marks_the_vendor_billing_as_off() -> None:
    """Four nodes of one plan at 0.001 each, the vendor billing its normal 0.10 a call (its own price)."""
    rec = FakeRecorder()
    offs = []
    for node in ("a", "b", "c", "d"):
        o = op(rec, "t1", node, "0.001")
        charge = job(cost="0.10")
        cost = asyncio.run(
            o.settle_cost(job_amount(PER_CALL, charge), price_bound=price_bound(PER_CALL, charge))
        )
        assert cost == Decimal("0.10")  # recorded as billed, and flagged against the plan's estimate
        offs.append(o.billing_off)
    assert offs == [False] * 4  # before: True four times (0.10 > 2 × 0.001): the shared breaker opened
    assert sum("above the reserved estimate" in a for a in rec.anomalies()) == 4


def test_billing_far_above_the_routes_own_price_marks_the_call_as_billing_off() -> None:
    """Judged against the route's declared price, never the plan's estimate; the route's breaker counts one
    such call per task and window (tests/ledger/test_route_breakers.py), so every call is marked here."""
    rec = FakeRecorder()

    def settle(task: str, node: str) -> bool:
        o = op(rec, task, node, "50")  # a generous estimate: the plan does not mind, the vendor is off
        charge = job(cost="5.00")
        asyncio.run(o.settle_cost(job_amount(PER_CALL, charge), price_bound=price_bound(PER_CALL, charge)))
        return o.billing_off

    # Before: never counted (5.00 is under twice the estimate); now: against the route's 0.10 a call.
    assert [settle("t1", n) for n in "abcd"] == [True, True, True, True]
    assert settle("t2", "a") is True
    assert any("the route's own price 0.10" in a for a in rec.anomalies())


def test_a_route_without_a_declared_price_is_never_judged_by_an_estimate() -> None:
    unpriced = RouteSpec()
    assert price_bound(unpriced, job(cost="9")) is None
    assert price_bound(SECONDS, job(cost="9")) is None  # priced per second, no seconds reported
    assert price_bound(SECONDS, job(cost="9", seconds=2.0)) == Decimal("0.600")
    assert price_bound(SECONDS, job(cost="9", seconds=float("nan"))) is None
