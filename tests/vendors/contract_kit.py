"""The harness of the vendor adapter contract (``test_contract.py``): one operation, driven as Temporal would.

No workflow runs: the test writes the task into the ledger the way the workflow does (a lease, the budget, a
fenced ``TaskCreated`` and ``Intent(Dispatch)`` reserving the estimate), then runs the real ``stage.run``
activity (``StageActivities``, the real adapters, the simulator over HTTP, Postgres) in an
``ActivityEnvironment``, attempt after attempt, until it returns the operation's resolution:

* attempt numbers increase and the latest heartbeat details reach the next attempt (Temporal's semantics);
* a retry-later ``ApplicationError`` is honoured: the next attempt waits its ``next_retry_delay`` (capped);
* a ``SimulatedCrash`` is the worker dying: the next attempt follows;
* a *takeover* is a new run: a new epoch from ``take_lease`` and no heartbeat details;
* past a bound of attempts or seconds the test fails: no task may retry forever.

Every cell of the contract ends in the same three checks (``Contract.check``): the vendor charged the
operation at most once (its own billing record, never our ledger's word), the money the ledger says was paid
equals what the vendor billed or every difference is flagged by a cost anomaly of the operation, and the
operation is resolved exactly once with nothing left reserved.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from enum import StrEnum
from typing import Any, Final

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.contracts import StageInput, SweepInput
from activities.operation import Operation
from activities.stages import StageActivities
from artifacts.local import LocalStore
from ledger.recorder import Recorder
from rules.actions import Dispatch
from rules.envelope import StoredEvent
from rules.events import (
    Failure,
    FailureKind,
    Intent,
    MarkerKind,
    Outcome,
    SystemMarker,
    TaskCreated,
    parse,
    to_new,
    vendor_spend,
)
from rules.keys import created_key, intent_key, operation_key, result_key
from rules.plan import Plan
from runtime import faults
from runtime.faults import SimulatedCrash
from vendors.adapter import VendorAdapter, mode_of
from vendors.registry import Adapters
from vendors.routes import RouteSpec, VendorMode
from vendors.simulator import Draw, ExecutorProfile

NODE: Final = "shot"
PROJECT: Final = "contract"
TASK_CEILING: Final = Decimal("100")
# Seconds: the longest the harness waits on a retry-later error (Retry-After: 1 is honoured in full).
RETRY_CAP: Final = 1.5
CRASH_RETRY_S: Final = 0.02  # a dead worker's attempt is retried after its heartbeat timeout: here, at once
RETRY_S: Final = 0.05  # Temporal's backoff for a plain retryable error, shortened


# ── the scenarios and what each must end in ───────────────────────────────────────────────────────────────
SCENARIOS: Final[dict[str, str]] = {
    "submit": "plain success: an Outcome whose artifact is in the store, its sha256 verified",
    "lost_response": "the vendor bills the call, then the answer is lost (502)",
    "retry": "the first call draws a 500 (nothing accepted, but a 5xx proves nothing), the second does not",
    "takeover": "the worker dies right after the vendor accepted; a new run (new epoch) continues",
    "key_expiry": "the worker dies after acceptance; the vendor forgets the key before the retry",
    "purge": "the worker dies once the job finished; the vendor purges the output before the retry",
    "late_creation": "the submit times out on the client; the vendor creates (and bills) the job later",
    "late_after_void": "the job appears only past the acceptance window the route promised; the task ends",
    "rate_limit": "the first call is refused with 429, Retry-After: 1",
    "unstated_mode": "a lost response under a route that states no mode (the route file default)",
}


class End(StrEnum):
    """How a cell's operation must be resolved."""

    OUTCOME = "Outcome"
    VOID = "void (nothing spent)"
    UNKNOWN = "unknown_outcome at the estimate + cost anomaly"
    PAID_FAILURE = "technical Failure at the job's cost"
    SWEPT = "void, then the sweep records the late job's charge"


