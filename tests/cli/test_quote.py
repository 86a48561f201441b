"""``ledgerflow quote`` and ``submit --budget-from-quote`` as a user runs them (a real subprocess), against a
history recorded in the real Postgres through the recorder's own append paths."""

from __future__ import annotations

import asyncio
import json
import os
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from clikit import CLI, assert_one_line_error, run
from historykit import D, History, uid

from ledger.recorder import Recorder
from ledgerflow.views.quote import money_text
from rules.envelope import StoredEvent
from rules.events import TaskCreated, parse_as
from rules.plan import PlanQuote
from vendors.routes import RouteSpec, RouteTable, default_table


def plan_text(a: str, b: str, **extra: Any) -> str:
    return yaml.safe_dump(
        {
            "goal": "a quoted plan",
            "budget_ceiling": 100,
            **extra,
            "stages": [
                {"id": "shots", "executor": a, "estimate": 1, "fan_out": 3},
                {"id": "edit", "executor": b, "estimate": "0.5", "depends_on": ["shots"]},
            ],
        }
    )


def seconds(pairs: list[tuple[StoredEvent, StoredEvent]]) -> list[float]:
    return sorted((done.recorded_at - sent.recorded_at).total_seconds() for sent, done in pairs)


@pytest.fixture
def routes() -> tuple[str, str]:
    """Two routes of this test's own, so no other test's history is counted on them."""
    return f"shots-{uid()}", f"edit-{uid()}"


@pytest.fixture
def deployment(tmp_path: Path, pg_url: str, recorder: Recorder, routes: tuple[str, str]) -> dict[str, str]:
    """The CLI's environment: the test database and a route file with the test's routes."""
    table = RouteTable(routes={**default_table().routes, **{r: RouteSpec() for r in routes}})
    path = tmp_path / "routes.yaml"
    path.write_text(yaml.safe_dump(table.model_dump(mode="json")))
    return {"LEDGERFLOW_DATABASE_URL": pg_url, "LEDGERFLOW_ROUTES_FILE": str(path)}


@pytest.fixture
def seeded(recorder: Recorder, routes: tuple[str, str]) -> dict[str, Any]:
    """A project whose history holds 6 results on the shots route (1.0 to 2.0 against an estimate of 1) and
    2 on the edit route (too few to learn from)."""
    project = f"p-{uid()}"
    shots, edit = routes
    a, b = History(recorder, project), History(recorder, project)
    costs = ((a, "1.0"), (a, "1.2"), (b, "1.4"), (b, "1.6"), (a, "1.8"), (b, "2.0"))
    pairs = [h.op(shots, "1.00", c) for h, c in costs]
    a.op(edit, "0.50", "0.45")
    b.op(edit, "0.50", "0.55")
    return {"project": project, "shots_s": seconds(pairs)}


