"""``ledgerflow audit`` on real servers: decisions recomputed, accounts, Temporal histories replayed, and with
``--billing`` every charge the vendors list matched to exactly one operation.

Each test runs its own routes (``*.<test>``): a jobs route (idempotency keys, ``GET /billing/charges``), a
predictions route (Replicate's API: no billing listing) and an OpenAI-compatible route, whose usage API names
no call: the last two are reported as not listable.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import datetime
from decimal import Decimal
from typing import Any

from peoplekit import cli

from ledgerflow.views.audit import Audit, TaskAudit, audit, operations
from rules.actions import Action, Dispatch
from rules.events import ArtifactRef, ExecutionResult, Intent, Outcome, TaskCreated, to_new
from rules.llm import ask_person
from rules.plan import REVIEW, budget_scopes
from rules.projection import Projection, fold
from rules.recompute import audit_decisions
from rules.table import RULES_VERSION, decide
from rules.table_versions import registered
from vendors.routes import AdapterKind, Price, RouteSpec, RouteTable

PIPELINE = """
goal: an audited pipeline
budget_ceiling: 20
review: {{reviewers: [compliance.rules], estimate: 0, require_rights: false}}
stages:
  - {{id: script, executor: {text}, estimate: 0.10}}
  - {{id: frames, executor: {image}, estimate: 0.50, fan_out: 3, depends_on: [script]}}
  - {{id: motion, executor: {video}, estimate: 0.30, depends_on: [frames]}}
