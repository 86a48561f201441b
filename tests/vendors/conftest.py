"""Fixtures: one real simulator (uvicorn on a free port) per session, reset and reconfigured per test."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from vendors.jobs import JobsAdapter
from vendors.routes import RouteSpec, Timeouts
from vendors.simulator import SimConfig

API_KEY = "sk-test-4f1c9e"


@dataclass
class SimAdmin:
    """The test's handle on the simulator: configure it and read what it charged."""

    url: str
    client: httpx.AsyncClient  # sends the bearer key, so it can also call the vendor API raw

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
        return response.json()


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
