"""Which route serves a dispatch, and how a route's circuit breaker moves — pure functions over what was read.

Every executor has a primary route and may list fallbacks (``vendors/routes.py``). A route's health is shared
by every worker and task: one row per route in the ledger's database (``route_breakers``), read in the same
statement that fences and reserves a dispatch's INTENT, and recorded in that INTENT (``Intent.route_basis``),
so the choice is recomputed by ``choose`` from the task's own record (``ledgerflow audit``).

The breaker of a route::

    closed ──(error rate ≥ limit over the window, or first-pass review rate < limit)──▶ open
    open ──(open_for elapsed: the next dispatch is the probe)──▶ half_open
    half_open ──(the probe succeeds)──▶ closed      half_open ──(the probe fails)──▶ open

A fallback serves only while it is qualified (a passed regression run no older than its ``max_age``) and
its own breaker lets it. The first dispatch a fallback takes during a primary's outage (the outage is
named by the primary's ``opened_at``) is its canary: every other dispatch waits until the canary's output
passed its node check (an Outcome) — a canary that fails frees the claim for the next dispatch.

Nothing here reads a clock or the database: the caller passes ``now`` (the database's clock) and the rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Final, Literal


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Observation(StrEnum):
    """What one vendor call, or one review of a route's output, told about the route."""

    OK = "ok"  # an attempt's output arrived (an Outcome)
    ERROR = "error"  # a 5xx, a reset connection, a technical failure of the job
    TIMEOUT = "timeout"  # no answer within the route's timeout
    ANOMALY = "anomaly"  # a cost figure the ledger could not take as billed
    REVIEW_PASS = "review_pass"  # the output was not flagged by its first review
    REVIEW_FAIL = "review_fail"  # the output was flagged by its first review
    # An attempt that ended without an output for a reason that is not the route's health (a refused request,
    # an output outside its bounds, a void): counted in no rate, but it ends a probe or a canary unproven.
    SETTLED = "settled"


FAILURES: Final = frozenset({Observation.ERROR, Observation.TIMEOUT, Observation.ANOMALY})
CALLS: Final = FAILURES | {Observation.OK}


@dataclass(frozen=True)
class BreakerPolicy:
    """When a route's breaker trips, and for how long (a route file's ``breaker:``)."""

    window_s: float = 60.0  # calls counted for the error rate
    min_calls: int = 4  # fewer calls in the window never trip it
    error_rate: float = 0.5  # failures / calls at or above this trips it
    open_for_s: float = 30.0  # an open breaker's rest before its half-open probe
    quality_window_s: float = 3600.0  # first-pass reviews counted for the pass rate
    quality_min_reviews: int = 4
    quality_pass_rate: float = 0.5  # a first-pass review rate below this trips it

    @property
    def widest_s(self) -> float:
        """The longest window any count of this route reads back."""
        return max(self.window_s, self.quality_window_s)


