"""The task tells its story in the Temporal UI and CLI: search attributes (project, episode, state, spent,
verdict, waiting on a person) upserted when the state, the verdict or the wait changes, not per node or
stage; the goal in the memo; each activity named by its node and attempt; progress in the current details."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from typing import Any

from peoplekit import wait_open
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from ledgerflow.views import people
from runtime.signing import demo_key
from workflows.contracts import workflow_id


async def listed(client: Client, query: str, timeout: float = 15.0) -> list[str]:
    """The workflow ids a visibility query finds, once it finds any (visibility is eventually consistent)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [w.id async for w in client.list_workflows(query)]
        if found or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.2)


async def test_a_task_is_found_by_its_search_attributes_and_its_activities_are_named(lf, sim):
    project = f"ui{uuid.uuid4().hex[:8]}"
    plan = lf.plan(
        f"""
goal: twelve shots after a board a person approves
project: {project}
episode: e7
budget_ceiling: 20
stages:
  - {{id: board, executor: llm.text, estimate: 1, approval: true}}
  - {{id: shots, executor: image.keyframe, estimate: 1, depends_on: [board], fan_out: 12}}
"""
    )
    handle = await lf.start(plan)
    tid = plan.task_id
    rid = await wait_open(lf, tid, "approval:board")
    waiting = f'LedgerflowProject="{project}" AND LedgerflowWaitingOnPerson=true'
    assert await listed(lf.client, waiting) == [workflow_id(tid)]
    described = await handle.describe()
    memo: dict[str, Any] = await described.memo()
    assert memo == {"goal": "twelve shots after a board a person approves", "project": project}
    sent = await people.decide(lf.settings, demo_key("director"), tid, rid, "approve")
    assert sent.status == "accepted"
    assert (await handle.result()).state == "Completed"
    done = f'LedgerflowProject="{project}" AND LedgerflowTaskState="Completed" AND LedgerflowVerdict="Pass"'
    assert await listed(lf.client, done) == [workflow_id(tid)]
    assert await listed(lf.client, waiting, timeout=0) == []
    attrs = (await handle.describe()).typed_search_attributes
    values = {pair.key.name: pair.value for pair in attrs}
    assert values["LedgerflowEpisode"] == "e7" and values["LedgerflowWaitingOnPerson"] is False
    assert values["LedgerflowSpent"] > 0

    history = await handle.fetch_history()
    upserted = [
        e
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES
        and "LedgerflowTaskState"
        in e.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
    ]
    ours = [
        e.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
        for e in upserted
    ]
    # The memo and the search attributes as they stand before the run did anything came with the start
    # event (``starting_story``): no event of their own; and no workflow task upserts twice.
    started = history.events[0].workflow_execution_started_event_attributes.search_attributes.indexed_fields
    assert (await lf.client.data_converter.decode([started["LedgerflowTaskState"]]))[0] == "Queued"
    modified = [
        e for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_PROPERTIES_MODIFIED
    ]
    assert modified == [], "the memo was upserted though the run started with it"
    tasks = [
        e.upsert_workflow_search_attributes_event_attributes.workflow_task_completed_event_id
        for e in upserted
    ]
    assert len(set(tasks)) == len(tasks), "two upserts in one workflow task"
    scheduled = [e for e in history.events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]
    summaries = set()
    for e in scheduled:
        payload = e.user_metadata.summary
        summaries.add((await lf.client.data_converter.decode([payload]))[0] if payload.data else None)
    assert {"board a1", "shots/S01 a1", "shots/S12 a1", "review a1"} <= summaries, summaries
    # Only when what a search finds by changes (state, verdict, waiting on a person), never per node or per
    # stage: 15 nodes in 4 stages, and no two upserts in a row say the same (the spend, at most once a
    # minute, does not change in this short task's life but at its end, with its state).
    told = []
    for fields in ours:
        said = [
            (await lf.client.data_converter.decode([fields[name]]))[0]
            for name in ("LedgerflowTaskState", "LedgerflowVerdict", "LedgerflowWaitingOnPerson")
        ]
        told.append(tuple(said))
    states = [state for state, _, _ in told]
    assert states[0] != "Queued" and states[-1] == "Completed" and "WaitingHuman" in states, states
    assert all(a != b for a, b in itertools.pairwise(told)), told
