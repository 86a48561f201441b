"""Chat spend checked from the vendor's own billing (issue 23, "done when"): the review's and the planner's
model calls send a request id (``X-Client-Request-Id``: the review operation's key, the planner Decision's
dedup key) that the simulator's chat endpoint bills by, so the ledger's inference spend for a task is
compared, line by line, with what the vendor billed under that task's request ids.
"""

from __future__ import annotations

import json
from decimal import Decimal

import httpx
from temporalio.testing import ActivityEnvironment

from activities.contracts import LlmDecideInput
from activities.llm import ChatClient, LlmActivities
from ledger.recorder import Recorder
from rules.events import TaskCreated, parse, to_new
from rules.llm import ALLOWED_LLM_ACTIONS
from rules.plan import REVIEW, budget_scopes, load_plan
from rules.projection import fold, summary
from vendors.routes import DEFAULT_ROUTES

PIPELINE = """
goal: three shots judged by the model
budget_ceiling: 40
stages:
  - {id: script, executor: llm.text, estimate: 0.10}
  - {id: shots, executor: image.keyframe, estimate: 0.40, depends_on: [script], fan_out: 3, canary: false}
"""
PASS = json.dumps({"scores": {"visual": 0.9}, "blame": {}, "reasons": []})


async def chat_charges(sim, prefix: str) -> dict[str, Decimal]:
    """What the simulator billed for chat under request ids starting with ``prefix``, by request id."""
    billed: dict[str, Decimal] = {}
    for c in await sim.charges(prefix, chat=True):
        if c["protocol"] == "chat":
            billed[c["idempotency_key"]] = billed.get(c["idempotency_key"], Decimal(0)) + Decimal(c["amount"])
    return billed


async def test_the_review_s_model_calls_are_billed_under_their_operation_keys_and_equal_the_ledger_s_spend(
    lf, sim
):
    await sim.configure(chat_default=PASS)
    plan = lf.plan(PIPELINE)
    result = await lf.run(plan)
    assert result.state == "Completed" and result.summary["verdict"] == "Pass"
    task = str(plan.task_id)

    events = lf.recorder.read_events(task)
    reviews = {
        e.operation_key: parse(e).actual_cost
        for e in events
        if e.dedup_key.endswith(":result") and e.payload.get("node") == REVIEW
    }
    assert reviews and all(cost > 0 for cost in reviews.values())
    billed = await chat_charges(sim, f"{task}:")
    assert billed == reviews  # one request id per review operation, the same figure on both sides
    inference = fold(events).spent - sum(
        Decimal(c["amount"]) for c in await sim.charges(f"{task}:", chat=True) if c["protocol"] == "jobs"
    )
    assert inference == sum(billed.values())


async def test_the_planner_s_model_call_is_billed_under_its_decision_key_and_equals_the_decision_s_cost(
    recorder: Recorder, sim, simulator_url: str, sim_key: str
):
    await sim.configure(chat_default=json.dumps({"action": "escalate", "reason": "nothing to go on"}))
    task = "llm-bill-" + __import__("uuid").uuid4().hex[:10]
    plan = load_plan(PIPELINE, DEFAULT_ROUTES, task_id=task)
    epoch = recorder.take_lease(task, "test")
    recorder.open_budget(task, budget_scopes(plan, task))
    recorder.append_fenced(task, epoch, [to_new(TaskCreated(plan=plan), dedup_key=f"{task}:created")])
    async with httpx.AsyncClient(timeout=10) as http:
        chat = ChatClient(http, simulator_url, sim_key, "sim-planner-1", Decimal("0.002"))
        p = fold(recorder.read_events(task))
        inp = LlmDecideInput(
            task_id=task,
            watermark=p.watermark,
            summary=summary(p),
            allowed=ALLOWED_LLM_ACTIONS,
            decided_at=p.created_at,
        )
        await ActivityEnvironment().run(LlmActivities(recorder, chat).decide, inp)

    [decision] = [e for e in recorder.read_events(task) if e.type == "Decision"]
    assert await chat_charges(sim, f"{task}:") == {decision.dedup_key: parse(decision).cost}
    assert parse(decision).cost > 0 and recorder.account(f"task:{task}").spent == parse(decision).cost