def expected_end(scenario: str, mode: VendorMode, free: bool) -> End:
    """What a scenario must end in for an adapter working in ``mode`` (reconcile.operations' rules)."""
    if scenario == "purge":
        return End.PAID_FAILURE  # the job ran and was billed: its cost stands, whatever became of the output
    if free or scenario in ("submit", "rate_limit", "key_expiry"):
        return End.OUTCOME  # nothing maybe-sent is left for reconciliation to prove (or redoing it is free)
    if scenario == "late_after_void":
        # A lookup that finds nothing once the window has passed voids the operation; the job that appears
        # later is found by the sweep at the task's end. Idempotent: the in-flight key answers 409 until then.
        return {VendorMode.IDEMPOTENT: End.OUTCOME, VendorMode.LOOKUP_ONLY: End.SWEPT}.get(mode, End.UNKNOWN)
    if scenario == "retry":
        # A 5xx proves nothing: the request may have been accepted. Here it was not, and only the mode says
        # whether that can be shown: a resubmission under the key, a lookup once no send can land, or nothing.
        return {VendorMode.IDEMPOTENT: End.OUTCOME, VendorMode.LOOKUP_ONLY: End.VOID}.get(mode, End.UNKNOWN)
    # The request was accepted and billed but the worker never learnt the job: found again, or unknowable.
    return End.UNKNOWN if mode == VendorMode.NONE else End.OUTCOME


