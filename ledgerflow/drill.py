"""``ledgerflow drill``: a seeded random crash campaign against the embedded stack (seed 003's crash drill).

A workload of small paid pipelines runs on worker subprocesses. Again and again, a worker is started with a
random fault point (``ledgerflow.faults.POINTS``) at which it freezes; the drill SIGKILLs it there and starts
a fresh worker, until the requested number of kills is reached; then every task must still finish. Report:
kills, recovery time (kill → the killed task's next ledger event) p50/p95, duplicate charges, ledger vs
vendor total difference, orphaned INTENTs, tasks completed.
"""

from __future__ import annotations

import asyncio
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
from rich.table import Table

from ledgerflow import client as lf
from ledgerflow import stack
from ledgerflow.config import Settings
from ledgerflow.faults import POINTS
from rules.events import vendor_spend
from rules.keys import is_result_key
from rules.projection import fold
from workflows.task import TaskInput, TaskWorkflow, workflow_id

ROOT = Path(__file__).resolve().parent.parent
PLAN = """
goal: drill pipeline {n}
budget_ceiling: 50
stages:
  - {{id: script, executor: llm.text, estimate: 0.10}}
  - {{id: shots, executor: image.keyframe, estimate: 0.40, depends_on: [script], fan_out: 3, canary: false}}
  - {{id: edit, executor: edit.assembly, estimate: 0.20, depends_on: [shots]}}
"""
SIM_CONFIG = {
    "seed": 0,
    "default": {"latency_seconds": 0.3},
    "executors": {"image.keyframe": {"latency_seconds": 0.6}},
}


