"""``ledgerflow demo``: the E001 pipeline, unattended, on the embedded stack, with a live view and report.

It never waits on a person without saying so: it starts by printing where everything is (Temporal, its Web UI,
the reviewer page, how to stop the stack), and whenever the task waits on a person it prints the command and
the reviewer page link that answer, the deadline, and what happens then. Its plan
(``examples/e001_demo.yaml``) gives every wait it can reach a deadline and a policy that ends the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
import urllib.parse
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, Final

import httpx
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from temporalio.client import WorkflowFailureError, WorkflowQueryFailedError
from temporalio.service import RPCError

from artifacts import open_store, store_for_uri
from ledgerflow import client as lf
from ledgerflow.stack import services as stack
from ledgerflow.views.report import stage_rows, status_table
from media import probe
from rules.actions import RequestKind
from rules.events import Outcome, RollbackDone, parse_as
from rules.people import allowed_approvers
from rules.plan import Plan, TimeoutPolicy
from runtime.settings import Settings
from runtime.signing import DEMO_APPROVERS
from workflows.contracts import TaskInput, starting_story, workflow_id
from workflows.task import TaskWorkflow

PROJECT_CEILING: Final = Decimal("500")
# With output piped (no live view), a line of progress this often, and whenever the task's state changes.
PROGRESS_EVERY_S: Final = 30.0


def run_demo(settings: Settings, plan_text: str, out: Console) -> int:
    started = time.monotonic()
    out.print("[bold]ledgerflow demo[/bold]: bringing the embedded stack up …")
    info = stack.up(settings)
    # The stack's addresses now live in stack.json; a fresh Settings reads them.
    settings = Settings()
    for line in where_lines(info, settings):
        out.print(line, highlight=False, soft_wrap=True)
    if not settings.vendor_url:  # our own simulator: give it the demo's latencies and technical failures
        sim_config = Path(__file__).resolve().parents[2] / "examples" / "simulator_demo.json"
        reply = httpx.put(
            f"{info['vendor_url']}/admin/config", json=json.loads(sim_config.read_text()), timeout=10
        )
        reply.raise_for_status()
    task_id = f"demo-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"
    plan = lf.parse_plan(plan_text, task_id)
    raised = _give_the_project_room(settings, f"project:{plan.project}", plan.budget_ceiling)
    if raised:
        out.print(raised, highlight=False)
    people = People(task_id, plan, str(info.get("review_url") or ""))
    summary, error = asyncio.run(run_task(settings, plan, out, people))
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
    elif summary.get("state") != "Completed":
        why = summary.get("terminal_reason") or summary.get("escalation_reason") or ""
        out.print(f"[red]task {summary.get('state')}:[/red] {why}", highlight=False)
    out.print(
        "The stack keeps running (ledgerflow status, ledgerflow tasks …): [bold]make down[/bold] stops it."
    )
    return 0 if summary.get("state") == "Completed" else 1


def where_lines(info: dict[str, Any], settings: Settings) -> list[str]:
    """Where everything is, printed before the task starts: Temporal, its Web UI, the reviewer page, and how
    to stop the stack (with each standard port that was busy and the port taken instead)."""
    address = info.get("temporal_address")
    lines = [f"Temporal       {address}   (stock CLI: temporal workflow list --address {address})"]
    lines.append(f"Temporal UI    {info.get('ui_url') or 'not known (set LEDGERFLOW_UI_URL)'}")
    tokens = settings.state_dir.resolve() / "stack.json"
    lines.append(
        f"Reviewer page  {info.get('review_url') or 'not running'}   "
        f"(log in as director: its token is review_tokens.director in {tokens})"
    )
    for moved in stack.moved_port_lines(info):
        lines.append(f"               {moved}")
    lines.append("Stop it all    make down   (or: ledgerflow down) — the stack keeps running after the demo")
    return lines


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


def _give_the_project_room(settings: Settings, scope: str, task_ceiling: Decimal) -> str | None:
    """The demo project gets a 500.00 ceiling the first time, so `budget show` has a limit to show; when what
    is left of it would not cover another demo task, it is raised by 500.00 (said in the line returned), so a
    demo never stops on a budget escalation because earlier demos used the project's money up."""
    rec = lf.recorder(settings)
    try:
        account = rec.account(scope)
        if account is None or account.ceiling is None:
            rec.set_ceiling(scope, PROJECT_CEILING)
            return None
        left = account.remaining
        if left is not None and left < task_ceiling:
            rec.raise_ceiling(scope, PROJECT_CEILING)
            return (
                f"{scope}: {left} of its ceiling {account.ceiling} left, below this task's {task_ceiling}: "
                f"raised by {PROJECT_CEILING} (ledgerflow budget show {scope})"
            )
        return None
    finally:
        rec.dispose()


