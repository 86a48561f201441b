"""Backup and point-in-time restore of the ledger, and the catch-up a restored ledger needs (docs/backup.md).

Three parts:

* **WAL archiving** (``enable_archiving``): ``archive_mode=on`` and an ``archive_command`` that ships every
  finished WAL segment, gzipped, to an archive directory (never overwriting one already there);
  ``archive_timeout`` bounds how long a quiet segment waits before it is shipped anyway.
* **Base backups** (``base_backup``): ``pg_basebackup`` (plain format, the WAL it needs streamed in), from any
  server the URL reaches; a backup plus the archive restores to any moment after the backup ended.
* **Restore** (``restore``): a new data directory from a base backup, ``restore_command`` reading the archive,
  ``recovery_target_time``, promoted at the target; started and waited for until it accepts writes.

A restored ledger is *behind* Temporal: workflows kept running (and the vendor kept charging) after the
recovery target. ``after_restore`` is what must run before any worker comes back (``docs/backup.md`` says
why): every run of a task the restore may have rewound is stopped and the task taken over from the ledger (a
new run, a new fencing epoch, open operations reconciled from the vendor, lost ones decided again under the
same operation keys, which the vendor replays instead of charging again); a task the ledger lost altogether
is started again from the input Temporal's history holds. ``relearn`` then puts every charge the vendor made
for those tasks in the ledger, with a ``cost_anomaly`` naming each figure that had to be re-learned, and a
``late_charge`` for one no run re-learned by itself.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy.engine import make_url
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.service import RPCError, RPCStatusCode

from ledger.recorder import Recorder
from ledgerflow.stack import pg
from reconcile.takeover import needs_a_run
from rules.events import MarkerKind, SystemMarker, to_new
from rules.keys import anomaly_key, late_charge_key
from rules.operation import OperationRecord, fold_operations
from rules.projection import fold
from workflows.contracts import TaskInput, workflow_id
from workflows.task import TaskWorkflow

# The reason a run is terminated with: its history may be ahead of the restored ledger.
REWOUND = (
    "ledger restored to an earlier point: this run's history may be ahead of it (takeover from the ledger)"
)
RESTORE_WHAT = "restore"  # the anomaly key's suffix of a figure re-learned after a restore
_PROMOTE_TIMEOUT_S = 120.0


class BackupError(RuntimeError):
    """A backup or restore step failed; the message says which and why."""


# ── archiving ─────────────────────────────────────────────────────────────────────────────────────────
def archive_command(archive_dir: Path) -> str:
    """Ship a finished segment gzipped, never over one already archived (a second cluster writing to the same
    archive must fail loudly, not overwrite)."""
    d = str(archive_dir.absolute())
    return f"test ! -f '{d}/%f.gz' && gzip -c '%p' > '{d}/%f.gz.tmp' && mv '{d}/%f.gz.tmp' '{d}/%f.gz'"


def restore_command(archive_dir: Path) -> str:
    d = str(archive_dir.absolute())
    return f"gunzip -c '{d}/%f.gz' > '%p'"


def _connect(url: str) -> psycopg.Connection[Any]:
    u = make_url(url)
    return psycopg.connect(
        host=u.host or "127.0.0.1",
        port=u.port or 5432,
        user=u.username or "postgres",
        password=u.password or None,
        dbname=u.database or "postgres",
        autocommit=True,
        connect_timeout=10,
    )


def archiving(url: str) -> dict[str, str]:
    """The server's archiving settings, as it reports them."""
    with _connect(url) as conn:
        names = ("archive_mode", "archive_command", "archive_timeout", "wal_level")
        return {n: str(conn.execute(f"SHOW {n}").fetchone()[0]) for n in names}  # type: ignore[index]


def _server_user() -> str | None:
    """The user an embedded server runs as (when we are root: ``pg.SYSTEM_USER``), else None."""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        with contextlib.suppress(KeyError):
            pwd.getpwnam(pg.SYSTEM_USER)
            return pg.SYSTEM_USER
    return None


def _own(path: Path, user: str | None, *, recursive: bool = False) -> None:
    if user is None:
        return
    entry = pwd.getpwnam(user)
    paths: Iterable[Path] = (path, *path.rglob("*")) if recursive else (path,)
    for p in paths:
        os.chown(p, entry.pw_uid, entry.pw_gid, follow_symlinks=False)


