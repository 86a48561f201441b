"""The ``openai`` adapter and the simulator's OpenAI dialect, held to OpenAI's own published API document.

The document is OpenAI's OpenAPI description, extracted at ``tests/vendors/schemas/openai-openapi.json``
(provenance: ``schemas/SOURCES.md``) and read with ``tests/vendors/openapi_check.py``. Its paths have no
``/v1`` (the API's base URL is ``https://api.openai.com/v1``): a recorded ``/v1/chat/completions`` is checked
as ``/chat/completions``.

Every request the adapter sends and every answer the simulator gives is recorded off a real HTTP client
talking to the real simulator over a socket (httpx event hooks on the client handed to the adapter: real
traffic, nothing mocked), then validated against the document. What the document states per image model only
in prose (sizes, ``response_format``, ``n``, prompt lengths, the GPT-image-only parameters) is checked by
:func:`prose_problems`, and the simulator refuses it the way the API does: a simulator kinder than the API
would prove nothing about the adapter.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from openapi_check import (
    load,
    parameter_problems,
    request_problems,
    response_problems,
    schema_problems,
)

from vendors.adapter import JobErrorKind, JobStatus, job_amount
from vendors.errors import VendorRateLimited, VendorRejected
from vendors.openai import ChatCompletion, OpenAIAdapter, chat_job
from vendors.routes import RouteSpec
from vendors.simulator.chat import CHAT_PARAMETERS, IMAGE_PARAMETERS
from vendors.simulator.config import DEFAULT_CHAT

if TYPE_CHECKING:
    from tests.vendors.conftest import SimAdmin

DOC = load("openai")
CHAT = "/chat/completions"
IMAGES = "/images/generations"
PROMPT = "a lighthouse at dusk"

# What the document says per image model in prose only (CreateImageRequest's descriptions).
GPT_IMAGE_SIZES = frozenset({"1024x1024", "1536x1024", "1024x1536", "auto"})
DALL_E_SIZES = {
    "dall-e-2": frozenset({"256x256", "512x512", "1024x1024"}),
    "dall-e-3": frozenset({"1024x1024", "1792x1024", "1024x1792"}),
}
MAX_PROMPT = {"dall-e-2": 1000, "dall-e-3": 4000}
GPT_IMAGE_ONLY = (
    "output_format",
    "output_compression",
    "background",
    "moderation",
    "stream",
    "partial_images",
)


def prose_problems(path: str, body: Any) -> list[str]:
    """What an image request breaks of the document's per-model prose (the schema cannot say it)."""
    if path != IMAGES or not isinstance(body, dict):
        return []
    gpt_only = any(body.get(p) is not None for p in GPT_IMAGE_ONLY)
    model = body.get("model") or ("gpt-image-1" if gpt_only else "dall-e-2")  # the document's default
    gpt = model.startswith("gpt-image-")
    found = []
    size = body.get("size")
    allowed = GPT_IMAGE_SIZES if gpt else DALL_E_SIZES.get(model)
    if (
        size is not None
        and allowed is not None
        and size not in allowed
        and not _gpt_image_2_size(model, size)
    ):
        found.append(f"size {size!r} is not one {model} takes ({sorted(allowed)})")
    if gpt and body.get("response_format") is not None:
        found.append(f"response_format is not supported for {model} (GPT image models always answer base64)")
    if not gpt and gpt_only:
        found.append(f"{[p for p in GPT_IMAGE_ONLY if body.get(p) is not None]} are GPT-image-only")
    if model == "dall-e-3" and body.get("n") not in (None, 1):
        found.append("dall-e-3 takes only n=1")
    if len(str(body.get("prompt", ""))) > MAX_PROMPT.get(model, 32000):
        found.append(f"prompt longer than {model} takes")
    return found


def _gpt_image_2_size(model: str, size: str) -> bool:
    """gpt-image-2 takes any WIDTHxHEIGHT with sides divisible by 16, an aspect ratio within 1:3..3:1, at
    most 3840x2160 (the document; its "current pixel and edge limits" are not stated, so not checked)."""
    if not model.startswith("gpt-image-2"):
        return False
    try:
        width, height = (int(v) for v in size.split("x"))
    except ValueError:
        return False
    long, short = max(width, height), min(width, height)
    return (
        short > 0 and width % 16 == height % 16 == 0 and long <= 3 * short and long <= 3840 and short <= 2160
    )


# ── recording real traffic ────────────────────────────────────────────────────────────────────────────────
@dataclass
class Exchange:
    method: str
    path: str  # as the document spells it: no /v1
    headers: httpx.Headers
    request: Any
    status: int
    answer: Any


