"""A gateway's 503/504 after its vendor accepted, end to end: real Temporal, real Postgres, the simulator.

Issue 23 §2, "a status code is evidence only where the vendor says so". nginx, Envoy and cloud load balancers
answer 502/503/504 when their upstream times out — after it took the request and charged for it. A route that
read every 503 as "nothing accepted" resubmitted (lookup_only: a second job, the first charge never seen by
the ledger) or, its breaker open, voided the node and sent it to a fallback under a new key, never looking the
first job up. Money is checked from the SIMULATOR's billing (its charge listing), never from our ledger alone.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from decimal import Decimal
from typing import Any

import pytest

from rules.events import parse, vendor_spend
from rules.keys import operation_key
from rules.operation import fold_operation
from vendors.routes import Breaker, RouteSpec, RouteTable, Timeouts, VendorMode
from vendors.simulator import Draw, ExecutorProfile

log = logging.getLogger(__name__)

THREE = """
goal: three paid shots behind a gateway
budget_ceiling: 20
review: {{reviewers: [compliance.rules]}}
stages:
  - {{id: a, executor: {executor}, estimate: 0.70, retries: 2}}
  - {{id: b, executor: {executor}, estimate: 0.70, retries: 2}}
  - {{id: c, executor: {executor}, estimate: 0.70, retries: 2}}
"""

FAN = """
goal: shots through a gateway outage
budget_ceiling: 40
rework_limit: 1
concurrency: 2
stages:
  - {{id: shots, executor: {primary}, estimate: 0.40, fan_out: 4, canary: false,
      input: {{aspect: "16:9", format: json}}}}
"""


def seed_for(keys: list[str], profile: ExecutorProfile) -> int:
    """A simulator seed that draws a gateway error on the first POST of every key, and not on the second."""
    return next(
        seed
        for seed in range(100_000)
        if all(
            Draw.for_attempt(seed, k, 0, profile).gateway_error
            and not Draw.for_attempt(seed, k, 1, profile).gateway_error
            for k in keys
        )
    )


async def billing(sim: Any, recorder: Any, task_id: str) -> tuple[list[str], Decimal, Decimal]:
    """The vendor's charges (their keys), the vendor's total and the ledger's, for one task."""
    charges = await sim.charges(f"{task_id}:")
    vendor = sum((Decimal(c["amount"]) for c in charges), Decimal(0))
    ledger = vendor_spend(recorder.read_events(task_id))
    log.info("billing %s: %d charges, vendor %s, ledger %s", task_id, len(charges), vendor, ledger)
    return [c["idempotency_key"] for c in charges], vendor, ledger


async def test_a_lookup_only_route_whose_gateway_charges_then_503s_pays_once_and_records_it(lf_with, sim):
    """Old (503 refused by default): each node was submitted again under its key and paid twice, and the
    ledger never saw the first charge (ledger − vendor = −0.70 a node)."""
    name = f"gw-{uuid.uuid4().hex[:8]}"
    route = RouteSpec(mode=VendorMode.LOOKUP_ONLY, timeouts=Timeouts(request=1.0), max_accept_seconds=1.0)
    async with lf_with(routes=RouteTable(routes={name: route})) as lf:
        plan = lf.plan(THREE.format(executor=name))
        keys = [operation_key(plan.task_id, node, 1) for node in ("a", "b", "c")]
        profile = {"gateway_error": 0.5, "gateway_error_status": 503}
        seed = seed_for(keys, ExecutorProfile(**profile))
        await sim.configure(seed=seed, mode="lookup_only", executors={name: profile})
        result = await lf.run(plan)
    charged, vendor, ledger = await billing(sim, lf.recorder, plan.task_id)
    assert sorted(charged) == sorted(keys), f"the vendor charged {charged}: a key paid twice"
    assert vendor == Decimal("2.10") == ledger, f"ledger {ledger} vs the vendor's billing {vendor}"
    assert result.state == "Completed"
    events = [parse(e) for e in lf.recorder.read_events(plan.task_id) if e.type == "SystemMarker"]
    assert not [m for m in events if m.kind in ("void", "refused")], "a 503 after a charge proves nothing"


