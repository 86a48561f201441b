"""``ledgerflow routes``: every route of the deployment, its adapter and where that comes from (the
distribution providing the entry point: ``ledgerflow 0.1.0 (built in)``, ``acme-vendor 1.2``), whether a
credentials error paused it, its shared breaker (closed / open / half-open, and why), its fallbacks and
whether each is qualified to serve."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from rich.table import Table

from ledgerflow import client as lf
from rules import scopes
from rules.routing import BreakerState, Candidate, RouteHealth, qualified
from runtime.settings import Settings
from vendors import plugins
from vendors.routes import deployment_table


def route_rows(settings: Settings) -> list[dict[str, Any]]:
    table = deployment_table(settings)
    rec = lf.recorder(settings)
    try:
        states = rec.route_states()
        health = rec.route_health()
        # This month's account of each capped route (this machine's clock picks the month: a report).
        now = datetime.now(UTC)
        months = {a.scope: a for a in rec.accounts(scopes.ROUTE_PREFIX)}
    finally:
        rec.dispose()
    rows = []
    for name, route in sorted(table.routes.items()):
        state = states.get(name)
        h = health.get(name) or RouteHealth(name)
        fallback_of = sorted(n for n, r in table.routes.items() if name in r.fallbacks)
        rows.append(
            {
                "route": name,
                "adapter": route.adapter,
                **_origin(route.adapter),
                "base_url": route.base_url or "(LEDGERFLOW_VENDOR_URL)",
                "mode": route.mode.value,
                "key_retention_s": route.key_retention,
                "max_accept_s": route.max_accept_seconds,
                "paused": bool(state and state.paused),
                "reason": state.reason if state and state.paused else None,
                "since": state.at.isoformat() if state else None,
                "by": state.actor if state else None,
                "breaker": h.state.value,
                "breaker_since": h.since.isoformat() if h.since else None,
                "breaker_reason": h.reason or None,
                "fallbacks": list(route.fallbacks),
                "fallback_of": fallback_of,
                # as the router judges it: only a fallback needs a qualification
                "qualified": bool(fallback_of)
                and qualified(Candidate(name, max_age_s=route.qualification_max_age), h, now),
                "qualified_at": h.qualified_at.isoformat() if h.qualified_at else None,
                **_cap(name, route.monthly_cap, months, now),
            }
        )
    return rows


def _origin(adapter: str) -> dict[str, Any]:
    """Where a route's adapter comes from: the entry point and the distribution that provides it."""
    entry = plugins.find(adapter)  # the table loaded: installed, and only once
    return {
        "adapter_from": entry.origin,
        "adapter_distribution": entry.distribution or plugins.OWN_DISTRIBUTION,
        "adapter_version": entry.version,
        "adapter_built_in": entry.built_in,
        "adapter_entry_point": entry.value,
    }


def _cap(name: str, cap: Any, months: dict[str, Any], now: datetime) -> dict[str, Any]:
    """A route's monthly cap and this month's account (``route:R:YYYY-MM``: none before its first use)."""
    scope = scopes.route_month(name, now)
    account = months.get(scope)
    return {
        "monthly_cap": None if cap is None else str(cap),
        "month_scope": scope if cap is not None or account is not None else None,
        "month_ceiling": None if account is None or account.ceiling is None else str(account.ceiling),
        "month_spent": None if account is None else str(account.spent),
        "month_reserved": None if account is None else str(account.reserved),
    }


def routes_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="routes", title_justify="left")
    for col in (
        "route",
        "adapter",
        "from",
        "mode",
        "base url",
        "state",
        "breaker",
        "fallbacks",
        "monthly cap",
    ):
        table.add_column(col)
    for r in rows:
        state = f"[red]PAUSED[/red] since {r['since']}: {r['reason']}" if r["paused"] else "running"
        breaker = r["breaker"]
        if breaker != BreakerState.CLOSED.value:
            breaker = f"[red]{breaker.upper()}[/red] since {r['breaker_since']}: {r['breaker_reason']}"
        links = ", ".join(r["fallbacks"])
        if r["fallback_of"]:
            verdict = "qualified" if r["qualified"] else "[yellow]not qualified[/yellow]"
            links = f"fallback of {', '.join(r['fallback_of'])} ({verdict})"
        cap = "—"
        if r["month_scope"] is not None:
            ceiling = r["month_ceiling"] or r["monthly_cap"] or "unlimited"
            used = f"spent {r['month_spent'] or 0} + reserved {r['month_reserved'] or 0}"
            cap = f"{ceiling} this month ({used})"
        table.add_row(
            r["route"],
            r["adapter"],
            r["adapter_from"],
            r["mode"],
            r["base_url"],
            state,
            breaker,
            links or "—",
            cap,
        )
    return table


def changes_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="route changes (newest first)", title_justify="left")
    for col in ("at", "route", "change", "reason", "operation"):
        table.add_column(col)
    for r in rows:
        at = r["recorded_at"].isoformat(timespec="seconds") if r.get("recorded_at") else ""
        table.add_row(at, r["route"], r["kind"], r["reason"], r.get("operation_key") or "")
    return table
