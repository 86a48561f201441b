"""The ``queue`` adapter: the queue-style API of hosted inference services, modelled on fal.ai's Queue API.

    POST {base}/queue/submit[?fal_webhook=URL]  {model input}      → 202 {request_id, status: IN_QUEUE, …}
    GET  {base}/queue/requests/{id}/status      → {status, queue_position?, logs?, metrics?, error?, cost?}
    GET  {base}/queue/requests/{id}             → the result: {output: {url, …} | …, metrics, cost?}
    PUT  {base}/queue/requests/{id}/cancel      → 202 {status: CANCELLATION_REQUESTED}
                                                  (400 {status: ALREADY_COMPLETED}: it finished)

Source followed: fal.ai's documentation of its Queue API (docs.fal.ai "Queue API" / "Asynchronous Inference",
the Inference API reference's queue OpenAPI document, "Webhooks", "Request errors"), read 2026-12-02 from the
stored copies of those pages. The default paths above are this project's generic shape; a fal route names its
own with ``paths`` (``ROUTE_PATHS``), no code:

    base_url: https://queue.fal.run
    auth: {scheme: header, name: Authorization, prefix: "Key "}
    paths: {submit: /fal-ai/flux/dev, status: "/fal-ai/flux/requests/{job_id}/status",
            result: "/fal-ai/flux/requests/{job_id}", cancel: "/fal-ai/flux/requests/{job_id}/cancel"}
    webhook_url: "https://hooks.example/fal?operation_key={operation_key}"

What that API offers, and what follows from it:

* **No idempotency key, no client request id.** The submit body is the model's input and nothing else; the
  query takes ``fal_webhook``, ``fal_max_queue_length`` and timeouts, none of which the queue deduplicates on
  or lets a caller search by. Every submit is a new, billed request (``deduplicates=False``).
* **No way to find a request again without its id.** The status, result and cancel calls all need the
  ``request_id`` the submit answered; the platform's "list requests by endpoint" is for the owner of a
  deployed app, not for a caller of a hosted model. So ``can_lookup=False``: a submit whose answer was lost
  is an unknown outcome (the route's mode falls to ``none`` through ``vendors.adapter.mode_of``), counted at
  the estimate with a cost anomaly for a person — never resent.
* **No billing API for a caller** (usage is on the dashboard): ``has_billing=False``,
  ``can_list_charges=False``. The cost is the result's ``cost`` where the vendor states one, else the route's
  ``price`` of ``metrics.inference_time`` (``price.per_second``) and ``per_call``.
* **The webhook URL** (``fal_webhook``) is the one place an OperationKey reaches the vendor: a route's
  ``webhook_url`` (``{operation_key}`` in it) is sent for the callback itself; the vendor never returns it.
* **Statuses.** fal documents ``IN_QUEUE`` (with ``queue_position``), ``IN_PROGRESS`` and ``COMPLETED``; a
  request that failed is ``COMPLETED`` with an ``error`` (its result call answers the error). Queue vendors
  of the same shape also say ``FAILED`` and ``CANCELLED`` (``CANCELED``): all are read. A word not listed
  here makes the answer unreadable (``VendorBadResponse``).
* **Cancel** removes a queued request, or signals a running one (the status then says how it ended):
  ``CANCELLATION_REQUESTED`` (202), ``ALREADY_COMPLETED`` (400), ``NOT_FOUND`` (404).
* **Outputs** are URLs on the vendor's CDN (``fal.media``), served without the key (on another origin the
  key never goes there anyway); they expire: a 404 there is a purge (``VendorNotFound``: that output fails at
  its job's cost). The result body's first ``url`` is the output (``output.url``, ``images[0].url``,
  ``video.url``, …).

Inputs: a request's ``inputs`` (artifact references) become the model's inputs, each reference replaced by the
URL the store made for this send (``files``), as the ``predictions`` adapter does.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from decimal import Decimal
from typing import Any, ClassVar, Final
from urllib.parse import quote

from vendors.adapter import (
    Capabilities,
    JobError,
    JobErrorKind,
    JobStatus,
    ResultFile,
    Sent,
    VendorCharge,
    VendorJob,
)
from vendors.errors import VendorBadResponse, VendorCannotTell, VendorRejected
from vendors.httpbase import HttpVendor, json_or_none
from vendors.predictions import model_input

ADAPTER_PROTOCOL_VERSION = 1

_STATUS: Final = {
    "IN_QUEUE": JobStatus.RUNNING,
    "IN_PROGRESS": JobStatus.RUNNING,
    "COMPLETED": JobStatus.SUCCEEDED,  # unless it carries an error: then failed
    "OK": JobStatus.SUCCEEDED,  # the webhook's word
    "FAILED": JobStatus.FAILED,
    "ERROR": JobStatus.FAILED,  # the webhook's word
    "CANCELLED": JobStatus.CANCELLED,
    "CANCELED": JobStatus.CANCELLED,
}
# An error whose words say the same input would be refused again: a person decides, it is not retried.
_CONTENT_WORDS: Final = ("nsfw", "content policy", "content_policy", "safety", "moderation", "content filter")
_MAX_DEPTH: Final = 6


class QueueAdapter(HttpVendor):
    """Client of a queue-style inference API (see the module doc)."""

    ROUTE_PATHS: ClassVar[Mapping[str, str]] = {
        "submit": "/queue/submit",
        "status": "/queue/requests/{job_id}/status",
        "result": "/queue/requests/{job_id}",
        "cancel": "/queue/requests/{job_id}/cancel",
    }

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            can_lookup=False,  # no key of ours and no listing a caller can search
            can_cancel=True,
            synchronous=False,
            has_billing=False,
            deduplicates=False,
            can_list_charges=False,
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
        """One POST of the model's input; the webhook URL (if the route has one) carries the OperationKey."""
        params: dict[str, str] = {}
        if self.route.webhook_url is not None:
            params["fal_webhook"] = self.route.webhook_url.replace(
                "{operation_key}", quote(operation_key, safe="")
            )
        response = await self.request(
            "POST", self.path("submit"), json=model_input(request, files or {}), params=params or None
        )
        body = _object(response)
        request_id = body.get("request_id")
        if not isinstance(request_id, str) or not request_id or len(request_id) > 200:
            raise VendorBadResponse("malformed answer from the vendor: no request_id in the submit's answer")
        status = _status(body.get("status", "IN_QUEUE"))
        if status != JobStatus.RUNNING:
            # Accepted, finished already: read it as the status call says (never a guess from this answer).
            return await self.get(request_id)
        return VendorJob(id=request_id, status=JobStatus.RUNNING, progress=0.0)

    async def get(self, job_id: str) -> VendorJob:
        """The status; once it is COMPLETED, the result too (its output URL, metrics and cost)."""
        body = _object(await self.request("GET", self.path("status", job_id=job_id)))
        status = _status(body.get("status"))
        if status == JobStatus.RUNNING:
            progress = 0.0 if body.get("status") == "IN_QUEUE" else None
            return VendorJob(id=job_id, status=status, progress=progress)
        seconds, cost = _usage(body)
        error = _error(body)
        if status == JobStatus.SUCCEEDED and error is None:
            try:
                result = _object(await self.request("GET", self.path("result", job_id=job_id)))
            except VendorRejected as e:
                # fal: a request that failed is COMPLETED, and its result call answers the error (422: the
                # model refused this input, which it will refuse again; another 4xx: it failed).
                kind = JobErrorKind.CONTENT_REJECTED if e.status_code == 422 else JobErrorKind.TECHNICAL
                error = JobError(kind=kind, message=str(e)[:4000])
                return VendorJob(
                    id=job_id, status=JobStatus.FAILED, progress=1.0, seconds=seconds, cost=cost, error=error
                )
            r_seconds, r_cost = _usage(result)
            seconds = r_seconds if r_seconds is not None else seconds
            cost = r_cost if r_cost is not None else cost
            error = _error(result)
            if error is None:
                url = first_url(result.get("output", result))
                return VendorJob(
                    id=job_id,
                    status=JobStatus.SUCCEEDED,
                    progress=1.0,
                    seconds=seconds,
                    cost=cost,
                    result=ResultFile(url=url) if url is not None else None,
                )
        if status == JobStatus.SUCCEEDED:  # COMPLETED with an error: the request failed
            status = JobStatus.FAILED
        if status == JobStatus.FAILED and error is None:
            error = JobError(kind=JobErrorKind.TECHNICAL, message="the request failed (no error given)")
        return VendorJob(
            id=job_id,
            status=status,
            progress=1.0 if status == JobStatus.FAILED else None,
            seconds=seconds,
            cost=cost,
            error=error if status == JobStatus.FAILED else None,
        )

    async def find_by_key(
        self, operation_key: str, *, since: datetime | None = None, sent: Sent | None = None
    ) -> list[VendorJob]:
        raise VendorCannotTell(
            f"{operation_key}: the queue keeps no key of ours and lists no requests: a request is found only"
            " by the request_id its submit answered"
        )

    async def cancel(self, job_id: str) -> VendorJob:
        """PUT cancel; the request as it then stands (400 ALREADY_COMPLETED: as it finished)."""
        try:
            await self.request("PUT", self.path("cancel", job_id=job_id))
        except VendorRejected as e:
            if e.status_code != 400:
                raise
            job = await self.get(job_id)  # ALREADY_COMPLETED: too late to cancel is not an error
            if not job.status.terminal:
                raise
            return job
        return await self.get(job_id)

    async def charged(self, operation_key: str, job_id: str | None) -> str | None:
        return None  # no billing API for a caller: the cost is the result's, else the route's price

    async def charges(self, since: datetime) -> list[VendorCharge]:
        raise VendorCannotTell("the queue API lists no charges or usage (the bill is on the dashboard)")


