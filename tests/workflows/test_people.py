"""People in the loop on real servers (docs/design.md#people): signed decisions arrive through the ``decide``
signal, are ruled on by the ``people.record_batch`` local activity, and only a recorded decision is acted on.

Keys: the ``lf`` worker's settings hold ``tests/conftest.py``'s APPROVER_KEYS; the tests sign with them
through ``ledgerflow.views.people.signed_payload`` (the CLI's own signing).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from peoplekit import cli, signal, wait_open
from temporalio.client import WorkflowHandle
from temporalio.worker import Worker

from activities.contracts import Received, RecordDecisionsInput
from activities.people import PeopleActivities
from ledger.errors import LedgerError
from ledgerflow.views import people
from ledgerflow.views.audit import audit_budget
from rules.actions import HumanDecisionType, HumanRequest, RequestKind, SuspendForHuman
from rules.envelope import StoredEvent
from rules.events import HumanDecision, Intent, MarkerKind, SystemMarker, TaskCreated, parse, to_new
from rules.keys import resolution_key
from rules.people import burst_reasons, decision_ref
from rules.plan import TimeoutPolicy, budget_scopes
from rules.projection import TaskState, fold
from runtime.signing import demo_key
from workflows.contracts import TaskInput, TaskResult, workflow_id
from workflows.task import TaskWorkflow

APPROVAL = """
goal: a storyboard a person must approve
budget_ceiling: 10
approval: {timeout: 1h, policy: escalate}
stages:
  - {id: board, executor: llm.text, estimate: 1, approval: true}
  - {id: shots, executor: image.keyframe, estimate: 1, depends_on: [board]}
"""


# ── helpers ──────────────────────────────────────────────────────────────────────────────────────────


def sign(lf, task_id: str, request_id: str, decision: str, approver: str = "director", **kw: Any) -> dict:
    """A decision signed with a demo approver's key (registered in the tests' key registry: dev mode)."""
    return people.signed_payload(demo_key(approver), task_id, request_id, decision, **kw)


async def decide(lf, task_id: str, request_id: str, decision: str, approver: str = "director", **kw: Any):
    """``ledgerflow decide``'s path: sign with the approver's key, send, wait for the ruling."""
    return await people.decide(lf.settings, demo_key(approver), task_id, request_id, decision, **kw)


async def ruling(lf, task_id: str, payload: dict, timeout: float = 10.0) -> people.Sent:
    """What the worker made of a decision, as ``ledgerflow decide`` reports it."""
    deadline = time.monotonic() + timeout
    decision_id = payload["decision_id"]
    while time.monotonic() < deadline:
        events = lf.recorder.read_events(task_id)
        found = people.ruling(fold(events), events, decision_id, payload["request_id"])
        if found is not None:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"no ruling on {decision_id} in {task_id}")


def typed(lf, task_id: str) -> list[Any]:
    return [parse(e) for e in lf.recorder.read_events(task_id)]


def resolutions_of(lf, task_id: str, request_id: str) -> list[StoredEvent]:
    key = resolution_key(task_id, request_id)
    return [e for e in lf.recorder.read_events(task_id) if e.dedup_key == key]


def rejections(lf, task_id: str) -> list[SystemMarker]:
    return [e for e in typed(lf, task_id) if e.type == "SystemMarker" and e.kind == MarkerKind.REJECTED_INPUT]


def refused(lf, task_id: str) -> dict[str, str]:
    """Every refused decision of the task, one by one or in a burst: decision ref -> reason."""
    out: dict[str, str] = {}
    for e in typed(lf, task_id):
        if e.type == "SystemMarker" and e.kind == MarkerKind.REJECTED_INPUT:
            ref, _, reason = e.detail.partition(": ")
            out[ref] = reason
        elif e.type == "SystemMarker" and e.kind == MarkerKind.REJECTED_BURST:
            out.update(burst_reasons(e))
    return out


# ── the three answers, end to end ────────────────────────────────────────────────────────────────────


async def test_approve_is_recorded_once_then_acted_on(lf, sim):
    plan = lf.plan(APPROVAL)
    handle = await lf.start(plan)
    rid = await wait_open(lf, plan.task_id, "approval:board")
    request = fold(lf.recorder.read_events(plan.task_id)).requests[rid].request
    assert Decimal(request.context["spend"]["spent"]) > 0
    assert [a["node"] for a in request.context["artifacts"]] == ["board"]  # what is to be approved
    payload = sign(lf, plan.task_id, rid, "approve", note="looks right")
    await asyncio.gather(signal(lf, plan.task_id, payload), signal(lf, plan.task_id, payload))  # sent twice
    assert (await ruling(lf, plan.task_id, payload)).status == "accepted"
    result = await handle.result()
    assert result.state == "Completed"
    decisions = [e for e in typed(lf, plan.task_id) if isinstance(e, HumanDecision)]
    assert len(decisions) == 1 and decisions[0].decision_id == payload["decision_id"]
    assert (decisions[0].approver, decisions[0].note) == ("director", "looks right")
    assert len(resolutions_of(lf, plan.task_id, rid)) == 1
    assert rejections(lf, plan.task_id) == []  # the repeat was a duplicate, not a rejection


async def test_abort_through_the_cli_path_fails_the_task(lf, sim):
    plan = lf.plan(APPROVAL)
    handle = await lf.start(plan)
    rid = await wait_open(lf, plan.task_id, "approval:board")
    sent = await decide(lf, plan.task_id, rid, "abort", "producer", note="wrong brief")
    assert (sent.status, sent.detail) == ("accepted", "abort by producer")
    result = await handle.result()
    assert result.state == "Failed"
    p = fold(lf.recorder.read_events(plan.task_id))
    assert p.terminal_reason == "aborted by producer"
    assert p.nodes["shots"].attempts == 0  # nothing after the approval point ran


async def test_add_budget_raises_the_ceiling_in_the_same_transaction_and_resumes(lf, sim):
    # The storyboard costs three times its estimate: the task's money is gone before the shots.
    await sim.configure(executors={"llm.text": {"cost_multiplier": "3"}})
    plan = lf.plan(
        """