def configure_archiving(url: str, archive_dir: Path, archive_timeout_s: int = 60) -> bool:
    """Turn WAL archiving on (``ALTER SYSTEM``) and reload; True if ``archive_mode`` was off, which only a
    restart of the server applies."""
    archive_dir.mkdir(parents=True, exist_ok=True)
    archive_dir.chmod(0o700)
    _own(archive_dir, _server_user())
    with _connect(url) as conn:
        was = str(conn.execute("SHOW archive_mode").fetchone()[0])  # type: ignore[index]
        conn.execute("ALTER SYSTEM SET wal_level = 'replica'")
        conn.execute("ALTER SYSTEM SET archive_mode = 'on'")
        conn.execute(f"ALTER SYSTEM SET archive_command = '{_sql(archive_command(archive_dir))}'")
        conn.execute(f"ALTER SYSTEM SET archive_timeout = '{int(archive_timeout_s)}s'")
        conn.execute("SELECT pg_reload_conf()")
    return was == "off"


def enable_archiving(
    instance: pg.PgInstance, archive_dir: Path, archive_timeout_s: int = 60
) -> pg.PgInstance:
    """WAL archiving on an embedded server, restarted (on the same port) if that is what it takes."""
    if configure_archiving(instance.url, archive_dir, archive_timeout_s):
        pg.stop(instance.data_dir)
        instance = pg.init_and_start(instance.data_dir, instance.port)
    return instance


def _sql(text: str) -> str:
    return text.replace("'", "''")


# ── base backups ──────────────────────────────────────────────────────────────────────────────────────
@dataclass(frozen=True)
class BaseBackup:
    path: Path
    started_at: datetime
    ended_at: datetime
    size_bytes: int


def base_backup(url: str, dest: Path, *, label: str = "ledgerflow backup") -> BaseBackup:
    """``pg_basebackup`` of the server ``url`` reaches into ``dest`` (created; it must not exist): plain
    format, checkpoint now, the WAL the backup needs streamed into it (so it is consistent on its own)."""
    if dest.exists() and any(dest.iterdir()):
        raise BackupError(f"{dest} exists and is not empty: a base backup goes into a new directory")
    u = make_url(url)
    dest.parent.mkdir(parents=True, exist_ok=True)
    user = _server_user()
    if user is not None:  # the backup's files belong to the server's user, as a restore needs them
        dest.mkdir(mode=0o700, exist_ok=True)
        _own(dest, user)
        pg._make_traversable(dest.parent)
    started = datetime.now(UTC)
    args = ["pg_basebackup", "-D", str(dest.absolute()), "-Fp", "-Xstream", "-cfast", "--no-password"]
    args += ["-h", u.host or "127.0.0.1", "-p", str(u.port or 5432), "-U", u.username or "postgres"]
    args += ["-l", label[:60]]
    try:
        pg._run(args, user=user, cwd=dest.parent)
    except pg.PgError as e:
        raise BackupError(f"pg_basebackup failed: {e}") from None
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    return BaseBackup(dest, started, datetime.now(UTC), size)


# ── restore ───────────────────────────────────────────────────────────────────────────────────────────
def restore(
    backup: Path,
    archive_dir: Path,
    data_dir: Path,
    *,
    target_time: datetime | None,
    port: int | None = None,
) -> pg.PgInstance:
    """A new cluster in ``data_dir`` from the base backup ``backup``, replayed from the archive up to
    ``target_time`` (None: to the end of the archive), then promoted; returns once it accepts writes.

    Raises:
        BackupError: ``data_dir`` holds a cluster (a restore never writes over one), or recovery failed
            (e.g. the archive ends before the target: the server's log says so).
    """
    data_dir = data_dir.absolute()
    if data_dir.exists() and any(data_dir.iterdir()):
        raise BackupError(f"{data_dir} is not empty: restore into a new (or emptied) data directory")
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(data_dir, ignore_errors=True)
    shutil.copytree(backup, data_dir, symlinks=True)
    data_dir.chmod(0o700)
    (data_dir / "postmaster.pid").unlink(missing_ok=True)
    lines = [
        "# ledgerflow restore",
        f"restore_command = '{_sql(restore_command(archive_dir))}'",
        "recovery_target_action = 'promote'",
        "recovery_target_timeline = 'latest'",
    ]
    if target_time is not None:
        lines.append(f"recovery_target_time = '{target_time.astimezone(UTC).isoformat(sep=' ')}'")
    with (data_dir / "postgresql.auto.conf").open("a") as conf:
        conf.write("\n" + "\n".join(lines) + "\n")
    (data_dir / "recovery.signal").touch()
    _own(data_dir, _server_user(), recursive=True)
    try:
        instance = pg.init_and_start(data_dir, port)
    except pg.PgError as e:
        raise BackupError(f"the restored server did not start: {e}") from None
    deadline = time.monotonic() + _PROMOTE_TIMEOUT_S
    while True:
        with contextlib.suppress(psycopg.OperationalError), _connect(instance.url) as conn:
            if not conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]:  # type: ignore[index]
                return instance
        if pg.postmaster_pid(data_dir) is None:
            raise BackupError(f"recovery failed:\n{pg._tail(pg.log_file(data_dir))}")
        if time.monotonic() > deadline:
            raise BackupError(
                f"not promoted within {_PROMOTE_TIMEOUT_S:.0f}s:\n{pg._tail(pg.log_file(data_dir))}"
            )
        time.sleep(0.2)


