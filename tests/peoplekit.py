"""Helpers shared by the tests of people in the loop (tests/workflows/test_people.py, test_approvers.py,
tests/web): waiting for a request, signalling a raw decision, the CLI as a subprocess, markers of a kind."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rules.events import MarkerKind, SystemMarker, parse
from rules.projection import fold
from workflows.contracts import workflow_id


async def wait_open(lf: Any, task_id: str, prefix: str, timeout: float = 20.0) -> str:
    """The id of the task's first open request starting with ``prefix``, once the ledger has one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = lf.recorder.read_events(task_id)
        if events:
            for rid, r in fold(events).requests.items():
                if r.open and rid.startswith(prefix):
                    return str(rid)
        await asyncio.sleep(0.05)
    raise AssertionError(f"no open {prefix!r} request in task {task_id}")


async def signal(lf: Any, task_id: str, payload: Any) -> None:
    """Send ``payload`` as it is through the task's ``decide`` signal (as `temporal workflow signal` does)."""
    await lf.client.get_workflow_handle(workflow_id(task_id)).signal("decide", payload)


def markers(lf: Any, task_id: str, kind: MarkerKind) -> list[SystemMarker]:
    """The task's system markers of one kind, in ledger order."""
    out = []
    for e in lf.recorder.read_events(task_id):
        event = parse(e)
        if isinstance(event, SystemMarker) and event.kind == kind:
            out.append(event)
    return out


async def cli(
    lf: Any, tmp_path: Path, *args: str, env: Mapping[str, str] | None = None
) -> tuple[int, str, str]:
    """``ledgerflow ARGS`` as a subprocess against the test's servers: (exit code, stdout, stderr). A
    traceback on either stream fails the test (a user error is one line). ``env`` is merged over the base
    environment (e.g. a test's vendor and route file)."""
    env = {
        **os.environ,
        "LEDGERFLOW_TEMPORAL_ADDRESS": str(lf.settings.temporal_address),
        "LEDGERFLOW_DATABASE_URL": str(lf.settings.database_url),
        "LEDGERFLOW_STATE_DIR": str(tmp_path),
        **(env or {}),
    }
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "ledgerflow"),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await proc.communicate()
    assert b"Traceback" not in out + err, err.decode()
    return proc.returncode or 0, out.decode(), err.decode()
