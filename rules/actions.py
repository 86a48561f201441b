"""What the decision loop can do: five action types plus Wait (and Complete, the happy terminal, and
Compensate, which undoes an output in a failed task's compensating phase).

Actions are frozen pydantic models in a discriminated union on ``kind``, so an action recorded in an INTENT
(or proposed by an LLM) is parsed back into exactly one of them or refused.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rules.plan import TimeoutPolicy


class HumanDecisionType(StrEnum):
    """The four decisions a person can make."""

    APPROVE = "approve"
    RESUME = "resume"
    ABORT = "abort"
    ADD_BUDGET = "add_budget"


class RequestKind(StrEnum):
    """Why a person is asked."""

    APPROVAL = "approval"  # a plan approval point (e.g. storyboard approval)
    DEAD_LETTER = "dead_letter"  # a node failed in a way the rules may not repair alone
    ESCALATION = "escalation"  # the task stopped (budget, rework limit, timeout policy) and can be resumed
    INVALID_DECISION = "invalid_decision"  # the LLM's proposal failed validation or admission


class _Action(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class HumanRequest(_Action):
    """A question put to a person, with what they may answer and until when."""

    id: str
    kind: RequestKind
    reason: str = Field(max_length=2000)
    node: str | None = None
    options: tuple[HumanDecisionType, ...]
    deadline: datetime | None = None
    timeout_policy: TimeoutPolicy | None = None
    # A budget escalation: the budget scope that refused (an add_budget raises it unless it names another).
    budget_scope: str | None = None
    # What the person is shown (rules.people.context_package): failure history, spend and remaining budget,
    # the options and their effect, the artifacts concerned — as the ledger stood when the question was put.
    context: dict[str, Any] = Field(default_factory=dict)


class Dispatch(_Action):
    """Start one business attempt of a node at the vendor."""

    kind: Literal["Dispatch"] = "Dispatch"
    node: str
    attempt: int = Field(ge=1)
    operation_key: str
    executor: str
    # What admission reserved for this attempt: the node's worst credible cost (rules.pricing) …
    estimate: Decimal = Field(ge=0)
    # … the plan's own estimate, where that price is above it (None: the price is the plan's estimate), and
    # what set the price (a declared bound, a learned ratio, an observed result).
    plan_estimate: Decimal | None = None
    priced_by: str = ""
    reason: str = ""
    # Exactly what the vendor will be sent, fixed at decision time: a resubmission after a crash or a takeover
    # sends the same body under the same key (an idempotent vendor refuses a different one). Upstream outputs
    # ride in ``input["inputs"]`` as artifact references (rules.inputs), never as fetchable URLs.
    input: dict[str, Any] = Field(default_factory=dict)
    input_hash: str | None = None  # rules.inputs.input_hash(input): what the request really asks
    # An earlier output of this node made from an equal request: registered again at no cost, nothing sent.
    reuse: dict[str, Any] | None = None  # {"operation_key": …, "artifact": {…}}


class Rollback(_Action):
    """Invalidate the flagged nodes' lineage and restart from the most upstream flagged nodes (dag.py)."""

    kind: Literal["Rollback"] = "Rollback"
    targets: tuple[str, ...]
    invalidated: tuple[str, ...]
    flagged: tuple[str, ...]
    round: int = Field(ge=1)
    reason: str = ""


class SuspendForHuman(_Action):
    """Ask a person and wait on a durable timer."""

    kind: Literal["SuspendForHuman"] = "SuspendForHuman"
    request: HumanRequest


class Escalate(_Action):
    """Stop the task: terminal (Failed) or semi-terminal (Escalated; a person may resume)."""

    kind: Literal["Escalate"] = "Escalate"
    reason: str
    terminal: bool
    request: HumanRequest | None = None  # the resume question, for a semi-terminal escalation
    resolves: str | None = None  # the timed-out request whose policy this applies


class StaticGate(_Action):
    """Check a high-cost node's input artifacts, once per input version, before it may run."""

    kind: Literal["StaticGate"] = "StaticGate"
    node: str
    input_version: int
    operation_key: str


class Compensate(_Action):
    """Undo one output of a terminal task (its stage's compensation): an operation like a dispatch, with its
    own INTENT and key, run in the task's compensating phase before its end state is final."""

    kind: Literal["Compensate"] = "Compensate"
    node: str  # the node whose output it undoes
    compensates: str  # that output's operation key
    attempt: int = Field(ge=1)
    operation_key: str
    executor: str
    estimate: Decimal = Field(ge=0)
    # How far past its ceiling this undo may take the task's own scope (the stage's declared cap); every scope
    # above the task is checked as for any reservation (an undo the project cannot afford asks a person).
    overdraw: Decimal = Field(default=Decimal(0), ge=0)
    input: dict[str, Any] = Field(default_factory=dict)
    reason: str = ""


class Complete(_Action):
    """The review passed on the current composition: the task is Completed."""

    kind: Literal["Complete"] = "Complete"
    verdict: str


class Wait(_Action):
    """Nothing to do until an event arrives or ``until`` passes."""

    kind: Literal["Wait"] = "Wait"
    until: datetime | None = None


Action = Annotated[
    Dispatch | Rollback | SuspendForHuman | Escalate | StaticGate | Compensate | Complete | Wait,
    Field(discriminator="kind"),
]


# The actions whose INTENT starts an operation at a vendor (its own key, one result): what money checks count.
OPERATION_KINDS = frozenset({"Dispatch", "Compensate"})
