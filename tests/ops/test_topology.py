"""The production topology on the embedded parts: `ledgerflow up --workers 2` migrates the ledger, starts two
workers each with its own `/healthz` (as docker-compose.yml's worker replicas), a task runs on them, and
`ledgerflow down` leaves nothing running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from ledger.migrate import HEAD
from ledgerflow.stack.services import alive

CLI = [str(Path(sys.executable).parent / "ledgerflow")]

PLAN = """
goal: one paragraph, written by whichever of the two workers takes it
budget_ceiling: 5
stages:
  - {id: draft, executor: llm.text, estimate: 0.5}
"""


def test_up_with_two_workers_checks_their_health_runs_a_task_and_down_stops_everything(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGERFLOW_")}
    env["LEDGERFLOW_STATE_DIR"] = str(tmp_path / ".ledgerflow")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )

    try:
        up = cli("up", "--workers", "2")
        assert up.returncode == 0, up.stderr + up.stdout
        migrated = [line for line in up.stdout.splitlines() if line.startswith("migrate ")]
        assert migrated and f"revision {HEAD}" in migrated[0]  # the migration step, logged before the workers
        assert up.stdout.index("migrate ") < up.stdout.index("worker ")
        stack = json.loads((tmp_path / ".ledgerflow" / "stack.json").read_text())
        pids = stack["pids"]
        assert {"worker", "worker-2"} <= set(pids) and pids["worker"] != pids["worker-2"]
        assert all(alive(pids[name]) for name in ("worker", "worker-2"))
        health = stack["health_urls"]
        assert set(health) == {"worker", "worker-2"} and len(set(health.values())) == 2  # a port each
        for name, url in health.items():
            reply = httpx.get(url, timeout=5)
            assert (reply.status_code, reply.json()) == (200, {"status": "ok"}), name
            assert f"{name:<9} pid {pids[name]}, healthy: {url}" in up.stdout

        (tmp_path / "plan.yaml").write_text(PLAN)
        submitted = cli(
            "submit", "plan.yaml", "--task-id", f"topology-{tmp_path.name[-8:]}", "--wait", "--json"
        )
        assert submitted.returncode == 0, submitted.stderr
        assert json.loads(submitted.stdout)["state"] == "Completed"
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
    assert down.stdout.strip() == "stopped: review, worker, worker-2, simulator, temporal, postgres"
    assert [name for name, pid in pids.items() if alive(pid)] == []
