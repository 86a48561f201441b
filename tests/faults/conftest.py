"""Fixtures of the crash-fault suite; the harness itself (workers, rig, invariants) is in ``faultkit.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from faultkit import FaultRig, scratch_dir
from temporalio.client import Client

from ledger.recorder import Recorder


@pytest.fixture
async def rig(
    temporal: Client, recorder: Recorder, pg_url: str, simulator_url: str
) -> AsyncIterator[FaultRig]:
    """A fault rig on the session's Temporal, Postgres and simulator; every worker is killed afterwards."""
    with scratch_dir("ledgerflow-faults-") as workdir:
        r = FaultRig(temporal, recorder, pg_url, simulator_url, workdir)
        try:
            yield r
        finally:
            await r.close()
