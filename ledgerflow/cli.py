"""The ``ledgerflow`` command line: stack, worker, submit, status, events, demo.

Every user error (a bad plan, a missing file, an unreachable server, a duplicate task) is one red line on
stderr and exit code 2 — never a traceback. Every command honours ``LEDGERFLOW_TEMPORAL_ADDRESS`` and
``LEDGERFLOW_DATABASE_URL`` (and the other ``LEDGERFLOW_*`` settings) to use existing servers.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import faulthandler
import functools
import json
import os
import sys
import uuid
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console

from ledgerflow.errors import ClientError, StackError

if TYPE_CHECKING:
    from runtime.settings import Settings

# Imports stay inside the commands: `ledgerflow --help` (and a mistyped option) must not load Temporal's SDK,
# SQLAlchemy or the ledger (tests/cli/test_lazy.py holds this).

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Trustworthy orchestration of paid pipelines."
)
out = Console()
err = Console(stderr=True)
F = TypeVar("F", bound=Callable[..., Any])


def _version(value: bool) -> None:
    if value:
        from ledgerflow import installed_version

        found = installed_version()
        said = f"ledgerflow {found}" if found else "ledgerflow (not installed: no version)"
        out.print(said, highlight=False)
        raise typer.Exit()


@app.callback()
def options(
    show_version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit"),
    ] = False,
) -> None:
    """Trustworthy orchestration of paid pipelines."""


def get_settings() -> Settings:
    """This deployment's settings (``LEDGERFLOW_*`` and ``.ledgerflow/stack.json``), read once."""
    from runtime.settings import get_settings as settings

    return settings()


def user_errors() -> tuple[type[BaseException], ...]:
    """The errors a user can fix, each printed as one line with exit code 2 (imported when one is raised)."""
    from ledger.errors import LedgerError
    from rules.plan import PlanError
    from runtime.settings import ConfigError

    return (
        PlanError,
        ConfigError,
        StackError,
        LedgerError,
        ClientError,
        FileNotFoundError,
        IsADirectoryError,
    )


def friendly(fn: F) -> F:
    """Turn our user-facing errors into one line and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if not isinstance(e, user_errors()):
                raise
            err.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def _read(path: Path, what: str = "plan") -> str:
    if not path.exists():
        raise FileNotFoundError(f"no such {what} file: {path}")
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory, not a {what} file")
    try:
        return path.read_text()
    except UnicodeDecodeError:
        from rules.plan import PlanError

        raise PlanError(f"{what}: {path} is not a text file") from None


@app.command()
@friendly
def up(
    no_worker: Annotated[bool, typer.Option("--no-worker", help="start the servers only")] = False,
    workers: Annotated[
        int, typer.Option("--workers", min=1, help="how many workers should run, each with its own /healthz")
    ] = 1,
) -> None:
    """Start the embedded stack (Temporal dev server + UI, Postgres, vendor simulator, the ledger's migration,
    N workers); return once each worker it started reports healthy."""
    from ledgerflow.stack import services as stack

    s = stack.up(
        get_settings(),
        with_worker=not no_worker,
        workers=workers,
        log=lambda line: out.print(line, highlight=False, soft_wrap=True),
    )
    moved = dict(s.get("moved_ports") or {})

    def busy(key: str) -> str:  # a standard port that was busy when the server started
        return f" ({moved[key]['standard']} was busy)" if key in moved else ""

    out.print(
        f"Temporal  {s['temporal_address']}{busy('temporal')}   Web UI {s.get('ui_url')}{busy('temporal_ui')}"
    )
    out.print(f"Postgres  {s['database_url']}")
    out.print(f"Vendor    {s['vendor_url']}")
    out.print(
        f"Review    {s['review_url']}   (demo approvers' tokens and key files in {get_settings().state_dir})"
    )
    out.print(f"state in  {get_settings().state_dir / 'stack.json'}")


@app.command()
@friendly
def review(
    host: Annotated[str, typer.Option("--host", help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535)] = 8300,
    tls_cert: Annotated[Path | None, typer.Option("--tls-cert", help="PEM certificate: serve HTTPS")] = None,
    tls_key: Annotated[Path | None, typer.Option("--tls-key", help="its PEM private key")] = None,
) -> None:
    """Serve the reviewer page and its JSON API (approvers log in with LEDGERFLOW_REVIEW_TOKENS); over TLS
    with --tls-cert and --tls-key (the deployment's reviewer service does)."""
    from ledgerflow.review import serve

    serve(get_settings(), host, port, tls_cert=tls_cert, tls_key=tls_key)


webhooks_app = typer.Typer(
    no_args_is_help=True, help="The receiver of vendors' callbacks (routes with `callback:`)."
)
app.add_typer(webhooks_app, name="webhooks")


@webhooks_app.command("serve")
@friendly
def webhooks_serve(
    host: Annotated[str, typer.Option("--host", help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535)] = 8787,
) -> None:
    """Serve POST /callbacks/{route}: verify each vendor callback, record it in the ledger, wake the worker
    waiting on its operation. Its own process and port, apart from the reviewer page (as lf_receiver)."""
    from ledgerflow.webhooks import serve

    serve(get_settings(), host, port)


@app.command()
@friendly
def down() -> None:
    """Stop the embedded stack."""
    from ledgerflow.stack import services as stack

    stopped = stack.down(get_settings())
    out.print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))


@app.command()
@friendly
def worker() -> None:
    """Run a worker in the foreground (same as ``python worker.py``)."""
    import worker as worker_module
    from runtime import logs

    logs.configure()  # text, or JSON with LEDGERFLOW_LOG_FORMAT=json (runtime/logs.py)
    asyncio.run(worker_module.run_worker(get_settings()))


