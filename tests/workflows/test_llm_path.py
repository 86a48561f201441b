"""The LLM only where the rules are silent: real model calls (the simulator's chat API, HTTP), real ledger.

``llm.decide`` runs in Temporal's ActivityEnvironment; what it proposes must pass ``check_llm_action`` (same
path as R11: ready node, static gate, cost admission) or it becomes a question to a person, never an action.
The Decision it records carries that action (or why there is none).

The workflow tests need a task on which no rule matches and nothing is pending. A fresh task never gets
there under today's rule table (every failure, request and verdict the executors and people can record has a
rule); the state the rule tests use for it is a review result that carries no verdict
(``tests/unit/test_rules.py``). ``seed_open_question`` writes that history through the recorder's own write
paths, as an earlier run would have, and the workflow takes the task over from the ledger.
"""

from __future__ import annotations

import json
import uuid
from decimal import Decimal

import httpx
import pytest
from temporalio.client import WorkflowExecutionStatus
from temporalio.testing import ActivityEnvironment

from activities.contracts import LlmDecideInput
from activities.llm import ChatClient, LlmActivities
from rules.actions import Dispatch, Escalate, SuspendForHuman
from rules.events import ArtifactRef, ExecutionResult, Intent, Outcome, TaskCreated, parse, to_new
from rules.llm import ALLOWED_LLM_ACTIONS, check_llm_action
from rules.plan import REVIEW, Plan, budget_scopes, load_plan
from rules.projection import fold, summary
from rules.table import decide
from vendors.routes import DEFAULT_ROUTES

PLAN = """
goal: one node the rules leave to the planner
budget_ceiling: {ceiling}
review: {{estimate: 0}}
stages:
  - {{id: a, executor: llm.text, estimate: 1.00}}
"""


def open_task(recorder, ceiling: str = "5"):
    task_id = f"llm-{uuid.uuid4().hex[:12]}"
    plan = load_plan(PLAN.format(ceiling=ceiling), DEFAULT_ROUTES, task_id=task_id)
    epoch = recorder.take_lease(task_id, "test")
    recorder.open_budget(task_id, budget_scopes(plan, task_id))
    recorder.append_fenced(task_id, epoch, [to_new(TaskCreated(plan=plan), dedup_key=f"{task_id}:created")])
    return task_id


async def ask(recorder, simulator_url: str, sim_key: str, task_id: str):
    async with httpx.AsyncClient(timeout=10) as http:
        chat = ChatClient(http, simulator_url, sim_key, "sim-planner-1", Decimal("0.002"))
        p = fold(recorder.read_events(task_id))
        inp = LlmDecideInput(
            task_id=task_id,
            watermark=p.watermark,
            summary=summary(p),
            allowed=ALLOWED_LLM_ACTIONS,
            decided_at=p.created_at,
        )
        proposal = await ActivityEnvironment().run(LlmActivities(recorder, chat).decide, inp)
    p = fold(recorder.read_events(task_id))
    return proposal, p


def recorded_decision(recorder, task_id: str):
    return next(parse(e) for e in recorder.read_events(task_id) if e.type == "Decision")


async def test_a_valid_proposal_becomes_the_same_dispatch_the_rules_would_make(
    recorder, sim, simulator_url, sim_key
):
    await sim.configure(chat_default=json.dumps({"action": "dispatch", "node": "a", "reason": "start here"}))
    task_id = open_task(recorder)
    proposal, p = await ask(recorder, simulator_url, sim_key, task_id)
    problem, action = check_llm_action(p, proposal, p.created_at)
    assert problem is None and isinstance(action, Dispatch)
    assert (action.node, action.operation_key, action.estimate) == ("a", f"{task_id}:a:a1", Decimal("1.00"))
    decision = recorded_decision(recorder, task_id)
    assert decision.valid and decision.tokens_in > 0 and decision.cost > 0 and len(decision.prompt_hash) == 64
    assert decision.action == action and decision.error is None  # the validated action, as the loop takes it
    assert decision.proposal == {"action": "dispatch", "node": "a", "reason": "start here"}
    assert p.spent == decision.cost == recorder.account(f"task:{task_id}").spent  # inference is spent


@pytest.mark.parametrize(
    ("output", "why"),
    [
        ('{"action": "dispatch", "node": "a"', "not valid JSON"),  # truncated
        ('["dispatch", "a"]', "not a JSON object"),
        ('{"action": "dispatch", "node": 7}', "node"),  # wrong type
        ('{"action": "dispatch", "node": "a", "budget": 1e9}', "budget"),  # an extra field
        (json.dumps({"action": "dispatch", "node": "a", "reason": "x" * 5000}), "reason"),  # huge string
        (json.dumps({"action": "approve_all_and_skip_review", "node": "a"}), "action"),  # instructions
        (json.dumps({"action": "dispatch", "node": "review"}), "not ready"),  # a node that is not ready
    ],
    ids=["truncated", "array", "wrong-type", "extra-field", "huge", "instructions", "not-ready"],
)
async def test_malformed_output_never_becomes_an_action(recorder, sim, simulator_url, sim_key, output, why):
    await sim.configure(chat_default=output)
    task_id = open_task(recorder)
    proposal, p = await ask(recorder, simulator_url, sim_key, task_id)
    problem, action = check_llm_action(p, proposal, p.created_at)
    assert action is None and problem is not None
    decision = recorded_decision(recorder, task_id)
    assert decision.raw_output == output[:20000]  # recorded as it came, for the audit
    assert not decision.valid and decision.action is None
    assert why in (decision.error or "") + problem, (decision.error, problem)


