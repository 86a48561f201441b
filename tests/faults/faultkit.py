"""Crash-fault harness: real worker SUBPROCESSES, killed at named fault points, then checked for invariants.

Shared by the modules of tests/faults (the fixtures are in conftest.py).

A ``Worker`` runs ``python worker.py`` in its own session (process group) with ``LEDGERFLOW_MARKS=1`` and
reads its ``MARK <point> k=v …`` lines on a thread. With ``hold_at`` (``LEDGERFLOW_HOLD_AT`` / ``_HOLD_OP``)
the worker freezes itself right after that mark; the harness also SIGSTOPs the whole process group as soon as
it reads the ``MARK held`` line (harmless if the worker already stopped itself, and a backstop if the hold
only stopped part of it). ``stop_on=(point, op)`` instead SIGSTOPs the worker from the harness when it prints
that mark, so it can be SIGCONTed later.

``FaultRig`` bundles what one test needs: its own task queue and artifact dir, the Temporal client, the ledger
recorder and the simulator; it spawns workers, starts tasks and, after a kill, clears the workflows'
stickiness (``ResetStickyTaskQueue``) so Temporal hands the next workflow task to a live worker at once
instead of after the dead worker's sticky schedule-to-start timeout (10 s). That is what a graceful shutdown
does; stickiness is only a cache, so correctness is unaffected.

``assert_invariants`` checks, per task: I1 at most one vendor charge per OperationKey; I2 the ledger's
Outcome + Failure ``actual_cost`` total equals the vendor's charges, exactly; I3 every Dispatch INTENT has a
resolution (Outcome / Failure / ExecutionResult, or a void marker) under its operation key; I4 nothing
acknowledged is lost (every event seen before a kill is still there, unchanged) and seqs are gapless 1..n;
and, unless told otherwise, the task Completed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowHandle

from ledger.recorder import Recorder
from rules.actions import OPERATION_KINDS
from rules.envelope import StoredEvent
from rules.events import vendor_spend
from rules.plan import Plan, load_plan
from runtime.stickiness import release
from vendors.routes import DEFAULT_ROUTES
from workflows.contracts import TaskInput, TaskResult, workflow_id
from workflows.task import TaskWorkflow

ROOT = Path(__file__).resolve().parents[2]
SIM_KEY = "sk-test-4f1c9e"  # the bearer key tests/conftest.py gives the simulator (any non-empty key works)
HEARTBEAT_S = 2.0  # TaskInput.heartbeat_timeout_seconds: a dead worker's activity moves on after this
POLL_S = 0.02
WORKER_START_S = 60.0  # generous: a 2-core machine under load can take a while to import temporalio


@dataclass(frozen=True)
class Mark:
    """One ``MARK`` line of a worker: ``point`` and its ``k=v`` fields (``held`` lines: point ``held``)."""

    index: int
    point: str
    detail: str
    fields: dict[str, str]
    at: float  # time.monotonic() when the harness read it

    @property
    def op(self) -> str:
        return self.fields.get("op", "")


def parse_mark(index: int, line: str) -> Mark | None:
    words = line.strip().split()
    if len(words) < 2 or words[0] != "MARK":
        return None
    point, rest = words[1], words[2:]
    fields = dict(w.split("=", 1) for w in rest if "=" in w)
    if point == "held" and rest:
        fields["at"] = rest[0]
    return Mark(index, point, " ".join(rest), fields, time.monotonic())


class WorkerDied(AssertionError):
    pass


class Worker:
    """``python worker.py`` as a subprocess in its own process group, its MARK lines read on a thread."""

    def __init__(
        self,
        name: str,
        env: dict[str, str],
        log_path: Path,
        *,
        freeze_on_hold: bool = True,
        stop_on: tuple[str, str] | None = None,
    ):
        """``stop_on=(point, op)``: SIGSTOP the worker as soon as it prints that mark (resume: ``cont``)."""
        self.name = name
        self.stop_on = stop_on
        self.env = env
        self.log_path = log_path
        self.freeze_on_hold = freeze_on_hold
        self.marks: list[Mark] = []
        self._lock = threading.Lock()
        self._log = log_path.open("a", buffering=1)
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "worker.py")],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self.stopped = False
        self._reader = threading.Thread(target=self._read, name=f"marks-{name}", daemon=True)
        self._reader.start()

    # ── reading ──────────────────────────────────────────────────────────────────────────────────────
    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            with self._lock:
                m = parse_mark(len(self.marks), line)
                if m is None:
                    continue
                self.marks.append(m)
            if m.point == "held" and self.freeze_on_hold:
                # Make sure every thread is frozen, not only the one that printed the mark (module doc).
                self._signal(signal.SIGSTOP)
                self.stopped = True
            elif self.stop_on and m.point == self.stop_on[0] and self.stop_on[1] in m.detail:
                self.stop_on = None  # once
                self._signal(signal.SIGSTOP)
                self.stopped = True

    def find(self, point: str, op_contains: str = "", after: int = 0) -> list[Mark]:
        with self._lock:
            marks = self.marks[after:]
        return [m for m in marks if m.point == point and op_contains in m.detail]

    async def wait_for(
        self, point: str, op_contains: str = "", timeout: float = 30.0, after: int = 0
    ) -> Mark:
        """The first ``MARK point`` (from index ``after`` on) whose fields contain ``op_contains``."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.find(point, op_contains, after)
            if found:
                return found[0]
            if self.proc.poll() is not None:
                raise WorkerDied(
                    f"worker {self.name} exited ({self.proc.returncode}) before MARK {point}\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                missing = f"no MARK {point} {op_contains!r} within {timeout:.0f}s"
                raise AssertionError(f"worker {self.name}: {missing}\n{self.tail()}")
            await asyncio.sleep(0.01)

    async def held(self, point: str, op_contains: str = "", timeout: float = 30.0) -> Mark:
        """Wait until the worker froze at its hold point (and the harness stopped the whole process)."""
        m = await self.wait_for("held", op_contains, timeout)
        assert m.fields.get("at") == point, f"held at {m.fields.get('at')}, expected {point}"
        while self.freeze_on_hold and not self.stopped:
            await asyncio.sleep(0.005)
        return m

    async def ready(self, timeout: float = WORKER_START_S) -> None:
        await self.wait_for("worker_ready", timeout=timeout)

    def tail(self, lines: int = 40) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    # ── signals ──────────────────────────────────────────────────────────────────────────────────────
    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash: no cleanup, no graceful shutdown) and reap it."""
        self._signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._reader.join(timeout=10)

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (what an orchestrator sends before it stops a container) and wait for the exit code."""
        self._signal(signal.SIGTERM)
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def stop(self) -> None:
        self._signal(signal.SIGSTOP)
        self.stopped = True

    def cont(self) -> None:
        self._signal(signal.SIGCONT)
        self.stopped = False

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        self._reader.join(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


def worker_env(
    *,
    temporal_address: str,
    database_url: str,
    vendor_url: str,
    task_queue: str,
    artifact_dir: Path,
    vendor_mode: str = "idempotent",
    hold_at: str | None = None,
    hold_op: str | None = None,
    **extra: str,
) -> dict[str, str]:
    """The environment of a worker (or CLI) process: the test's servers, queue and store; marks on."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEDGERFLOW_", "LF_"))}
    env.update(
        LEDGERFLOW_TEMPORAL_ADDRESS=temporal_address,
        LEDGERFLOW_DATABASE_URL=database_url,
        LEDGERFLOW_VENDOR_URL=vendor_url,
        LEDGERFLOW_VENDOR_API_KEY=SIM_KEY,
        LEDGERFLOW_LLM_API_KEY=SIM_KEY,
        LEDGERFLOW_TASK_QUEUE=task_queue,
        LEDGERFLOW_ARTIFACT_DIR=str(artifact_dir),
        LEDGERFLOW_POLL_INTERVAL_SECONDS=str(POLL_S),
        LEDGERFLOW_HEARTBEAT_TIMEOUT_SECONDS=str(HEARTBEAT_S),
        LEDGERFLOW_VENDOR_MODE=vendor_mode,
        LEDGERFLOW_MARKS="1",
        LEDGERFLOW_ENV="dev",  # the demo approvers' keys are registered (tests/conftest.py)
        # The shared ledger teaches no prices across tests (tests/conftest.py says why).
        LEDGERFLOW_PRICE_HISTORY="0",
        PYTHONUNBUFFERED="1",
    )
    if hold_at:
        env["LEDGERFLOW_HOLD_AT"] = hold_at
    if hold_op:
        env["LEDGERFLOW_HOLD_OP"] = hold_op
    env.update(extra)
    return env


def new_task_id() -> str:
    return f"f-{uuid.uuid4().hex[:12]}"


@dataclass
class FaultRig:
    """One test's private queue, artifact store and workers, on shared (or the test's own) servers."""

    client: Client
    recorder: Recorder
    database_url: str
    vendor_url: str
    workdir: Path
    vendor_mode: str = "idempotent"
    task_queue: str = field(default_factory=lambda: f"fq-{uuid.uuid4().hex[:10]}")
    workers: list[Worker] = field(default_factory=list)
    handles: dict[str, WorkflowHandle[Any, TaskResult]] = field(default_factory=dict)

    @property
    def artifact_dir(self) -> Path:
        return self.workdir / "artifacts"

    @property
    def temp_dir(self) -> Path:
        return self.artifact_dir / "tmp"

    def env(self, **overrides: Any) -> dict[str, str]:
        kwargs: dict[str, Any] = {
            "temporal_address": self.client.service_client.config.target_host,
            "database_url": self.database_url,
            "vendor_url": self.vendor_url,
            "task_queue": self.task_queue,
            "artifact_dir": self.artifact_dir,
            "vendor_mode": self.vendor_mode,
        }
        kwargs.update(overrides)
        return worker_env(**kwargs)

    async def spawn(
        self,
        hold_at: str | None = None,
        hold_op: str | None = None,
        stop_on: tuple[str, str] | None = None,
        **env: Any,
    ) -> Worker:
        """Start a worker process and wait until it polls its task queue."""
        name = f"w{len(self.workers) + 1}"
        worker = Worker(
            name,
            self.env(hold_at=hold_at, hold_op=hold_op, **env),
            self.workdir / f"{name}.log",
            stop_on=stop_on,
        )
        self.workers.append(worker)
        await worker.ready()
        return worker

    # ── tasks ────────────────────────────────────────────────────────────────────────────────────────
    def plan(self, text: str, task_id: str | None = None) -> Plan:
        return load_plan(text, DEFAULT_ROUTES, task_id=task_id or new_task_id())

    async def start(self, plan: Plan) -> WorkflowHandle[Any, TaskResult]:
        assert plan.task_id is not None
        handle = await self.client.start_workflow(
            TaskWorkflow.run,
            TaskInput(task_id=plan.task_id, plan=plan, heartbeat_timeout_seconds=HEARTBEAT_S),
            id=workflow_id(plan.task_id),
            task_queue=self.task_queue,
        )
        self.handles[plan.task_id] = handle
        return handle

    def handle(self, task_id: str) -> WorkflowHandle[Any, TaskResult]:
        """The task's workflow, whichever run is the latest (e.g. after ``ledgerflow resume``)."""
        return self.client.get_workflow_handle_for(TaskWorkflow.run, workflow_id(task_id))

    async def result(self, task_id: str, timeout: float = 90.0) -> TaskResult:
        try:
            return await asyncio.wait_for(self.handle(task_id).result(), timeout)
        except TimeoutError:
            status = await self.status(task_id)
            raise AssertionError(
                f"task {task_id} did not finish in {timeout:.0f}s: {status}\n" + self.logs()
            ) from None

    async def status(self, task_id: str) -> dict[str, Any]:
        try:
            return dict(await self.handle(task_id).query("status"))
        except Exception as e:  # the query needs a live worker; the ledger always answers
            from rules.projection import fold, summary

            return {"query_failed": repr(e)[:200], **summary(fold(self.recorder.read_events(task_id)))}

    async def crash(self, worker: Worker) -> None:
        """SIGKILL the worker, then clear stickiness so the next workflow task goes to any live worker."""
        worker.kill()
        await self.unstick()

    async def unstick(self) -> None:
        """Forget which worker caches each task's workflow (what a graceful worker shutdown does)."""
        for task_id in self.handles:
            await release(self.client, self.client.namespace, workflow_id(task_id), None)

    # ── the ledger ───────────────────────────────────────────────────────────────────────────────────
    def events(self, task_id: str) -> list[StoredEvent]:
        return self.recorder.read_events(task_id)

    def by_op(self, task_id: str, op: str) -> list[StoredEvent]:
        return [e for e in self.events(task_id) if e.operation_key == op]

    async def wait_ledger(self, task_id: str, predicate: Any, timeout: float = 30.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not predicate(self.events(task_id)):
            if time.monotonic() > deadline:
                raise AssertionError(f"ledger of {task_id}: not {what or predicate} within {timeout:.0f}s")
            await asyncio.sleep(0.05)

    async def cli(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run ``ledgerflow ARGS`` as a subprocess with this rig's environment."""
        cmd = [sys.executable, "-m", "ledgerflow.cli", *args]
        return await asyncio.to_thread(
            subprocess.run, cmd, cwd=ROOT, env=self.env(), capture_output=True, text=True, timeout=timeout
        )

    def logs(self, lines: int = 30) -> str:
        return "\n".join(f"--- {w.name} ---\n{w.tail(lines)}" for w in self.workers)

    async def close(self) -> None:
        for w in self.workers:
            if w.stopped:
                w.cont()
            w.close()
        for task_id in self.handles:
            with contextlib.suppress(Exception):
                await self.handle(task_id).terminate("fault test finished")


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A directory under the system temp dir (readable by other users, e.g. a Postgres run as non-root)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ── invariants ───────────────────────────────────────────────────────────────────────────────────────
def dispatch_intents(events: Iterable[StoredEvent]) -> list[StoredEvent]:
    """The INTENTs that start an operation at a vendor (dispatches, and a failed task's compensations)."""
    return [e for e in events if e.type == "Intent" and e.payload["action"]["kind"] in OPERATION_KINDS]


def resolutions(events: Iterable[StoredEvent]) -> dict[str, StoredEvent]:
    """operation key → its one resolution (Outcome / Failure / ExecutionResult / void marker)."""
    out: dict[str, StoredEvent] = {}
    for e in events:
        if e.operation_key is None:
            continue
        void = e.type == "SystemMarker" and e.payload.get("kind") == "void"
        if e.type in ("Outcome", "Failure", "ExecutionResult") or void:
            assert e.operation_key not in out, (
                f"two resolutions of {e.operation_key}: {out[e.operation_key]} {e}"
            )
            out[e.operation_key] = e
    return out


def ledger_cost(events: Iterable[StoredEvent]) -> Decimal:
    """What the ledger says was paid to vendors (rules.events.vendor_spend: results and late charges)."""
    return vendor_spend(events)


def assert_prefix_kept(seen: Iterable[StoredEvent], now: list[StoredEvent]) -> None:
    """I4: every event acknowledged before (seen by the test) is still in the ledger, byte for byte."""
    by_seq = {(e.task_id, e.seq): e for e in now}
    for old in seen:
        kept = by_seq.get((old.task_id, old.seq))
        assert kept is not None, f"I4: event {old.task_id}#{old.seq} ({old.type}) was lost"
        assert (kept.dedup_key, kept.type, kept.payload, kept.epoch) == (
            old.dedup_key,
            old.type,
            old.payload,
            old.epoch,
        ), f"I4: event {old.task_id}#{old.seq} changed: {old} → {kept}"


async def assert_invariants(
    recorder: Recorder,
    sim: Any,
    task_ids: Iterable[str],
    *,
    seen: Iterable[StoredEvent] = (),
    rig: FaultRig | None = None,
    completed: bool = True,
) -> None:
    """I1–I4 for every task (see the module doc), and Completed via the workflow's result unless told not."""
    seen = list(seen)
    for task_id in task_ids:
        if completed:
            assert rig is not None, "pass rig= to check the workflow result"
            result = await rig.result(task_id)
            assert result.state == "Completed", f"{task_id} ended {result.state}: {result.summary}"
        events = recorder.read_events(task_id)
        charges = await sim.charges(f"{task_id}:")
        # I1: the vendor charged each OperationKey at most once.
        counts = Counter(c["idempotency_key"] for c in charges)
        dupes = {k: n for k, n in counts.items() if n > 1}
        assert not dupes, f"I1: charged more than once: {dupes}"
        # I2: the ledger's recorded costs equal what the vendor charged, to the cent (Decimal, exact).
        vendor = sum((Decimal(c["amount"]) for c in charges), Decimal(0))
        assert ledger_cost(events) == vendor, (
            f"I2: ledger {ledger_cost(events)} != vendor {vendor} for {task_id}"
        )
        # I3: no Dispatch INTENT is left open.
        resolved = resolutions(events)
        open_ops = [e.operation_key for e in dispatch_intents(events) if e.operation_key not in resolved]
        assert not open_ops, f"I3: INTENTs without a resolution: {open_ops}"
        # I4: gapless seqs, nothing acknowledged lost.
        assert [e.seq for e in events] == list(range(1, len(events) + 1)), f"I4: seq gap in {task_id}"
        assert_prefix_kept([e for e in seen if e.task_id == task_id], events)


# ── shared scenario pieces ───────────────────────────────────────────────────────────────────────────
ONE_SHOT = """
goal: one paid motion shot
budget_ceiling: 20
stages:
  - {id: shot, executor: video.motion, estimate: 1.5}
"""


def op_key(task_id: str, node: str, attempt: int = 1) -> str:
    return f"{task_id}:{node}:a{attempt}"


async def vendor_job(sim: Any, job_id: str) -> dict[str, Any]:
    """The vendor's own view of a job (status, progress, result sha256)."""
    r = await sim.http.get(f"/jobs/{job_id}")
    r.raise_for_status()
    return dict(r.json())


def assert_artifact(outcome: StoredEvent) -> None:
    """The registered artifact exists in the store and its bytes hash to what the Outcome says."""
    import hashlib
    from urllib.parse import unquote, urlparse

    artifact = outcome.payload["artifact"]
    path = Path(unquote(urlparse(artifact["uri"]).path))
    assert path.is_file(), f"artifact of {outcome.operation_key} missing: {path}"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == artifact["sha256"]
