"""The console script as a user runs it (a subprocess), and the shape every user error must have."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [str(Path(sys.executable).parent / "ledgerflow")]  # the installed console script


def run(
    args: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """``ledgerflow ARGS`` with this environment plus ``env``, in ``cwd``."""
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=cwd, timeout=120
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Bad input: exit 2, no traceback, one line on stderr holding every needle."""
    assert proc.returncode == 2, proc
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
