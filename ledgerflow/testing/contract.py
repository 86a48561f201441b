"""The vendor adapter contract: every money scenario, written once, run against any adapter and its fake.

``AdapterContract`` is a base test class. A subclass is one adapter configuration — the adapter's name (any
installed adapter, ``ledgerflow.adapters`` entry point), the mode its route states, its estimate and price —
and pytest collects every scenario (``SCENARIOS``) for it, except those it lists in ``NOT_APPLICABLE`` with
the reason. The vendor is a fake of its wire protocol over real HTTP that the test supplies as the
``contract_vendor`` fixture (``ledgerflow.testing.vendor.FakeVendor``; write one with
``ledgerflow.testing.fake``). The ledger is a real Postgres (the ``contract_ledger`` fixture of the kit's
pytest plugin: ``LEDGERFLOW_TEST_DATABASE_URL``, else an embedded PostgreSQL).

No workflow runs. Each scenario writes its task into the ledger the way the workflow does (a lease, the
budget, a fenced ``TaskCreated`` and ``Intent(Dispatch)`` reserving the estimate), then runs the real
``stage.run`` activity — the real adapter, the fake over HTTP, the ledger — in an ``ActivityEnvironment``,
attempt after attempt, as Temporal would (``Contract``):

* attempt numbers increase and the latest heartbeat details reach the next attempt;
* a retry-later ``ApplicationError`` is honoured: the next attempt waits its ``next_retry_delay`` (capped);
* a ``SimulatedCrash`` is the worker dying: the next attempt follows;
* a *takeover* is a new run: a new epoch from ``take_lease`` and no heartbeat details;
* past a bound of attempts or seconds the test fails: no task may retry forever.

Every scenario ends in the same three checks (``Contract.check``), read from the vendor's own billing: the
vendor charged the operation at most once; the money the ledger says was paid equals what the vendor billed,
or every difference is flagged by a cost anomaly of the operation; and the operation is resolved exactly once
with nothing left reserved.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar, Final

import httpx
import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.callbacks import CallbackWaker
from activities.contracts import StageInput, SweepInput
from activities.operation import Operation
from activities.stages import StageActivities
from artifacts.local import LocalStore
from ledger.recorder import Recorder
from ledgerflow.testing.vendor import Charge, FakeVendor, Habits
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
from rules.operation import fold_operation
from rules.plan import Plan, validate_plan
from runtime import faults
from runtime.faults import SimulatedCrash
from vendors.adapter import VendorAdapter, mode_of
from vendors.registry import Adapters
from vendors.routes import Price, RouteSpec, RouteTable, VendorMode, with_simulator_cdn

NODE: Final = "shot"
PROJECT: Final = "contract"
TASK_CEILING: Final = Decimal("100")
CREDENTIAL: Final = "sk-test-4f1c9e"  # what every route's credential_env reads in the kit (fakes check it)
# Seconds: the longest the harness waits on a retry-later error (Retry-After: 1 is honoured in full).
RETRY_CAP: Final = 1.5
CRASH_RETRY_S: Final = 0.02  # a dead worker's attempt is retried after its heartbeat timeout: here, at once
RETRY_S: Final = 0.05  # Temporal's backoff for a plain retryable error, shortened
OVERCHARGE: Final = Decimal(5)  # the overcharge scenario's multiple of the vendor's normal price


# ── the scenarios and what each must end in ───────────────────────────────────────────────────────────────
SCENARIOS: Final[dict[str, str]] = {
    "submit": "plain success: an Outcome whose artifact is in the store, its sha256 verified",
    "lost_response": "the vendor bills the call, then the answer is lost (502)",
    "charge_then_5xx": "the vendor bills the call, then a gateway answers 503 (a 5xx proves nothing)",
    "retry": "the first call draws a 500 (nothing accepted, but a 5xx proves nothing), the second does not",
    "takeover": "the worker dies right after the vendor accepted; a new run (new epoch) continues",
    "key_expiry": "the worker dies after acceptance; the vendor forgets the key before the retry",
    "purge": "the worker dies once the job finished; the vendor purges the output before the retry",
    "late_creation": "the submit times out on the client; the vendor creates (and bills) the job later",
    "late_after_void": "the job appears only past the acceptance window the route promised; the task ends",
    "rate_limit": "the first call is refused with 429, Retry-After: 1",
    "overcharge": f"the vendor bills {OVERCHARGE}x its price: the Outcome records the bill, flagged",
    "unstated_mode": "a lost response under a route that states no mode (the route file default)",
}


class End(StrEnum):
    """How a scenario's operation must be resolved."""

    OUTCOME = "Outcome"
    VOID = "void (nothing spent)"
    UNKNOWN = "unknown_outcome at the estimate + cost anomaly"
    PAID_FAILURE = "technical Failure at the job's cost"
    SWEPT = "void, then the sweep records the late job's charge"
    FLAGGED = "Outcome at the vendor's bill + cost anomaly"


