"""An INTENT that is its operation's first send's write-ahead (``send_ahead_s``): only the attempt that wrote
it knows nothing has left under it, and only until it sends.

Real Postgres; the Operation runs in Temporal's ActivityEnvironment, as an executor runs it. The attack the
third test closes: an attempt that sent under the claim and then opens the operation again (a cancellation's
close, ``StageActivities._abandon``) must read send 1 as maybe sent — reading "nothing sent" there voided an
operation whose request may still have been landing at the vendor.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from temporalio.testing import ActivityEnvironment

from activities.operation import _FRESH_INTENT, Operation
from ledger.recorder import Recorder
from rules.actions import Dispatch
from rules.events import Intent, MarkerKind, to_new
from rules.keys import intent_key, operation_key
from rules.operation import SEND_AHEAD

ESTIMATE = Decimal("0.40")


@pytest.fixture
async def claimed(recorder: Recorder) -> tuple[str, str, int]:
    """A task whose one Dispatch INTENT stands for its first send's write-ahead (a 12 s window)."""
    task_id = f"wa-{uuid.uuid4().hex[:10]}"
    epoch = await asyncio.to_thread(recorder.take_lease, task_id, "run-1")
    await asyncio.to_thread(recorder.open_budget, task_id, [(f"task:{task_id}", Decimal(10))])
    op = operation_key(task_id, "shot", 1)
    dispatch = Dispatch(node="shot", attempt=1, operation_key=op, executor="video.motion", estimate=ESTIMATE)
    intent = Intent(
        action=dispatch, rule="R11", watermark=1, decided_at=datetime.now(UTC), reservation=ESTIMATE
    )
    new = to_new(intent, dedup_key=intent_key(task_id, 1, 1), operation_key=op)
    new = new.model_copy(update={"payload": {**new.payload, SEND_AHEAD: 12.0}})
    await asyncio.to_thread(recorder.append_fenced, task_id, epoch, [new], reserve=ESTIMATE)
    return task_id, op, epoch


async def as_attempt(body: Callable[[], Awaitable[Any]], *, wrote_intent: str | None) -> Any:
    """``body`` as an executor attempt runs it; ``wrote_intent``: the OperationKey whose INTENT this attempt
    wrote itself (``activities.operation.routed`` says so the same way)."""

    async def run() -> Any:
        token = _FRESH_INTENT.set(wrote_intent)
        try:
            return await body()
        finally:
            _FRESH_INTENT.reset(token)

    return await ActivityEnvironment().run(run)


def markers(recorder: Recorder, task_id: str) -> list[Any]:
    return [e.payload.get("kind") for e in recorder.read_events(task_id) if e.type == "SystemMarker"]


async def test_anyone_but_the_attempt_that_wrote_it_reads_send_1_as_maybe_sent(
    recorder: Recorder, claimed: tuple[str, str, int]
) -> None:
    task_id, op, epoch = claimed

    async def body() -> Any:
        return await Operation(
            recorder, task_id=task_id, node="shot", key=op, epoch=epoch, estimate=ESTIMATE
        ).open()

    state = await as_attempt(body, wrote_intent=None)  # a retry, a takeover, a close
    assert [s.n for s in state.maybe_sent] == [1] and state.sends[0].timeout_s == 12.0


async def test_the_attempt_that_wrote_it_sends_under_it_without_a_marker(
    recorder: Recorder, claimed: tuple[str, str, int]
) -> None:
    task_id, op, epoch = claimed

    async def body() -> tuple[Any, Any, int]:
        o = Operation(recorder, task_id=task_id, node="shot", key=op, epoch=epoch, estimate=ESTIMATE)
        first = await o.open()
        again = await o.open()  # unused so far: still nothing sent, as this attempt knows
        return first, again, await o.sending(first, 1.0)

    first, again, n = await as_attempt(body, wrote_intent=op)
    assert first.sends == () and again.sends == () and first.next_send == 1
    assert n == 1 and MarkerKind.SUBMITTING not in markers(recorder, task_id)


async def test_once_it_sent_under_the_claim_the_attempt_itself_reads_maybe_sent(
    recorder: Recorder, claimed: tuple[str, str, int]
) -> None:
    task_id, op, epoch = claimed

    async def body() -> Any:
        o = Operation(recorder, task_id=task_id, node="shot", key=op, epoch=epoch, estimate=ESTIMATE)
        await o.sending(await o.open(), 1.0)
        return await o.open(fenced=False)  # what a cancellation's close (``_stop``) reads next

    after = await as_attempt(body, wrote_intent=op)
    assert [s.n for s in after.maybe_sent] == [1], "the close would void a request that may still land"


async def test_a_send_that_no_longer_fits_the_window_writes_its_own_marker(
    recorder: Recorder, claimed: tuple[str, str, int]
) -> None:
    task_id, op, epoch = claimed

    async def body() -> tuple[int, Any]:
        o = Operation(recorder, task_id=task_id, node="shot", key=op, epoch=epoch, estimate=ESTIMATE)
        state = await o.open()
        n = await o.sending(state, 30.0)  # a request timeout longer than the INTENT's 12 s window
        return n, await o.open(fenced=False)

    n, after = await as_attempt(body, wrote_intent=op)
    assert n == 1 and markers(recorder, task_id) == [MarkerKind.SUBMITTING]
    # The claim was never used: this attempt's view holds the marker's send alone.
    assert len(after.maybe_sent) == 1 and after.maybe_sent[0].timeout_s == 30.0
