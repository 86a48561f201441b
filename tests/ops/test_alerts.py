"""The alert rules (ops/prometheus/alerts.yml) under promtool, against series of the real exporter.

``promtool check rules`` and the rules' own unit tests (ops/prometheus/alerts_test.yml) run here, so
``make test`` runs them; the rules' order, severities and runbook anchors are read from the file; every
metric an alert names is one a real scrape exposes; and a dead letter made on the real servers, scraped from
the real exporter and replayed to promtool, fires its alert where the healthy scrape before it fired none.
promtool comes from Debian's prometheus package (``make test`` installs it); without it these tests fail.
"""

from __future__ import annotations

import functools
import re
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import yaml
from metricskit import ROOT, exporter, fresh_ledger, input_series, promtool, scrape
from test_dashboard import metric_names

from ledgerflow.views.schedules import last_success
from runtime.metrics import known_routes
from vendors.routes import deployment_table

RULES = ROOT / "ops" / "prometheus" / "alerts.yml"
UNIT_TESTS = ROOT / "ops" / "prometheus" / "alerts_test.yml"
RUNBOOKS = ROOT / "docs" / "runbooks.md"

# In order of consequence: money, then stuck work, then degraded service, then the exporter itself.
ORDER = {
    "ledgerflow-money": [
        "LedgerflowUnknownVendorCharge",
        "LedgerflowLedgerVendorMismatch",
        "LedgerflowSpendPastCeiling",
        "LedgerflowTaskSpendPastCeiling",
        "LedgerflowBillingUnreconciled",
    ],
    "ledgerflow-stuck": [
        "LedgerflowOperationOpenPastWindow",
        "LedgerflowTaskNoProgress",
        "LedgerflowDeadLettersGrowing",
        "LedgerflowScanStale",
    ],
    "ledgerflow-degraded": [
        "LedgerflowRouteBreakerOpen",
        "LedgerflowFallbackUnqualified",
        "LedgerflowHumanQueueOldWait",
        "LedgerflowRetryRateAboveBaseline",
    ],
    "ledgerflow-exporter": ["LedgerflowLedgerMetricsDown", "LedgerflowLedgerExporterNotOne"],
}

PLAIN = """
goal: one paragraph
project: {project}
budget_ceiling: 1
stages:
  - {{id: text, executor: llm.text, estimate: 0.1}}
"""
DEAD_LETTER = """
goal: a mix the vendor always fails
project: {project}
budget_ceiling: 1
stages:
  - {{id: mix, executor: audio.mix, estimate: 0.2, retries: 1}}
"""


def rules() -> dict[str, Any]:
    return yaml.safe_load(RULES.read_text())


def alerts() -> list[dict[str, Any]]:
    return [r for g in rules()["groups"] for r in g["rules"] if "alert" in r]


