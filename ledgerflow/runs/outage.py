"""``ledgerflow drill --scenario vendor-outage``: the vendor-outage exercise
(docs/design.md#the-vendor-outage-exercise) on the embedded stack.

The motion vendor goes down mid-episode. A fresh pair of routes is made for the run (``motion-<stamp>`` and
its fallback ``motion-<stamp>-backup``, the fallback's ``convert`` renaming ``aspect``); the fallback is
qualified first (``ledgerflow routes qualify``: its regression set, ``examples/regressions/motion.yaml``,
against the simulator), then a few episodes start (script → a motion fan-out on the primary → edit) on a
worker subprocess. Once the first shots are in, the primary fails:

* ``--failure errors`` (default): every submit answers 503 (the vendor's "down, not taken"), then — after a
  while — every call hangs until the client's timeout; at the end the vendor comes back.
* ``--failure quality``: the vendor keeps answering, but the first two episodes' shots are judged unusable
  at their first review (a model update gone wrong: "a generation endpoint at 99.9 percent availability with
  a collapsing pass rate"); later episodes start once the breaker has opened.

The breaker opens, the dispatches switch to the qualified fallback — its canary first, the rest once the
canary passed its node check — and every task completes. Report: where each shot was made, the times from
the failure to the breaker opening and to the switch, the canary, end states, duplicate charges and the
ledger against the vendor's own charge list (exact, never "about").
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import httpx
import yaml
from rich.table import Table

from ledgerflow import client as lf
from ledgerflow.runs.drill import ROOT, WorkerProcess, vendor_charges
from ledgerflow.runs.qualify import qualify
from ledgerflow.stack import services as stack
from rules.events import vendor_spend
from rules.projection import fold
from runtime.settings import Settings
from vendors.routes import DEFAULT_EXECUTORS, deployment_table
from workflows.contracts import TaskInput, workflow_id
from workflows.task import TaskWorkflow

REGRESSION = ROOT / "examples" / "regressions" / "motion.yaml"
PLAN = """
goal: outage drill episode {n}
budget_ceiling: 60
rework_limit: 1
stages:
  - {{id: script, executor: llm.text, estimate: 0.10}}
  - {{id: motion, executor: {primary}, estimate: 0.40, depends_on: [script], fan_out: {shots},
      input: {{aspect: "16:9", format: json}}}}
  - {{id: edit, executor: edit.assembly, estimate: 0.20, depends_on: [motion]}}
