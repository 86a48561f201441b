"""Every rule table that has decided something, by version: what the audit recomputes each INTENT with.

Each INTENT records the version of the table that decided it (``Intent.rules``; today's is
``rules.table.RULES_VERSION``). An audit must recompute a decision with the table that made it, so an old
table stays importable for as long as a ledger holds INTENTs it decided. To change what the table decides:

1. copy today's ``rules/table.py`` to ``rules/table_v{N}.py`` (N = today's ``RULES_VERSION``), unchanged —
   or, where the change only adds a rule or an input, express table N as today's with that part turned off
   (as ``_decide_v1`` below), which is exact and keeps one copy of the rules;
2. map N to that module's ``decide`` in ``_TABLES`` below;
3. change ``rules/table.py`` and bump ``RULES_VERSION``.

``rules.recompute`` then recomputes old INTENTs with their own table and reports apart (informational) where
today's table would decide differently.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Final

from rules.actions import Action
from rules.projection import Projection
from rules.table import RULES_VERSION, decide

Decide = Callable[[Projection, datetime], tuple[str, Action] | None]


def _decide_v8(p: Projection, now: datetime) -> tuple[str, Action] | None:
    """Table 8: today's without what table 9 added — a person's approval before a lost output is made again
    (table 8 made it again at once). Exact: a node whose output was never lost is decided the same."""
    lost = [p.nodes[n] for n in p.stale if p.nodes[n].lost_pending]  # never true outside ``stale``
    for n in lost:
        n.lost_pending = False
    try:
        return decide(p, now)
    finally:
        for n in lost:
            n.lost_pending = True


def _decide_v7(p: Projection, now: datetime) -> tuple[str, Action] | None:
    """Table 7: today's without what table 8 added — people's waivers of a review's findings (none could be
    made then). Exact: a review nobody waived is answered the same under both. (Skips and restores change the
    fold, not the table: a node a person skipped counts as done under every table.)"""
    waived = p.review.waived if p.review is not None else frozenset()
    if p.review is not None:
        p.review.waived = frozenset()
    try:
        return _decide_v8(p, now)
    finally:
        if p.review is not None:
            p.review.waived = waived


def _decide_v6(p: Projection, now: datetime) -> tuple[str, Action] | None:
    """Table 6: today's without what table 7 added — re-routes (no node could be re-routed then). Exact."""
    routes = {n.id: (n.route, n.route_price) for n in p.nodes.values() if n.route is not None}
    for node_id in routes:
        p.nodes[node_id].route, p.nodes[node_id].route_price = None, None
    try:
        return _decide_v7(p, now)
    finally:
        for node_id, (route, price) in routes.items():
            p.nodes[node_id].route, p.nodes[node_id].route_price = route, price


def _decide_v5(p: Projection, now: datetime) -> tuple[str, Action] | None:
    """Table 5: today's without what table 6 added — a person's edits in a node's request (no edit could be
    made then). Exact: a node never edited is asked the same under both."""
    edits = {n.id: n.edits for n in p.nodes.values() if n.edits}
    for node_id in edits:
        p.nodes[node_id].edits = {}
    try:
        return _decide_v6(p, now)
    finally:
        for node_id, kept in edits.items():
            p.nodes[node_id].edits = kept


def _decide_v4(p: Projection, now: datetime) -> tuple[str, Action] | None:
    """Table 4: today's without what table 5 added — people's notes in a node's next request (its requests
    carried none). Exact: a node with no notes is asked the same under both."""
    notes = {n.id: n.notes for n in p.nodes.values() if n.notes}
    for node_id in notes:
        p.nodes[node_id].notes = ()
    try:
        return _decide_v5(p, now)
    finally:
        for node_id, kept in notes.items():
            p.nodes[node_id].notes = kept


def _decide_v3(p: Projection, now: datetime) -> tuple[str, Action] | None:
    """Table 3: today's without what table 4 added — a person's pause (no task could be paused then).
    Exact: a task never paused decides the same under both."""
    paused, p.paused_by = p.paused_by, None
    try:
        return _decide_v4(p, now)
    finally:
        p.paused_by = paused


def _decide_v2(p: Projection, now: datetime) -> tuple[str, Action] | None:
    """Table 2: today's table without what table 3 added — admission at the worst credible cost (it admitted
    every node at its plan's estimate: no price book, no observed price). Exact: with no price book, table 3
    prices every node at its estimate."""
    book, p.prices = p.prices, None
    try:
        return _decide_v3(p, now)
    finally:
        p.prices = book


def _decide_v1(p: Projection, now: datetime) -> tuple[str, Action] | None:
    """Table 1: table 2 without what it added — backpressure (it ignored the human load a task's INTENTs
    recorded) and compensation (it decided nothing once the task was terminal). Everything else is
    unchanged, so this is exact and needs no copy of the old module."""
    if p.terminal:
        return None
    reading, p.pressure = p.pressure, None
    try:
        return _decide_v2(p, now)
    finally:
        p.pressure = reading


# version -> that table's ``decide``. Today's table is always here under today's version.
_TABLES: Final[dict[int, Decide]] = {
    1: _decide_v1,
    2: _decide_v2,
    3: _decide_v3,
    4: _decide_v4,
    5: _decide_v5,
    6: _decide_v6,
    7: _decide_v7,
    8: _decide_v8,
    RULES_VERSION: decide,
}
_today: list[int] = [RULES_VERSION]  # a one-slot box: ``registered(..., today=True)`` swaps it for a block


def table(version: int) -> Decide | None:
    """The ``decide`` of rule table ``version``, or None if no such table is registered."""
    return _TABLES.get(version)


def today() -> tuple[int, Decide]:
    """Today's table: its version and its ``decide``."""
    version = _today[0]
    return version, _TABLES[version]


def versions() -> tuple[int, ...]:
    return tuple(sorted(_TABLES))


@contextmanager
def registered(version: int, decide_fn: Decide, *, as_today: bool = False) -> Iterator[None]:
    """Register a table for the duration of the block (and, with ``as_today``, make it today's).

    For tests and what-if audits: a rule changed on purpose. Outside such a block, tables are registered by
    ``_TABLES`` only.
    """
    before, before_today = _TABLES.get(version), _today[0]
    _TABLES[version] = decide_fn
    if as_today:
        _today[0] = version
    try:
        yield
    finally:
        _today[0] = before_today
        if before is None:
            del _TABLES[version]
        else:
            _TABLES[version] = before
