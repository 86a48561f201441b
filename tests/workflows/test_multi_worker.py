"""Several workers, one task: two worker processes' worth of workers (each its own local disk for staging),
sharing the S3-compatible artifact store, complete one task together — every artifact one made, the other can
use, and the episode is assembled from both."""

from __future__ import annotations

import os
import re
import uuid
from contextlib import AsyncExitStack

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from rules.projection import fold
from workflows.contracts import TaskInput, workflow_id
from workflows.task import TaskWorkflow

PLAN = """
goal: six shots from six keyframes, one clip
budget_ceiling: 40
compose: {video: [shots]}
stages:
  - {id: frames, executor: image.keyframe, estimate: 0.4, fan_out: 6, canary: false,
     input: {format: png, width: 64, height: 36}}
  - {id: shots, executor: video.motion, estimate: 1.2, fan_out: 6, canary: false, depends_on: [frames],
     input: {format: mp4, duration_s: 1, width: 64, height: 36}}
"""


async def test_two_workers_with_separate_disks_complete_one_task_through_the_s3_store(
    lf, sim, s3_endpoint, monkeypatch, tmp_path
):
    from worker import build_worker

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_endpoint.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_endpoint.secret_access_key)
    monkeypatch.setenv("AWS_REGION", s3_endpoint.region)
    store = f"s3://{s3_endpoint.bucket}/multi-{os.getpid()}"
    queue = f"q-multi-{uuid.uuid4().hex[:8]}"
    plan = lf.plan(PLAN)
    tid = plan.task_id
    async with AsyncExitStack() as stack:
        workers = []
        for name in ("a", "b"):
            # One client each, as two worker processes would have (a client runs one worker per queue).
            client = await Client.connect(
                str(lf.settings.temporal_address), data_converter=pydantic_data_converter
            )
            settings = lf.settings.model_copy(
                update={
                    "artifact_store": store,
                    "artifact_dir": tmp_path / f"disk-{name}",
                    "task_queue": queue,
                }
            )
            built = await build_worker(client, settings, stack, task_queue=f"{queue}-unused-{name}")
            # At most two activities each, so the fan-outs spread over both workers.
            config = {**built.config(), "task_queue": queue, "identity": f"worker-{name}"}
            config["max_concurrent_activities"] = 2
            workers.append(await stack.enter_async_context(Worker(**config)))
        handle = await lf.client.start_workflow(
            TaskWorkflow.run, TaskInput(task_id=tid, plan=plan), id=workflow_id(tid), task_queue=queue
        )
        result = await handle.result()
    assert result.state == "Completed", result.summary
    history = await handle.fetch_history()
    started = [
        e.activity_task_started_event_attributes.identity
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
    ]
    assert {"worker-a", "worker-b"} <= set(started), started
    p = fold(lf.recorder.read_events(tid))
    composed = p.nodes["compose"].artifact
    assert composed is not None and composed["uri"].startswith(f"s3://{s3_endpoint.bucket}/")
    assert composed["media"]["duration_s"] == 6.0  # all six shots, wherever each was made
    # Neither worker's disk holds a published artifact: each only staged its own uploads there.
    for name in ("a", "b"):
        # the local store publishes a file under its sha256 (hex) as its name
        disk = (tmp_path / f"disk-{name}").rglob("*")
        published = [f for f in disk if f.is_file() and re.fullmatch(r"[0-9a-f]{64}", f.name)]
        assert published == [], published