@dataclass
class Wire:
    """Every exchange of ``client`` (its response hook reads each answer whole; the caller reads it after)."""

    client: httpx.AsyncClient = field(init=False)
    exchanges: list[Exchange] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.client = httpx.AsyncClient(event_hooks={"response": [self.record]})

    async def record(self, response: httpx.Response) -> None:
        await response.aread()
        sent = response.request
        try:
            request = json.loads(sent.content) if sent.content else None
        except ValueError:
            request = sent.content
        try:
            answer = response.json()
        except ValueError:
            answer = response.text
        path = sent.url.path.removeprefix("/v1")
        self.exchanges.append(
            Exchange(sent.method, path, sent.headers, request, response.status_code, answer)
        )

    @property
    def only(self) -> Exchange:
        assert len(self.exchanges) == 1, [(x.path, x.status) for x in self.exchanges]
        return self.exchanges[0]

    def problems(self) -> list[str]:
        """Every difference between the recorded traffic and the document (its schemas and its prose)."""
        found = []
        for x in self.exchanges:
            what = f"{x.method} {x.path}"
            found += [f"{what} request: {p}" for p in request_problems(DOC, x.method, x.path, x.request)]
            found += [f"{what} request: {p}" for p in prose_problems(x.path, x.request)]
            if x.status >= 400 and x.status != 429:  # the document declares 200 (and 429 for chat) only
                answer = schema_problems(DOC, "ErrorResponse", x.answer)
            else:
                answer = response_problems(DOC, x.method, x.path, x.status, x.answer)
            found += [f"{what} answer {x.status}: {p}" for p in answer]
        return found


@pytest.fixture
async def wire() -> AsyncIterator[Wire]:
    recorded = Wire()
    yield recorded
    await recorded.client.aclose()


def openai(wire: Wire, url: str, api_key: str, model: str | None = None, **route: Any) -> OpenAIAdapter:
    spec = RouteSpec.model_validate(
        {"adapter": "openai", "model": model, "mode": "none", "timeouts": {"request": 10.0}, **route}
    )
    return OpenAIAdapter(spec, url, api_key, client=wire.client)


def png_size(data: bytes) -> tuple[int, int]:
    assert data.startswith(b"\x89PNG\r\n\x1a\n"), data[:8]
    width, height = struct.unpack(">II", data[16:24])
    return width, height


# ── chat ──────────────────────────────────────────────────────────────────────────────────────────────────
@pytest.mark.parametrize("model", [None, "gpt-4.1-mini"])
async def test_chat_request_and_answer_conform_to_the_document(
    sim: SimAdmin, wire: Wire, api_key: str, key: str, model: str | None
) -> None:
    adapter = openai(wire, sim.url, api_key, model)

    job = await adapter.submit(
        operation_key=key, executor="llm.text", request={"prompt": "narrate shot 1"}, estimate=Decimal("0.01")
    )

    assert wire.problems() == []
    x = wire.only
    assert (x.method, x.path, x.status) == ("POST", CHAT, 200)
    assert x.request["model"] == (model or "gpt-4o-mini")
    assert x.headers["X-Client-Request-Id"] == key  # a label on the vendor's logs, nothing more
    assert parameter_problems(DOC, "POST", CHAT, "header", dict(x.headers)) == []
    usage = x.answer["usage"]
    assert job.status == JobStatus.SUCCEEDED and job.id == x.answer["id"]
    assert job.inline == DEFAULT_CHAT.encode()
    assert (job.tokens_in, job.tokens_out) == (usage["prompt_tokens"], usage["completion_tokens"])


async def test_a_content_filtered_chat_answer_is_a_paid_content_rejection(
    sim: SimAdmin, wire: Wire, api_key: str, key: str
) -> None:
    await sim.configure(executors={"chat": {"reject_content": 1}})
    adapter = openai(wire, sim.url, api_key)

    job = await adapter.submit(
        operation_key=key, executor="llm.text", request={"prompt": "x"}, estimate=Decimal("0.01")
    )

    assert wire.problems() == []
    choice = wire.only.answer["choices"][0]
    assert choice["finish_reason"] == "content_filter" and choice["message"]["content"] is None
    assert job.status == JobStatus.FAILED
    assert job.error is not None and job.error.kind == JobErrorKind.CONTENT_REJECTED
    assert "content_filter" in job.error.message
    assert job.tokens_in == wire.only.answer["usage"]["prompt_tokens"] > 0  # the prompt was paid for
    assert (await sim.charges())["count"] == 1


