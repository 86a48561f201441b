"""ledgerflow's vendor simulator as a fake for the contract kit: the built-in adapters' contract uses it.

``SimulatorAdmin`` is a handle on a running simulator (configure it, read what it billed, call its API raw);
``SimulatorVendor`` turns the kit's ``Habits`` into the simulator's profile switches; ``SimulatorContract`` is
``AdapterContract`` with its ``contract_vendor`` fixture made from the class's simulator settings. The
simulator draws every call's fate from (seed, key, call number), so a fault meant for the first call only is
placed there exactly by picking the seed (``SimulatorVendor.seed_where``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, ClassVar

import httpx
import pytest

from ledgerflow.testing.contract import CREDENTIAL, AdapterContract
from ledgerflow.testing.vendor import Charge, Habits
from vendors.routes import VendorMode
from vendors.simulator import BackgroundSimulator, Draw, ExecutorProfile, SimConfig


@dataclass
class SimulatorAdmin:
    """A running simulator: configure it and read what it charged; ``client`` calls its API raw."""

    url: str
    client: httpx.AsyncClient  # sends the kit's bearer key

    @classmethod
    @asynccontextmanager
    async def serving(cls) -> AsyncIterator[SimulatorAdmin]:
        """A simulator served on free ports (a daemon thread) for as long as the context lasts."""
        with BackgroundSimulator(SimConfig()) as simulator:
            headers = {"Authorization": f"Bearer {CREDENTIAL}"}
            async with httpx.AsyncClient(base_url=simulator.url, headers=headers) as client:
                yield cls(simulator.url, client)

    async def configure(self, **fields: Any) -> SimConfig:
        config = SimConfig.model_validate(fields)
        response = await self.client.put("/admin/config", json=config.model_dump(mode="json"))
        response.raise_for_status()
        return config

    async def reset(self) -> None:
        (await self.client.post("/admin/reset")).raise_for_status()

    async def charges(self) -> dict[str, Any]:
        response = await self.client.get("/charges")
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result


def profile_for(base: dict[str, Any], habits: Habits, overcharge_by: str = "price") -> ExecutorProfile:
    """The simulator's profile switches that make it behave as ``habits`` say (first-call faults at 0.5:
    the seed then places the fault on the first call only). An overcharge is a higher price, or — where the
    vendor bills by the second and states no price (``overcharge_by="time"``) — a job that runs that much
    longer."""
    fields = dict(base)
    if habits.drop_response:
        fields["drop_response"] = 1.0
    if habits.gateway_status is not None:
        fields.update(gateway_error=1.0, gateway_error_status=habits.gateway_status)
    if habits.server_error_first:
        fields["server_error"] = 0.5
    if habits.rate_limit_first:
        fields["rate_limit"] = 0.5
    if habits.key_retention_seconds is not None:
        fields["key_retention_seconds"] = habits.key_retention_seconds
    if habits.purge_after_seconds is not None:
        fields["purge_after_seconds"] = habits.purge_after_seconds
    if habits.late_accept_seconds is not None:
        fields.update(late_accept=1.0, late_accept_seconds=habits.late_accept_seconds)
    if habits.overcharge is not None and overcharge_by == "time":
        fields["latency_seconds"] = float(fields.get("latency_seconds", 0.0)) * float(habits.overcharge)
    elif habits.overcharge is not None:
        fields["cost_multiplier"] = habits.overcharge
    return ExecutorProfile.model_validate(fields)


def first_call_fault(habits: Habits) -> Callable[[Draw], bool] | None:
    if habits.server_error_first:
        return lambda d: d.server_error
    if habits.rate_limit_first:
        return lambda d: d.rate_limited
    return None


@dataclass
class SimulatorVendor:
    """The simulator as one configuration's vendor (``FakeVendor``).

    Attributes:
        admin: The running simulator.
        mode: What the simulator itself does with keys (``idempotent``, ``lookup_only``, ``none``).
        base: The profile every call draws from (latency, price) before the scenario's habits.
        sim: Simulator-wide settings (what chat and images bill).
        profile: The profile's name (None: the route's, i.e. the executor the simulator is called for).
        overcharge_by: ``price`` (a higher bill) or ``time`` (a longer job, for vendors billing seconds).
    """

    admin: SimulatorAdmin
    mode: VendorMode
    base: dict[str, Any]
    sim: dict[str, Any]
    profile: str | None = None
    overcharge_by: str = "price"

    @property
    def url(self) -> str:
        return self.admin.url

    async def arrange(self, route: str, operation_key: str, habits: Habits) -> None:
        await self.admin.reset()
        profile = profile_for(self.base, habits, self.overcharge_by)
        hit = first_call_fault(habits)
        seed = self.seed_where(operation_key, profile, hit) if hit is not None else 0
        await self.admin.configure(
            seed=seed,
            mode=self.mode.value,
            executors={self.profile or route: profile.model_dump(mode="json")},
            **self.sim,
        )

    async def charges(self, operation_key: str) -> list[Charge]:
        return [
            Charge(job_id=c["job_id"], amount=Decimal(c["amount"]))
            for c in (await self.admin.charges())["charges"]
            if c["idempotency_key"] == operation_key
        ]

    @staticmethod
    def seed_where(operation_key: str, base: ExecutorProfile, hit: Callable[[Draw], bool]) -> int:
        """The first seed whose draws make ``hit`` true for the key's first call only."""
        return next(
            seed
            for seed in range(10_000)
            if hit(Draw.for_attempt(seed, operation_key, 0, base))
            and not hit(Draw.for_attempt(seed, operation_key, 1, base))
        )


class SimulatorContract(AdapterContract):
    """``AdapterContract`` against ledgerflow's simulator: the class says how the simulator behaves."""

    PROFILE: ClassVar[str | None] = None  # the simulator profile its calls draw from (None: the executor)
    VENDOR: ClassVar[dict[str, Any]] = {}  # the simulator profile of every call (latency, price)
    SIM: ClassVar[dict[str, Any]] = {}  # simulator-wide settings (what chat and images bill)
    OVERCHARGE_BY: ClassVar[str] = "price"  # or "time": the vendor bills seconds and states no price

    @pytest.fixture
    def contract_vendor(self, ledgerflow_simulator: SimulatorAdmin) -> SimulatorVendor:
        return SimulatorVendor(
            ledgerflow_simulator, self.MODE, self.VENDOR, self.SIM, self.PROFILE, self.OVERCHARGE_BY
        )