def run_promtool(*args: str, cwd: Path = ROOT) -> str:
    done = subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"promtool {' '.join(args)} failed:\n{out[-4000:]}"
    return out


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces as dashes."""
    out = set()
    for line in markdown.splitlines():
        if m := re.match(r"#{1,6}\s+(.*)", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def test_the_rules_pass_promtools_check_and_their_unit_tests_drive_every_alert():
    assert "SUCCESS" in run_promtool("check", "rules", str(RULES))
    assert "SUCCESS" in run_promtool("test", "rules", str(UNIT_TESTS))
    # Each alert has a case where it fires and a case where it stays silent.
    cases = [c for t in yaml.safe_load(UNIT_TESTS.read_text())["tests"] for c in t["alert_rule_test"]]
    for alert in alerts():
        name = alert["alert"]
        assert any(c["alertname"] == name and c["exp_alerts"] for c in cases), f"{name} never fires"
        assert any(c["alertname"] == name and not c["exp_alerts"] for c in cases), f"{name} never silent"


def test_alerts_come_in_order_of_consequence_each_with_a_severity_and_a_runbook():
    groups = rules()["groups"]
    assert {g["name"]: [r["alert"] for r in g["rules"] if "alert" in r] for g in groups} == ORDER
    assert [g["name"] for g in groups] == list(ORDER)
    written = anchors(RUNBOOKS.read_text())
    for alert in alerts():
        assert alert["labels"]["severity"] in {"page", "ticket"}, alert["alert"]
        path, _, anchor = alert["annotations"]["runbook"].partition("#")
        assert path == "docs/runbooks.md" and anchor in written, (alert["alert"], anchor)
    # Money pages (a route's cap or a project's ceiling); stuck work pages.
    severity = {a["alert"]: a["labels"]["severity"] for a in alerts()}
    assert severity["LedgerflowUnknownVendorCharge"] == severity["LedgerflowTaskNoProgress"] == "page"


async def test_every_metric_an_alert_names_is_one_the_real_exporter_exposes(temporal, pg_url):
    scans = functools.partial(last_success, temporal, f"q-{uuid.uuid4().hex[:8]}")  # none ran: each at 0
    with fresh_ledger(pg_url) as url, exporter(url, temporal, scans=scans) as server:
        exposed = (await scrape(server.url)).names
    recorded = {r["record"] for g in rules()["groups"] for r in g["rules"] if "record" in r}
    for rule in rules()["groups"]:
        for r in rule["rules"]:
            names = metric_names(r["expr"])
            assert names, r
            assert names <= exposed | recorded, (r.get("alert") or r.get("record"), names - exposed)


async def test_a_real_dead_letter_fires_its_alert_where_the_healthy_ledger_fired_none(
    lf_on, pg_url, sim, tmp_path
):
    """A project on a ledger of its own: one task completed (healthy), scraped; then a node that used up its
    retries (a dead letter, waiting for a person), scraped again. promtool replays the healthy scrape for 10
    minutes and the other one for 40: no alert fires on the healthy minutes, and the dead letter fires
    LedgerflowDeadLettersGrowing — because the healthy scrape already exported the project's dead letters at
    0 (a series that only appears with its first dead letter has no growth to see)."""
    project = f"a{uuid.uuid4().hex[:10]}"
    with fresh_ledger(pg_url) as url:
        async with lf_on(url) as lf:
            routes = known_routes(deployment_table(lf.settings))
            with exporter(url, lf.client, routes=routes) as server:
                assert (await lf.run(lf.plan(PLAIN.format(project=project)))).state == "Completed"
                healthy = await scrape(server.url)
                await sim.configure(executors={"audio.mix": {"fail_technical": 1.0}})
                handle = await lf.start(lf.plan(DEAD_LETTER.format(project=project)))
                await lf.wait_state(handle, {"WaitingHuman"})
                dead = await scrape(server.url)
                await handle.terminate("test over")

    assert healthy.value("ledgerflow_dead_letters_open", project=project) == 0
    assert dead.value("ledgerflow_dead_letters_open", project=project) == 1
    assert (
        dead.value("ledgerflow_failures_total", project=project, executor="audio.mix", kind="technical") == 2
    )

    # promtool's clock starts at 0, so a unix time scraped (the reconciliation's last run, a qualification)
    # means nothing to `time()` there: the one alert on such a stamp is left out of the replay.
    timeless = [a["alert"] for a in alerts() if "time()" not in a["expr"]]
    silent = [{"eval_time": "9m", "alertname": name, "exp_alerts": []} for name in timeless]
    fires = {
        "eval_time": "15m",
        "alertname": "LedgerflowDeadLettersGrowing",
        "exp_alerts": [
            {
                "exp_labels": {"severity": "ticket", "project": project},
                "exp_annotations": {
                    "summary": f"{project}: more dead letters than 30 minutes ago",
                    "description": "Nodes that used up their retries are waiting for a person (1 open).",
                    "runbook": "docs/runbooks.md#ledgerflowdeadlettersgrowing",
                },
            }
        ],
    }
    # The task waits on a person: it is not "stuck" (no progress) nor is an operation open past its window.
    quiet = [
        {"eval_time": "15m", "alertname": name, "exp_alerts": []}
        for name in (
            "LedgerflowTaskNoProgress",
            "LedgerflowOperationOpenPastWindow",
            "LedgerflowSpendPastCeiling",
        )
    ]
    replay = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "name": "a real dead letter after a healthy ledger",
                "interval": "1m",
                "input_series": input_series((healthy, 10), (dead, 40)),
                "alert_rule_test": [*silent, fires, *quiet],
            }
        ],
    }
    (tmp_path / "replay_test.yml").write_text(yaml.safe_dump(replay, sort_keys=False))
    started = time.monotonic()
    assert "SUCCESS" in run_promtool("test", "rules", "replay_test.yml", cwd=tmp_path)
    assert time.monotonic() - started < 60