def _object(response: Any) -> dict[str, Any]:
    body = json_or_none(response)
    if body is None:
        raise VendorBadResponse("malformed answer from the vendor: not a JSON object")
    return body


def _status(word: Any) -> JobStatus:
    status = _STATUS.get(word) if isinstance(word, str) else None
    if status is None:
        raise VendorBadResponse(f"queue status {str(word)[:40]!r} is not one this adapter knows")
    return status


def _usage(body: dict[str, Any]) -> tuple[float | None, str | None]:
    """``metrics.inference_time`` (seconds) and the ``cost`` as written (None where absent)."""
    metrics = body.get("metrics")
    seconds = metrics.get("inference_time") if isinstance(metrics, dict) else None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        seconds = None
    cost = body.get("cost")
    if isinstance(cost, bool) or not isinstance(cost, str | int | float):
        cost = None
    return (float(seconds) if seconds is not None else None), (str(cost) if cost is not None else None)


def _error(body: dict[str, Any]) -> JobError | None:
    """The body's error, if it holds one: ``error`` (a string or ``{message}``), else ``detail``."""
    raw = body.get("error")
    if isinstance(raw, dict):
        raw = raw.get("message") or raw.get("detail") or str(raw)
    if not raw and body.get("status") in ("FAILED", "ERROR"):
        raw = body.get("detail")
    if raw is None or raw == "":
        return None
    text = (raw if isinstance(raw, str) else str(raw))[:4000]
    kind = body.get("error_type")
    content = kind in ("content_policy_violation",) or any(w in text.lower() for w in _CONTENT_WORDS)
    return JobError(kind=JobErrorKind.CONTENT_REJECTED if content else JobErrorKind.TECHNICAL, message=text)


def first_url(value: Any, depth: int = 0) -> str | None:
    """The first output URL in a result: the value itself if it is one, else the first ``url`` found
    depth-first (``{"url"}``, ``{"images": [{"url"}]}``, ``{"video": {"url"}}``)."""
    if depth > _MAX_DEPTH:
        return None
    if isinstance(value, str):
        return value if value.startswith(("https://", "http://", "/")) else None
    if isinstance(value, dict):
        url = value.get("url")
        if isinstance(url, str) and url:
            return url
        items = list(value.values())
    elif isinstance(value, list):
        items = value
    else:
        return None
    for item in items:
        if isinstance(item, dict | list) and (found := first_url(item, depth + 1)) is not None:
            return found
    return None
