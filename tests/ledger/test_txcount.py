"""The recorder's own transaction counts (ledger.txcount): what the bench's "writes per paid node" reads."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from ledger import txcount
from ledger.errors import StaleEpoch
from ledger.recorder import Recorder
from rules.envelope import NewEvent
from vendors.routes import RouteSpec, RouteTable, VendorMode


@pytest.fixture
def counted(recorder: Recorder) -> Iterator[tuple[Recorder, txcount.Counter]]:
    counter = txcount.Counter()
    counter.watch(recorder._engine)  # a counter of this test's own, whatever else the process records
    yield recorder, counter


def test_each_kind_of_transaction_is_counted_once(counted: tuple[Recorder, txcount.Counter]) -> None:
    rec, counter = counted
    task = f"tx-{uuid.uuid4().hex[:8]}"
    epoch = rec.take_lease(task, "run-1")
    assert counter.snapshot() == txcount.Counts(writes=1)

    rec.append_fenced(task, epoch, [NewEvent(type="Noted", dedup_key=f"{task}:a", payload={})])
    rec.append_idempotent(task, NewEvent(type="Noted", dedup_key=f"{task}:b", payload={}))
    assert counter.snapshot() == txcount.Counts(writes=3)

    rec.read_events(task)  # one statement on the AUTOCOMMIT reader
    rec.operation_view(task, f"{task}:op")  # two: the epoch and clock, the operation's events
    assert counter.snapshot() == txcount.Counts(writes=3, reads=3)

    with pytest.raises(StaleEpoch):  # its fencing UPDATE ran, matched nothing, and was rolled back
        rec.append_fenced(task, epoch - 1, [NewEvent(type="Noted", dedup_key=f"{task}:c", payload={})])
    assert counter.snapshot() == txcount.Counts(writes=3, reads=3, rollbacks=1)


def test_a_select_for_update_is_not_a_write() -> None:
    from ledger.txcount import _WRITE

    assert _WRITE.search("SELECT task_id FROM task_leases WHERE task_id = %s FOR UPDATE") is None
    assert _WRITE.search("SELECT 1 FOR NO KEY UPDATE OF task_leases SKIP LOCKED") is None
    assert _WRITE.search("WITH r AS (UPDATE task_leases SET next_seq = 2) SELECT 1")
    assert _WRITE.search("insert into events (seq) values (1)")
    assert _WRITE.search("DELETE FROM route_observations WHERE at < now()")


async def test_a_label_follows_the_work_into_the_recorders_threads(
    counted: tuple[Recorder, txcount.Counter],
) -> None:
    rec, counter = counted
    task = f"tx-{uuid.uuid4().hex[:8]}"
    with txcount.labelled("node"):
        await asyncio.to_thread(rec.take_lease, task, "run-1")
    await asyncio.to_thread(rec.read_events, task)
    assert counter.snapshot("node") == txcount.Counts(writes=1)
    assert counter.snapshot("") == txcount.Counts(reads=1)
    assert counter.snapshot() == txcount.Counts(writes=1, reads=1)


PLAN = """
goal: three quick shots
budget_ceiling: 20
review: {{reviewers: [compliance.rules]}}
stages:
  - {{id: shot, executor: {executor}, estimate: 1.5, fan_out: 3, canary: false}}
"""


@pytest.mark.parametrize(
    ("mode", "per_shot"),
    [
        # Where the vendor deduplicates on our key and finds a job by it: the INTENT is the send's
        # write-ahead, and a quick job's id comes with its result.
        (VendorMode.IDEMPOTENT, 2),
        # Where it cannot: a marker of its own before the send, then the result (with the job's id: this
        # vendor answers the submit with the finished job).
        (VendorMode.NONE, 3),
    ],
)
async def test_a_quick_paid_node_writes_the_ledger_this_many_times(
    lf_with: Any, sim: Any, mode: VendorMode, per_shot: int
) -> None:
    name = f"video.{uuid.uuid4().hex[:8]}"
    async with lf_with(routes=RouteTable(routes={name: RouteSpec(mode=mode)})) as lf:
        await sim.configure(executors={name: {"latency_seconds": 0.0}})
        plan = lf.plan(PLAN.format(executor=name))
        before, reviewed = txcount.snapshot("node"), txcount.snapshot("review")
        await lf.run(plan)
        counted, review = txcount.snapshot("node") - before, txcount.snapshot("review") - reviewed
    assert plan.task_id is not None
    shots = [e for e in lf.recorder.read_events(plan.task_id) if ":shot/" in (e.operation_key or "")]
    assert counted.writes == 3 * per_shot, (counted, [(e.type, e.payload.get("kind")) for e in shots])
    assert [e.type for e in shots].count("Outcome") == 3 and len(await sim.charges(f"{plan.task_id}:")) == 3
    # The review: its INTENT, its verdict, and the three outputs' first reviews for their route's breaker
    # in one transaction (not one each).
    assert review.writes == 3, review
