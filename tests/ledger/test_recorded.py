"""An executor writing its INTENT (activities.operation.recorded) on the real ledger."""

from __future__ import annotations

import uuid
from decimal import Decimal

from activities.contracts import StageInput
from activities.operation import recorded
from ledger.recorder import Recorder
from rules.envelope import NewEvent, StoredEvent


def intent_of(task: str) -> NewEvent:
    return NewEvent(type="Intent", dedup_key=f"{task}:intent:1:1", operation_key=f"{task}:n:a1", payload={})


async def test_a_retry_whose_intent_is_written_runs_on_even_if_the_budget_is_now_short(
    recorder: Recorder,
) -> None:
    # Attempt 1 wrote the INTENT (reserving 1.00 of the project's 1.50) and died. Meanwhile another task
    # took the rest of the project's money. Attempt 2's write must find its own INTENT (the duplicate is found
    # before the reservation is tried), not report BudgetRefused: that would make the loop escalate and forget
    # an operation that may already be at the vendor.
    project = f"project:p{uuid.uuid4().hex[:8]}"
    task, other = (f"t-{uuid.uuid4().hex[:10]}" for _ in range(2))
    epoch = recorder.take_lease(task, "run-a")
    recorder.open_budget(task, [(project, Decimal("1.50")), (f"task:{task}", None)])
    recorder.append_fenced(task, epoch, [intent_of(task)], reserve=Decimal("1.00"))
    other_epoch = recorder.take_lease(other, "run-b")
    recorder.open_budget(other, [(project, Decimal("1.50")), (f"task:{other}", None)])
    recorder.append_fenced(other, other_epoch, [intent_of(other)], reserve=Decimal("0.50"))

    ran: list[bool] = []

    async def body() -> StoredEvent:
        ran.append(True)
        [row] = recorder.read_events(task, after_seq=0)
        return row

    inp = StageInput(
        task_id=task,
        node="n",
        operation_key=f"{task}:n:a1",
        attempt=1,
        epoch=epoch,
        executor="llm.text",
        estimate=Decimal("1.00"),
        intent=intent_of(task),
    )
    rows = await recorded(recorder, inp, body)
    assert ran == [True]
    assert isinstance(rows, list) and [r.dedup_key for r in rows] == [f"{task}:intent:1:1"]
    account = recorder.account(project)
    assert account is not None and account.reserved == Decimal("1.50")  # reserved once, not twice