@dataclass(frozen=True)
class RouteHealth:
    """One route's shared state, as a ``route_breakers`` row holds it (no row: closed, never qualified)."""

    route: str
    state: BreakerState = BreakerState.CLOSED
    since: datetime | None = None  # when it entered ``state``
    opened_at: datetime | None = None  # when the current outage began (closed → open); names the outage
    reason: str = ""
    probe_key: str | None = None  # half-open: the OperationKey that holds the probe
    canary_key: str | None = None  # as a fallback: the OperationKey of its canary …
    canary_outage: datetime | None = None  # … during the primary's outage that began then
    canary_passed: bool = False
    qualified_at: datetime | None = None  # its last passed regression run (None: never, or since failed)
    version: int = 0  # bumped by every change: claims are optimistic (UPDATE … WHERE version = read)

    def as_basis(self) -> dict[str, Any]:
        """What an INTENT records of this row (JSON-ready)."""

        def iso(t: datetime | None) -> str | None:
            return t.isoformat() if t is not None else None

        return {
            "state": self.state.value,
            "since": iso(self.since),
            "opened_at": iso(self.opened_at),
            "reason": self.reason,
            "probe_key": self.probe_key,
            "canary_key": self.canary_key,
            "canary_outage": iso(self.canary_outage),
            "canary_passed": self.canary_passed,
            "qualified_at": iso(self.qualified_at),
            "version": self.version,
        }

    @classmethod
    def from_basis(cls, route: str, raw: Mapping[str, Any]) -> RouteHealth:
        def at(key: str) -> datetime | None:
            value = raw.get(key)
            return datetime.fromisoformat(value) if isinstance(value, str) else value

        return cls(
            route=route,
            state=BreakerState(raw.get("state", "closed")),
            since=at("since"),
            opened_at=at("opened_at"),
            reason=str(raw.get("reason") or ""),
            probe_key=raw.get("probe_key"),
            canary_key=raw.get("canary_key"),
            canary_outage=at("canary_outage"),
            canary_passed=bool(raw.get("canary_passed")),
            qualified_at=at("qualified_at"),
            version=int(raw.get("version") or 0),
        )


@dataclass(frozen=True)
class Candidate:
    """A route that may serve an executor: its name, its breaker's rest, and (a fallback) how long a
    qualification stays good."""

    route: str
    open_for_s: float = 30.0
    max_age_s: float | None = None  # None: the primary (no qualification needed)


Claim = Literal["probe", "canary"]


@dataclass(frozen=True)
class Choice:
    """Where a dispatch goes. ``route`` None: nowhere yet — wait ``retry_s`` and ask again."""

    route: str | None
    reason: str
    claim: Claim | None = None  # what this dispatch takes on the route (a row change, made with the INTENT)
    retry_s: float = 0.0


def qualified(c: Candidate, h: RouteHealth, now: datetime) -> bool:
    if c.max_age_s is None:
        return True
    return h.qualified_at is not None and now - h.qualified_at <= timedelta(seconds=c.max_age_s)


def choose(chain: Sequence[Candidate], rows: Mapping[str, RouteHealth], now: datetime, key: str) -> Choice:
    """The route for dispatch ``key`` of an executor whose routes are ``chain`` (primary first), given every
    route's row as read with the INTENT. Deterministic: the same rows, time and key give the same choice."""
    primary = chain[0]
    p = rows.get(primary.route) or RouteHealth(primary.route)
    waits: list[float] = []
    reasons: list[str] = []
    for i, c in enumerate(chain):
        h = rows.get(c.route) or RouteHealth(c.route)
        if not qualified(c, h, now):
            reasons.append(f"{c.route} is not qualified")
            continue
        if h.state == BreakerState.HALF_OPEN:
            if h.probe_key == key:
                return Choice(c.route, f"{c.route}: this dispatch is its probe")
            reasons.append(f"{c.route} is half-open (its probe is out)")
            continue
        if h.state == BreakerState.OPEN:
            rest = _rest_left(h, c.open_for_s, now)
            if rest > 0:
                waits.append(rest)
                reasons.append(f"{c.route} is open ({h.reason})")
                continue
            return Choice(c.route, f"{c.route}: probe after {c.open_for_s:g}s open", claim="probe")
        if i == 0:
            return Choice(c.route, f"{c.route}: primary, closed")
        # A closed, qualified fallback while the primary is not serving: its canary first.
        outage = p.opened_at
        if h.canary_outage != outage or h.canary_key is None:
            why = f"{c.route}: canary for {primary.route}'s outage ({'; '.join(reasons)})"
            return Choice(c.route, why, claim="canary")
        if h.canary_key == key or h.canary_passed:
            return Choice(c.route, f"{c.route}: fallback, canary passed or own")
        waits.append(1.0)
        reasons.append(f"{c.route} waits for its canary {h.canary_key}")
        break  # the fallback serves once its canary passed: the rest wait, not a later fallback
    retry = min(waits) if waits else 5.0
    return Choice(None, "; ".join(reasons) or "no route can serve", retry_s=max(0.5, min(retry, 30.0)))


