"""The ``predictions`` adapter: Replicate's HTTP API, as its published OpenAPI document describes it.

    POST /v1/predictions              {version, input, webhook?, webhook_events_filter?}  → 201 prediction
    GET  /v1/predictions/{id}         → {id, model, version, input, status, output, error, metrics,
                                         data_removed, created_at, urls, …}
    GET  /v1/predictions?created_after=T  → {results: [predictions, newest first], next: URL | null, previous}
    POST /v1/predictions/{id}/cancel  → prediction

What that API does not offer, and what follows from it (checked against the document, kept with its source
in ``tests/vendors/schemas/``):

* **No idempotency key, no metadata.** The create body is exactly ``version``, ``input``, ``webhook``,
  ``webhook_events_filter`` (``additionalProperties: false``); every POST creates and bills a prediction. So
  the route's mode is at most ``lookup_only``, and a prediction whose answer was lost is found again only by
  what was asked: the listing's items carry ``version``, ``input`` and ``created_at``, and ``find_by_key``
  matches the recorded request (``Sent``, from the operation's INTENT) against them, within the send's window
  (``created_after``). Inputs that were artifact references went out as URLs made for that one send (never
  recorded): any URL matches them. Two predictions of one version with the same input in the window cannot be
  told apart — another operation may own one — so ``find_by_key`` says it cannot tell (the operation is then
  an unknown outcome for a person), never claims one. ``webhook`` is not returned by any endpoint, so a
  webhook URL cannot be read back; a route's ``webhook_url`` (``{operation_key}`` in it) is sent for the
  callback itself.
* **No billing listing.** No endpoint lists charges or usage: ``charged`` and ``charges`` cannot say
  (``can_list_charges`` is false); the bill is the route's price of ``metrics.predict_time`` (plus
  ``per_call``), which is what Replicate bills for public models.
* **Outputs need the key.** "You'll need to pass the Authorization header to request them" — they are
  served by ``replicate.delivery`` and its subdomains: list ``replicate.delivery`` and
  ``*.replicate.delivery`` in the route's ``allow_hosts`` (the key goes to the route's own origin and those
  hosts only, over https). Outputs are removed after an hour by default (``data_removed``): a
  prediction whose output is gone is a purge (the download fails that output).
* Statuses: ``starting``, ``processing``, ``succeeded``, ``failed``, ``canceled``, and ``aborted`` (ended
  before it started running: nothing ran).

Inputs: a request's ``inputs`` (artifact references, ``rules.inputs``) become the model's own inputs, each
reference replaced by the URL the store made for this send (``files``); the rest of the request is sent as is.
"""

from __future__ import annotations

import json
from datetime import datetime
from decimal import Decimal
from typing import Any, Final
from urllib.parse import parse_qsl, quote, urlsplit

from pydantic import BaseModel, Field, ValidationError

from rules.inputs import is_ref
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
from vendors.errors import VendorBadResponse, VendorCannotTell
from vendors.httpbase import HttpVendor

MAX_PAGES: Final = 20  # a lookup never lists more than this many pages (2,000 predictions) back
_STATUS: Final = {
    "starting": JobStatus.RUNNING,
    "processing": JobStatus.RUNNING,
    "succeeded": JobStatus.SUCCEEDED,
    "failed": JobStatus.FAILED,
    "canceled": JobStatus.CANCELLED,
    "aborted": JobStatus.CANCELLED,
}
_CONTENT_WORDS: Final = ("nsfw", "content policy", "safety")
_ANY_URL: Final = object()  # in an expected input: the URL made for one send of an artifact reference


class _Prediction(BaseModel):
    id: str = Field(min_length=1, max_length=200)
    status: str
    version: str | None = None
    input: dict[str, Any] = Field(default_factory=dict)
    output: Any = None
    error: str | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    data_removed: bool = False
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
            seconds=float(seconds) if isinstance(seconds, int | float) else None,
            error=error,
            result=result,
        )


class _Page(BaseModel):
    results: list[_Prediction]
    next: str | None = None


