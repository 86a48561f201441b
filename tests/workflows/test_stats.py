"""``ledgerflow stats`` on real servers: the production SLOs (docs/design.md#production-slos) from the ledger,
over one project's tasks — one that completes with real media, one sent back for rework once, one a person
aborts."""

from __future__ import annotations

import json
import uuid
from decimal import Decimal

from peoplekit import cli, wait_open

from ledgerflow.views import people, stats
from reconcile.takeover import task_histories
from rules.projection import fold
from runtime.signing import demo_key

CLIP = """
goal: a two-shot clip
project: {project}
budget_ceiling: 20
compose: {{video: [clip]}}
stages:
  - {{id: art, executor: image.keyframe, estimate: 1}}
  - {{id: clip, executor: video.motion, estimate: 0.5, fan_out: 2, canary: false, depends_on: [art],
      input: {{format: mp4, duration_s: 1, width: 64, height: 36}}}}
"""
APPROVAL = """
goal: a board a person approves
project: {project}
budget_ceiling: 10
stages:
  - {{id: board, executor: llm.text, estimate: 1, approval: true}}
"""
REWORK = json.dumps({"scores": {"visual": 0.4}, "blame": {"visual": ["art"]}, "reasons": ["off"]})
PASS = json.dumps({"scores": {"visual": 0.9}, "blame": {}, "reasons": []})


async def test_stats_give_the_slos_of_a_projects_tasks(lf, sim, tmp_path):
    project = f"slo{uuid.uuid4().hex[:8]}"
    # The first review of the reworked task blames `art` (version 1); every other review passes.
    script = [{"match": '"art": 2', "content": PASS}, {"match": "rework-me", "content": REWORK}]
    await sim.configure(chat_default=PASS, chat_script=script)
    clean = lf.plan(CLIP.format(project=project))
    reworked = lf.plan(CLIP.format(project=project).replace("a two-shot clip", "a clip to rework-me"))
    aborted = lf.plan(APPROVAL.format(project=project))
    assert (await lf.run(clean)).state == "Completed"
    assert (await lf.run(reworked)).state == "Completed"
    handle = await lf.start(aborted)
    rid = await wait_open(lf, aborted.task_id, "approval:board")
    assert (await people.decide(lf.settings, demo_key("director"), aborted.task_id, rid, "abort")).status == (
        "accepted"
    )
    assert (await handle.result()).state == "Failed"

    figures = stats.compute(task_histories(lf.recorder), project=project).as_json()
    assert figures["tasks"] == 3
    assert figures["task_success_rate"] == round(2 / 3, 4)
    assert figures["first_pass_rate"] == 0.5  # the clean task passed first time, the reworked one did not
    # Retries: counted independently from the ledger — every dispatch of a node after its first.
    dispatches = [
        e.payload["action"]["node"]
        for t in (clean, reworked, aborted)
        for e in lf.recorder.read_events(t.task_id)
        if e.type == "Intent" and e.payload["action"]["kind"] == "Dispatch"
    ]
    retries = _retries(lf, (clean, reworked, aborted))
    assert retries > 0 and figures["retry_rate"] == round(retries / len(dispatches), 4)
    # Cost per usable second: what the completed tasks spent over the seconds of their compositions (2 × 1 s).
    spent = sum(fold(lf.recorder.read_events(t.task_id)).spent for t in (clean, reworked))
    assert figures["cost_per_usable_second"] == str((spent / Decimal(4)).quantize(Decimal("0.000001")))
    assert figures["human_wait_s"]["n"] == 1 and figures["human_wait_s"]["p50"] > 0
    assert figures["invalidation_propagation_s"]["n"] == 1
    assert figures["queue_duration_s"]["n"] == 3

    rc, out, _ = await cli(lf, tmp_path, "stats", "--project", project, "--json")
    assert rc == 0 and json.loads(out) == figures
    rc, _, err = await cli(lf, tmp_path, "stats", "--since", "yesterday")
    assert (rc, err.strip()) == (
        2,
        "error: --since 'yesterday' is not a duration like 24h or an ISO 8601 time",
    )


def _retries(lf, plans) -> int:
    """Dispatches of a node after its first, per task."""
    n = 0
    for t in plans:
        seen: set[str] = set()
        for e in lf.recorder.read_events(t.task_id):
            if e.type == "Intent" and e.payload["action"]["kind"] == "Dispatch":
                node = e.payload["action"]["node"]
                n += node in seen
                seen.add(node)
    return n
