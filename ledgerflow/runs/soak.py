"""``ledgerflow soak``: many copies of one plan on the embedded stack, what became of them, and what it cost.

Every task gets its own id and goal (the simulator's seeded draws, including the model's verdicts, depend on
the request, so the copies meet different faults). The run ends when every task is Completed, Failed or
Escalated (an unattended run has nobody to answer: approvals and dead letters time out by the plan's policy);
escalated tasks are then terminated. Progress is one visibility count every two seconds (search attributes:
the task's project and state), never a query per task, so a thousand tasks cost what ten do.

Report: review verdict counts (every review, and each task's last), end states, rework rounds, gate
failures, the money invariants — duplicate charges and ledger total against the vendor's own charge list —
and the run's figures: wall time, tasks per minute, the hop from a node's completion to its dependent's
dispatch (p50/p95, from the ledger's own clock), CPU per task (the workers', and the whole machine's),
each worker's peak memory, the ledger database's peak connections and how often a worker waited for its pool.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg
from rich.table import Table
from sqlalchemy import make_url
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from ledger.recorder import Recorder
from ledgerflow import client as lf
from ledgerflow.runs.drill import charges_for, duplicates_and_total
from ledgerflow.stack import services as stack
from ledgerflow.views.stats import percentile
from rules.dag import Graph
from rules.envelope import StoredEvent
from rules.events import Escalation, ExecutionResult, Intent, Outcome, parse, vendor_spend
from rules.projection import fold
from rules.table import ENDING_RULES, RULES
from runtime.settings import Settings
from workflows.contracts import PROJECT, STATE, TaskInput, starting_story, workflow_id
from workflows.policies import start_priority
from workflows.task import TaskWorkflow

SETTLED = frozenset({"Completed", "Failed", "Escalated"})
RULE_NAMES = {r.id: r.name for r in (*RULES, *ENDING_RULES)}
POOL_WAIT = "QueuePool limit"  # SQLAlchemy's message when a checkout waited out pool_timeout
START_CONCURRENCY = 32  # workflow starts in flight at once


@dataclass
class Resources:
    """What the run cost the machine, sampled once a second."""

    worker_rss_peak: dict[str, int] = field(default_factory=dict)  # worker name -> bytes
    worker_cpu_seconds: float = 0.0  # user + system, every worker, over the run
    machine_cpu_seconds: float = 0.0  # every process on the machine (Temporal, Postgres, simulator too)
    pg_connections_peak: int = 0
    pool_waits: int = 0  # pool checkouts that timed out (the worker logs' "QueuePool limit" lines)


@dataclass
class SoakReport:
    tasks: int = 0
    workers: int = 1
    task_ids: list[str] = field(default_factory=list)
    review_verdicts: Counter[str] = field(default_factory=Counter)  # every review of every task
    last_verdicts: Counter[str] = field(default_factory=Counter)  # each task's final review
    end_states: Counter[str] = field(default_factory=Counter)
    rework_rounds: Counter[int] = field(default_factory=Counter)  # rounds -> tasks
    repaired: int = 0  # tasks that had a rework round and then completed
    gate_failures: int = 0
    escalations: Counter[str] = field(default_factory=Counter)
    duplicate_charges: int = 0
    ledger_total: Decimal = Decimal(0)
    vendor_total: Decimal = Decimal(0)
    operations: int = 0  # operations charged by the vendor
    outcomes: int = 0  # paid Outcome events in the ledger
    hops: list[float] = field(
        default_factory=list
    )  # seconds, a node's completion -> its dependent's dispatch
    heroes: set[str] = field(default_factory=set)  # the tasks run with priority: hero
    # Per task, in start order: its first and last event's time on the ledger's clock (None: not ended).
    spans: list[tuple[str, datetime, datetime | None]] = field(default_factory=list)
    # Per task: seconds from its creation to its first INTENT (the wait for admission, ledger.admission).
    waits: list[float] = field(default_factory=list)
    wall_seconds: float = 0.0
    active_tasks: int = 0  # the workers' bound on tasks running at once (settings.active_tasks; 0: none)
    resources: Resources = field(default_factory=Resources)

    @property
    def clean(self) -> bool:
        """The money invariants (verdicts are whatever the faults made them)."""
        return self.duplicate_charges == 0 and self.ledger_total == self.vendor_total

    @property
    def all_completed(self) -> bool:
        return self.end_states.get("Completed", 0) == self.tasks

    def hop(self, q: float) -> float | None:
        return percentile(self.hops, q)

    def durations(self, heroes: bool) -> list[float]:
        """Seconds from each ended task's first event to its last, of the hero tasks or the others."""
        return [
            (end - start).total_seconds()
            for tid, start, end in self.spans
            if end is not None and (tid in self.heroes) == heroes
        ]

    def first_done(self) -> float | None:
        """Seconds from the run's first task's start to its first task's end."""
        ends = [end for _, _, end in self.spans if end is not None]
        return (min(ends) - min(s for _, s, _ in self.spans)).total_seconds() if ends else None

    def order(self) -> float | None:
        """Spearman's rank correlation of the tasks' start order with their finishing order (1: they finish
        in the order they started; 0: no relation)."""
        ended = [(start, end) for _, start, end in self.spans if end is not None]
        n = len(ended)
        if n < 3:
            return None
        by_start = sorted(range(n), key=lambda i: ended[i][0])
        by_end = sorted(range(n), key=lambda i: ended[i][1])
        start_rank = {i: r for r, i in enumerate(by_start)}
        end_rank = {i: r for r, i in enumerate(by_end)}
        d2 = sum((start_rank[i] - end_rank[i]) ** 2 for i in range(n))
        return 1 - 6 * d2 / (n * (n * n - 1))

    def table(self) -> Table:
        def counts(c: Counter[Any]) -> str:
            return ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: str(kv[0]))) or "—"

        def ms(v: float | None) -> str:
            return "—" if v is None else f"{v * 1000:.0f} ms"

        r = self.resources
        t = Table(title=f"ledgerflow soak — {self.tasks} tasks, {self.workers} workers", title_justify="left")
        t.add_column("measure")
        t.add_column("value")
        t.add_row("review verdicts (every review)", counts(self.review_verdicts))
        t.add_row("final verdict per task", counts(self.last_verdicts))
        t.add_row("end states", counts(self.end_states))
        t.add_row("rework rounds → tasks", counts(self.rework_rounds))
        t.add_row("repaired by rework", str(self.repaired))
        t.add_row("static gate failures", str(self.gate_failures))
        t.add_row("escalations by rule", counts(self.escalations))
        t.add_row("paid outcomes in the ledger / vendor charges", f"{self.outcomes} / {self.operations}")
        t.add_row("duplicate charges", str(self.duplicate_charges))
        t.add_row("ledger − vendor total", f"{self.ledger_total} − {self.vendor_total}")
        minutes = self.wall_seconds / 60
        t.add_row("wall time", f"{self.wall_seconds:.1f} s ({self.tasks / minutes:.1f} tasks/min)")
        p50, p95 = self.hop(0.50), self.hop(0.95)
        ratio = f", p95 = {p95 / p50:.1f} × p50" if p50 and p95 is not None else ""
        t.add_row(
            "completion → dependent's dispatch",
            f"p50 {ms(p50)}, p95 {ms(p95)} ({len(self.hops)} hops{ratio})",
        )

        def median(values: list[float]) -> str:
            found = percentile(values, 0.5)
            return "—" if found is None else f"{found:.1f} s ({len(values)} tasks)"

        t.add_row("tasks running at once (admission)", str(self.active_tasks or "no bound"))
        first = self.first_done()
        t.add_row("time to the first completed task", "—" if first is None else f"{first:.1f} s")
        w50, w95 = percentile(self.waits, 0.50), percentile(self.waits, 0.95)
        t.add_row(
            "created → first dispatch (admission)",
            "—" if w50 is None or w95 is None else f"p50 {w50:.1f} s, p95 {w95:.1f} s",
        )
        t.add_row("median task duration, standard", median(self.durations(heroes=False)))
        if self.heroes:
            t.add_row("median task duration, hero", median(self.durations(heroes=True)))
        order = self.order()
        t.add_row("finishing order vs start order", "—" if order is None else f"Spearman ρ {order:.2f}")
        if self.tasks:
            t.add_row(
                "CPU per task",
                f"workers {r.worker_cpu_seconds / self.tasks:.2f} s,"
                f" machine {r.machine_cpu_seconds / self.tasks:.2f} s",
            )
        rss = ", ".join(f"{n} {b / 2**20:.0f} MiB" for n, b in sorted(r.worker_rss_peak.items())) or "—"
        t.add_row("peak memory per worker", rss)
        t.add_row("ledger DB connections (peak)", str(r.pg_connections_peak))
        t.add_row("pool checkouts timed out", str(r.pool_waits))
        return t


