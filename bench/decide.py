"""The CPU cost of one decision (``rules.table.decide``) at 10, 1,000 and 10,000 nodes, and the largest plan.

Pure CPU, no servers: a plan of chained fan-outs is folded from real ledger events (``rules.events``), its
first stage run to completion, then a window of the second stage is decided the way the workflow decides it
(decide, record the Dispatch, and when the rules say Wait, complete the oldest node in flight). Each
decision's CPU time (``time.process_time``) is measured; so is the first activation (fold the TaskCreated,
decide until the first Wait: what the workflow's first workflow task does, and what the SDK's 2 s deadlock
detector watches).

    python -m bench.decide [--sizes 10 1000 10000] [--window 300]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from rules.actions import Dispatch, Wait
from rules.envelope import StoredEvent
from rules.events import ArtifactRef, Intent, Outcome, TaskCreated, to_new
from rules.plan import MAX_FAN_OUT, MAX_NODES, MAX_STAGES, Plan, validate_plan
from rules.projection import Projection, apply, new_projection
from rules.table import advance, decide
from vendors.routes import DEFAULT_ROUTES

T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)


def chained_plan(nodes: int) -> Plan:
    """About ``nodes`` nodes: the fewest chained fan-outs of at most MAX_FAN_OUT (plus compose and review)."""
    stages = max(1, min(MAX_STAGES, -(-(nodes - 2) // MAX_FAN_OUT)))
    width = max(1, min(MAX_FAN_OUT, (nodes - 2) // stages))
    raw: dict[str, Any] = {
        "goal": f"decision benchmark, {stages} x {width}",
        "budget_ceiling": "1000000",
        "time_ceiling": "30d",
        "stages": [
            {
                "id": f"s{i}",
                "executor": "llm.text",
                "estimate": "0.01",
                "fan_out": width,
                "canary": False,
                "depends_on": [f"s{i - 1}"] if i else [],
            }
            for i in range(stages)
        ],
    }
    return validate_plan(raw, DEFAULT_ROUTES)


class Ledger:
    """A task's events as the ledger stores them (seq, server time), folded as they are appended."""

    def __init__(self, plan: Plan) -> None:
        self.task_id = "bench"
        self.now = T0
        self.seq = 0
        created = self._stored(to_new(TaskCreated(plan=plan), dedup_key="bench:created"))
        self.p: Projection = new_projection(created)
        self.intents = 0
        self.folding: list[float] = []  # CPU seconds of each event's fold (parse + apply)

    def _stored(self, new: Any) -> StoredEvent:
        self.seq += 1
        self.now += timedelta(milliseconds=10)
        return new.stored(self.task_id, self.seq, 1, self.now)

    def append(self, event: Any, key: str, op: str | None = None) -> None:
        stored = self._stored(to_new(event, dedup_key=key, operation_key=op))
        t = time.process_time()
        apply(self.p, stored)
        self.folding.append(time.process_time() - t)

    def dispatch(self, d: Dispatch) -> None:
        self.intents += 1
        intent = Intent(
            action=d, rule="R11", watermark=self.p.watermark, decided_at=self.now, reservation=d.estimate
        )
        self.append(intent, f"bench:intent:{self.intents}", d.operation_key)

    def outcome(self, node: str, op: str) -> None:
        ref = ArtifactRef(uri=f"file:///a/{op}", sha256=f"{self.seq:064x}", size=1)
        self.append(
            Outcome(node=node, operation_key=op, job_id=f"j-{op}", artifact=ref, actual_cost=Decimal("0.01")),
            f"{op}:result",
            op,
        )


def first_activation(plan: Plan) -> tuple[float, int]:
    """CPU seconds to fold the TaskCreated and decide until the first Wait, and the dispatches made."""
    t = time.process_time()
    ledger = Ledger(plan)
    made = 0
    while True:
        decided = decide(ledger.p, ledger.now)
        assert decided is not None
        _, action = decided
        if not isinstance(action, Dispatch):
            break
        ledger.dispatch(action)
        made += 1
    return time.process_time() - t, made


def window(plan: Plan, decisions: int) -> tuple[list[float], list[float]]:
    """CPU seconds of each of ``decisions`` decisions in the second stage of a run (or the first, if alone),
    and of each event folded meanwhile."""
    ledger = Ledger(plan)
    p = ledger.p
    first = p.graph.stage_nodes[plan.stages[0].id]
    if len(plan.stages) > 1:  # run the first stage to completion without measuring
        for node in first:
            d = advance(p, p.nodes[node], ledger.now)
            assert isinstance(d, Dispatch)
            ledger.dispatch(d)
            ledger.outcome(node, d.operation_key)
    ledger.folding.clear()
    in_flight: deque[tuple[str, str]] = deque()
    samples: list[float] = []
    while len(samples) < decisions:
        t = time.process_time()
        decided = decide(p, ledger.now)
        samples.append(time.process_time() - t)
        if decided is None:
            break
        _, action = decided
        if isinstance(action, Dispatch):
            ledger.dispatch(action)
            in_flight.append((action.node, action.operation_key))
        elif isinstance(action, Wait) and in_flight:
            ledger.outcome(*in_flight.popleft())
        else:
            break  # complete, or the plan ran out of nodes
    return samples, ledger.folding


# Mean CPU per decision the performance issue asks for, by plan size (nodes at most).
TARGETS_MS = {1000: 5.0, 10000: 20.0}
DEADLOCK_S = 2.0  # the Python SDK fails a workflow task whose activation holds the thread longer


def main(sizes: list[int], decisions: int) -> None:
    means: dict[int, float] = {}
    print(
        f"{'nodes':>7} {'decision CPU ms: mean':>22} {'p95':>7} {'max':>7} {'fold ms/event':>14} "
        f"{'first activation ms':>20}"
    )
    for size in sizes:
        plan = chained_plan(size)
        nodes = sum(len(s.items()) or 1 for s in plan.all_stages())
        samples, folding = window(plan, decisions)
        first, made = first_activation(plan)
        ms = sorted(s * 1000 for s in samples)
        means[nodes] = statistics.mean(ms)
        print(
            f"{nodes:7d} {statistics.mean(ms):22.3f} {ms[int(len(ms) * 0.95) - 1]:7.3f} {ms[-1]:7.3f} "
            f"{statistics.mean(folding) * 1000:14.3f} {first * 1000:13.1f} ({made} dispatched)"
        )
    for limit, target in TARGETS_MS.items():
        for n, mean in means.items():
            if limit / 2 < n <= limit:
                verdict = "met" if mean <= target else "NOT MET"
                print(f"target: a decision at {n} nodes <= {target:g} ms CPU: {mean:.3f} ms  {verdict}")
    t = time.process_time()
    largest = chained_plan(MAX_NODES)
    built = time.process_time() - t
    first, made = first_activation(largest)
    nodes = sum(len(s.items()) or 1 for s in largest.all_stages())
    print(
        f"largest plan the validator accepts: {nodes} nodes; validation {built * 1000:.0f} ms, "
        f"first activation {first * 1000:.0f} ms ({made} dispatched)"
    )
    verdict = "met" if first < DEADLOCK_S / 4 else "NOT MET"
    print(f"target: its first activation well under the SDK's {DEADLOCK_S:g} s deadlock detector: {verdict}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 1000, 10000])
    parser.add_argument("--window", type=int, default=300, help="decisions measured per size")
    args = parser.parse_args()
    main(args.sizes, args.window)
