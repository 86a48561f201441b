"""The approver's side on real servers (issue 15): keys from the registry, rotation and revocation, the fair
protocol (a decision in time wins even with no worker up; an overdue deadline is still marked), add_budget on
the scope that refused, backup approvers, and floods of refused signals.

Keys: the tests run in dev mode with the demo approvers registered (tests/conftest.py); the keys made here
belong to approvers of their own (unique per test), so revoking them touches no other test.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from contextlib import AsyncExitStack
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from peoplekit import cli, markers, signal, wait_open
from pydantic import SecretStr
from temporalio.worker import Worker

from activities.contracts import Received, RecordDecisionsInput
from activities.people import PeopleActivities
from ledgerflow.views import people
from rules.approvers import KeyRecord
from rules.events import HumanDecision, MarkerKind, parse
from rules.projection import fold
from runtime.settings import SIM_VENDOR_KEY, ConfigError
from runtime.signing import ApproverKey, demo_key, generate
from workflows.contracts import TaskInput, workflow_id
from workflows.task import TaskWorkflow

APPROVAL = """
goal: a storyboard a person must approve
budget_ceiling: 10
approval: {timeout: 1h, policy: escalate}
stages:
  - {id: board, executor: llm.text, estimate: 1, approval: true}
  - {id: shots, executor: image.keyframe, estimate: 1, depends_on: [board]}