# ── after a restore: the ledger is behind Temporal ────────────────────────────────────────────────────
@dataclass
class CatchUp:
    """What ``after_restore`` did, and what the restored ledger held (for ``relearn``)."""

    # When the catch-up ran: a charge the vendor made before it may be one the ledger lost.
    restored_at: datetime
    terminated: list[str] = field(default_factory=list)  # runs stopped (their history may be ahead)
    resumed: list[str] = field(default_factory=list)  # tasks taken over from the restored ledger
    recreated: list[str] = field(default_factory=list)  # tasks the ledger lost entirely, started again
    # task → operation keys with a result in the restored ledger (a charge of any other key is re-learned)
    resolved: dict[str, set[str]] = field(default_factory=dict)


async def after_restore(rec: Recorder, client: Client, task_ids: Collection[str]) -> CatchUp:
    """Bring every task of ``task_ids`` (those Temporal ran since the backup; ``task_workflows`` lists them)
    back in step with the restored ledger, before any worker returns.

    A running run is terminated: its watermark and its in-memory fold may be past the ledger's end, where its
    appends would take seqs it never reads. Then a task the ledger holds and that still needs a run is taken
    over from the ledger (``ledgerflow resume``'s new run, on the task queue the old one used); a task the
    ledger lost altogether (created after the recovery target) is started again with the input its last run
    was started with. Either new run decides again what the ledger does not hold; its operation keys are
    the ones the lost INTENTs had (``task:node:aN``, N from the ledger), so the vendor replays the job it
    already ran and charged instead of charging again.
    """
    catch = CatchUp(restored_at=datetime.now(UTC))
    for task_id in sorted(task_ids):
        events = rec.read_events(task_id)
        catch.resolved[task_id] = {k for k, op in fold_operations(events).items() if op.result is not None}
        handle = client.get_workflow_handle(workflow_id(task_id))
        try:
            described = await handle.describe()
        except RPCError as e:
            if e.status == RPCStatusCode.NOT_FOUND:
                continue  # never ran here: the takeover scan (reconcile) looks after ledger-only tasks
            raise
        if described.status == WorkflowExecutionStatus.RUNNING:
            with contextlib.suppress(RPCError):  # it ended meanwhile: closed either way
                await handle.terminate(reason=REWOUND)
            catch.terminated.append(task_id)
        queue = described.task_queue or ""
        started = await _started_input(client, task_id)
        if events and events[0].type == "TaskCreated":
            p = fold(events)
            if not needs_a_run(p):
                continue
            plan = p.plan.model_copy(update={"task_id": task_id})
            beat = started.heartbeat_timeout_seconds if started is not None else 30.0
            inp = TaskInput(task_id=task_id, plan=plan, heartbeat_timeout_seconds=beat)
            catch.resumed.append(task_id)
        elif started is not None:
            inp = started
            catch.recreated.append(task_id)
        else:
            continue
        await client.start_workflow(
            TaskWorkflow.run,
            inp,
            id=workflow_id(task_id),
            task_queue=queue,
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
            id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
        )
    return catch


async def _started_input(client: Client, task_id: str) -> TaskInput | None:
    """The input the task's latest run was started with, from its history (None: not readable)."""
    try:
        history = await client.get_workflow_handle(workflow_id(task_id)).fetch_history()
    except RPCError:
        return None
    for event in history.events:
        if event.HasField("workflow_execution_started_event_attributes"):
            payloads = event.workflow_execution_started_event_attributes.input.payloads
            decoded = await client.data_converter.decode(payloads, [TaskInput])
            return decoded[0] if decoded else None
    return None


async def task_workflows(client: Client, since: datetime) -> list[str]:
    """Every task whose workflow ran at or after ``since`` (running, or closed since): what a restore to
    ``since`` may have rewound."""
    at = since.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    query = f"WorkflowType = 'TaskWorkflow' AND (ExecutionStatus = 'Running' OR CloseTime >= '{at}')"
    found: set[str] = set()
    async for wf in client.list_workflows(query):
        found.add(wf.id.removeprefix(workflow_id("")))
    return sorted(found)


@dataclass(frozen=True)
class Relearned:
    task_id: str
    operation_key: str
    job_id: str
    amount: Decimal
    how: str  # "result" (the new run recorded it) or "late_charge" (recorded here from the vendor's billing)