goal: an expensive storyboard
budget_ceiling: 3
stages:
  - {id: board, executor: llm.text, estimate: 1}
  - {id: shots, executor: image.keyframe, estimate: 1, depends_on: [board]}
"""
    )
    handle = await lf.start(plan)
    rid = await wait_open(lf, plan.task_id, "escalation:")
    p = fold(lf.recorder.read_events(plan.task_id))
    assert p.state == TaskState.ESCALATED and "budget exhausted" in (p.escalation_reason or "")
    ctx = p.requests[rid].request.context
    assert ctx["spend"]["remaining"] == str(p.ceiling - p.spent - p.reserved)
    assert {o["decision"] for o in ctx["options"]} == {"resume", "add_budget", "abort"}
    # Resuming without money is accepted, and the budget rule stops the task again at once.
    resumed = await decide(lf, plan.task_id, rid, "resume", "director")
    assert resumed.status == "accepted"
    rid2 = await wait_open(lf, plan.task_id, "escalation:2")
    sent = await decide(lf, plan.task_id, rid2, "add-budget", "producer", amount="5")
    assert sent.status == "accepted", sent
    result = await handle.result()
    assert result.state == "Completed"
    account = lf.recorder.account(f"task:{plan.task_id}")
    assert account is not None and account.ceiling == Decimal(8)
    assert fold(lf.recorder.read_events(plan.task_id)).ceiling == Decimal(8)
    assert all(c.ok for c in audit_budget(lf.recorder, plan.task_id))


async def test_timeout_with_policy_escalate_then_resume(lf, sim):
    plan = lf.plan(APPROVAL.replace("timeout: 1h", "timeout: 1s"))
    handle = await lf.start(plan)
    rid = await wait_open(lf, plan.task_id, "escalation:")
    p = fold(lf.recorder.read_events(plan.task_id))
    assert p.requests["approval:board:v1"].timed_out and p.requests[rid].resolves == "approval:board:v1"
    # The approval is closed by its timeout: a late approval of it is refused and told so.
    late = await decide(lf, plan.task_id, "approval:board:v1", "approve", "director")
    assert (late.status, late.detail) == ("already resolved", "timed out")
    sent = await decide(lf, plan.task_id, rid, "resume", "director")
    assert sent.status == "accepted"
    result = await handle.result()
    assert result.state == "Completed"
    assert fold(lf.recorder.read_events(plan.task_id)).nodes["board"].approved


# ── races ────────────────────────────────────────────────────────────────────────────────────────────


async def test_conflicting_decisions_in_parallel_first_wins_and_the_loser_is_told(lf, sim):
    plan = lf.plan(APPROVAL)
    handle = await lf.start(plan)
    rid = await wait_open(lf, plan.task_id, "approval:board")
    approve = sign(lf, plan.task_id, rid, "approve", "director")
    abort = sign(lf, plan.task_id, rid, "abort", "producer")
    await asyncio.gather(signal(lf, plan.task_id, approve), signal(lf, plan.task_id, abort))
    # If the abort wins, the task ends and may do so before the approve is ruled on: the loser is then
    # answered from the ledger (its request is resolved), as ``ledgerflow decide`` does.
    a, b = await ruling(lf, plan.task_id, approve), await ruling(lf, plan.task_id, abort)
    assert sorted([a.status, b.status]) == ["accepted", "already resolved"]
    winner, loser = (a, b) if a.status == "accepted" else (b, a)
    assert loser.detail == winner.detail  # "approve by director" or "abort by producer"
    assert len(resolutions_of(lf, plan.task_id, rid)) == 1
    result = await handle.result()
    assert result.state == ("Completed" if winner is a else "Failed")


def _ledger_task(lf, task_id: str, request: HumanRequest) -> None:
    """A task whose ledger holds an open request, written as the workflow writes it."""
    plan = lf.plan(APPROVAL, task_id=task_id)
    epoch = lf.recorder.take_lease(task_id, "test")
    lf.recorder.open_budget(task_id, budget_scopes(plan, task_id))
    created = to_new(TaskCreated(plan=plan), dedup_key=f"{task_id}:created")
    intent = Intent(
        action=SuspendForHuman(request=request), rule="R9", watermark=1, decided_at=datetime.now(UTC)
    )
    lf.recorder.append_fenced(task_id, epoch, [created, to_new(intent, dedup_key=f"{task_id}:intent:1:1")])


async def test_a_decision_racing_the_timeout_and_another_person_50_times_resolves_once(lf, sim):
    """Directly against the activity and the recorder, on threads released together: an add_budget, a
    conflicting abort and the timer's marker race for one request's resolution key, 50 times."""
    activity = PeopleActivities(lf.recorder, lf.settings)
    request = HumanRequest(
        id="escalation:1",
        kind=RequestKind.ESCALATION,
        reason="budget exhausted",
        options=(HumanDecisionType.RESUME, HumanDecisionType.ADD_BUDGET, HumanDecisionType.ABORT),
        deadline=datetime.now(UTC) + timedelta(hours=1),
        timeout_policy=TimeoutPolicy.ESCALATE,
    )

    def race(i: int) -> str:
        task_id = f"race-{uuid.uuid4().hex[:10]}"
        _ledger_task(lf, task_id, request)
        add = sign(lf, task_id, request.id, "add-budget", "producer", amount="2.5")
        abort = sign(lf, task_id, request.id, "abort", "director")
        marker = SystemMarker(kind=MarkerKind.TIMEOUT, request_id=request.id)
        gate = threading.Barrier(3)

        def decide(payload: dict) -> None:
            gate.wait()
            received = Received(decision=payload, received_at=datetime.now(UTC))
            activity.record_batch(RecordDecisionsInput(task_id=task_id, decisions=[received], after=0))

        def timeout() -> None:
            gate.wait()
            lf.recorder.append_idempotent(
                task_id, to_new(marker, dedup_key=resolution_key(task_id, request.id))
            )

        threads = [
            threading.Thread(target=f, args=a)
            for f, a in ((decide, (add,)), (decide, (abort,)), (timeout, ()))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        events = lf.recorder.read_events(task_id)
        resolved = [e for e in events if e.dedup_key == resolution_key(task_id, request.id)]
        assert len(resolved) == 1, resolved
        winner = parse(resolved[0])
        r = fold(events).requests[request.id]
        assert r.timed_out != (r.decision is not None)  # exactly one resolution in the fold too
        account = lf.recorder.account(f"task:{task_id}")
        added = isinstance(winner, HumanDecision) and winner.decision == HumanDecisionType.ADD_BUDGET
        assert account is not None and account.ceiling == Decimal(10) + (Decimal("2.5") if added else 0)
        for payload in (add, abort):
            told = people.outcome(events, payload["decision_id"])
            assert told is not None
            if isinstance(winner, HumanDecision) and winner.decision_id == payload["decision_id"]:
                assert told.status == "accepted"
            else:
                assert told.status == "already resolved", told
        return winner.type if not isinstance(winner, HumanDecision) else winner.decision.value

    with ThreadPoolExecutor(max_workers=10) as pool:  # each round asserts its own single winner
        await asyncio.get_running_loop().run_in_executor(None, lambda: list(pool.map(race, range(50))))


def test_raise_ceiling_applies_only_with_the_insert_and_only_to_the_tasks_own_scope(lf):
    task_id = f"raise-{uuid.uuid4().hex[:10]}"
    request = HumanRequest(
        id="escalation:1", kind=RequestKind.ESCALATION, reason="r", options=(HumanDecisionType.ADD_BUDGET,)
    )
    _ledger_task(lf, task_id, request)
    decision = HumanDecision(
        request_id="escalation:1", decision=HumanDecisionType.ADD_BUDGET, approver="p", amount=Decimal(3)
    )
    event = to_new(decision, dedup_key=resolution_key(task_id, "escalation:1"))
    with pytest.raises(LedgerError, match="does not draw on"):
        lf.recorder.append_idempotent(task_id, event, raise_ceiling=("project:elsewhere", Decimal(3)))
    assert len(lf.recorder.read_events(task_id)) == 2  # nothing was written
    for _ in range(2):
        lf.recorder.append_idempotent(task_id, event, raise_ceiling=(f"task:{task_id}", Decimal(3)))
    account = lf.recorder.account(f"task:{task_id}")
    assert account is not None and account.ceiling == Decimal(13)  # raised once, by the write that inserted


async def test_a_decision_signalled_around_the_deadline_resolves_exactly_once_end_to_end(lf, sim):
    """Ten tasks whose approval times out after 1 s (policy approve), each sent an abort within ±0.15 s of
    its deadline: whichever is recorded first is the only resolution, and the task follows it."""
    text = APPROVAL.replace("timeout: 1h, policy: escalate", "timeout: 1s, policy: approve")
    plans = [lf.plan(text) for _ in range(10)]
    handles = [await lf.start(plan) for plan in plans]

    async def one(task_id: str, handle: WorkflowHandle[Any, TaskResult]) -> str:
        rid = await wait_open(lf, task_id, "approval:board")
        deadline = fold(lf.recorder.read_events(task_id)).requests[rid].request.deadline
        assert deadline is not None
        at = deadline + timedelta(seconds=random.uniform(-0.15, 0.15))
        await asyncio.sleep(max(0.0, (at - datetime.now(UTC)).total_seconds()))
        payload = sign(lf, task_id, rid, "abort")
        try:
            await signal(lf, task_id, payload)
        except Exception:  # the timeout won and the task already completed: nothing received the signal
            assert (await handle.result()).state == "Completed"
            return "timeout (task done)"
        result = await handle.result()
        assert len(resolutions_of(lf, task_id, rid)) == 1
        told = people.outcome(lf.recorder.read_events(task_id), payload["decision_id"])
        if result.state == "Failed":
            assert told is not None and told.status == "accepted"
            return "decision"
        assert result.state == "Completed"
        # Lost to the timeout: told so, as "timed out" (marked first) or as arriving after the deadline.
        assert (
            told is None
            or (told.status, told.detail) == ("already resolved", "timed out")
            or (told.status == "rejected" and "after the request's deadline" in told.detail)
        )
        return "timeout"

    outcomes = await asyncio.gather(*(one(p.task_id, h) for p, h in zip(plans, handles, strict=True)))
    assert len(outcomes) == 10


# ── refused input ────────────────────────────────────────────────────────────────────────────────────


async def test_forged_unsigned_unauthorised_misdirected_late_and_malformed_input_is_refused_and_audited(
    lf, sim
):
    plan = lf.plan(
        """
