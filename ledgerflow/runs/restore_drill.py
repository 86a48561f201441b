"""``ledgerflow drill --scenario restore``: lose the ledger's database and restore it behind Temporal.

Paid work runs on a Postgres of the drill's own (WAL archiving on), against the simulator and Temporal. A
base backup is taken while tasks run; more tasks start; a recovery target is noted; more tasks start and
everything keeps running (the vendor keeps charging, Temporal's histories keep growing) for the data-loss
window; then the workers die with the database, whose data directory is deleted. The ledger is restored from
the base backup and the WAL archive to the target, ``ledgerflow.backup.after_restore`` brings the tasks back
in step with it, the workers come back, every task ends, and ``relearn`` records the figures that had to be
reconstructed. Then, from the vendor's own billing (its ``/charges``): every charge is in the ledger, none is
duplicated; every task ended; the audit passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
from rich.table import Table
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from ledger import migrate
from ledger.recorder import Recorder
from ledgerflow import backup
from ledgerflow.runs.drill import _money, charges_for
from ledgerflow.stack import pg
from ledgerflow.stack.services import register_demo_keys, start_worker
from rules.events import vendor_spend
from rules.operation import fold_operations
from rules.plan import load_plan
from rules.projection import fold
from runtime.settings import Settings
from vendors.routes import DEFAULT_ROUTES
from workflows.contracts import TaskInput, workflow_id
from workflows.task import TaskWorkflow

PLAN = """
goal: restore drill pipeline {n}
budget_ceiling: 50
stages:
  - {{id: script, executor: llm.text, estimate: 0.10}}
  - {{id: shots, executor: image.keyframe, estimate: 0.40, depends_on: [script], fan_out: 3}}
  - {{id: edit, executor: edit.assembly, estimate: 0.20, depends_on: [shots]}}
"""
# The second wave's tasks: a slow motion job, charged when it starts, still running at the loss.
LONG_PLAN = """
goal: restore drill pipeline {n}, with a long shot
budget_ceiling: 50
stages:
  - {{id: script, executor: llm.text, estimate: 0.10}}
  - {{id: shots, executor: image.keyframe, estimate: 0.40, depends_on: [script], fan_out: 2}}
  - {{id: motion, executor: video.motion, estimate: 1.50, depends_on: [shots]}}
  - {{id: edit, executor: edit.assembly, estimate: 0.20, depends_on: [motion]}}
