"""The ``lumen`` adapter: Lumen Render's API (an invented vendor), as a ledgerflow plugin.

    POST /v1/renders              {prompt, size: "WxH", client_token}  → 201 {id, state}
    GET  /v1/renders/{id}         → {id, state, client_token, price_usd?, asset_url?, error?}
    GET  /v1/renders?client_token=K → {data: [render, …]} (oldest first)
    POST /v1/renders/{id}/cancel  → the render

Lumen deduplicates on ``client_token`` for 24 hours (a resubmission returns the same render, unbilled) and
lists renders by it, so a lost answer is found again: ``deduplicates=True``, ``can_lookup=True``. Each render
states its price (``price_usd``), the figure the ledger records. States: ``queued``, ``rendering`` (running),
``ready`` (succeeded), ``failed``, ``cancelled``; a failure whose ``error.code`` is ``content_policy`` is a
content rejection (the same prompt would be refused again). The key goes in the ``X-Lumen-Key`` header: the
route says so (``auth: {scheme: header, name: X-Lumen-Key}``), the adapter has no auth code.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from decimal import Decimal
from typing import Any, ClassVar

from vendors.adapter import (
    Capabilities,
    JobError,
    JobErrorKind,
    JobStatus,
    ResultFile,
    Sent,
    VendorJob,
)
from vendors.errors import VendorBadResponse
from vendors.httpbase import HttpVendor, json_or_none

ADAPTER_PROTOCOL_VERSION = 1  # a literal: the protocol this adapter was written for

STATES: Mapping[str, JobStatus] = {
    "queued": JobStatus.RUNNING,
    "rendering": JobStatus.RUNNING,
    "ready": JobStatus.SUCCEEDED,
    "failed": JobStatus.FAILED,
    "cancelled": JobStatus.CANCELLED,
}


class LumenAdapter(HttpVendor):
    """Client of Lumen Render (see the module doc). ``HttpVendor`` brings the client, auth, errors, downloads
    and the plugin factory; a route may rename any path below with ``paths``."""

    ROUTE_PATHS: ClassVar[Mapping[str, str]] = {
        "submit": "/v1/renders",
        "get": "/v1/renders/{job_id}",
        "find": "/v1/renders?client_token={operation_key}",
        "cancel": "/v1/renders/{job_id}/cancel",
    }

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            can_lookup=True, can_cancel=True, synchronous=False, has_billing=False, deduplicates=True
        )

    async def submit(
        self,
        *,
        operation_key: str,
        executor: str,
        request: dict[str, Any],
        estimate: Decimal,
        files: dict[str, str] | None = None,
    ) -> VendorJob:
        body = {
            "prompt": str(request.get("prompt", "")),
            "size": f"{request.get('width', 1024)}x{request.get('height', 1024)}",
            "client_token": operation_key,
        }
        return _job(json_or_none(await self.request("POST", self.path("submit"), json=body)))

    async def get(self, job_id: str) -> VendorJob:
        return _job(json_or_none(await self.request("GET", self.path("get", job_id=job_id))))

    async def find_by_key(
        self, operation_key: str, *, since: datetime | None = None, sent: Sent | None = None
    ) -> list[VendorJob]:
        answer = json_or_none(await self.request("GET", self.path("find", operation_key=operation_key)))
        renders = (answer or {}).get("data")
        if not isinstance(renders, list):
            raise VendorBadResponse("malformed answer from Lumen: no data list")
        # Only renders that carry our token: a listing is the vendor's word, checked like any other answer.
        return [_job(r) for r in renders if isinstance(r, dict) and r.get("client_token") == operation_key]

    async def cancel(self, job_id: str) -> VendorJob:
        return _job(json_or_none(await self.request("POST", self.path("cancel", job_id=job_id))))

    async def charged(self, operation_key: str, job_id: str | None) -> str | None:
        return None  # no billing API: the render's own price_usd is the figure


def _job(body: dict[str, Any] | None) -> VendorJob:
    """A render as a ``VendorJob``; anything unreadable is ``VendorBadResponse`` (never a guess)."""
    if body is None or not isinstance(body.get("id"), str) or body.get("state") not in STATES:
        raise VendorBadResponse("malformed answer from Lumen: no render id or an unknown state")
    status = STATES[body["state"]]
    error = None
    if status == JobStatus.FAILED:
        raw = body.get("error") if isinstance(body.get("error"), dict) else {}
        content = raw.get("code") == "content_policy"
        kind = JobErrorKind.CONTENT_REJECTED if content else JobErrorKind.TECHNICAL
        error = JobError(kind=kind, message=str(raw.get("message", "the render failed"))[:4000])
    asset = body.get("asset_url")
    return VendorJob(
        id=body["id"],
        status=status,
        idempotency_key=body.get("client_token"),
        cost=body.get("price_usd"),
        error=error,
        result=ResultFile(url=asset) if status == JobStatus.SUCCEEDED and isinstance(asset, str) else None,
    )
