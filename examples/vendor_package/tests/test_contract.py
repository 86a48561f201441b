"""Lumen's adapter under ledgerflow's contract kit: every money scenario, checked from the fake's billing."""

from __future__ import annotations

from decimal import Decimal
from typing import Any, ClassVar

from ledgerflow.testing import AdapterContract
from vendors import plugins
from vendors.routes import VendorMode


class TestLumen(AdapterContract):
    LABEL = "lumen · idempotent"
    ADAPTER = "lumen"  # found through this package's entry point, as a worker finds it
    MODE = VendorMode.IDEMPOTENT  # Lumen deduplicates on client_token
    EXECUTOR = "image.lumen"
    ESTIMATE = Decimal("0.50")
    ROUTE: ClassVar[dict[str, Any]] = {"auth": {"scheme": "header", "name": "X-Lumen-Key"}}
    NOT_APPLICABLE: ClassVar[dict[str, str]] = {
        "unstated_mode": "a route that states no mode is idempotent: test_lost_response is that case",
    }


def test_the_adapter_is_found_by_its_entry_point() -> None:
    """Installed, the package's entry point names the adapter: no edit to ledgerflow."""
    [found] = plugins.installed()["lumen"]
    assert (found.distribution, found.value) == ("lumen-vendor", "lumen_vendor.adapter:LumenAdapter")
    assert not found.built_in