class Sampler:
    """Peak memory per worker, CPU of the workers and of the machine, peak ledger connections."""

    def __init__(self, pids: dict[str, int], database_url: str) -> None:
        self.procs = {n: psutil.Process(p) for n, p in pids.items() if stack.is_worker(n) and stack.alive(p)}
        # psycopg takes a libpq URL: SQLAlchemy's driver suffix off.
        self.database_url = make_url(database_url).set(drivername="postgresql").render_as_string(False)
        self.res = Resources()
        self._cpu0 = {n: _cpu(p) for n, p in self.procs.items()}
        self._machine0 = _busy(psutil.cpu_times())

    async def run(self) -> None:
        with contextlib.suppress(psycopg.Error):
            async with await psycopg.AsyncConnection.connect(self.database_url, autocommit=True) as conn:
                while True:
                    self._sample_memory()
                    row = await (
                        await conn.execute(
                            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"
                        )
                    ).fetchone()
                    self.res.pg_connections_peak = max(
                        self.res.pg_connections_peak, int(row[0]) if row else 0
                    )
                    await asyncio.sleep(1.0)

    def _sample_memory(self) -> None:
        for n, p in self.procs.items():
            with contextlib.suppress(psutil.Error):
                self.res.worker_rss_peak[n] = max(self.res.worker_rss_peak.get(n, 0), p.memory_info().rss)

    def finish(self, logs: Path) -> Resources:
        self._sample_memory()
        for n, p in self.procs.items():
            with contextlib.suppress(psutil.Error):
                self.res.worker_cpu_seconds += _cpu(p) - self._cpu0[n]
        self.res.machine_cpu_seconds = _busy(psutil.cpu_times()) - self._machine0
        for n in self.procs:
            log = logs / f"{n}.log"
            if log.exists():
                self.res.pool_waits += log.read_text(errors="replace").count(POOL_WAIT)
        return self.res


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


