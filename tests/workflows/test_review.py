"""Gates, review and rollback end to end: each verdict path on real servers, the simulator as the model."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from decimal import Decimal
from typing import Any

import httpx
import pytest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment
from temporalio.worker import Replayer

from activities.contracts import StageInput
from activities.llm import ChatClient
from activities.review import ReviewActivities
from artifacts import LocalStore
from ledgerflow.views.versions import evals, show_at
from rules.events import parse
from rules.plan import REVIEW
from rules.projection import fold
from rules.recompute import recompute
from workflows.task import TaskWorkflow

PIPELINE = """
goal: three shots and an edit
budget_ceiling: 40
rework_limit: {limit}
stages:
  - {{id: script, executor: llm.text, estimate: 0.10}}
  - {{id: shots, executor: image.keyframe, estimate: 0.40, depends_on: [script], fan_out: 3, canary: false}}
  - {{id: edit, executor: edit.assembly, estimate: 0.20, depends_on: [shots]}}
"""
REWORK_S02 = json.dumps(
    {"scores": {"visual": 0.4}, "blame": {"visual": ["shots/S02"]}, "reasons": ["S02 off"]}
)
REWORK_S01_S03 = json.dumps(
    {"scores": {"visual": 0.4}, "blame": {"visual": ["shots/S03", "shots/S01"]}, "reasons": ["off model"]}
)
PASS = json.dumps({"scores": {"visual": 0.9}, "blame": {}, "reasons": []})


def blame(node: str) -> str:
    """A judgement asking for rework of ``node``."""
    return json.dumps({"scores": {"visual": 0.4}, "blame": {"visual": [node]}, "reasons": [f"{node} off"]})


def dispatches(lf, task_id):
    return [
        parse(e).action
        for e in lf.recorder.read_events(task_id)
        if e.type == "Intent" and e.payload["action"]["kind"] == "Dispatch"
    ]


async def test_soft_warning_completes_with_its_verdict(lf, sim):
    await sim.configure(chat_default=json.dumps({"scores": {"clarity": 0.7}, "blame": {}, "reasons": []}))
    result = await lf.run(lf.plan(PIPELINE.format(limit=2)))
    assert result.state == "Completed" and result.summary["verdict"] == "SoftWarning"


async def test_quality_rework_reruns_the_flagged_shots_and_their_lineage_in_one_round(lf, sim):
    # The model blames shots S01 and S03 until it sees S03's second version, then passes.
    await sim.configure(
        chat_default=REWORK_S01_S03, chat_script=[{"match": '"shots/S03": 2', "content": PASS}]
    )
    plan = lf.plan(PIPELINE.format(limit=2))
    handle = await lf.start(plan)
    result = await handle.result()
    assert result.state == "Completed" and result.summary["verdict"] == "Pass"
    replayer = Replayer(workflows=[TaskWorkflow], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(await handle.fetch_history())  # the rework path replays deterministically
    p = fold(lf.recorder.read_events(plan.task_id))
    assert p.rework_rounds == 1
    assert recompute(lf.recorder.read_events(plan.task_id)) == []  # the rollback and the reruns too
    rollbacks = [parse(e) for e in lf.recorder.read_events(plan.task_id) if e.type == "Rollback"]
    assert len(rollbacks) == 1, "both issues of the review are merged into one round"
    assert rollbacks[0].targets == ("shots/S01", "shots/S03")
    assert set(rollbacks[0].invalidated) == {"shots/S01", "shots/S03", "edit", "compose", "review"}
    attempts = {n: v.attempts for n, v in p.nodes.items()}
    assert attempts == {
        "script": 1,  # their common ancestor was not flagged: it is not redone
        "shots/S01": 2,
        "shots/S02": 1,  # a sibling nobody flagged is kept
        "shots/S03": 2,
        "edit": 2,
        "compose": 2,
        "review": 2,
    }
    for shot in ("shots/S01", "shots/S03"):
        first, rerun = [d for d in dispatches(lf, plan.task_id) if d.node == shot]
        assert "feedback" not in first.input
        findings = rerun.input["feedback"]["review_findings"]
        assert "content.visual: score 0.40" in findings  # findings go with it …
        assert "content.reasons: off model" in findings  # … and what the model said was wrong
        assert rerun.input != first.input, "a rework never resends an unchanged request"
    charged = {n: len(await sim.charges(f"{plan.task_id}:{n}")) for n in ("script", "shots/S02")}
    assert charged == {"script": 1, "shots/S02": 1}


async def test_a_rework_verdict_that_blames_no_part_reruns_the_review_with_what_it_said_before(lf, sim):
    no_blame = json.dumps({"scores": {"visual": 0.4}, "blame": {}, "reasons": ["something is off"]})
    await sim.configure(chat_default=no_blame, chat_script=[{"match": "previous_findings", "content": PASS}])
    plan = lf.plan(PIPELINE.format(limit=2))
    result = await lf.run(plan)
    assert result.state == "Completed" and result.summary["verdict"] == "Pass"
    [rollback] = [parse(e) for e in lf.recorder.read_events(plan.task_id) if e.type == "Rollback"]
    assert rollback.targets == ("review",) and rollback.invalidated == ("review",)
    p = fold(lf.recorder.read_events(plan.task_id))
    assert p.nodes["review"].attempts == 2 and p.nodes["shots/S01"].attempts == 1, "only the review reran"


async def test_a_plan_reviewed_by_rules_alone_never_asks_the_model(lf, sim):
    await sim.configure(chat_default=REWORK_S02)  # would ask for rework, if it were asked
    before = (await sim.http.get("/chat/stats")).json()["calls"]
    plan = lf.plan(PIPELINE.format(limit=2) + "review: {reviewers: [compliance.rules]}\n")
    result = await lf.run(plan)
    assert result.state == "Completed" and result.summary["verdict"] == "Pass"
    assert (await sim.http.get("/chat/stats")).json()["calls"] == before
    [review] = [parse(e) for e in lf.recorder.read_events(plan.task_id) if e.type == "ExecutionResult"]
    assert review.actual_cost == 0 and review.scores == {}


async def test_rework_limit_escalates_instead_of_a_second_round(lf, sim):
    await sim.configure(chat_default=REWORK_S02)  # never satisfied
    plan = lf.plan(PIPELINE.format(limit=1))
    handle = await lf.start(plan)
    status = await lf.wait_state(handle, {"Escalated"})
    assert "rework limit of 1" in status["escalation_reason"]
    assert fold(lf.recorder.read_events(plan.task_id)).rework_rounds == 1
    await handle.terminate("test over")


async def test_compliance_block_fails_the_task_with_no_rollback_and_no_rework(lf, sim):
    plan = lf.plan(
        PIPELINE.format(limit=2).replace("{id: edit,", "{id: edit, input: {note: '[banned] logo'},")
    )
    result = await lf.run(plan)
    assert result.state == "Failed"
    assert (
        result.summary["verdict"] == "ComplianceBlock"
        and "compliance block" in result.summary["terminal_reason"]
    )
    types = [e.type for e in lf.recorder.read_events(plan.task_id)]
    assert "Rollback" not in types and fold(lf.recorder.read_events(plan.task_id)).rework_rounds == 0


async def test_failed_static_gate_terminates_before_the_expensive_node_spends_anything(lf, sim):
    plan = lf.plan(
        PIPELINE.format(limit=2).replace(
            "{id: edit, executor: edit.assembly,",
            "{id: edit, executor: edit.assembly, gate: true, input: {music: unlicensed},",
        )
    )
    result = await lf.run(plan)
    assert result.state == "Failed" and "compliance gate failed: edit" in result.summary["terminal_reason"]
    assert "edit" not in {d.node for d in dispatches(lf, plan.task_id)}
    assert await sim.charges(f"{plan.task_id}:edit") == []
    assert "Rollback" not in [e.type for e in lf.recorder.read_events(plan.task_id)]


async def test_the_gate_checks_each_input_version_once_and_a_new_version_again(lf, sim):
    await sim.configure(
        chat_default=blame("edit"),  # round 1 redoes edit itself: its input version is unchanged
        chat_script=[
            {"match": '"shots/S02": 2', "content": PASS},
            {"match": '"edit": 2', "content": blame("shots/S02")},  # round 2: a new version of an input
        ],
    )
    plan = lf.plan(PIPELINE.format(limit=2).replace("{id: edit,", "{id: edit, gate: true,"))
    result = await lf.run(plan)
    assert result.state == "Completed"
    events = lf.recorder.read_events(plan.task_id)
    gates = [parse(e) for e in events if e.type == "ExecutionResult" and e.payload["kind"] == "gate"]
    assert fold(events).nodes["edit"].attempts == 3
    assert len(gates) == 2 and all(g.passed for g in gates), "three runs of edit, two input versions"
    assert gates[0].input_version < gates[1].input_version
    s02 = [e.seq for e in events if e.type == "Outcome" and e.payload["node"] == "shots/S02"]
    assert gates[1].input_version == s02[-1], "anchored to the registration of the new version"


async def test_a_failed_canary_stops_the_fan_out(lf, sim):
    await sim.configure(executors={"image.keyframe": {"reject_content": 1.0}})
    plan = lf.plan(PIPELINE.format(limit=2).replace(", canary: false", ""))
    handle = await lf.start(plan)
    status = await lf.wait_state(handle, {"WaitingHuman"})
    assert [r["id"] for r in status["open_requests"]] == ["dead_letter:shots/S01:a1"]
    assert [d.node for d in dispatches(lf, plan.task_id)] == ["script", "shots/S01"]  # S02, S03 never sent
    await handle.terminate("test over")


async def test_evals_list_scores_per_version_and_flag_a_regression(lf, sim):
    first = json.dumps({"scores": {"visual": 0.4, "story": 0.9}, "blame": {"visual": ["shots/S02"]}})
    second = json.dumps({"scores": {"visual": 0.9, "story": 0.7}, "blame": {}})  # the fix cost the story
    await sim.configure(chat_default=first, chat_script=[{"match": '"shots/S02": 2', "content": second}])
    plan = lf.plan(PIPELINE.format(limit=2))
    result = await lf.run(plan)
    assert result.state == "Completed" and result.summary["verdict"] == "SoftWarning"
    rows = evals(lf.settings, plan.task_id, threshold=0.1)
    assert [(r.version, r.verdict, r.scores) for r in rows] == [
        (1, "QualityRework", {"visual": 0.4, "story": 0.9}),
        (2, "SoftWarning", {"visual": 0.9, "story": 0.7}),
    ]
    assert rows[0].regressions == {} and rows[1].regressions == {"story": (0.9, 0.7)}
    then = show_at(lf.settings, plan.task_id, rows[0].seq)  # time travel: the state the first verdict left
    assert then["verdict"] == "QualityRework" and then["nodes"]["shots/S02"]["status"] == "succeeded"


async def chat_calls(sim) -> int:
    return (await sim.http.get("/chat/stats")).json()["calls"]


async def test_a_model_slower_than_the_heartbeat_timeout_is_asked_once(lf, sim):
    # The review heartbeats while it waits on the model: its attempt is not timed out and retried (and paid)
    # over and over; the one judgement asked for is the one recorded.
    await sim.configure(chat_default=PASS, chat_latency_seconds=2.5)
    plan = lf.plan(PIPELINE.format(limit=2))
    assert plan.task_id is not None
    before = await chat_calls(sim)
    handle = await lf.start(plan, heartbeat_timeout_seconds=1.0)
    try:
        result = await asyncio.wait_for(handle.result(), 30)
    except TimeoutError:
        await handle.terminate("test over")
        pytest.fail("the review never finished: its attempts kept timing out while the model answered")
    assert result.state == "Completed" and result.summary["verdict"] == "Pass"
    assert await chat_calls(sim) - before == 1


async def test_a_review_retried_after_its_paid_judgement_reuses_it(lf, sim, simulator_url, sim_key, tmp_path):
    # The review's judgement rides in its heartbeat details: an attempt that paid for it but died before the
    # verdict was recorded leaves it to the next attempt, which does not ask (or pay) again.
    await sim.configure(chat_error_status=503)  # the review cannot be judged: it stays in flight
    plan = lf.plan(PIPELINE.format(limit=2))
    handle = await lf.start(plan)
    await asyncio.wait_for(_until_dispatched(lf, plan.task_id, REVIEW), 30)
    await handle.terminate("the run is gone; its review operation is still open")
    await asyncio.sleep(0.5)  # an attempt in progress ends (503); a terminated run gets no retry
    [review] = [d for d in dispatches(lf, plan.task_id) if d.node == REVIEW]
    inp = StageInput(
        task_id=plan.task_id,
        node=REVIEW,
        operation_key=review.operation_key,
        attempt=review.attempt,
        epoch=lf.recorder.current_epoch(plan.task_id),
        executor=review.executor,
        estimate=review.estimate,
        input=review.input,
    )
    async with httpx.AsyncClient(timeout=10) as http:
        chat = ChatClient(http, simulator_url, sim_key, "sim-reviewer-1", Decimal("0.002"))
        activities = ReviewActivities(lf.recorder, LocalStore(lf.settings.artifact_dir), chat)

        await sim.configure(chat_default=REWORK_S02)
        paid = ActivityEnvironment()
        beats: list[object] = []
        paid.on_heartbeat = lambda *details: beats.extend(details)
        # The attempt pays for the judgement, then cannot record its verdict (here: it settles more than was
        # reserved, which the ledger refuses; in life: the worker died).
        broken = inp.model_copy(update={"estimate": inp.estimate + 1000})
        with pytest.raises(ApplicationError, match="exceeds its reservation") as refused:
            await paid.run(activities.review, broken)
        assert refused.value.type == "LedgerError" and refused.value.non_retryable
        assert beats and lf.recorder.find_by_dedup_key(f"{inp.operation_key}:result") is None

        await sim.configure(chat_error_status=500)  # the model is gone: only the kept judgement can serve
        before = await chat_calls(sim)
        retry = ActivityEnvironment()
        retry.info = dataclasses.replace(retry.info, heartbeat_details=[beats[-1]])
        stored = await retry.run(activities.review, inp)
    verdict = parse(stored)
    assert verdict.verdict == "QualityRework" and verdict.flagged == ("shots/S02",)
    assert verdict.actual_cost == Decimal(str(beats[-1]["cost"])) > 0  # the one judgement paid for
    assert await chat_calls(sim) == before


@pytest.mark.parametrize("status", [401, 429])
async def test_a_model_call_the_api_refused_is_never_booked_as_a_possible_charge(lf, sim, status):
    """Old: each retry after the model API refused the call (a rotated key, a rate limit) booked the refused
    call as possibly billed: a late charge at the review's estimate for a call that cost nothing."""
    await sim.configure(chat_error_status=status)
    plan = lf.plan(PIPELINE.format(limit=2))
    handle = await lf.start(plan)

    def review_markers(kind: str) -> list[Any]:
        return [
            m
            for m in (parse(e) for e in lf.recorder.read_events(plan.task_id) if e.type == "SystemMarker")
            if m.node == REVIEW and m.kind == kind
        ]

    async def refused_twice() -> None:
        while len(review_markers("submitting")) < 2:
            await asyncio.sleep(0.1)

    await asyncio.wait_for(refused_twice(), 60)
    await sim.configure(chat_default=PASS)  # the key is fixed / the limit lifted
    result = await asyncio.wait_for(handle.result(), 60)
    assert result.state == "Completed"
    assert review_markers("late_charge") == [], "a refused call cost nothing"
    assert len(review_markers("refused")) >= 1, "each refused call is recorded as refused"


async def _until_dispatched(lf, task_id: str, node: str) -> None:
    while not [d for d in dispatches(lf, task_id) if d.node == node]:
        await asyncio.sleep(0.1)
