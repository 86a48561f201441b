"""``ledgerflow routes qualify`` and ``ledgerflow routes``, as a user runs them: a real subprocess against the
simulator and the ledger's Postgres; the result recorded with its scores, bad input refused in one line."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import yaml

from ledger.recorder import Recorder
from tests.cli.test_cli import ROOT, assert_one_line_error, run

REGRESSION = ROOT / "examples" / "regressions" / "motion.yaml"


def setup(tmp_path: Path, pg_url: str, simulator_url: str, sim_key: str, *, min_score: float = 0.7) -> Any:
    u = uuid.uuid4().hex[:8]
    primary, backup = f"mo-{u}", f"mo-{u}-b"
    regression = yaml.safe_load(REGRESSION.read_text())
    (tmp_path / "sets").mkdir()
    (tmp_path / "sets" / "motion.yaml").write_text(yaml.safe_dump({**regression, "min_score": min_score}))
    routes = {
        "routes": {
            primary: {"fallbacks": [backup]},
            backup: {"regression": "sets/motion.yaml", "convert": {"aspect": "aspect_ratio"}},
        }
    }
    (tmp_path / "routes.yaml").write_text(yaml.safe_dump(routes))
    env = {
        "LEDGERFLOW_ROUTES_FILE": str(tmp_path / "routes.yaml"),
        "LEDGERFLOW_DATABASE_URL": pg_url,
        "LEDGERFLOW_VENDOR_URL": simulator_url,
        "LEDGERFLOW_VENDOR_API_KEY": sim_key,
        "LEDGERFLOW_LLM_API_KEY": sim_key,
        "LEDGERFLOW_STATE_DIR": str(tmp_path / "state"),
        "LEDGERFLOW_ENV": "dev",
    }
    return primary, backup, env


async def test_qualify_runs_the_regression_set_and_records_a_pass_with_its_scores(
    recorder: Recorder, pg_url: str, simulator_url: str, sim_key: str, sim: Any, tmp_path: Path
) -> None:
    primary, backup, env = setup(tmp_path, pg_url, simulator_url, sim_key)
    before = len(await sim.charges(f"qualify-{backup}-"))

    done = run(["routes", "qualify", backup, "--as", "ops"], env=env, cwd=tmp_path)

    assert done.returncode == 0, done.stderr
    assert f"{backup}: QUALIFIED — 3 of 3 cases passed their checks, mean score 0.90" in done.stdout
    (change,) = [c for c in recorder.route_changes(backup) if c["kind"] == "qualified"]
    assert change["detail"]["actor"] == "ops" and change["detail"]["score"] == 0.9
    assert [c["id"] for c in change["detail"]["cases"]] == ["wide-establishing", "close-up", "keyframe-still"]
    charges = await sim.charges(f"qualify-{backup}-")
    assert len(charges) - before == 3 and {c["executor"] for c in charges} == {backup}  # sent to the fallback

    listed = run(["routes", "--json"], env=env, cwd=tmp_path)
    rows = {r["route"]: r for r in json.loads(listed.stdout)}
    assert rows[backup]["qualified"] is True and rows[backup]["fallback_of"] == [primary]
    assert rows[primary]["breaker"] == "closed" and rows[primary]["fallbacks"] == [backup]


def test_a_run_below_its_minimum_score_does_not_qualify_and_exits_1(
    recorder: Recorder, pg_url: str, simulator_url: str, sim_key: str, tmp_path: Path
) -> None:
    _, backup, env = setup(tmp_path, pg_url, simulator_url, sim_key, min_score=0.95)

    done = run(["routes", "qualify", backup], env=env, cwd=tmp_path)

    assert done.returncode == 1
    assert "NOT QUALIFIED" in done.stdout and "needs 0.95" in done.stdout
    assert recorder.route_health()[backup].qualified_at is None
    assert recorder.route_changes(backup)[0]["kind"] == "disqualified"


def test_qualify_refuses_an_unknown_route_or_a_missing_set_in_one_line(
    recorder: Recorder, pg_url: str, simulator_url: str, sim_key: str, tmp_path: Path
) -> None:
    primary, backup, env = setup(tmp_path, pg_url, simulator_url, sim_key)
    assert_one_line_error(run(["route", "qualify", "nope"], env=env, cwd=tmp_path), "route 'nope'")
    assert_one_line_error(
        run(["routes", "qualify", primary], env=env, cwd=tmp_path), f"route {primary!r} has no regression set"
    )
    shutil.rmtree(tmp_path / "sets")
    assert_one_line_error(
        run(["routes", "qualify", backup], env=env, cwd=tmp_path), "regression set", "motion.yaml"
    )
    assert recorder.route_changes(backup) == []  # nothing recorded for a run that could not be made