"""
PASS = json.dumps({"scores": {"visual": 0.9}, "blame": {}, "reasons": []})
FINISH_TIMEOUT = 240.0


@dataclass
class OutageReport:
    failure: str
    shots: int = 8
    primary: str = ""
    fallback: str = ""
    qualification: str = ""
    episodes: int = 0
    shots_primary: int = 0
    shots_fallback: int = 0
    failed_at: float | None = None  # wall clock: when the drill broke the primary
    opened_at: float | None = None
    switched_at: float | None = None
    canary_passed_at: float | None = None
    opened_reason: str = ""
    end_states: dict[str, int] = field(default_factory=dict)
    duplicate_charges: int = 0
    ledger_total: Decimal = Decimal(0)
    vendor_total: Decimal = Decimal(0)
    closed_again: bool = False

    @property
    def clean(self) -> bool:
        return (
            self.duplicate_charges == 0
            and self.ledger_total == self.vendor_total
            and self.end_states.get("Completed", 0) == self.episodes
            and self.shots_fallback > 0
        )

    def _after(self, at: float | None) -> str:
        if at is None or self.failed_at is None:
            return "—"
        return f"{at - self.failed_at:.1f} s"

    def table(self) -> Table:
        t = Table(title=f"ledgerflow drill — vendor outage ({self.failure})", title_justify="left")
        t.add_column("measure")
        t.add_column("value")
        t.add_row("routes", f"{self.primary} → fallback {self.fallback}")
        t.add_row("fallback qualification", self.qualification)
        t.add_row(
            "episodes (end states)",
            f"{self.episodes} ({', '.join(f'{k} {v}' for k, v in self.end_states.items())})",
        )
        t.add_row("shots made on primary / fallback", f"{self.shots_primary} / {self.shots_fallback}")
        t.add_row("failure → breaker open", self._after(self.opened_at))
        t.add_row("breaker opened because", self.opened_reason or "—")
        t.add_row("failure → switch (canary dispatched)", self._after(self.switched_at))
        t.add_row("failure → canary passed", self._after(self.canary_passed_at))
        t.add_row("primary closed again (probe)", "yes" if self.closed_again else "no")
        t.add_row("duplicate charges", str(self.duplicate_charges))
        t.add_row("ledger − vendor total", f"{self.ledger_total} − {self.vendor_total}")
        return t


async def run_outage_drill(
    settings: Settings, *, failure: str = "errors", episodes: int = 4, shots: int = 8
) -> OutageReport:
    info = stack.up(settings, with_worker=False)
    stamp = datetime.now(UTC).strftime("%m%d%H%M%S")
    primary, fallback = f"motion-{stamp}", f"motion-{stamp}-backup"
    report = OutageReport(failure, shots, primary, fallback)
    state = settings.state_dir.resolve()
    routes_file = state / f"outage-routes-{stamp}.yaml"
    routes_file.write_text(yaml.safe_dump(_routes(primary, fallback)))
    queue = f"outage-{stamp}-{uuid.uuid4().hex[:4]}"
    settings = Settings(
        temporal_address=info["temporal_address"],
        database_url=info["database_url"],
        vendor_url=info["vendor_url"],
        task_queue=queue,
        routes_file=routes_file,
        env="dev",
    )
    vendor = str(info["vendor_url"])
    base: dict[str, Any] = {
        "seed": 3,
        "default": {"latency_seconds": 0.2},
        "executors": {primary: {"latency_seconds": 1.0}, fallback: {"latency_seconds": 1.0}},
        "chat_default": PASS,
    }
    _configure(vendor, base)
    q = await qualify(settings, fallback, actor="outage drill")
    report.qualification = q.reason()
    if not q.passed:
        return report
    env = {
        "LEDGERFLOW_TEMPORAL_ADDRESS": str(settings.temporal_address),
        "LEDGERFLOW_DATABASE_URL": str(settings.database_url),
        "LEDGERFLOW_VENDOR_URL": vendor,
        "LEDGERFLOW_TASK_QUEUE": queue,
        "LEDGERFLOW_ARTIFACT_DIR": str(state / "artifacts"),
        "LEDGERFLOW_POLL_INTERVAL_SECONDS": "0.05",
        "LEDGERFLOW_ROUTES_FILE": str(routes_file),
        "LEDGERFLOW_ENV": "dev",
    }
    logs = state / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    worker = WorkerProcess(env, logs / "outage-worker.log")
    client = await lf.connect(settings)
    rec = lf.recorder(settings)
    handles: list[Any] = []
    task_ids: list[str] = []
    names = deployment_table(settings).names()

    async def start(n: int) -> None:
        tid = f"outage-{stamp}-{n:02d}"
        plan = lf.parse_plan(PLAN.format(n=n + 1, primary=primary, shots=shots), tid, routes=names)
        inp = TaskInput(task_id=tid, plan=plan, heartbeat_timeout_seconds=5)
        handles.append(
            await client.start_workflow(TaskWorkflow.run, inp, id=workflow_id(tid), task_queue=queue)
        )
        task_ids.append(tid)

    try:
        if failure == "quality":
            await _quality_collapse(vendor, base, primary, episodes, start, rec, report)
        else:
            await _errors_then_timeouts(vendor, base, primary, episodes, start, rec, report)
        await asyncio.wait([asyncio.ensure_future(h.result()) for h in handles], timeout=FINISH_TIMEOUT)
        _tally(report, rec, vendor, task_ids)
    finally:
        worker.kill()
        rec.dispose()
    return report


def _routes(primary: str, fallback: str) -> dict[str, Any]:
    """The run's route file: every default executor on the simulator, plus the motion pair."""
    routes: dict[str, Any] = {name: {} for name in sorted(DEFAULT_EXECUTORS)}
    routes[primary] = {
        "breaker": {
            "window": "30s",
            "min_calls": 3,
            "error_rate": 0.5,
            "open_for": "15s",
            "quality_min_reviews": 4,
            "quality_pass_rate": 0.5,
        },
        "fallbacks": [fallback],
        # The simulator's server_error habit answers 503 before accepting anything: this "vendor" documents
        # its 503 as "down, not taken". A route lists a status only where its vendor says so.
        "refused_statuses": [503],
        "timeouts": {"request": "2s"},
        "max_accept_seconds": 3.0,
    }
    routes[fallback] = {
        "regression": str(REGRESSION),
        "convert": {"aspect": "aspect_ratio"},
        "qualification_max_age": "1d",
    }
    return {"routes": routes}