"""


def names() -> dict[str, str]:
    tag = uuid.uuid4().hex[:8]
    return {"text": f"text.{tag}", "image": f"image.{tag}", "video": f"video.{tag}"}


def route_table(n: dict[str, str]) -> RouteTable:
    return RouteTable(
        routes={
            n["text"]: RouteSpec(
                adapter=AdapterKind.OPENAI,
                price=Price(per_1k_input_tokens=Decimal("0.001"), per_1k_output_tokens=Decimal("0.002")),
            ),
            n["image"]: RouteSpec(adapter=AdapterKind.JOBS),
            # The simulator bills a prediction 0.30 a second of compute; the route prices it the same way.
            n["video"]: RouteSpec(adapter=AdapterKind.PREDICTIONS, price=Price(per_second=Decimal("0.30"))),
        }
    )


async def run_pipeline(lf: Any, sim: Any, n: dict[str, str]) -> str:
    await sim.configure(executors={n["video"]: {"latency_seconds": 0.2}})
    plan = lf.plan(PIPELINE.format(**n))
    result = await lf.run(plan)
    assert result.state == "Completed", result.summary
    return str(plan.task_id)


async def test_a_finished_pipeline_audits_clean_decisions_accounts_histories_and_billing(lf_with, sim):
    n = names()
    async with lf_with(routes=route_table(n)) as lf:
        task = await run_pipeline(lf, sim, n)
        report = await audit(lf.settings, lf.recorder, lf.client, [task], billing=True)
    [t] = report.tasks
    assert report.ok, report.lines()
    intents = [e for e in lf.recorder.read_events(task) if e.type == "Intent"]
    assert t.decisions.decisions == len(intents) >= 8 and t.decisions.llm == 0
    assert audit_decisions(lf.recorder.read_events(task), incremental=False) == t.decisions  # exact
    assert t.replay is not None and t.replay.replayed == 1
    billing = t.billing
    assert billing is not None
    # Three frames on the jobs API, each charge matched to its operation, amounts equal (a prediction is
    # priced: Replicate lists no charges).
    assert (billing.matched, billing.operations) == (3, 3), billing
    assert billing.unlisted == [
        f"route {n['text']} (the openai API lists no charges per call)",
        f"route {n['video']} (the predictions API lists no charges per call)",  # Replicate has no billing API
    ]
    head, *_, summary = report.lines()
    assert head == f"{task}: OK"
    assert summary.strip() == (
        f"{len(intents)} decisions recomputed, 0 LLM decisions re-validated, accounts equal, 1 history "
        "replayed, billing: 3 charges matched to 3 operations, 2 routes not listable"
    )
    assert json.loads(json.dumps(report.as_json()))["billing"]["matched"] == 3


async def test_a_rule_changed_on_purpose_is_a_divergence_naming_the_seq_and_both_decisions(lf_with, sim):
    n = names()
    async with lf_with(routes=route_table(n)) as lf:
        task = await run_pipeline(lf, sim, n)
    events = lf.recorder.read_events(task)
    motion = next(e for e in events if e.type == "Intent" and e.payload["action"].get("node") == "motion")
    assert motion.payload["rules"] == RULES_VERSION  # what the workflow records: today's table

    NEXT = RULES_VERSION + 1  # a table no INTENT was recorded by yet

    def changed(p: Projection, now: datetime) -> tuple[str, Action] | None:
        """The next version of the table: a person approves the motion stage before it is dispatched."""
        decided = decide(p, now)
        if decided is not None and isinstance(decided[1], Dispatch) and decided[1].node == "motion":
            return "R9", ask_person(p, f"v{NEXT}: motion needs a person first")
        return decided

    # The ledger is append-only: the INTENT is re-tagged as decided by the next table in a copy, in memory.
    tampered = [
        e.model_copy(update={"payload": {**e.payload, "rules": NEXT}}) if e.seq == motion.seq else e
        for e in events
    ]
    with registered(NEXT, changed):
        found = audit_decisions(tampered)
        [d] = found.divergences
        assert (d.seq, d.recorded, d.recomputed) == (motion.seq, "R11 Dispatch(motion)", "R9 SuspendForHuman")
        assert str(d) == f"seq {motion.seq}: recorded R11 Dispatch(motion), recomputed R9 SuspendForHuman"
        # Today's table decided exactly that: nothing to report apart.
        assert found.today == ()
    # Were the next table today's, the untouched record recomputes (each INTENT with its own), and the audit
    # says apart, without failing, where today's table would decide differently.
    with registered(NEXT, changed, as_today=True):
        clean = audit_decisions(events)
    assert clean.ok
    [today] = clean.today
    assert (today.seq, today.recorded) == (motion.seq, "R11 Dispatch(motion)")
    assert today.recomputed == f"R9 SuspendForHuman (today's v{NEXT})"
    # --all's shape: one line per task with a problem, then the total.
    audited = [TaskAudit(task, clean, accounts=[]), TaskAudit("tampered", found, accounts=[])]
    lines = Audit(audited, every=True).lines()
    assert (
        lines[0]
        == f"tampered: seq {motion.seq}: recorded R11 Dispatch(motion), recomputed R9 SuspendForHuman"
    )
    assert lines[1].startswith("audited 2 tasks, 1 with problems: ") and len(lines) == 2


# ── the LLM planner's decision ───────────────────────────────────────────────────────────────────────
SEEDED = """
goal: a task whose review said nothing
budget_ceiling: 5
review: {reviewers: [compliance.rules], estimate: 0}
stages:
  - {id: a, executor: llm.text, estimate: 1.00}
