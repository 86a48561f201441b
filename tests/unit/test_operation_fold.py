"""The fold of one operation's events (rules.operation): sends, refusals, its job, result, late charges."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

from helpers import History, chain_plan

from rules.actions import Dispatch, StaticGate
from rules.events import FailureKind, MarkerKind, Progress, SystemMarker
from rules.keys import anomaly_key, late_charge_key, progress_key, refused_key, result_key, submitting_key
from rules.operation import SEND_AHEAD, OperationRecord, fold_operation, fold_operations

OP = "t1:a:a1"


def dispatched(route: str | None = None) -> History:
    """Node a dispatched (its INTENT reserving 1.00); a routed INTENT names the route its executor chose."""
    action = Dispatch(node="a", attempt=1, operation_key=OP, executor="llm.text", estimate=Decimal("1.00"))
    return History(chain_plan()).intent(action, extra={"route": route} if route else None)


def send(h: History, n: int, timeout_s: float = 2.0) -> History:
    marker = SystemMarker(kind=MarkerKind.SUBMITTING, node="a", operation_key=OP, send=n, timeout_s=timeout_s)
    return h.append(marker, dedup_key=submitting_key(OP, n), operation_key=OP)


def refuse(h: History, n: int, status: int | None = 429) -> History:
    marker = SystemMarker(
        kind=MarkerKind.REFUSED, node="a", operation_key=OP, send=n, detail="refused", status=status
    )
    return h.append(marker, dedup_key=refused_key(OP, n), operation_key=OP)


def progress(h: History, job: str) -> History:
    event = Progress(node="a", operation_key=OP, job_id=job, progress=0.5)
    return h.append(event, dedup_key=progress_key(OP, job), operation_key=OP)


def void(h: History) -> History:
    marker = SystemMarker(kind=MarkerKind.VOID, node="a", operation_key=OP, detail="provably not sent")
    return h.append(marker, dedup_key=result_key(OP), operation_key=OP)


def late_charge(h: History, job: str, amount: str) -> History:
    marker = SystemMarker(
        kind=MarkerKind.LATE_CHARGE, node="a", operation_key=OP, amount=Decimal(amount), detail=f"job {job}"
    )
    h.append(marker, dedup_key=late_charge_key(OP, job), operation_key=OP)
    anomaly = SystemMarker(kind=MarkerKind.COST_ANOMALY, node="a", operation_key=OP, detail="late job")
    return h.append(anomaly, dedup_key=anomaly_key(OP, f"late:{job}"), operation_key=OP)


def fold_of(h: History) -> OperationRecord:
    return fold_operation(e for e in h.events if e.operation_key == OP)


def test_an_intent_alone_names_what_the_operation_is_for_and_nothing_is_sent() -> None:
    op = fold_of(dispatched(route="llm.fallback"))
    assert (op.key, op.kind, op.node, op.executor) == (OP, "Dispatch", "a", "llm.text")
    assert op.route == "llm.fallback" and op.reservation == Decimal("1.00") and op.dispatched
    assert op.sends == () and op.maybe_sent == () and op.next_send == 1
    assert not op.resolved and op.cost == op.recorded == 0 and op.provable_at(5.0) is None


def test_sends_are_numbered_timed_and_a_refused_one_is_no_longer_maybe_sent() -> None:
    h = send(dispatched(), 1, timeout_s=2.0)
    first = h.events[-1].recorded_at
    refuse(h, 1)
    send(h, 2, timeout_s=3.0)
    second = h.events[-1].recorded_at
    op = fold_of(h)
    assert [(s.n, s.at, s.timeout_s) for s in op.sends] == [(1, first, 2.0), (2, second, 3.0)]
    assert op.refused == {1} and [s.n for s in op.maybe_sent] == [2] and op.next_send == 3
    # No maybe-sent request can land once its timeout and the route's acceptance window have passed.
    assert op.provable_at(5.0) == second + timedelta(seconds=3.0 + 5.0)


def test_an_intent_written_ahead_of_send_1_reads_as_send_1_from_its_own_time() -> None:
    action = Dispatch(node="a", attempt=1, operation_key=OP, executor="llm.text", estimate=Decimal("1.00"))
    h = History(chain_plan()).intent(action, extra={SEND_AHEAD: 12.0})
    at = h.events[-1].recorded_at
    op = fold_of(h)
    assert [(s.n, s.at, s.timeout_s) for s in op.sends] == [(1, at, 12.0)] and op.next_send == 2
    assert op.provable_at(5.0) == at + timedelta(seconds=12.0 + 5.0)
    # Refused, it is no longer maybe sent; a later send is numbered after it.
    op = fold_of(send(refuse(h, 1), 2))
    assert [s.n for s in op.maybe_sent] == [2] and op.refused == {1}


def test_every_send_refused_leaves_nothing_maybe_sent() -> None:
    op = fold_of(refuse(send(dispatched(), 1), 1))
    assert op.sends and op.maybe_sent == () and op.provable_at(5.0) is None


def test_the_latest_job_on_record_is_the_one_the_operation_is_at() -> None:
    op = fold_of(progress(progress(send(dispatched(), 1), "job-1"), "job-2"))
    assert op.job_id == "job-2" and op.job_ids == ("job-1", "job-2")


def test_the_result_is_the_first_under_the_result_key_with_its_cost_and_job() -> None:
    h = progress(send(dispatched(), 1), "job-1").outcome("a", op_key=OP, cost="0.73")
    op = fold_of(h)
    assert op.resolved and not op.voided and op.result is not None and op.result.type == "Outcome"
    assert op.cost == op.recorded == Decimal("0.73")
    assert op.job_ids == ("job-1", f"job-{OP}")  # the result names its job too


def test_a_paid_failure_counts_its_cost() -> None:
    op = fold_of(dispatched().failure("a", FailureKind.STALLED, op_key=OP, cost="0.40"))
    assert op.resolved and op.cost == Decimal("0.40") and op.anomalies == ()


def test_a_late_charge_after_a_void_is_what_the_operation_counts_as_paid() -> None:
    op = fold_of(late_charge(void(send(dispatched(), 1)), "job-late", "0.25"))
    assert op.voided and op.cost == 0
    assert [(c.job_id, c.amount) for c in op.late_charges] == [("job-late", Decimal("0.25"))]
    assert op.recorded == Decimal("0.25") and op.job_ids == ("job-late",)
    assert op.anomalies == ("late job",)
    assert [s.n for s in op.maybe_sent] == [1]  # the void stands: it was looked for and not found


def test_a_task_s_events_fold_into_each_operation_and_only_dispatches_are_vendor_operations() -> None:
    h = send(dispatched(), 1)
    gate = StaticGate(node="b", operation_key="t1:b:gate0", input_version=0)
    h.intent(gate)
    ops = fold_operations(h.events)
    assert list(ops) == [OP, "t1:b:gate0"]  # the TaskCreated event belongs to no operation
    assert ops[OP].dispatched and ops[OP].sends and not ops["t1:b:gate0"].dispatched


def test_a_send_refused_with_a_5xx_or_no_known_status_is_still_looked_up_when_voided() -> None:
    """A 5xx is a refusal only where the route declares it, and refusals recorded before statuses were kept
    may have been 503s: the sweep looks such a voided operation up (its status is read, never its text)."""
    h = refuse(refuse(refuse(send(send(send(dispatched(), 1), 2), 3), 1, 429), 2, 503), 3, None)
    op = fold_of(void(h))
    assert op.refused == {1, 2, 3} and op.refused_5xx == {2, 3} and not op.maybe_sent
    only_429 = fold_of(void(refuse(send(dispatched(), 1), 1, 429)))
    assert only_429.refused_5xx == frozenset()