async def test_a_structured_output_refusal_is_a_content_rejection(
    sim: SimAdmin, wire: Wire, api_key: str, key: str
) -> None:
    await sim.configure(executors={"chat": {"reject_content": 1}})
    schema = {"type": "object", "properties": {"verdict": {"type": "string"}}}
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "judge"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "judgement", "schema": schema}},
    }
    headers = {"Authorization": f"Bearer {api_key}", "X-Client-Request-Id": key}

    await wire.client.post(f"{sim.url}/v1/chat/completions", json=body, headers=headers)

    assert wire.problems() == []
    answer = wire.only.answer
    assert answer["choices"][0]["message"]["refusal"] and answer["choices"][0]["message"]["content"] is None
    job = chat_job(ChatCompletion.model_validate(answer))
    assert job.status == JobStatus.FAILED
    assert job.error is not None and job.error.kind == JobErrorKind.CONTENT_REJECTED
    assert answer["choices"][0]["message"]["refusal"] in job.error.message


async def test_a_drawn_rate_limit_is_openais_429(sim: SimAdmin, wire: Wire, api_key: str, key: str) -> None:
    await sim.configure(executors={"chat": {"rate_limit": 1}})
    adapter = openai(wire, sim.url, api_key)

    with pytest.raises(VendorRateLimited):
        await adapter.submit(operation_key=key, executor="llm.text", request={}, estimate=Decimal("0.01"))

    assert wire.problems() == []  # the document declares chat's 429: ErrorResponse
    assert wire.only.status == 429 and wire.only.answer["error"]["code"] == "rate_limit_exceeded"


async def test_the_review_chat_client_speaks_the_document_too(
    sim: SimAdmin, wire: Wire, api_key: str
) -> None:
    from activities.llm import ChatClient  # the review's and the planner's client reads ChatCompletion

    client = ChatClient(wire.client, sim.url, api_key, "gpt-4o-mini", Decimal("0.002"))
    await client.complete("You are a reviewer.", "judge this", request_id="review-1")
    await client.complete(
        "You are a reviewer.", "judge this", schema={"type": "object"}, request_id="review-2"
    )

    assert len(wire.exchanges) == 2
    assert wire.problems() == []


# ── images ────────────────────────────────────────────────────────────────────────────────────────────────
# (route model, requested width, height) -> the size the adapter must ask: the model's size nearest in aspect
# ratio; among equals the smallest covering the request, else the largest. None: the route names no model.
IMAGE_CASES = [
    (None, 64, 64, "1024x1024"),
    ("gpt-image-1", 64, 64, "1024x1024"),
    ("gpt-image-1", 512, 512, "1024x1024"),  # the old adapter asked gpt-image-1 for 512x512
    ("gpt-image-1", 1920, 1080, "1536x1024"),
    ("gpt-image-1", 1080, 1920, "1024x1536"),
    ("gpt-image-1", None, None, "1024x1024"),
    ("gpt-image-1-mini", 1280, 720, "1536x1024"),
    ("gpt-image-1.5", 720, 1280, "1024x1536"),
    ("dall-e-2", 64, 64, "256x256"),
    ("dall-e-2", 300, 300, "512x512"),
    ("dall-e-2", 512, 512, "512x512"),
    ("dall-e-2", 1920, 1080, "1024x1024"),
    ("dall-e-2", None, None, "1024x1024"),
    ("dall-e-3", 64, 64, "1024x1024"),
    ("dall-e-3", 1920, 1080, "1792x1024"),
    ("dall-e-3", 1080, 1920, "1024x1792"),
]


@pytest.mark.parametrize(("model", "width", "height", "size"), IMAGE_CASES, ids=lambda v: str(v))
async def test_image_requests_are_what_the_routes_model_takes(
    sim: SimAdmin,
    wire: Wire,
    api_key: str,
    key: str,
    model: str | None,
    width: int | None,
    height: int | None,
    size: str,
) -> None:
    adapter = openai(wire, sim.url, api_key, model)
    request: dict[str, Any] = {"prompt": PROMPT, "format": "png"}
    if width is not None:
        request |= {"width": width, "height": height}

    job = await adapter.submit(
        operation_key=key, executor="image.keyframe", request=request, estimate=Decimal("0.05")
    )

    assert wire.problems() == []
    x = wire.only
    assert (x.path, x.status) == (IMAGES, 200)
    assert x.headers["X-Client-Request-Id"] == key
    gpt = not (model or "").startswith("dall-e")
    assert x.request == {
        "model": model or "gpt-image-1",
        "prompt": PROMPT,
        "size": size,
        "n": 1,
        **({} if gpt else {"response_format": "b64_json"}),
    }
    assert job.status == JobStatus.SUCCEEDED and job.inline is not None
    assert "x".join(map(str, png_size(job.inline))) == size
    if gpt:  # GPT image models report their token usage: what a route priced per token is priced by
        usage = x.answer["usage"]
        assert (job.tokens_in, job.tokens_out) == (usage["input_tokens"], usage["output_tokens"])
        assert job.tokens_out > 0
    else:
        assert "usage" not in x.answer and (job.tokens_in, job.tokens_out) == (0, 0)


