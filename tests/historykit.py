"""A task's operations written into the real ledger as a worker writes them (a fenced INTENT reserving its
estimate, then the operation's one result settling its cost): the recorded history the learned prices
(``ledger.prices``) and ``ledgerflow quote`` are tested against."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

from ledger.recorder import Recorder
from rules.actions import Dispatch
from rules.envelope import StoredEvent
from rules.events import (
    ArtifactRef,
    ExecutionResult,
    Failure,
    FailureKind,
    Intent,
    MarkerKind,
    Outcome,
    RollbackDone,
    SystemMarker,
    TaskCreated,
    Verdict,
    to_new,
)
from rules.keys import created_key, intent_key, late_charge_key, operation_key, result_key
from rules.plan import Routes, validate_plan
from rules.scopes import chain

D = Decimal
ART = ArtifactRef(uri="file:///history/out.bin", sha256="0" * 64)

# The seeded plan's fan-out items: the nodes ``History.op`` names by number, and the few named by hand.
NODES: list[str] = [f"S{i:03d}" for i in range(1, 301)] + ["S1", "S2", "open"]


def uid() -> str:
    return uuid.uuid4().hex[:10]


@dataclass
class History:
    """One task's recorded operations, written as a worker writes them: a fenced INTENT reserving its
    estimate, then the operation's one result settling its actual cost."""

    recorder: Recorder
    project: str
    task_id: str = ""
    epoch: int = 0
    n: int = 0

    def __post_init__(self) -> None:
        self.task_id = f"t-{uid()}"
        self.epoch = self.recorder.take_lease(self.task_id, "history")
        self.recorder.open_budget(self.task_id, chain(self.project, None, self.task_id, None))
        plan = validate_plan(
            {
                "goal": "history",
                "project": self.project,
                "budget_ceiling": 1000,
                # Every node an operation below names (the ledger is shared: commands that fold every task,
                # as `dlq` and `stats` do, must be able to fold this one too).
                "stages": [{"id": "s", "executor": "x", "estimate": 1, "fan_out": NODES}],
            },
            Routes(executors=frozenset({"x"}), reviewers=frozenset({"compliance.rules", "content.llm"})),
        )
        created = TaskCreated(plan=plan)
        self.recorder.append_fenced(self.task_id, self.epoch, [to_new(created, created_key(self.task_id))])

    def op(
        self,
        route: str | None,
        estimate: str,
        cost: str,
        *,
        result: str = "Outcome",
        plan_estimate: str | None = None,
        executor: str | None = None,
        node: str | None = None,
        late: str | None = None,
        verdict: Verdict | None = None,
        reuse: bool = False,
    ) -> tuple[StoredEvent, StoredEvent]:
        """One operation on ``route`` (None: an INTENT from before routes were recorded), settled at
        ``cost``."""
        self.n += 1
        node = node or f"s/S{self.n:03d}"
        assert node in ("review", "s/open") or node.removeprefix("s/") in NODES, node
        op = operation_key(self.task_id, node, self.n)
        dispatch = Dispatch(
            node=node,
            attempt=self.n,
            operation_key=op,
            executor=executor or route or "x",
            estimate=D(estimate),
            plan_estimate=None if plan_estimate is None else D(plan_estimate),
            reuse={"operation_key": "earlier", "artifact": ART.model_dump()} if reuse else None,
        )
        intent = Intent(
            action=dispatch,
            rule="R3",
            watermark=self.n,
            decided_at=datetime.now(UTC),
            reservation=D(estimate),
            route=route,
        )
        [sent] = self.recorder.append_fenced(
            self.task_id,
            self.epoch,
            [to_new(intent, intent_key(self.task_id, self.n, 0), op)],
            reserve=D(estimate),
        )
        settled = self._result(result, node, op, D(cost), verdict)
        stored, _ = self.recorder.append_idempotent(
            self.task_id,
            to_new(settled, result_key(op), op),
            release=D(estimate),
            spend=settled_cost(settled),
        )
        if late is not None:
            marker = SystemMarker(kind=MarkerKind.LATE_CHARGE, node=node, operation_key=op, amount=D(late))
            self.recorder.append_idempotent(
                self.task_id, to_new(marker, late_charge_key(op, "job-late"), op), spend=D(late)
            )
        return sent, stored

    def _result(
        self, result: str, node: str, op: str, cost: Decimal, verdict: Verdict | None
    ) -> Outcome | Failure | ExecutionResult | SystemMarker:
        if result == "Outcome":
            return Outcome(node=node, operation_key=op, artifact=ART, actual_cost=cost)
        if result == "Failure":
            return Failure(
                node=node, operation_key=op, kind=FailureKind.TECHNICAL, error="5xx", actual_cost=cost
            )
        if result == "review":
            passed = verdict in (Verdict.PASS, Verdict.SOFT_WARNING)
            return ExecutionResult(
                kind="review", node=node, operation_key=op, verdict=verdict, passed=passed, actual_cost=cost
            )
        assert result == "void"
        return SystemMarker(kind=MarkerKind.VOID, node=node, operation_key=op)

    def rework(self, *nodes: str) -> None:
        self.n += 1
        done = RollbackDone(targets=nodes[:1], invalidated=nodes, flagged=nodes, round=1)
        self.recorder.append_fenced(
            self.task_id, self.epoch, [to_new(done, f"{self.task_id}:rework:{self.n}")]
        )


def settled_cost(event: object) -> Decimal:
    return getattr(event, "actual_cost", D(0))