class PredictionsAdapter(HttpVendor):
    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(can_lookup=True, can_cancel=True, synchronous=False, has_billing=False)

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
            "version": self._version(executor),
            "input": model_input(request, files or {}),
        }
        if self.route.webhook_url is not None:
            body["webhook"] = self.route.webhook_url.replace("{operation_key}", quote(operation_key, safe=""))
            body["webhook_events_filter"] = ["completed"]
        return self._job(await self.request("POST", "/v1/predictions", json=body))

    async def get(self, job_id: str) -> VendorJob:
        return self._job(await self.request("GET", f"/v1/predictions/{quote(job_id, safe='')}"))

    async def find_by_key(
        self, operation_key: str, *, since: datetime | None = None, sent: Sent | None = None
    ) -> list[VendorJob]:
        """The prediction ``sent`` created, found by its version and input among those created since
        ``since`` (newest first, a page at a time); [] once the window is listed without it.

        VendorCannotTell: nothing says what was sent; the listing was cut before it reached ``since``; or
        more than one prediction matches (another operation may have asked the same)."""
        if sent is None:
            raise VendorCannotTell(f"{operation_key}: Replicate keeps no key; what was sent is not on record")
        version = self._version(sent.executor)
        expected = model_input(sent.request, None)
        found: list[_Prediction] = []
        params: dict[str, str] = {"created_after": since.isoformat()} if since is not None else {}
        for _ in range(MAX_PAGES):
            page: _Page = self.parse(_Page, await self.request("GET", "/v1/predictions", params=params))
            found += [p for p in page.results if p.version == version and same_input(p.input, expected)]
            if page.next is None:
                break
            params = _cursor(page.next)
        else:
            raise VendorCannotTell(f"{operation_key}: not in the newest {MAX_PAGES} pages of predictions")
        if len(found) > 1:
            ids = ", ".join(p.id for p in found[:5])
            raise VendorCannotTell(
                f"{operation_key}: {len(found)} predictions of {version} with its input ({ids}): which one is"
                " this operation's cannot be told"
            )
        return [self._normalise(p) for p in found]

    async def cancel(self, job_id: str) -> VendorJob:
        return self._job(await self.request("POST", f"/v1/predictions/{quote(job_id, safe='')}/cancel"))

    async def charged(self, operation_key: str, job_id: str | None) -> str | None:
        return None  # no billing API: the cost is the route's price of the prediction's metrics

    async def charges(self, since: datetime) -> list[VendorCharge]:
        raise VendorCannotTell("Replicate's API lists no charges or usage (its bills are on the dashboard)")

    def _version(self, executor: str) -> str:
        return self.route.model or executor

    def _normalise(self, p: _Prediction) -> VendorJob:
        try:
            return p.normalised()
        except (ValueError, ValidationError) as e:
            raise VendorBadResponse(f"malformed prediction from the vendor: {e}") from e

    def _job(self, response: Any) -> VendorJob:
        return self._normalise(self.parse(_Prediction, response))


def model_input(request: dict[str, Any], files: dict[str, str] | None) -> dict[str, Any]:
    """The model's ``input`` for a request: its fields, and each of its ``inputs`` as a model input of that
    name, every artifact reference replaced by its URL for this send (``files``: sha256 → URL; None: by a
    marker any URL matches, for ``same_input``)."""
    out = {k: v for k, v in request.items() if k != "inputs"}
    inputs = request.get("inputs")
    if isinstance(inputs, dict):
        out.update({name: _urls(value, files) for name, value in inputs.items()})
    elif inputs is not None:
        out["inputs"] = _urls(inputs, files)
    return out


def _urls(value: Any, files: dict[str, str] | None) -> Any:
    if is_ref(value):
        return _ANY_URL if files is None else files.get(value["sha256"], value["uri"])
    if isinstance(value, dict):
        return {k: _urls(v, files) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_urls(v, files) for v in value]
    return value


def same_input(seen: Any, expected: Any) -> bool:
    """Whether the input a prediction reports is the one ``expected`` (``model_input(request, None)``)
    describes: equal as JSON, a URL standing wherever an artifact reference was sent."""
    if expected is _ANY_URL:
        return isinstance(seen, str) and seen.startswith(("https://", "http://", "file://"))
    if isinstance(expected, dict):
        return (
            isinstance(seen, dict)
            and seen.keys() == expected.keys()
            and all(same_input(seen[k], v) for k, v in expected.items())
        )
    if isinstance(expected, list):
        return (
            isinstance(seen, list)
            and len(seen) == len(expected)
            and all(same_input(s, e) for s, e in zip(seen, expected, strict=True))
        )
    return bool(_json(seen) == _json(expected))


def _json(value: Any) -> Any:
    """A scalar as it travels (a Decimal in a recorded request is a number on the wire)."""
    return json.loads(json.dumps(value, default=str))


def _cursor(next_url: str) -> dict[str, str]:
    """The query of the listing's ``next`` URL: sent to our own base URL, never to whatever host it names
    (the key goes only to the route's origin)."""
    return dict(parse_qsl(urlsplit(next_url).query, keep_blank_values=True))
