"""``ledgerflow soak``: many copies of one plan under the simulator's failure rates, and what became of them.

Every task gets its own id and goal (the simulator's seeded draws, including the model's verdicts, depend on
the request, so the copies meet different faults). The run ends when every task is Completed, Failed or
Escalated (an unattended run has nobody to answer: approvals and dead letters time out by the plan's policy);
escalated tasks are then terminated. Report: review verdict counts (every review, and each task's last),
end states, rework rounds, gate failures, and the money invariants — duplicate charges and ledger total
against the vendor's own charge list.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import httpx
from rich.table import Table
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle
from temporalio.service import RPCError

from ledger.recorder import Recorder
from ledgerflow import client as lf
from ledgerflow import stack
from ledgerflow.drill import vendor_charges
from rules.events import Escalation, ExecutionResult, Intent, parse, vendor_spend
from rules.projection import fold
from rules.table import RULES
from runtime.settings import Settings
from workflows.contracts import TaskInput, workflow_id
from workflows.task import TaskWorkflow

SETTLED = frozenset({"Completed", "Failed", "Escalated"})
RULE_NAMES = {r.id: r.name for r in RULES}


@dataclass
class SoakReport:
    tasks: int = 0
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
    wall_seconds: float = 0.0

    @property
    def clean(self) -> bool:
        """The money invariants (verdicts are whatever the faults made them)."""
        return self.duplicate_charges == 0 and self.ledger_total == self.vendor_total

    def table(self) -> Table:
        def counts(c: Counter[Any]) -> str:
            return ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: str(kv[0]))) or "—"

        t = Table(title=f"ledgerflow soak — {self.tasks} tasks", title_justify="left")
        t.add_column("measure")
        t.add_column("value")
        t.add_row("review verdicts (every review)", counts(self.review_verdicts))
        t.add_row("final verdict per task", counts(self.last_verdicts))
        t.add_row("end states", counts(self.end_states))
        t.add_row("rework rounds → tasks", counts(self.rework_rounds))
        t.add_row("repaired by rework", str(self.repaired))
        t.add_row("static gate failures", str(self.gate_failures))
        t.add_row("escalations by rule", counts(self.escalations))
        t.add_row("duplicate charges", str(self.duplicate_charges))
        t.add_row("ledger − vendor total", f"{self.ledger_total} − {self.vendor_total}")
        t.caption = f"wall time {self.wall_seconds:.1f}s"
        return t


async def run_soak(
    settings: Settings,
    plan_text: str,
    tasks: int,
    sim_config: dict[str, Any] | None,
    timeout: float = 1800.0,
) -> SoakReport:
    started = asyncio.get_running_loop().time()
    info = stack.up(settings)
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
    handles: list[WorkflowHandle[Any, Any]] = []
    task_ids = []
    for n in range(tasks):
        tid = f"soak-{stamp}-{n:03d}"
        plan = lf.parse_plan(plan_text, tid)
        # Its own project, so a soak run never spends a real project's budget (nor is stopped by it).
        plan = plan.model_copy(update={"goal": f"{plan.goal} (take {n})", "project": project})
        handles.append(
            await client.start_workflow(
                TaskWorkflow.run,
                TaskInput(task_id=tid, plan=plan),
                id=workflow_id(tid),
                task_queue=settings.task_queue,
            )
        )
        task_ids.append(tid)
    pending = set(range(tasks))
    deadline = asyncio.get_running_loop().time() + timeout
    while pending:
        for i in list(pending):
            with contextlib.suppress(RPCError):
                if (await handles[i].query("status"))["state"] in SETTLED:
                    pending.discard(i)
                    continue
            with contextlib.suppress(RPCError):
                if (await handles[i].describe()).status != WorkflowExecutionStatus.RUNNING:
                    pending.discard(i)  # the workflow itself ended (e.g. failed): nothing more will happen
        if asyncio.get_running_loop().time() > deadline:
            break  # what is still running is reported as it stands
        await asyncio.sleep(1.0)
    rec = lf.recorder(settings)
    try:
        for h, tid in zip(handles, task_ids, strict=True):
            if fold(rec.read_events(tid)).state.value not in ("Completed", "Failed"):
                with contextlib.suppress(RPCError):  # it may have ended on its own meanwhile
                    await h.terminate("soak run over: nobody is there to answer")
        report = tally(rec, task_ids, str(info["vendor_url"]))
    finally:
        rec.dispose()
    report.wall_seconds = asyncio.get_running_loop().time() - started
    return report


def tally(rec: Recorder, task_ids: list[str], vendor_url: str) -> SoakReport:
    """Everything the report says, read from the ledger and from the vendor's charge list."""
    report = SoakReport(tasks=len(task_ids))
    report.duplicate_charges, report.vendor_total = vendor_charges(vendor_url, task_ids)
    for tid in task_ids:
        events = rec.read_events(tid)
        p = fold(events)
        verdicts = []
        rule = ""
        for e in events:
            ev = parse(e)
            if isinstance(ev, Intent):
                rule = ev.rule  # an Escalation is written with (right after) the INTENT deciding it
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
    return report