def _rest_left(h: RouteHealth, open_for_s: float, now: datetime) -> float:
    if h.since is None:
        return 0.0
    return (h.since + timedelta(seconds=open_for_s) - now).total_seconds()


def claimed(h: RouteHealth, choice: Choice, key: str, now: datetime, outage: datetime | None) -> RouteHealth:
    """The row after ``choice``'s claim (written with the INTENT; the version check makes it exclusive)."""
    if choice.claim == "probe":
        return replace(h, state=BreakerState.HALF_OPEN, since=now, probe_key=key, version=h.version + 1)
    if choice.claim == "canary":
        return replace(
            h,
            canary_key=key,
            canary_outage=outage,
            canary_passed=False,
            version=h.version + 1,
        )
    return h


@dataclass(frozen=True)
class Window:
    """Counts of a route's observations in its windows, read when a failure (or a failed review) arrives."""

    calls: int = 0
    failures: int = 0
    reviews: int = 0
    passed: int = 0


def observed(
    h: RouteHealth, what: Observation, key: str, window: Window, policy: BreakerPolicy, now: datetime
) -> tuple[RouteHealth, str | None]:
    """The route's row after an observation, and the change to log (None: nothing changed)."""
    failed = what in FAILURES or what == Observation.REVIEW_FAIL
    ends = what in CALLS or what == Observation.SETTLED
    if h.state == BreakerState.HALF_OPEN and h.probe_key == key and ends:
        if what == Observation.OK:
            return _moved(h, BreakerState.CLOSED, now, f"probe {key} succeeded"), "closed"
        return _moved(h, BreakerState.OPEN, now, f"probe {key} failed ({what.value})"), "opened"
    if h.canary_key == key and not h.canary_passed and ends:
        if what == Observation.OK:
            return replace(h, canary_passed=True, version=h.version + 1), "canary_passed"
        return replace(h, canary_key=None, version=h.version + 1), "canary_failed"
    if h.state != BreakerState.CLOSED or not failed:
        return h, None
    if what in FAILURES and window.calls >= policy.min_calls:
        rate = window.failures / window.calls
        if rate >= policy.error_rate:
            why = f"{window.failures} of {window.calls} calls failed in {policy.window_s:g}s"
            return _opened(h, now, why), "opened"
    if what == Observation.REVIEW_FAIL and window.reviews >= policy.quality_min_reviews:
        rate = window.passed / window.reviews
        if rate < policy.quality_pass_rate:
            why = (
                f"quality collapse: {window.passed} of {window.reviews} outputs passed their first review"
                f" (below {policy.quality_pass_rate:.0%})"
            )
            return _opened(h, now, why), "opened"
    return h, None


def _opened(h: RouteHealth, now: datetime, reason: str) -> RouteHealth:
    return replace(
        h,
        state=BreakerState.OPEN,
        since=now,
        opened_at=now,
        reason=reason,
        probe_key=None,
        version=h.version + 1,
    )


def _moved(h: RouteHealth, state: BreakerState, now: datetime, reason: str) -> RouteHealth:
    """A probe's result: closed ends the outage; open starts another rest (the same outage)."""
    return replace(
        h,
        state=state,
        since=now,
        reason=reason,
        probe_key=None,
        opened_at=None if state == BreakerState.CLOSED else h.opened_at,
        version=h.version + 1,
    )


def convert(request: Mapping[str, Any], mapping: Mapping[str, str]) -> dict[str, Any]:
    """A fallback's input conversion: each ``from: to`` renames a request field (absent fields are left)."""
    out = dict(request)
    for old, new in mapping.items():
        if old in out:
            out[new] = out.pop(old)
    return out


