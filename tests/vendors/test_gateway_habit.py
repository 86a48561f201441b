"""The simulator's gateway habit (charge, then answer 503/504) and how an adapter classifies it, over HTTP."""

from __future__ import annotations

from decimal import Decimal
from typing import TYPE_CHECKING

import pytest

from vendors.errors import VendorOverloaded, VendorUnavailable
from vendors.jobs import JobsAdapter
from vendors.routes import RouteSpec, Timeouts
from vendors.simulator import Draw, ExecutorProfile

if TYPE_CHECKING:
    from tests.vendors.conftest import SimAdmin

EXECUTOR = "video.motion"
INPUT = {"prompt": "a fox behind a gateway", "seconds": 4}


async def submit(vendor: JobsAdapter, key: str) -> object:
    return await vendor.submit(operation_key=key, executor=EXECUTOR, request=INPUT, estimate=Decimal("0.70"))


@pytest.mark.parametrize("status", [503, 504])
async def test_a_gateway_error_charges_first_and_is_maybe_accepted_by_default(
    sim: SimAdmin, vendor: JobsAdapter, key: str, status: int
) -> None:
    await sim.configure(default={"gateway_error": 1, "gateway_error_status": status})
    with pytest.raises(VendorUnavailable) as failed:
        await submit(vendor, key)
    assert failed.value.status_code == status
    assert not failed.value.refused, "a route lists no refused status by default"
    charges = await sim.charges()
    assert [c["idempotency_key"] for c in charges["charges"]] == [key] and charges["total"] == "0.7000"
    [found] = await vendor.find_by_key(key)  # the job exists: a lookup finds what the 503 hid
    assert (await sim.client.get("/admin/stats")).json()["gateway_errors"] == 1
    assert found.id == charges["charges"][0]["job_id"]


async def test_a_route_that_lists_503_reads_it_as_a_refusal(sim: SimAdmin, key: str, api_key: str) -> None:
    await sim.configure(default={"server_error": 1, "server_error_status": 503})
    route = RouteSpec(timeouts=Timeouts(request=5.0), refused_statuses=(503,))
    async with JobsAdapter(route, sim.url, api_key, client=sim.client) as vendor:
        with pytest.raises(VendorOverloaded) as refused:
            await submit(vendor, key)
    assert refused.value.refused and (await sim.charges())["count"] == 0


def test_the_gateway_rate_leaves_every_earlier_seeded_draw_unchanged() -> None:
    rates = {"rate_limit": 0.3, "server_error": 0.3, "drop_response": 0.3, "truncated": 0.3, "slow": 0.3}
    before, after = ExecutorProfile(**rates), ExecutorProfile(**rates, gateway_error=1.0)
    for i in range(50):
        old, new = Draw.for_attempt(7, f"g-{i}", 0, before), Draw.for_attempt(7, f"g-{i}", 0, after)
        assert new.gateway_error and not old.gateway_error
        assert {**vars(new), "gateway_error": False} == vars(old)
