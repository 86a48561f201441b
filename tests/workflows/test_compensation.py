"""Compensation end to end: a task aborted after its compensable stage published undoes each published
output at the vendor — newest first, each an operation with its own INTENT — while its state is
Compensating, and only then is Failed. Money exact by the vendor's billing; the history replays. Real
Temporal, real Postgres, the simulator."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
from peoplekit import wait_open

from ledger.recorder import Recorder
from ledgerflow.views import people
from ledgerflow.views.audit import audit
from rules.events import vendor_spend
from rules.projection import fold
from runtime.signing import demo_key
from vendors.routes import RouteSpec, RouteTable

PLAN = """
goal: publish two clips, then a person aborts
project: {project}
budget_ceiling: 20
reuse: project
approval: {{timeout: 1h, policy: escalate}}
stages:
  - {{id: publish, executor: {pub}, estimate: 1, fan_out: 2, canary: false,
      compensation: {{executor: {unpub}, estimate: 0.5, input: {{action: unpublish}}}}}}
  - {{id: board, executor: {pub}, estimate: 1, depends_on: [publish], approval: true}}
"""


async def test_an_aborted_task_unpublishes_what_it_published_before_it_is_failed(
    lf_with: Any, sim: Any, recorder: Recorder
) -> None:
    u = uuid.uuid4().hex[:8]
    pub, unpub = f"pub-{u}", f"unpub-{u}"
    # An unpublish finishes with no file, as real ones do: its receipt is what the ledger registers.
    await sim.configure(executors={unpub: {"latency_seconds": 0.5, "no_result": True}})
    routes = RouteTable(routes={pub: RouteSpec(), unpub: RouteSpec()})
    async with lf_with(routes=routes) as lf:
        plan = lf.plan(PLAN.format(project=f"cp-{u}", pub=pub, unpub=unpub))
        handle = await lf.start(plan)
        rid = await wait_open(lf, plan.task_id, "approval:board")
        sent = await people.decide(lf.settings, demo_key("producer"), plan.task_id, rid, "abort")
        assert sent.status == "accepted"
        status = await lf.wait_state(handle, {"Compensating"})  # aborted, not final yet
        assert status["terminal_reason"] == "aborted by producer"
        # A published clip whose undo is in flight reads "compensating" (issue 26 §4).
        while not any(n["state"] == "compensating" for n in status["nodes"].values()):
            assert status["state"] == "Compensating", f"no node was seen compensating: {status['nodes']}"
            await asyncio.sleep(0.05)
            status = await handle.query("status")
        assert {n for n, v in status["nodes"].items() if v["state"] == "compensating"} <= {
            "publish/S01",
            "publish/S02",
        }
        result = await handle.result()
        report = await audit(lf.settings, lf.recorder, lf.client, [plan.task_id], billing=True)
        # The same plan again in the project (reuse: project): the unpublished clips are not reused.
        again = lf.plan(PLAN.format(project=f"cp-{u}", pub=pub, unpub=unpub))
        second = await lf.start(again)
        await wait_open(lf, again.task_id, "approval:board")
        await second.terminate("test over")

    assert result.state == "Failed"
    assert {v["state"] for v in result.summary["compensations"].values()} == {"undone"}
    events = recorder.read_events(plan.task_id)
    p = fold(events)
    published = sorted(
        (
            e
            for e in events
            if e.type == "Outcome" and re.fullmatch(r".*:publish/S0\d:a1", str(e.operation_key))
        ),
        key=lambda e: e.seq,
    )
    undos = [e for e in events if e.type == "Intent" and e.payload["action"]["kind"] == "Compensate"]
    aborted = next(e for e in events if e.type == "Intent" and e.payload["action"]["kind"] == "Escalate")
    # Each published output undone once, newest first, after the abort was recorded.
    assert [u.payload["action"]["compensates"] for u in undos] == [
        e.operation_key for e in reversed(published)
    ]
    assert all(u.seq > aborted.seq for u in undos) and all(v.done for v in p.compensations.values())

    # At the vendor: one unpublish job per published job, naming it.
    charges = await sim.charges(f"{plan.task_id}:")
    keys = [c["idempotency_key"] for c in charges]
    assert len(keys) == len(set(keys)), "a key was charged twice"
    jobs = {c["job_id"]: c for c in charges}
    undone = {
        httpx.get(f"{sim.url}/admin/jobs/{j}").json()["input"]["compensates"]["job_id"]
        for j, c in jobs.items()
        if c["executor"] == unpub
    }
    assert undone == {e.payload["job_id"] for e in published}
    receipts = [e for e in events if e.type == "Outcome" and ":undo" in str(e.operation_key)]
    assert len(receipts) == 2
    for r in receipts:
        receipt = json.loads(Path(urlparse(r.payload["artifact"]["uri"]).path).read_bytes())
        assert receipt["undoes"]["operation_key"] == r.operation_key.removesuffix(":undo1")
    assert vendor_spend(events) == await sim.total(f"{plan.task_id}:")
    assert recorder.account(f"task:{plan.task_id}").reserved == 0  # type: ignore[union-attr]
    republished = [
        e
        for e in recorder.read_events(again.task_id)
        if e.type == "Outcome" and ":publish/" in str(e.operation_key)
    ]
    assert len(republished) == 2 and all(e.payload.get("reused_from") is None for e in republished)
    # The audit: every decision (the compensating phase's too) recomputes, the accounts match, the history
    # replays, and each vendor charge is matched to its operation (the undos included).
    assert report.ok, report.lines()
    [audited] = report.tasks
    assert audited.replay is not None and audited.replay.replayed == 1
    assert audited.billing is not None and (audited.billing.matched, audited.billing.operations) == (5, 5)
