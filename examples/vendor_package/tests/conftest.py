"""The vendor's fake for the contract kit: served over real HTTP for the whole session, reset per scenario
(``FakeVendorApp.arrange``). The ledger is the kit's plugin's ``contract_ledger`` (an embedded PostgreSQL,
or ``LEDGERFLOW_TEST_DATABASE_URL``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from lumen_fake import lumen_fake

from ledgerflow.testing.fake import FakeVendorApp


@pytest.fixture(scope="session")
def contract_vendor() -> Iterator[FakeVendorApp]:
    with lumen_fake().serving() as fake:
        yield fake