@dataclass
class People:
    """What the demo says when its task waits on a person: each open request once (again if its deadline
    moves), with the command and the reviewer page link that answer it, its deadline and what happens then."""

    task_id: str
    plan: Plan
    review_url: str
    created_at: datetime | None = None  # the task's TaskCreated time: its time ceiling counts from there
    told: dict[str, str | None] = field(default_factory=dict)

    def news(self, summary: dict[str, Any]) -> list[dict[str, Any]]:
        """The open requests not yet told (or whose deadline changed since)."""
        fresh = []
        for r in summary.get("open_requests") or []:
            if self.told.get(r["id"], "") != r.get("deadline"):
                self.told[r["id"]] = r.get("deadline")
                fresh.append(r)
        return fresh

    def lines(self, request: dict[str, Any], now: datetime) -> list[str]:
        rid, kind = str(request["id"]), str(request["kind"])
        options = [str(o).replace("_", "-") for o in request.get("options") or []]  # as `decide` spells them
        first = options[0] if options else "resume"
        who = self._approver(kind)
        command = f"ledgerflow decide {self.task_id}/{rid} {first} {who}"
        others = [o + (" --amount N" if o == "add-budget" else "") for o in options[1:]]
        link = f"{self.review_url.rstrip('/')}/requests/{self.task_id}/{urllib.parse.quote(rid, safe=':')}"
        deadline, then = self._deadline(request)
        reason = escape(
            str(request.get("reason") or "")[:300]
        )  # printed with markup on: its brackets are text
        lines = [f"[bold yellow]waiting on a person[/bold yellow]: {kind} {escape(rid)} — {reason}"]
        lines.append(f"  answer    {command}" + (f"   (or: {', '.join(others)})" if others else ""))
        if self.review_url:
            lines.append(f"  or open   {link}")
        if deadline is None:
            lines.append(f"  deadline  none known: {then}")
        else:
            left = max(0, round((deadline - now).total_seconds()))
            at = deadline.astimezone().strftime("%H:%M:%S")
            lines.append(f"  deadline  {at} (in {_span(left)}): then {then}")
        return lines

    def _approver(self, kind: str) -> str:
        allowed = allowed_approvers(self.plan.approval, RequestKind(kind))
        demo = [a for a in allowed if a in DEMO_APPROVERS] if allowed else list(DEMO_APPROVERS)
        return f"--as {demo[0]}" if demo else f"--key-file YOUR.key   (one of: {', '.join(allowed)})"

    def _deadline(self, request: dict[str, Any]) -> tuple[datetime | None, str]:
        """When the wait ends by itself, and what happens then (rules.table: R5, R6 and R4)."""
        ceiling_text = "the task's time ceiling stops it: it fails, and what it made is undone"
        ceiling = (
            self.created_at + timedelta(seconds=self.plan.time_ceiling)
            if self.created_at is not None
            else None
        )
        raw = request.get("deadline")
        if raw is None:  # an escalation or a refused proposal: only the task's time ceiling ends the wait
            return ceiling, ceiling_text
        deadline = datetime.fromisoformat(str(raw))
        if ceiling is not None and ceiling < deadline:
            return ceiling, ceiling_text
        approval = self.plan.approval
        if approval.backups and not request.get("offered_to_backups"):
            return deadline, f"it is offered to the backup approvers ({', '.join(approval.backups)})"
        policy = approval.policy
        if request["kind"] != "approval" and policy == TimeoutPolicy.APPROVE:
            policy = TimeoutPolicy.ESCALATE  # an unanswered dead letter never approves itself
        return deadline, {
            TimeoutPolicy.APPROVE: "the plan's policy approves it",
            TimeoutPolicy.ABORT: "the plan's policy aborts the task (what it made is undone)",
            TimeoutPolicy.ESCALATE: "the plan's policy escalates it (the task stops and asks again, until "
            "its time ceiling)",
        }[policy]


