"""``ledgerflow audit --billing`` after a fallback, and ``ledgerflow billing dispute``, on real servers.

The primary route is the session's simulator, down (503: refused, nothing billed); its qualified fallback is a
second simulator — another vendor, with its own bill. The billing audit must read the bill of the route that
served each operation (the INTENT's route), not the one its Dispatch names: a correct fallback task audits
clean, and one extra charge the fallback vendor adds for one of its operations is found. ``billing dispute``
then bundles that operation's evidence, the vendor's two charge lines included.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from fallbackkit import names
from peoplekit import cli

from ledger.recorder import Recorder
from ledgerflow.views.audit import Listed, audit, match_charges, operations
from rules.money import vendor_amount
from rules.operation import OperationRecord
from vendors.adapter import VendorCharge
from vendors.routes import Breaker, RouteSpec, RouteTable
from vendors.simulator import BackgroundSimulator, SimConfig

PLAN = """
goal: a fallback audited
budget_ceiling: 40
rework_limit: 1
concurrency: 2
stages:
  - {{id: shots, executor: {primary}, estimate: 0.40, fan_out: 4, canary: false,
      input: {{aspect: "16:9", format: json}}}}
"""


@pytest.fixture
def vendor_b() -> Iterator[str]:
    """The fallback's vendor: a simulator of its own, so its bill is another listing than the primary's."""
    with BackgroundSimulator(SimConfig()) as simulator:
        yield simulator.url


def routes(primary: str, backup: str, backup_url: str) -> RouteTable:
    breaker = Breaker(window=60.0, min_calls=2, error_rate=0.5, open_for=600.0)
    return RouteTable(
        routes={
            # this vendor documents its 503 as "nothing accepted": refused sends, voided, routed again
            primary: RouteSpec(breaker=breaker, fallbacks=(backup,), refused_statuses=(503,)),
            backup: RouteSpec(
                base_url=backup_url, regression="regressions/motion.yaml", convert={"aspect": "ratio"}
            ),
        }
    )


def vendor_env(lf: Any) -> dict[str, str]:
    """What the CLI needs beyond the servers (peoplekit.cli's base): the test's vendor and routes."""
    return {
        "LEDGERFLOW_VENDOR_URL": str(lf.settings.vendor_url),
        "LEDGERFLOW_VENDOR_API_KEY": lf.settings.vendor_api_key.get_secret_value(),
        "LEDGERFLOW_ROUTES_FILE": str(lf.settings.routes_file),
    }


async def test_the_billing_audit_reads_the_fallback_routes_bill_and_a_dispute_has_its_evidence(
    lf_with: Any, sim: Any, recorder: Recorder, vendor_b: str, tmp_path: Path, sim_key: str
) -> None:
    primary, backup = names()
    await sim.configure(executors={primary: {"server_error": 1.0, "server_error_status": 503}})
    recorder.record_qualification(backup, True, "regression passed", {"scores": [0.9]}, "test")
    async with lf_with(routes=routes(primary, backup, vendor_b)) as lf:
        plan = lf.plan(PLAN.format(primary=primary))
        handle = await lf.start(plan)
        try:
            result = await asyncio.wait_for(handle.result(), 120)
        except TimeoutError:
            raise AssertionError(f"the task did not finish: {await handle.query('status')}") from None
        assert result.state == "Completed", result.summary
        task = str(plan.task_id)
        ops = operations(task, recorder.read_events(task))
        served = [op for op in ops.values() if op.route == backup]
        assert len(served) == 4 and all(op.executor == primary and op.cost > 0 for op in served)

        # Every operation the fallback served is on the fallback vendor's bill, once: the audit is clean.
        clean = await audit(lf.settings, recorder, lf.client, [task], billing=True)
        assert clean.ok, clean.lines()
        billing = clean.tasks[0].billing
        assert billing is not None and billing.matched == 4 and not billing.unlisted, billing

        # The fallback vendor bills one of them a second time (it forgot the key and ran it again).
        doubled = served[1]
        async with httpx.AsyncClient(
            base_url=vendor_b, headers={"Authorization": f"Bearer {sim_key}"}
        ) as http:
            (await http.put("/admin/config", json={"mode": "none"})).raise_for_status()
            body = {"executor": backup, "input": {"ratio": "16:9", "format": "json"}, "estimate": "0.40"}
            extra = await http.post("/jobs", json=body, headers={"Idempotency-Key": doubled.key})
            assert extra.status_code == 201, extra.text
            on_bill = [
                c
                for c in (await http.get("/charges")).json()["charges"]
                if c["idempotency_key"] == doubled.key
            ]
        assert len(on_bill) == 2

        billed = sum((vendor_amount(c["amount"]).amount or Decimal("NaN") for c in on_bill), Decimal(0))
        assert billed == 2 * doubled.cost
        found = await audit(lf.settings, recorder, lf.client, [task], billing=True)
        assert not found.ok
        [problem] = found.tasks[0].problems()
        assert problem == (
            f"billing: operation {doubled.key} recorded {doubled.cost}, vendor billed {billed} (2 charges)"
        ), problem

        # The evidence for a refund claim on that operation, from the CLI.
        bundle = tmp_path / "dispute.json"
        (code, out, err), (bad, _, why) = await asyncio.gather(
            cli(lf, tmp_path, "billing", "dispute", doubled.key, "--out", str(bundle), env=vendor_env(lf)),
            cli(lf, tmp_path, "billing", "dispute", f"{task}:nothing:a1", env=vendor_env(lf)),
        )
    assert code == 0, (out, err)
    evidence = json.loads(bundle.read_text())
    assert evidence["operation_key"] == doubled.key and evidence["task"] == task
    intent = evidence["intent"]
    assert intent["route"] == backup and intent["executor"] == primary
    assert Decimal(intent["reservation"]) == Decimal("0.40") and intent["request"]["aspect"] == "16:9"
    assert [s["refused"] for s in evidence["sends"]] == [False] * len(evidence["sends"]) != []
    assert evidence["result"]["type"] == "Outcome" and evidence["result"]["cost"] == str(doubled.cost)
    assert evidence["job_ids"] == list(doubled.job_ids)
    lines = evidence["vendor_charges"]["lines"]
    assert sorted(c["job_id"] for c in lines) == sorted(c["job_id"] for c in on_bill)
    assert evidence["vendor_charges"]["total"] == str(billed)
    assert bad != 0 and why.strip() == f"error: no operation {task}:nothing:a1 in the ledger", why


# ── the matching itself, pure ─────────────────────────────────────────────────────────────────────────
def op(key: str, route: str, *jobs: str) -> OperationRecord:
    return OperationRecord(
        key=key,
        kind="Dispatch",
        node=key.split(":")[1],
        executor="mo",
        route=route,
        reservation=Decimal("0.40"),
        result=None,
        job_id=jobs[-1] if jobs else None,
        job_ids=jobs,
        sends=(),
        refused=frozenset(),
        refused_5xx=frozenset(),
        late_charges=(),
        anomalies=(),
    )


def test_each_charge_is_matched_within_the_account_of_the_route_that_served_its_operation() -> None:
    a, b, c = op("t:s1:a1", "mo", "j1"), op("t:s2:a1", "mo-b", "j2"), op("t:s3:a1", "mo-b", "j2")
    accounts = {"mo": "jobs at A (mo)", "mo-b": "jobs at B (mo-b)"}
    listed = [
        Listed("jobs at A (mo)", VendorCharge(job_id="j1", operation_key="t:s1:a1", amount="0.40")),
        # the key of an operation the other vendor served: it was never sent here
        Listed("jobs at A (mo)", VendorCharge(job_id="j9", operation_key="t:s2:a1", amount="0.40")),
        # one job two operations claim
        Listed("jobs at B (mo-b)", VendorCharge(job_id="j2", operation_key=None, amount="0.40")),
        Listed("jobs at B (mo-b)", VendorCharge(job_id="j7", operation_key="other:x:a1", amount="0.40")),
    ]
    billing = match_charges(
        [a, b, c],
        listed,
        served=lambda o: accounts.get(o.route or ""),
        attributable=lambda ch: (ch.operation_key or "").startswith("t:"),
    )
    assert billing.matched == 1
    assert [u.charge.job_id for u in billing.unmatched] == ["j9"]
    assert billing.ambiguous == [
        "job j2 (no key) charged 0.40 by jobs at B (mo-b) is claimed by operations t:s2:a1 and t:s3:a1"
    ]
    billing.unlisted = ["route mo-c (the openai API lists no charges per call)"]
    assert (
        billing.notes()[0]
        == "billing: cannot list charges: route mo-c (the openai API lists no charges per call)"
    )
