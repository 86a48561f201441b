"""The workflow's one contract with its activities: names, inputs, outputs and the errors that cross.

Everything here is persisted compatibility data: Temporal's histories hold each activity's name, its input
and its result, and every recorded run replays against them. A name changes only with a new version (a
``workflow.patched`` marker), and a model only gains optional fields. The workflow imports this module (and
``activities.boundary``, and ``rules``) and nothing else of the activities: it is pure (pydantic and the
rules' own models), so the sandbox never reaches SQLAlchemy, HTTP clients or the vendors.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from enum import StrEnum
from typing import Any, Final

from pydantic import BaseModel, field_serializer, model_validator

from rules.envelope import NewEvent, StoredEvent
from rules.plan import OutputSpec, Plan


class Activity(StrEnum):
    """Every activity's registered name (``@activity.defn(name=...)``) and what the workflow schedules."""

    # The ledger, as local activities of the workflow (activities/ledger.py).
    OPEN_TASK = "ledger.open_task"
    APPEND = "ledger.append"
    MARK = "ledger.mark"
    READ = "ledger.read"
    # Admission at the task level (ledger.admission): a waiting task asks again; an ending task leaves.
    ADMIT = "ledger.admit"
    RELEASE = "ledger.release"
    # Executors: one operation each (activities/stages.py, activities/review.py).
    STAGE_RUN = "stage.run"
    COMPOSE_RUN = "compose.run"
    REVIEW_RUN = "review.run"
    GATE_RUN = "gate.run"
    # Closing operations left open (activities/closing.py).
    OPERATION_CLOSE = "operation.close"
    OPERATION_SWEEP = "operation.sweep"
    # The fallback planner (activities/llm.py) and people's decisions (activities/people.py).
    LLM_DECIDE = "llm.decide"
    PEOPLE_RECORD_BATCH = "people.record_batch"
    PEOPLE_ARRIVALS = "people.arrivals"
    PEOPLE_RECORD_CHANGES = "people.record_changes"  # people's signed changes to a running task
    PEOPLE_NOTIFY = "people.notify"  # a project's webhook told of a request (opened, due soon, resolved)
    # The scheduled billing reconciliation (activities/billing.py, workflows/reconciliation.py): no task's.
    BILLING_RECONCILE = "billing.reconcile"
    # Removed: no worker registers it. Scheduled only when replaying a history recorded before
    # ``fair-decisions-v1`` (the compatibility section of workflows/task.py), which replay answers from the
    # history itself.
    PEOPLE_RECORD = "people.record"


def executor_activity(executor: str) -> Activity:
    """The activity that runs a node of ``executor``: the framework's compose and review have their own;
    every other executor is a paid stage (``stage.run``), whatever route serves it."""
    return {"compose": Activity.COMPOSE_RUN, "review": Activity.REVIEW_RUN}.get(executor, Activity.STAGE_RUN)


class ErrorType(StrEnum):
    """The ``type`` of the ApplicationErrors the workflow tells apart (``activities.boundary`` raises them
    under the class names of ``ledger.errors``; a test keeps the two equal)."""

    STALE_EPOCH = "StaleEpoch"  # another run holds the task: stop acting at once
    BUDGET_REFUSED = "BudgetRefused"  # a reservation does not fit a scope; details: [the scope]
    ALREADY_RESOLVED = "AlreadyResolved"  # the task began closing: nothing may start any more
    DUPLICATE_EVENT = "DuplicateEvent"
    PLAN_INVALID = "PlanInvalid"
    LEDGER_ERROR = "LedgerError"
    INVALID_AMOUNT = "InvalidAmount"
    TASK_NOT_FOUND = "TaskNotFound"
    LLM_REJECTED = "LlmRejected"  # the model refused the request: asking again changes nothing
    LLM_UNAVAILABLE = "LlmUnavailable"  # unreachable, 5xx, refused before running, unreadable: asked again


# Never retried by the ledger's local activities: a retry can never fix these.
LEDGER_NON_RETRYABLE: Final = [
    ErrorType.STALE_EPOCH,
    ErrorType.DUPLICATE_EVENT,
    ErrorType.BUDGET_REFUSED,
    ErrorType.PLAN_INVALID,
]
# Never retried by an executor: the run is fenced off, or the error is a bug no retry can fix.
EXECUTOR_NON_RETRYABLE: Final = [
    ErrorType.STALE_EPOCH,
    ErrorType.LEDGER_ERROR,
    ErrorType.INVALID_AMOUNT,
    ErrorType.DUPLICATE_EVENT,
    ErrorType.TASK_NOT_FOUND,
]


