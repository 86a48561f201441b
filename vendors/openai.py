"""The ``openai`` adapter: OpenAI's chat completions and image generation, synchronous.

It speaks OpenAI's published API as its OpenAPI description defines it (``openai/openai-openapi``,
``openapi.yaml``). The extract the tests hold it to is ``tests/vendors/schemas/openai-openapi.json`` (its
provenance in ``tests/vendors/schemas/SOURCES.md``): ``tests/vendors/test_openai_wire.py`` records every
request this adapter sends to the simulator, and every answer, and validates both against it. The document's
paths have no ``/v1`` (its server is ``https://api.openai.com/v1``); a route's ``base_url`` is the host, and
the adapter posts to ``/v1/...``::

    POST /v1/chat/completions    {model, messages}                          → {id, object, created, model,
                                                                               choices, usage}
    POST /v1/images/generations  {model, prompt, size, n: 1
                                  [, response_format: "b64_json" (dall-e)]}  → {created, data, [usage]}

Chat (every executor but ``image.*``): the route's ``model`` (default ``gpt-4o-mini``), a system message
naming the step and the request as JSON in a user message. The first choice's ``content`` is the output;
``usage.prompt_tokens`` / ``completion_tokens`` are the job's tokens (a route prices them per 1k). A choice
that ends ``finish_reason: "content_filter"`` or carries a ``refusal`` is a content rejection: a FAILED job
with ``JobErrorKind.CONTENT_REJECTED`` at the cost of its usage (those tokens were billed), which the
operation records as a content failure (``activities/outputs.py``), so the same input is not sent again as
if the failure were technical. ``finish_reason: "length"`` (a cut answer) is returned as it came: the checks
judge it.

Images (``image.*`` executors): the route's ``model`` (default ``gpt-image-1``) decides what is sent. The
document states these rules in prose only (CreateImageRequest's descriptions):

============================  ===============================  ============================  ==========
model                         sizes                            ``response_format``           prompt max
============================  ===============================  ============================  ==========
GPT image models              1024x1024, 1536x1024, 1024x1536  never: they answer base64     32000
(``gpt-image-*``; any model
not below is taken as one)
``dall-e-2``                  256x256, 512x512, 1024x1024      ``b64_json``                  1000
``dall-e-3``                  1024x1024, 1792x1024, 1024x1792  ``b64_json``                  4000
============================  ===============================  ============================  ==========

* ``size``: of the model's sizes, the one nearest the request's ``width`` x ``height`` in aspect ratio (on a
  log scale, so 2:1 and 1:2 are as far from 1:1); among equally near ones the smallest covering both sides,
  else the largest. Without a width and height: 1024x1024. So 1920x1080 is 1536x1024 (GPT image models) or
  1792x1024 (``dall-e-3``), 64x64 is 1024x1024 (GPT, ``dall-e-3``) or 256x256 (``dall-e-2``). The image may
  therefore be larger or smaller than asked: the artifact is probed, and a node's output bounds judge it.
  (``gpt-image-2`` also takes other sizes; the adapter asks it for the standard ones all GPT image models
  take.)
* ``n`` is always 1 (``dall-e-3`` takes nothing else); ``b64_json`` is asked of dall-e so that the image comes
  in the answer, not at a URL that expires in an hour (a URL answer is still read). No ``output_format``:
  the document's default, png.
* The prompt is the request's ``prompt`` (else ``shot``, else the request as JSON), cut to the model's
  maximum.
* Cost: GPT image models report ``usage`` (ImageGenUsage): its ``input_tokens`` / ``output_tokens`` are the
  job's tokens, priced by the route's per-1k-token prices (plus any per-call price). dall-e reports no usage:
  the route's per-call price.
* A content rejection of an image request is the API's 400 (``moderation_blocked`` /
  ``content_policy_violation``): ``VendorRejected``, nothing billed.

Validated: every answer goes through the pydantic models below, which require what the document requires
wherever this adapter relies on it and tolerate every other field (unknown ones included). Chat: ``id``,
``choices`` (at least one), each choice's ``message`` and ``finish_reason``, the message's ``content``
(nullable); ``refusal`` (required by the document, nullable) is read as null when absent; ``usage`` when
present needs ``prompt_tokens`` and ``completion_tokens`` (integers: an odd figure, negative, reaches the
money gate and is flagged there rather than lose a paid answer). Images: ``data`` (at least one, with
``b64_json`` or ``url``); ``usage`` when present needs ``input_tokens`` and ``output_tokens``. Not required,
since nothing here reads them: ``object``, ``created``, ``model``, ``logprobs``, ``total_tokens``. Nothing is
read with an unguarded ``r.json()[...]``.

Identification: the OperationKey travels as ``X-Client-Request-Id``. OpenAI documents that request header
(not in the OpenAPI document: its API reference, "supplying your own request id with X-Client-Request-Id";
the openai-python client forwards it) only as a label on its logs, for support to find a call. It is **no
idempotency key**: OpenAI neither deduplicates on it nor looks calls up or bills by it. A call is the whole
job: ``submit`` returns it finished, its output inline (or at a URL), so there is no job to poll, look up or
cancel, and no late creation. Nothing is idempotent (mode ``none``): a call whose answer was lost is an
unknown outcome for a person.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass
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
    Sent,
    VendorCharge,
    VendorJob,
)
from vendors.errors import VendorBadResponse, VendorCannotTell, VendorNotFound
from vendors.httpbase import HttpVendor

DEFAULT_CHAT_MODEL = "gpt-4o-mini"
DEFAULT_IMAGE_MODEL = "gpt-image-1"
DEFAULT_IMAGE_SIZE = (1024, 1024)  # what every model takes; the GPT image models' default


# ── the answers, validated ────────────────────────────────────────────────────────────────────────────────
class _Message(BaseModel):
    content: str | None  # required by the document, nullable
    refusal: str | None = None  # required by the document; an OpenAI-compatible server may leave it out


class _Choice(BaseModel):
    message: _Message
    finish_reason: str  # stop, length, tool_calls, content_filter, function_call


class _Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class ChatCompletion(BaseModel):
    """A chat completion's answer, validated (also read by the review's and the planner's chat client)."""

    id: str = Field(min_length=1, max_length=200)
    model: str | None = None
    choices: list[_Choice] = Field(min_length=1)
    usage: _Usage | None = None

    @property
    def text(self) -> str:
        return self.choices[0].message.content or ""