# ── one test's operation ──────────────────────────────────────────────────────────────────────────────────
@dataclass
class Contract:
    """One operation of one fresh task, and the worker that runs it (see the module doc)."""

    recorder: Recorder
    sim: Any  # tests/vendors/conftest.py's SimAdmin
    store: LocalStore
    adapters: Adapters
    activities: StageActivities
    route: RouteSpec
    inp: StageInput
    attempt: int = 0
    details: tuple[Any, ...] = ()  # the latest heartbeat details of this run
    delays: list[tuple[str, float]] = field(default_factory=list)  # (error type, next_retry_delay s)
    errors: list[str] = field(default_factory=list)  # what every failed attempt raised, in order

    @property
    def task(self) -> str:
        return self.inp.task_id

    @property
    def op(self) -> str:
        return self.inp.operation_key

    @property
    def adapter(self) -> VendorAdapter:
        return self.adapters.get(self.inp.executor)

    @property
    def mode(self) -> VendorMode:
        """The mode reconciliation really works with for this route and adapter."""
        return mode_of(self.route, self.adapter.capabilities)

    # ── the simulator ─────────────────────────────────────────────────────────────────────────────────
    def operation(self) -> Operation:
        """The operation's ledger side, as an executor of the current run holds it."""
        inp = self.inp
        return Operation(
            self.recorder,
            task_id=inp.task_id,
            node=inp.node,
            key=inp.operation_key,
            epoch=inp.epoch,
            estimate=inp.estimate,
        )

    async def charges(self) -> list[dict[str, Any]]:
        """The vendor's own billing record of this operation (the simulator's, not our ledger)."""
        return [c for c in (await self.sim.charges())["charges"] if c["idempotency_key"] == self.op]

    async def billed(self) -> Decimal:
        return sum((Decimal(c["amount"]) for c in await self.charges()), Decimal(0))

    async def until_charged(self, count: int, within: float) -> list[dict[str, Any]]:
        """The charges once there are ``count`` (a late job is billed late); fails after ``within`` s."""
        deadline = time.monotonic() + within
        while len(charges := await self.charges()) < count:
            if time.monotonic() > deadline:
                pytest.fail(f"the vendor billed {self.op} {len(charges)} times within {within}s, not {count}")
            await asyncio.sleep(0.05)
        return charges

    def seed_where(self, base: ExecutorProfile, hit: Callable[[Draw], bool]) -> int:
        """The first simulator seed whose draws make ``hit`` true for this key's first call only.

        The simulator draws every call's fate from (seed, key, call number), so this picks the fault exactly.
        """
        return next(
            seed
            for seed in range(10_000)
            if hit(Draw.for_attempt(seed, self.op, 0, base))
            and not hit(Draw.for_attempt(seed, self.op, 1, base))
        )

    # ── running the activity ──────────────────────────────────────────────────────────────────────────
    async def run_once(self, inp: StageInput | None = None) -> StoredEvent:
        """One attempt of ``stage.run``, as a worker runs it: its number, the previous heartbeat details."""
        self.attempt += 1
        env = ActivityEnvironment()
        env.info = dataclasses.replace(
            env.info,
            activity_type="stage.run",
            attempt=self.attempt,
            heartbeat_details=list(self.details),
        )
        env.on_heartbeat = self._beat
        return await env.run(self.activities.run, inp or self.inp)

    def _beat(self, *details: Any) -> None:
        self.details = details  # Temporal hands the next attempt the latest details recorded

    async def drive(self, *, max_attempts: int = 25, within: float = 25.0) -> StoredEvent:
        """Attempt after attempt until the activity returns the operation's resolution."""
        resolved = await self._drive(stop_on_crash=False, max_attempts=max_attempts, within=within)
        assert resolved is not None
        return resolved

    async def crash(self, point: str) -> None:
        """Arm a one-shot crash at ``point`` for this operation and drive until the worker dies there."""
        faults.crash_at(point, self.op)
        try:
            resolved = await self._drive(stop_on_crash=True, max_attempts=10, within=15.0)
        finally:
            faults._CRASH.clear()  # disarmed whatever happened: a leftover would hit another test's operation
        if resolved is not None:
            pytest.fail(f"{self.op} was resolved ({resolved.type}) without ever reaching {point}")

    async def takeover(self) -> StageInput:
        """A new run takes the task over: a new epoch, attempts from 1, no heartbeat details.

        Returns:
            The superseded run's input: a zombie attempt of that run must never reach the vendor again.
        """
        stale = self.inp
        epoch = await asyncio.to_thread(self.recorder.take_lease, self.task, "contract: the new run")
        self.inp = stale.model_copy(update={"epoch": epoch})
        self.attempt, self.details = 0, ()
        return stale

    async def zombie(self, stale: StageInput) -> ApplicationError:
        """An attempt of the superseded run (its worker was only slow): it must fail, calling no one."""
        attempt, details = self.attempt, self.details
        try:
            await self.run_once(stale)
        except ApplicationError as e:
            return e
        finally:
            self.attempt, self.details = attempt, details
        pytest.fail("an attempt of the superseded run returned a result")

    async def sweep(self) -> int:
        """The task ended: ``operation.sweep`` looks voided operations up again; returns the jobs found."""
        env = ActivityEnvironment()
        env.info = dataclasses.replace(env.info, activity_type="operation.sweep")
        found: int = await env.run(self.activities.sweep, SweepInput(task_id=self.task))
        return found

    async def _drive(self, *, stop_on_crash: bool, max_attempts: int, within: float) -> StoredEvent | None:
        deadline = time.monotonic() + within
        while True:
            if self.attempt >= max_attempts or time.monotonic() > deadline:
                billed = len(await self.charges())
                pytest.fail(
                    f"no task retrying forever: {self.op} still unresolved after {self.attempt} attempts "
                    f"({within:g}s bound), billed {billed} times; the attempts raised {self.errors}"
                )
            try:
                # Bounded too: an attempt that never returns (a poll that never ends) is a test failure.
                return await asyncio.wait_for(self.run_once(), max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                pytest.fail(f"no task retrying forever: attempt {self.attempt} of {self.op} never returned")
            except SimulatedCrash:
                self.errors.append("SimulatedCrash")
                if stop_on_crash:
                    return None
                await asyncio.sleep(CRASH_RETRY_S)
            except ApplicationError as e:
                self.errors.append(str(e.type))
                if e.non_retryable:
                    pytest.fail(f"attempt {self.attempt} of {self.op} failed for good: {e.type}: {e}")
                if e.next_retry_delay is None:
                    await asyncio.sleep(RETRY_S)
                    continue
                delay = e.next_retry_delay.total_seconds()
                self.delays.append((str(e.type), delay))
                await asyncio.sleep(min(delay, RETRY_CAP))

    # ── the checks ────────────────────────────────────────────────────────────────────────────────────
    async def events(self) -> list[StoredEvent]:
        return await asyncio.to_thread(self.recorder.read_events, self.task)

    async def anomalies(self) -> list[StoredEvent]:
        return [
            e
            for e in await self.events()
            if e.type == "SystemMarker"
            and e.payload.get("kind") == MarkerKind.COST_ANOMALY
            and e.operation_key == self.op
        ]

    async def check(self, resolved: StoredEvent) -> None:
        """The three invariants every cell holds: one charge at most, money accounted for, resolved once."""
        charges = await self.charges()
        free = self.adapter.capabilities.free
        assert len(charges) <= (0 if free else 1), (
            f"the vendor billed {self.op} {len(charges)} times: {charges}"
        )

        events = await self.events()
        ledger, vendor = vendor_spend(events), sum((Decimal(c["amount"]) for c in charges), Decimal(0))
        if ledger != vendor:
            assert await self.anomalies(), (
                f"the ledger says {ledger} was paid for {self.op}, the vendor billed {vendor}, "
                "and no cost anomaly of the operation says why"
            )

        results = [e for e in events if e.dedup_key == result_key(self.op)]
        assert [e.seq for e in results] == [resolved.seq], (
            f"{self.op} must be resolved exactly once: {results}"
        )
        account = await asyncio.to_thread(self.recorder.account, f"task:{self.task}")
        assert account is not None
        assert account.reserved == 0, f"{account.reserved} is still reserved after {self.op} was resolved"
        assert account.spent == ledger, f"the budget spent {account.spent}, the events say {ledger}"

    async def check_end(self, resolved: StoredEvent, end: End) -> Any:
        """The resolution is the one ``end`` names, at the right cost; returns the parsed event."""
        event = parse(resolved)
        billed = await self.billed()
        if end == End.OUTCOME:
            assert isinstance(event, Outcome), f"expected an Outcome, got {event!r}"
            assert event.actual_cost == billed, f"recorded {event.actual_cost}, the vendor billed {billed}"
            assert await asyncio.to_thread(self.store.verify, event.artifact.uri, event.artifact.sha256)
            data = b"".join(await asyncio.to_thread(lambda: list(self.store.open_read(event.artifact.uri))))
            assert hashlib.sha256(data).hexdigest() == event.artifact.sha256
            assert len(data) == event.artifact.size > 0
            charges = await self.charges()
            if self.adapter.capabilities.free:
                assert charges == [] and event.actual_cost == 0, "free work is never billed"
            else:
                assert len(charges) == 1, f"an Outcome is one paid call, the vendor billed {len(charges)}"
                if not self.adapter.capabilities.synchronous:
                    assert event.job_id == charges[0]["job_id"], "the Outcome names the job the vendor billed"
        elif end == End.VOID:
            assert isinstance(event, SystemMarker) and event.kind == MarkerKind.VOID, (
                f"expected void: {event!r}"
            )
            assert billed == 0 and await self.charges() == []
        elif end == End.UNKNOWN:
            assert isinstance(event, Failure) and event.kind == FailureKind.UNKNOWN_OUTCOME, repr(event)
            assert event.actual_cost == self.inp.estimate, "an unknown outcome is counted at the estimate"
            assert any("possible charge" in a.payload["detail"] for a in await self.anomalies())
        elif end == End.SWEPT:
            assert isinstance(event, SystemMarker) and event.kind == MarkerKind.VOID, (
                f"expected void: {event!r}"
            )
            [charge] = await self.charges()
            late = [
                parse(e)
                for e in await self.events()
                if e.type == "SystemMarker" and e.payload.get("kind") == MarkerKind.LATE_CHARGE
            ]
            assert [(m.operation_key, m.amount) for m in late] == [(self.op, Decimal(charge["amount"]))]
            assert charge["job_id"] in late[0].detail, "the late charge names the job the vendor billed"
        elif end == End.PAID_FAILURE:
            assert isinstance(event, Failure), f"expected a Failure, got {event!r}"
            assert event.kind == FailureKind.TECHNICAL, f"a purged output is technical, not {event.kind}"
            assert event.actual_cost == billed > 0, f"recorded {event.actual_cost}, the job cost {billed}"
        else:
            raise AssertionError(f"no check for {end!r}")
        return event


# ── writing the task as the workflow would ────────────────────────────────────────────────────────────────
async def open_task(
    recorder: Recorder, plan: Plan, executor: str, request: dict[str, Any], estimate: Decimal
) -> StageInput:
    """Lease, budget, TaskCreated and the Dispatch INTENT reserving ``estimate``: what the workflow writes."""
    task = plan.task_id
    assert task is not None
    op = operation_key(task, NODE, 1)
    epoch = await asyncio.to_thread(recorder.take_lease, task, "contract: the first run")
    scopes = [(f"project:{PROJECT}", None), (f"task:{task}", TASK_CEILING)]
    await asyncio.to_thread(recorder.open_budget, task, scopes)
    dispatch = Dispatch(
        node=NODE, attempt=1, operation_key=op, executor=executor, estimate=estimate, input=request
    )
    intent = Intent(
        action=dispatch, rule="R11", watermark=1, decided_at=datetime.now(UTC), reservation=estimate
    )
    events = [
        to_new(TaskCreated(plan=plan), dedup_key=created_key(task)),
        to_new(intent, dedup_key=intent_key(task, 1, 1), operation_key=op),
    ]
    await asyncio.to_thread(recorder.append_fenced, task, epoch, events, reserve=estimate)
    return StageInput(
        task_id=task,
        node=NODE,
        operation_key=op,
        attempt=1,
        epoch=epoch,
        executor=executor,
        estimate=estimate,
        input=request,
    )


# ── the matrix (CONTRACT.md) ──────────────────────────────────────────────────────────────────────────────
def render_matrix(configs: list[Any], module: str) -> str:
    """CONTRACT.md: every configuration × scenario cell, the test that proves it or why it does not apply."""
    lines = [
        "# The vendor adapter contract",
        "",
        f"Generated from `{module}`: `LEDGERFLOW_WRITE_CONTRACT=1 pytest {module} -k matrix`",
        "rewrites it, and a test fails when it differs from what is collected.",
        "",
        "Each cell is the test that proves it, with the resolution it must end in, or **N/A** and why",
        "the scenario cannot happen to that adapter (that test is not generated at all). Every test also",
        "holds the same three invariants (`contract_kit.Contract.check`): the vendor billed the operation",
        "at most once (the simulator's own billing, not our ledger); the ledger's `vendor_spend` equals",
        "what the vendor billed, or a cost anomaly of the operation flags the difference; and the operation",
        "is resolved exactly once, with nothing left reserved.",
        "",
        "| scenario | " + " | ".join(f"`{c.__name__}`<br>{c.LABEL}" for c in configs) + " |",
        "|---|" + "---|" * len(configs),
    ]
    for scenario in SCENARIOS:
        cells = []
        for c in configs:
            reason = c.NOT_APPLICABLE.get(scenario)
            if reason is not None:
                cells.append(f"N/A — {reason}")
            else:
                end = expected_end(scenario, c.MODE, c.FREE)
                cells.append(f"`test_{scenario}`<br>→ {end.value}")
        lines.append(f"| **{scenario}** | " + " | ".join(cells) + " |")
    lines += ["", "## Scenarios", ""]
    lines += [f"* **{name}** — {what}." for name, what in SCENARIOS.items()]
    lines.append("")
    return "\n".join(lines)
