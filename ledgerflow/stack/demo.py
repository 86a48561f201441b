"""``ledgerflow demo``: the E001 pipeline, unattended, on the embedded stack, with a live view and report."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table
from temporalio.client import WorkflowFailureError, WorkflowQueryFailedError
from temporalio.service import RPCError

from artifacts import open_store, store_for_uri
from ledgerflow import client as lf
from ledgerflow import stack
from ledgerflow.report import stage_rows, status_table
from media import probe
from rules.events import Outcome, RollbackDone, parse_as
from runtime.settings import Settings
from workflows.contracts import TaskInput, workflow_id
from workflows.task import TaskWorkflow


def run_demo(settings: Settings, plan_text: str, out: Console) -> int:
    started = time.monotonic()
    out.print("[bold]ledgerflow demo[/bold]: bringing the embedded stack up …")
    info = stack.up(settings)
    # The stack's addresses now live in stack.json; a fresh Settings reads them.
    settings = Settings()
    if not settings.vendor_url:  # our own simulator: give it the demo's latencies and technical failures
        sim_config = Path(__file__).resolve().parent.parent / "examples" / "simulator_demo.json"
        reply = httpx.put(
            f"{info['vendor_url']}/admin/config", json=json.loads(sim_config.read_text()), timeout=10
        )
        reply.raise_for_status()
    task_id = f"demo-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"
    plan = lf.parse_plan(plan_text, task_id)
    _give_the_project_a_ceiling(settings, f"project:{plan.project}")
    summary, error = asyncio.run(_run(settings, plan, out))
    wall = time.monotonic() - started
    record = lf.events(settings, task_id)
    out.print(_report(summary, len(record), wall))
    for line in _rework_lines(record):
        out.print(line)
    ui = info.get("ui_url")
    if ui:
        out.print(f"Temporal UI: {ui}/namespaces/{settings.namespace}/workflows/{workflow_id(task_id)}")
    out.print(f"Ledger:      ledgerflow events {task_id}   ·   artifacts: ledgerflow artifacts {task_id}")
    episode = _episode(settings, record)
    if episode:
        out.print(f"[bold]Episode:[/bold]     {episode}")
    if error:
        out.print(f"[red]task failed:[/red] {error}")
    return 0 if summary.get("state") == "Completed" else 1


def _episode(settings: Settings, record: list[Any]) -> str | None:
    """The composed episode: its file and what a probe of it says (None if compose made no video)."""
    composed = [
        parse_as(e, Outcome) for e in record if e.type == "Outcome" and e.payload.get("node") == "compose"
    ]
    if not composed or not composed[-1].artifact.media:
        return None
    uri = composed[-1].artifact.uri
    store = store_for_uri(uri, [open_store(settings.store_location())])
    # The store names files by their hash; a copy under the task's name is what a person opens in a player.
    where = (settings.state_dir / "episodes" / f"{record[0].task_id}.mp4").resolve()
    where.parent.mkdir(parents=True, exist_ok=True)
    with store.local_copy(uri) as path:
        shutil.copyfile(path, where)
    found = probe(where)
    shape = f"{found.width}×{found.height}, {found.frames} frames" + (", with audio" if found.audio else "")
    return f"{where}  ({found.duration_s:.1f} s, {shape})"


def _give_the_project_a_ceiling(settings: Settings, scope: str) -> None:
    """The demo project gets a 500.00 ceiling the first time, so `budget show` has a limit to show."""
    rec = lf.recorder(settings)
    try:
        account = rec.account(scope)
        if account is None or account.ceiling is None:
            rec.set_ceiling(scope, Decimal("500"))
    finally:
        rec.dispose()


async def _run(settings: Settings, plan: Any, out: Console) -> tuple[dict[str, Any], str | None]:
    client = await lf.connect(settings)
    handle = await client.start_workflow(
        TaskWorkflow.run,
        TaskInput(task_id=plan.task_id, plan=plan),
        id=workflow_id(plan.task_id),
        task_queue=settings.task_queue,
    )
    out.print(
        f"task {plan.task_id} started; storyboard approval times out after "
        f"{plan.approval.timeout:g}s and the plan's policy ({plan.approval.policy}) applies"
    )
    result_task = asyncio.ensure_future(handle.result())
    error = None
    with Live(Table(), console=out, refresh_per_second=4, transient=False) as live:
        while not result_task.done():
            # The query can race the workflow's first task; the next tick retries.
            with contextlib.suppress(RPCError, WorkflowQueryFailedError):
                live.update(status_table(await handle.query("status")))
            await asyncio.wait([result_task], timeout=0.5)
        try:
            summary = (await result_task).summary
        except WorkflowFailureError as e:
            error = str(e.cause or e)
            summary = await lf.status(settings, plan.task_id)
        live.update(status_table(summary))
    return summary, error


def _rework_lines(record: list[Any]) -> list[str]:
    """One line per quality-rework round: what the review flagged, what was rerun, and the outcome."""
    lines = []
    for e in record:
        if e.type == "ExecutionResult" and e.payload.get("kind") == "review":
            findings = "; ".join(e.payload.get("findings", []))
            lines.append(f"review (seq {e.seq}): {e.payload.get('verdict')} {findings}".rstrip())
        if e.type == "Rollback":
            done = parse_as(e, RollbackDone)
            rerun = [n for n in done.invalidated if n not in done.targets]
            lines.append(
                f"rework round {done.round} (seq {e.seq}): rerun {', '.join(done.targets)} "
                f"and {len(rerun)} nodes built on them ({', '.join(rerun)})"
            )
    return lines


def _report(summary: dict[str, Any], n_events: int, wall: float) -> Table:
    table = Table(
        title=f"E001 report — {summary['state']}, verdict {summary.get('verdict')}", title_justify="left"
    )
    for col in ("stage", "nodes", "attempts", "cost"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for stage, nodes, _done, attempts, cost in stage_rows(summary):
        table.add_row(stage, str(nodes), str(attempts), str(cost))
    table.add_section()
    table.add_row("total", "", "", str(summary["spent"]))
    table.caption = (
        f"{n_events} ledger events · wall time {wall:.1f}s · ceiling {summary['ceiling']} · "
        f"rework rounds {summary.get('rework_rounds', 0)}"
    )
    return table
