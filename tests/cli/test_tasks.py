"""`ledgerflow tasks` lists tasks from Temporal's search attributes; `ledgerflow status` of a finished task
exits 0 every time (it once ended in a segmentation fault after printing: the CLI now turns faulthandler on,
so a crash in native code would leave every thread's stack on stderr)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from ledgerflow.views import people
from ledgerflow.views.tasks import query
from runtime.signing import demo_key
from workflows.contracts import PROJECT, WAITING

CLI = [str(Path(sys.executable).parent / "ledgerflow")]
STATUS_RUNS = 50
AT_ONCE = 2  # the machine's cores

PLAN = """
goal: a two-stage plan
project: {project}
budget_ceiling: 10
approval: {{timeout: 10m, policy: abort, approvers: [director]}}
stages:
  - {{id: script, executor: llm.text, estimate: 0.5, approval: {approval}}}
  - {{id: shots, executor: image.keyframe, estimate: 1, depends_on: [script], fan_out: 2}}
"""


def _env(lf: Any, tmp_path: Path) -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("LEDGERFLOW_")},
        "LEDGERFLOW_ENV": "dev",
        "LEDGERFLOW_STATE_DIR": str(tmp_path / ".ledgerflow"),  # no stack.json of anyone else's
        "LEDGERFLOW_TEMPORAL_ADDRESS": lf.settings.temporal_address,
        "LEDGERFLOW_DATABASE_URL": lf.settings.database_url,
        "LEDGERFLOW_TASK_QUEUE": lf.task_queue,
    }


async def _cli(env: dict[str, str], cwd: Path, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *CLI, *args, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    return proc.returncode, out.decode(), err.decode()


async def test_tasks_lists_a_projects_tasks_with_state_spent_and_who_waits_on_a_person(lf, sim, tmp_path):
    project = f"p-{uuid.uuid4().hex[:8]}"
    done = lf.plan(PLAN.format(project=project, approval="false"))
    waiting = lf.plan(PLAN.format(project=project, approval="true"))
    other = lf.plan(PLAN.format(project=f"{project}-other", approval="false"))
    finished = await lf.run(done)
    assert finished.state == "Completed"
    assert (await lf.run(other)).state == "Completed"
    handle = await lf.start(waiting)
    await lf.wait_state(handle, {"WaitingHuman"})
    # Visibility follows a moment behind the workflows: wait until it shows what the CLI will read.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        seen = {
            e.id: e.typed_search_attributes.get(WAITING)
            async for e in lf.client.list_workflows(query(project))
            if e.typed_search_attributes.get(PROJECT) == project
        }
        if len(seen) == 2 and any(seen.values()):
            break
        await asyncio.sleep(0.2)
    else:
        raise AssertionError(f"visibility never showed both tasks, one waiting on a person, in 30s: {seen}")
    env = _env(lf, tmp_path)
    code, out, err = await _cli(env, tmp_path, "tasks", "--project", project, "--json")
    assert code == 0, err
    rows = {r["task_id"]: r for r in json.loads(out)}
    assert set(rows) == {done.task_id, waiting.task_id}  # not the other project's
    assert rows[done.task_id]["state"] == "Completed" and not rows[done.task_id]["waiting_on_person"]
    assert rows[done.task_id]["spent"] == float(finished.summary["spent"])
    assert rows[done.task_id]["project"] == project
    assert rows[waiting.task_id]["state"] == "WaitingHuman" and rows[waiting.task_id]["waiting_on_person"]
    code, out, err = await _cli(env, tmp_path, "tasks", "--project", project, "--waiting", "--json")
    assert code == 0 and [r["task_id"] for r in json.loads(out)] == [waiting.task_id], (out, err)
    code, out, err = await _cli(env, tmp_path, "tasks", "--project", project)
    assert code == 0 and done.task_id in out and "WaitingHuman" in out and "yes" in out, (out, err)
    # A project name the query cannot hold: one line, not a query error.
    code, out, err = await _cli(env, tmp_path, "tasks", "--project", "no/such")
    assert code == 2, (out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    # Answered: the task finishes (nothing is left waiting for the next test).
    approval = "approval:script:v1"
    sent = await people.decide(lf.settings, demo_key("director"), waiting.task_id, approval, "approve")
    assert sent.status == "accepted", sent.line
    assert (await handle.result()).state == "Completed"


async def test_status_of_a_finished_task_exits_0_every_time(lf, sim, tmp_path):
    plan = lf.plan(PLAN.format(project="status-runs", approval="false"))
    assert (await lf.run(plan)).state == "Completed"
    env = _env(lf, tmp_path)
    slots = asyncio.Semaphore(AT_ONCE)
    failures: list[str] = []

    async def one(i: int) -> None:
        async with slots:
            code, out, err = await _cli(env, tmp_path, "status", str(plan.task_id))
        if code != 0 or "Completed" not in out or "Fatal Python error" in err:
            failures.append(f"run {i}: exit {code}\n{out[-2000:]}\n{err[-4000:]}")

    await asyncio.gather(*(one(i) for i in range(STATUS_RUNS)))
    assert failures == [], f"{len(failures)} of {STATUS_RUNS} runs failed; first:\n{failures[0]}"
