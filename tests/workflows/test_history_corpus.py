"""Every recorded history in tests/histories replays on today's workflow code (no server needed)."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workflows.task import TaskWorkflow

CORPUS = Path(__file__).resolve().parents[1] / "histories"
# The paths the corpus must cover: deleting a recording is a failure, not a smaller corpus.
REQUIRED = {
    "test_e001_video_pipeline_completes_with_ledger_equal_to_vendor",  # E001, gates, fan-outs, compose
    "test_course_lesson_pipeline_completes",  # the course plan
    "test_quality_rework_reruns_the_flagged_shots_and_their_lineage_in_one_round",  # a rework round
    "test_approve_is_recorded_once_then_acted_on",  # a person's signed approval
}
FILES = sorted(CORPUS.glob("*/*.json.gz"))


def test_the_corpus_covers_every_required_path() -> None:
    recorded = {f.name.removesuffix(".json.gz") for f in FILES}
    assert not REQUIRED - recorded, f"missing recordings: {sorted(REQUIRED - recorded)}"


@pytest.mark.parametrize(
    "path", FILES, ids=[f"{f.parent.name}/{f.name.removesuffix('.json.gz')}" for f in FILES]
)
async def test_a_recorded_history_replays(path: Path) -> None:
    with gzip.open(path, "rt") as f:
        history = WorkflowHistory.from_json(f"ledgerflow-{path.name}", f.read())
    replayer = Replayer(workflows=[TaskWorkflow], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(history)  # raises on any nondeterminism