def _configure(vendor: str, config: dict[str, Any]) -> None:
    httpx.put(f"{vendor}/admin/config", json=config, timeout=10).raise_for_status()


async def _errors_then_timeouts(
    vendor: str, base: dict[str, Any], primary: str, episodes: int, start: Any, rec: Any, report: OutageReport
) -> None:
    """Start the episodes; once shots are coming in, 503 every submit, then hang every call, then recover."""
    for n in range(episodes):
        await start(n)
    report.episodes = episodes
    await _wait_for(lambda: _outcomes_on(rec, primary) >= 2, 90.0)
    down = {
        **base,
        "executors": {**base["executors"], primary: {"server_error": 1.0, "server_error_status": 503}},
    }
    _configure(vendor, down)
    report.failed_at = time.time()
    await _wait_for(lambda: _changed(rec, report.fallback, "canary_passed"), 60.0)
    hung = {**base, "executors": {**base["executors"], primary: {"hang": 1.0}}}
    _configure(vendor, hung)  # the vendor stops answering at all: a probe meets a timeout
    await asyncio.sleep(20.0)
    _configure(vendor, base)  # back: what is still in flight at the primary reconciles there


async def _quality_collapse(
    vendor: str, base: dict[str, Any], primary: str, episodes: int, start: Any, rec: Any, report: OutageReport
) -> None:
    """The first two episodes' first shots are all judged unusable (their remakes pass); the other episodes
    start once the primary's breaker has opened."""
    first = min(2, episodes)
    blamed = json.dumps(
        {
            "scores": {"visual": 0.2},
            "blame": {"visual": [f"motion/S{i:02d}" for i in range(1, report.shots + 1)]},
            "reasons": ["after the vendor's model update, faces melt"],
        }
    )
    rules = [{"match": '"motion/S01": 2', "content": PASS}]  # a remade shot (version 2) is fine: first match
    rules += [{"match": f'outage drill episode {n + 1}"', "content": blamed} for n in range(first)]
    _configure(vendor, {**base, "chat_script": rules})
    report.failed_at = time.time()
    for n in range(first):
        await start(n)
    await _wait_for(lambda: _changed(rec, primary, "opened"), 120.0)
    for n in range(first, episodes):
        await start(n)
    report.episodes = episodes


async def _wait_for(ready: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not await asyncio.to_thread(ready):
        await asyncio.sleep(0.2)


def _outcomes_on(rec: Any, route: str) -> int:
    """How many calls to ``route`` brought an output (its breaker's own observations)."""
    return int(rec.observations(route).get("ok", 0))


def _changed(rec: Any, route: str, kind: str) -> bool:
    return any(c["kind"] == kind for c in rec.route_changes(route, 100))


def _tally(report: OutageReport, rec: Any, vendor: str, task_ids: list[str]) -> None:
    for tid in task_ids:
        events = rec.read_events(tid)
        state = fold(events).state.value
        report.end_states[state] = report.end_states.get(state, 0) + 1
        report.ledger_total += vendor_spend(events)
        made = {e.operation_key for e in events if e.type == "Outcome"}
        for e in events:
            route = e.payload.get("route") if e.type == "Intent" else None
            if route in (report.primary, report.fallback) and e.operation_key in made:
                if route == report.primary:
                    report.shots_primary += 1
                else:
                    report.shots_fallback += 1
    report.duplicate_charges, report.vendor_total = vendor_charges(vendor, task_ids)
    primary = rec.route_changes(report.primary, 200)  # newest first: a kind's first is its last row
    fallback = rec.route_changes(report.fallback, 200)
    for rows, kind, attr in (
        (primary, "opened", "opened_at"),
        (fallback, "switched", "switched_at"),
        (fallback, "canary_passed", "canary_passed_at"),
    ):
        first = next((c for c in reversed(rows) if c["kind"] == kind), None)
        if first is not None:
            setattr(report, attr, first["recorded_at"].timestamp())
            if kind == "opened":
                report.opened_reason = first["reason"]
    report.closed_again = any(c["kind"] == "closed" for c in primary)
