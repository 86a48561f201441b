"""Issue 24 §7: ``operation.close`` is fenced. A run that lost its task (a newer run took the next epoch: a
takeover, a reset) may still have a close on its way — the executor that gave up, or the task's end. Its close
must neither write the operation's result nor touch the vendor's job: the newer run adopted the operation and
reconciles it itself. The run that holds the task still closes its operations, after its task ended too.

Real Postgres, the real simulator; the activity runs in Temporal's ActivityEnvironment as a worker runs it
(the workflow's run id is what the lease names as its holder).
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.closing import ClosingActivities
from activities.contracts import CloseInput, ErrorType
from artifacts.local import LocalStore
from ledger.errors import StaleEpoch
from ledger.recorder import Recorder
from rules.actions import Dispatch
from rules.envelope import StoredEvent
from rules.events import Intent, TaskCreated, to_new
from rules.keys import created_key, intent_key, operation_key
from rules.plan import validate_plan
from vendors.registry import Adapters
from vendors.routes import RouteSpec, RouteTable, with_simulator_cdn

SIM_KEY = "sk-test-4f1c9e"
ESTIMATE = Decimal("0.40")
OLD_RUN, NEW_RUN = "run-that-lost-the-task", "run-that-took-it-over"


@dataclass
class Task:
    """A task whose one Dispatch INTENT is recorded by ``OLD_RUN`` (epoch ``old``) and not yet resolved."""

    recorder: Recorder
    closing: ClosingActivities
    task_id: str
    executor: str
    old: int

    def close_input(self, epoch: int = 0, gave_up: str | None = None) -> CloseInput:
        return CloseInput(
            task_id=self.task_id,
            node="shot",
            operation_key=operation_key(self.task_id, "shot", 1),
            executor=self.executor,
            estimate=ESTIMATE,
            epoch=epoch,
            gave_up=gave_up,
        )

    async def close(self, inp: CloseInput, run_id: str) -> StoredEvent:
        """``operation.close`` as a worker runs it for the workflow run ``run_id``."""
        env = ActivityEnvironment()
        env.info = dataclasses.replace(env.info, activity_type="operation.close", workflow_run_id=run_id)
        result: StoredEvent = await env.run(self.closing.close, inp)
        return result

    def events(self) -> list[StoredEvent]:
        return self.recorder.read_events(self.task_id)


@pytest.fixture
async def task(recorder: Recorder, simulator_url: str, tmp_path: Path) -> AsyncIterator[Task]:
    suffix = uuid.uuid4().hex[:12]
    executor = f"fence-{suffix}"
    table = with_simulator_cdn(RouteTable(routes={executor: RouteSpec()}), simulator_url)
    store = LocalStore(tmp_path / "artifacts")
    async with httpx.AsyncClient() as client:
        adapters = Adapters(
            table,
            vendor_url=simulator_url,
            credential=lambda _: SIM_KEY,
            client=client,
            store_for=lambda _: store,
        )
        try:
            plan = validate_plan(
                {
                    "goal": "close fencing",
                    "budget_ceiling": "10",
                    "stages": [{"id": "shot", "executor": executor, "estimate": str(ESTIMATE)}],
                },
                table.names(),
                task_id=f"t-{suffix}",
            )
            task_id = f"t-{suffix}"
            old = await asyncio.to_thread(recorder.take_lease, task_id, OLD_RUN)
            await asyncio.to_thread(recorder.open_budget, task_id, [(f"task:{task_id}", Decimal(10))])
            op = operation_key(task_id, "shot", 1)
            dispatch = Dispatch(
                node="shot", attempt=1, operation_key=op, executor=executor, estimate=ESTIMATE
            )
            intent = Intent(
                action=dispatch, rule="R11", watermark=1, decided_at=datetime.now(UTC), reservation=ESTIMATE
            )
            events = [
                to_new(TaskCreated(plan=plan), dedup_key=created_key(task_id)),
                to_new(intent, dedup_key=intent_key(task_id, 1, 1), operation_key=op),
            ]
            await asyncio.to_thread(recorder.append_fenced, task_id, old, events, reserve=ESTIMATE)
            closing = ClosingActivities(recorder, adapters, store, pause_retry_s=0.5)
            yield Task(recorder, closing, task_id, executor, old)
        finally:
            await adapters.aclose()


async def test_a_close_under_a_stale_epoch_is_refused_and_writes_nothing(task: Task) -> None:
    """The old run's executor gave up (its close carries the run's epoch) after a newer run took the task."""
    before = task.events()
    await asyncio.to_thread(task.recorder.take_lease, task.task_id, NEW_RUN)
    with pytest.raises(ApplicationError) as refused:
        await task.close(task.close_input(epoch=task.old, gave_up="a bug"), OLD_RUN)
    assert refused.value.type == ErrorType.STALE_EPOCH and refused.value.non_retryable
    assert task.events() == before  # no result, no anomaly, no marker: the newer run's to decide


async def test_a_task_end_close_from_a_run_that_lost_the_lease_is_refused_and_writes_nothing(
    task: Task,
) -> None:
    """The old run's end closes its open operations (the workflow sends no epoch: the run is the lease's
    holder or it is not) after a newer run took the task."""
    before = task.events()
    await asyncio.to_thread(task.recorder.take_lease, task.task_id, NEW_RUN)
    with pytest.raises(ApplicationError) as refused:
        await task.close(task.close_input(), OLD_RUN)
    assert refused.value.type == ErrorType.STALE_EPOCH and refused.value.non_retryable
    assert task.events() == before


async def test_the_run_holding_the_task_still_closes_its_operation_when_the_task_ends(task: Task) -> None:
    """What closing exists for: nothing was sent, so the task's end voids the operation, under the fence."""
    closed = await task.close(task.close_input(), OLD_RUN)
    assert (closed.type, closed.payload["kind"]) == ("SystemMarker", "void")
    assert closed.epoch == task.old
    again = await task.close(task.close_input(epoch=task.old), OLD_RUN)  # a retry returns the one result
    assert again.seq == closed.seq


async def test_a_close_that_loses_the_task_between_its_check_and_its_write_writes_nothing(task: Task) -> None:
    """The fence is in the write itself, not only in the check before the vendor is asked: a newer run that
    takes the task after the close read its epoch still finds nothing written."""
    before = task.events()
    op = task.closing._operation(task.close_input(epoch=task.old), None, epoch=task.old)

    async def race() -> None:
        await op.open(fenced=False)
        await asyncio.to_thread(task.recorder.take_lease, task.task_id, NEW_RUN)
        op.check_fence()  # it read the old epoch: the check alone would let it through
        await op.void("the task ended")

    with pytest.raises(StaleEpoch):
        await ActivityEnvironment().run(race)
    assert task.events() == before