def expected_end(scenario: str, mode: VendorMode, free: bool) -> End:
    """What a scenario must end in for an adapter working in ``mode`` (reconcile.operations' rules)."""
    if scenario == "purge":
        return End.PAID_FAILURE  # the job ran and was billed: its cost stands, whatever became of the output
    if scenario == "overcharge":
        return End.FLAGGED
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


# ── one scenario's environment and operation ──────────────────────────────────────────────────────────────
@dataclass
class ContractEnv:
    """What every scenario shares: the ledger, the vendor's fake, a scratch directory, what to close after."""

    recorder: Recorder
    vendor: FakeVendor
    tmp_path: Path
    stack: AsyncExitStack


@dataclass
class Contract:
    """One operation of one fresh task, and the worker that runs it (see the module doc)."""

    recorder: Recorder
    vendor: FakeVendor
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

    # ── the vendor's own billing ──────────────────────────────────────────────────────────────────────
    async def charges(self) -> list[Charge]:
        """The vendor's own billing record of this operation (the fake's, never our ledger)."""
        return await self.vendor.charges(self.op)

    async def billed(self) -> Decimal:
        return sum((c.amount for c in await self.charges()), Decimal(0))

    async def until_charged(self, count: int, within: float) -> list[Charge]:
        """The charges once there are ``count`` (a late job is billed late); fails after ``within`` s."""
        deadline = time.monotonic() + within
        while len(charges := await self.charges()) < count:
            if time.monotonic() > deadline:
                pytest.fail(f"the vendor billed {self.op} {len(charges)} times within {within}s, not {count}")
            await asyncio.sleep(0.05)
        return charges

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
        result = await env.run(self.activities.run, inp or self.inp)
        assert isinstance(result, StoredEvent), f"the INTENT was the workflow's: one result, not {result!r}"
        return result

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
            faults.disarm()  # whatever happened: a leftover would hit another test's operation
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
        """The three invariants of every scenario: one charge at most, money accounted for, resolved once."""
        charges = await self.charges()
        free = self.adapter.capabilities.free
        assert len(charges) <= (0 if free else 1), (
            f"the vendor billed {self.op} {len(charges)} times: {charges}"
        )

        events = await self.events()
        ledger, vendor = vendor_spend(events), sum((c.amount for c in charges), Decimal(0))
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
        if end in (End.OUTCOME, End.FLAGGED):
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
                    assert event.job_id == charges[0].job_id, "the Outcome names the job the vendor billed"
            if end == End.FLAGGED:
                flagged = [a.payload["detail"] for a in await self.anomalies()]
                assert any("above the reserved estimate" in d for d in flagged), (
                    f"a bill of {billed} against the estimate {self.inp.estimate} is not flagged: {flagged}"
                )
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
                m
                for e in await self.events()
                if isinstance(m := parse(e), SystemMarker) and m.kind == MarkerKind.LATE_CHARGE
            ]
            assert [(m.operation_key, m.amount) for m in late] == [(self.op, charge.amount)]
            assert charge.job_id in late[0].detail, "the late charge names the job the vendor billed"
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


# ── the base test class ───────────────────────────────────────────────────────────────────────────────────
SIDE: Final = 64  # pixels: small images keep every render and probe fast
IMAGE_REQUEST: Final[dict[str, Any]] = {
    "prompt": "a lighthouse at dusk",
    "format": "png",
    "width": SIDE,
    "height": SIDE,
}
# The contract's route defaults: "no send can land any more" comes within a second or two.
ROUTE_DEFAULTS: Final[dict[str, Any]] = {"timeouts": {"request": 1.0}, "max_accept_seconds": 0.5}


