"""The ``ledgerflow`` command as a user runs it: a real subprocess, real servers, one-line errors."""

from __future__ import annotations

import asyncio
import json
import os
import re
import uuid

import pytest
import sqlalchemy as sa
from clikit import CLI, ROOT, assert_one_line_error, run

GOOD = """
goal: a two-stage plan
budget_ceiling: 10
stages:
  - {id: script, executor: llm.text, estimate: 0.5}
  - {id: shots, executor: image.keyframe, estimate: 1, depends_on: [script], fan_out: 2}
"""


@pytest.mark.parametrize(
    ("plan", "needles"),
    [
        (
            GOOD.replace("depends_on: [script]", "depends_on: [scrpt]"),
            ("stage 'shots'", "unknown stage 'scrpt'"),
        ),
        (GOOD.replace("estimate: 0.5", "estimate: -1"), ("stage 'script'", "must not be negative")),
        (GOOD.replace("estimate: 0.5", "estimate: .nan"), ("stage 'script'", "finite")),
        (GOOD.replace("executor: llm.text", "executor: nope"), ("stage 'script'", "has no route")),
        (GOOD.replace("id: script", "id: ../etc/passwd"), ("not a valid id",)),
        ("goal: [unclosed\n", ("not valid YAML",)),
        (
            GOOD
            + "  - {id: a, executor: llm.text, depends_on: [b]}\n"
            + "  - {id: b, executor: llm.text, depends_on: [a]}\n",
            ("dependency cycle", "a -> b -> a"),
        ),
        (
            GOOD.replace("fan_out: 2}", "fan_out: 2, inputs: {pic: nowhere}}"),
            ("stage 'shots'", "input 'pic' names unknown stage 'nowhere'"),
        ),
    ],
    ids=["unknown-dep", "negative", "nan", "no-route", "hostile-id", "bad-yaml", "cycle", "input-mapping"],
)
def test_submit_refuses_a_bad_plan_with_one_line_naming_the_stage(tmp_path, plan, needles):
    path = tmp_path / "plan.yaml"
    path.write_text(plan)
    proc = run(["submit", str(path)], env={"LEDGERFLOW_TEMPORAL_ADDRESS": "127.0.0.1:1"}, cwd=tmp_path)
    assert_one_line_error(proc, *needles)


def test_missing_plan_file_is_one_line(tmp_path):
    assert_one_line_error(run(["submit", str(tmp_path / "nope.yaml")], cwd=tmp_path), "no such plan file")


def test_soak_with_a_missing_or_broken_simulator_profile_is_one_line_before_anything_starts(tmp_path):
    missing = run(["soak", "--sim", str(tmp_path / "nope.json")], cwd=tmp_path)
    assert_one_line_error(missing, "no such simulator profile file")
    broken = tmp_path / "profile.json"
    broken.write_text("{not json")
    assert_one_line_error(run(["soak", "--sim", str(broken)], cwd=tmp_path), "is not JSON")
    assert not (tmp_path / ".ledgerflow").exists(), "no stack was started for bad input"


def test_unreachable_temporal_is_one_line(tmp_path, pg_url, recorder):  # recorder: the schema exists
    path = tmp_path / "plan.yaml"
    path.write_text(GOOD)
    env = {"LEDGERFLOW_TEMPORAL_ADDRESS": "127.0.0.1:1", "LEDGERFLOW_DATABASE_URL": pg_url}
    assert_one_line_error(run(["submit", str(path)], env=env, cwd=tmp_path), "cannot reach Temporal")


def test_status_of_an_unknown_task_is_one_line(tmp_path, pg_url, recorder):  # recorder: the schema exists
    env = {"LEDGERFLOW_TEMPORAL_ADDRESS": "127.0.0.1:1", "LEDGERFLOW_DATABASE_URL": pg_url}
    assert_one_line_error(run(["status", "no-such-task"], env=env, cwd=tmp_path), "no task 'no-such-task'")


