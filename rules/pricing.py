"""What a node may really cost: the price admission reserves, not the plan author's wish.

A plan's ``estimate`` is what its author hopes a node costs. Admission reserves a node's **worst credible
cost** instead, the largest of:

* the plan's estimate;
* the **declared** bound: what the routes that may serve the stage's executor say one call costs at most
  (``per_call``, plus ``per_second`` × the stage's longest allowed output) — the dearest route of the chain,
  since a fallback may serve it;
* the **learned** price: the stage's estimate × the p95 of actual ÷ estimate over the last results of those
  routes in the ledger (``ledger.prices``);
* the **observed** price: the dearest settled operation of this stage in this task so far. A canary settles
  before its fan-out widens, so its real price prices the rest.

The first three are read once, when the task opens, and recorded in its ``TaskCreated`` event
(:class:`PriceBook`): every admission after that is a pure function of the task's events, so the audit
recomputes it. The fourth is the fold's own. A task opened before price books (``TaskCreated.prices`` None)
is admitted at its estimates, as it was decided then (rule table 2).

The bound this gives, for every scope: spend − ceiling ≤ the overrun (actual − reserved, where positive) of
the operations in flight when the last one was admitted. Each admission checks spent + reserved + its price
against the ceiling, so only what was already in flight can settle above its reservation; with a canary and a
vendor that holds its price, that is one node's overrun. ``tests/unit/test_pricing_bound.py`` checks it
over arbitrary actual costs (Hypothesis).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import Final

from pydantic import BaseModel, ConfigDict

from rules.money import QUANTUM
from rules.plan import Plan, Stage

__all__ = ["LEARN_MIN_RESULTS", "PriceBook", "RoutePrice", "StagePrice", "admission_price", "price_book"]

# Fewer settled results than this on a route teach nothing: one cheap or dear call is not a price.
LEARN_MIN_RESULTS: Final = 5


@dataclass(frozen=True, slots=True)
class RoutePrice:
    """A route's declared price (vendors.routes.Price), as the pure rules see it."""

    route: str
    per_call: Decimal = Decimal(0)
    per_second: Decimal = Decimal(0)
    per_1k_tokens: Decimal = Decimal(0)  # input or output: a route that prices tokens has no bound here
    free: bool = False  # the adapter charges nothing (``local``)

    @property
    def declared(self) -> bool:
        return self.per_call > 0 or self.per_second > 0 or self.per_1k_tokens > 0


class StagePrice(BaseModel):
    """What the routes of one stage's executor said a node costs, when the task opened."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    declared: Decimal | None = None  # the dearest route's bound for one call; None: no route declares one
    declared_route: str | None = None
    learned_ratio: Decimal | None = None  # p95 of actual ÷ estimate; None: too little history
    learned_route: str | None = None
    learned_results: int = 0


class PriceBook(BaseModel):
    """Every stage's :class:`StagePrice`, recorded in ``TaskCreated`` (an input to every admission)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stages: dict[str, StagePrice] = {}


def declared_bound(stage: Stage, price: RoutePrice) -> Decimal | None:
    """What one call of ``stage`` on this route costs at most by its declared price, or None where the
    price cannot bound it (no price; a per-second price and no longest output; a price per token)."""
    if price.free:
        return Decimal(0)
    if not price.declared or price.per_1k_tokens > 0:
        return None
    bound = price.per_call
    if price.per_second > 0:
        duration = stage.output.duration if stage.output is not None else None
        if duration is None:
            return None
        bound += price.per_second * Decimal(repr(float(duration[1])))
    return bound.quantize(QUANTUM, rounding=ROUND_CEILING)


def price_book(
    plan: Plan,
    chains: Mapping[str, Iterable[RoutePrice]],
    learned: Mapping[str, tuple[Decimal, int]],
) -> PriceBook:
    """The task's price book: for each stage, the dearest declared bound and learned ratio over the routes
    that may serve its executor (``chains``: executor -> its routes, primary first; ``learned``: route ->
    (p95 of actual ÷ estimate, results counted))."""
    stages: dict[str, StagePrice] = {}
    for stage in plan.stages:
        routes = list(chains.get(stage.executor, ()))
        declared: tuple[Decimal, str] | None = None
        for r in routes:
            bound = declared_bound(stage, r)
            if bound is not None and (declared is None or bound > declared[0]):
                declared = (bound, r.route)
        ratio: tuple[Decimal, str, int] | None = None
        for r in routes:
            got = learned.get(r.route)
            if got is None or got[1] < LEARN_MIN_RESULTS:
                continue
            if ratio is None or got[0] > ratio[0]:
                ratio = (got[0], r.route, got[1])
        stages[stage.id] = StagePrice(
            declared=declared[0] if declared else None,
            declared_route=declared[1] if declared else None,
            learned_ratio=ratio[0] if ratio else None,
            learned_route=ratio[1] if ratio else None,
            learned_results=ratio[2] if ratio else 0,
        )
    return PriceBook(stages=stages)


def admission_price(stage: Stage, book: PriceBook | None, observed: Decimal | None) -> tuple[Decimal, str]:
    """The price one node of ``stage`` is admitted and reserved at, and why (empty: the plan's estimate).

    ``book`` None (a task opened before price books): the estimate, as then. ``observed``: the dearest
    settled operation of the stage in this task so far.
    """
    if book is None:
        return stage.estimate, ""
    sp = book.stages.get(stage.id) or StagePrice()
    learned = None
    if sp.learned_ratio is not None and sp.learned_ratio > 1:
        learned = (stage.estimate * sp.learned_ratio).quantize(QUANTUM, rounding=ROUND_CEILING)
    # The dearest wins; on a tie the earlier (estimate, then declared, learned, observed) names it. Only the
    # winner's reason is written out: this runs at every dispatch decision.
    price, why = stage.estimate, ""
    for amount, kind in ((sp.declared, "declared"), (learned, "learned"), (observed, "observed")):
        if amount is not None and amount > price:
            price, why = amount, kind
    return price, _reason(why, sp)


def _reason(kind: str, sp: StagePrice) -> str:
    """Why a node was priced above its plan's estimate, for its Dispatch (``priced_by``) and a person."""
    if kind == "declared":
        return f"declared by route {sp.declared_route}"
    if kind == "learned":
        return (
            f"learned: p95 {sp.learned_ratio}× the estimate over {sp.learned_results} results "
            f"of route {sp.learned_route}"
        )
    if kind == "observed":
        return "observed: the stage's dearest result in this task"
    return ""