async def test_a_gpt_image_route_priced_per_token_is_priced_from_the_reported_usage(
    sim: SimAdmin, wire: Wire, api_key: str, key: str
) -> None:
    price = {"per_1k_input_tokens": "0.005", "per_1k_output_tokens": "0.04"}
    adapter = openai(wire, sim.url, api_key, "gpt-image-1", price=price)

    job = await adapter.submit(
        operation_key=key, executor="image.keyframe", request={"prompt": PROMPT}, estimate=Decimal("1")
    )

    usage = wire.only.answer["usage"]
    expected = (
        Decimal("0.005") * usage["input_tokens"] / 1000 + Decimal("0.04") * usage["output_tokens"] / 1000
    )
    amount = job_amount(adapter.route, job).amount
    assert amount is not None and amount == expected.quantize(amount)


async def test_a_dall_e_route_is_priced_per_call(sim: SimAdmin, wire: Wire, api_key: str, key: str) -> None:
    adapter = openai(wire, sim.url, api_key, "dall-e-3", price={"per_call": "0.04"})

    job = await adapter.submit(
        operation_key=key, executor="image.keyframe", request={"prompt": PROMPT}, estimate=Decimal("1")
    )

    assert job_amount(adapter.route, job).amount == Decimal("0.04")


async def test_a_moderated_image_request_is_refused_unbilled(
    sim: SimAdmin, wire: Wire, api_key: str, key: str
) -> None:
    await sim.configure(executors={"images": {"reject_content": 1}})
    adapter = openai(wire, sim.url, api_key, "gpt-image-1")

    with pytest.raises(VendorRejected):
        await adapter.submit(
            operation_key=key, executor="image.keyframe", request={"prompt": PROMPT}, estimate=Decimal("1")
        )

    assert wire.problems() == []
    assert wire.only.status == 400 and wire.only.answer["error"]["code"] == "moderation_blocked"
    assert (await sim.charges())["count"] == 0


# ── the simulator: what it answers, and what it refuses as the API does ───────────────────────────────────
ANSWERED = {
    "chat-n-2": (CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}),
    "chat-json-schema": (
        CHAT,
        {
            "model": "m",
            "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}},
            },
            "temperature": 0,
        },
    ),
    "dall-e-2-url-by-default": (IMAGES, {"prompt": PROMPT}),
    "dall-e-3-revised-prompt": (
        IMAGES,
        {"model": "dall-e-3", "prompt": PROMPT, "response_format": "b64_json"},
    ),
    "gpt-image-1-auto": (
        IMAGES,
        {"model": "gpt-image-1", "prompt": PROMPT, "size": "auto", "quality": "low"},
    ),
    "gpt-image-2-any-size": (IMAGES, {"model": "gpt-image-2", "prompt": PROMPT, "size": "1536x864"}),
    "gpt-image-by-its-parameters": (IMAGES, {"prompt": PROMPT, "output_format": "png", "n": 2}),
}


@pytest.mark.parametrize("case", list(ANSWERED))
async def test_the_simulators_answers_conform_to_the_document(
    sim: SimAdmin, wire: Wire, api_key: str, key: str, case: str
) -> None:
    path, body = ANSWERED[case]
    headers = {"Authorization": f"Bearer {api_key}", "X-Client-Request-Id": key}

    await wire.client.post(f"{sim.url}/v1{path}", json=body, headers=headers)

    assert wire.only.status == 200, wire.only.answer
    assert wire.problems() == []
    answer = wire.only.answer
    if path == IMAGES:
        first = answer["data"][0]
        assert ("url" in first) == (case == "dall-e-2-url-by-default")
        assert ("revised_prompt" in first) == (case == "dall-e-3-revised-prompt")
        assert ("usage" in answer) == ("gpt-image" in case)
        if "b64_json" in first:
            assert png_size(base64.b64decode(first["b64_json"]))[0] in (1024, 1536, 256, 512, 1792)


