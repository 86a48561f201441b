"""The embedded stack's lifecycle: `ledgerflow down` stops each process before the servers it needs, waits for
every one to exit, and kills what does not exit within its grace period."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ledgerflow.stack.pg import free_port
from ledgerflow.stack.services import alive, moved_port_lines, standard_port, stop

CLI = [str(Path(sys.executable).parent / "ledgerflow")]


def _child(code: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    time.sleep(0.3)  # let it install its signal handler
    return proc


def test_stop_waits_for_a_process_that_exits_on_sigterm() -> None:
    proc = _child("import time\ntime.sleep(60)")
    started = time.monotonic()
    assert stop(proc.pid, grace=10) == "stopped"
    assert time.monotonic() - started < 5 and proc.wait(1) == -signal.SIGTERM


def test_stop_kills_a_process_that_ignores_sigterm_after_its_grace_period() -> None:
    proc = _child("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)")
    started = time.monotonic()
    assert stop(proc.pid, grace=1.0) == "killed"
    assert 1.0 <= time.monotonic() - started < 5
    assert proc.wait(1) == -9 and not alive(proc.pid)


def test_down_returns_only_when_every_process_of_the_stack_has_exited(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGERFLOW_")}
    env["LEDGERFLOW_STATE_DIR"] = str(tmp_path / ".ledgerflow")
    up = subprocess.run([*CLI, "up"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert up.returncode == 0, up.stderr
    stack = json.loads((tmp_path / ".ledgerflow" / "stack.json").read_text())
    pids = stack["pids"]
    # Temporal takes its standard port when free; when not, `up` says so and which port it took instead.
    port = int(stack["temporal_address"].rsplit(":", 1)[1])
    assert (port == 7233) == ("temporal" not in stack["moved_ports"]), stack
    if port != 7233:
        assert f"7233 (Temporal's standard port) is busy: Temporal takes {port} instead" in up.stdout
        assert "(7233 was busy)" in up.stdout
    assert set(pids) == {"postgres", "temporal", "simulator", "worker", "review"}
    assert all(alive(pid) for pid in pids.values())
    down = subprocess.run([*CLI, "down"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert down.returncode == 0, down.stderr
    assert down.stdout.strip() == "stopped: review, worker, simulator, temporal, postgres"
    assert [name for name, pid in pids.items() if alive(pid)] == []  # nothing left running when down returns


def test_a_busy_standard_port_is_said_with_the_port_taken_instead() -> None:
    said: list[str] = []
    moved: dict[str, dict[str, object]] = {}
    free = free_port()
    assert standard_port(free, "temporal_ui", "the Temporal UI", moved, said.append) == free
    assert said == [] and moved == {}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        took = standard_port(port, "temporal", "Temporal", moved, said.append)
    assert took != port
    assert said == [f"port      {port} (Temporal's standard port) is busy: Temporal takes {took} instead"]
    assert moved_port_lines({"moved_ports": moved}) == [
        f"Temporal: its standard port {port} was busy, it took {took} instead"
    ]