def _busy(t: Any) -> float:
    return float(
        t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    )


async def run_soak(
    settings: Settings,
    plan_text: str,
    tasks: int,
    sim_config: dict[str, Any] | None,
    *,
    workers: int = 1,
    timeout: float = 3600.0,
    hero_share: float = 0.0,
) -> SoakReport:
    info = stack.up(settings, workers=workers)
    settings = Settings()  # the stack's addresses now live in stack.json
    if sim_config is not None:
        if settings.vendor_url:
            raise lf.ClientError(
                "--sim configures our simulator, but LEDGERFLOW_VENDOR_URL names another vendor"
            )
        reply = httpx.put(f"{info['vendor_url']}/admin/config", json=sim_config, timeout=10)
        reply.raise_for_status()
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    project = f"soak-{stamp}"
    client = await lf.connect(settings)
    task_ids = [f"soak-{stamp}-{n:04d}" for n in range(tasks)]
    sampler = Sampler(dict(info["pids"]), str(info["database_url"]))
    sampling = asyncio.create_task(sampler.run())
    loop = asyncio.get_running_loop()
    started = loop.time()
    # Every k-th task is a hero (k = 1 / hero_share): spread over the start order, not the first ones.
    every = round(1 / hero_share) if hero_share > 0 else 0
    heroes = {tid for n, tid in enumerate(task_ids) if every and n % every == every - 1}
    handles = await _start_all(client, settings, plan_text, task_ids, project, heroes)
    deadline = started + timeout
    rec = lf.recorder(settings)
    try:
        while loop.time() < deadline:
            # Visibility counts runs, and a task may have more than one (a takeover): the ledger says when
            # every task has settled.
            if await _settled(client, project) >= tasks and await asyncio.to_thread(
                _all_settled, rec, task_ids
            ):
                break
            await asyncio.sleep(2.0)  # what is still running at the deadline is reported as it stands
        wall = loop.time() - started
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
        resources = sampler.finish(Path(str(info["logs"])))
        for h, tid in zip(handles, task_ids, strict=True):
            if fold(rec.read_events(tid)).state.value not in ("Completed", "Failed"):
                with contextlib.suppress(RPCError):  # it may have ended on its own meanwhile
                    await h.terminate("soak run over: nobody is there to answer")
        report = tally(rec, task_ids, str(info["vendor_url"]))
        report.heroes = heroes
    finally:
        rec.dispose()
    report.wall_seconds, report.workers, report.resources = wall, workers, resources
    report.active_tasks = settings.active_tasks
    return report