async def test_submit_wait_runs_a_task_and_events_lists_its_ledger(lf, sim, tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(GOOD)
    env = {
        **os.environ,
        "LEDGERFLOW_TEMPORAL_ADDRESS": lf.settings.temporal_address,
        "LEDGERFLOW_DATABASE_URL": lf.settings.database_url,
        "LEDGERFLOW_TASK_QUEUE": lf.task_queue,
    }
    task_id = f"cli-{os.getpid()}-{tmp_path.name[-6:]}"
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        "submit",
        str(path),
        "--task-id",
        task_id,
        "--wait",
        "--json",
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode == 0, err.decode()
    result = json.loads(out)
    assert result["state"] == "Completed" and result["task_id"] == task_id
    again = await asyncio.create_subprocess_exec(
        *CLI,
        "submit",
        str(path),
        "--task-id",
        task_id,
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await again.communicate()
    assert again.returncode == 2 and b"already exists" in err and b"Traceback" not in err
    events = await asyncio.create_subprocess_exec(
        *CLI, "events", task_id, "--json", cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE
    )
    lines, _ = await events.communicate()
    types = [json.loads(line)["type"] for line in lines.decode().splitlines()]
    assert types[0] == "TaskCreated" and types.count("Outcome") == 4  # script, 2 shots, compose
    assert len(types) == len(lf.recorder.read_events(task_id))
    listed = await asyncio.create_subprocess_exec(
        *CLI, "artifacts", task_id, "--json", cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await listed.communicate()
    rows = {r["node"]: r for r in json.loads(out)}
    # Each shot was made from the script's output: its lineage names the script's bytes.
    assert [i["node"] for i in rows["shots/S02"]["inputs"]] == ["script"]
    assert rows["shots/S02"]["inputs"][0]["sha256"] == rows["script"]["sha256"]
    assert all(r["current"] and r["input_hash"] for r in rows.values() if r["node"] != "compose")


def test_artifacts_of_an_unknown_task_is_one_line(tmp_path, pg_url, recorder):  # recorder: the schema exists
    env = {"LEDGERFLOW_DATABASE_URL": pg_url}
    assert_one_line_error(run(["artifacts", "no-such-task"], env=env, cwd=tmp_path), "no task 'no-such-task'")


def test_a_route_file_is_checked_with_one_line_naming_the_route_and_field(tmp_path):
    good = run(["routes", "check", str(ROOT / "examples" / "routes.yaml")])
    assert good.returncode == 0 and "5 routes" in good.stdout, good
    bad = tmp_path / "routes.yaml"
    bad.write_text("routes:\n  video.motion: {adapter: jobs, mode: sometimes}\n")
    assert_one_line_error(run(["routes", "check", str(bad)], cwd=tmp_path), "route 'video.motion': mode")
    bad.write_text("routes:\n  video.motion: {adapter: jobs, credential_env: 'sk-live-123 4'}\n")
    assert_one_line_error(run(["routes", "check", str(bad)], cwd=tmp_path), "credential_env")
    bad.write_text("routes:\n  video.motion: {adapter: jobs, fallbacks: [nope]}\n")
    assert_one_line_error(
        run(["routes", "check", str(bad)], cwd=tmp_path),
        f"route file {bad}: route 'video.motion': fallback 'nope' is not another route of this table",
    )
    bad.write_text("routes:\n  video.motion: {fallbacks: [b]}\n  b: {adapter: jobs}\n")
    assert_one_line_error(
        run(["routes", "check", str(bad)], cwd=tmp_path), "route 'b': a fallback needs a regression"
    )


def test_db_sync_queue_rebuilds_the_human_queue_from_the_ledgers(tmp_path, pg_url, recorder):
    tid = f"sq-{uuid.uuid4().hex[:10]}"
    recorder.take_lease(tid, "test")
    recorder.open_budget(tid, [("project:sq", None), (f"task:{tid}", None)])
    engine = sa.create_engine(pg_url)
    try:
        with engine.begin() as conn:  # a row no ledger explains (its task never asked anything)
            conn.execute(
                sa.text(
                    "INSERT INTO human_queue (task_id, request_id, kind, scope)"
                    " VALUES (:t, 'r', 'approval', 'x')"
                ),
                {"t": tid},
            )
        proc = run(["db", "sync-queue"], env={"LEDGERFLOW_DATABASE_URL": pg_url}, cwd=tmp_path)
        with engine.connect() as conn:
            left = conn.execute(
                sa.text("SELECT count(*) FROM human_queue WHERE task_id = :t"), {"t": tid}
            ).scalar()
    finally:
        engine.dispose()
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(
        r"human_queue: \d+ tasks read, [1-9]\d* rows changed, \d+ open requests\n", proc.stdout
    )
    assert left == 0


def test_db_sync_queue_names_a_ledger_that_does_not_fold_and_goes_on(tmp_path, pg_url, recorder):
    tid = f"sq-{uuid.uuid4().hex[:10]}"
    recorder.take_lease(tid, "test")
    recorder.open_budget(tid, [("project:sq", None), (f"task:{tid}", None)])
    engine = sa.create_engine(pg_url)
    try:
        with engine.begin() as conn:  # an event no ledgerflow wrote (a hand edit, a corrupt restore)
            seq = conn.execute(
                sa.text(
                    "UPDATE task_leases SET next_seq = next_seq + 1 WHERE task_id = :t RETURNING next_seq"
                ),
                {"t": tid},
            ).scalar_one()
            conn.execute(
                sa.text(
                    "INSERT INTO events (task_id, seq, type, epoch, dedup_key, payload)"
                    " VALUES (:t, :seq, 'Intent', 1, :k, CAST('{\"type\": \"Intent\"}' AS jsonb))"
                ),
                {"t": tid, "seq": seq - 1, "k": f"{tid}:bad"},
            )
    finally:
        engine.dispose()
    proc = run(["db", "sync-queue"], env={"LEDGERFLOW_DATABASE_URL": pg_url}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ledgers do not fold (left as they were; `ledgerflow audit` them)" in proc.stderr
    assert tid in proc.stderr and "Traceback" not in proc.stderr
    assert re.fullmatch(r"human_queue: \d+ tasks read, \d+ rows changed, \d+ open requests\n", proc.stdout)
