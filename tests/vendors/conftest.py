"""Fixtures: one real simulator (uvicorn on a free port) per session, reset and reconfigured per test."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from ledger.recorder import Recorder
from ledgerflow.testing.simulator import SimulatorAdmin
from vendors.jobs import JobsAdapter
from vendors.routes import RouteSpec, Timeouts

API_KEY = "sk-test-4f1c9e"


SimAdmin = SimulatorAdmin  # the kit's handle on the simulator (ledgerflow.testing.simulator)


@pytest.fixture(scope="session")
async def http_client(simulator_url: str) -> AsyncIterator[httpx.AsyncClient]:
    # Shared: building an AsyncClient (its SSL context) costs ~50 ms, which per test would dominate the suite.
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=simulator_url, headers=headers) as client:
        yield client


@pytest.fixture
async def sim(simulator_url: str, http_client: httpx.AsyncClient) -> SimAdmin:
    admin = SimAdmin(simulator_url, http_client)
    await admin.reset()
    await admin.configure()
    return admin


@pytest.fixture
def ledgerflow_simulator(sim: SimAdmin) -> SimAdmin:
    """The kit's simulator is the session's (reset per test), not a second one."""
    return sim


@pytest.fixture
def contract_ledger(recorder: Recorder) -> Recorder:
    """The kit's ledger is the session's Postgres."""
    return recorder


@pytest.fixture
async def vendor(sim: SimAdmin) -> AsyncIterator[JobsAdapter]:
    route = RouteSpec(timeouts=Timeouts(request=5.0))
    async with JobsAdapter(route, sim.url, API_KEY, client=sim.client) as adapter:
        yield adapter


@pytest.fixture
def api_key() -> str:
    return API_KEY


@pytest.fixture
def key(request: pytest.FixtureRequest) -> str:
    return f"{request.node.name}-{uuid.uuid4().hex[:8]}"
