"""The LLM only where the rules are silent: real model calls (the simulator's chat API, HTTP), real ledger.

``llm.decide`` runs in Temporal's ActivityEnvironment; what it proposes must pass ``check_llm_action`` (same
path as R11: ready node, static gate, cost admission) or it becomes a question to a person, never an action.
"""

from __future__ import annotations

import json
import uuid
from decimal import Decimal

import httpx
import pytest
from temporalio.testing import ActivityEnvironment

from activities.llm import ChatClient, LlmActivities
from activities.models import LlmDecideInput
from ledgerflow.routes import DEFAULT_ROUTES
from rules.actions import Dispatch, Escalate
from rules.events import TaskCreated, parse, to_new
from rules.llm import ALLOWED_LLM_ACTIONS, check_llm_action
from rules.plan import budget_scopes, load_plan
from rules.projection import fold, summary

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
            task_id=task_id, watermark=p.watermark, summary=summary(p), allowed=ALLOWED_LLM_ACTIONS
        )
        proposal = await ActivityEnvironment().run(LlmActivities(recorder, chat).decide, inp)
    p = fold(recorder.read_events(task_id))
    return proposal, p


async def test_a_valid_proposal_becomes_the_same_dispatch_the_rules_would_make(
    recorder, sim, simulator_url, sim_key
):
    await sim.configure(chat_default=json.dumps({"action": "dispatch", "node": "a", "reason": "start here"}))
    task_id = open_task(recorder)
    proposal, p = await ask(recorder, simulator_url, sim_key, task_id)
    problem, action = check_llm_action(p, proposal, p.created_at)
    assert problem is None and isinstance(action, Dispatch)
    assert (action.node, action.operation_key, action.estimate) == ("a", f"{task_id}:a:a1", Decimal("1.00"))
    decision = next(parse(e) for e in recorder.read_events(task_id) if e.type == "Decision")
    assert decision.valid and decision.tokens_in > 0 and decision.cost > 0 and len(decision.prompt_hash) == 64
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
    decision = next(parse(e) for e in recorder.read_events(task_id) if e.type == "Decision")
    assert decision.raw_output == output[:20000]  # recorded as it came, for the audit
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


async def test_the_model_can_only_escalate_to_a_person_not_past_one(recorder, sim, simulator_url, sim_key):
    await sim.configure(chat_default=json.dumps({"action": "escalate", "reason": "this looks wrong"}))
    task_id = open_task(recorder)
    proposal, p = await ask(recorder, simulator_url, sim_key, task_id)
    _problem, action = check_llm_action(p, proposal, p.created_at)
    assert isinstance(action, Escalate) and not action.terminal and action.request is not None