class _Image(BaseModel):
    b64_json: str | None = None
    url: str | None = None


class _ImageUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class _Images(BaseModel):
    created: int | None = None
    data: list[_Image] = Field(min_length=1)
    usage: _ImageUsage | None = None


def chat_job(chat: ChatCompletion) -> VendorJob:
    """The job a chat answer is: its first choice's content, or a content rejection (a refusal, the content
    filter) at the cost of its usage."""
    choice = chat.choices[0]
    tokens_in = chat.usage.prompt_tokens if chat.usage is not None else 0
    tokens_out = chat.usage.completion_tokens if chat.usage is not None else 0
    why = None
    if choice.message.refusal is not None:
        why = f"the model refused: {choice.message.refusal}"
    elif choice.finish_reason == "content_filter":
        why = "OpenAI's content filter withheld the answer (finish_reason content_filter)"
    if why is not None:
        return VendorJob(
            id=chat.id,
            status=JobStatus.FAILED,
            progress=1.0,
            tokens_in=tokens_in,
            tokens_out=tokens_out,
            error=JobError(kind=JobErrorKind.CONTENT_REJECTED, message=why[:4000]),
        )
    return VendorJob(
        id=chat.id,
        status=JobStatus.SUCCEEDED,
        progress=1.0,
        tokens_in=tokens_in,
        tokens_out=tokens_out,
        inline=chat.text.encode(),
    )


# ── what each image model takes ───────────────────────────────────────────────────────────────────────────
@dataclass(frozen=True, slots=True)
class ImageModel:
    """An image model's rules, as the document's prose states them."""

    sizes: tuple[tuple[int, int], ...]
    max_prompt: int
    dall_e: bool  # takes response_format (b64_json is asked); a GPT image model answers base64 only


GPT_IMAGE = ImageModel(((1024, 1024), (1536, 1024), (1024, 1536)), 32000, dall_e=False)
IMAGE_MODELS = {
    "dall-e-2": ImageModel(((256, 256), (512, 512), (1024, 1024)), 1000, dall_e=True),
    "dall-e-3": ImageModel(((1024, 1024), (1792, 1024), (1024, 1792)), 4000, dall_e=True),
}


def image_model(name: str) -> ImageModel:
    """The rules of ``name``: dall-e-2, dall-e-3, else a GPT image model's."""
    return IMAGE_MODELS.get(name, GPT_IMAGE)


