"""``make bench-2k`` / ``make bench-10k``: one very wide task, end to end, on the embedded stack.

The plan is ``--fan-outs`` chained 500-wide fan-outs of ``llm.text`` (4 → 2,002 nodes with compose and
review; 20 → 10,002) against the simulator at zero latency, so the figure is the orchestration's own: the
loop, the ledger, Temporal, and continue-as-new along the way (a run hands over every 10,000 history events).
It reports wall time from the start of the workflow to its end, nodes per second, how many runs the task took,
the completion → dispatch hop, and checks the money from the vendor's own charge list: no duplicate charge,
one charge per paid outcome, ledger total = vendor total. Exit 1 if a check fails or the run took longer
than ``--limit`` seconds.

    python -m bench.scale --fan-outs 4 --limit 120
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from ledgerflow import client as lf
from ledgerflow.runs.soak import run_soak
from runtime.settings import Settings
from workflows.contracts import workflow_id

WIDTH = 500  # the plan validator's largest fan-out
ZERO_LATENCY = {"seed": 0, "default": {"latency_seconds": 0}}


def plan(fan_outs: int) -> str:
    stages = [
        f"  - {{id: s{i:02d}, executor: llm.text, estimate: 0.01, fan_out: {WIDTH}, canary: false"
        + (f", depends_on: [s{i - 1:02d}]}}" if i else "}")
        for i in range(fan_outs)
    ]
    nodes = fan_outs * WIDTH + 2
    return "\n".join(
        [
            f"goal: {fan_outs} chained {WIDTH}-wide fan-outs ({nodes:,} nodes with compose and review)",
            f"budget_ceiling: {fan_outs * WIDTH}",
            "stages:",
            *stages,
        ]
    )


async def main(fan_outs: int, limit: float) -> int:
    report = await run_soak(Settings(), plan(fan_outs), 1, ZERO_LATENCY, workers=1, timeout=limit * 5)
    client = await lf.connect(Settings())
    (task_id,) = report.task_ids
    runs = [w async for w in client.list_workflows(f"WorkflowId = '{workflow_id(task_id)}'")]
    nodes = fan_outs * WIDTH + 2
    p50, p95 = report.hop(0.5), report.hop(0.95)
    print(f"plan: {fan_outs} chained {WIDTH}-wide fan-outs, {nodes:,} nodes")
    print(f"end state: {dict(report.end_states)}; runs (continue-as-new): {len(runs)}")
    print(
        f"wall time: {report.wall_seconds:.1f} s ({nodes / report.wall_seconds:.1f} nodes/s),"
        f" limit {limit:.0f} s"
    )
    if p50 is not None and p95 is not None:
        print(f"completion → dispatch: p50 {p50 * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms")
    print(
        f"money: {report.duplicate_charges} duplicate charges, {report.outcomes} paid outcomes /"
        f" {report.operations} vendor charges, ledger {report.ledger_total} = vendor {report.vendor_total}"
    )
    ok = (
        report.all_completed
        and report.clean
        and report.outcomes == report.operations
        and report.wall_seconds <= limit
    )
    print("target met" if ok else "TARGET NOT MET")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fan-outs", type=int, default=4, help="chained 500-wide fan-outs")
    parser.add_argument("--limit", type=float, default=120.0, help="seconds the run may take")
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.fan_outs, args.limit)))
