"""Issue 24 §3/§4/§7: a recorded decision keeps what was signed, a signed decision carries its issued-at time
and counts only within a window of it, and ``ledgerflow audit`` re-verifies every recorded decision against
the key registry as of its arrival — so a decision forged with a worker's database credentials is reported.

End to end on the real servers (Temporal, Postgres, the worker), signing as the CLI does
(``ledgerflow.views.people.signed_payload``).
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from peoplekit import wait_open

from ledger import roles
from ledger.recorder import Recorder
from ledgerflow.views import people
from ledgerflow.views.audit import audit, audit_signatures
from rules.events import HumanDecision, parse, to_new
from rules.keys import resolution_key
from rules.people import CANONICAL_V3, Keys, canonical, issued_now
from runtime.signing import demo_key, verify

APPROVAL = """
goal: a storyboard a person must approve
budget_ceiling: 10
approval: {timeout: 1h, policy: escalate}
stages:
  - {id: board, executor: llm.text, estimate: 1, approval: true}
  - {id: shots, executor: image.keyframe, estimate: 1, depends_on: [board]}
"""
WINDOW = timedelta(minutes=10)


def keys(lf) -> Keys:
    return Keys(lf.recorder.key_registry(), verify, WINDOW)


def decisions(lf, task_id: str) -> list:
    return [e for e in lf.recorder.read_events(task_id) if e.type == "HumanDecision"]


async def open_approval(lf):
    plan = lf.plan(APPROVAL)
    handle = await lf.start(plan)
    return plan.task_id, handle, await wait_open(lf, plan.task_id, "approval:board")


async def test_the_cli_signs_an_issued_at_time_and_the_decision_records_what_was_signed(lf, sim):
    task_id, handle, rid = await open_approval(lf)
    payload = people.signed_payload(demo_key("director"), task_id, rid, "approve", note="two\nlines")
    issued = datetime.fromisoformat(payload["issued_at"].replace("Z", "+00:00"))
    assert abs(datetime.now(UTC) - issued) < timedelta(seconds=5)
    sent = await people.relay(lf.settings, task_id, payload)
    assert (sent.status, sent.detail) == ("accepted", "approve by director")
    assert (await handle.result()).state == "Completed"
    [stored] = decisions(lf, task_id)
    d = parse(stored)
    assert isinstance(d, HumanDecision)
    assert d.signed is not None and d.signed.startswith(CANONICAL_V3 + "\n" + task_id + "\n")
    assert d.signed == canonical(
        task_id,
        d.decision_id,
        rid,
        "approve",
        "director",
        "demo-director",
        None,
        None,
        "two\nlines",
        payload["issued_at"],
    )
    assert (d.signature, d.issued_at) == (payload["signature"], issued)
    assert d.received_at is not None and abs(d.received_at - issued) < timedelta(seconds=30)
    assert verify(demo_key("director").public_key, d.signed, d.signature)
    found = audit_signatures(task_id, lf.recorder.read_events(task_id), keys(lf), None)
    assert (found.verified, found.problems, found.notes) == (1, (), ())


async def test_a_signed_decision_replayed_after_its_window_is_refused_on_record_naming_why(lf, sim):
    task_id, handle, rid = await open_approval(lf)
    old = datetime.now(UTC) - timedelta(minutes=11)
    payload = people.signed_payload(demo_key("director"), task_id, rid, "approve", issued_at=old)
    sent = await people.relay(lf.settings, task_id, payload)
    assert sent.status == "rejected"
    assert sent.detail.startswith(
        f"issued at {old.replace(microsecond=old.microsecond // 1000 * 1000).isoformat()}"
    )
    assert "before it arrived at" in sent.detail and sent.detail.endswith("outside the 10 min 0 s window")
    ahead = people.signed_payload(
        demo_key("director"), task_id, rid, "approve", issued_at=datetime.now(UTC) + timedelta(hours=1)
    )
    told = await people.relay(lf.settings, task_id, ahead)
    assert told.status == "rejected" and "after it arrived at" in told.detail
    assert decisions(lf, task_id) == []  # nothing was accepted; both refusals are on record (their markers)
    fresh = await people.decide(lf.settings, demo_key("director"), task_id, rid, "approve")
    assert fresh.status == "accepted"
    assert (await handle.result()).state == "Completed"


async def test_a_decision_signed_without_an_issued_at_time_is_refused_naming_why(lf, sim):
    task_id, handle, rid = await open_approval(lf)
    key = demo_key("director")
    did = str(uuid.uuid4())
    v2 = canonical(task_id, did, rid, "approve", "director", key.key_id, None, None, "")
    payload = {
        "decision_id": did,
        "request_id": rid,
        "decision": "approve",
        "approver": "director",
        "key_id": key.key_id,
        "note": "",
        "signature": key.sign(v2),
    }
    sent = await people.relay(lf.settings, task_id, payload)
    assert (sent.status, sent.detail) == (
        "rejected",
        "signed without an issued-at time (decision format v2): sign it again with a current ledgerflow",
    )
    await handle.cancel()


async def test_a_decision_forged_with_a_workers_credentials_fails_the_audit(lf, sim, pg_url):
    """A worker's login may insert events. In one task it records an approval nobody signed; in another it
    copies a real signature onto a decision the approver did not sign (abort, where they signed approve).
    The workflows act on them (that is what the credential allows), but the audit names each."""
    (first, first_run, rid1), (second, second_run, rid2) = [await open_approval(lf) for _ in range(2)]
    password = "forger-worker-password-0123"
    roles.ensure_logins(pg_url, {roles.ENV["worker"]: password})
    url = sa.engine.make_url(pg_url).set(username=roles.USERS["worker"], password=password)
    worker = Recorder(url.render_as_string(hide_password=False))
    try:
        unsigned = HumanDecision(request_id=rid1, decision="approve", approver="director")
        worker.append_idempotent(first, to_new(unsigned, dedup_key=resolution_key(first, rid1)))
        genuine = people.signed_payload(demo_key("director"), second, rid2, "approve")
        message = canonical(
            second,
            genuine["decision_id"],
            rid2,
            "approve",
            "director",
            "demo-director",
            None,
            None,
            "",
            genuine["issued_at"],
        )
        altered = HumanDecision(
            request_id=rid2,
            decision="abort",
            approver="director",
            decision_id=genuine["decision_id"],
            key_id="demo-director",
            signed=message,
            signature=genuine["signature"],
            issued_at=datetime.fromisoformat(genuine["issued_at"].replace("Z", "+00:00")),
            received_at=datetime.now(UTC),
        )
        worker.append_idempotent(second, to_new(altered, dedup_key=resolution_key(second, rid2)))
    finally:
        worker.dispose()
    for run in (first_run, second_run):
        await run.signal("decide", {})  # wakes the loop: it reads the forged resolution and acts on it
        await run.result()
    report = await audit(lf.settings, lf.recorder, lf.client, [first])
    [forged] = decisions(lf, first)
    assert report.tasks[0].problems() == [
        f"#{forged.seq} approve by director: recorded without its signature: nothing proves it was signed"
    ]
    assert report.lines()[0].startswith(f"{first}: FAILED: #{forged.seq} approve by director")
    report = await audit(lf.settings, lf.recorder, lf.client, [second])
    [copied] = decisions(lf, second)
    assert report.tasks[0].problems() == [
        f"#{copied.seq} abort by director: the record differs from what was signed (decision)"
    ]


async def test_a_key_registered_after_or_revoked_before_its_decision_arrived_fails_the_audit(lf, sim):
    task_id, handle, rid = await open_approval(lf)
    assert (
        await people.decide(lf.settings, demo_key("director"), task_id, rid, "approve")
    ).status == "accepted"
    await handle.result()
    events = lf.recorder.read_events(task_id)
    [stored] = decisions(lf, task_id)
    arrived = parse(stored).received_at
    registry = lf.recorder.key_registry()
    director = registry["demo-director"]
    later = {**registry, "demo-director": replace(director, added_at=arrived + timedelta(seconds=1))}
    found = audit_signatures(task_id, events, Keys(later, verify, WINDOW), None)
    assert found.verified == 0 and len(found.problems) == 1
    assert "key demo-director was registered at" in found.problems[0]
    assert f"after the decision arrived at {arrived.isoformat()}" in found.problems[0]
    revoked = {**registry, "demo-director": replace(director, revoked_at=arrived - timedelta(seconds=1))}
    found = audit_signatures(task_id, events, Keys(revoked, verify, WINDOW), None)
    assert len(found.problems) == 1 and "key demo-director was revoked at" in found.problems[0]
    # Revoked after it arrived: the decision stands.
    after = {**registry, "demo-director": replace(director, revoked_at=arrived + timedelta(seconds=1))}
    assert audit_signatures(task_id, events, Keys(after, verify, WINDOW), None).problems == ()


async def test_a_decision_recorded_before_signatures_were_kept_still_passes_flagged(lf, sim):
    """An event as earlier releases recorded it (no signed message, no issued-at) is accepted as recorded
    then and flagged; the same event recorded after this database began keeping signatures fails."""
    task_id, handle, rid = await open_approval(lf)
    assert (
        await people.decide(lf.settings, demo_key("director"), task_id, rid, "approve")
    ).status == "accepted"
    await handle.result()
    events = lf.recorder.read_events(task_id)
    i = next(n for n, e in enumerate(events) if e.type == "HumanDecision")
    legacy = {
        k: v
        for k, v in events[i].payload.items()
        if k not in ("signed", "signature", "issued_at", "received_at")
    }
    old = [*events[:i], events[i].model_copy(update={"payload": legacy}), *events[i + 1 :]]
    since = lf.recorder.decisions_signed_since()
    assert since < events[i].recorded_at  # this database keeps signatures: the session's ledger is new
    flagged = audit_signatures(task_id, old, keys(lf), events[i].recorded_at + timedelta(seconds=1))
    assert flagged.problems == () and flagged.verified == 1
    assert flagged.notes == (
        f"#{events[i].seq} approve by director: signed before issued-at (recorded before decisions kept their"
        " signature; accepted as recorded then)",
    )
    failed = audit_signatures(task_id, old, keys(lf), since)
    assert failed.problems == (
        f"#{events[i].seq} approve by director: recorded without its signature: nothing proves it was signed",
    )
    # issued_now is what the CLI signs: the browser's toISOString form.
    assert issued_now(datetime(2026, 12, 3, 10, 0, 0, 120000, tzinfo=UTC)) == "2026-12-03T10:00:00.120Z"
