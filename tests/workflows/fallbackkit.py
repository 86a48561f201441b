"""The fallback plumbing shared by the workflow tests of a primary route and its qualified backup
(test_fallback.py, test_money_gate_e2e.py, test_audit_fallback.py): imported as ``fallbackkit``, the way
tests/unit imports ``helpers`` (pytest puts a test file's folder on ``sys.path``).

Every test runs its own routes (``mo-<id>`` and ``mo-<id>-b``), so one test's breaker never touches another's.
"""

from __future__ import annotations

import uuid
from typing import Any

from ledger.recorder import Recorder
from rules.events import vendor_spend
from vendors.routes import Breaker, RouteSpec, RouteTable


def names() -> tuple[str, str]:
    """A fresh primary route's name and its backup's."""
    u = uuid.uuid4().hex[:8]
    return f"mo-{u}", f"mo-{u}-b"


def outage_routes(primary: str, backup: str, **breaker: Any) -> RouteTable:
    rest = {"window": 60.0, "min_calls": 2, "error_rate": 0.5, "open_for": 600.0, **breaker}
    return RouteTable(
        routes={
            # The simulator's server_error habit answers before accepting anything: this vendor documents
            # its 503 as "down, not taken" (no route lists it by default).
            primary: RouteSpec(breaker=Breaker(**rest), fallbacks=(backup,), refused_statuses=(503,)),
            backup: RouteSpec(regression="regressions/motion.yaml", convert={"aspect": "ratio"}),
        }
    )


async def check_money(sim: Any, recorder: Recorder, task_id: str) -> list[dict[str, Any]]:
    """One charge per OperationKey, and the ledger's total equal to the vendor's own billing."""
    charges: list[dict[str, Any]] = await sim.charges(f"{task_id}:")
    keys = [c["idempotency_key"] for c in charges]
    assert len(keys) == len(set(keys)), "a key was charged twice"
    assert vendor_spend(recorder.read_events(task_id)) == await sim.total(f"{task_id}:") > 0
    return charges