goal: two approval points, approvals by the director only
budget_ceiling: 10
approval:
  timeout: 1h
  approvers: [director, producer]
  approvers_by_kind: {approval: [director]}
stages:
  - {id: board, executor: llm.text, estimate: 1, approval: true}
  - {id: shots, executor: image.keyframe, estimate: 1, depends_on: [board], approval: true}
"""
    )
    other = lf.plan(APPROVAL)
    handle = await lf.start(plan)
    await lf.start(other)
    tid = plan.task_id
    board = await wait_open(lf, tid, "approval:board")
    assert (await decide(lf, tid, board, "approve", "director")).status == "accepted"
    rid = await wait_open(lf, tid, "approval:shots")

    def good(**kw: Any) -> dict:
        return sign(lf, tid, rid, "approve", **kw)

    forged = {**good(), "signature": "0" * 128}
    altered = {**good(), "decision": "abort"}  # signed as an approve
    unsigned = {k: v for k, v in good().items() if k != "signature"}
    stranger = {**good(), "approver": "mallory"}
    cases: list[tuple[Any, str]] = [
        (forged, "bad signature"),
        (altered, "bad signature"),
        (unsigned, "unsigned decision"),
        ({**good(), "signature": None}, "unsigned decision"),
        (stranger, "bad signature"),  # the approver is signed too
        ({**good(), "key_id": "nobody-1"}, "unknown key 'nobody-1'"),
        (sign(lf, tid, rid, "approve", "producer"), "producer may not decide approval requests"),
        (sign(lf, tid, rid, "approve", "editor"), "editor may not decide approval requests"),
        (sign(lf, other.task_id, rid, "approve"), "bad signature"),  # signed for another task
        (sign(lf, tid, "approval:nope:v1", "approve"), "no request 'approval:nope:v1'"),
        (sign(lf, tid, board, "approve"), "already resolved: approve by director"),
        (sign(lf, tid, rid, "add-budget", amount="5"), "add_budget is not an option"),
        ({**good(), "amount": "5"}, "bad signature"),  # an amount the signature does not cover
        ([1, 2], "expected a JSON object, got an array"),
        ("approve", "expected a JSON object, got a string"),
        (None, "expected a JSON object, got null"),
        (42, "expected a JSON object, got a number"),
        ({}, "unsigned decision"),
        ({**good(), "decision_id": 5}, "decision_id must be a string"),
        ({**good(), "decision_id": "not-a-uuid"}, "is not a lowercase UUID"),
        ({**good(), "decision": "approve!!"}, "is not one of approve, resume, abort, add_budget"),
        ({**good(), "admin": True}, "unknown field 'admin'"),
        ({**good(), "note": "x" * 3000}, "note is longer than 2000"),
        ({**good(), "amount": "lots"}, "amount 'lots' is not a decimal string"),
        ({k: v for k, v in good().items() if k != "request_id"}, "request_id is required"),
    ]
    for payload, _ in cases:
        await signal(lf, tid, payload)
    await signal(lf, tid, [1, 2])  # the same malformed payload again: audited once
    await signal(lf, tid, forged)  # the same forged decision again: audited once
    deadline = time.monotonic() + 15
    while len(refused(lf, tid)) < len(cases) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.3)  # let the repeats be ruled on too
    # Each decision refused once, with its reason, found by its ref (its id, or a digest of the payload): the
    # first few one by one, the rest of each batch in one burst marker.
    reasons = refused(lf, tid)
    assert len(reasons) == len(cases), reasons
    for payload, needle in cases:
        assert needle in reasons[decision_ref(payload)], (needle, reasons[decision_ref(payload)])
    by_request: dict[str | None, int] = {}
    for m in rejections(lf, tid):
        by_request[m.request_id] = by_request.get(m.request_id, 0) + 1
    assert max(by_request.values()) <= 3, by_request  # the rest were counted, not recorded one by one
    # Nothing reached the projection; the workflow keeps waiting, and a valid decision still goes through.
    status = await lf.client.get_workflow_handle(workflow_id(tid)).query("status")
    assert status["state"] == "WaitingHuman"
    assert [r["id"] for r in status["open_requests"]] == [rid]
    assert (await decide(lf, tid, rid, "approve", "director")).status == "accepted"
    assert (await handle.result()).state == "Completed"
    assert [e.type for e in typed(lf, tid)].count("HumanDecision") == 2


# ── the command line ─────────────────────────────────────────────────────────────────────────────────


async def test_the_cli_queue_request_decide_and_dlq(lf, sim, tmp_path):
    plan = lf.plan(
        """
