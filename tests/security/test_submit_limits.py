"""``ledgerflow submit`` of a plan the system cannot carry: one clear line on stderr, exit 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from limitskit import billion_laughs, fan_outs

CLI = [str(Path(sys.executable).parent / "ledgerflow")]


def _deep_input(depth: int) -> str:
    return "{a: " * depth + "1" + "}" * depth


ONE = "goal: g\nbudget_ceiling: 10\nstages:\n  - {id: deep, executor: llm.text, estimate: 1, input: %s}\n"


@pytest.mark.parametrize(
    ("plan", "needles"),
    [
        (ONE % _deep_input(260), ("stage 'deep'", "nested deeper than 32 levels")),
        (ONE % ("{text: " + "x" * 300_000 + "}"), ("stage 'deep'", "larger than 256 KiB")),
        (billion_laughs(), ("YAML aliases", "not allowed")),
        (yaml.safe_dump(fan_outs(200)), ("100,002 nodes", "at most 20,000")),
        ("goal: x\nstages: " + "[" * 50_000 + "]" * 50_000 + "\n", ("nested too deeply",)),
    ],
    ids=["deep-input", "big-input", "alias-bomb", "100k-nodes", "deep-document"],
)
def test_submit_of_a_plan_beyond_the_limits_is_one_line(tmp_path, plan, needles):
    path = tmp_path / "plan.yaml"
    path.write_text(plan)
    proc = subprocess.run(
        [*CLI, "submit", str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, "LEDGERFLOW_TEMPORAL_ADDRESS": "127.0.0.1:1"},
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 2, proc
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert len(lines[0]) < 300, lines[0][:300]
    for needle in needles:
        assert needle in lines[0], lines[0]
