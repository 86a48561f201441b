"""The baseline: the same DAG as a hand-written Temporal workflow, one activity per stage, no ledger.

Each stage does what a careful hand-written pipeline does at minimum: submit to the vendor with an
idempotency key, poll until done, fetch and hash-check the result. No ledger, no rules, no review.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from decimal import Decimal

from pydantic import BaseModel
from temporalio import activity, workflow

with workflow.unsafe.imports_passed_through():
    from vendors.adapter import JobStatus
    from vendors.jobs import JobsAdapter


class BareInput(BaseModel):
    run_id: str
    chain: list[str]
    fan_out: list[str]
    join: list[str]


class StageCall(BaseModel):
    key: str
    executor: str


class BareActivities:
    def __init__(self, vendor: JobsAdapter, poll_interval: float) -> None:
        self.vendor = vendor
        self.poll_interval = poll_interval

    @activity.defn(name="bare.stage")
    async def stage(self, call: StageCall) -> str:
        job = await self.vendor.submit(
            operation_key=call.key,
            executor=call.executor,
            request={"stage": call.key},
            estimate=Decimal("0.01"),
        )
        if job.status == JobStatus.RUNNING:
            job = await self.vendor.wait(job.id, poll_interval=self.poll_interval)
        await self.vendor.fetch_result(job)
        return job.id


@workflow.defn(name="BareDag")
class BareDag:
    @workflow.run
    async def run(self, inp: BareInput) -> int:
        async def stage(name: str) -> None:
            await workflow.execute_activity(
                "bare.stage",
                StageCall(key=f"{inp.run_id}:{name}", executor="llm.text"),
                start_to_close_timeout=timedelta(minutes=5),
            )

        for name in inp.chain:
            await stage(name)
        await asyncio.gather(*(stage(name) for name in inp.fan_out))
        for name in inp.join:
            await stage(name)
        return len(inp.chain) + len(inp.fan_out) + len(inp.join)