# ── executors ─────────────────────────────────────────────────────────────────────────────────────
class StageInput(BaseModel):
    """One business attempt of one node: everything the executor needs, and no secrets.

    The request (``input``) travels once: when the executor writes the INTENT (``intent``), the request is
    the one inside it, so ``input`` is left empty on the wire and filled in from the INTENT on arrival.
    """

    task_id: str
    node: str
    operation_key: str
    attempt: int
    epoch: int
    executor: str
    estimate: Decimal  # what admission reserved (rules.pricing: the worst credible cost)
    # The plan's own estimate where admission reserved more (None: ``estimate`` is the plan's). What a vendor
    # that takes an estimate is told: our reservation is no business of its pricing.
    plan_estimate: Decimal | None = None
    input: dict[str, Any] = {}
    stall_after: float = 600.0  # seconds without progress before the watchdog cancels the job
    output: OutputSpec | None = None  # the stage's output bounds: the node check an artifact must pass
    input_hash: str | None = None  # the request's input hash (recorded with the Outcome)
    # An earlier output of this node made from an equal request (rules.table): registered again, nothing sent.
    reuse: dict[str, Any] | None = None
    # The plan opted in to reuse across its project: the executor may look for an earlier task's output.
    reuse_project: str | None = None
    # The dispatch's INTENT, for the executor to write as its first step (activities.operation.recorded); None
    # when the workflow wrote it (histories recorded before executors did).
    intent: NewEvent | None = None
    # Its place in a full route's queue (rules.routing.rank): the plan's priority and the task's deadline.
    priority: str = "standard"
    deadline: datetime | None = None
    # A failed task's compensation (rules.table R12): not held back by its route's breaker, and a finished job
    # that names no file is recorded with its receipt.
    undo: bool = False

    @model_validator(mode="after")
    def _request_from_intent(self) -> StageInput:
        if not self.input and (request := self._intent_request()) is not None:
            self.input = request
        return self

    @field_serializer("input")
    def _input_once(self, value: dict[str, Any]) -> dict[str, Any]:
        return {} if value and value == self._intent_request() else value

    @property
    def quoted(self) -> Decimal:
        """The plan's estimate for this attempt: what the vendor is told (the same on every resend)."""
        return self.estimate if self.plan_estimate is None else self.plan_estimate

    def _intent_request(self) -> dict[str, Any] | None:
        """The request inside the INTENT this executor is to write (None: none to write)."""
        if self.intent is None:
            return None
        request = self.intent.payload.get("action", {}).get("input")
        return request if isinstance(request, dict) else None


class CloseInput(BaseModel):
    """An operation to resolve now (its task ended, or its executor gave up without a result)."""

    task_id: str
    node: str
    operation_key: str
    executor: str
    estimate: Decimal
    # The closing run's epoch: every write of the close is fenced by it (a run that lost the task closes
    # nothing; the newer run adopted the operation). 0: the run's own, read from the lease while the run (its
    # Temporal run id) holds it — what the task's end sends, and every close recorded before this was set.
    epoch: int = 0
    gave_up: str | None = None  # why its executor ended without a result (None: the task ended)
    output: OutputSpec | None = None  # the node's bounds, for a job that succeeded meanwhile
    input_hash: str | None = None

    @classmethod
    def for_executor(cls, arg: StageInput | GateInput, why: str) -> CloseInput:
        """An executor that ended without a result: its node's request and bounds (a StageInput), or
        nothing reserved and no output (a gate)."""
        if isinstance(arg, StageInput):
            return cls(
                task_id=arg.task_id,
                node=arg.node,
                operation_key=arg.operation_key,
                executor=arg.executor,
                estimate=arg.estimate,
                epoch=arg.epoch,
                gave_up=why,
                output=arg.output,
                input_hash=arg.input_hash,
            )
        return cls(
            task_id=arg.task_id,
            node=arg.node,
            operation_key=arg.operation_key,
            executor="gate",
            estimate=Decimal(0),
            epoch=arg.epoch or 0,
            gave_up=why,
        )

    def as_stage(self, route: str) -> StageInput:
        """The operation as its executor would see it on ``route``, for closing it (never sends anything new,
        so neither attempt nor epoch matters)."""
        return StageInput(
            task_id=self.task_id,
            node=self.node,
            operation_key=self.operation_key,
            attempt=0,
            epoch=0,
            executor=route,
            estimate=self.estimate,
            output=self.output,
            input_hash=self.input_hash,
        )


class SweepInput(BaseModel):
    task_id: str


