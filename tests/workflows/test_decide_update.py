"""Issue 26 §1: people's decisions as a Temporal Update — answered at once, refused early, ruled on as today.

Real Temporal, Postgres and worker. A decision sent as the ``decide`` Update joins the same inbox the signal
feeds (ruled on in the same batches by ``people.record_batch``, with the time it arrived), and its sender gets
the ruling as the Update's result: accepted, already resolved (by whom), or refused and why. The validator
refuses what is malformed or names no open request before anything enters the history or the ledger. When no
worker accepts the Update in time, the CLI and the page send the same decision as the signal, which Temporal
keeps (and times) until a worker runs.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from peoplekit import wait_open
from temporalio.client import WorkflowUpdateFailedError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.worker import Replayer

from ledgerflow.views import people
from rules.events import MarkerKind, SystemMarker, parse
from rules.projection import fold
from runtime.signing import demo_key
from workflows.contracts import DECIDE, DECISION_REFUSED, DecisionRuling, workflow_id
from workflows.task import TaskWorkflow

APPROVAL = """
goal: a storyboard two people may approve
budget_ceiling: 10
approval: {timeout: 1h, policy: escalate, approvers: [director, producer]}
stages:
  - {id: board, executor: llm.text, estimate: 1, approval: true}
  - {id: shots, executor: image.keyframe, estimate: 1, depends_on: [board]}
