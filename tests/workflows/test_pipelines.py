"""Real pipelines: each stage's outputs reach the next, input hashes decide what is redone, real files.

E001 end to end on the real servers: keyframes (PNG) → motion shots (H.264 MP4) that carry their lineage →
compose assembling the 19 shots and the final audio into one playable MP4; a rework that pays only for the
lineage of what the review blamed; the course plan's examples really run; artifacts in an S3 store.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from artifacts import open_store
from artifacts.local import path_of
from media import lineage_of, probe
from rules.events import parse
from rules.inputs import input_hash
from rules.projection import fold

ROOT = Path(__file__).resolve().parents[2]
E001 = (ROOT / "examples" / "e001_video.yaml").read_text()


def dispatches(lf: Any, task_id: str) -> list[Any]:
    return [
        parse(e).action
        for e in lf.recorder.read_events(task_id)
        if e.type == "Intent" and e.payload["action"]["kind"] == "Dispatch"
    ]


async def test_e001_shots_are_made_from_their_own_keyframe_and_compose_assembles_a_real_episode(lf, sim):
    plan = lf.plan(E001)
    result = await lf.run(plan)

    assert result.state == "Completed", result.summary
    p = fold(lf.recorder.read_events(plan.task_id))
    keyframe = p.nodes["keyframes/S07"].artifact
    [shot] = [d for d in dispatches(lf, plan.task_id) if d.node == "motion/S07"]
    # The request carries keyframe S07 (by reference), and its input hash is made from its bytes' hash.
    assert shot.input["inputs"]["keyframe"]["sha256"] == keyframe["sha256"]
    assert shot.input["inputs"]["keyframe"]["node"] == "keyframes/S07"
    motion = plan.stage("motion")
    bounds = motion.output.model_dump(mode="json") if motion.output else None

    def hashed(request: dict) -> str:
        return input_hash(request, node="motion/S07", executor=motion.executor, output=bounds)

    assert shot.input_hash == hashed(shot.input)
    swapped = {**shot.input, "inputs": {"keyframe": {**shot.input["inputs"]["keyframe"], "sha256": "0" * 64}}}
    assert hashed(swapped) != shot.input_hash, "another keyframe would be another request"
    # The file itself says what it was made from: its lineage names the keyframe's bytes.
    made = probe(path_of(p.nodes["motion/S07"].artifact["uri"]))
    assert (made.codec, made.width, made.height, made.frames) == ("h264", 320, 180, 48)
    assert lineage_of(made)["inputs"] == [keyframe["sha256"]]
    # compose really assembled the episode: 19 shots of 4 s and the final audio, one playable file.
    episode = probe(path_of(p.nodes["compose"].artifact["uri"]))
    assert episode.format == "mp4" and episode.audio
    assert episode.frames == 19 * 48 and abs(episode.duration_s - 76.0) <= 1 / 12
    assert lineage_of(episode)["shots"] == [
        p.nodes[f"motion/S{i:02d}"].artifact["sha256"] for i in range(1, 20)
    ]


async def test_a_rework_of_one_keyframe_pays_only_for_its_lineage_and_reuses_every_other_shot(lf, sim):
    """The review blames keyframes/S07. The round invalidates it and everything built on it — keyframe_qc and,
    through it, all 19 motion shots — but only motion/S07's input really changed: the other 18 shots are
    reused by input hash (nothing sent), and the simulator bills exactly S07's lineage."""
    blame = (
        '{"scores": {"continuity": 0.4}, "blame": {"continuity": ["keyframes/S07"]},'
        ' "reasons": ["S07: the jacket is the wrong colour"]}'
    )
    await sim.configure(
        chat_script=[{"match": '"keyframes/S07": 1', "content": blame}],
        chat_default='{"scores": {"continuity": 0.9}, "blame": {}, "reasons": []}',
    )
    plan = lf.plan(E001)
    result = await lf.run(plan)

    assert result.state == "Completed" and result.summary["rework_rounds"] == 1, result.summary
    events = lf.recorder.read_events(plan.task_id)
    [rollback] = [e for e in events if e.type == "Rollback"]
    after = [e for e in events if e.seq > rollback.seq]
    charged_ops = {c["idempotency_key"] for c in await sim.charges(f"{plan.task_id}:")}
    # Every operation the vendor billed after the rollback, whatever became of it (Outcome or Failure).
    rerun = {parse(e).action.node for e in after if e.type == "Intent" and e.operation_key in charged_ops}
    lineage = {"keyframes/S07", "keyframe_qc", "motion/S07", "motion_qc", "assembly_edit", "audio_final"}
    lineage |= {"graphics_final", "picture_lock", "mix", "subtitle", "color", "release_gate"}
    assert rerun == lineage, f"paid for {sorted(rerun ^ lineage)} outside (or missing from) S07's lineage"
    reused = {parse(e).node for e in after if e.type == "Outcome" and parse(e).reused_from}
    assert reused == {f"motion/S{i:02d}" for i in range(1, 20)} - {"motion/S07"}
    charges = await sim.charges(f"{plan.task_id}:")
    assert len(charges) == len({c["idempotency_key"] for c in charges}), "one charge per operation"


async def test_the_course_lesson_examples_really_run_and_a_broken_one_is_a_content_failure(lf, sim):
    await sim.configure(executors={"llm.text": {"broken_code": 1.0}})
    plan = lf.plan((ROOT / "examples" / "course_lesson.yaml").read_text())
    handle = await lf.start(plan)
    status = await lf.wait_state(handle, {"WaitingHuman"})

    [failure] = [parse(e) for e in lf.recorder.read_events(plan.task_id) if e.type == "Failure"]
    assert failure.node == "validate_code" and failure.kind == "content"
    assert "RecursionError" in failure.error and "example_1.py" in failure.error  # the real traceback
    assert [r["kind"] for r in status["open_requests"]] == ["dead_letter"]


async def test_artifacts_live_in_an_s3_store_and_vendors_fetch_inputs_by_presigned_url(
    lf_with, sim, s3_endpoint, monkeypatch
):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_endpoint.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_endpoint.secret_access_key)
    monkeypatch.setenv("AWS_REGION", s3_endpoint.region)
    prefix = f"s3://{s3_endpoint.bucket}/e2e-{os.getpid()}"
    plan_text = """
goal: two shots from two keyframes
budget_ceiling: 20
stages:
  - id: frames
    executor: image.keyframe
    estimate: 0.4
    fan_out: 2
    input: {format: png, width: 64, height: 36}
  - id: shots
    executor: video.motion
    estimate: 1.2
    fan_out: 2
    depends_on: [frames]
    input: {format: mp4, duration_s: 1, width: 64, height: 36}
"""
    async with lf_with(artifact_store=prefix) as lf:
        plan = lf.plan(plan_text)
        result = await lf.run(plan)
    assert result.state == "Completed", result.summary
    p = fold(lf.recorder.read_events(plan.task_id))
    uris = [p.nodes[n].artifact["uri"] for n in ("frames/S01", "shots/S02")]
    assert all(u.startswith(f"s3://{s3_endpoint.bucket}/") for u in uris)
    # The vendor fetched each shot's keyframe itself (a presigned URL made just before the call, never
    # recorded): the shot's lineage names the keyframe's bytes, and no URL in the record is presigned.
    store = open_store(prefix)
    with store.local_copy(p.nodes["shots/S02"].artifact["uri"]) as path:
        assert lineage_of(probe(path))["inputs"] == [p.nodes["frames/S02"].artifact["sha256"]]
    assert "X-Amz-Signature" not in str([e.payload for e in lf.recorder.read_events(plan.task_id)])
