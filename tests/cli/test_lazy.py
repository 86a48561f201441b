"""`ledgerflow --help` stays fast: importing the CLI loads neither Temporal's SDK, SQLAlchemy nor the ledger
(each command imports what it needs); `--version` prints the installed version."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

CLI = [str(Path(sys.executable).parent / "ledgerflow")]
HEAVY = ("sqlalchemy", "temporalio", "ledger.recorder", "ledgerflow.client", "psycopg")


def test_importing_the_cli_loads_neither_temporal_nor_sqlalchemy_nor_the_ledger() -> None:
    code = "import json, sys, ledgerflow.cli; print(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(proc.stdout))
    assert [m for m in HEAVY if m in loaded] == []


def test_help_and_version() -> None:
    helped = subprocess.run([*CLI, "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "tasks" in helped.stdout and "--version" in helped.stdout, helped
    shown = subprocess.run([*CLI, "--version"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and shown.stdout.strip() == f"ledgerflow {version('ledgerflow')}", shown


def test_a_user_error_is_still_one_line_with_the_errors_imported_late(tmp_path: Path) -> None:
    (tmp_path / "plan.yaml").write_text("goal: [unclosed\n")
    proc = subprocess.run(
        [*CLI, "submit", str(tmp_path / "plan.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc
    assert proc.stderr.strip().startswith("error:") and "not valid YAML" in proc.stderr, proc.stderr