@app.command()
@friendly
def submit(
    plan: Annotated[Path, typer.Argument(help="plan file (YAML)")],
    task_id: Annotated[
        str | None, typer.Option("--task-id", help="task id (default: plan's, else random)")
    ] = None,
    wait: Annotated[bool, typer.Option("--wait", help="wait for the task to finish")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    budget_from_quote: Annotated[
        str | None,
        typer.Option(
            "--budget-from-quote", metavar="p50|p95", help="ceiling = the quote's total (and record it)"
        ),
    ] = None,
) -> None:
    """Validate a plan and start its task. A task id can only be submitted once."""
    from ledgerflow import client as lf

    settings = get_settings()
    parsed = lf.parse_plan(_read(plan), task_id)
    if budget_from_quote is not None:  # ledgerflow.views.quote: the ceiling from the ledger's history
        from ledgerflow.views.quote import budget_from_quote as quoted

        parsed, _ = quoted(settings, parsed, budget_from_quote)
        if not as_json:
            shown = f"ceiling {parsed.budget_ceiling}: the quote's {budget_from_quote} total"
            out.print(shown, highlight=False)
    tid = parsed.task_id or f"task-{uuid.uuid4().hex[:12]}"
    result = asyncio.run(lf.submit(settings, parsed, tid, wait=wait))
    link = settings.task_ui_link(result["workflow_id"])
    started = f"submitted task {tid} (workflow {result['workflow_id']})" + (
        f"\nTemporal UI: {link}" if link else ""
    )
    _report_start({**result, "ui_url": link} if link else result, as_json, started)


@app.command()
@friendly
def resume(
    task_id: str,
    wait: Annotated[bool, typer.Option("--wait", help="wait for the task to finish")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Take a task over from the ledger alone, after its workflow was terminated or lost."""
    from ledgerflow import client as lf

    result = asyncio.run(lf.resume(get_settings(), task_id, wait=wait))
    _report_start(result, as_json, f"resumed task {task_id} (run {result.get('run_id')})")


def _report_start(result: dict[str, Any], as_json: bool, started: str) -> None:
    """Print a started (or, with --wait, finished) task; exit 1 when a waited-for task did not complete."""
    finished = "state" in result
    if as_json:
        out.print_json(json.dumps(result, default=str))
    elif finished:
        money = f"spent {result.get('spent')} of {result.get('ceiling')}"
        out.print(f"task {result['task_id']}: {result['state']}  {money}")
    else:
        out.print(started, soft_wrap=True, highlight=False)
    if finished and result["state"] != "Completed":
        raise typer.Exit(1)


@app.command()
@friendly
def reconcile(
    apply: Annotated[bool, typer.Option("--apply", help="resume them (default: only list)")] = False,
) -> None:
    """Find unfinished tasks whose workflow is not running; with --apply, resume each from the ledger."""
    from ledgerflow import client as lf

    settings = get_settings()
    orphans = asyncio.run(lf.open_tasks_without_a_run(settings))
    if not orphans:
        out.print("every unfinished task has a running workflow")
        return
    for task_id in orphans:
        if apply:
            result = asyncio.run(lf.resume(settings, task_id))
            out.print(f"resumed {task_id} (run {result['run_id']})")
        else:
            out.print(f"orphaned: {task_id}")


@app.command()
@friendly
def status(
    task_id: str, as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False
) -> None:
    """Show a task's state, nodes, money and open requests."""
    from ledgerflow import client as lf
    from workflows.contracts import workflow_id

    settings = get_settings()
    summary = asyncio.run(lf.status(settings, task_id))
    link = settings.task_ui_link(workflow_id(task_id))
    if as_json:
        out.print_json(json.dumps({**summary, "ui_url": link} if link else summary, default=str))
        return
    from ledgerflow.views.report import status_table

    out.print(status_table(summary))
    if link:
        out.print(f"Temporal UI: {link}", soft_wrap=True, highlight=False)


@app.command()
@friendly
def tasks(
    project: Annotated[str | None, typer.Option("--project", help="only this project's tasks")] = None,
    waiting: Annotated[bool, typer.Option("--waiting", help="only tasks waiting on a person")] = False,
    limit: Annotated[int, typer.Option("--limit", min=1, max=10_000, help="at most this many")] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """List tasks, newest first: state, project, spent, whether waiting on a person (from Temporal's search
    attributes: one query, however many tasks)."""
    from ledgerflow.views.tasks import list_tasks, table

    rows = asyncio.run(list_tasks(get_settings(), project, waiting=waiting, limit=limit))
    if as_json:
        out.print_json(json.dumps([r.as_json() for r in rows]))
    elif not rows:
        which = " waiting on a person" if waiting else ""
        out.print(f"no tasks{which}" + (f" in project {project}" if project else ""), highlight=False)
    else:
        out.print(table(rows))


@app.command()
@friendly
def events(
    task_id: str, as_json: Annotated[bool, typer.Option("--json", help="one JSON object per line")] = False
) -> None:
    """List a task's ledger events in order."""
    from ledgerflow import client as lf

    rows = lf.events(get_settings(), task_id)
    if as_json:
        for e in rows:
            sys.stdout.write(e.model_dump_json() + "\n")
        return
    from ledgerflow.views.report import events_table

    out.print(events_table(rows))


@app.command()
@friendly
def artifacts(
    task_id: str, as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False
) -> None:
    """Every artifact a task registered: where it is, what it is, what it was made from, paid or reused."""
    from ledgerflow import client as lf
    from ledgerflow.views.lineage import artifact_rows, artifacts_table

    rows = artifact_rows(lf.events(get_settings(), task_id))
    if as_json:
        out.print_json(json.dumps([r.as_json() for r in rows], default=str))
    else:
        out.print(artifacts_table(task_id, rows))


@app.command()
@friendly
def show(
    task_id: str,
    at: Annotated[
        int | None, typer.Option("--at", help="the state as of this ledger seq (time travel)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """A task's projection as it was after event SEQ (default: now), folded from the ledger."""
    from ledgerflow.views.report import status_table
    from ledgerflow.views.versions import show_at

    summary = show_at(get_settings(), task_id, at)
    if as_json:
        out.print_json(json.dumps(summary, default=str))
    else:
        out.print(status_table(summary))


@app.command()
@friendly
def evals(
    task_id: str,
    threshold: Annotated[float, typer.Option(help="flag a dimension that drops by more than this")] = 0.1,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Review scores per composition version; regressions flagged (exit 1 if any)."""
    from ledgerflow.views.versions import evals as read_evals
    from ledgerflow.views.versions import evals_table

    rows = read_evals(get_settings(), task_id, threshold)
    if as_json:
        out.print_json(json.dumps([r.__dict__ for r in rows], default=str))
    else:
        out.print(evals_table(task_id, rows))
    if any(r.regressions for r in rows):
        raise typer.Exit(1)


@app.command()
@friendly
def demo(
    plan: Annotated[Path, typer.Option(help="plan to run")] = Path("examples/e001_demo.yaml"),
) -> None:
    """Bring the stack up if needed, run the E001 plan unattended with a live view, and report; says where
    everything is, and how to answer (and by when) whenever the task waits on a person."""
    from ledgerflow.stack.demo import run_demo

    raise typer.Exit(run_demo(get_settings(), _read(plan), out))


@app.command()
@friendly
def drill(
    kills: Annotated[int, typer.Option("--kills", min=1, max=1000, help="worker kills to inflict")] = 10,
    seed: Annotated[int, typer.Option("--seed", help="random seed: same seed, same fault points")] = 1,
    tasks: Annotated[int, typer.Option("--tasks", min=1, max=100, help="tasks in the workload")] = 4,
    profile: Annotated[
        str, typer.Option("--profile", help="plain, or realistic: every unkind vendor habit on")
    ] = "plain",
    mode: Annotated[
        str, typer.Option("--mode", help="vendor mode: idempotent, lookup_only or none")
    ] = "idempotent",
    scenario: Annotated[
        str,
        typer.Option(
            "--scenario",
            help="crash (worker kills), vendor-outage (breaker and fallback) or restore (the ledger's "
            "database lost and restored behind Temporal)",
        ),
    ] = "crash",
    failure: Annotated[
        str, typer.Option("--failure", help="vendor-outage: errors (503s, then timeouts) or quality")
    ] = "errors",
    episodes: Annotated[int, typer.Option("--episodes", min=1, max=20, help="vendor-outage: episodes")] = 4,
    shots: Annotated[
        int, typer.Option("--shots", min=2, max=50, help="vendor-outage: shots per episode")
    ] = 8,
    window: Annotated[
        float,
        typer.Option("--window", min=1, max=3600, help="restore: seconds the restored ledger is behind"),
    ] = 120.0,
) -> None:
    """A seeded random crash campaign on the embedded stack (or, with --scenario vendor-outage, a vendor
    going down mid-episode; with --scenario restore, the ledger's database lost and restored --window
    seconds behind Temporal); exit 1 unless every invariant holds."""
    from ledgerflow.runs.drill import run_drill

    if scenario == "vendor-outage":
        from ledgerflow.runs.outage import run_outage_drill

        if failure not in ("errors", "quality"):
            raise ClientError(f"--failure {failure[:40]!r} is not errors or quality")
        outage = asyncio.run(
            run_outage_drill(get_settings(), failure=failure, episodes=episodes, shots=shots)
        )
        out.print(outage.table())
        if not outage.clean:
            raise typer.Exit(1)
        return
    if scenario == "restore":
        from ledgerflow.runs.restore_drill import run_restore_scenario

        if tasks < 4:
            raise ClientError("--scenario restore needs --tasks 4 or more (one per wave)")
        restored = asyncio.run(run_restore_scenario(get_settings(), tasks, window, log=out.print))
        out.print(restored.table())
        for line in restored.audit_lines:
            out.print(line, markup=False, highlight=False, emoji=False, soft_wrap=True)
        if not restored.clean:
            raise typer.Exit(1)
        return
    if scenario != "crash":
        raise ClientError(f"--scenario {scenario[:40]!r} is not crash, vendor-outage or restore")

    if profile not in ("plain", "realistic"):
        raise ClientError(f"--profile {profile[:40]!r} is not plain or realistic")
    if mode not in ("idempotent", "lookup_only", "none"):
        raise ClientError(f"--mode {mode[:40]!r} is not idempotent, lookup_only or none")
    report = asyncio.run(run_drill(get_settings(), kills, seed, tasks, profile=profile, mode=mode))
    out.print(report.table())
    if not report.clean:
        raise typer.Exit(1)


@app.command()
@friendly
def backup(
    dest: Annotated[
        Path | None,
        typer.Option("--dest", help="a new directory for the base backup (default: .ledgerflow/backups/UTC)"),
    ] = None,
    archive: Annotated[
        Path | None,
        typer.Option("--archive", help="turn WAL archiving on first, into this directory (point in time)"),
    ] = None,
    archive_timeout: Annotated[
        int,
        typer.Option("--archive-timeout", min=1, max=86400, help="ship a quiet WAL segment after N seconds"),
    ] = 60,
) -> None:
    """A base backup of the ledger's database (pg_basebackup), with --archive WAL archiving for a restore
    to any point in time; docs/backup.md has the restore and the catch-up that must follow it."""
    from datetime import UTC, datetime

    from ledgerflow import backup as ledger_backup

    settings = get_settings()
    url = settings.resolved_database_url()
    if archive is not None:
        archive = archive.absolute()
        if ledger_backup.configure_archiving(url, archive, archive_timeout):
            if ledger_backup.restart_embedded(settings.state_dir, url):
                out.print("archive_mode was off: the embedded Postgres was restarted to apply it")
            else:
                out.print("archive_mode was off: restart the database server to apply it, then back up again")
                raise typer.Exit(1)
        out.print(f"WAL archiving on: segments go to {archive} (a quiet one after {archive_timeout}s)")
    state = ledger_backup.archiving(url)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    target = (dest or settings.state_dir / "backups" / stamp).absolute()
    taken = ledger_backup.base_backup(url, target)
    seconds = (taken.ended_at - taken.started_at).total_seconds()
    out.print(f"base backup {target}: {taken.size_bytes // 1024} KiB in {seconds:.1f}s")
    if state["archive_mode"] == "off":
        out.print("WAL archiving is off: this backup restores to its own end only (--archive DIR: on)")


@app.command()
@friendly
def soak(
    tasks: Annotated[int, typer.Option("--tasks", min=1, max=5000, help="copies of the plan to run")] = 20,
    plan: Annotated[Path, typer.Option(help="plan to run")] = Path("examples/e001_video.yaml"),
    sim: Annotated[Path | None, typer.Option(help="simulator profile (JSON) to load first")] = Path(
        "examples/simulator_failures.json"
    ),
    workers: Annotated[int, typer.Option("--workers", min=1, max=32, help="worker processes to run")] = 1,
    timeout: Annotated[
        float, typer.Option("--timeout", min=1, help="seconds to wait for every task to settle")
    ] = 3600.0,
    require_complete: Annotated[
        bool, typer.Option("--require-complete", help="exit 1 unless every task completed")
    ] = False,
    hero_share: Annotated[
        float, typer.Option("--hero-share", min=0, max=1, help="share of the tasks run with priority: hero")
    ] = 0.0,
) -> None:
    """Run many copies of a plan under the simulator's failure rates: verdicts, end states, money checks,
    and the run's figures (throughput, dispatch hops, task durations and finishing order, CPU and memory,
    database connections)."""
    from ledgerflow.runs.soak import run_soak

    profile = None
    if sim is not None:
        try:
            profile = json.loads(_read(sim, "simulator profile"))
        except json.JSONDecodeError as e:
            from rules.plan import PlanError

            raise PlanError(f"simulator profile {sim} is not JSON: {e.msg} at line {e.lineno}") from None
    report = asyncio.run(
        run_soak(
            get_settings(),
            _read(plan),
            tasks,
            profile,
            workers=workers,
            timeout=timeout,
            hero_share=hero_share,
        )
    )
    out.print(report.table())
    if not report.clean or (require_complete and not report.all_completed):
        raise typer.Exit(1)


budget_app = typer.Typer(no_args_is_help=True, help="Budget accounts: project ⊃ episode ⊃ task.")
app.add_typer(budget_app, name="budget")


@budget_app.command("set")
@friendly
def budget_set(
    scope: Annotated[
        str,
        typer.Argument(help="project:NAME, episode:PROJECT/EPISODE, task:ID or route:ROUTE:YYYY-MM"),
    ],
    amount: Annotated[str, typer.Argument(help="the ceiling, or 'unlimited'")],
) -> None:
    """Set a scope's ceiling (reservations already admitted stay admitted)."""
    from ledgerflow.views.money import parse_scope, set_ceiling

    ceiling = None if amount.strip().lower() == "unlimited" else _amount(amount)
    account = set_ceiling(get_settings(), parse_scope(scope), ceiling)
    out.print(f"{account.scope}: ceiling {account.ceiling if account.ceiling is not None else 'unlimited'}")


@budget_app.command("show")
@friendly
def budget_show(
    scope: Annotated[str | None, typer.Argument(help="a scope; its children are listed too")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Show ceiling, reserved, spent and remaining, for a scope and every scope under it."""
    from ledgerflow.views.money import accounts_table, show

    rows = show(get_settings(), scope)
    if as_json:
        out.print_json(json.dumps([r.as_json() for r in rows]))
    else:
        out.print(accounts_table(rows))


@app.command()
@friendly
def audit(
    task_id: Annotated[str | None, typer.Argument(metavar="TASK", help="the task to audit")] = None,
    every: Annotated[bool, typer.Option("--all", help="every task in the ledger")] = False,
    billing: Annotated[
        bool, typer.Option("--billing", help="match every charge the vendors list to one operation")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Recompute every decision, check the accounts equal the fold, replay the Temporal histories (and with
    --billing match the vendors' charges to operations); exit 1 at a divergence, naming the first."""
    from ledgerflow import client as lf
    from ledgerflow.views.audit import UnknownTask
    from ledgerflow.views.audit import audit as run_audit

    if (task_id is None) != every:
        raise ClientError("give one TASK, or --all for every task in the ledger")
    settings = get_settings()

    async def go() -> Any:
        client = await lf.connect(settings)
        rec = lf.recorder(settings)
        try:
            return await run_audit(settings, rec, client, None if every else [str(task_id)], billing=billing)
        except UnknownTask as e:
            raise ClientError(str(e)) from None
        finally:
            rec.dispose()

    report = asyncio.run(go())
    if as_json:
        out.print_json(json.dumps(report.as_json(), default=str))
    else:
        for line in report.lines():
            out.print(line, markup=False, highlight=False, emoji=False, soft_wrap=True)
    if not report.ok:
        raise typer.Exit(1)


def _amount(text: str) -> Decimal:
    from rules.money import parse_amount

    try:
        return parse_amount(text)
    except ValueError as e:
        raise ClientError(f"amount {text[:40]!r} {e}") from None


billing_app = typer.Typer(
    no_args_is_help=True, help="The vendors' bills: disputes, and the scheduled reconciliation."
)
app.add_typer(billing_app, name="billing")


@billing_app.command("dispute")
@friendly
def billing_dispute(
    operation_key: Annotated[
        str, typer.Argument(metavar="OPERATION_KEY", help="the operation, e.g. TASK:NODE:a1")
    ],
    out_file: Annotated[
        Path | None, typer.Option("--out", help="write the JSON bundle to this file (default: stdout)")
    ] = None,
) -> None:
    """Write the evidence for a refund claim on one operation as JSON: its INTENT (request, reservation,
    route), every numbered send and whether it was refused, its jobs, its result (cost, anomalies, late
    charges), the probe of its output, and the vendor's own charge lines for its key where its route lists
    them."""
    from ledgerflow import client as lf
    from ledgerflow.views.billing import UnknownOperation, dispute

    settings = get_settings()

    async def go() -> dict[str, Any]:
        rec = lf.recorder(settings)
        try:
            return await dispute(settings, rec, operation_key)
        except UnknownOperation as e:
            raise ClientError(str(e)) from None
        finally:
            rec.dispose()

    text = json.dumps(asyncio.run(go()), indent=2, default=str) + "\n"
    if out_file is None:
        sys.stdout.write(text)
    else:
        out_file.write_text(text)
        out.print(f"{operation_key}: evidence written to {out_file}", markup=False, highlight=False)


@billing_app.command("reconcile")
@friendly
def billing_reconcile(
    grace: Annotated[
        float, typer.Option("--grace", min=0, help="seconds a charge without a key may wait for its job id")
    ] = 600.0,
    window: Annotated[float, typer.Option("--window", min=0.01, help="hours of charges to list")] = 48.0,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Reconcile billing once, here (what the schedule runs): match every charge the listable routes list to
    one operation; record each charge nobody knows or two operations claim, and each credit; name the routes
    that cannot list charges."""
    from activities.billing import ReconcileInput
    from ledgerflow import client as lf
    from ledgerflow.views.billing import reconcile_lines, reconcile_once

    settings = get_settings()

    async def go() -> Any:
        rec = lf.recorder(settings)
        try:
            inp = ReconcileInput(grace_seconds=grace, window_seconds=window * 3600)
            return await reconcile_once(settings, rec, inp)
        finally:
            rec.dispose()

    result = asyncio.run(go())
    if as_json:
        out.print_json(result.model_dump_json())
        return
    for line in reconcile_lines(result):
        out.print(line, markup=False, highlight=False, emoji=False, soft_wrap=True)


@billing_app.command("schedule")
@friendly
def billing_schedule(
    every: Annotated[float, typer.Option("--every", min=10, help="seconds between two runs")] = 300.0,
) -> None:
    """Create (or update) the Temporal Schedule that reconciles billing every --every seconds, run by the
    workers of LEDGERFLOW_TASK_QUEUE on the cluster LEDGERFLOW_TEMPORAL_ADDRESS (`ledgerflow up` does it for
    the embedded stack)."""
    from datetime import timedelta

    from ledgerflow import client as lf
    from ledgerflow.views.billing import schedule_reconciliation

    settings = get_settings()

    async def go() -> str:
        client = await lf.connect(settings)
        return await schedule_reconciliation(client, settings, every=timedelta(seconds=every))

    out.print(asyncio.run(go()), markup=False, highlight=False, soft_wrap=True)


# ── the scans that run themselves: one Temporal Schedule each (ledgerflow/views/schedules.py) ───────────
schedules_app = typer.Typer(
    no_args_is_help=True,
    help="The Temporal Schedules of the scans that run themselves (docs/operations.md).",
)
app.add_typer(schedules_app, name="schedules")


@schedules_app.command("apply")
@friendly
def schedules_apply(
    orphans: Annotated[
        float | None, typer.Option("--orphans-every", min=10, help="seconds between two orphan scans (60)")
    ] = None,
    holds: Annotated[
        float | None, typer.Option("--route-holds-every", min=10, help="seconds between two route scans (60)")
    ] = None,
    consistency: Annotated[
        float | None, typer.Option("--consistency-every", min=10, help="seconds between two checks (300)")
    ] = None,
    billing: Annotated[
        float | None, typer.Option("--billing-every", min=10, help="seconds between two billing runs (300)")
    ] = None,
    include_unknown: Annotated[
        bool,
        typer.Option(
            "--include-unknown", help="resume tasks Temporal has no record of (a restored namespace)"
        ),
    ] = False,
) -> None:
    """Create each scan's Temporal Schedule, or update it to this spec (idempotent: run it again at will),
    run by the workers of LEDGERFLOW_TASK_QUEUE on the cluster LEDGERFLOW_TEMPORAL_ADDRESS (`ledgerflow up`
    does it for the embedded stack)."""
    from datetime import timedelta

    from ledgerflow import client as lf
    from ledgerflow.views.schedules import BILLING, CONSISTENCY, ORPHANS, ROUTE_HOLDS, ensure_schedules

    settings = get_settings()
    given = ((ORPHANS, orphans), (ROUTE_HOLDS, holds), (CONSISTENCY, consistency), (BILLING, billing))
    periods = {s.name: timedelta(seconds=p) for s, p in given if p is not None}

    async def go() -> list[str]:
        client = await lf.connect(settings)
        return await ensure_schedules(client, settings, every=periods, include_unknown=include_unknown)

    for line in asyncio.run(go()):
        out.print(line, markup=False, highlight=False, soft_wrap=True)


@schedules_app.command("list")
@friendly
def schedules_list(
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Each scan's Schedule on LEDGERFLOW_TASK_QUEUE: its interval, its runs, when it last succeeded and what
    that run found and did."""
    from dataclasses import asdict

    from ledgerflow import client as lf
    from ledgerflow.views.schedules import describe_schedules, schedule_lines

    settings = get_settings()

    async def go() -> Any:
        return await describe_schedules(await lf.connect(settings), settings.task_queue)

    rows = asyncio.run(go())
    if as_json:
        dump = [
            {**asdict(r), "last_result": r.last_result.model_dump(mode="json") if r.last_result else None}
            for r in rows
        ]
        out.print_json(json.dumps(dump, default=str))
        return
    for line in schedule_lines(rows):
        out.print(line, markup=False, highlight=False, soft_wrap=True)


# ── releases: rebuild, sign, and verify without the ledger (docs/releases.md) ───────────────────────────


@app.command()
@friendly
def release(
    task_id: Annotated[str, typer.Argument(metavar="TASK", help="the completed task to release")],
    key_file: Annotated[
        Path, typer.Option("--key-file", help="the release key (registered with kind release)")
    ],
    out_dir: Annotated[
        Path | None,
        typer.Option("--out", help="where to write the output and its manifest (default: state dir)"),
    ] = None,
    c2pa_cert: Annotated[
        Path | None,
        typer.Option("--c2pa-cert", help="also embed a C2PA manifest: PEM chain certifying the release key"),
    ] = None,
    c2pa_dev_cert: Annotated[
        bool, typer.Option("--c2pa-dev-cert", help="dev mode: embed C2PA under a throwaway test CA")
    ] = False,
) -> None:
    """Rebuild the task's final output from the ledger and the content store, refuse unless it hashes to
    the recorded final output (exit 1, naming the difference), then write it and its signed provenance
    manifest (.ledgerflow/releases/TASK unless --out)."""
    from ledgerflow import client as lf
    from ledgerflow.release.build import ReleaseRefused
    from ledgerflow.release.build import release as make_release
    from runtime.signing import KeyFileError, load_key_file

    try:
        key = load_key_file(key_file)
    except KeyFileError as e:
        raise ClientError(str(e)) from None
    settings = get_settings()
    chain: bytes | None = None
    anchor: bytes | None = None
    if c2pa_cert is not None and c2pa_dev_cert:
        raise ClientError("give --c2pa-cert or --c2pa-dev-cert, not both")
    if c2pa_cert is not None:
        chain = _read(c2pa_cert, "certificate").encode()
    elif c2pa_dev_cert:
        if not settings.dev:
            raise ClientError("--c2pa-dev-cert is for dev mode only (LEDGERFLOW_ENV=dev): use --c2pa-cert")
        from ledgerflow.release.c2pa_embed import dev_chain

        chain, anchor = dev_chain(key)

    async def go() -> Any:
        rec = lf.recorder(settings)
        try:
            return await make_release(
                settings, rec, task_id, key, out_dir, c2pa_chain=chain, c2pa_anchor=anchor
            )
        finally:
            rec.dispose()

    try:
        made = asyncio.run(go())
    except ReleaseRefused as e:
        err.print(f"[red]release refused:[/red] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    out.print(
        f"released {task_id}: {made.method} rebuilt, sha256 {made.sha256}", highlight=False, soft_wrap=True
    )
    out.print(f"  output    {made.output}\n  manifest  {made.manifest}", highlight=False, soft_wrap=True)
    embedded = made.document["claim"].get("embedded_c2pa")
    if embedded:
        out.print(f"  with C2PA {made.manifest.parent / embedded['name']}", highlight=False, soft_wrap=True)


@app.command()
def verify(
    manifest: Annotated[Path, typer.Argument(metavar="MANIFEST", help="a release manifest (.release.json)")],
    file: Annotated[Path | None, typer.Argument(metavar="FILE", help="the released file to check")] = None,
    public_key: Annotated[
        str | None, typer.Option("--public-key", help="the publisher's release key (64 hex)")
    ] = None,
    key_file: Annotated[
        Path | None, typer.Option("--key-file", help="read the public key from a key file")
    ] = None,
) -> None:
    """Check a release manifest's signature and hashes, and FILE's bytes against it, with no database: exit 0
    verified, 1 not, with one line naming what failed."""
    from ledgerflow.release.manifest import ManifestError, read_public_key, verify_files

    try:
        pinned = read_public_key(public_key=public_key, key_file=key_file)
        verified = verify_files(manifest, file, public_key=pinned)
    except ManifestError as e:
        err.print(f"not verified: {e}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except Exception as e:  # never a traceback: any other failure is "not verified" too, named
        err.print(f"not verified: {type(e).__name__}: {e}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    out.print(verified.line(), markup=False, highlight=False, soft_wrap=True)


# ── retention: an ended task's artifacts leave the store after its project's period ───────────────────


@app.command()
@friendly
def retention(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="say what would be deleted; delete nothing")
    ] = False,
) -> None:
    """Delete the artifacts of tasks that ended longer ago than their project keeps them
    (LEDGERFLOW_ARTIFACT_RETENTION_DAYS, e.g. '{"*": 365, "drafts": 30}'), unless a release or a task still
    open names them; each deletion is recorded in the ledger of every task that named the object."""
    from datetime import UTC, datetime

    from artifacts import open_store, store_for_uri
    from ledgerflow import client as lf
    from ledgerflow.retention import expire

    settings = get_settings()
    if not settings.artifact_retention_days:
        raise ClientError("no retention period: set LEDGERFLOW_ARTIFACT_RETENTION_DAYS (artifacts are kept)")
    stores = [open_store(settings.store_location())]
    rec = lf.recorder(settings)
    try:
        found = expire(
            rec,
            lambda uri: store_for_uri(uri, stores),
            settings.artifact_retention_days,
            datetime.now(UTC),
            dry_run=dry_run,
        )
    finally:
        rec.dispose()
    verb = "would delete" if dry_run else "deleted"
    done = len(found.due) if dry_run else len(found.deleted)
    out.print(f"{verb} {done} artifact(s); kept {len(found.kept)}", highlight=False)
    for sha in found.missing:
        out.print(f"  {sha[:12]}… was already gone from the store (recorded)", highlight=False)


# ── people in the loop: the queue, one request, deciding, dead letters ─────────────────────────────────


@app.command()
@friendly
def queue(as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False) -> None:
    """Open requests across unfinished tasks: escalations and blockers first, then dead letters, approvals."""
    from ledgerflow.views import people

    groups = people.queue(get_settings())
    if as_json:
        out.print_json(json.dumps(people.queue_json(groups)))
    else:
        out.print(people.queue_table(groups), soft_wrap=True, highlight=False)


@app.command()
@friendly
def request(
    request_id: Annotated[str, typer.Argument(help="TASK_ID/REQUEST_ID")],
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """One request's whole context package: failures, spend, options, artifacts, refused answers."""
    from ledgerflow.views import people

    task_id, rid = people.parse_global_id(request_id)
    detail = people.request(get_settings(), task_id, rid)
    if as_json:
        out.print_json(json.dumps(detail, default=str))
    else:
        out.print(people.request_view(detail), soft_wrap=True, highlight=False)


# The options of a signed decision, shared by `decide` (sign and send) and `sign` (sign and print).
KeyFileOption = Annotated[
    Path | None,
    typer.Option("--key-file", envvar="LEDGERFLOW_KEY_FILE", help="your key file (signs the decision)"),
]
AsOption = Annotated[
    str | None, typer.Option("--as", help="who decides (dev mode: a demo approver, no key file)")
]
AmountOption = Annotated[str | None, typer.Option("--amount", help="for add-budget")]
ScopeOption = Annotated[
    str | None,
    typer.Option("--scope", help="for add-budget: project:P, episode:P/E or task:T (default: the one short)"),
]
NoteOption = Annotated[str, typer.Option("--note", help="why")]


def _signer(request_id: str, key_file: Path | None, approver: str | None) -> tuple[str, str, Any]:
    """(task id, request id, the key to sign with) for ``TASK_ID/REQUEST_ID``."""
    from ledgerflow.views import people

    task_id, rid = people.parse_global_id(request_id)
    if key_file is None and approver is not None:  # a demo approver's key: only for a dev stack
        from ledgerflow.client import stack_dev

        return task_id, rid, people.approver_key(stack_dev(get_settings()), key_file, approver)
    return task_id, rid, people.approver_key(get_settings(), key_file, approver)


@app.command()
@friendly
def decide(
    request_id: Annotated[str, typer.Argument(help="TASK_ID/REQUEST_ID")],
    decision: Annotated[str, typer.Argument(help="approve | resume | abort | add-budget")],
    key_file: KeyFileOption = None,
    approver: AsOption = None,
    amount: AmountOption = None,
    scope: ScopeOption = None,
    note: NoteOption = "",
) -> None:
    """Sign and send a decision, then wait for the worker's ruling: exit 0 accepted, 1 otherwise."""
    from ledgerflow.views import people

    task_id, rid, key = _signer(request_id, key_file, approver)
    sent = asyncio.run(
        people.decide(get_settings(), key, task_id, rid, decision, note=note, amount=amount, scope=scope)
    )
    (out if sent.status == "accepted" else err).print(sent.line, highlight=False, soft_wrap=True)
    if sent.status != "accepted":
        raise typer.Exit(1)


def _fields(pairs: list[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` pairs as request fields: a VALUE that parses as JSON is that, else the text itself."""
    out: dict[str, Any] = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not name.strip():
            raise ClientError(f"--set {pair[:60]!r} is not FIELD=VALUE")
        try:
            out[name.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[name.strip()] = value
    return out


@app.command()
@friendly
def change(
    kind: Annotated[str, typer.Argument(help="pause | resume | edit | reroute | skip | waive | restore")],
    task_id: Annotated[str, typer.Argument(help="TASK_ID")],
    key_file: KeyFileOption = None,
    approver: AsOption = None,
    node: Annotated[
        str | None, typer.Option("--node", help="the node (a stage for reroute; review: all of a waiver)")
    ] = None,
    fields: Annotated[
        list[str] | None,
        typer.Option("--set", help="edit: FIELD=VALUE (repeat; VALUE as JSON, else as text)"),
    ] = None,
    route: Annotated[str | None, typer.Option("--route", help="reroute: the route to send it to")] = None,
    version: Annotated[
        int | None, typer.Option("--version", help="restore: the output version to make current (from 1)")
    ] = None,
    note: NoteOption = "",
) -> None:
    """Sign and send a change to a running task, then print its ruling: exit 0 accepted, 1 otherwise.

    pause: nothing new is dispatched (work in flight finishes and is recorded); resume: it goes on; edit:
    --node N --set prompt="…": its next attempt asks that (its open dead letter is resolved); reroute: --node
    N_OR_STAGE --route R: their next attempts go to route R, re-quoted at its price; skip: --node N: it and
    what only it feeds never run; waive: --node N (or review) --note WHY: the review's rework finding on it
    is accepted as it is; restore: --node N --version V: that output is current again, what is built on it
    is made again or reused."""
    from ledgerflow.views import people

    edit = _fields(fields) if fields else ({"route": route} if route is not None else None)
    if version is not None:
        edit = {"version": version}

    if approver is not None and key_file is None:
        from ledgerflow.client import stack_dev

        key = people.approver_key(stack_dev(get_settings()), key_file, approver)
    else:
        key = people.approver_key(get_settings(), key_file, approver)
    sent = asyncio.run(people.change(get_settings(), key, task_id, kind, node=node, edit=edit, note=note))
    (out if sent.status == "accepted" else err).print(sent.line, highlight=False, soft_wrap=True)
    if sent.status != "accepted":
        raise typer.Exit(1)


@app.command()
@friendly
def quote(
    plan: Annotated[Path | None, typer.Argument(help="plan file (YAML)")] = None,
    project: Annotated[
        str | None, typer.Option("--project", help="learn from this project's tasks only (default: all)")
    ] = None,
    drift: Annotated[
        str | None, typer.Option("--drift", metavar="TASK", help="a task's spend against its recorded quote")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """What a plan should cost and take (p50 / p95 per stage), learned from the ledger's history of its
    routes; with --drift TASK, a task's spend against the quote it was submitted with."""
    from ledgerflow.views import quote as q

    if (plan is None) == (drift is None):
        raise ClientError("give a PLAN to quote, or --drift TASK (not both)")
    if drift is not None:
        d = q.drift(get_settings(), drift)
        if as_json:
            out.print_json(json.dumps(d.as_json()))
        else:
            out.print(q.drift_table(d))
        return
    from ledgerflow import client as lf

    assert plan is not None
    result = q.quote(get_settings(), lf.parse_plan(_read(plan)), project)
    if as_json:
        out.print_json(json.dumps(result.as_json()))
        return
    for part in q.tables(result):
        out.print(part, highlight=False, soft_wrap=True)


@app.command()
@friendly
def stats(
    since: Annotated[str | None, typer.Option("--since", help="24h, 7d … or an ISO 8601 time")] = None,
    project: Annotated[str | None, typer.Option("--project", help="only this project's tasks")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """The production SLOs (docs/design.md#production-slos) from the ledger: success, queue duration, first
    pass, retries, cost per usable second, human wait, invalidation propagation."""
    from datetime import UTC, datetime

    from ledgerflow import client as lf
    from ledgerflow.views import stats as slo
    from reconcile.takeover import task_histories

    try:
        start = slo.parse_since(since, datetime.now(UTC))
    except ValueError as e:
        raise ClientError(str(e)) from None
    rec = lf.recorder(get_settings())
    try:
        figures = slo.compute(task_histories(rec), start, project).as_json()
    finally:
        rec.dispose()
    if as_json:
        out.print_json(json.dumps(figures))
    else:
        out.print(slo.table(figures))


@app.command()
@friendly
def sign(
    request_id: Annotated[str, typer.Argument(help="TASK_ID/REQUEST_ID")],
    decision: Annotated[str, typer.Argument(help="approve | resume | abort | add-budget")],
    key_file: KeyFileOption = None,
    approver: AsOption = None,
    amount: AmountOption = None,
    scope: ScopeOption = None,
    note: NoteOption = "",
) -> None:
    """Print a signed decision (one JSON line) to send any way, e.g. with the stock Temporal CLI:
    temporal workflow signal --workflow-id ledgerflow-task-T --name decide --input "$(ledgerflow sign …)"."""
    from ledgerflow.views import people

    task_id, rid, key = _signer(request_id, key_file, approver)
    payload = people.signed_payload(key, task_id, rid, decision, note=note, amount=amount, scope=scope)
    sys.stdout.write(json.dumps(payload, separators=(",", ":")) + "\n")


@app.command()
@friendly
def dlq(
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    groups: Annotated[
        bool, typer.Option("--groups", help="the open ones grouped by systemic cause, largest first")
    ] = False,
    resume_group: Annotated[
        int | None, typer.Option("--resume-group", help="resume every open dead letter of group N (signed)")
    ] = None,
    project: Annotated[str | None, typer.Option("--project", help="only this project's")] = None,
    key_file: KeyFileOption = None,
    approver: AsOption = None,
    note: NoteOption = "",
) -> None:
    """Nodes with dead-letter requests (open or resolved): original request, attempts, a suggestion.

    --groups: the open ones by systemic cause ("40% are validator timeouts"); --resume-group N: one signed
    resume for each of group N's dead letters (exit 1 if any is not accepted)."""
    from ledgerflow.views import people
    from ledgerflow.views.queue import dead_letter_groups

    settings = get_settings()
    entries = people.dlq(settings, project)
    found = dead_letter_groups(entries)
    if resume_group is not None:
        chosen = next((g for g in found if g["group"] == resume_group), None)
        if chosen is None:
            raise ClientError(f"no group {resume_group}: there are {len(found)} (ledgerflow dlq --groups)")
        failed = 0
        for global_id in chosen["ids"]:
            task_id, rid, key = _signer(global_id, key_file, approver)
            sent = asyncio.run(people.decide(settings, key, task_id, rid, "resume", note=note))
            (out if sent.status == "accepted" else err).print(f"{global_id}: {sent.line}", highlight=False)
            failed += sent.status != "accepted"
        if failed:
            raise typer.Exit(1)
        return
    if groups:
        if as_json:
            out.print_json(json.dumps(found, default=str))
            return
        for g in found:
            out.print(
                f"{g['group']}. {g['share']} ({g['count']} open): {g['cause']} — {g['suggested_action']}; "
                f"answer them all: ledgerflow dlq{f' --project {project}' if project else ''} --resume-group "
                f"{g['group']}",
                highlight=False,
                soft_wrap=True,
            )
        if not found:
            out.print("no open dead letters")
        return
    if as_json:
        out.print_json(json.dumps(entries, default=str))
    else:
        out.print(people.dlq_view(entries), soft_wrap=True, highlight=False)


db_app = typer.Typer(no_args_is_help=True, help="The ledger database's schema (Alembic migrations).")
app.add_typer(db_app, name="db")


@db_app.command("upgrade")
@friendly
def db_upgrade() -> None:
    """Migrate the ledger database to this ledgerflow's schema (workers and commands never run DDL)."""
    from ledger import migrate

    for line in migrate.upgrade_lines(get_settings().resolved_database_url()):
        out.print(line, highlight=False)


@db_app.command("current")
@friendly
def db_current() -> None:
    """The ledger database's schema revision and this ledgerflow's; exit 1 if they differ."""
    from ledger import migrate
    from ledger.errors import LedgerError

    url = get_settings().resolved_database_url()
    for line in migrate.current_lines(url):
        out.print(line, highlight=False)
    try:
        migrate.check(url)
    except LedgerError:
        raise typer.Exit(1) from None


@db_app.command("roles")
@friendly
def db_roles() -> None:
    """Create or update the database's login users (lf_worker, lf_operator, lf_reader, lf_receiver), each a
    member of its group role only, with passwords from LEDGERFLOW_DB_WORKER_PASSWORD,
    LEDGERFLOW_DB_OPERATOR_PASSWORD, LEDGERFLOW_DB_READER_PASSWORD, LEDGERFLOW_DB_RECEIVER_PASSWORD (the ones
    set). Run as the role that ran `ledgerflow db upgrade`."""
    import os

    from ledger.roles import ensure_logins

    for login in ensure_logins(get_settings().resolved_database_url(), os.environ):
        out.print(login.line, highlight=False, soft_wrap=True)


@db_app.command("sync-queue")
@friendly
def db_sync_queue() -> None:
    """Rebuild the shared queue of open human requests (backpressure) from every task's ledger: after an
    upgrade to schema 0004 with requests already open, or as a repair."""
    from ledgerflow import client as lf

    rec = lf.recorder(get_settings())
    changed, unreadable = 0, []
    try:
        tasks = rec.task_ids()
        for t in tasks:
            try:
                changed += rec.sync_human_queue(t)
            except ValueError:  # an event that does not parse (pydantic's ValidationError): its rows stay
                unreadable.append(t)
        total = sum(rec.open_requests_by_project().values())
    finally:
        rec.dispose()
    if unreadable:  # every one named: each is a ledger to audit
        err.print(
            f"{len(unreadable)} tasks' ledgers do not fold (left as they were; `ledgerflow audit` them):"
            f" {', '.join(unreadable)}",
            highlight=False,
            soft_wrap=True,
        )
    out.print(
        f"human_queue: {len(tasks)} tasks read, {changed} rows changed, {total} open requests",
        highlight=False,
    )


keys_app = typer.Typer(no_args_is_help=True, help="The approver key registry (public keys; audited).")
app.add_typer(keys_app, name="keys")


@keys_app.command("generate")
@friendly
def keys_generate(
    approver: Annotated[str, typer.Option("--approver", help="whose key")],
    key_id: Annotated[str, typer.Option("--key-id", help="its id, e.g. director-2026-12")],
    out_file: Annotated[Path, typer.Option("--out", help="where to write the private key file")],
) -> None:
    """Make an approver's key pair: the private key file stays with them; register its public key."""
    from ledgerflow.views import keys

    key = keys.generate(approver, key_id, out_file)
    out.print(f"wrote {out_file} (keep it private)\npublic key {key.public_key}", highlight=False)
    out.print(
        f"register it: ledgerflow keys add --key-file {out_file} --as YOU --reason '…'",
        highlight=False,
        soft_wrap=True,
    )


@keys_app.command("add")
@friendly
def keys_add(
    actor: Annotated[str, typer.Option("--as", help="who registers it (recorded)")],
    reason: Annotated[str, typer.Option("--reason", help="why (recorded)")],
    key_file: Annotated[
        Path | None, typer.Option("--key-file", help="read key id, approver, public key from it")
    ] = None,
    key_id: Annotated[str | None, typer.Option("--key-id")] = None,
    approver: Annotated[str | None, typer.Option("--approver")] = None,
    public_key: Annotated[str | None, typer.Option("--public-key", help="64 hex digits")] = None,
    kind: Annotated[
        list[str] | None, typer.Option("--kind", help="request kinds it may decide (repeat; default all)")
    ] = None,
    scope: Annotated[
        list[str] | None,
        typer.Option("--scope", help="*, project:P, episode:P/E or task:T (repeat; default *)"),
    ] = None,
    not_before: Annotated[str | None, typer.Option("--not-before", help="ISO 8601 time")] = None,
    expires: Annotated[str | None, typer.Option("--expires", help="ISO 8601 time")] = None,
) -> None:
    """Register an approver's public key (an audited entry in the ledger's database)."""
    from ledgerflow.views import keys

    record = keys.record_from(
        key_file=key_file,
        key_id=key_id,
        approver=approver,
        public_key=public_key,
        kinds=kind or [],
        scopes=scope or [],
        not_before=not_before,
        expires=expires,
    )
    keys.add(get_settings(), record, actor=actor, reason=reason)
    out.print(f"key {record.key_id} of {record.approver} registered", highlight=False)


@keys_app.command("revoke")
@friendly
def keys_revoke(
    key_id: str,
    actor: Annotated[str, typer.Option("--as", help="who revokes it (recorded)")],
    reason: Annotated[str, typer.Option("--reason", help="why (recorded)")],
) -> None:
    """Revoke a key: decisions signed with it are refused from now on (and audited)."""
    from ledgerflow.views import keys

    out.print(keys.revoke(get_settings(), key_id, actor=actor, reason=reason), highlight=False)


@keys_app.command("list")
@friendly
def keys_list(
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Every registered key: approver, what it may sign, validity, revocation."""
    from ledgerflow.views import keys

    records = keys.listing(get_settings())
    if as_json:
        out.print_json(json.dumps([r.as_json() for r in records]))
    else:
        out.print(keys.table(records), soft_wrap=True, highlight=False)


@keys_app.command("root-generate")
@friendly
def keys_root_generate(
    key_id: Annotated[str, typer.Option("--key-id", help="the root's id, e.g. root-2026")],
    out_file: Annotated[Path, typer.Option("--out", help="where to write the root's private key file")],
) -> None:
    """Make a root key pair, on the offline machine: its public key goes into LEDGERFLOW_KEY_ROOTS."""
    from ledgerflow.views import keys

    key = keys.root_generate(key_id, out_file)
    out.print(f"wrote {out_file} (keep it offline)\nroot public key {key.public_key}", highlight=False)
    out.print(
        f"trust it: LEDGERFLOW_KEY_ROOTS={key.public_key} on every worker and where `ledgerflow audit` runs",
        highlight=False,
        soft_wrap=True,
    )


@keys_app.command("entry")
@friendly
def keys_entry(
    key_id: str,
    out_file: Annotated[
        Path, typer.Option("--out", help="where to write the entry, for the root's custodian")
    ],
) -> None:
    """Write a registered key's entry (what it lets the key do), to carry to the offline root machine."""
    from ledgerflow.views import keys

    record = keys.entry(get_settings(), key_id, out_file)
    out.print(f"wrote {out_file}: {keys.describe(record)}", highlight=False, soft_wrap=True)


@keys_app.command("endorse")
@friendly
def keys_endorse(
    entry_file: Annotated[Path, typer.Argument(help="the entry `ledgerflow keys entry` wrote")],
    root_key: Annotated[Path, typer.Option("--root-key", help="the root's private key file")],
    out_file: Annotated[Path, typer.Option("--out", help="where to write the endorsement")],
) -> None:
    """Sign a registry entry with a root key, on the offline machine (no database, no network)."""
    from ledgerflow.views import keys

    record, _ = keys.endorse(entry_file, root_key, out_file)
    out.print(f"endorsed {keys.describe(record)}", highlight=False, soft_wrap=True)
    out.print(
        f"wrote {out_file}: record it with `ledgerflow keys add-endorsement {out_file}`", highlight=False
    )


@keys_app.command("add-endorsement")
@friendly
def keys_add_endorsement(
    file: Annotated[Path, typer.Argument(help="the endorsement `ledgerflow keys endorse` wrote")],
    actor: Annotated[str, typer.Option("--as", help="who records it (recorded)")],
    reason: Annotated[str, typer.Option("--reason", help="why (recorded)")],
) -> None:
    """Record a root's endorsement of a key, after checking it against the registry's entry."""
    from ledgerflow.views import keys

    out.print(keys.add_endorsement(get_settings(), file, actor=actor, reason=reason), highlight=False)


routes_app = typer.Typer(
    no_args_is_help=False, invoke_without_command=True, help="Vendor routes and their state."
)
app.add_typer(routes_app, name="routes")
app.add_typer(routes_app, name="route", hidden=True)  # `ledgerflow route qualify ROUTE` reads naturally too


@routes_app.callback()
@friendly
def routes_list(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Every route of this deployment (LEDGERFLOW_ROUTES_FILE, or the built-in table), its adapter and the
    distribution it comes from (a plugin's, or ledgerflow's own), and its state."""
    if ctx.invoked_subcommand is not None:
        return
    from ledgerflow.views.routes import route_rows, routes_table

    rows = route_rows(get_settings())
    if as_json:
        out.print_json(json.dumps(rows, default=str))
    else:
        out.print(routes_table(rows))


@routes_app.command("resume")
@friendly
def routes_resume(
    route: str,
    actor: Annotated[str, typer.Option("--as", help="who fixed it (recorded)")] = "operator",
    note: Annotated[str, typer.Option("--note", help="what was fixed")] = "",
) -> None:
    """Resume a route paused by a credentials error, once its key is fixed (every worker picks it up)."""
    from ledgerflow import client as lf

    settings = get_settings()
    rec = lf.recorder(settings)
    try:
        resumed = rec.resume_route(route, actor, note)
    finally:
        rec.dispose()
    out.print(f"route {route} resumed" if resumed else f"route {route} was not paused")


@routes_app.command("qualify")
@friendly
def routes_qualify(
    route: str,
    actor: Annotated[str, typer.Option("--as", help="who ran it (recorded)")] = "operator",
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Run a fallback route's regression set against it and record the result with its scores (exit 1 if
    it did not pass: the route does not serve as a fallback until a run passes)."""
    from ledgerflow.runs.qualify import QualifyError, qualify
    from runtime.settings import ConfigError
    from vendors.routes import RouteError

    try:
        result = asyncio.run(qualify(get_settings(), route, actor=actor))
    except (QualifyError, RouteError) as e:
        raise ConfigError(str(e)) from None
    if as_json:
        cases = [c.as_json() for c in result.cases]
        out.print_json(
            json.dumps({"route": route, "passed": result.passed, "score": result.score, "cases": cases})
        )
    else:
        for c in result.cases:
            score = "—" if c.score is None else f"{c.score:.2f}"
            problems = "; ".join(c.problems) or "ok"
            out.print(f"  {c.id:<24} score {score:>5}  cost {c.cost}  {problems}", highlight=False)
        verdict = "QUALIFIED" if result.passed else "NOT QUALIFIED"
        out.print(f"{route}: {verdict} — {result.reason()}", highlight=False)
    if not result.passed:
        raise typer.Exit(1)


@routes_app.command("changes")
@friendly
def routes_changes(
    route: Annotated[str | None, typer.Argument(help="one route (default: all)")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000)] = 30,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """The routes' history, newest first: breaker opened / half-open / closed, switches to a fallback,
    canaries, qualifications — each with its reason."""
    from ledgerflow import client as lf
    from ledgerflow.views.routes import changes_table

    rec = lf.recorder(get_settings())
    try:
        rows = rec.route_changes(route, limit)
    finally:
        rec.dispose()
    if as_json:
        out.print_json(json.dumps(rows, default=str))
    else:
        out.print(changes_table(rows), soft_wrap=True, highlight=False)


@routes_app.command("check")
@friendly
def routes_check(path: Path) -> None:
    """Validate a route file; one line naming the route and field if it is wrong (exit 2)."""
    from runtime.settings import ConfigError
    from vendors.routes import RouteError, load_table

    try:
        table = load_table(path) if path.exists() else None
    except RouteError as e:
        raise ConfigError(str(e)) from None
    if table is None:
        raise FileNotFoundError(f"no such route file: {path}")
    out.print(f"{path}: {len(table.routes)} routes, {len(table.reviewers)} reviewers — valid")


@routes_app.command("schema")
def routes_schema() -> None:
    """Print the route file's JSON schema."""
    from vendors.routes import json_schema

    sys.stdout.write(json.dumps(json_schema(), indent=2) + "\n")


def main() -> None:
    # A crash in native code (a segmentation fault, an abort) prints every thread's Python stack to stderr
    # before the process dies, instead of nothing.
    faulthandler.enable()
    try:
        app()  # typer ends every command with SystemExit and its exit code
    except SystemExit as e:
        leave(e.code)
    leave(0)


def leave(code: object) -> NoReturn:
    """End the process once the command has done all its work, without interpreter finalization.

    The Temporal client's Rust runtime keeps threads that may call into Python while the interpreter
    finalizes; then CPython aborts ("Fatal Python error: PyGILState_Release: thread state … must be current
    when releasing", SIGABRT, exit -6) after a command that succeeded — temporalio/sdk-python#300, seen here
    in 2 of 3 test-suite runs. So: run the atexit handlers, flush both streams, and ``os._exit``.
    """
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): the message on stderr, status 1 (what the interpreter would do)
        print(code, file=sys.stderr)
        status = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
