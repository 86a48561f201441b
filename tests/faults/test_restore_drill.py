"""The restore drill (issue 27 §4): the ledger's database is lost and restored to a point behind Temporal.

Paid tasks run on a Postgres of the test's own with WAL archiving on; a base backup is taken mid-run; work
keeps going past a recovery target while the vendor keeps charging; then the database is killed and its data
directory deleted, and it is restored from the backup and the archive to the target — seconds behind
Temporal's histories. After the workers come back, from the simulator's own billing (never the ledger alone):
every charge it made is in the restored ledger, with a cost anomaly naming each figure that had to be
re-learned; no idempotency key was charged twice; every task ended; ``ledgerflow audit --all --billing``
passes.

Each test has a simulator of its own: ``audit --all --billing`` holds every charge of the vendor's account
against the ledger's tasks, so another test's charges on a shared simulator would be unmatched.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import httpx
import pytest
from faultkit import scratch_dir

from ledgerflow.runs.restore_drill import run_restore_drill
from vendors.simulator import BackgroundSimulator, SimConfig


@pytest.fixture
def own_simulator() -> Iterator[str]:
    with BackgroundSimulator(SimConfig()) as simulator:
        yield simulator.url


def vendor_charges(url: str, prefix: str) -> list[dict[str, Any]]:
    """The simulator's own billing: its generation charges under ``prefix`` (model calls apart)."""
    listed = httpx.get(f"{url}/charges", timeout=10).json()["charges"]
    return [c for c in listed if c["idempotency_key"].startswith(prefix) and c.get("protocol") != "chat"]


async def test_restore_behind_temporal_loses_no_charge(temporal, own_simulator):
    address = temporal.service_client.config.target_host
    with scratch_dir("ledgerflow-restore-") as workdir:
        report = await run_restore_drill(
            temporal_address=address,
            vendor_url=own_simulator,
            workdir=workdir,
            tasks=6,
            window_s=4.0,
        )
        detail = "\n".join(report.audit_lines[-40:])
        # The drill really rewound the ledger: events and charges the vendor made were missing from it.
        assert report.behind_events > 0, report
        assert report.missing_at_restore > 0, report
        assert report.absent_at_restore > 0, "no task was created after the target: the drill tried less"
        assert report.terminated > 0, "no run was still going when the database was lost"

        charges = vendor_charges(own_simulator, f"{report.prefix}-")
        # From the vendor's billing: one charge per idempotency key.
        dupes = {k: n for k, n in Counter(c["idempotency_key"] for c in charges).items() if n > 1}
        assert not dupes, f"charged more than once: {dupes}"
        assert report.duplicates == 0
        assert report.vendor_charges == len(charges)
        assert report.vendor_total == sum((Decimal(c["amount"]) for c in charges), Decimal(0))
        # Every charge is in the ledger afterwards, its figure equal; each re-learned one carries an anomaly.
        assert report.ledger_charges == report.vendor_charges, report
        assert report.ledger_total == report.vendor_total, report
        assert report.reconstructed == report.missing_at_restore, report
        # Every task ended (nothing left open), and the audit passes.
        assert report.ended == report.tasks == 6, report
        assert report.recreated == report.absent_at_restore, report
        assert report.audit_ok, detail
        assert report.clean


async def test_a_charge_only_the_vendors_billing_knows_is_recorded_as_a_late_charge(temporal, own_simulator):
    """Inside the window the vendor bills an attempt no new run makes again: the restored ledger learns it
    from the billing alone (a late charge with its cost anomaly), and the audit still passes."""
    address = temporal.service_client.config.target_host
    with scratch_dir("ledgerflow-restore-") as workdir:
        report = await run_restore_drill(
            temporal_address=address,
            vendor_url=own_simulator,
            workdir=workdir,
            tasks=4,
            window_s=3.0,
            stray_charge=True,
        )
        charges = vendor_charges(own_simulator, f"{report.prefix}-")
        assert report.vendor_charges == len(charges)
        assert report.late_charges == 1, report
        assert report.reconstructed == report.missing_at_restore, report
        assert report.ledger_charges == report.vendor_charges, report
        assert report.ledger_total == report.vendor_total, report
        assert report.duplicates == 0
        assert report.ended == report.tasks == 4, report
        assert report.audit_ok, "\n".join(report.audit_lines[-40:])
