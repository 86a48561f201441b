"""Issue 26 §3: what a person says when they decide about a node reaches that node's next attempt.

Real Temporal, Postgres, worker and simulator. A shot the vendor refuses on content becomes a dead letter; the
person who resumes it says why it should go differently; the next attempt's request carries that note (with
the vendor's own error) in ``feedback``, and so does the status the planner reads. Every decision recomputes
with the table that made it (the first dispatch was decided before any note existed).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from peoplekit import cli, wait_open
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from ledgerflow.views import people
from rules.events import Intent, parse
from rules.recompute import recompute
from runtime.signing import demo_key
from workflows.task import TaskWorkflow

ONE_SHOT = """
goal: one keyframe a person steers after the vendor refuses it
budget_ceiling: 10
approval: {timeout: 1h, policy: escalate}
stages:
  - {id: shot, executor: image.keyframe, estimate: 1, retries: 0, input: {prompt: a lighthouse}}
"""
NOTE = "the vendor's filter trips on 'storm': ask for a calm evening instead"


def dispatches(lf: Any, task_id: str) -> list[Any]:
    return [
        i.action
        for e in lf.recorder.read_events(task_id)
        if e.type == "Intent" and isinstance(i := parse(e), Intent) and i.action.kind == "Dispatch"
    ]


async def test_a_persons_note_on_resuming_a_dead_letter_reaches_the_next_attempts_request(lf, sim):
    await sim.configure(executors={"image.keyframe": {"reject_content": 1.0}})
    plan = lf.plan(ONE_SHOT)
    handle = await lf.start(plan)
    rid = await wait_open(lf, plan.task_id, "dead_letter:")
    [first] = [d for d in dispatches(lf, plan.task_id) if d.node == "shot"]
    assert "people" not in first.input.get("feedback", {}), "nobody has said anything yet"
    await sim.configure()  # the vendor takes the next request
    told = await people.decide(lf.settings, demo_key("director"), plan.task_id, rid, "resume", note=NOTE)
    assert told.status == "accepted", told
    result = await handle.result()
    assert result.state == "Completed", result.summary
    shots = dispatches(lf, plan.task_id)
    second = [d for d in shots if d.node == "shot"][1]
    feedback = second.input["feedback"]
    assert feedback["people"] == [f"director (resume): {NOTE}"]
    assert feedback["previous_errors"] and "content" in feedback["previous_errors"][0], feedback
    assert result.summary["nodes"]["shot"]["notes"] == [f"director (resume): {NOTE}"], "the planner reads it"
    events = lf.recorder.read_events(plan.task_id)
    assert recompute(events) == [], "each dispatch recomputes with the table that decided it"
    replayer = Replayer(workflows=[TaskWorkflow], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(await handle.fetch_history())


# ── dead letters grouped by cause (issue 26 §5) ─────────────────────────────────────────────────────────
REFUSED = """
goal: a keyframe the vendor refuses
project: {project}
budget_ceiling: 5
approval: {{timeout: 1h, policy: escalate}}
stages:
  - {{id: shot, executor: image.keyframe, estimate: 1, retries: 0, input: {{prompt: frame {n}}}}}
"""


async def test_dead_letters_of_one_cause_are_one_group_answered_with_one_command(lf, sim, tmp_path):
    """Three tasks fail the same way: one group, 100% of the project's open dead letters, with the action
    that answers them all; one command resumes each with a signed decision."""
    await sim.configure(executors={"image.keyframe": {"reject_content": 1.0}})
    project = f"dlq-{uuid.uuid4().hex[:8]}"
    handles = []
    for n in range(3):
        plan = lf.plan(REFUSED.format(project=project, n=n))
        handles.append(await lf.start(plan))
        await wait_open(lf, plan.task_id, "dead_letter:")
    code, out, _ = await cli(lf, tmp_path, "dlq", "--project", project, "--groups", "--json")
    assert code == 0
    [group] = json.loads(out)
    assert (group["count"], group["share"]) == (3, "100%")
    assert group["cause"] == "content: input violates content policy", group["cause"]
    await sim.configure()  # the vendor takes the next attempts
    code, out, err = await cli(
        lf,
        tmp_path,
        "dlq",
        "--project",
        project,
        "--resume-group",
        "1",
        "--as",
        "director",
        "--note",
        "try again",
    )
    assert code == 0, err
    assert out.count("accepted (resume by director)") == 3, out
    for handle in handles:
        assert (await handle.result()).state == "Completed"
    code, out, _ = await cli(lf, tmp_path, "dlq", "--project", project, "--groups", "--json")
    assert json.loads(out) == [], "no open dead letter left"
