"""Pre-dispatch cost admission, shared by the rule path and the LLM path (docs/design.md#cost-admission)."""

from __future__ import annotations

from decimal import Decimal

from rules.plan import INFERENCE_RESERVE, Stage
from rules.pricing import admission_price
from rules.projection import Projection

__all__ = ["INFERENCE_RESERVE", "admits", "headroom", "node_price"]


def node_price(p: Projection, stage: Stage) -> tuple[Decimal, str]:
    """What one node of ``stage`` is admitted at now, and why: the worst credible cost (rules.pricing) from
    the task's price book and the stage's dearest result so far."""
    return admission_price(stage, p.prices, p.observed.get(stage.id))


def headroom(p: Projection) -> Decimal:
    """Money left for new work: ceiling − spent − outstanding reservations − the inference reserve."""
    return p.ceiling - p.spent - p.reserved - INFERENCE_RESERVE


def admits(p: Projection, estimate: Decimal) -> bool:
    """True if spent + reserved + estimated inference + this estimate fits under the task's ceiling."""
    return estimate <= headroom(p)