"""


def sign(task_id: str, request_id: str, decision: str, approver: str = "director", **kw: Any) -> dict:
    return people.signed_payload(demo_key(approver), task_id, request_id, decision, **kw)


def history_events(history: Any, field: str) -> list[Any]:
    return [e for e in history.events if e.HasField(field)]


async def started(lf: Any) -> tuple[str, str, Any]:
    plan = lf.plan(APPROVAL)
    assert plan.task_id is not None
    handle = await lf.start(plan)
    rid = await wait_open(lf, plan.task_id, "approval:")
    return plan.task_id, rid, handle


async def test_a_decision_sent_as_an_update_is_answered_with_its_ruling_and_acted_on(lf, sim):
    """The sender learns "accepted (approve by director)" from the Update itself — no signal, no polling of
    the ledger — and the task goes on as for a signalled decision."""
    task_id, rid, handle = await started(lf)
    payload = sign(task_id, rid, "approve")
    asked = time.monotonic()
    told = await handle.execute_update(DECIDE, payload, result_type=DecisionRuling)
    took = time.monotonic() - asked
    assert (told.decision_id, told.status, told.detail) == (
        payload["decision_id"],
        "accepted",
        "approve by director",
    )
    result = await handle.result()
    assert result.state == "Completed", result.summary
    history = await handle.fetch_history()
    assert history_events(history, "workflow_execution_update_completed_event_attributes")
    assert not history_events(history, "workflow_execution_signaled_event_attributes"), "no signal was sent"
    decisions = [parse(e) for e in lf.recorder.read_events(task_id) if e.type == "HumanDecision"]
    assert [(d.decision_id, d.approver) for d in decisions] == [(payload["decision_id"], "director")]
    print(f"update ruling round trip: {took * 1000:.0f} ms")
    # The history with the Update replays on today's code.
    replayer = Replayer(workflows=[TaskWorkflow], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(history)


async def test_the_validator_refuses_a_malformed_decision_and_one_for_no_open_request_leaving_no_trace(
    lf, sim
):
    task_id, rid, handle = await started(lf)
    before = len(lf.recorder.read_events(task_id))
    refusals = {
        "malformed": (["approve"], "malformed decision: expected a JSON object"),
        "unsigned": ({**sign(task_id, rid, "approve"), "signature": ""}, "unsigned decision"),
        "no such request": (sign(task_id, "approval:nothing", "approve"), "no request 'approval:nothing'"),
    }
    for what, (payload, reason) in refusals.items():
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update(DECIDE, payload, result_type=DecisionRuling)
        cause = refused.value.cause
        assert isinstance(cause, ApplicationError) and cause.type == DECISION_REFUSED, (what, cause)
        assert reason in cause.message, (what, cause.message)
    # Nothing of them entered the ledger or the history: refused before either.
    assert len(lf.recorder.read_events(task_id)) == before
    history = await handle.fetch_history()
    assert not history_events(history, "workflow_execution_update_accepted_event_attributes")
    # The request is still open, and a good decision still goes through.
    told = await handle.execute_update(DECIDE, sign(task_id, rid, "approve"), result_type=DecisionRuling)
    assert told.status == "accepted"


async def test_a_forged_decision_passes_the_validator_and_is_refused_on_record_with_its_reason(lf, sim):
    """The validator cannot check a signature (the key registry is in the database): a well-formed forgery is
    ruled on by the activity, recorded as refused, and its sender told why."""
    task_id, rid, handle = await started(lf)
    forged = {**sign(task_id, rid, "approve"), "signature": "0" * 128}
    told = await handle.execute_update(DECIDE, forged, result_type=DecisionRuling)
    assert told.status == "rejected" and "signature" in told.detail, told
    refused = [
        m
        for e in lf.recorder.read_events(task_id)
        if isinstance(m := parse(e), SystemMarker) and m.kind == MarkerKind.REJECTED_INPUT
    ]
    assert [m.detail.partition(": ")[0] for m in refused] == [forged["decision_id"]]
    assert fold(lf.recorder.read_events(task_id)).requests[rid].open, "the forgery decided nothing"


async def test_two_people_deciding_one_request_at_once_one_wins_and_the_other_is_told_by_whom(lf, sim):
    # The shots run a while after the approval: the task is still there to rule on the second decision (an
    # abort winning, or a task done, would leave the loser nothing to be told by: the workflow is gone).
    await sim.configure(executors={"image.keyframe": {"latency_seconds": 2.0}})
    task_id, rid, handle = await started(lf)
    mine, theirs = sign(task_id, rid, "approve", "director"), sign(task_id, rid, "approve", "producer")
    a, b = await asyncio.gather(
        handle.execute_update(DECIDE, mine, result_type=DecisionRuling),
        handle.execute_update(DECIDE, theirs, result_type=DecisionRuling),
        return_exceptions=True,
    )
    rulings = [r for r in (a, b) if isinstance(r, DecisionRuling)]
    refused = [r for r in (a, b) if isinstance(r, WorkflowUpdateFailedError)]
    statuses = sorted(r.status for r in rulings)
    # The winner is accepted; the loser is told who won — by the activity (same batch) or, if the first was
    # recorded before the second arrived, by the validator (nothing of it recorded).
    assert statuses in (["accepted", "already resolved"], ["accepted"]), (a, b)
    [won] = [r for r in rulings if r.status == "accepted"]
    winner = "director" if won.decision_id == mine["decision_id"] else "producer"
    told = [r.detail for r in rulings if r.status == "already resolved"] + [str(e.cause) for e in refused]
    assert len(told) == 1 and f"by {winner}" in told[0], told
    decisions = [parse(e) for e in lf.recorder.read_events(task_id) if e.type == "HumanDecision"]
    assert [d.approver for d in decisions] == [winner], "one resolution"


async def test_the_cli_path_sends_an_update_and_the_same_decision_again_is_answered_as_it_stood(lf, sim):
    """``people.relay`` (``ledgerflow decide`` and the reviewer page): an Update, answered at once; sending
    the very same signed decision again is told it was accepted, and records nothing more."""
    task_id, rid, handle = await started(lf)
    payload = sign(task_id, rid, "approve")
    first = await people.relay(lf.settings, task_id, payload, timeout=10)
    assert (first.status, first.detail) == ("accepted", "approve by director")
    again = await handle.execute_update(DECIDE, payload, result_type=DecisionRuling)
    assert (again.status, again.detail) == ("accepted", "approve by director")
    decisions = [e for e in lf.recorder.read_events(task_id) if e.type == "HumanDecision"]
    assert len(decisions) == 1
    history = await handle.fetch_history()
    assert not history_events(history, "workflow_execution_signaled_event_attributes")


async def test_with_no_worker_to_accept_the_update_the_decision_goes_as_the_signal_and_is_ruled_later(
    lf_with, sim, monkeypatch
):
    """Every worker is down: the Update cannot be accepted, so the same decision is sent as the signal, which
    Temporal keeps; the sender is told it is pending; once a worker runs, it is ruled on and acted on."""
    monkeypatch.setattr(people, "ACCEPT_SECONDS", 1.0)
    async with lf_with() as lf:
        task_id, rid, handle = await started(lf)
        queue = lf.task_queue
    # The worker is gone (its context ended): nobody accepts the Update.
    payload = sign(task_id, rid, "approve")
    told = await people.relay(lf.settings, task_id, payload, timeout=2.5)
    assert told.status == "pending", told
    history = await handle.fetch_history()
    assert history_events(history, "workflow_execution_signaled_event_attributes"), "the signal carried it"
    async with lf_with(task_queue=queue) as again:
        result = await again.client.get_workflow_handle(workflow_id(task_id)).result()
    assert result["state"] == "Completed", result["summary"]
    decisions = [parse(e) for e in lf.recorder.read_events(task_id) if e.type == "HumanDecision"]
    assert [d.decision_id for d in decisions] == [payload["decision_id"]], "ruled on once"
