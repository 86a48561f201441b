"""Retention on the real servers (issue 27 §6): an ended task's artifacts leave the store after its project's
period and the ledger records each deletion; a released task's, and an open task's, stay; a second run
deletes nothing more; an expired output is never reused. Real Temporal, Postgres, worker and simulator."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from artifacts import open_store
from artifacts.local import path_of
from ledgerflow.release.build import release
from ledgerflow.retention import expire
from rules.approvers import KeyRecord
from rules.projection import fold
from runtime.signing import generate

PLAN = """
goal: a note ({word})
project: {project}
budget_ceiling: 5
reuse: project
stages:
  - {{id: note, executor: llm.text, estimate: 0.05, input: {{prompt: "A note about {word}."}}}}
"""
WAITING = """
goal: a note a person has not approved yet
project: {project}
budget_ceiling: 5
approval: {{timeout: 1h, policy: escalate}}
stages:
  - {{id: note, executor: llm.text, estimate: 0.05, approval: true, input: {{prompt: "An open note."}}}}
"""


def objects(lf: Any, task_id: str) -> dict[str, Path]:
    """The task's outputs: sha256 -> the file in the store."""
    events = lf.recorder.read_events(task_id)
    if not events:
        return {}
    p = fold(events)
    return {o.artifact["sha256"]: path_of(o.artifact["uri"]) for n in p.nodes.values() for o in n.outputs}


def expired(lf: Any, task_id: str) -> list[str]:
    return [
        e.payload["detail"]
        for e in lf.recorder.read_events(task_id)
        if e.type == "SystemMarker" and e.payload["kind"] == "artifact_expired"
    ]


async def test_an_ended_task_loses_its_artifacts_a_released_or_open_one_keeps_them(lf, sim, tmp_path):
    project = f"ret-{uuid.uuid4().hex[:8]}"
    ended = lf.plan(PLAN.format(project=project, word="tides"))
    kept = lf.plan(PLAN.format(project=project, word="lighthouses"))
    for plan in (ended, kept):
        assert (await lf.run(plan)).state == "Completed"
    waiting = lf.plan(WAITING.format(project=project))
    open_handle = await lf.start(waiting)
    deadline = time.monotonic() + 30
    while not objects(lf, waiting.task_id):
        assert time.monotonic() < deadline, "the open task's note"
        await asyncio.sleep(0.1)
    key = generate("publisher", f"release-{uuid.uuid4().hex[:8]}")
    lf.recorder.add_key(
        KeyRecord(key_id=key.key_id, approver=key.approver, public_key=key.public_key, kinds=("release",)),
        actor="tests",
        reason="a release key",
    )
    await release(lf.settings, lf.recorder, kept.task_id, key, tmp_path / "release")
    before = {t: objects(lf, t) for t in (ended.task_id, kept.task_id, waiting.task_id)}
    assert all(p.is_file() for files in before.values() for p in files.values())

    opened = open_store(lf.settings.store_location())
    found = await asyncio.to_thread(expire, lf.recorder, lambda uri: opened, {project: 0}, datetime.now(UTC))

    gone = before[ended.task_id]
    assert set(found.deleted) == set(gone) and found.missing == [], found
    assert not any(p.exists() for p in gone.values()), "the ended task's artifacts left the store"
    assert sorted(expired(lf, ended.task_id)) == sorted(gone), "each deletion is in the task's ledger"
    for task in (kept.task_id, waiting.task_id):
        assert all(p.is_file() for p in before[task].values()), f"{task}'s artifacts stay"
        assert expired(lf, task) == []
    assert found.kept[next(iter(before[kept.task_id]))] == f"task {kept.task_id} was released"
    assert found.kept[next(iter(before[waiting.task_id]))] == f"task {waiting.task_id} is open"

    again = await asyncio.to_thread(expire, lf.recorder, lambda uri: opened, {project: 0}, datetime.now(UTC))
    assert again.deleted == [] and again.missing == [] and not set(again.due) & set(gone), "nothing more"

    # The same request again in the project (reuse: project): the expired output is never offered.
    redo = lf.plan(PLAN.format(project=project, word="tides"))
    assert (await lf.run(redo)).state == "Completed"
    [note] = fold(lf.recorder.read_events(redo.task_id)).nodes["note"].outputs
    assert note.reused_from is None, "made again, not reused from an artifact the store no longer holds"
    await open_handle.terminate("test over")
