"""`ledgerflow demo` never waits on a person without saying so, and always ends by itself.

Its plan (examples/e001_demo.yaml) is E001 with a clock fit for an unattended demo: every wait for a person
it can reach ends by itself (an approval by its policy, a dead letter by escalating, an escalation at the
task's time ceiling), and while the task waits the demo prints the command and the reviewer page link that
answer, with the deadline. The runs below go through the demo's own loop (``run_task``) on the session's
servers, under several simulator seeds and once with a node forced to dead-letter.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from ledgerflow.stack.demo import People, run_task, wait_policy_line, where_lines
from rules.plan import TimeoutPolicy, load_plan
from rules.projection import fold
from runtime.settings import Settings
from vendors.routes import DEFAULT_ROUTES

ROOT = Path(__file__).resolve().parents[2]
DEMO_PLAN = ROOT / "examples" / "e001_demo.yaml"
# The demo's own simulator profile: its failure rates and its scripted rework, with the latencies taken out
# (what is tested is that every run ends by itself, not how long a vendor takes).
DEMO_SIM = json.loads((ROOT / "examples" / "simulator_demo.json").read_text())
# The time ceilings the runs below get instead of the plan's 10 minutes, so a run that meets an escalation
# (by chance under a seed, or forced) ends in seconds: what ends the wait is the same rule (R4). A run under
# a seed takes about 10 s here; the forced dead letter escalates about 5 s in.
SEED_CEILING_S = 90.0
DEAD_LETTER_CEILING_S = 20.0
# How long past its ceiling a run may take to be over (stopping, the end state written).
MARGIN_S = 60.0


def _sim(seed: int, **executors: dict[str, Any]) -> dict[str, Any]:
    profiles = {name: {**p, "latency_seconds": 0.0} for name, p in DEMO_SIM["executors"].items()}
    for name, extra in executors.items():
        profiles[name] = {**profiles.get(name, {}), **extra}
    return {**DEMO_SIM, "seed": seed, "default": {"latency_seconds": 0.0}, "executors": profiles}


def test_the_demo_plan_is_e001_with_a_clock_that_ends_every_wait() -> None:
    demo = load_plan(DEMO_PLAN.read_text(), DEFAULT_ROUTES)
    e001 = load_plan((ROOT / "examples" / "e001_video.yaml").read_text(), DEFAULT_ROUTES)
    assert demo.model_dump(exclude={"time_ceiling"}) == e001.model_dump(exclude={"time_ceiling"})
    assert demo.time_ceiling == 600.0  # every escalation ends by then (the task fails)
    # The approval point ends by approving; a dead letter, whose policy never approves, by escalating.
    assert (demo.approval.timeout, demo.approval.policy) == (3.0, TimeoutPolicy.APPROVE)
    assert "an escalation at the task's time ceiling of 10 min 00 s" in wait_policy_line(demo)


def test_the_demo_says_where_everything_is_and_how_to_stop_it(tmp_path: Path) -> None:
    info = {
        "temporal_address": "127.0.0.1:7234",
        "ui_url": "http://127.0.0.1:8233",
        "review_url": "http://127.0.0.1:8300",
        "moved_ports": {"temporal": {"what": "Temporal", "standard": 7233, "port": 7234}},
    }
    text = "\n".join(where_lines(info, Settings(state_dir=tmp_path / ".ledgerflow")))
    for needle in (
        "127.0.0.1:7234",
        "http://127.0.0.1:8233",
        "http://127.0.0.1:8300",
        "make down",
        "Temporal: its standard port 7233 was busy, it took 7234 instead",
    ):
        assert needle in text, text


def test_each_wait_is_told_with_the_command_the_link_and_the_deadline() -> None:
    plan = load_plan(DEMO_PLAN.read_text(), DEFAULT_ROUTES, task_id="demo-x")
    created = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    people = People("demo-x", plan, "http://127.0.0.1:8300", created_at=created)
    now = created + timedelta(seconds=30)
    approval = {
        "id": "approval:storyboard:v1",
        "kind": "approval",
        "reason": "approve storyboard",
        "options": ["approve", "abort"],
        "deadline": (now + timedelta(seconds=3)).isoformat(),
    }
    escalation = {
        "id": "escalation:1",
        "kind": "escalation",
        "reason": "dead_letter request dead_letter:prop_graphics:a1 timed out: policy escalate",
        "options": ["resume", "add_budget", "abort"],
        "deadline": None,
    }
    assert people.news({"open_requests": [approval, escalation]}) == [approval, escalation]
    assert people.news({"open_requests": [approval, escalation]}) == []  # each told once
    told = "\n".join(people.lines(approval, now))
    assert "ledgerflow decide demo-x/approval:storyboard:v1 approve --as director   (or: abort)" in told
    assert "http://127.0.0.1:8300/requests/demo-x/approval:storyboard:v1" in told
    assert "(in 3 s): then the plan's policy approves it" in told
    told = "\n".join(people.lines(escalation, now))
    assert (
        "ledgerflow decide demo-x/escalation:1 resume --as director   (or: add-budget --amount N, abort)"
        in told
    )
    at = (created + timedelta(minutes=10)).astimezone().strftime("%H:%M:%S")
    assert f"deadline  {at} (in 9 min 30 s): then the task's time ceiling stops it" in told


@pytest.mark.parametrize(
    ("seed", "forced"),
    [(7, {}), (11, {}), (7, {"graphics.render": {"reject_content": 1.0}})],
    ids=["seed-7", "seed-11", "dead-letter"],
)
async def test_the_demo_plan_ends_by_itself(lf, sim, seed: int, forced: dict[str, Any]) -> None:
    """Unattended, under the demo's failure rates: each run reaches an end state by itself. With every
    content request of prop_graphics rejected (a failure no retry fixes), the node dead-letters at once: the
    dead letter times out into an escalation, which the task's time ceiling ends (Failed); the demo told both
    waits, with the command that answers them."""
    await sim.configure(**_sim(seed, **forced))
    ceiling = DEAD_LETTER_CEILING_S if forced else SEED_CEILING_S
    plan = lf.plan(DEMO_PLAN.read_text()).model_copy(update={"time_ceiling": ceiling})
    assert plan.task_id is not None
    text = io.StringIO()
    out = Console(file=text, width=200)  # not a terminal: progress lines instead of the live view
    people = People(plan.task_id, plan, "http://review.invalid")
    started = time.monotonic()
    summary, error = await asyncio.wait_for(run_task(lf.settings, plan, out, people), ceiling + MARGIN_S)
    took = time.monotonic() - started
    p = fold(lf.recorder.read_events(plan.task_id))
    assert p.finished and summary["state"] in ("Completed", "Failed"), (summary, text.getvalue())
    assert error is None
    shown = text.getvalue()
    if not forced:
        approve = f"ledgerflow decide {plan.task_id}/approval:storyboard:v1 approve --as director"
        assert approve in shown, shown
        if summary["state"] == "Failed":  # a dead letter by chance (about 1 run in 25): ended the same way
            assert "time ceiling" in str(p.terminal_reason), p.terminal_reason
        return
    assert summary["state"] == "Failed" and "time ceiling" in str(p.terminal_reason), summary
    kinds = {r.request.kind.value for r in p.requests.values()}
    assert kinds == {"dead_letter", "escalation"}, kinds  # the storyboard waits on prop_graphics: no approval
    assert p.nodes["prop_graphics"].status.value == "failed" and p.spent <= Decimal(plan.budget_ceiling)
    for rid in ("dead_letter:prop_graphics:a1", "escalation:1"):
        assert f"waiting on a person: {rid.split(':')[0]} {rid}" in shown, shown
        assert f"ledgerflow decide {plan.task_id}/{rid} resume --as director" in shown, shown
    assert "then the task's time ceiling stops it" in shown, shown
    assert took >= ceiling, took  # it waited for a person until the ceiling: it did not stop early