# The old adapter's own image request (size from the request, response_format always): refused.
OLD_ADAPTER_IMAGE = {
    "model": "gpt-image-1",
    "prompt": PROMPT,
    "size": "512x512",
    "n": 1,
    "response_format": "b64_json",
}
REFUSED = {
    "old-adapter-gpt-image-1": (IMAGES, OLD_ADAPTER_IMAGE, "size"),
    "gpt-image-1-response-format": (
        IMAGES,
        {"model": "gpt-image-1", "prompt": PROMPT, "size": "1024x1024", "response_format": "b64_json"},
        "response_format",
    ),
    "gpt-image-1-64x64": (IMAGES, {"model": "gpt-image-1", "prompt": PROMPT, "size": "64x64"}, "size"),
    "dall-e-2-1536x1024": (IMAGES, {"model": "dall-e-2", "prompt": PROMPT, "size": "1536x1024"}, "size"),
    "dall-e-3-512x512": (IMAGES, {"model": "dall-e-3", "prompt": PROMPT, "size": "512x512"}, "size"),
    "dall-e-3-n-2": (IMAGES, {"model": "dall-e-3", "prompt": PROMPT, "n": 2}, "n"),
    "n-11": (IMAGES, {"model": "gpt-image-1", "prompt": PROMPT, "n": 11}, "n"),
    "dall-e-2-output-format": (
        IMAGES,
        {"model": "dall-e-2", "prompt": PROMPT, "output_format": "png"},
        "output_format",
    ),
    "dall-e-2-long-prompt": (IMAGES, {"model": "dall-e-2", "prompt": "x" * 1001}, "prompt"),
    "gpt-image-2-odd-size": (IMAGES, {"model": "gpt-image-2", "prompt": PROMPT, "size": "1000x1000"}, "size"),
    "image-no-prompt": (IMAGES, {"model": "gpt-image-1", "size": "1024x1024"}, "prompt"),
    "image-unknown-model": (IMAGES, {"model": "dall-e-4", "prompt": PROMPT}, "model"),
    "image-unknown-parameter": (IMAGES, {"model": "gpt-image-1", "prompt": PROMPT, "width": 64}, "width"),
    "chat-no-model": (CHAT, {"messages": [{"role": "user", "content": "hi"}]}, None),
    "chat-no-messages": (CHAT, {"model": "gpt-4o-mini"}, "messages"),
    "chat-empty-messages": (CHAT, {"model": "gpt-4o-mini", "messages": []}, "messages"),
    "chat-unknown-role": (
        CHAT,
        {"model": "m", "messages": [{"role": "robot", "content": "x"}]},
        "messages[0].role",
    ),
    "chat-unknown-argument": (
        CHAT,
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "temprature": 0},
        None,
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
async def test_the_simulator_refuses_what_the_api_refuses(
    sim: SimAdmin, wire: Wire, api_key: str, key: str, case: str
) -> None:
    path, body, param = REFUSED[case]
    headers = {"Authorization": f"Bearer {api_key}", "X-Client-Request-Id": key}

    await wire.client.post(f"{sim.url}/v1{path}", json=body, headers=headers)

    x = wire.only
    assert x.status == 400, x.answer
    assert schema_problems(DOC, "ErrorResponse", x.answer) == []
    assert x.answer["error"]["type"] == "invalid_request_error"
    assert x.answer["error"]["param"] == param
    assert (await sim.charges())["count"] == 0  # refused: nothing billed
    if path == IMAGES:  # the prose check agrees with the simulator where the document's prose speaks
        assert (
            prose_problems(path, body)
            or request_problems(DOC, "POST", path, body)
            or case
            in (
                "image-unknown-model",
                "gpt-image-2-odd-size",
                "n-11",
                "image-unknown-parameter",
            )
        )


@pytest.mark.parametrize("path", [CHAT, IMAGES])
async def test_a_body_that_is_not_json_is_openais_400(
    sim: SimAdmin, wire: Wire, api_key: str, path: str
) -> None:
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}

    await wire.client.post(f"{sim.url}/v1{path}", content=b"{not json", headers=headers)

    assert wire.only.status == 400
    assert schema_problems(DOC, "ErrorResponse", wire.only.answer) == []


def _properties(schema: dict[str, Any]) -> set[str]:
    if "$ref" in schema:
        return _properties(DOC["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]])
    found = set(schema.get("properties", {}))
    for part in schema.get("allOf", []):
        found |= _properties(part)
    return found


def test_the_simulators_parameter_lists_are_the_documents() -> None:
    schemas = DOC["components"]["schemas"]
    assert _properties(schemas["CreateChatCompletionRequest"]) == CHAT_PARAMETERS
    assert _properties(schemas["CreateImageRequest"]) == IMAGE_PARAMETERS