def relearn(rec: Recorder, charges: Iterable[dict[str, Any]], catch: CatchUp) -> list[Relearned]:
    """Every generation charge the vendor lists for the caught-up tasks is in the ledger afterwards.

    Call once their runs have ended. A charge made before the catch-up for an operation the restored ledger
    held no result for is a figure the restore lost: the new run re-learned it (its result names the job), or,
    if no run did (the task ended another way), it is recorded here as a ``late_charge`` from the vendor's
    own billing. Either way a ``cost_anomaly`` marker says which figure was reconstructed, from where, and
    why: the audit shows it, nothing hides it. Idempotent (dedup keys per operation and job).
    """
    out: list[Relearned] = []
    cutoff = catch.restored_at.timestamp()
    by_task: dict[str, list[dict[str, Any]]] = {}
    for c in charges:
        task = str(c["idempotency_key"]).split(":")[0]
        if task in catch.resolved and c.get("protocol") != "chat":
            by_task.setdefault(task, []).append(c)
    for task_id, mine in sorted(by_task.items()):
        ops = fold_operations(rec.read_events(task_id))
        for c in mine:
            key, job = str(c["idempotency_key"]), str(c["job_id"])
            amount = _money(c["amount"])
            if key in catch.resolved[task_id] or float(c.get("at") or 0) >= cutoff:
                continue  # in the restored ledger, or charged after the catch-up (the new run's own)
            op = ops.get(key)
            when = datetime.fromtimestamp(float(c.get("at") or 0), UTC).isoformat(timespec="seconds")
            if op is not None and job in op.job_ids:
                how = "result"
                detail = (
                    f"re-learned after a restore: the vendor charged {amount} for job {job} at {when}; the "
                    "restored ledger had no result for it, the new run recorded the vendor's figure"
                )
            else:
                how = "late_charge"
                # Booked to the operation of record: its own if its INTENT survived, else the node's
                # surviving operation (same node, same route), so the charge keeps its route and the audit
                # matches it to that operation by job id; the anomaly names the key the vendor billed.
                book = op if op is not None and op.intent is not None else _of_node(ops, key)
                booked = book.key if book is not None else key
                marker = SystemMarker(
                    kind=MarkerKind.LATE_CHARGE,
                    operation_key=booked,
                    node=book.node if book is not None else None,
                    amount=amount,
                    detail=f"job {job} (key {key}): charged at {when}, lost with the ledger's tail, "
                    "learned from the vendor's billing",
                )
                rec.append_idempotent(
                    task_id,
                    to_new(marker, dedup_key=late_charge_key(booked, job), operation_key=booked),
                    spend=amount,
                )
                detail = (
                    f"re-learned after a restore: the vendor charged {amount} for job {job} under key {key} "
                    f"at {when}; no run recorded it again, so its figure is the vendor's billing, booked as "
                    f"a late charge of {booked}"
                )
                op, key = book, booked
            anomaly = SystemMarker(
                kind=MarkerKind.COST_ANOMALY,
                operation_key=key,
                node=op.node if op is not None else None,
                detail=detail,
            )
            dedup = anomaly_key(key, f"{RESTORE_WHAT}:{job}")
            rec.append_idempotent(task_id, to_new(anomaly, dedup_key=dedup, operation_key=key))
            out.append(Relearned(task_id, str(c["idempotency_key"]), job, amount, how))
    return out


def _of_node(ops: dict[str, OperationRecord], key: str) -> OperationRecord | None:
    """The node's operation of record for an attempt key (``task:node:aN``) the ledger has no INTENT for:
    its latest attempt with an INTENT, resolved ones first."""
    node = key.rsplit(":", 1)[0]
    same = [o for o in ops.values() if o.key.rsplit(":", 1)[0] == node and o.intent is not None]
    same.sort(key=lambda o: (o.resolved, o.key))
    return same[-1] if same else None


def _money(raw: Any) -> Decimal:
    try:
        amount = Decimal(str(raw))
    except InvalidOperation:
        return Decimal(0)
    return amount if amount.is_finite() else Decimal(0)


def restart_embedded(state_dir: Path, url: str) -> bool:
    """Restart the embedded stack's Postgres (``state_dir/pg/data``) on its port if it is the server ``url``
    names, so a new ``archive_mode`` applies; False if it is not ours to restart (say so to the operator)."""
    data_dir = state_dir.absolute() / "pg" / "data"
    if pg.postmaster_pid(data_dir) is None:
        return False
    running = pg.init_and_start(data_dir)  # the live instance: its port
    if make_url(url).port != running.port:
        return False
    pg.stop(data_dir)
    pg.init_and_start(data_dir, running.port)
    return True
