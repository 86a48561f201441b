"""The ``predictions`` adapter: Replicate-style predictions, the most common shape of real video APIs.

    POST /v1/predictions              {version, input, metadata: {operation_key}}  → 201 prediction
    GET  /v1/predictions/{id}         → {id, status, output, error, metrics: {predict_time}, created_at, …}
    GET  /v1/predictions?cursor=C     → {results: [newest first], next}
    POST /v1/predictions/{id}/cancel
    GET  /v1/usage?since=T&cursor=C   → {results: [{prediction_id, metadata, amount, created_at}], next}

There is no idempotency key: every POST creates and bills a prediction. So the route's mode is at most
``lookup_only`` — a lost POST is found again by listing recent predictions and matching the OperationKey in
their ``metadata`` — and the body reports no cost: it is priced from ``metrics.predict_time`` at the route's
``price.per_second`` (plus ``per_call``). Outputs are URLs on the vendor's CDN (another host: downloaded
without the key).
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, Field

from vendors.adapter import (
    Capabilities,
    JobError,
    JobErrorKind,
    JobStatus,
    ResultFile,
    VendorCharge,
    VendorJob,
)
from vendors.errors import VendorCannotTell
from vendors.httpbase import HttpVendor

MAX_PAGES = 50  # a lookup never lists more than this many pages (1,000 predictions) back
USAGE_PAGE = 500
MAX_USAGE_PAGES = 2000  # the usage listing is cut (VendorCannotTell) beyond a million predictions
_STATUS = {
    "starting": JobStatus.RUNNING,
    "processing": JobStatus.RUNNING,
    "succeeded": JobStatus.SUCCEEDED,
    "failed": JobStatus.FAILED,
    "canceled": JobStatus.CANCELLED,
}
_CONTENT_WORDS = ("nsfw", "content policy", "safety")


class _Prediction(BaseModel):
    id: str
    status: str
    output: str | list[str] | None = None
    error: str | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime | None = None

    def normalised(self) -> VendorJob:
        status = _STATUS.get(self.status)
        if status is None:
            raise ValueError(f"unknown prediction status {self.status!r}")
        error = None
        if status == JobStatus.FAILED:
            text = (self.error or "prediction failed")[:4000]
            content = any(w in text.lower() for w in _CONTENT_WORDS)
            error = JobError(
                kind=JobErrorKind.CONTENT_REJECTED if content else JobErrorKind.TECHNICAL, message=text
            )
        output = self.output[0] if isinstance(self.output, list) and self.output else self.output
        result = ResultFile(url=output) if status == JobStatus.SUCCEEDED and isinstance(output, str) else None
        seconds = self.metrics.get("predict_time")
        progress = {"starting": 0.0, "processing": None}.get(self.status, 1.0)
        return VendorJob(
            id=self.id,
            status=status,
            progress=progress,
            idempotency_key=str(self.metadata.get("operation_key") or "") or None,
            seconds=float(seconds) if isinstance(seconds, int | float) else None,
            error=error,
            result=result,
        )


class _Page(BaseModel):
    results: list[_Prediction]
    next: str | None = None


class _Usage(BaseModel):
    prediction_id: str
    metadata: dict[str, Any] = Field(default_factory=dict)
    amount: str
    created_at: datetime | None = None


class _UsagePage(BaseModel):
    results: list[_Usage] = Field(default_factory=list)
    next: str | None = None


class PredictionsAdapter(HttpVendor):
    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            can_lookup=True, can_cancel=True, synchronous=False, has_billing=False, can_list_charges=True
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
        body: dict[str, Any] = {
            "version": self.route.model or executor,
            "input": request,
            "metadata": {"operation_key": operation_key},
        }
        if files:
            body["input_urls"] = files
        return self._job(await self.request("POST", "/v1/predictions", json=body))

    async def get(self, job_id: str) -> VendorJob:
        return self._job(await self.request("GET", f"/v1/predictions/{job_id}"))

    async def find_by_key(self, operation_key: str, *, since: datetime | None = None) -> list[VendorJob]:
        """Page back through recent predictions (newest first) until ``since``, matching the metadata."""
        found: list[VendorJob] = []
        cursor: str | None = None
        for _ in range(MAX_PAGES):
            params = {"cursor": cursor} if cursor else None
            page: _Page = self.parse(_Page, await self.request("GET", "/v1/predictions", params=params))
            for p in page.results:
                if p.metadata.get("operation_key") == operation_key:
                    found.append(self._normalise(p))
            oldest = page.results[-1].created_at if page.results else None
            if page.next is None or (since is not None and oldest is not None and oldest < since):
                return list(reversed(found))  # oldest first
            cursor = page.next
        if found:
            return list(reversed(found))
        # The listing was cut before it reached the send's time: "not found" here proves nothing.
        raise VendorCannotTell(f"{operation_key} not in the newest {MAX_PAGES} pages of predictions")

    async def cancel(self, job_id: str) -> VendorJob:
        return self._job(await self.request("POST", f"/v1/predictions/{job_id}/cancel"))

    async def charged(self, operation_key: str, job_id: str | None) -> str | None:
        return None  # no billing API: the cost is the route's price of the prediction's metrics

    async def charges(self, since: datetime) -> list[VendorCharge]:
        """The account's usage listing since ``since``: each billed prediction, its amount and metadata."""
        out: list[VendorCharge] = []
        cursor: str | None = None
        for _ in range(MAX_USAGE_PAGES):
            params = {"since": since.isoformat(), "limit": str(USAGE_PAGE)}
            if cursor:
                params["cursor"] = cursor
            page: _UsagePage = self.parse(_UsagePage, await self.request("GET", "/v1/usage", params=params))
            for u in page.results:
                key = u.metadata.get("operation_key")
                out.append(
                    VendorCharge(
                        job_id=u.prediction_id,
                        operation_key=str(key) if key else None,
                        amount=u.amount,
                        at=u.created_at,
                    )
                )
            if page.next is None:
                return out
            cursor = page.next
        raise VendorCannotTell(f"more than {MAX_USAGE_PAGES * USAGE_PAGE} billed predictions since {since}")

    def _normalise(self, p: _Prediction) -> VendorJob:
        try:
            return p.normalised()
        except ValueError as e:
            from vendors.errors import VendorBadResponse

            raise VendorBadResponse(f"malformed prediction from the vendor: {e}") from e

    def _job(self, response: Any) -> VendorJob:
        return self._normalise(self.parse(_Prediction, response))
