"""Rich renderings of a task's status and events (the CLI's tables)."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

from rich.table import Table

from rules.envelope import StoredEvent


def stage_rows(summary: dict[str, Any]) -> list[tuple[str, int, int, int, Decimal]]:
    """Per stage: (stage, nodes, succeeded, attempts, cost), in plan order."""
    rows: dict[str, list[Any]] = {}
    for node_id, node in summary["nodes"].items():
        stage = node_id.split("/", 1)[0]
        row = rows.setdefault(stage, [stage, 0, 0, 0, Decimal(0)])
        row[1] += 1
        row[2] += node["status"] == "succeeded"
        row[3] += node["attempts"]
        row[4] += Decimal(node["spent"])
    return [tuple(r) for r in rows.values()]


def stage_states(summary: dict[str, Any]) -> dict[str, str]:
    """Per stage, its nodes' states in plain words ("2 running, 1 waiting for a person")."""
    words = {"waiting_human": "waiting for a person", "leased": "about to start"}
    counts: dict[str, dict[str, int]] = {}
    for node_id, node in summary["nodes"].items():
        state = node.get("state", node["status"])
        per = counts.setdefault(node_id.split("/", 1)[0], {})
        per[state] = per.get(state, 0) + 1
    return {
        stage: ", ".join(f"{n} {words.get(state, state)}" for state, n in per.items())
        for stage, per in counts.items()
    }


def status_table(summary: dict[str, Any]) -> Table:
    if "nodes" not in summary:  # the workflow has not opened the task in the ledger yet
        return Table(title=f"task {summary.get('task_id')} — {summary.get('state')}", title_justify="left")
    title = (
        f"task {summary['task_id']} — {summary['state']} — spent {summary['spent']} "
        f"(reserved {summary['reserved']}) of {summary['ceiling']}"
    )
    if summary.get("paused_by"):
        title += f" — paused by {summary['paused_by']}"
    if (admission := summary.get("admission")) and admission.get("waiting"):
        title += f" — waiting for admission, {admission.get('ahead', 0)} ahead"
    table = Table(title=title, title_justify="left")
    for col in ("stage", "nodes", "done", "attempts", "cost", "now"):
        table.add_column(col, justify="left" if col in ("stage", "now") else "right")
    states = stage_states(summary)
    for stage, nodes, done, attempts, cost in stage_rows(summary):
        table.add_row(stage, str(nodes), str(done), str(attempts), str(cost), states.get(stage, ""))
    for r in summary.get("open_requests", []):
        table.add_row(f"[yellow]waiting: {r['id']}[/yellow]", "", "", "", r.get("deadline") or "")
    return table


def events_table(events: list[StoredEvent]) -> Table:
    table = Table(title=f"{len(events)} events of task {events[0].task_id}" if events else "no events")
    for col in ("seq", "recorded_at", "type", "epoch", "detail"):
        table.add_column(col)
    for e in events:
        detail = {k: v for k, v in e.payload.items() if k not in ("plan",)}
        if "action" in detail and isinstance(detail["action"], dict):
            a = detail["action"]
            detail = {
                "rule": detail.get("rule"),
                "action": a.get("kind"),
                "node": a.get("node") or ",".join(a.get("targets") or ()) or None,
            }
        text = json.dumps(detail, default=str)
        table.add_row(
            str(e.seq), e.recorded_at.strftime("%H:%M:%S.%f")[:-3], e.type, str(e.epoch), text[:100]
        )
    return table
