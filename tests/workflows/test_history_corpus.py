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
    # v2: decisions in batches, fair deadlines, backups, the UI's search attributes (fair-decisions-v1,
    # ui-story-v1)
    "test_a_request_unanswered_by_its_deadline_is_offered_to_the_backups",
    "test_a_deadline_already_past_when_the_loop_comes_to_wait_is_marked_at_once",
    "test_add_budget_raises_the_project_scope_that_refused",
    "test_a_task_is_found_by_its_search_attributes_and_its_activities_are_named",
    # v3: a failed task's compensating phase (compensation-v1), a fan-out under backpressure
    "test_an_aborted_task_unpublishes_what_it_published_before_it_is_failed",
    "test_over_capacity_a_fan_out_widens_one_node_per_finished_node",
    # v4: a decision sent as the decide Update; a person's signed pause and resume (the change Update)
    "test_a_decision_sent_as_an_update_is_answered_with_its_ruling_and_acted_on",
    "test_a_paused_task_dispatches_nothing_new_finishes_what_is_in_flight_and_goes_on_after_resume",
    # v5: every version check answered at the run's start (steady-patches-v1), a decision by Update
    "test_a_node_goes_leased_running_waiting_human_succeeded_and_unrun_nodes_end_cancelled",
    # v6: people skip a fan-out item, waive a rework finding, restore an earlier version (rule table 8)
    "test_a_skipped_item_and_the_clip_only_it_feeds_never_run_and_nothing_is_paid_for_them",
    "test_a_waiver_of_the_blamed_output_answers_the_rework_limit_and_the_task_completes_unredone",
    "test_restoring_an_earlier_version_reuses_what_was_built_on_it_and_pays_nothing_again",
    # v7: a lost output made again at once, recorded before rule table 9 (it replays with table 8: the
    # remake-asks-v1 patch), and made again only once a person approved the cost (table 9)
    "test_a_deleted_input_the_vendor_purged_is_recorded_lost_and_made_again",
    "test_a_deleted_input_the_vendor_purged_is_made_again_only_once_a_person_approves_the_cost",
    # v8: one version marker for three (steady-patches-v2), search attributes at state changes only
    # (ui-states-v1), activities queued by the task's slot priority; a hero task and E001 on it
    "test_activities_carry_their_tasks_place_in_the_queue-2",
    "test_e001_video_pipeline_completes_with_ledger_equal_to_vendor-steady-v2",
    # v9: one version marker for four (steady-patches-v3): the memo and the search attributes in the start
    # event, upserted once per workflow task (a person's approval, a hero task, E001); executors that write
    # their INTENT as the first send's write-ahead
    "test_a_task_is_found_by_its_search_attributes_and_its_activities_are_named-steady-v3",
    "test_activities_carry_their_tasks_place_in_the_queue-steady-v3",
    "test_e001_video_pipeline_completes_with_ledger_equal_to_vendor-steady-v3",
    # v10: admission at the task level (ledger.admission): three tasks under a bound of 1 — the first runs,
    # releases its place and signals the next; the others wait for admission, are woken, run and release
    "test_past_the_bound_tasks_wait_for_a_place_and_run_in_the_order_they_asked-1",
    "test_past_the_bound_tasks_wait_for_a_place_and_run_in_the_order_they_asked-2",
    "test_past_the_bound_tasks_wait_for_a_place_and_run_in_the_order_they_asked-3",
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