def _span(seconds: int) -> str:
    return f"{seconds} s" if seconds < 120 else f"{seconds // 60} min {seconds % 60:02d} s"


def wait_policy_line(plan: Plan) -> str:
    """How each wait for a person the plan can reach ends by itself (printed when the task starts)."""
    a = plan.approval
    dead_letter = TimeoutPolicy.ESCALATE if a.policy == TimeoutPolicy.APPROVE else a.policy
    return (
        f"every wait for a person ends by itself: an approval after {a.timeout:g} s ({a.policy.value}), "
        f"a dead letter after {a.timeout:g} s ({dead_letter.value}), an escalation at the task's time "
        f"ceiling of {_span(round(plan.time_ceiling))} (the task fails)"
    )


async def run_task(
    settings: Settings, plan: Plan, out: Console, people: People
) -> tuple[dict[str, Any], str | None]:
    """Start the plan's task and follow it to its end with a live view (a line of progress now and then when
    the output is not a terminal), telling each wait for a person as it opens; its summary and error."""
    assert plan.task_id is not None
    client = await lf.connect(settings)
    handle = await client.start_workflow(
        TaskWorkflow.run,
        TaskInput(task_id=plan.task_id, plan=plan),
        id=workflow_id(plan.task_id),
        task_queue=settings.task_queue,
        **starting_story(plan),
    )
    out.print(f"task {plan.task_id} started; {wait_policy_line(plan)}", highlight=False, soft_wrap=True)
    result_task = asyncio.ensure_future(handle.result())
    error = None
    progress = Progress(out)
    with Live(Table(), console=out, refresh_per_second=4, transient=False) as live:
        while not result_task.done():
            # The query can race the workflow's first task; the next tick retries.
            with contextlib.suppress(RPCError, WorkflowQueryFailedError):
                status = await handle.query("status")
                live.update(status_table(status))
                _tell_people(settings, people, status, live.console)
                progress.tick(status)
            await asyncio.wait([result_task], timeout=0.5)
        try:
            summary = (await result_task).summary
        except WorkflowFailureError as e:
            error = str(e.cause or e)
            summary = await lf.status(settings, plan.task_id)
        live.update(status_table(summary))
    if not out.is_terminal:
        out.print()  # the live view's last render ends without a newline when the output is not a terminal
    return summary, error


def _tell_people(settings: Settings, people: People, status: dict[str, Any], out: Console) -> None:
    now = datetime.now(UTC)
    fresh = people.news(status)
    if fresh and people.created_at is None:
        with contextlib.suppress(lf.ClientError):
            people.created_at = lf.events(settings, people.task_id)[0].recorded_at
    for request in fresh:  # one print per request: the live view redraws once below it
        out.print("\n".join(people.lines(request, now)), highlight=False, soft_wrap=True)


@dataclass
class Progress:
    """With output piped (no live view): a line when the task's state changes, and every 30 s."""

    out: Console
    state: str | None = None
    last: float = 0.0

    def tick(self, status: dict[str, Any]) -> None:
        if self.out.is_terminal:
            return
        now = time.monotonic()
        state = str(status.get("state"))
        if state == self.state and now - self.last < PROGRESS_EVERY_S:
            return
        self.state, self.last = state, now
        nodes = dict(status.get("nodes") or {})
        done = sum(1 for n in nodes.values() if n.get("status") == "succeeded")
        self.out.print(
            f"{datetime.now().strftime('%H:%M:%S')}  {state}: {done}/{len(nodes)} nodes succeeded, "
            f"spent {status.get('spent')} of {status.get('ceiling')}",
            highlight=False,
        )


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