"""


def seed_open_question(recorder: Any, plan: Any) -> None:
    """Record, as an earlier run would have, a task whose review result carries no verdict: no rule matches
    and nothing is pending, so the loop that takes it over asks the model (tests/workflows/test_llm_path)."""
    task_id = plan.task_id
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
            result: Any = ExecutionResult(kind="review", node=REVIEW, operation_key=key)  # no verdict
        else:
            artifact = ArtifactRef(uri=f"file:///nowhere/{key}", sha256="0" * 64)
            result = Outcome(node=action.node, operation_key=key, artifact=artifact, actual_cost=0)
        settled = to_new(result, dedup_key=f"{key}:result", operation_key=key)
        recorder.append_idempotent(task_id, settled, release=action.estimate)
        if action.node == REVIEW:
            return


async def test_an_llm_planner_decision_is_re_validated_and_a_run_replays_while_it_waits(lf, sim):
    await sim.configure(chat_default=json.dumps({"action": "escalate", "reason": "the review said nothing"}))
    plan = lf.plan(SEEDED)
    seed_open_question(lf.recorder, plan)
    handle = await lf.start(plan)
    try:
        await lf.wait_state(handle, {"Escalated"})
        report = await audit(lf.settings, lf.recorder, lf.client, [str(plan.task_id)])
    finally:
        await handle.terminate("test over")
    [t] = report.tasks
    assert report.ok, report.lines()
    assert t.decisions.llm == 1 and t.decisions.decisions == 3  # the seeded a, compose, review: the rules
    assert audit_decisions(lf.recorder.read_events(str(plan.task_id)), incremental=False) == t.decisions
    assert t.replay is not None and t.replay.replayed == 1  # a running workflow's history replays too
    [llm] = [e for e in lf.recorder.read_events(str(plan.task_id)) if e.payload.get("rule") == "LLM"]
    assert llm.payload["action"]["kind"] == "Escalate"


async def test_a_task_whose_temporal_history_is_gone_is_reported_not_failed(lf):
    plan = lf.plan(SEEDED)
    seed_open_question(lf.recorder, plan)  # recorded by a run whose workflow history Temporal no longer holds
    report = await audit(lf.settings, lf.recorder, lf.client, [str(plan.task_id)])
    [t] = report.tasks
    assert report.ok and t.replay is not None and t.replay.replayed == 0
    assert t.notes() == [
        f"no Temporal history of ledgerflow-task-{plan.task_id} (past retention, or never "
        "started): not replayed"
    ]


# ── a charge nobody recorded, through the CLI ────────────────────────────────────────────────────────
def vendor_env(lf: Any, sim: Any) -> dict[str, str]:
    """What the CLI needs beyond the servers (peoplekit.cli's base): the simulator and the test's routes."""
    return {
        "LEDGERFLOW_VENDOR_URL": sim.url,
        "LEDGERFLOW_VENDOR_API_KEY": lf.settings.vendor_api_key.get_secret_value(),
        "LEDGERFLOW_ROUTES_FILE": str(lf.settings.routes_file),
    }


async def test_a_charge_the_ledger_does_not_know_fails_the_billing_audit(lf_with, sim, tmp_path):
    n = names()
    async with lf_with(routes=route_table(n)) as lf:
        task = await run_pipeline(lf, sim, n)
        # Paid for at the vendor under the task's keys, unknown to the ledger (a stray client, a bug).
        ghost = f"{task}:ghost:a1"
        job = {"executor": n["image"], "input": {"prompt": "nobody asked"}, "estimate": "0.25"}
        response = await sim.http.post("/jobs", json=job, headers={"Idempotency-Key": ghost})
        assert response.status_code == 201
        (code, out, err), (bad, _, why) = await asyncio.gather(
            cli(lf, tmp_path, "audit", task, "--billing", env=vendor_env(lf, sim)),
            cli(lf, tmp_path, "audit", env=vendor_env(lf, sim)),
        )
    lines = out.splitlines()
    assert code == 1, (out, err)
    job_id = response.json()["id"]
    assert lines[0] == (
        f"{task}: FAILED: billing: unmatched charge: job {job_id} (key {ghost}) charged 0.2500 by "
        f"jobs at {sim.url} ({n['image']})"
    ), lines
    assert lines[-1].endswith(
        "billing: 3 charges matched to 3 operations, 1 unmatched, 2 routes not listable"
    )
    assert bad == 2 and why.strip() == "error: give one TASK, or --all for every task in the ledger"
    # The same audit without --billing knows nothing of the vendor's bill: clean.
    report = await audit(lf.settings, lf.recorder, lf.client, [task])
    assert report.ok and report.tasks[0].billing is None
    ops = operations(task, lf.recorder.read_events(task))
    assert ghost not in ops and {op.node for op in ops.values()} >= {"frames/S01", "motion"}
