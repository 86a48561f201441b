"""``ledgerflow drill``: a seeded random crash campaign against the embedded stack (the S12 crash drill of
docs/design.md#the-s12-crash-drill, at random fault points).

A workload of small paid pipelines runs on worker subprocesses. Again and again, a worker is started with a
random fault point (``runtime.faults.POINTS``) at which it freezes; the drill SIGKILLs it there and starts
a fresh worker, until the requested number of kills is reached; then every task must still finish. Report:
kills, recovery time (kill → the killed task's next ledger event) p50/p95, duplicate charges, ledger vs
vendor total difference, orphaned INTENTs, tasks completed.
"""

from __future__ import annotations

import asyncio
import json
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
from typing import Any, Final

import httpx
import yaml
from rich.table import Table

from ledgerflow import client as lf
from ledgerflow.stack import services as stack
from ledgerflow.views.stats import percentile
from rules.actions import OPERATION_KINDS
from rules.events import vendor_spend
from rules.keys import is_result_key
from rules.operation import overrun_bound
from rules.projection import fold
from rules.table import BUDGET_REFUSED
from runtime.faults import POINTS
from runtime.settings import Settings
from workflows.contracts import TaskInput, starting_story, workflow_id
from workflows.task import TaskWorkflow

ROOT = Path(__file__).resolve().parents[2]
PLAN = """
goal: drill pipeline {n}
budget_ceiling: {ceiling}
stages:
  - {{id: script, executor: llm.text, estimate: 0.10}}
  - {{id: shots, executor: image.keyframe, estimate: 0.40, depends_on: [script],
     fan_out: 3, canary: {canary}}}
  - {{id: edit, executor: edit.assembly, estimate: 0.20, depends_on: [shots]}}
"""
# The plain drill's plan never meets its ceiling. The realistic drill's keyframe vendor bills 4× what the plan
# estimates (examples/simulator_realistic.json): its canary's price prices the fan-out, the ceiling stops it,
# and the person adds budget (``BUDGET_ADDED``), as a producer would after reading what the rest would cost.
PLAIN_PLAN: Final = {"ceiling": "50", "canary": "false"}
REALISTIC_PLAN: Final = {"ceiling": "3.00", "canary": "true"}
BUDGET_ADDED: Final = "5.00"
SIM_CONFIG = {
    "seed": 0,
    "default": {"latency_seconds": 0.3},
    "executors": {"image.keyframe": {"latency_seconds": 0.6}},
}
DRILL_EXECUTORS = ("llm.text", "image.keyframe", "edit.assembly")
# Every habit of real vendors at once, per executor (vendors/simulator/config.py): charge-then-drop,
# charge-then-503 (a gateway), jobs created after the client gave up, keys forgotten, outputs purged, results
# on a CDN, figures finer than the ledger, 408s, 429s and slow answers. The routes say what the vendor
# promises (timeouts, acceptance window, key retention; no refused_statuses: its 503s may follow a charge).
REALISTIC_PROFILE = ROOT / "examples" / "simulator_realistic.json"
REALISTIC_ROUTE: dict[str, Any] = {
    "timeouts": {"request": 1.0},
    "max_accept_seconds": 4.0,
    "key_retention": 5.0,
}