class GateInput(BaseModel):
    task_id: str
    node: str
    operation_key: str
    input_version: int
    epoch: int | None = None  # None: scheduled before gates were fenced (opened unfenced)


class RecordDecisionInput(BaseModel):
    """A signalled human decision, exactly as received (validated by the activity, not by the model)."""

    task_id: str
    decision: Any
    after: int


class Received(BaseModel):
    """One signalled decision, exactly as received, and when it reached the workflow: the signal's own
    event time in Temporal's history when it was handled after its request's deadline (``people.arrivals``),
    else the workflow time it was handled at (which is never before it arrived)."""

    decision: Any
    received_at: datetime


class RecordDecisionsInput(BaseModel):
    """A batch of signalled decisions, ruled on and recorded in one local activity."""

    task_id: str
    decisions: list[Received]
    after: int


class RecordChangesInput(BaseModel):
    """A batch of people's signed changes (rules.changes), ruled on and recorded in one local activity."""

    task_id: str
    changes: list[Received]  # ``decision`` holds the raw change
    after: int


class ArrivalsInput(BaseModel):
    """Which signalled decisions (by ``rules.people.decision_ref``) to find in the run's history."""

    workflow_id: str
    run_id: str
    refs: list[str]


class LlmDecideInput(BaseModel):
    """An open question: the task's fold at ``watermark``, decided at ``decided_at`` (workflow time)."""

    task_id: str
    watermark: int
    summary: dict[str, Any]
    allowed: list[str]
    # Optional for inputs scheduled before it existed: without it, only the output's shape is recorded.
    decided_at: datetime | None = None
    epoch: int | None = None  # the run's fencing epoch: the paid call is made only while it is current


# ── the ledger's local activities ─────────────────────────────────────────────────────────────────
class OpenTaskInput(BaseModel):
    task_id: str
    plan: Plan
    holder: str
    # At most this many events in the result (None: all, as runs recorded before paging asked); the rest are
    # read in pages of the same size, so no payload outgrows Temporal's 2 MB limit.
    limit: int | None = None
    # Admission (ledger.admission): the task queue whose workers the bound protects, and the task's rank in
    # its waiting line (workflows.policies.slot_priority at no progress: 1 hero, 3 standard, 5 background).
    # Runs recorded before admission sent neither, and were never queued.
    queue: str = ""
    rank: int = 3


class AdmitInput(BaseModel):
    """A waiting task asks again (``ledger.admit``); an ending one leaves (``ledger.release``)."""

    task_id: str
    queue: str  # (a rank is only needed to enter the queue, which a task does at its opening)


class AdmitResult(BaseModel):
    """A task's place in its admission queue (ledger.admission.Admission), and the tasks to wake."""

    admitted: bool = True  # the task may run its work
    held: bool = False  # it holds a place: its last run releases it as the task ends
    ahead: int = 0  # waiting tasks ranked before it
    woken: list[str] = []  # other tasks this admitted: the workflow signals each


class OpenTaskResult(BaseModel):
    epoch: int
    events: list[StoredEvent]
    complete: bool = True  # False: there are more events after the last one returned
    # The worker's configuration names a webhook for the task's project: the run tells it of each request
    # (people.notify). False in runs recorded before notifications (nothing was told).
    notify: bool = False
    # Admission (ledger.admission), as the open found it; a run recorded before admission was admitted, held
    # no place and woke nobody.
    admission: AdmitResult = AdmitResult()


class NotifyInput(BaseModel):
    """One notification to a project's people: a request of a task opened, nears its deadline, or resolved."""

    task_id: str
    project: str
    event: str  # opened | due_soon | resolved
    request_id: str
    kind: str
    node: str | None = None
    reason: str = ""
    deadline: datetime | None = None
    resolution: str | None = None


class AppendInput(BaseModel):
    task_id: str
    epoch: int
    events: list[NewEvent]
    after: int
    # Admitted on every budget scope in the same transaction, or nothing is written (``overdraw``: reserved
    # even past a ceiling — a failed task's compensation, which must not wait on money).
    reserve: Decimal = Decimal(0)
    overdraw: bool = False
    # … with ``overdraw``: how far past its ceiling the task's own scope may go (the scopes above: none)
    overdraw_cap: Decimal = Decimal(0)


class MarkInput(BaseModel):
    task_id: str
    event: NewEvent
    after: int
    release: Decimal = Decimal(0)  # settlement, applied only if this call is the one that writes the event
    spend: Decimal = Decimal(0)


class ReadInput(BaseModel):
    task_id: str
    after: int
    limit: int | None = None  # a page (None: everything after ``after``)