def test_quote_prices_each_stage_from_its_routes_history_and_totals_them(
    tmp_path: Path, deployment: dict[str, str], routes: tuple[str, str], seeded: dict[str, Any]
) -> None:
    shots, edit = routes
    plan = tmp_path / "plan.yaml"
    plan.write_text(plan_text(shots, edit))
    proc = run(["quote", str(plan), "--project", seeded["project"], "--json"], deployment, tmp_path)
    assert proc.returncode == 0, proc.stderr
    q = json.loads(proc.stdout)
    by = {s["stage"]: s for s in q["stages"]}
    assert list(by) == ["shots", "edit", "compose", "review"]
    # shots: 6 results; ratio p50 = the 3rd of 6 (1.4), p95 = the 6th (2.0); × estimate 1 × 3 nodes.
    assert by["shots"]["learned"] is True and by["shots"]["results"] == 6
    assert by["shots"]["ratio"] == {"p50": "1.400000", "p95": "2.000000"}
    assert by["shots"]["node_spend"] == {"p50": "1.400000", "p95": "2.000000"}
    assert by["shots"]["spend"] == {"p50": "4.200000", "p95": "6.000000"}
    # Its 3 nodes run at once (concurrency 8): one node's duration.
    s = seeded["shots_s"]
    assert by["shots"]["duration_s"] == {"p50": round(s[2], 3), "p95": round(s[5], 3)}
    assert (by["shots"]["retry_rate"], by["shots"]["rework_rate"]) == (0.0, 0.0)
    # edit: 2 results is too little history: the plan's estimate, and no duration.
    assert by["edit"]["learned"] is False and by["edit"]["results"] == 2
    assert by["edit"]["spend"] == {"p50": "0.500000", "p95": "0.500000"} and by["edit"]["duration_s"] is None
    assert by["review"]["spend"] == {"p50": "0.050000", "p95": "0.050000"}  # no review in this project yet
    # 4.2 + 0.5 + 0 + 0.05, and the 0.05 inference reserve admission always keeps aside.
    assert q["total"] == {"p50": "4.800000", "p95": "6.600000"}
    assert q["estimated_total"] == "3.600000"
    assert q["duration_s"] == {"p50": round(s[2], 3), "p95": round(s[5], 3)}
    assert q["duration_unknown_for"] == ["edit", "compose", "review"]


def test_quote_says_plainly_where_there_is_too_little_history(
    tmp_path: Path, deployment: dict[str, str], routes: tuple[str, str], seeded: dict[str, Any]
) -> None:
    shots, edit = routes
    plan = tmp_path / "plan.yaml"
    plan.write_text(plan_text(shots, edit))
    proc = run(["quote", str(plan), "--project", seeded["project"]], deployment, tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert (
        f"* edit: too little history: 2 results on route {edit} (fewer than 5): the plan's estimate" in text
    )
    assert "* review: too little history: 0 results on route review" in text
    assert "shots: too little history" not in text
    assert "duration leaves out edit, compose, review (no history) and waits for people" in text


def test_submit_refuses_a_p50_ceiling_below_the_plans_own_estimates_in_one_line(
    tmp_path: Path, deployment: dict[str, str], recorder: Recorder, routes: tuple[str, str]
) -> None:
    shots, edit = routes
    h = History(recorder, f"p-{uid()}")
    for cost in ("0.30", "0.40", "0.50", "0.60", "1.50"):  # p50 0.50 ≠ p95 1.50: the percentile matters
        h.op(shots, "1.00", cost)
    plan = tmp_path / "plan.yaml"
    plan.write_text(plan_text(shots, edit))
    env = {**deployment, "LEDGERFLOW_TEMPORAL_ADDRESS": "127.0.0.1:1"}
    # The review's share is learned from every task of the shared ledger: the figure is read from the quote.
    quoted = json.loads(run(["quote", str(plan), "--json"], env, tmp_path).stdout)["total"]
    assert Decimal(quoted["p50"]) < Decimal("3.60") <= Decimal(quoted["p95"])
    proc = run(["submit", str(plan), "--budget-from-quote", "p50"], env, tmp_path)
    total = money_text(Decimal(quoted["p50"]))
    assert_one_line_error(proc, f"the quote's p50 total {total} is below the plan's estimated total 3.60")


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["quote"], ("give a PLAN to quote, or --drift TASK",)),
        (["quote", "nope.yaml"], ("no such plan file",)),
        (["quote", "--drift", "no-such-task"], ("no task 'no-such-task'",)),
        (["submit", "plan.yaml", "--budget-from-quote", "p99"], ("--budget-from-quote must be p50 or p95",)),
    ],
    ids=["nothing", "no-file", "unknown-task", "bad-percentile"],
)
def test_bad_quote_input_is_one_line(
    tmp_path: Path, deployment: dict[str, str], routes: tuple[str, str], args: list[str], needles: tuple[str]
) -> None:
    (tmp_path / "plan.yaml").write_text(plan_text(*routes))
    env = {**deployment, "LEDGERFLOW_TEMPORAL_ADDRESS": "127.0.0.1:1"}
    assert_one_line_error(run(args, env, tmp_path), *needles)