class AdapterContract:
    """Every scenario, once; a subclass is one adapter configuration (see the module doc).

    A subclass sets ``LABEL``, ``ADAPTER``, ``MODE``, ``ESTIMATE`` (and what else differs), and its test
    module (or a ``conftest.py``) provides the ``contract_vendor`` fixture: its vendor's fake.
    """

    LABEL: ClassVar[str]
    ADAPTER: ClassVar[str]  # the adapter's name: a built-in one or any installed ``ledgerflow.adapters``
    MODE: ClassVar[VendorMode]  # what the route states, and what reconciliation must work with
    FREE: ClassVar[bool] = False  # no vendor money involved (the local adapter)
    EXECUTOR: ClassVar[str] = "image.vendor"  # a prefix: each test's route is named for it alone
    ESTIMATE: ClassVar[Decimal]
    PRICE: ClassVar[Price] = Price()
    ROUTE: ClassVar[dict[str, Any]] = {}  # route fields this configuration needs over the contract's
    REQUEST: ClassVar[dict[str, Any]] = IMAGE_REQUEST  # what the Dispatch asks the vendor for
    NOT_APPLICABLE: ClassVar[dict[str, str]] = {}  # scenario → why it cannot happen to this adapter

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        unknown = set(cls.NOT_APPLICABLE) - set(SCENARIOS)
        if unknown:
            raise TypeError(f"{cls.__name__}: unknown scenarios {sorted(unknown)}")
        for scenario, reason in cls.NOT_APPLICABLE.items():
            if not reason.strip():
                raise TypeError(f"{cls.__name__}: {scenario} needs a reason to be N/A")
            # Not a test here (pytest collects only callables): the cell is N/A, and the matrix says why.
            setattr(cls, f"test_{scenario}", None)

    # ── the configuration's hooks ─────────────────────────────────────────────────────────────────────
    def executor(self, suffix: str) -> str:
        return f"{self.EXECUTOR}-{suffix}"

    async def request(self, store: LocalStore) -> dict[str, Any]:
        """What the Dispatch asks the vendor for (a configuration may first put its inputs in the store)."""
        return dict(self.REQUEST)

    def check_output(self, artifact: Any, data: bytes) -> None:
        """What a plain success delivers: a PNG of the asked size, probed (not as the vendor claims)."""
        assert data.startswith(b"\x89PNG\r\n\x1a\n"), "the output is a PNG"
        assert artifact.media is not None
        assert (artifact.media.format, artifact.media.width, artifact.media.height) == ("png", SIDE, SIDE)

    def end(self, scenario: str) -> End:
        return expected_end(scenario, self.MODE, self.FREE)

    async def waker(self, env: ContractEnv) -> CallbackWaker | None:
        """What wakes an attempt when the vendor calls back (a route with ``callback``): None, it polls."""
        return None

    # ── the harness ───────────────────────────────────────────────────────────────────────────────────
    async def start(
        self,
        env: ContractEnv,
        *,
        route: dict[str, Any] | None = None,
        habits: Habits | None = None,
        state_mode: bool = True,
    ) -> Contract:
        """A fresh task whose Dispatch INTENT is recorded, the vendor told its habits, the worker ready.

        Args:
            route: Route fields over the contract's defaults.
            habits: How the vendor treats this operation (default: it behaves).
            state_mode: False: the route states no mode (what a route file that names none gets).
        """
        suffix = uuid.uuid4().hex[:12]
        executor = self.executor(suffix)
        raw_route = {
            "adapter": self.ADAPTER,
            "price": self.PRICE,
            **ROUTE_DEFAULTS,
            **self.ROUTE,
            **(route or {}),
        }
        if state_mode:
            raw_route["mode"] = self.MODE
        spec = RouteSpec.model_validate(raw_route)
        # As a dev deployment's routes do (deployment_table): the vendor's own CDN is allow-listed.
        table = with_simulator_cdn(RouteTable(routes={executor: spec}), env.vendor.url)
        store = LocalStore(env.tmp_path / "artifacts")
        client = httpx.AsyncClient()
        env.stack.push_async_callback(client.aclose)
        adapters = Adapters(
            table,
            vendor_url=env.vendor.url,
            credential=lambda name: CREDENTIAL,
            client=client,
            store_for=lambda uri: store,
        )
        env.stack.push_async_callback(adapters.aclose)
        waker = await self.waker(env)
        activities = StageActivities(env.recorder, adapters, store, 0.02, pause_retry_s=0.5, waker=waker)
        request = await self.request(store)
        # The plan as a person writes it: an input file comes through ``inputs:``, never as a reference in
        # the free ``input`` (plan validation refuses that); the operation below sends ``request`` itself.
        written = {k: v for k, v in request.items() if k != "inputs"}
        plan = validate_plan(
            {
                "goal": f"the adapter contract: {self.LABEL}",
                "project": PROJECT,
                "budget_ceiling": "100",
                "stages": [
                    {"id": NODE, "executor": executor, "estimate": str(self.ESTIMATE), "input": written}
                ],
            },
            table.names(),
            task_id=f"t-{suffix}",
        )
        inp = await open_task(env.recorder, plan, executor, request, self.ESTIMATE)
        kit = Contract(env.recorder, env.vendor, store, adapters, activities, spec, inp)
        # What the adapter really works with is what this configuration declares, whatever the route says.
        assert kit.mode == self.MODE, f"{self.LABEL}: reconciliation works in {kit.mode}, not {self.MODE}"
        assert kit.adapter.capabilities.free == self.FREE
        await env.vendor.arrange(executor, kit.op, habits or Habits())
        return kit

    # ── the scenarios ─────────────────────────────────────────────────────────────────────────────────
    async def test_submit(self, contract_env: ContractEnv) -> None:
        """A plain call: one attempt, one charge, the Outcome's artifact stored and verified, at the cost."""
        kit = await self.start(contract_env)
        resolved = await kit.drive()
        event = await kit.check_end(resolved, self.end("submit"))
        assert kit.errors == [] and kit.attempt == 1, f"a plain success takes one attempt: {kit.errors}"
        data = b"".join(kit.store.open_read(event.artifact.uri))
        self.check_output(event.artifact, data)
        await kit.check(resolved)

    async def test_lost_response(self, contract_env: ContractEnv) -> None:
        """A billed call whose answer is lost is found again (or counted unknown), never paid twice."""
        kit = await self.start(contract_env, habits=Habits(drop_response=True))
        resolved = await kit.drive()
        assert kit.errors[0] == "VendorUnavailable", "the first attempt never got its answer"
        await kit.check_end(resolved, self.end("lost_response"))
        assert len(await kit.charges()) == 1, "the lost call was billed: the vendor did the work"
        await kit.check(resolved)

    async def test_charge_then_5xx(self, contract_env: ContractEnv) -> None:
        """A billed call a gateway answers 503 is maybe-sent, never refused: it is not paid twice."""
        kit = await self.start(contract_env, habits=Habits(gateway_status=503))
        resolved = await kit.drive()
        assert kit.errors[0] == "VendorUnavailable", "the first attempt got the gateway's 503"
        await kit.check_end(resolved, self.end("charge_then_5xx"))
        assert len(await kit.charges()) == 1, "the call behind the 503 was billed: the vendor did the work"
        await kit.check(resolved)

    async def test_unstated_mode(self, contract_env: ContractEnv) -> None:
        """A route that states no mode never makes an adapter without idempotency resubmit a lost call."""
        kit = await self.start(contract_env, habits=Habits(drop_response=True), state_mode=False)
        resolved = await kit.drive()
        assert kit.errors[0] == "VendorUnavailable"
        await kit.check_end(resolved, self.end("unstated_mode"))
        assert len(await kit.charges()) == 1, "the route's default mode must not buy a second call"
        await kit.check(resolved)

    async def test_retry(self, contract_env: ContractEnv) -> None:
        """A 500 before acceptance: resubmitted under the key, voided once provably absent, or unknown."""
        kit = await self.start(contract_env, habits=Habits(server_error_first=True))
        resolved = await kit.drive()
        assert kit.errors[0] == "VendorUnavailable", "the first call drew the 500"
        end = self.end("retry")
        await kit.check_end(resolved, end)
        assert len(await kit.charges()) == (1 if end == End.OUTCOME else 0)
        if end == End.VOID:
            # Not found by key is proof of absence only once no send can land: the void waited for that.
            # The first send's write-ahead: its own marker, or the INTENT where that stands for it.
            ops = [e for e in await kit.events() if e.operation_key == resolved.operation_key]
            sent = fold_operation(ops).sends
            landing = (resolved.recorded_at - sent[0].at).total_seconds()
            assert landing >= kit.route.timeouts.request + kit.route.max_accept_seconds
            assert "NotYetProvable" in kit.errors
        await kit.check(resolved)

    async def test_takeover(self, contract_env: ContractEnv) -> None:
        """A new run (new epoch) finds the job the dead run paid for; the old run is fenced off."""
        kit = await self.start(contract_env)
        await kit.crash("vendor_accepted")
        paid = await kit.charges()
        assert len(paid) == (0 if self.FREE else 1), "the vendor accepted (and billed) before the crash"
        stale = await kit.takeover()
        fenced = await kit.zombie(stale)
        assert (fenced.type, fenced.non_retryable) == ("StaleEpoch", True), (
            "a zombie of the old run is fenced"
        )
        assert await kit.charges() == paid, "the fenced-off run called the vendor"
        resolved = await kit.drive()
        await kit.check_end(resolved, self.end("takeover"))
        await kit.check(resolved)

    async def test_key_expiry(self, contract_env: ContractEnv) -> None:
        """Past the key's retention the job is looked up, not resubmitted into a duplicate."""
        kit = await self.start(
            contract_env, route={"key_retention": 0.3}, habits=Habits(key_retention_seconds=0.6)
        )
        await kit.crash("vendor_accepted")
        [paid] = await kit.charges()
        # Past the route's retention and the vendor's: a resubmission now would be billed again.
        await asyncio.sleep(0.8)
        resolved = await kit.drive()
        event = await kit.check_end(resolved, self.end("key_expiry"))
        assert event.job_id == paid.job_id, "the job found by lookup is the one paid for"
        await kit.check(resolved)

    async def test_purge(self, contract_env: ContractEnv) -> None:
        """A finished job whose output was purged is a technical Failure at what the job cost."""
        kit = await self.start(contract_env, habits=Habits(purge_after_seconds=0))
        await kit.crash("vendor_completed")
        resolved = await kit.drive()
        event = await kit.check_end(resolved, self.end("purge"))
        assert "is gone" in event.error
        await kit.check(resolved)

    async def test_late_creation(self, contract_env: ContractEnv) -> None:
        """A job created after the client gave up is adopted (one charge) or counted as unknown."""
        kit = await self.start(
            contract_env,
            route={"timeouts": {"request": 0.5}, "max_accept_seconds": 3.0},
            habits=Habits(late_accept_seconds=1.5),
        )
        resolved = await kit.drive()
        assert kit.errors[0] == "VendorUnavailable", "the client gave up on the submit"
        await kit.until_charged(1, within=5.0)  # the late job exists and is billed (whatever we decided)
        await kit.check_end(resolved, self.end("late_creation"))
        await kit.check(resolved)

    async def test_late_after_void(self, contract_env: ContractEnv) -> None:
        """A job created past the promised acceptance window: the void stands, the sweep books its charge."""
        kit = await self.start(
            contract_env,
            route={"timeouts": {"request": 0.4}, "max_accept_seconds": 0.3},
            habits=Habits(late_accept_seconds=2.5),
        )
        resolved = await kit.drive()
        assert kit.errors[0] == "VendorUnavailable", "the client gave up on the submit"
        end = self.end("late_after_void")
        await kit.until_charged(1, within=6.0)  # the vendor created and billed it after all
        assert await kit.sweep() == (1 if end == End.SWEPT else 0), (
            "the sweep looks up voided operations only"
        )
        await kit.check_end(resolved, end)
        await kit.check(resolved)

    async def test_rate_limit(self, contract_env: ContractEnv) -> None:
        """A 429 is retried no sooner than Retry-After, then succeeds: one charge, no void, no unknown."""
        kit = await self.start(contract_env, habits=Habits(rate_limit_first=True))
        resolved = await kit.drive()
        assert kit.errors == ["VendorRateLimited"], f"one refusal, then the call: {kit.errors}"
        [(kind, delay)] = kit.delays
        assert kind == "VendorRateLimited" and delay >= 1.0, f"retried after {delay}s, the vendor said 1s"
        await kit.check_end(resolved, self.end("rate_limit"))
        await kit.check(resolved)

    async def test_overcharge(self, contract_env: ContractEnv) -> None:
        """A bill far above the estimate is recorded as billed (never capped to the estimate) and flagged."""
        kit = await self.start(contract_env, habits=Habits(overcharge=OVERCHARGE))
        resolved = await kit.drive()
        billed = await kit.billed()
        assert billed > self.ESTIMATE, (
            f"the scenario needs a bill above the estimate, the vendor billed {billed}"
        )
        await kit.check_end(resolved, self.end("overcharge"))
        await kit.check(resolved)


# ── the matrix ────────────────────────────────────────────────────────────────────────────────────────────
def render_matrix(configs: list[type[AdapterContract]], module: str) -> str:
    """A Markdown matrix: every configuration × scenario, the test that proves it or why it does not apply."""
    lines = [
        "# The vendor adapter contract",
        "",
        f"Generated from `{module}`: `LEDGERFLOW_WRITE_CONTRACT=1 pytest {module} -k matrix`",
        "rewrites it, and a test fails when it differs from what is collected.",
        "",
        "Each cell is the test that proves it, with the resolution it must end in, or **N/A** and why",
        "the scenario cannot happen to that adapter (that test is not generated at all). Every test also",
        "holds the same three invariants (`ledgerflow.testing.Contract.check`): the vendor billed the",
        "operation at most once (the fake's own billing, not our ledger); the ledger's `vendor_spend` equals",
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
