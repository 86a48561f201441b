"""``ledgerflow routes``: every route of the deployment, and whether a credentials error paused it."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from ledgerflow import client as lf
from runtime.settings import Settings


def route_rows(settings: Settings) -> list[dict[str, Any]]:
    table = settings.route_table()
    rec = lf.recorder(settings)
    try:
        states = rec.route_states()
    finally:
        rec.dispose()
    rows = []
    for name, route in sorted(table.routes.items()):
        state = states.get(name)
        rows.append(
            {
                "route": name,
                "adapter": route.adapter.value,
                "base_url": route.base_url or "(LEDGERFLOW_VENDOR_URL)",
                "mode": route.mode.value,
                "key_retention_s": route.key_retention,
                "max_accept_s": route.max_accept_seconds,
                "paused": bool(state and state.paused),
                "reason": state.reason if state and state.paused else None,
                "since": state.at.isoformat() if state else None,
                "by": state.actor if state else None,
            }
        )
    return rows


def routes_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="routes", title_justify="left")
    for col in ("route", "adapter", "mode", "base url", "state"):
        table.add_column(col)
    for r in rows:
        state = f"[red]PAUSED[/red] since {r['since']}: {r['reason']}" if r["paused"] else "running"
        table.add_row(r["route"], r["adapter"], r["mode"], r["base_url"], state)
    return table
