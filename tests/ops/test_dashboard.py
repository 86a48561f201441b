"""The worker as deployed (``python worker.py`` with LEDGERFLOW_METRICS_PORT) serves /healthz and one
/metrics carrying the ledger's metrics and the Temporal SDK's, and every query of the Grafana dashboard
(ops/grafana/ledgerflow.json) names a metric that scrape exposes."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import httpx
from metricskit import ROOT, scrape, worker_process
from temporalio.client import Client

from ledger.recorder import Recorder
from ledgerflow.stack.pg import free_port
from rules.plan import load_plan
from vendors.routes import DEFAULT_ROUTES
from workflows.contracts import TaskInput, workflow_id
from workflows.task import TaskWorkflow

DASHBOARD = ROOT / "ops" / "grafana" / "ledgerflow.json"
PLAN = """
goal: one paragraph
budget_ceiling: 1
stages:
  - {id: text, executor: llm.text, estimate: 0.1}
"""

# PromQL words that are not metric names: functions are recognised by the "(" after them.
KEYWORDS = frozenset(
    {
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "and",
        "or",
        "unless",
        "offset",
        "inf",
        "nan",
    }
)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: every identifier left once string literals, label
    matchers, grouping lists, ranges and durations, numbers, functions and keywords are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', " ", expr)  # strings: quantile labels, regexes
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # ranges and subqueries
    expr = re.sub(r"\$\w+", " ", expr)  # Grafana variables
    names = set()
    for m in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", expr):
        word, call = m.group(1), m.group(2)
        if not call and word not in KEYWORDS:
            names.add(word)
    return names


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expr) of every panel target (rows' nested panels too) and every templating query."""
    out = []

    def panels(items: list[dict[str, Any]]) -> None:
        for panel in items:
            for target in panel.get("targets", []):
                out.append((f"panel {panel['title']!r}", target["expr"]))
            panels(panel.get("panels", []))

    panels(dashboard["panels"])
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]
            expr = query["query"] if isinstance(query, dict) else query
            label_values = re.fullmatch(r"label_values\((.*),\s*\w+\)", expr)  # (selector, label)
            out.append((f"variable {var['name']!r}", label_values.group(1) if label_values else expr))
    return out


def test_metric_names_are_extracted_from_promql() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le) (rate(temporal_x_bucket{namespace="a:b"}[$__rate_interval])))'
        " / on (project) group_left max by (project) (ledgerflow_y_total offset 5m) > bool 0 or vector(1)"
    )
    assert metric_names(expr) == {"temporal_x_bucket", "ledgerflow_y_total"}


async def test_the_worker_serves_both_kinds_of_metrics_and_every_dashboard_query_names_one(
    temporal: Client,
    pg_url: str,
    simulator_url: str,
    sim_key: str,
    tmp_path: Path,
    recorder: Recorder,  # the ledger's schema (the worker never runs DDL)
) -> None:
    port, queue = free_port(), f"q-{uuid.uuid4().hex[:10]}"
    env = {
        "LEDGERFLOW_TEMPORAL_ADDRESS": temporal.service_client.config.target_host,
        "LEDGERFLOW_TASK_QUEUE": queue,
        "LEDGERFLOW_DATABASE_URL": pg_url,
        "LEDGERFLOW_VENDOR_URL": simulator_url,
        "LEDGERFLOW_VENDOR_API_KEY": sim_key,
        "LEDGERFLOW_LLM_API_KEY": sim_key,
        "LEDGERFLOW_ARTIFACT_DIR": str(tmp_path / "artifacts"),
        "LEDGERFLOW_STATE_DIR": str(tmp_path / "state"),
        "LEDGERFLOW_ENV": "dev",
        "LEDGERFLOW_METRICS_PORT": str(port),
        "LEDGERFLOW_METRICS_SDK_PORT": str(free_port()),
    }
    base = f"http://127.0.0.1:{port}"
    async with worker_process(env, tmp_path / "worker.log", base):
        plan = load_plan(PLAN, DEFAULT_ROUTES, task_id=f"t-{uuid.uuid4().hex[:12]}")
        assert plan.task_id is not None
        handle = await temporal.start_workflow(
            TaskWorkflow.run,
            TaskInput(task_id=plan.task_id, plan=plan),
            id=workflow_id(plan.task_id),
            task_queue=queue,
        )
        assert (await handle.result()).state == "Completed"
        async with httpx.AsyncClient() as http:
            r = await http.get(f"{base}/healthz")
            assert (r.status_code, r.json()) == (200, {"status": "ok"})
        m = await scrape(base)

    assert m.value("ledgerflow_ledger_up") == 1
    # The SDK's metrics, relayed: this worker ran the task's workflow tasks and activities.
    assert m.series(
        "temporal_workflow_task_execution_latency_count", task_queue=queue, workflow_type="TaskWorkflow"
    )
    assert m.series("temporal_activity_execution_latency_count", task_queue=queue, activity_type="stage.run")

    dashboard = json.loads(DASHBOARD.read_text())
    found = queries(dashboard)
    assert len(found) >= 12
    for where, expr in found:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        missing = names - m.names
        assert not missing, f"{where}: {sorted(missing)} not in the worker's /metrics"