def _side(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def image_size(model: ImageModel, width: Any, height: Any) -> str:
    """The size to ask ``model`` for a ``width`` x ``height`` request (see the module doc)."""
    w, h = _side(width), _side(height)
    if w is None or h is None:
        return "{}x{}".format(*DEFAULT_IMAGE_SIZE)
    want = math.log(w / h)

    def rank(size: tuple[int, int]) -> tuple[float, bool, int]:
        covers = size[0] >= w and size[1] >= h
        area = size[0] * size[1]
        return round(abs(math.log(size[0] / size[1]) - want), 9), not covers, area if covers else -area

    return "{}x{}".format(*min(model.sizes, key=rank))


def _is_image(executor: str) -> bool:
    return executor.startswith("image.")


class OpenAIAdapter(HttpVendor):
    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(can_lookup=False, can_cancel=False, synchronous=True, has_billing=False)

    async def submit(
        self,
        *,
        operation_key: str,
        executor: str,
        request: dict[str, Any],
        estimate: Decimal,
        files: dict[str, str] | None = None,
    ) -> VendorJob:
        # A label on OpenAI's logs (see the module doc): no idempotency, no lookup.
        headers = {"X-Client-Request-Id": operation_key}
        if _is_image(executor):
            return await self._image(operation_key, request, headers)
        model = self.route.model or DEFAULT_CHAT_MODEL
        messages = [
            {"role": "system", "content": f"You are the {executor} step of a production pipeline."},
            {"role": "user", "content": json.dumps(request, sort_keys=True)},
        ]
        response = await self.request(
            "POST", "/v1/chat/completions", json={"model": model, "messages": messages}, headers=headers
        )
        return chat_job(self.parse(ChatCompletion, response))

    async def _image(self, operation_key: str, request: dict[str, Any], headers: dict[str, str]) -> VendorJob:
        name = self.route.model or DEFAULT_IMAGE_MODEL
        model = image_model(name)
        prompt = str(request.get("prompt") or request.get("shot") or json.dumps(request, sort_keys=True))
        body: dict[str, Any] = {
            "model": name,
            "prompt": prompt[: model.max_prompt],
            "size": image_size(model, request.get("width"), request.get("height")),
            "n": 1,
        }
        if model.dall_e:
            body["response_format"] = "b64_json"
        response = await self.request("POST", "/v1/images/generations", json=body, headers=headers)
        images: _Images = self.parse(_Images, response)
        first = images.data[0]
        usage = images.usage
        tokens_in, tokens_out = (usage.input_tokens, usage.output_tokens) if usage is not None else (0, 0)
        job_id = f"img-{operation_key}"
        if first.b64_json is not None:
            try:
                data = base64.b64decode(first.b64_json, validate=True)
            except (binascii.Error, ValueError) as e:
                raise VendorBadResponse("image data is not valid base64") from e
            return VendorJob(
                id=job_id,
                status=JobStatus.SUCCEEDED,
                progress=1.0,
                tokens_in=tokens_in,
                tokens_out=tokens_out,
                inline=data,
            )
        if first.url is not None:
            return VendorJob(
                id=job_id,
                status=JobStatus.SUCCEEDED,
                progress=1.0,
                tokens_in=tokens_in,
                tokens_out=tokens_out,
                result=ResultFile(url=first.url),
            )
        raise VendorBadResponse("image answer has neither b64_json nor url")

    async def get(self, job_id: str) -> VendorJob:
        raise VendorNotFound(f"{job_id}: a synchronous API keeps no jobs to look at")

    async def find_by_key(
        self, operation_key: str, *, since: datetime | None = None, sent: Sent | None = None
    ) -> list[VendorJob]:
        raise VendorCannotTell(
            "a synchronous API cannot look calls up (X-Client-Request-Id only labels logs)"
        )

    async def cancel(self, job_id: str) -> VendorJob:
        raise VendorNotFound(f"{job_id}: a synchronous call cannot be cancelled")

    async def charged(self, operation_key: str, job_id: str | None) -> str | None:
        return None

    async def charges(self, since: datetime) -> list[VendorCharge]:
        # OpenAI's usage and costs APIs report totals per time bucket, model and project, never per call:
        # nothing there names a request, so no charge can be matched to an operation.
        raise VendorCannotTell("the usage API reports totals per time bucket, not charges per call")
