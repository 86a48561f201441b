"""The vendor adapter contract kit, shipped with ledgerflow for your own adapters' tests.

Write a fake of your vendor's wire protocol (``ledgerflow.testing.fake.FakeVendorApp``: routes and the habits
it has, a few dozen lines), subclass ``AdapterContract`` with your adapter's name and mode, give it the fake
as the ``contract_vendor`` fixture, and pytest runs every money scenario — lost response, a gateway's 5xx
after the charge, retry, takeover, key expiry, purge, late creation, late after void, rate limit, overcharge —
against your adapter, checked from the fake's own billing. The kit's pytest plugin (installed with
ledgerflow) provides the real Postgres ledger. ``docs/vendor-plugins.md`` walks through it;
``examples/vendor_package/`` is a whole plugin package that uses it.
"""

from ledgerflow.testing.contract import (
    SCENARIOS,
    AdapterContract,
    Contract,
    ContractEnv,
    End,
    expected_end,
    render_matrix,
)
from ledgerflow.testing.vendor import Charge, FakeVendor, Habits

__all__ = [
    "SCENARIOS",
    "AdapterContract",
    "Charge",
    "Contract",
    "ContractEnv",
    "End",
    "FakeVendor",
    "Habits",
    "expected_end",
    "render_matrix",
]