goal: two approval points, approvals by the director only
budget_ceiling: 10
approval: {timeout: 1h, approvers_by_kind: {approval: [director]}}
stages:
  - {id: board, executor: llm.text, estimate: 1, approval: true, value: hero}
  - {id: shots, executor: image.keyframe, estimate: 1, depends_on: [board], approval: true}
"""
    )
    handle = await lf.start(plan)
    tid = plan.task_id
    board = await wait_open(lf, tid, "approval:board")
    (rc_q, queue, _), (rc_r, detail, _), (rc_d, dlq, _), (rc_bad, _, bad) = await asyncio.gather(
        cli(lf, tmp_path, "queue", "--json"),
        cli(lf, tmp_path, "request", f"{tid}/{board}", "--json"),
        cli(lf, tmp_path, "dlq", "--json"),
        cli(lf, tmp_path, "decide", f"{tid}/{board}", "add-budget", "--as", "director"),
    )
    assert (rc_q, rc_r, rc_d) == (0, 0, 0)
    mine = [i for i in json.loads(queue) if i["task_id"] == tid]
    assert [(i["id"], i["kind"], i["value"], i["group_size"]) for i in mine] == [
        (f"{tid}/{board}", "approval", "hero", 1)
    ]
    assert json.loads(detail)["context_now"]["artifacts"][0]["node"] == "board"
    assert isinstance(json.loads(dlq), list)
    assert rc_bad == 2 and bad.strip() == "error: add-budget needs --amount"
    rc, out, _ = await cli(lf, tmp_path, "decide", f"{tid}/{board}", "approve", "--as", "director")
    assert (rc, out.strip()) == (0, "accepted (approve by director)")
    shots = await wait_open(lf, tid, "approval:shots")
    rc, _, late = await cli(lf, tmp_path, "decide", f"{tid}/{board}", "abort", "--as", "director")
    assert (rc, late.strip()) == (1, "already resolved (by director: approve)")
    who = await decide(lf, tid, shots, "approve", "producer")
    assert who.line == "rejected: producer may not decide approval requests (allowed: director)"
    assert (await decide(lf, tid, shots, "approve", "director")).status == "accepted"
    assert (await handle.result()).state == "Completed"


# ── waiting costs nothing ────────────────────────────────────────────────────────────────────────────


async def test_waiting_tasks_hold_no_worker_slot(lf, sim):
    """Twenty tasks wait for a person on a worker with two workflow-task slots; one more task still runs to
    completion, and then all twenty are approved and finish."""
    from worker import build_worker

    queue = f"q-slots-{uuid.uuid4().hex[:8]}"
    async with AsyncExitStack() as stack:
        # build_worker wires the activities; the same worker, with two slots, is built from its config (on
        # another queue: a constructed worker is registered under its queue even if never run).
        base = await build_worker(lf.client, lf.settings, stack, task_queue=f"{queue}-unused")
        config = {
            **base.config(),
            "task_queue": queue,
            "max_concurrent_workflow_tasks": 2,
        }
        async with Worker(**config):

            async def start(text: str) -> tuple[str, WorkflowHandle[Any, TaskResult]]:
                plan = lf.plan(text)
                assert plan.task_id is not None
                handle = await lf.client.start_workflow(
                    TaskWorkflow.run,
                    TaskInput(task_id=plan.task_id, plan=plan),
                    id=workflow_id(plan.task_id),
                    task_queue=queue,
                )
                return plan.task_id, handle

            waiting = await asyncio.gather(*(start(APPROVAL) for _ in range(20)))
            rids = await asyncio.gather(*(wait_open(lf, tid, "approval:board", 30) for tid, _ in waiting))
            started = time.monotonic()
            _, extra = await start(APPROVAL.replace("approval: true", "approval: false"))
            assert (await asyncio.wait_for(extra.result(), 20)).state == "Completed"
            assert time.monotonic() - started < 10
            groups = people.queue(lf.settings)
            mine = [i for g in groups for i in g if i.task_id in {tid for tid, _ in waiting}]
            assert len(mine) == 20 and all(i.kind == RequestKind.APPROVAL for i in mine)
            await asyncio.gather(
                *(
                    signal(lf, tid, sign(lf, tid, rid, "approve"))
                    for (tid, _), rid in zip(waiting, rids, strict=True)
                )
            )
            results = await asyncio.wait_for(asyncio.gather(*(h.result() for _, h in waiting)), 40)
            assert {r.state for r in results} == {"Completed"}
