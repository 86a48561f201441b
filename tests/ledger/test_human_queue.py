"""The shared queue of open human requests (``human_queue``) is kept by the writes that open and close them,
and a dispatch's INTENT reads its project's count in its own fencing statement (rules.pressure)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal

import sqlalchemy as sa

from ledger.recorder import Recorder
from rules.actions import Dispatch, Escalate, HumanDecisionType, HumanRequest, RequestKind, SuspendForHuman
from rules.envelope import NewEvent
from rules.events import HumanDecision, Intent, MarkerKind, SystemMarker, TaskCreated, effect_of, to_new
from rules.plan import load_plan
from vendors.routes import DEFAULT_ROUTES

NOW = datetime(2026, 12, 1, tzinfo=UTC)


def task(recorder: Recorder, project: str) -> tuple[str, int]:
    tid = f"hq-{uuid.uuid4().hex[:10]}"
    epoch = recorder.take_lease(tid, "test")
    recorder.open_budget(tid, [(f"project:{project}", None), (f"task:{tid}", Decimal(100))])
    return tid, epoch


def intent(tid: str, n: int, action) -> NewEvent:
    key = action.operation_key if isinstance(action, Dispatch) else None
    event = Intent(action=action, rule="R9", watermark=n, decided_at=NOW)
    return to_new(event, dedup_key=f"{tid}:intent:{n}", operation_key=key)


def ask(tid: str, n: int, rid: str) -> NewEvent:
    request = HumanRequest(
        id=rid, kind=RequestKind.APPROVAL, reason="approve", options=(HumanDecisionType.APPROVE,)
    )
    return intent(tid, n, SuspendForHuman(request=request))


def dispatch(tid: str, n: int) -> NewEvent:
    op = f"{tid}:shots/S{n:02d}:a1"
    return intent(
        tid,
        n,
        Dispatch(node=f"shots/S{n:02d}", attempt=1, operation_key=op, executor="motion", estimate=Decimal(1)),
    )


def test_requests_enter_the_queue_with_their_intent_and_leave_with_a_decision_or_a_timeout(
    recorder: Recorder,
) -> None:
    project = f"p-{uuid.uuid4().hex[:8]}"
    tid, epoch = task(recorder, project)
    recorder.append_fenced(tid, epoch, [ask(tid, 1, "approval:a:v1"), ask(tid, 2, "approval:b:v1")])
    assert recorder.open_requests_by_project()[f"project:{project}"] == 2

    decided = HumanDecision(request_id="approval:a:v1", decision=HumanDecisionType.APPROVE, approver="d")
    recorder.append_idempotent(tid, to_new(decided, dedup_key=f"{tid}:resolution:a"))
    assert recorder.open_requests_by_project()[f"project:{project}"] == 1
    # A repeat of the decision writes nothing, and changes nothing.
    _, inserted = recorder.append_idempotent(tid, to_new(decided, dedup_key=f"{tid}:resolution:a"))
    assert not inserted and recorder.open_requests_by_project()[f"project:{project}"] == 1
    timeout = SystemMarker(kind=MarkerKind.TIMEOUT, request_id="approval:b:v1")
    recorder.append_idempotent(tid, to_new(timeout, dedup_key=f"{tid}:resolution:b"))
    assert f"project:{project}" not in recorder.open_requests_by_project()


def test_a_task_that_ends_takes_its_open_requests_out_of_the_queue(recorder: Recorder) -> None:
    project = f"p-{uuid.uuid4().hex[:8]}"
    tid, epoch = task(recorder, project)
    recorder.append_fenced(tid, epoch, [ask(tid, 1, "approval:a:v1"), ask(tid, 2, "dead_letter:b:a1")])
    recorder.append_fenced(tid, epoch, [intent(tid, 3, Escalate(reason="aborted by d", terminal=True))])
    assert f"project:{project}" not in recorder.open_requests_by_project()


def test_a_dispatchs_intent_records_its_projects_load_read_in_the_same_append(recorder: Recorder) -> None:
    project, other = f"p-{uuid.uuid4().hex[:8]}", f"p-{uuid.uuid4().hex[:8]}"
    asking, epoch = task(recorder, project)
    recorder.append_fenced(asking, epoch, [ask(asking, n, f"approval:n{n}:v1") for n in range(1, 4)])
    elsewhere, e2 = task(recorder, other)
    recorder.append_fenced(elsewhere, e2, [ask(elsewhere, 1, "approval:x:v1")])

    tid, epoch = task(recorder, project)
    (row,) = recorder.append_fenced(tid, epoch, [dispatch(tid, 1)], reserve=Decimal(1), human_capacity=2)
    assert row.payload["pressure"] == {"load": 3, "capacity": 2}  # its project's three, not the other's
    (plain,) = recorder.append_fenced(tid, epoch, [dispatch(tid, 2)], reserve=Decimal(1))
    assert "pressure" not in plain.payload  # backpressure off: nothing read, nothing recorded


def test_sync_rebuilds_a_tasks_rows_from_its_ledger_under_its_lease_lock(
    recorder: Recorder, pg_url: str
) -> None:
    project = f"p-{uuid.uuid4().hex[:8]}"
    tid, epoch = task(recorder, project)
    plan = load_plan(
        "goal: g\nbudget_ceiling: 5\nstages:\n  - {id: a, executor: llm.text, estimate: 1}\n", DEFAULT_ROUTES
    )
    recorder.append_fenced(tid, epoch, [to_new(TaskCreated(plan=plan), dedup_key=f"{tid}:created")])
    recorder.append_fenced(tid, epoch, [ask(tid, 1, "approval:a:v1"), ask(tid, 2, "approval:b:v1")])
    # As a database upgraded to 0004 with these requests already open would be, plus a row nothing explains.
    engine = sa.create_engine(pg_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM human_queue WHERE task_id = :t"), {"t": tid})
            conn.execute(
                sa.text(
                    "INSERT INTO human_queue (task_id, request_id, kind, scope)"
                    " VALUES (:t, 'x', 'approval', :s)"
                ),
                {"t": tid, "s": f"project:{project}"},
            )
    finally:
        engine.dispose()
    assert recorder.sync_human_queue(tid) == 3  # two missing rows written, one stale row deleted
    assert recorder.open_requests_by_project()[f"project:{project}"] == 2
    assert recorder.sync_human_queue(tid) == 0  # already what the ledger says

    aborted = Escalate(reason="aborted by d", terminal=True)
    effect = effect_of(aborted)
    assert effect is not None
    recorder.append_fenced(
        tid, epoch, [intent(tid, 3, aborted), to_new(effect[1], dedup_key=f"{tid}:effect:3")]
    )
    assert recorder.sync_human_queue(tid) == 0
    assert f"project:{project}" not in recorder.open_requests_by_project()
