"""A quick job's id is written with its result, not on its own (issue 28: fewer ledger writes per node).

Where the vendor deduplicates on our key and finds a job by it (an idempotent route), the INTENT is the
first send's write-ahead (no ``submitting`` marker of its own), and the job id is written by the first poll
that sees the job still running after RECORD_RUNNING_AFTER_S (2 s) — or, for a job that ends by then, with
its result: two writes for a quick node. Where it cannot (a route in mode ``none``), a marker precedes the
send and the id is written the moment the vendor answers, as before: it is the only way back to the job after
a crash. The crash between the vendor's answer and the first poll is tests/faults/test_vendor_faults.py
(one charge in idempotent and lookup modes); the crash under the INTENT's write-ahead,
tests/faults/test_kill_points.py. The route's ok observation (what its breaker counts calls by) is written in
the result's transaction too.
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa

from rules.keys import operation_key
from rules.money import vendor_amount
from vendors.routes import RouteSpec, RouteTable, VendorMode

PLAN = """
goal: one paid shot
budget_ceiling: 20
review: {{reviewers: [compliance.rules]}}
stages:
  - {{id: shot, executor: {executor}, estimate: 1.5}}
"""


def kinds_of(lf: Any, task_id: str, op: str) -> list[str]:
    return [
        e.payload.get("kind") or e.type for e in lf.recorder.read_events(task_id) if e.operation_key == op
    ]


@pytest.mark.parametrize(
    ("mode", "latency", "expected"),
    [
        # Ends at once, or within RECORD_RUNNING_AFTER_S: its id arrives with the Outcome.
        (VendorMode.IDEMPOTENT, 0.01, ["Intent", "Outcome"]),
        (VendorMode.IDEMPOTENT, 1.0, ["Intent", "Outcome"]),
        # Still running after it: on record from then on.
        (VendorMode.IDEMPOTENT, 3.0, ["Intent", "Progress", "Outcome"]),
        # A vendor that cannot find the job by our key: the id is written at once, however quick the job.
        (VendorMode.NONE, 0.01, ["Intent", "submitting", "Progress", "Outcome"]),
    ],
)
async def test_the_job_id_is_written_alone_only_where_it_is_the_way_back(
    lf_with, sim, mode, latency, expected
):
    name = f"video.{uuid.uuid4().hex[:8]}"
    async with lf_with(routes=RouteTable(routes={name: RouteSpec(mode=mode)})) as lf:
        await sim.configure(mode=mode.value, executors={name: {"latency_seconds": latency}})
        plan = lf.plan(PLAN.format(executor=name))
        handle = await lf.start(plan)
        assert (await handle.result()).state == "Completed"
    op = operation_key(plan.task_id, "shot", 1)
    assert kinds_of(lf, plan.task_id, op) == expected
    [charge] = await sim.charges(op)
    [outcome] = [
        e for e in lf.recorder.read_events(plan.task_id) if e.type == "Outcome" and e.operation_key == op
    ]
    assert outcome.payload["job_id"] == charge["job_id"]
    assert Decimal(str(outcome.payload["actual_cost"])) == vendor_amount(charge["amount"]).amount
    # The route's breaker still hears of the call: its ok observation, written with the result.
    with lf.recorder.reader.connect() as conn:
        seen = conn.execute(
            sa.text("SELECT kind, operation_key FROM route_observations WHERE route = :r AND kind = 'ok'"),
            {"r": name},
        ).all()
    assert [tuple(row) for row in seen] == [("ok", op)]