def test_drift_of_a_task_submitted_without_a_quote_is_one_line(
    tmp_path: Path, deployment: dict[str, str], recorder: Recorder
) -> None:
    h = History(recorder, f"p-{uid()}")
    proc = run(["quote", "--drift", h.task_id], deployment, tmp_path)
    assert_one_line_error(proc, f"task {h.task_id!r} has no quote", "--budget-from-quote")


async def test_submit_budget_from_quote_sets_the_ceiling_records_the_quote_and_drift_is_shown(
    lf_with: Any,
    sim: Any,
    tmp_path: Path,
    recorder: Recorder,
    routes: tuple[str, str],
    seeded: dict[str, Any],
) -> None:
    shots, edit = routes
    table = RouteTable(routes={**default_table().routes, **{r: RouteSpec() for r in routes}})
    async with lf_with(routes=table) as lf:
        env = {
            "LEDGERFLOW_TEMPORAL_ADDRESS": lf.settings.temporal_address,
            "LEDGERFLOW_DATABASE_URL": lf.settings.database_url,
            "LEDGERFLOW_TASK_QUEUE": lf.task_queue,
            "LEDGERFLOW_ROUTES_FILE": str(lf.settings.routes_file),
        }
        plan = tmp_path / "plan.yaml"
        plan.write_text(plan_text(shots, edit))
        quoted = run(["quote", str(plan), "--json"], env, tmp_path)
        assert quoted.returncode == 0, quoted.stderr
        expected = json.loads(quoted.stdout)
        task_id = f"quoted-{uid()}"
        proc = await asyncio.create_subprocess_exec(
            *CLI, "submit", str(plan), "--task-id", task_id, "--budget-from-quote", "p95", "--wait", "--json",
            cwd=tmp_path, env={**os.environ, **env},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
        assert proc.returncode == 0, err.decode()
        assert json.loads(out)["state"] == "Completed"
        events = recorder.read_events(task_id)
        recorded = parse_as(events[0], TaskCreated).plan
        # The ceiling is the quote's p95 total; the quote rides in the plan, so TaskCreated records it.
        assert (
            recorded.budget_ceiling
            == D(expected["total"]["p95"])
            == D("6.60")
            + (
                D(expected["stages"][3]["spend"]["p95"]) - D("0.05")  # the review's, if others taught it
            )
        )
        assert isinstance(recorded.quote, PlanQuote) and recorded.quote.percentile == "p95"
        assert recorded.quote.total == recorded.budget_ceiling
        assert recorded.quote.stages == {s["stage"]: D(s["spend"]["p95"]) for s in expected["stages"]}
        drift = run(["quote", "--drift", task_id, "--json"], env, tmp_path)
        assert drift.returncode == 0, drift.stderr
        d = json.loads(drift.stdout)
        # The actual spend per stage is what the ledger recorded for its nodes; drift is actual − quoted.
        spent: dict[str, Decimal] = {}
        for e in events:
            if e.type in ("Outcome", "Failure", "ExecutionResult"):
                stage = e.payload["node"].split("/")[0]
                spent[stage] = spent.get(stage, D(0)) + D(e.payload["actual_cost"])
        rows = {r["stage"]: r for r in d["stages"]}
        for stage, quoted_spend in recorded.quote.stages.items():
            assert D(rows[stage]["actual"]) == spent.get(stage, D(0))
            assert D(rows[stage]["drift"]) == spent.get(stage, D(0)) - quoted_spend
        account = recorder.account(f"task:{task_id}")
        assert account is not None and D(d["actual"]) == account.spent
        assert D(d["drift"]) == account.spent - recorded.quote.total
        assert (d["finished"], d["state"]) == (True, "Completed")
        shown = run(["quote", "--drift", task_id], env, tmp_path)
        assert shown.returncode == 0 and "(Completed) against its p95 quote" in " ".join(shown.stdout.split())
