"""Issue 26 §4: the states a node goes through, derived by the fold and shown by ``ledgerflow status``.

Real Temporal, Postgres, worker and simulator. ``ledgerflow status``'s source (``client.status``: the
workflow's query, each node's state from the ledger's fold) is polled while a task runs, and each node's
``state`` sequence is checked: leased (its INTENT recorded, the vendor not answered yet) → running (a job id)
→ waiting_human (its approval open) → succeeded, and cancelled for the nodes a task that ended never ran.
"""

from __future__ import annotations

import asyncio
from typing import Any

from peoplekit import wait_open

from ledgerflow import client
from ledgerflow.views import people
from rules.projection import NodeStatus, fold, node_state
from runtime.signing import demo_key

BOARD = """
goal: a storyboard a person approves, then two shots
budget_ceiling: 10
approval: {timeout: 1h, policy: escalate}
stages:
  - {id: board, executor: image.keyframe, estimate: 1, approval: true}
  - {id: shots, executor: video.motion, estimate: 1, depends_on: [board], fan_out: 2, canary: false}
"""


def collapse(seen: list[str]) -> list[str]:
    return [s for i, s in enumerate(seen) if i == 0 or seen[i - 1] != s]


async def test_a_node_goes_leased_running_waiting_human_succeeded_and_unrun_nodes_end_cancelled(lf, sim):
    # The vendor answers the submit after 0.8 s (the job exists meanwhile): the attempt is leased that long;
    # running once its id is on record, 2 s into the job (RECORD_RUNNING_AFTER_S).
    await sim.configure(
        executors={"image.keyframe": {"slow": 1.0, "slow_seconds": 0.8, "latency_seconds": 3.5}}
    )
    plan = lf.plan(BOARD)
    handle = await lf.start(plan)
    seen: dict[str, list[str]] = {}

    async def watch() -> None:
        while True:
            summary = await client.status(lf.settings, plan.task_id)
            for node, view in summary.get("nodes", {}).items():
                seen.setdefault(node, []).append(view["state"])
            if summary.get("state") in ("Completed", "Failed"):
                return
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    rid = await wait_open(lf, plan.task_id, "approval:")
    await asyncio.sleep(0.3)  # the status shows the open approval
    told = await people.decide(lf.settings, demo_key("director"), plan.task_id, rid, "abort", note="not this")
    assert told.status == "accepted"
    await handle.result()
    watcher.cancel()
    # Between its Outcome and the approval the next decision opens, the node is briefly "succeeded".
    board = [s for s in collapse(seen["board"]) if s not in ("pending", "succeeded")]
    assert board[:3] == ["leased", "running", "waiting_human"], seen["board"]
    final = fold(lf.recorder.read_events(plan.task_id))
    assert node_state(final, final.nodes["board"]) == NodeStatus.SUCCEEDED, "it was made; its approval ended"
    for shot in ("shots/S01", "shots/S02"):
        assert node_state(final, final.nodes[shot]) == NodeStatus.CANCELLED, f"{shot} never ran: cancelled"
    summary: Any = await handle.query("status")
    assert {n: v["state"] for n, v in summary["nodes"].items()} == {
        "board": "succeeded",
        "shots/S01": "cancelled",
        "shots/S02": "cancelled",
        "compose": "cancelled",  # the plan's own last steps: never reached either
        "review": "cancelled",
    }
