"""Issue 29 §0 / 24 §5: an ``allow_hosts`` wildcard, for a vendor that serves its files from subdomains.

Replicate: "Output files are served by replicate.delivery and its subdomains", and they need the token. An
exact entry covers one host only, so an output on ``pbxt.replicate.delivery`` went without the token (a 401:
that output failed). ``*.replicate.delivery`` covers every subdomain — over https, on its port, never the
domain itself, never a look-alike — and never makes a private address acceptable.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from pydantic import ValidationError

from vendors.errors import UnsafeResultUrl
from vendors.predictions import PredictionsAdapter
from vendors.routes import RouteSpec


def adapter(*allow: str) -> PredictionsAdapter:
    route = RouteSpec(adapter="predictions", allow_hosts=allow)
    return PredictionsAdapter(route, "https://api.replicate.com", "r8-test-token")


def keyed(vendor: PredictionsAdapter, url: str) -> bool:
    return vendor.resolve(url)[2]


def test_a_wildcard_sends_the_token_to_every_subdomain_over_https_and_nowhere_else():
    exact, wild = adapter("replicate.delivery"), adapter("*.replicate.delivery")
    output = "https://pbxt.replicate.delivery/abc/output.mp4"
    assert not keyed(exact, output)  # before: the token did not go, and the output failed with a 401
    assert keyed(wild, output)
    assert keyed(wild, "https://a.b.replicate.delivery/x.png")
    for elsewhere in (
        "https://replicate.delivery/x.png",  # the domain itself: an entry of its own
        "http://pbxt.replicate.delivery/x.png",  # plain http: never the token
        "https://pbxt.replicate.delivery:8443/x.png",  # another port
        "https://evilreplicate.delivery/x.png",  # a look-alike, not a subdomain
        "https://replicate.delivery.evil.example/x.png",
    ):
        assert not keyed(wild, elsewhere), elsewhere


async def test_a_wildcard_never_makes_a_private_address_acceptable(monkeypatch: pytest.MonkeyPatch):
    """A subdomain the vendor's DNS (or an attacker's) points at 127.0.0.1 gets no connection, token or not:
    the name is resolved here as a resolver would answer (no DNS on this machine), then refused."""
    loop = asyncio.get_running_loop()

    async def resolves_to_loopback(host: str, port: object, **kw: object) -> list[tuple[Any, ...]]:
        assert host == "files.example.test"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 443))]

    monkeypatch.setattr(loop, "getaddrinfo", resolves_to_loopback)
    wild = adapter("*.example.test")
    url, _, credentials = wild.resolve("https://files.example.test/x.png")
    assert credentials  # the wildcard covers it for the token …
    with pytest.raises(UnsafeResultUrl, match="loopback, private, link-local or metadata"):
        await wild.check_address(url)  # … but never makes its private address acceptable


@pytest.mark.parametrize(
    "entry", ["*", "*.com", "http://*.replicate.delivery", "a.*.delivery", "*.*.delivery", "*.x.y:port"]
)
def test_a_wildcard_that_is_not_subdomains_of_one_domain_over_https_is_refused(entry: str):
    with pytest.raises(ValidationError, match="allow_hosts"):
        RouteSpec(adapter="predictions", allow_hosts=(entry,))


def test_a_wildcard_is_for_allow_hosts_only():
    with pytest.raises(ValidationError, match="a wildcard is for allow_hosts only"):
        RouteSpec(adapter="predictions", allow_private=("*.internal.example",))