@pytest.mark.parametrize("refused", [(), (503,)], ids=["default", "misdeclared-503"])
async def test_an_open_breaker_never_voids_a_send_its_gateway_answered_503(lf_with, sim, recorder, refused):
    """Old: the 503s were refusals, the breaker opened, the nodes were voided and went to the fallback under
    new keys; the primary's charges were never looked up (nor swept) and the ledger missed them.

    ``misdeclared-503``: a route that lists 503 although its gateway answers it after a charge voids those
    nodes — and the sweep at the task's end, which looks up voids whose sends ended in a 5xx, records each
    charge it finds, so the ledger still equals the vendor."""
    u = uuid.uuid4().hex[:8]
    primary, backup = f"gwo-{u}", f"gwo-{u}-b"
    breaker = Breaker(window=60.0, min_calls=2, error_rate=0.5, open_for=600.0)
    table = RouteTable(
        routes={
            primary: RouteSpec(breaker=breaker, fallbacks=(backup,), refused_statuses=refused),
            backup: RouteSpec(regression="regressions/motion.yaml", convert={"aspect": "ratio"}),
        }
    )
    await sim.configure(executors={primary: {"gateway_error": 1.0, "gateway_error_status": 503}})
    recorder.record_qualification(backup, True, "regression passed", {"scores": [0.9]}, "test")
    async with lf_with(routes=table) as lf:
        plan = lf.plan(FAN.format(primary=primary))
        result = await lf.run(plan)
    charged, vendor, ledger = await billing(sim, recorder, plan.task_id)
    assert len(charged) == len(set(charged)), f"a key was charged twice: {charged}"
    assert ledger == vendor > 0, f"ledger {ledger} vs the vendor's billing {vendor}"
    assert result.state == "Completed"
    assert [c for c in recorder.route_changes(primary) if c["kind"] == "opened"], "the breaker opened"
    events = recorder.read_events(plan.task_id)
    voided = {e.operation_key for e in events if e.type == "SystemMarker" and e.payload.get("kind") == "void"}
    if not refused:
        assert not voided & set(charged), "an operation the vendor charged was voided"
    else:
        hit = voided & set(charged)
        assert hit, f"no charged operation was voided ({voided}): the misdeclared 503 was never exercised"
        late = [e for e in events if e.type == "SystemMarker" and e.payload.get("kind") == "late_charge"]
        assert hit <= {e.operation_key for e in late}, "a voided operation's charge was not swept"
        billed: dict[str, Decimal] = {}
        for c in await sim.charges(f"{plan.task_id}:"):
            billed[c["idempotency_key"]] = billed.get(c["idempotency_key"], Decimal(0)) + Decimal(c["amount"])
        swept: dict[str, Decimal] = {}
        for e in late:
            if e.operation_key in hit:
                amount = Decimal(str(e.payload["amount"]))
                swept[e.operation_key] = swept.get(e.operation_key, Decimal(0)) + amount
        assert swept == {k: billed[k] for k in hit}, f"late charges {swept} vs the vendor's billing {billed}"


async def test_an_unlisted_503_is_voided_for_the_fallback_only_once_proven_absent(lf_with, sim, recorder):
    """A primary that really is down (503, nothing taken) but does not say so (no ``refused_statuses``): its
    maybe-sent operations are not resent into the outage, nor voided at once; each is looked up, voided only
    after its send can no longer land (time + timeout + ``max_accept_seconds``), and its node moves on."""
    u = uuid.uuid4().hex[:8]
    primary, backup = f"gwp-{u}", f"gwp-{u}-b"
    breaker = Breaker(window=60.0, min_calls=2, error_rate=0.5, open_for=600.0)
    spec = RouteSpec(
        breaker=breaker, fallbacks=(backup,), timeouts=Timeouts(request=0.5), max_accept_seconds=0.5
    )
    table = RouteTable(
        routes={
            primary: spec,
            backup: RouteSpec(regression="regressions/motion.yaml", convert={"aspect": "ratio"}),
        }
    )
    await sim.configure(executors={primary: {"server_error": 1.0, "server_error_status": 503}})
    recorder.record_qualification(backup, True, "regression passed", {"scores": [0.9]}, "test")
    async with lf_with(routes=table) as lf:
        plan = lf.plan(FAN.format(primary=primary))
        # Bounded: resending into the outage never ends (the old way), and must fail, not hang, the suite.
        result = await asyncio.wait_for(lf.run(plan), 60)
    charged, vendor, ledger = await billing(sim, recorder, plan.task_id)
    assert result.state == "Completed" and ledger == vendor > 0 and len(charged) == len(set(charged)) == 4
    events = recorder.read_events(plan.task_id)
    on_primary = {e.operation_key for e in events if e.type == "Intent" and e.payload.get("route") == primary}
    assert on_primary, "the primary took the first dispatches"
    # Until the breaker opened, a maybe-sent request to an idempotent route may be sent again under its key
    # (nothing says the route is down yet: which retries come first is timing); once it opened, never.
    [opened] = [c["recorded_at"] for c in recorder.route_changes(primary) if c["kind"] == "opened"]
    for op in on_primary:
        # Each send's write-ahead: its marker, or the INTENT where that stands for the first.
        sends = fold_operation(e for e in events if e.operation_key == op).sends
        [void] = [e for e in events if e.operation_key == op and e.payload.get("kind") == "void"]
        resent = [s for s in sends[1:] if s.at >= opened]
        assert sends and not resent, f"{op} was resent into the outage ({len(resent)} sends after it opened)"
        waited = (void.recorded_at - sends[-1].at).total_seconds()
        assert waited >= 1.0, f"{op} voided {waited:.2f}s after a send that could land for 1s"