def drill_setup(profile: str, mode: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The simulator configuration and (for ``realistic``) the route table of a drill run."""
    if profile == "plain":
        return {**SIM_CONFIG, "mode": mode}, None
    config = json.loads(REALISTIC_PROFILE.read_text())
    routes = {"routes": {name: {**REALISTIC_ROUTE, "mode": mode} for name in DRILL_EXECUTORS}}
    return {**config, "mode": mode}, routes


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
    stuck: int = 0  # tasks not in a terminal state at the end
    duplicate_charges: int = 0
    ledger_total: Decimal = Decimal(0)
    vendor_total: Decimal = Decimal(0)
    unmatched: Decimal = Decimal(0)  # ledger − vendor differences of operations no cost anomaly explains
    anomalies: int = 0
    late_charges: int = 0
    decisions: int = 0  # dead letters and escalations the drill answered as a person
    budget_added: int = 0  # … of which budget added to a task its ceiling stopped
    # Spend past a task's ceiling (its last, budget added included), by the task it is largest for, and the
    # bound on it (rules.pricing): the overrun of what was in flight when its last operation was admitted.
    largest_overrun: Decimal = Decimal(0)
    overrun_bound: Decimal = Decimal(0)
    chat_ledger: Decimal = Decimal(0)  # the model calls' spend, as the ledger and as the vendor count it
    chat_vendor: Decimal = Decimal(0)
    route_pauses: int = 0
    orphaned_intents: int = 0
    points: dict[str, int] = field(default_factory=dict)
    title: str = "ledgerflow drill"

    def table(self) -> Table:
        def pct(q: float) -> str:
            at = percentile(self.recoveries, q)
            return "—" if at is None else f"{at:.1f}s"

        t = Table(title=self.title, title_justify="left")
        t.add_column("measure")
        t.add_column("value", justify="right")
        t.add_row("kills", str(self.kills))
        t.add_row("recovery p50 / p95", f"{pct(0.5)} / {pct(0.95)}")
        t.add_row("duplicate charges", str(self.duplicate_charges))
        t.add_row("ledger − vendor total", str(self.ledger_total - self.vendor_total))
        t.add_row("  not matched by a cost anomaly", str(self.unmatched))
        t.add_row("model calls: ledger − vendor", str(self.chat_ledger - self.chat_vendor))
        t.add_row("cost anomalies recorded", str(self.anomalies))
        t.add_row("late charges recorded", str(self.late_charges))
        t.add_row("operations left open", str(self.orphaned_intents))
        t.add_row("route pauses (key rotated)", str(self.route_pauses))
        t.add_row("decisions taken as a person", f"{self.decisions} ({self.budget_added} added budget)")
        over = f"{self.largest_overrun} / {self.overrun_bound}"
        t.add_row("largest spend past a ceiling / its bound", over)
        t.add_row("tasks completed / stuck", f"{self.completed} / {self.stuck} of {self.tasks}")
        t.caption = "kills by point: " + ", ".join(f"{k} {v}" for k, v in sorted(self.points.items()))
        return t

    @property
    def clean(self) -> bool:
        return (
            self.duplicate_charges == 0
            and self.largest_overrun <= self.overrun_bound
            and self.unmatched == 0
            and self.orphaned_intents == 0
            and self.stuck == 0
            and self.completed == self.tasks
        )


async def run_drill(
    settings: Settings, kills: int, seed: int, tasks: int, *, profile: str = "plain", mode: str = "idempotent"
) -> DrillReport:
    """Kill and freeze workers ``kills`` times under a workload, then check every money invariant.

    ``profile="realistic"`` turns every unkind vendor habit on (``examples/simulator_realistic.json``),
    with routes that state what the vendor promises; rotates the vendor's key halfway through (the route
    pauses; the drill, as the operator, deploys the new key and resumes it); and answers dead letters and
    escalations as a person would (resume), so no task waits forever. ``mode`` is the vendor mode of the
    simulator and of every route.
    """
    rng = random.Random(seed)
    info = stack.up(settings, with_worker=False)
    settings = Settings(
        temporal_address=info["temporal_address"],
        database_url=info["database_url"],
        vendor_url=info["vendor_url"],
        task_queue=f"drill-{profile}-{mode}-{seed}-{uuid.uuid4().hex[:6]}",
    )
    sim_config, routes = drill_setup(profile, mode)
    httpx.put(f"{settings.vendor_url}/admin/config", json=sim_config, timeout=10).raise_for_status()
    env = {
        "LEDGERFLOW_TEMPORAL_ADDRESS": str(settings.temporal_address),
        "LEDGERFLOW_DATABASE_URL": str(settings.database_url),
        "LEDGERFLOW_VENDOR_URL": str(settings.vendor_url),
        "LEDGERFLOW_TASK_QUEUE": settings.task_queue,
        "LEDGERFLOW_ARTIFACT_DIR": str((settings.state_dir / "artifacts").resolve()),
        "LEDGERFLOW_POLL_INTERVAL_SECONDS": "0.05",
        "LEDGERFLOW_VENDOR_MODE": mode,
        "LEDGERFLOW_VENDOR_API_KEY": "drill-key-1",
        "LEDGERFLOW_LLM_API_KEY": "drill-key-1",  # the simulator is the model vendor too: one key, rotated
        "LEDGERFLOW_ROUTE_PAUSE_RETRY_SECONDS": "1",
        "LEDGERFLOW_ENV": "dev",  # a drill runs on the embedded stack: its producer signs with a demo key
    }
    if routes is not None:
        routes_file = (settings.state_dir / f"drill-routes-{mode}.yaml").resolve()
        routes_file.write_text(yaml.safe_dump(routes))
        env["LEDGERFLOW_ROUTES_FILE"] = str(routes_file)
    log = (settings.state_dir / "logs").resolve()
    log.mkdir(parents=True, exist_ok=True)
    client = await lf.connect(settings)
    rec = lf.recorder(settings)
    report = DrillReport(title=f"ledgerflow drill — profile {profile}, vendor mode {mode}")
    handles: list[Any] = []
    prefix = f"drill{seed}-{uuid.uuid4().hex[:4]}"
    rotate_at = kills // 2 if profile == "realistic" else None

    async def start_task() -> None:
        n = len(handles)
        tid = f"{prefix}-{n:03d}"
        shape = REALISTIC_PLAN if profile == "realistic" else PLAIN_PLAN
        plan = lf.parse_plan(PLAN.format(n=n, **shape), tid, routes=_names(routes))
        # A short heartbeat timeout: Temporal hands a dead worker's activity to the next worker in seconds.
        inp = TaskInput(task_id=tid, plan=plan, heartbeat_timeout_seconds=3)
        handles.append(
            await client.start_workflow(
                TaskWorkflow.run,
                inp,
                id=workflow_id(tid),
                task_queue=settings.task_queue,
                **starting_story(plan),
            )
        )

    def task_ids() -> list[str]:
        return [h.id.removeprefix("ledgerflow-task-") for h in handles]

    for _ in range(tasks):
        await start_task()
    person = asyncio.create_task(_answer_as_a_person(settings, rec, task_ids, report))
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
            if report.kills == rotate_at:
                # The vendor rotates its key while a worker still holds the old one: its calls meet 401s and
                # the route pauses for every worker. The operator deploys the new key and resumes the route.
                rotated = {**sim_config, "accepted_keys": ["drill-key-2"]}
                httpx.put(f"{settings.vendor_url}/admin/config", json=rotated, timeout=10).raise_for_status()
                await start_task()  # work for the old key to meet the rotation with
                deadline = time.monotonic() + 20.0
                while time.monotonic() < deadline and not any(s.paused for s in rec.route_states().values()):
                    await asyncio.sleep(0.2)
                survivor.kill()
                env["LEDGERFLOW_VENDOR_API_KEY"] = env["LEDGERFLOW_LLM_API_KEY"] = "drill-key-2"
                for route, state in rec.route_states().items():
                    if state.paused and rec.resume_route(route, "drill operator", "new key deployed"):
                        report.route_pauses += 1
            else:
                survivor.kill()
            if all(_done(rec, h) for h in handles):
                await start_task()
        final = WorkerProcess(env, log / "drill-worker.log")
        try:
            await asyncio.wait([asyncio.ensure_future(h.result()) for h in handles], timeout=FINISH_TIMEOUT)
        finally:
            final.kill()
        await _tally(report, rec, settings, task_ids())
    finally:
        person.cancel()
        rec.dispose()
    return report


FINISH_TIMEOUT = 300.0


def _names(routes: dict[str, Any] | None) -> Any:
    """The plan-validation view of the drill's routes (None: the deployment's own table)."""
    if routes is None:
        return None
    from vendors.routes import parse_table

    return parse_table(routes).names()


async def _answer_as_a_person(settings: Settings, rec: Any, task_ids: Any, report: DrillReport) -> None:
    """Resume every dead letter and escalation of the drill's tasks, as a person would after checking them.

    An unknown outcome (the vendor cannot say whether a job ran) asks a person; in the drill the person
    always resumes, so the node runs again under a new key and the task can finish. A task that stopped at its
    ceiling is given ``BUDGET_ADDED`` more first. Decisions are signed with the demo approver keys and sent as
    the ``decide`` signal, like ``ledgerflow decide``.
    """
    from ledgerflow.views.people import send, signed_payload
    from runtime.signing import demo_key

    answered: set[tuple[str, str]] = set()
    added: set[tuple[str, str]] = set()  # budget added, a resume still to send
    while True:
        for tid in task_ids():
            events = rec.read_events(tid)
            if not events:
                continue
            p = fold(events)
            if p.terminal:
                continue
            for rid, r in p.requests.items():
                if (
                    not r.open
                    or (tid, rid) in answered
                    or r.request.kind.value not in ("dead_letter", "escalation")
                ):
                    continue
                node = r.request.node or ""
                short = r.request.reason.startswith(BUDGET_REFUSED.format(node=node))
                if short and (tid, rid) not in added:
                    decision, amount, note = "add-budget", BUDGET_ADDED, "drill: the rest is worth it"
                else:
                    decision, amount, note = "resume", None, "drill: checked, resume"
                payload = signed_payload(demo_key("producer"), tid, rid, decision, note=note, amount=amount)
                try:
                    await send(settings, tid, payload)
                except Exception:  # the task ended meanwhile: nothing to answer
                    continue
                if amount is not None:
                    added.add((tid, rid))  # then resumed, at the next look
                    report.budget_added += 1
                else:
                    answered.add((tid, rid))
                report.decisions += 1
        await asyncio.sleep(1.0)


def vendor_charges(vendor_url: str, task_ids: list[str]) -> tuple[int, Decimal]:
    """From the vendor's own charge list, for these tasks: duplicate charges (more than one per
    OperationKey) and the total charged."""
    return duplicates_and_total(charges_for(vendor_url, task_ids))


def duplicates_and_total(mine: list[dict[str, Any]]) -> tuple[int, Decimal]:
    keys = [c["idempotency_key"] for c in mine]
    return len(keys) - len(set(keys)), sum((_money(c["amount"]) for c in mine), Decimal(0))


def charges_for(vendor_url: str, task_ids: list[str], *, chat: bool = False) -> list[dict[str, Any]]:
    """The vendor's own charge list, for these tasks (an OperationKey starts with its task id): their
    generations, or with ``chat`` their model calls too (billed by the request id each sends)."""
    charges = httpx.get(f"{vendor_url}/charges", timeout=10).json()["charges"]
    tasks = set(task_ids)
    return [
        c
        for c in charges
        if c["idempotency_key"].split(":")[0] in tasks and (chat or c.get("protocol") != "chat")
    ]


def _money(raw: str) -> Decimal:
    """A billed figure as it stands (exact: the comparison is with the ledger's figure and its anomalies)."""
    try:
        amount = Decimal(raw)
    except ArithmeticError:
        return Decimal(0)
    return amount if amount.is_finite() else Decimal(0)


def _task_of(held: str, prefix: str) -> str | None:
    for word in held.split():
        value = word.partition("=")[2]
        if value.startswith(prefix):
            return value.split(":")[0]
    return None


def _done(rec: Any, handle: Any) -> bool:
    events = rec.read_events(handle.id.removeprefix("ledgerflow-task-"))
    return bool(events) and fold(events).finished


async def _recovered(rec: Any, task: str, before: int, killed_at: float, timeout: float = 120.0) -> float:
    """Seconds from the kill until the killed task's ledger grows again (or it is finished)."""
    while time.monotonic() - killed_at < timeout:
        events = rec.read_events(task)
        if len(events) > before or fold(events).finished:
            return time.monotonic() - killed_at
        await asyncio.sleep(0.1)
    return timeout


async def _tally(report: DrillReport, rec: Any, settings: Settings, task_ids: list[str]) -> None:
    # The vendor's own billing, read once: generations by OperationKey; the model calls (the review's, the
    # planner's) by the request id they send, apart — a chat API takes no idempotency key.
    billing = charges_for(str(settings.vendor_url), task_ids, chat=True)
    charges = [c for c in billing if c.get("protocol") != "chat"]
    chat = (_money(c["amount"]) for c in billing if c.get("protocol") == "chat")
    report.chat_vendor = sum(chat, Decimal(0))
    report.duplicate_charges, report.vendor_total = duplicates_and_total(charges)
    report.tasks = len(task_ids)
    billed: dict[str, Decimal] = {}
    for c in charges:
        billed[c["idempotency_key"]] = billed.get(c["idempotency_key"], Decimal(0)) + _money(c["amount"])
    for tid in task_ids:
        events = rec.read_events(tid)
        p = fold(events)
        report.completed += p.state.value == "Completed"
        report.stuck += not p.finished
        report.chat_ledger += p.spent - vendor_spend(events)  # what the ledger spent on model calls
        if (over := p.spent - p.ceiling) > report.largest_overrun:
            report.largest_overrun, report.overrun_bound = over, overrun_bound(events)
        by_op: dict[str, list[Any]] = {}
        for e in events:
            if e.operation_key:
                by_op.setdefault(e.operation_key, []).append(e)
        for op, op_events in by_op.items():
            kinds = [e.payload.get("kind") for e in op_events if e.type == "SystemMarker"]
            report.anomalies += kinds.count("cost_anomaly")
            report.late_charges += kinds.count("late_charge")
            difference = vendor_spend(op_events) - billed.get(op, Decimal(0))
            if difference and "cost_anomaly" not in kinds:
                report.unmatched += abs(difference)
        resolved = {e.operation_key for e in events if is_result_key(e.dedup_key)}
        report.ledger_total += vendor_spend(events)
        for e in events:
            if e.type == "Intent" and e.operation_key and e.payload["action"]["kind"] in OPERATION_KINDS:
                report.orphaned_intents += e.operation_key not in resolved