"""
SIM_CONFIG: dict[str, Any] = {
    "seed": 0,
    "default": {"latency_seconds": 0.4},
    "executors": {"image.keyframe": {"latency_seconds": 0.8}, "video.motion": {"latency_seconds": 12.0}},
    "mode": "idempotent",
}
HEARTBEAT_S = 3.0
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RestoreReport:
    prefix: str = ""  # every task id of the drill starts with it
    tasks: int = 0
    ended: int = 0  # in a terminal state with no operation open
    completed: int = 0
    vendor_charges: int = 0  # generations the vendor charged for the drill's tasks
    vendor_total: Decimal = Decimal(0)
    ledger_charges: int = 0  # … of which in the ledger after the drill (the job on record, the figure equal)
    ledger_total: Decimal = Decimal(0)  # what the ledger counts as paid to vendors for them
    missing_at_restore: int = 0  # charges the restored ledger had no result for
    reconstructed: int = 0  # figures recorded with a cost anomaly: re-learned after the restore
    late_charges: int = 0  # … of which recorded from the vendor's billing (no run re-learned them)
    duplicates: int = 0  # charges beyond one per idempotency key
    terminated: int = 0
    resumed: int = 0
    recreated: int = 0  # tasks started again from Temporal's input (the restored ledger lacked them)
    absent_at_restore: int = 0  # tasks the restored ledger had never heard of
    window_s: float = 0.0  # recovery target → database lost
    behind_events: int = 0  # ledger events lost with the tail
    audit_ok: bool = False
    audit_lines: list[str] = field(default_factory=list)
    backup_bytes: int = 0
    archived_segments: int = 0
    restore_s: float = 0.0

    @property
    def clean(self) -> bool:
        return (
            self.duplicates == 0
            and self.ledger_charges == self.vendor_charges
            and self.ledger_total == self.vendor_total
            and self.ended == self.tasks
            and self.audit_ok
        )

    def table(self) -> Table:
        t = Table(title="ledgerflow drill — restore the ledger behind Temporal", title_justify="left")
        t.add_column("measure")
        t.add_column("value", justify="right")
        t.add_row("tasks (ended / completed)", f"{self.tasks} ({self.ended} / {self.completed})")
        t.add_row("data-loss window used (target → loss)", f"{self.window_s:.1f}s")
        t.add_row("ledger events lost with the tail", str(self.behind_events))
        t.add_row("charges at the vendor", f"{self.vendor_charges} ({self.vendor_total})")
        t.add_row("  missing from the restored ledger", str(self.missing_at_restore))
        t.add_row("charges in the ledger afterwards", f"{self.ledger_charges} ({self.ledger_total})")
        t.add_row(
            "reconstructed figures (cost anomalies)", f"{self.reconstructed} ({self.late_charges} late)"
        )
        t.add_row("duplicate charges", str(self.duplicates))
        t.add_row(
            "runs stopped / taken over / started again",
            f"{self.terminated} / {self.resumed} / {self.recreated}",
        )
        t.add_row("audit --all --billing", "pass" if self.audit_ok else "FAIL")
        t.add_row(
            "base backup / archived WAL segments",
            f"{self.backup_bytes // 1024} KiB / {self.archived_segments}",
        )
        t.add_row("restore (copy + replay + promote)", f"{self.restore_s:.1f}s")
        return t


class _Workers:
    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env, self.log = env, log
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, n: int = 1) -> None:
        self.procs += [start_worker(self.env, self.log) for _ in range(n)]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        self.procs = []


async def run_restore_drill(
    *,
    temporal_address: str,
    vendor_url: str,
    workdir: Path,
    tasks: int = 6,
    window_s: float = 4.0,
    archive_timeout_s: int = 1,
    catch_up: bool = True,
    stray_charge: bool = False,
    finish_timeout: float = 120.0,
    log: Any = None,
) -> RestoreReport:
    """The drill (module doc). ``workdir`` holds the drill's Postgres, its archive and backup, artifacts and
    logs; ``catch_up=False`` skips ``after_restore``/``relearn`` (what a restore did before them).
    ``stray_charge``: the vendor also bills, inside the window, an attempt no run will make again (a charge
    only its billing knows): ``relearn`` must record it from the billing, as a late charge.

    Tasks start in three waves: before the base backup, between it and the recovery target (in the restored
    ledger only as far as the target), and after the target (absent from the restored ledger).
    """
    say = log or (lambda _msg: None)
    report = RestoreReport()
    workdir.mkdir(parents=True, exist_ok=True)
    workdir.chmod(0o755)
    data_dir, archive_dir = workdir / "pg" / "data", workdir / "wal-archive"
    instance = await asyncio.to_thread(pg.init_and_start, data_dir)
    instance = await asyncio.to_thread(backup.enable_archiving, instance, archive_dir, archive_timeout_s)
    url = instance.url
    await asyncio.to_thread(migrate.upgrade, url)
    rec = Recorder(url)
    register_demo_keys(rec, actor="restore drill")
    httpx.put(f"{vendor_url}/admin/config", json=SIM_CONFIG, timeout=10).raise_for_status()
    queue = f"restore-drill-{uuid.uuid4().hex[:8]}"
    env = _env(temporal_address, url, vendor_url, queue, workdir)
    workers = _Workers(env, workdir / "workers.log")
    client = await Client.connect(temporal_address, data_converter=pydantic_data_converter)
    prefix = report.prefix = f"rd-{uuid.uuid4().hex[:6]}"
    ids: list[str] = []

    async def start(n: int, text: str = PLAN) -> None:
        for _ in range(n):
            tid = f"{prefix}-{len(ids):02d}"
            plan = load_plan(text.format(n=len(ids)), DEFAULT_ROUTES, task_id=tid)
            inp = TaskInput(task_id=tid, plan=plan, heartbeat_timeout_seconds=HEARTBEAT_S)
            await client.start_workflow(TaskWorkflow.run, inp, id=workflow_id(tid), task_queue=queue)
            ids.append(tid)

    def charged() -> int:
        return len(charges_for(vendor_url, ids))

    try:
        workers.start()
        # Waves (module doc): A before the backup; B (long: a slow motion job spans the target and the
        # loss) between the backup and the target; C after the target; D just before the loss (mid-flight).
        a, b = max(1, tasks // 3), max(1, tasks // 3)
        d = max(1, (tasks - a - b) // 2)
        c = max(0, tasks - a - b - d)
        await start(a)
        await _until(lambda: charged() >= a * 2, 90, "the first wave's charges")
        taken = await asyncio.to_thread(backup.base_backup, url, workdir / "base", label="restore drill")
        report.backup_bytes = taken.size_bytes
        say(f"base backup taken ({taken.size_bytes // 1024} KiB); more work starts")
        await start(b, LONG_PLAN)
        await _until(lambda: charged() >= a * 5 + b * 2, 90, "the second wave's first charges")
        target = datetime.now(UTC)
        at_target = charged()
        await start(c)
        say(f"recovery target {target.isoformat(timespec='seconds')}; work keeps running for {window_s:.0f}s")
        await _until(lambda: charged() >= at_target + 3, 60, "charges after the target")
        await asyncio.sleep(max(0.0, window_s - (datetime.now(UTC) - target).total_seconds()))
        await asyncio.sleep(2 * archive_timeout_s + 1)  # the segment holding the target is shipped
        await start(d)
        last = ids[-d:]
        await _until(lambda: len(charges_for(vendor_url, last)) >= d, 30, "the last wave's first charges")
        if stray_charge:  # an attempt of the last task's script, charged, then lost with the tail
            stray = {
                "job_id": f"job_stray_{prefix}",
                "idempotency_key": f"{ids[-1]}:script:a9",
                "amount": "0.10",
            }
            httpx.post(f"{vendor_url}/admin/charges", json=stray, timeout=10).raise_for_status()
        events_before = sum(len(rec.read_events(t)) for t in ids)
        # The database is lost: workers die with it, its data directory is deleted.
        workers.kill()
        lost = datetime.now(UTC)
        rec.dispose()
        await asyncio.to_thread(pg.kill, data_dir)
        pg._clear_zombie_lock(data_dir)  # a killed postmaster nobody reaped still holds its socket's lock
        shutil.rmtree(data_dir)
        report.window_s = (lost - target).total_seconds()
        report.archived_segments = len(list(archive_dir.glob("*.gz")))
        say(f"database lost ({report.window_s:.1f}s after the target); restoring to the target")
        began = time.monotonic()
        instance = await asyncio.to_thread(
            backup.restore, workdir / "base", archive_dir, data_dir, target_time=target, port=instance.port
        )
        report.restore_s = time.monotonic() - began
        rec = Recorder(instance.url)
        report.behind_events = events_before - sum(len(rec.read_events(t)) for t in ids)
        report.absent_at_restore = sum(not rec.read_events(t) for t in ids)
        # What the restored ledger held: each task's operations with a result (a charge of any other is one
        # the ledger lost with its tail).
        resolved = {t: {k for k, o in fold_operations(rec.read_events(t)).items() if o.resolved} for t in ids}
        catch = None
        if catch_up:
            # What the restore may have rewound: every task Temporal ran since the target (this drill's own,
            # on a Temporal that may be shared); a task finished before the target is finished in the ledger.
            rewound = [t for t in await backup.task_workflows(client, since=target) if t in ids]
            catch = await backup.after_restore(rec, client, rewound)
            report.terminated, report.resumed = len(catch.terminated), len(catch.resumed)
            report.recreated = len(catch.recreated)
        # (catch_up=False: what a restore did before; the workers come back to whatever runs are there.)
        workers.start()
        await _until(
            lambda: all(_ended(rec, t) for t in ids), finish_timeout, "every task ending", fail=False
        )
        workers.kill()
        billing = charges_for(vendor_url, ids, chat=True)
        if catch is not None:
            relearned = backup.relearn(rec, billing, catch)
            report.reconstructed = len(relearned)
            report.late_charges = sum(r.how == "late_charge" for r in relearned)
        await _tally(report, rec, billing, ids, resolved, lost)
        # The audit, as an operator runs it: every task in the (restored) ledger, and the vendor's billing.
        cmd = [sys.executable, "-m", "ledgerflow.cli", "audit", "--all", "--billing"]
        audited = await asyncio.to_thread(
            subprocess.run, cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        report.audit_ok = audited.returncode == 0
        report.audit_lines = (audited.stdout + audited.stderr).splitlines()
        return report
    finally:
        workers.kill()
        with contextlib.suppress(Exception):
            rec.dispose()
        for tid in ids:
            with contextlib.suppress(Exception):
                await client.get_workflow_handle(workflow_id(tid)).terminate("restore drill finished")
        await asyncio.to_thread(pg.stop, data_dir, "immediate")


def _env(temporal: str, url: str, vendor: str, queue: str, workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGERFLOW_")}
    env.update(
        LEDGERFLOW_TEMPORAL_ADDRESS=temporal,
        LEDGERFLOW_DATABASE_URL=url,
        LEDGERFLOW_VENDOR_URL=vendor,
        LEDGERFLOW_VENDOR_API_KEY="restore-drill-key",
        LEDGERFLOW_LLM_API_KEY="restore-drill-key",
        LEDGERFLOW_TASK_QUEUE=queue,
        LEDGERFLOW_ARTIFACT_DIR=str((workdir / "artifacts").absolute()),
        LEDGERFLOW_POLL_INTERVAL_SECONDS="0.05",
        LEDGERFLOW_HEARTBEAT_TIMEOUT_SECONDS=str(HEARTBEAT_S),
        LEDGERFLOW_VENDOR_MODE="idempotent",
        LEDGERFLOW_ENV="dev",
        LEDGERFLOW_PRICE_HISTORY="0",
        PYTHONUNBUFFERED="1",
    )
    return env


async def _until(check: Any, timeout: float, what: str, *, fail: bool = True) -> bool:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(check):
        if time.monotonic() > deadline:
            if fail:
                raise TimeoutError(f"restore drill: no {what} within {timeout:.0f}s")
            return False
        await asyncio.sleep(0.25)
    return True


def _ended(rec: Recorder, task_id: str) -> bool:
    events = rec.read_events(task_id)
    if not events:
        return False
    p = fold(events)
    return p.finished and not p.in_flight()


async def _tally(
    report: RestoreReport,
    rec: Recorder,
    billing: list[dict[str, Any]],
    ids: list[str],
    resolved: dict[str, set[str]],
    lost: datetime,
) -> None:
    charges = [c for c in billing if c.get("protocol") != "chat"]
    report.tasks = len(ids)
    report.vendor_charges = len(charges)
    report.vendor_total = sum((_money(c["amount"]) for c in charges), Decimal(0))
    counts = Counter(c["idempotency_key"] for c in charges)
    report.duplicates = sum(n - 1 for n in counts.values())
    ops: dict[str, Any] = {}
    for tid in ids:
        events = rec.read_events(tid)
        ops.update(fold_operations(events))
        if events:
            p = fold(events)
            report.ended += p.finished and not p.in_flight()
            report.completed += p.state.value == "Completed"
    # Each charge to the operation on record that holds its job (its own key's, or the one a late charge
    # was booked to), else the one of its key; then every such operation's figure against what it was billed.
    by_job = {job: o for o in ops.values() for job in o.job_ids}
    matched: dict[str, list[dict[str, Any]]] = {}
    for c in charges:
        key, job = c["idempotency_key"], c["job_id"]
        before = float(c.get("at") or 0) <= lost.timestamp()
        report.missing_at_restore += before and key not in resolved.get(key.split(":")[0], set())
        op = by_job.get(job) or ops.get(key)
        if op is not None and job in op.job_ids:
            matched.setdefault(op.key, []).append(c)
    for op_key, mine in matched.items():
        if ops[op_key].recorded == sum((_money(c["amount"]) for c in mine), Decimal(0)):
            report.ledger_charges += len(mine)
    # What the ledger counts as paid to vendors (results and late charges; model calls apart).
    report.ledger_total = sum((vendor_spend(rec.read_events(t)) for t in ids), Decimal(0))


async def run_restore_scenario(
    settings: Settings, tasks: int, window_s: float, log: Any = None
) -> RestoreReport:
    """``ledgerflow drill --scenario restore``: the drill on servers of its own under
    ``.ledgerflow/restore-drill/UTC/`` — a Temporal dev server, the simulator (in this process) and the
    Postgres it loses. Nothing of the stack's is touched: the drill deletes a database, and ``audit --all
    --billing`` holds every charge of the vendor's account against the ledger's tasks."""
    from ledgerflow.stack.services import start_temporal
    from vendors.simulator import BackgroundSimulator, SimConfig

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    workdir = (settings.state_dir / "restore-drill" / stamp).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    port, ui_port = pg.free_port(), pg.free_port()
    temporal = await asyncio.to_thread(start_temporal, workdir, port, ui_port, workdir / "temporal.log")
    try:
        with BackgroundSimulator(SimConfig()) as simulator:
            return await run_restore_drill(
                temporal_address=f"127.0.0.1:{port}",
                vendor_url=simulator.url,
                workdir=workdir,
                tasks=tasks,
                window_s=window_s,
                log=log,
            )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(temporal.pid, signal.SIGKILL)
        temporal.wait(timeout=30)