"""


# ── keys: rotation, revocation, expiry, through the CLI ──────────────────────────────────────────────


async def test_keys_are_registered_rotated_and_revoked_and_a_refused_key_is_audited(lf, sim, tmp_path):
    approver = f"ann{uuid.uuid4().hex[:6]}"
    old_file, new_file = tmp_path / "old.key", tmp_path / "new.key"
    rc, out, _ = await cli(
        lf,
        tmp_path,
        "keys",
        "generate",
        "--approver",
        approver,
        "--key-id",
        f"{approver}-1",
        "--out",
        str(old_file),
    )
    assert rc == 0 and "public key" in out and oct(old_file.stat().st_mode & 0o777) == "0o600"
    rc, out, _ = await cli(
        lf,
        tmp_path,
        "keys",
        "add",
        "--key-file",
        str(old_file),
        "--as",
        "sec-ops",
        "--reason",
        "new approver",
    )
    assert (rc, out.strip()) == (0, f"key {approver}-1 of {approver} registered")
    rc, _, err = await cli(
        lf, tmp_path, "keys", "add", "--key-file", str(old_file), "--as", "sec-ops", "--reason", "again"
    )
    assert (rc, err.strip()) == (2, f"error: key {approver}-1 is already registered (a key id is used once)")

    plan = lf.plan(
        APPROVAL.replace(
            "approval: true}",
            "approval: true}\n  - {id: more, executor: llm.text, estimate: 1, approval: true,"
            " depends_on: [shots]}",
        )
    )
    handle = await lf.start(plan)
    tid = plan.task_id
    board = await wait_open(lf, tid, "approval:board")
    rc, out, _ = await cli(lf, tmp_path, "decide", f"{tid}/{board}", "approve", "--key-file", str(old_file))
    assert (rc, out.strip()) == (0, f"accepted (approve by {approver})")

    # Rotation: a new key, then the old one revoked. A decision signed with the old key is refused, audited.
    await cli(
        lf,
        tmp_path,
        "keys",
        "generate",
        "--approver",
        approver,
        "--key-id",
        f"{approver}-2",
        "--out",
        str(new_file),
    )
    await cli(
        lf, tmp_path, "keys", "add", "--key-file", str(new_file), "--as", "sec-ops", "--reason", "rotation"
    )
    rc, out, _ = await cli(
        lf, tmp_path, "keys", "revoke", f"{approver}-1", "--as", "sec-ops", "--reason", "rotated"
    )
    assert (rc, out.strip()) == (0, f"key {approver}-1 of {approver} revoked")
    more = await wait_open(lf, tid, "approval:more")
    rc, _, err = await cli(lf, tmp_path, "decide", f"{tid}/{more}", "approve", "--key-file", str(old_file))
    assert rc == 1 and f"rejected: key {approver}-1 was revoked at" in err and "rotated" in err
    refused = markers(lf, tid, MarkerKind.REJECTED_INPUT)
    assert len(refused) == 1 and "was revoked" in refused[0].detail and refused[0].request_id == more
    rc, out, _ = await cli(lf, tmp_path, "decide", f"{tid}/{more}", "approve", "--key-file", str(new_file))
    assert (rc, out.strip()) == (0, f"accepted (approve by {approver})")
    assert (await handle.result()).state == "Completed"
    decisions = [parse(e) for e in lf.recorder.read_events(tid) if e.type == "HumanDecision"]
    assert [d.key_id for d in decisions if isinstance(d, HumanDecision)] == [f"{approver}-1", f"{approver}-2"]

    rc, out, _ = await cli(lf, tmp_path, "keys", "list", "--json")
    listed = {k["key_id"]: k for k in json.loads(out)}
    assert (
        listed[f"{approver}-1"]["revoked_reason"] == "rotated"
        and listed[f"{approver}-2"]["revoked_at"] is None
    )
    rc, _, err = await cli(lf, tmp_path, "keys", "revoke", "no-such-key", "--as", "x", "--reason", "y")
    assert (rc, err.strip()) == (2, "error: no key 'no-such-key' in the registry")
    rc, _, err = await cli(
        lf,
        tmp_path,
        "keys",
        "add",
        "--key-id",
        "k",
        "--approver",
        "a",
        "--public-key",
        "zz",
        "--as",
        "x",
        "--reason",
        "y",
    )
    assert (rc, err.strip()) == (2, "error: 'zz' is not an Ed25519 public key (64 hex digits)")


async def test_ledgerflow_sign_makes_a_payload_the_stock_temporal_cli_can_send(lf, sim, tmp_path):
    plan = lf.plan(APPROVAL)
    handle = await lf.start(plan)
    tid = plan.task_id
    rid = await wait_open(lf, tid, "approval:board")
    rc, payload, err = await cli(
        lf, tmp_path, "sign", f"{tid}/{rid}", "approve", "--as", "director", "--note", "ok"
    )
    assert rc == 0, err
    temporal = Path(sys.executable).parent / "temporal"
    proc = await asyncio.create_subprocess_exec(
        str(temporal),
        "workflow",
        "signal",
        "--address",
        str(lf.settings.temporal_address),
        "--workflow-id",
        workflow_id(tid),
        "--name",
        "decide",
        "--input",
        payload.strip(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, signal_err = await proc.communicate()
    assert proc.returncode == 0, signal_err.decode()
    assert (await asyncio.wait_for(handle.result(), 30)).state == "Completed"
    decided = [parse(e) for e in lf.recorder.read_events(tid) if e.type == "HumanDecision"]
    assert [(d.approver, d.note) for d in decided if isinstance(d, HumanDecision)] == [("director", "ok")]
    rc, _, err = await cli(
        lf, tmp_path, "sign", f"{tid}/{rid}", "approve", "--scope", "task:x", "--as", "director"
    )
    assert (rc, err.strip()) == (2, "error: --scope is only for add-budget, not approve")


async def test_an_expired_key_is_refused(lf, sim):
    key = generate(f"bob{uuid.uuid4().hex[:6]}", f"bob-{uuid.uuid4().hex[:6]}")
    past = datetime.now(UTC) - timedelta(days=1)
    record = KeyRecord(key_id=key.key_id, approver=key.approver, public_key=key.public_key, expires_at=past)
    lf.recorder.add_key(record, actor="test", reason="already expired")
    plan = lf.plan(APPROVAL)
    await lf.start(plan)
    rid = await wait_open(lf, plan.task_id, "approval:board")
    sent = await people.decide(lf.settings, key, plan.task_id, rid, "approve")
    assert sent.status == "rejected" and f"key {key.key_id} expired at" in sent.detail


async def test_outside_dev_mode_demo_keys_are_refused_and_the_worker_will_not_start(lf, sim, tmp_path):
    production = lf.settings.model_copy(update={"env": "production"})
    from worker import build_worker

    async with AsyncExitStack() as stack:
        with pytest.raises(ConfigError) as refused:
            await build_worker(lf.client, production, stack, task_queue=f"q-{uuid.uuid4().hex[:8]}")
    assert str(refused.value).startswith("the approver key registry holds demo keys (demo-director")
    defaults = production.model_copy(update={"vendor_api_key": SecretStr(SIM_VENDOR_KEY)})
    assert defaults.default_secret() == (
        "LEDGERFLOW_VENDOR_API_KEY is the simulator's default key: set the real one (or LEDGERFLOW_ENV=dev)"
    )
    # And a decision signed with a demo key is refused by a production worker's activity, with why.
    plan = lf.plan(APPROVAL)
    await lf.start(plan)
    rid = await wait_open(lf, plan.task_id, "approval:board")
    payload = people.signed_payload(demo_key("director"), plan.task_id, rid, "approve")
    activity = PeopleActivities(lf.recorder, production)
    received = Received(decision=payload, received_at=datetime.now(UTC))
    activity.record_batch(RecordDecisionsInput(task_id=plan.task_id, decisions=[received], after=0))
    refused_markers = markers(lf, plan.task_id, MarkerKind.REJECTED_INPUT)
    assert len(refused_markers) == 1
    assert "a demo key: refused outside dev mode (LEDGERFLOW_ENV=dev)" in refused_markers[0].detail


# ── the fair protocol ────────────────────────────────────────────────────────────────────────────────


async def test_a_deadline_already_past_when_the_loop_comes_to_wait_is_marked_at_once(lf, sim):
    """A 1 ms approval deadline has passed before the loop waits (it was busy recording the request): the
    timeout is marked at once and the policy applies, instead of waiting until the time ceiling."""
    plan = lf.plan(APPROVAL.replace("timeout: 1h", "timeout: 0.001") + "time_ceiling: 120\n")
    handle = await lf.start(plan)
    started = time.monotonic()
    await wait_open(lf, plan.task_id, "escalation:", timeout=30)
    assert time.monotonic() - started < 20  # without the fix: 120 s (the ceiling)
    assert len(markers(lf, plan.task_id, MarkerKind.TIMEOUT)) == 1
    await handle.cancel()


async def _stoppable_worker(lf, queue: str, stack: AsyncExitStack) -> dict[str, Any]:
    from worker import build_worker

    base = await build_worker(lf.client, lf.settings, stack, task_queue=f"{queue}-unused")
    return {**base.config(), "task_queue": queue}


@pytest.mark.parametrize(
    "in_time", [True, False], ids=["before-the-deadline-wins", "after-the-deadline-loses"]
)
async def test_with_no_worker_up_the_decision_that_reached_temporal_first_decides(lf, sim, in_time):
    queue = f"q-fair-{uuid.uuid4().hex[:8]}"
    plan = lf.plan(APPROVAL.replace("timeout: 1h", "timeout: 4s"))
    tid = plan.task_id
    async with AsyncExitStack() as stack:
        config = await _stoppable_worker(lf, queue, stack)
        handle = await lf.client.start_workflow(
            TaskWorkflow.run, TaskInput(task_id=tid, plan=plan), id=workflow_id(tid), task_queue=queue
        )
        async with Worker(**config):
            rid = await wait_open(lf, tid, "approval:board")
        deadline = fold(lf.recorder.read_events(tid)).requests[rid].deadline
        assert deadline is not None
        # No worker now. Signal before the deadline (or after it), then wait past it, then start a worker.
        if not in_time:
            await asyncio.sleep(max(0.0, (deadline - datetime.now(UTC)).total_seconds()) + 1.0)
        payload = people.signed_payload(demo_key("director"), tid, rid, "approve")
        await signal(lf, tid, payload)
        await asyncio.sleep(max(0.0, (deadline - datetime.now(UTC)).total_seconds()) + 1.5)
        async with Worker(**config):
            if in_time:
                result = await asyncio.wait_for(handle.result(), 30)
                assert result.state == "Completed"
                assert markers(lf, tid, MarkerKind.TIMEOUT) == []
                told = people.outcome(lf.recorder.read_events(tid), payload["decision_id"])
                assert told is not None and told.status == "accepted"
            else:
                await wait_open(lf, tid, "escalation:")  # the timeout's policy: escalate
                assert len(markers(lf, tid, MarkerKind.TIMEOUT)) == 1
                told = people.outcome(lf.recorder.read_events(tid), payload["decision_id"])
                assert told is not None and "after the request's deadline" in told.detail
                await handle.cancel()


async def test_a_request_unanswered_by_its_deadline_is_offered_to_the_backups(lf, sim):
    plan = lf.plan(
        APPROVAL.replace(
            "approval: {timeout: 1h, policy: escalate}",
            "approval: {timeout: 2s, policy: escalate, approvers: [director], backups: [editor],"
            " backup_timeout: 1h}",
        )
    )
    handle = await lf.start(plan)
    tid = plan.task_id
    rid = await wait_open(lf, tid, "approval:board")
    early = await people.decide(lf.settings, demo_key("editor"), tid, rid, "approve")
    assert early.status == "rejected" and "editor may not decide approval requests" in early.detail
    deadline = time.monotonic() + 20
    while not markers(lf, tid, MarkerKind.BACKUPS_OFFERED) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert [m.request_id for m in markers(lf, tid, MarkerKind.BACKUPS_OFFERED)] == [rid]
    status = await handle.query("status")
    assert status["open_requests"][0]["offered_to_backups"] is True
    sent = await people.decide(lf.settings, demo_key("editor"), tid, rid, "approve")
    assert sent.status == "accepted", sent
    assert (await handle.result()).state == "Completed"
    assert markers(lf, tid, MarkerKind.TIMEOUT) == []


async def test_add_budget_raises_the_project_scope_that_refused(lf, sim):
    project = f"p{uuid.uuid4().hex[:8]}"
    plan = lf.plan(
        APPROVAL.replace("approval: true", "approval: false").replace("goal:", f"project: {project}\ngoal:")
    )
    lf.recorder.set_ceiling(f"project:{project}", Decimal("1"))  # room for the board, not the shots
    handle = await lf.start(plan)
    tid = plan.task_id
    rid = await wait_open(lf, tid, "escalation:")
    request = fold(lf.recorder.read_events(tid)).requests[rid].request
    assert request.budget_scope == f"project:{project}"
    task_ceiling = lf.recorder.account(f"task:{tid}").ceiling
    sent = await people.decide(lf.settings, demo_key("producer"), tid, rid, "add-budget", amount="5")
    assert (sent.status, sent.detail) == ("accepted", "add_budget 5 by producer")
    assert (await handle.result()).state == "Completed"
    assert lf.recorder.account(f"project:{project}").ceiling == Decimal("6")
    assert lf.recorder.account(f"task:{tid}").ceiling == task_ceiling  # the task's own ceiling is untouched


# ── floods ───────────────────────────────────────────────────────────────────────────────────────────


async def test_a_flood_of_refused_signals_is_counted_not_recorded_one_by_one(lf, sim):
    plan = lf.plan(APPROVAL)
    handle = await lf.start(plan)
    tid = plan.task_id
    rid = await wait_open(lf, tid, "approval:board")
    stranger = ApproverKey(key_id="nobody-1", approver="director", private=demo_key("director").private)
    flood = [people.signed_payload(stranger, tid, rid, "approve") for _ in range(150)]
    flood += [
        {**people.signed_payload(demo_key("director"), tid, rid, "abort"), "signature": "0" * 128}
        for _ in range(150)
    ]
    await asyncio.gather(*(signal(lf, tid, p) for p in flood))
    sent = await people.decide(lf.settings, demo_key("director"), tid, rid, "approve")
    assert sent.status == "accepted"  # the flood did not keep the real decision out
    assert (await handle.result()).state == "Completed"
    single = markers(lf, tid, MarkerKind.REJECTED_INPUT)
    bursts = markers(lf, tid, MarkerKind.REJECTED_BURST)
    assert len(single) == 3 and 1 <= len(bursts) <= 6, (len(single), len(bursts))
    counted = [json.loads(b.detail) for b in bursts]
    refs = [r for b in counted for r in b["refs"]]
    assert len(single) + len(refs) == 300, ([b["count"] for b in counted], len(refs), len(set(refs)))
    assert len(set(refs)) == len(refs)  # each refusal counted once
    reasons = {r for b in bursts for r in json.loads(b.detail)["reasons"]}
    assert {"unknown key 'nobody-1' (not in the approver key registry)"} <= reasons
    assert any(
        r.startswith("bad signature for key 'demo-director'")
        for r in reasons | {s.detail.partition(": ")[2] for s in single}
    )