async def _start_all(
    client: Client,
    settings: Settings,
    plan_text: str,
    task_ids: list[str],
    project: str,
    heroes: Collection[str] = (),
) -> list[WorkflowHandle[Any, Any]]:
    """Start every task, a few dozen starts in flight at once. The project is a search attribute from the
    start, so the progress count sees a task that ends before its first upsert."""
    gate = asyncio.Semaphore(START_CONCURRENCY)

    async def start(n: int, tid: str) -> WorkflowHandle[Any, Any]:
        plan = lf.parse_plan(plan_text, tid)
        # Its own project, so a soak run never spends a real project's budget (nor is stopped by it).
        plan = plan.model_copy(update={"goal": f"{plan.goal} (take {n})", "project": project})
        if tid in heroes:
            plan = plan.model_copy(update={"priority": "hero"})
        async with gate:
            return await client.start_workflow(
                TaskWorkflow.run,
                TaskInput(task_id=tid, plan=plan),
                id=workflow_id(tid),
                task_queue=settings.task_queue,
                priority=start_priority(plan.priority),
                **starting_story(plan),
            )

    return list(await asyncio.gather(*(start(n, tid) for n, tid in enumerate(task_ids))))


def _all_settled(rec: Recorder, task_ids: list[str]) -> bool:
    """Whether every task's ledger has reached Completed, Failed or Escalated."""
    return all(fold(rec.read_events(tid)).state.value in SETTLED for tid in task_ids)


async def _settled(client: Client, project: str) -> int:
    """How many of the run's tasks are settled: the task's last run ended, or its task state says so."""
    states = ", ".join(f"'{s}'" for s in sorted(SETTLED))
    query = (
        f"{PROJECT.name} = '{project}'"
        # a run that continued as new is not its task's end (the next run carries the search attributes on)
        f" AND ExecutionStatus != 'ContinuedAsNew'"
        f" AND (ExecutionStatus != 'Running' OR {STATE.name} IN ({states}))"
    )
    with contextlib.suppress(RPCError):
        return (await client.count_workflows(query)).count
    return 0


def tally(rec: Recorder, task_ids: list[str], vendor_url: str) -> SoakReport:
    """Everything the report says, read from the ledger and from the vendor's charge list."""
    report = SoakReport(tasks=len(task_ids), task_ids=list(task_ids))
    charges = charges_for(vendor_url, task_ids)
    report.operations = len(charges)
    report.duplicate_charges, report.vendor_total = duplicates_and_total(charges)
    for tid in task_ids:
        events = rec.read_events(tid)
        p = fold(events)
        verdicts = []
        rule = ""
        first_intent: datetime | None = None  # when the task's work started (after its wait for admission)
        for e in events:
            ev = parse(e)
            if isinstance(ev, Intent):
                rule = ev.rule  # an Escalation is written with (right after) the INTENT deciding it
                first_intent = first_intent or e.recorded_at
            if isinstance(ev, Outcome) and ev.actual_cost > 0:
                report.outcomes += 1  # paid (compose is local, a reused output free)
            if isinstance(ev, ExecutionResult) and ev.kind == "review" and ev.verdict is not None:
                verdicts.append(str(ev.verdict))
            if isinstance(ev, ExecutionResult) and ev.kind == "gate" and not ev.passed:
                report.gate_failures += 1
            if isinstance(ev, Escalation):
                report.escalations[f"{rule} {RULE_NAMES.get(rule, '')}".strip()] += 1
        report.ledger_total += vendor_spend(events)  # every operation's cost and every late charge
        report.review_verdicts.update(verdicts)
        report.last_verdicts[verdicts[-1] if verdicts else "no review"] += 1
        report.end_states[p.state.value] += 1
        report.rework_rounds[p.rework_rounds] += 1
        report.repaired += p.rework_rounds > 0 and p.state.value == "Completed"
        report.hops += hops(p.graph, events)
        if events:
            ended = events[-1].recorded_at if p.terminal else None
            report.spans.append((tid, events[0].recorded_at, ended))
            if first_intent is not None:
                report.waits.append((first_intent - events[0].recorded_at).total_seconds())
    return report


def hops(graph: Graph, events: list[StoredEvent]) -> list[float]:
    """For each node's first INTENT that had dependencies: seconds from the last of its dependencies'
    completions (Outcome or review/gate result, whichever came last before it) to that INTENT — the loop's
    turn-around, measured on the ledger's clock (recorded_at, the database's)."""
    done: dict[str, datetime] = {}
    seen: set[str] = set()
    out = []
    for e in events:
        ev = parse(e)
        if isinstance(ev, Outcome | ExecutionResult) and ev.node not in done:
            done[ev.node] = e.recorded_at
        elif isinstance(ev, Intent):
            node = getattr(ev.action, "node", None)
            if not isinstance(node, str) or node in seen or node not in graph.nodes:
                continue
            seen.add(node)
            deps = [d for s in graph.stage_deps[graph.stage_of(node)] for d in graph.stage_nodes[s]]
            if deps and all(d in done for d in deps):
                out.append((e.recorded_at - max(done[d] for d in deps)).total_seconds())
    return out