def first_reviews(events: Sequence[Any], flagged: Sequence[str]) -> list[tuple[str, str, bool]]:
    """The routed outputs a review now judges for the first time: ``(route, operation_key, passed)`` for
    each node whose current Outcome came after the previous review (earlier outputs were judged then), made
    by an operation whose INTENT chose a route; ``passed``: the review did not flag the node."""
    routes: dict[str, str] = {}
    current: dict[str, tuple[int, str]] = {}  # node -> (seq, operation_key) of its latest Outcome
    last_review = 0
    for e in events:
        if e.type == "Intent" and e.operation_key and isinstance(e.payload.get("route"), str):
            routes[e.operation_key] = e.payload["route"]
        elif e.type == "Outcome" and e.operation_key and not e.payload.get("reused_from"):
            current[e.payload["node"]] = (e.seq, e.operation_key)
        elif e.type == "ExecutionResult" and e.payload.get("kind") == "review":
            last_review = e.seq
    out = []
    for node, (seq, key) in sorted(current.items()):
        if seq > last_review and key in routes:
            out.append((routes[key], key, node not in flagged))
    return out


def recompute(intent: Mapping[str, Any]) -> Choice | None:
    """The choice an INTENT's recorded routing inputs give (None: the INTENT was not routed): the audit
    compares its route and claim with what the INTENT says."""
    chain = intent.get("route_chain") or ()
    basis = intent.get("route_basis")
    at, key = (
        intent.get("route_at"),
        intent.get("operation_key") or intent.get("action", {}).get("operation_key"),
    )
    if not chain or basis is None or at is None or key is None:
        return None
    candidates = tuple(Candidate(r, float(o), None if m is None else float(m)) for r, o, m in chain)
    rows = {r: RouteHealth.from_basis(r, raw) for r, raw in basis.items()}
    now = at if isinstance(at, datetime) else datetime.fromisoformat(at)
    return choose(candidates, rows, now, key)


# ── a route's concurrency quota, shared by every task: who gets the next slot ─────────────────────────────
PRIORITY_CLASS: Final = {"hero": 0, "standard": 1, "background": 2}


@dataclass(frozen=True)
class Waiter:
    """A dispatch waiting for a slot on a full route (a ``route_waiters`` row)."""

    key: str
    priority: str = "standard"
    deadline: datetime | None = None
    since: datetime | None = None  # when it first asked


def rank(w: Waiter, now: datetime, aging_s: float) -> tuple[float, datetime, str]:
    """Smaller goes first: hero before standard before background, but every ``aging_s`` a dispatch has waited
    moves it up one class (so nothing starves); then the earlier deadline; then the key (a total order)."""
    waited = (now - w.since).total_seconds() if w.since is not None else 0.0
    aged = PRIORITY_CLASS.get(w.priority, 1) - (waited / aging_s if aging_s > 0 else 0.0)
    far = datetime.max.replace(tzinfo=now.tzinfo)
    return (aged, w.deadline or far, w.key)


@dataclass(frozen=True)
class Grant:
    """Whether dispatch ``me`` takes a slot now; ``ahead`` waiters rank before it (free slots go to them)."""

    granted: bool
    used: int
    limit: int
    ahead: int
    reason: str


def grant(
    me: Waiter, used: int, limit: int, waiters: Sequence[Waiter], now: datetime, aging_s: float
) -> Grant:
    """A slot for ``me`` if one is free after every waiter that ranks before it had theirs."""
    mine = rank(me, now, aging_s)
    ahead = sum(1 for w in waiters if w.key != me.key and rank(w, now, aging_s) < mine)
    free = limit - used
    if free > ahead:
        return Grant(True, used, limit, ahead, f"slot {used + 1} of {limit}")
    why = f"{used} of {limit} slots in use, {ahead} waiting before it ({me.priority})"
    return Grant(False, used, limit, ahead, why)
