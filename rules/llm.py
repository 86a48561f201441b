"""What an LLM may propose when no rule matches, and the checks its proposal must pass to become an action.

The model never writes an action directly: it proposes ``{"action": "dispatch", "node": …}``,
``{"action": "escalate", "reason": …}`` or ``{"action": "ask_human", "reason": …}``. Everything else of the
action (operation key, attempt, estimate) is computed here from the projection, and a dispatch must name a
ready node and pass the same cost admission as the rule path. Anything else becomes a question to a person.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rules.actions import (
    Action,
    Dispatch,
    HumanDecisionType,
    HumanRequest,
    RequestKind,
    SuspendForHuman,
)
from rules.admission import admits, node_price
from rules.people import context_package
from rules.projection import Projection
from rules.table import advance, escalate, ready_nodes

ALLOWED_LLM_ACTIONS: Final = ["dispatch", "escalate", "ask_human"]


class Proposal(BaseModel):
    """The only shape of model output we accept (strict: unknown fields and wrong types are refused)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    action: str = Field(max_length=20)
    node: str | None = Field(default=None, max_length=200)
    reason: str = Field(default="", max_length=500)


# How the loop words the question it puts to a person when the model's answer cannot be used
# (workflows/task.py ``_ask_llm``); the audit (rules.recompute) reads them back: the text after is the reason.
MODEL_UNAVAILABLE: Final = "no rule matched and the model could not be asked: "
PROPOSAL_REFUSED: Final = "no rule matched and the model's proposal was refused: "


def parse_proposal(raw: Any) -> tuple[Proposal | None, str | None]:
    """Validate the model's JSON object; returns (proposal, None) or (None, why it was refused)."""
    try:
        proposal = Proposal.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        return None, f"invalid output: {'.'.join(map(str, first['loc'])) or 'value'}: {first['msg']}"
    if proposal.action not in ALLOWED_LLM_ACTIONS:
        return None, f"action {proposal.action[:20]!r} is not one of {ALLOWED_LLM_ACTIONS}"
    return proposal, None


def ask_person(p: Projection, reason: str) -> SuspendForHuman:
    """The task-stopping question put to a person when no rule matched and the model gave no usable action:
    it asked for one, its proposal was refused, or it could not be asked at all (an outage)."""
    options = (HumanDecisionType.RESUME, HumanDecisionType.ABORT)
    request = HumanRequest(
        id=f"invalid_decision:{p.watermark}",
        kind=RequestKind.INVALID_DECISION,
        reason=reason[:2000],
        options=options,
        context=context_package(p, RequestKind.INVALID_DECISION, None, options),
    )
    return SuspendForHuman(request=request)


def check_llm_action(p: Projection, raw: Any, now: datetime) -> tuple[str | None, Action | None]:
    """Turn a proposal into an action the loop may take, or say why not."""
    if raw is None:
        return "the model gave no usable output", None
    proposal, problem = parse_proposal(raw)
    if proposal is None:
        return problem, None
    if proposal.action == "escalate":
        return None, escalate(p, f"model escalated: {proposal.reason or 'no reason given'}")
    if proposal.action == "ask_human":
        return None, ask_person(p, f"model asks a person: {proposal.reason or 'no reason given'}")
    ready = {n.id: n for n in ready_nodes(p)}
    if proposal.node not in ready:
        return f"node {str(proposal.node)[:60]!r} is not ready to dispatch", None
    node = ready[proposal.node]
    stage = p.graph.nodes[node.id].stage
    price, why = node_price(p, stage)
    if not admits(p, price):
        priced = f"estimate {price}" if not why else f"price {price}, {why}"
        return f"dispatch of {node.id} refused by cost admission ({priced})", None
    # The same path as R11: a gated node gets its static gate first; nothing the model says skips it.
    action = advance(p, node, now)
    if isinstance(action, Dispatch):
        action = action.model_copy(update={"reason": f"model: {proposal.reason[:200]}"})
    return None, action