class WorkerProcess:
    """A worker subprocess whose ``MARK`` lines are read on a thread; optionally frozen at a fault point."""

    def __init__(self, env: dict[str, str], log: Path, hold_at: str | None = None) -> None:
        full = {**os.environ, **env, "LEDGERFLOW_MARKS": "1"}
        if hold_at:
            full["LEDGERFLOW_HOLD_AT"] = hold_at
        self.lines: queue.Queue[str] = queue.Queue()
        self._log = log.open("a")
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "worker.py")],
            env=full,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            if line.startswith("MARK "):
                self.lines.put(line.strip())

    def wait_held(self, timeout: float) -> str | None:
        """The ``MARK held …`` line once the worker froze at its fault point, or None on timeout."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                return None
            if line.startswith("MARK held "):
                return line
        return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()


@dataclass
class DrillReport:
    kills: int = 0
    recoveries: list[float] = field(default_factory=list)
    tasks: int = 0
    completed: int = 0
    duplicate_charges: int = 0
    ledger_total: Decimal = Decimal(0)
    vendor_total: Decimal = Decimal(0)
    orphaned_intents: int = 0
    points: dict[str, int] = field(default_factory=dict)

    def table(self) -> Table:
        def pct(q: float) -> str:
            if not self.recoveries:
                return "—"
            ordered = sorted(self.recoveries)
            return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))]:.1f}s"

        t = Table(title="ledgerflow drill", title_justify="left")
        t.add_column("measure")
        t.add_column("value", justify="right")
        t.add_row("kills", str(self.kills))
        t.add_row("recovery p50 / p95", f"{pct(0.5)} / {pct(0.95)}")
        t.add_row("duplicate charges", str(self.duplicate_charges))
        t.add_row("ledger − vendor total", str(self.ledger_total - self.vendor_total))
        t.add_row("orphaned INTENTs", str(self.orphaned_intents))
        t.add_row("tasks completed", f"{self.completed} / {self.tasks}")
        t.caption = "kills by point: " + ", ".join(f"{k} {v}" for k, v in sorted(self.points.items()))
        return t

    @property
    def clean(self) -> bool:
        return (
            self.duplicate_charges == 0
            and self.ledger_total == self.vendor_total
            and self.orphaned_intents == 0
            and self.completed == self.tasks
        )


async def run_drill(settings: Settings, kills: int, seed: int, tasks: int) -> DrillReport:
    rng = random.Random(seed)
    info = stack.up(settings, with_worker=False)
    settings = Settings(
        temporal_address=info["temporal_address"],
        database_url=info["database_url"],
        vendor_url=info["vendor_url"],
        task_queue=f"drill-{seed}-{uuid.uuid4().hex[:6]}",
    )
    httpx.put(f"{settings.vendor_url}/admin/config", json=SIM_CONFIG, timeout=10).raise_for_status()
    env = {
        "LEDGERFLOW_TEMPORAL_ADDRESS": str(settings.temporal_address),
        "LEDGERFLOW_DATABASE_URL": str(settings.database_url),
        "LEDGERFLOW_VENDOR_URL": str(settings.vendor_url),
        "LEDGERFLOW_TASK_QUEUE": settings.task_queue,
        "LEDGERFLOW_ARTIFACT_DIR": str((settings.state_dir / "artifacts").resolve()),
        "LEDGERFLOW_POLL_INTERVAL_SECONDS": "0.05",
    }
    log = (settings.state_dir / "logs").resolve()
    log.mkdir(parents=True, exist_ok=True)
    client = await lf.connect(settings)
    rec = lf.recorder(settings)
    report = DrillReport()
    handles: list[Any] = []
    prefix = f"drill{seed}-{uuid.uuid4().hex[:4]}"

    async def start_task() -> None:
        n = len(handles)
        tid = f"{prefix}-{n:03d}"
        plan = lf.parse_plan(PLAN.format(n=n), tid)
        # A short heartbeat timeout: Temporal hands a dead worker's activity to the next worker in seconds.
        inp = TaskInput(task_id=tid, plan=plan, heartbeat_timeout_seconds=3)
        handles.append(
            await client.start_workflow(
                TaskWorkflow.run, inp, id=workflow_id(tid), task_queue=settings.task_queue
            )
        )

    for _ in range(tasks):
        await start_task()
    try:
        while report.kills < kills:
            point = rng.choice(POINTS)
            worker = WorkerProcess(env, log / "drill-worker.log", hold_at=point)
            held = await asyncio.to_thread(worker.wait_held, 30.0)
            if held is None:  # the point was not reached (the workload may be done): more work, next point
                worker.kill()
                await start_task()
                continue
            worker.kill()
            killed_at = time.monotonic()
            report.kills += 1
            report.points[point] = report.points.get(point, 0) + 1
            task = _task_of(held, prefix)
            before = len(rec.read_events(task)) if task else 0
            survivor = WorkerProcess(env, log / "drill-worker.log")
            if task:
                report.recoveries.append(await _recovered(rec, task, before, killed_at))
            survivor.kill()
            if all(_done(rec, h) for h in handles):
                await start_task()
        final = WorkerProcess(env, log / "drill-worker.log")
        try:
            for h in handles:
                await asyncio.wait_for(h.result(), timeout=180)
        finally:
            final.kill()
        await _tally(report, rec, settings, [h.id.removeprefix("ledgerflow-task-") for h in handles])
    finally:
        rec.dispose()
    return report


def vendor_charges(vendor_url: str, task_ids: list[str]) -> tuple[int, Decimal]:
    """From the vendor's own charge list, for these tasks: duplicate charges (more than one per
    OperationKey) and the total charged."""
    charges = httpx.get(f"{vendor_url}/charges", timeout=10).json()["charges"]
    tasks = set(task_ids)
    mine = [c for c in charges if c["idempotency_key"].split(":")[0] in tasks]
    keys = [c["idempotency_key"] for c in mine]
    return len(keys) - len(set(keys)), sum((Decimal(c["amount"]) for c in mine), Decimal(0))


def _task_of(held: str, prefix: str) -> str | None:
    for word in held.split():
        value = word.partition("=")[2]
        if value.startswith(prefix):
            return value.split(":")[0]
    return None


def _done(rec: Any, handle: Any) -> bool:
    events = rec.read_events(handle.id.removeprefix("ledgerflow-task-"))
    return bool(events) and fold(events).terminal


async def _recovered(rec: Any, task: str, before: int, killed_at: float, timeout: float = 120.0) -> float:
    """Seconds from the kill until the killed task's ledger grows again (or it is finished)."""
    while time.monotonic() - killed_at < timeout:
        events = rec.read_events(task)
        if len(events) > before or fold(events).terminal:
            return time.monotonic() - killed_at
        await asyncio.sleep(0.1)
    return timeout


async def _tally(report: DrillReport, rec: Any, settings: Settings, task_ids: list[str]) -> None:
    report.duplicate_charges, report.vendor_total = vendor_charges(str(settings.vendor_url), task_ids)
    report.tasks = len(task_ids)
    for tid in task_ids:
        events = rec.read_events(tid)
        p = fold(events)
        report.completed += p.state.value == "Completed"
        resolved = {e.operation_key for e in events if is_result_key(e.dedup_key)}
        report.ledger_total += vendor_spend(events)
        for e in events:
            if e.type == "Intent" and e.operation_key and e.payload["action"]["kind"] == "Dispatch":
                report.orphaned_intents += e.operation_key not in resolved
