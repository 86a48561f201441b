"""The orphan scan never takes over a task whose run ended while the scan looked (found in the session-13
soak: 112 needless takeover runs of 500 tasks, each starting, folding and ending, and the soak's count of
settled runs reached 500 with four tasks still running).

The scan reads the ledger first and asks Temporal second; a run that writes its last events and completes in
between looks orphaned: ledger open, workflow completed. Here the Temporal client the scan is given answers
``describe`` only once the task's real run has completed, so the race happens every time.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from temporalio.client import Client

from reconcile.scans import Runs, ScanInput, scan_orphans
from reconcile.takeover import needs_a_run
from rules.projection import fold
from vendors.routes import RouteSpec, RouteTable
from workflows.contracts import workflow_id

PLAN = """
goal: one slow shot
budget_ceiling: 20
review: {{reviewers: [compliance.rules]}}
stages:
  - {{id: shot, executor: {executor}, estimate: 1.5}}
"""


class EndsBeforeItAnswers:
    """Temporal's client, except that ``describe`` waits for the workflow's run to complete first."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def get_workflow_handle(self, wid: str) -> Any:
        handle = self.client.get_workflow_handle(wid)

        class Handle:
            async def describe(self) -> Any:
                await handle.result()
                return await handle.describe()

        return Handle()


async def test_a_run_that_ends_while_the_scan_looks_is_not_taken_over(lf_with: Any, sim: Any) -> None:
    name = f"video.{uuid.uuid4().hex[:8]}"
    taken: list[str] = []

    async def take_over(client: Client, p: Any) -> str:
        taken.append(p.task_id)
        return "not started"

    async with lf_with(routes=RouteTable(routes={name: RouteSpec()})) as lf:
        await sim.configure(executors={name: {"latency_seconds": 1.5}})
        plan = lf.plan(PLAN.format(executor=name))
        await lf.start(plan)
        for _ in range(200):  # until the run has opened the task and dispatched its shot
            if any(e.type == "Intent" for e in lf.recorder.read_events(plan.task_id)):
                break
            await asyncio.sleep(0.05)
        assert needs_a_run(fold(lf.recorder.read_events(plan.task_id))), "the task ended before the scan"
        report = await scan_orphans(
            lf.recorder,
            EndsBeforeItAnswers(lf.client),  # type: ignore[arg-type]
            Runs(workflow_id=workflow_id, take_over=take_over),
            lf.settings.task_queue,
            ScanInput(only=[plan.task_id]),
        )
    assert fold(lf.recorder.read_events(plan.task_id)).state.value == "Completed"
    assert report.looked_at == 1  # the first read saw it open
    assert taken == [] and report.found == [], report