async def test_an_over_budget_proposal_is_refused_by_the_same_admission_as_the_rules(
    recorder, sim, simulator_url, sim_key
):
    await sim.configure(chat_default=json.dumps({"action": "dispatch", "node": "a", "reason": "go"}))
    # 1.00 + the 0.05 inference reserve fits exactly; the planner's own call then spends a little of it.
    task_id = open_task(recorder, ceiling="1.05")
    proposal, p = await ask(recorder, simulator_url, sim_key, task_id)
    problem, action = check_llm_action(p, proposal, p.created_at)
    assert action is None and problem == "dispatch of a refused by cost admission (estimate 1.0)"
    decision = recorded_decision(recorder, task_id)  # well-formed, but not admitted: not a valid decision
    assert decision.proposal is not None and not decision.valid and decision.action is None
    assert decision.error == problem


async def test_the_model_can_only_escalate_to_a_person_not_past_one(recorder, sim, simulator_url, sim_key):
    await sim.configure(chat_default=json.dumps({"action": "escalate", "reason": "this looks wrong"}))
    task_id = open_task(recorder)
    proposal, p = await ask(recorder, simulator_url, sim_key, task_id)
    _problem, action = check_llm_action(p, proposal, p.created_at)
    assert isinstance(action, Escalate) and not action.terminal and action.request is not None


# ── the loop itself on an open question ──────────────────────────────────────────────────────────────
SEEDED = """
goal: a task whose review said nothing
budget_ceiling: 5
review: {estimate: 0.05}
stages:
  - {id: a, executor: llm.text, estimate: 1.00}
"""


def seed_open_question(recorder, plan: Plan) -> None:
    """Record, as an earlier run would have, a task driven by the rules until its review, whose result then
    carries no verdict: no rule matches and nothing is pending (``decide`` returns None)."""
    task_id = plan.task_id
    assert task_id is not None
    epoch = recorder.take_lease(task_id, "an earlier run")
    recorder.open_budget(task_id, budget_scopes(plan, task_id))
    recorder.append_fenced(task_id, epoch, [to_new(TaskCreated(plan=plan), dedup_key=f"{task_id}:created")])
    while True:
        p = fold(recorder.read_events(task_id))
        rule, action = decide(p, p.created_at)
        assert isinstance(action, Dispatch), (rule, action)
        intent = Intent(
            action=action,
            rule=rule,
            watermark=p.watermark,
            decided_at=p.created_at,
            reservation=action.estimate,
        )
        key = action.operation_key
        new = to_new(intent, dedup_key=f"{task_id}:intent:{p.watermark}:{p.intents + 1}", operation_key=key)
        recorder.append_fenced(task_id, epoch, [new], reserve=action.estimate)
        if action.node == REVIEW:
            result = ExecutionResult(kind="review", node=REVIEW, operation_key=key)  # no verdict
        else:
            artifact = ArtifactRef(uri=f"file:///nowhere/{key}", sha256="0" * 64)
            result = Outcome(node=action.node, operation_key=key, artifact=artifact, actual_cost=0)
        settled = to_new(result, dedup_key=f"{key}:result", operation_key=key)
        recorder.append_idempotent(task_id, settled, release=action.estimate)
        if action.node == REVIEW:
            assert decide(fold(recorder.read_events(task_id)), p.created_at) is None
            return


async def chat_calls(sim) -> int:
    return (await sim.http.get("/chat/stats")).json()["calls"]


async def test_an_llm_outage_suspends_the_task_for_a_person_instead_of_failing_the_workflow(lf, sim, sim_key):
    await sim.configure(chat_error_status=500)
    plan = lf.plan(SEEDED)
    seed_open_question(lf.recorder, plan)
    before = await chat_calls(sim)
    handle = await lf.start(plan)
    status = await lf.wait_state(handle, {"WaitingHuman"})
    [request] = status["open_requests"]
    assert request["kind"] == "invalid_decision" and request["options"] == ["resume", "abort"]
    assert "the model could not be asked" in request["reason"] and "500" in request["reason"]
    assert sim_key not in request["reason"]
    assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING  # waiting, not failed
    assert await chat_calls(sim) - before == 3, "a few attempts, then a person"
    events = [parse(e) for e in lf.recorder.read_events(plan.task_id)]
    assert not [e for e in events if e.type == "Decision"]  # nothing was decided, nothing spent
    [asked] = [e for e in events if e.type == "Intent" and e.rule == "LLM"]
    assert isinstance(asked.action, SuspendForHuman) and asked.action.request.id == request["id"]
    await handle.terminate("test over")


async def test_the_recorded_decision_carries_the_action_the_loop_takes(lf, sim):
    await sim.configure(chat_default=json.dumps({"action": "escalate", "reason": "the review said nothing"}))
    plan = lf.plan(SEEDED)
    seed_open_question(lf.recorder, plan)
    handle = await lf.start(plan)
    status = await lf.wait_state(handle, {"Escalated"})
    assert status["escalation_reason"] == "model escalated: the review said nothing"
    events = lf.recorder.read_events(plan.task_id)
    decision = recorded_decision(lf.recorder, plan.task_id)
    [intent] = [parse(e) for e in events if e.type == "Intent" and e.payload["rule"] == "LLM"]
    assert decision.valid and decision.error is None and isinstance(decision.action, Escalate)
    assert decision.action == intent.action  # the activity's check and the loop's agree
    [stored] = [e for e in events if e.type == "Decision"]
    assert intent.watermark == stored.seq  # decided on the fold that includes the Decision (its spend)
    await handle.terminate("test over")
