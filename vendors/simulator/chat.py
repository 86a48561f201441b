"""The OpenAI dialect: ``POST /v1/chat/completions`` and ``POST /v1/images/generations``, as OpenAI's API
really speaks them.

The reference is OpenAI's own published OpenAPI description (``openai/openai-openapi``, ``openapi.yaml``;
the extract the tests check against is ``tests/vendors/schemas/openai-openapi.json``, its provenance in
``tests/vendors/schemas/SOURCES.md``). Its paths have no ``/v1``: the API's base URL is
``https://api.openai.com/v1``. ``tests/vendors/test_openai_wire.py`` validates every answer below against it.

Chat completions (``createChatCompletion``):

* request: ``model`` and ``messages`` (at least one, each with a known ``role``) are required; an argument
  the document does not define is refused, as the API refuses it. ``stream`` is refused (the simulator
  does not stream).
* answer: ``id``, ``object: "chat.completion"``, ``created``, ``model``, ``choices`` (each with ``index``,
  ``message {role: "assistant", content, refusal}``, ``finish_reason``, ``logprobs: null``) and
  ``usage {prompt_tokens, completion_tokens, total_tokens}``. The content comes from ``chat_script`` /
  ``chat_default``; a content rejection drawn from the ``chat`` profile (``reject_content``) answers as the
  model does: a ``refusal`` (content null) when Structured Outputs were asked (``response_format`` of type
  ``json_schema``), else ``finish_reason: "content_filter"`` (content null). Both are billed.

Image generations (``createImage``), per model (the document states the per-model rules in prose only):

* ``prompt`` is required (at most 1000 characters for ``dall-e-2``, 4000 for ``dall-e-3``, 32000 for the GPT
  image models); ``model`` defaults to ``dall-e-2`` (``gpt-image-1`` if a GPT-image-only parameter is given)
  and must be one the document lists.
* ``size``: GPT image models 1024x1024, 1536x1024, 1024x1536 or ``auto`` (``gpt-image-2*`` also any
  WIDTHxHEIGHT the document allows: sides divisible by 16, aspect ratio within 1:3..3:1, at most 3840x2160);
  ``dall-e-2`` 256x256, 512x512, 1024x1024; ``dall-e-3`` 1024x1024, 1792x1024, 1024x1792.
* ``response_format`` (``url`` | ``b64_json``, default ``url``) only for the dall-e models: sent to a GPT
  image model it is refused (they always answer base64). ``output_format``, ``output_compression``,
  ``background``, ``moderation``, ``partial_images`` and ``stream`` are GPT-image-only; ``style`` is
  ``dall-e-3`` only. ``n`` is 1-10 (``dall-e-3``: 1).
* answer: ``created`` and ``data`` ([{b64_json} | {url}], ``revised_prompt`` for ``dall-e-3``); for the GPT
  image models also ``background``, ``output_format``, ``quality``, ``size`` and ``usage`` (ImageGenUsage:
  input tokens of the prompt, output tokens after OpenAI's gpt-image-1 table per quality, scaled by area).
  A content rejection drawn from the ``images`` profile is a 400 (``moderation_blocked`` for GPT image
  models, ``content_policy_violation`` for dall-e), not billed.

Limits of the simulator, answered as 400s that say so: ``stream: true`` and an ``output_format`` other than
``png`` (it renders PNGs only).

Errors are answered in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}`` (the document's
``ErrorResponse``): a refused request is a 400 ``invalid_request_error`` naming the parameter, a drawn 429
is ``type: "requests", code: "rate_limit_exceeded"``, a 5xx a ``server_error``. (A missing or refused key
is answered before these handlers, by the simulator's own authentication, in its own shape.)

Both endpoints are synchronous and take no idempotency key: a lost answer cannot be looked up. A call
carrying an ``X-Client-Request-Id`` header (what ledgerflow's adapters send: the OperationKey) is billed under
that id, chat at ``chat_price_per_1k_tokens`` of its usage and images at ``image_price`` each whatever the
model (the real API bills GPT image models by tokens; the reported usage is what a route prices them by),
so money checks can match a charge to its operation. The real API only logs that header: it neither
deduplicates nor lists charges by it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from media import keyframe_png
from vendors.simulator.config import Draw
from vendors.simulator.outputs import Output
from vendors.simulator.state import SimError, SimState, refuse

# The properties of the document's CreateChatCompletionRequest and CreateImageRequest (an argument outside
# these is refused; tests/vendors/test_openai_wire.py checks both sets against the document).
CHAT_PARAMETERS = frozenset(
    {
        "audio",
        "frequency_penalty",
        "function_call",
        "functions",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "messages",
        "metadata",
        "modalities",
        "model",
        "moderation",
        "n",
        "parallel_tool_calls",
        "prediction",
        "presence_penalty",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "reasoning_effort",
        "response_format",
        "safety_identifier",
        "seed",
        "service_tier",
        "stop",
        "store",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "user",
        "verbosity",
        "web_search_options",
    }
)
IMAGE_PARAMETERS = frozenset(
    {
        "background",
        "model",
        "moderation",
        "n",
        "output_compression",
        "output_format",
        "partial_images",
        "prompt",
        "quality",
        "response_format",
        "size",
        "stream",
        "style",
        "user",
    }
)
ROLES = ("developer", "system", "user", "assistant", "tool", "function")
REFUSAL = "I'm sorry, but I can't help with that request."
GPT_IMAGE_ONLY = (
    "background",
    "moderation",
    "output_format",
    "output_compression",
    "partial_images",
    "stream",
)


@dataclass(frozen=True)
class ImageModel:
    """What one image model takes, as the document's prose states it."""

    sizes: tuple[str, ...]
    max_prompt: int
    max_n: int
    qualities: tuple[str, ...]
    gpt: bool  # a GPT image model: base64 only, usage reported, GPT-only parameters accepted
    any_size: bool = False  # gpt-image-2: any WIDTHxHEIGHT within the document's bounds


_GPT_IMAGE = ImageModel(
    sizes=("1024x1024", "1536x1024", "1024x1536", "auto"),
    max_prompt=32000,
    max_n=10,
    qualities=("low", "medium", "high", "auto"),
    gpt=True,
)
IMAGE_MODELS: dict[str, ImageModel] = {
    "dall-e-2": ImageModel(("256x256", "512x512", "1024x1024"), 1000, 10, ("standard", "auto"), gpt=False),
    "dall-e-3": ImageModel(
        ("1024x1024", "1792x1024", "1024x1792"), 4000, 1, ("standard", "hd", "auto"), False
    ),
    "gpt-image-1": _GPT_IMAGE,
    "gpt-image-1-mini": _GPT_IMAGE,
    "gpt-image-1.5": _GPT_IMAGE,
    "gpt-image-2": replace(_GPT_IMAGE, any_size=True),
    "gpt-image-2-2026-04-21": replace(_GPT_IMAGE, any_size=True),
}
# Output tokens of one 1024x1024 image per quality (OpenAI's gpt-image-1 pricing table), scaled by area.
_IMAGE_TOKENS = {"low": 272, "medium": 1056, "high": 4160}


class OpenAIError(SimError):
    """An error answer in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status, code or error_type, message, headers=headers)
        self.error_type, self.param, self.openai_code = error_type, param, code

    def response(self) -> JSONResponse:
        error = {
            "message": self.message,
            "type": self.error_type,
            "param": self.param,
            "code": self.openai_code,
        }
        return JSONResponse({"error": error}, status_code=self.status, headers=self.headers)


@contextmanager
def _openai_errors() -> Iterator[None]:
    """Every refusal raised inside (the draws' 429/5xx, the drop's 502, an outage) in OpenAI's shape."""
    try:
        yield
    except OpenAIError:
        raise
    except SimError as e:
        if e.status == 429:
            kind, code = "requests", "rate_limit_exceeded"
        elif e.status >= 500:
            kind, code = "server_error", None
        else:
            kind, code = "invalid_request_error", e.code
        raise OpenAIError(e.status, e.message, error_type=kind, code=code, headers=e.headers) from None


# ── request checks ────────────────────────────────────────────────────────────────────────────────────────
def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a decimal", str: "a string", list: "an array"}
    return "null" if value is None else names.get(type(value), "an object")


def _missing(param: str) -> OpenAIError:
    return OpenAIError(
        400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
    )


def _invalid_type(param: str, expected: str, value: Any) -> OpenAIError:
    message = f"Invalid type for '{param}': expected {expected}, but got {_json_type(value)} instead."
    return OpenAIError(400, message, param=param, code="invalid_type")


def _invalid_value(param: str, value: Any, supported: tuple[str, ...]) -> OpenAIError:
    listed = ", ".join(f"'{s}'" for s in supported[:-1]) + f", and '{supported[-1]}'"
    message = f"Invalid value: '{str(value)[:60]}'. Supported values are: {listed}."
    return OpenAIError(400, message, param=param, code="invalid_value")


def _not_supported(param: str, model: str) -> OpenAIError:
    return OpenAIError(
        400,
        f"Unknown parameter: '{param}'. It is not supported with model '{model}'.",
        param=param,
        code="unknown_parameter",
    )


def _simulator_limit(param: str, what: str) -> OpenAIError:
    return OpenAIError(400, f"The simulator {what}.", param=param, code="unsupported_by_simulator")


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise OpenAIError(
            400, "We could not parse the JSON body of your request. The OpenAI API expects a JSON payload."
        ) from None
    if not isinstance(body, dict):
        raise _invalid_type("body", "an object", body)
    # A null is an absent optional parameter (the document marks them nullable).
    return {k: v for k, v in body.items() if v is not None}


def _integer(body: dict[str, Any], param: str, low: int, high: int, default: int) -> int:
    value = body.get(param, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid_type(param, "an integer", value)
    if not low <= value <= high:
        raise OpenAIError(
            400,
            f"Invalid '{param}': {value} is out of range; it must be between {low} and {high}.",
            param=param,
            code="integer_out_of_range",
        )
    return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    response_format: dict[str, Any] | None = None
    n: int = 1


def chat_request(raw: bytes) -> ChatRequest:
    """A chat completion request, checked as the API checks it (400 in OpenAI's shape otherwise)."""
    body = _json_object(raw)
    if unknown := sorted(set(body) - CHAT_PARAMETERS):
        raise OpenAIError(400, f"Unrecognized request argument supplied: {unknown[0]}")
    model = body.get("model")
    if model is None or model == "":
        raise OpenAIError(400, "you must provide a model parameter")
    if not isinstance(model, str):
        raise _invalid_type("model", "a string", model)
    if "messages" not in body:
        raise _missing("messages")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise _invalid_type("messages", "an array", messages)
    if not messages:
        message = (
            "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty one."
        )
        raise OpenAIError(400, message, param="messages", code="empty_array")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _invalid_type(where, "an object", m)
        if "role" not in m:
            raise _missing(f"{where}.role")
        if m["role"] not in ROLES:
            raise _invalid_value(f"{where}.role", m["role"], ROLES)
        content = m.get("content")
        if content is None and m["role"] not in ("assistant", "function"):
            raise _missing(f"{where}.content")
        if content is not None and not isinstance(content, str | list):
            raise _invalid_type(f"{where}.content", "one of a string or an array", content)
    _integer(body, "n", 1, 128, 1)
    if body.get("stream"):
        raise _simulator_limit("stream", "does not stream: send stream false")
    fmt = body.get("response_format")
    if fmt is not None:
        kinds = ("text", "json_object", "json_schema")
        if not isinstance(fmt, dict):
            raise _invalid_type("response_format", "an object", fmt)
        if fmt.get("type") not in kinds:
            raise _invalid_value("response_format.type", fmt.get("type"), kinds)
        if fmt["type"] == "json_schema":
            schema = fmt.get("json_schema")
            if not isinstance(schema, dict):
                raise _missing("response_format.json_schema")
            if not isinstance(schema.get("name"), str):
                raise _missing("response_format.json_schema.name")
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as e:
        where = ".".join(str(p) for p in e.errors()[0]["loc"])
        raise OpenAIError(400, f"Invalid '{where}'.", param=where, code="invalid_value") from None


@dataclass(frozen=True)
class ImageRequest:
    """An image generation request, checked: the model's rules applied, defaults filled in."""

    model: str
    spec: ImageModel
    prompt: str
    width: int
    height: int
    n: int
    url: bool  # answer URLs (dall-e's default) rather than base64
    quality: str
    body: dict[str, Any]


def image_request(raw: bytes) -> ImageRequest:
    """An image generation request, checked per model as the document's prose says (400 otherwise)."""
    body = _json_object(raw)
    if unknown := sorted(set(body) - IMAGE_PARAMETERS):
        raise OpenAIError(
            400, f"Unknown parameter: '{unknown[0]}'.", param=unknown[0], code="unknown_parameter"
        )
    if "prompt" not in body:
        raise _missing("prompt")
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise _invalid_type("prompt", "a string", prompt)
    if not prompt:
        raise OpenAIError(400, "Invalid 'prompt': empty string.", param="prompt", code="empty_string")
    # The document: "Defaults to dall-e-2 unless a parameter specific to the GPT image models is used".
    default = "gpt-image-1" if any(p in body for p in GPT_IMAGE_ONLY) else "dall-e-2"
    model = body.get("model", default)
    if not isinstance(model, str):
        raise _invalid_type("model", "a string", model)
    spec = IMAGE_MODELS.get(model)
    if spec is None:
        raise _invalid_value("model", model, tuple(IMAGE_MODELS))
    if len(prompt) > spec.max_prompt:
        message = (
            f"Invalid 'prompt': string too long. Expected a string with maximum length {spec.max_prompt}, "
            f"but got a string with length {len(prompt)} instead."
        )
        raise OpenAIError(400, message, param="prompt", code="string_above_max_length")
    n = _integer(body, "n", 1, spec.max_n, 1)
    width, height = _image_size(body, model, spec)
    quality = body.get("quality", "auto")
    if quality not in spec.qualities:
        raise _invalid_value("quality", quality, spec.qualities)
    if "style" in body and model != "dall-e-3":
        raise _not_supported("style", model)
    if "style" in body and body["style"] not in ("vivid", "natural"):
        raise _invalid_value("style", body["style"], ("vivid", "natural"))
    if spec.gpt:
        if "response_format" in body:  # "isn't supported for the GPT image models" (always base64)
            raise _not_supported("response_format", model)
        _gpt_image_options(body)
        url = False
    else:
        if found := next((p for p in GPT_IMAGE_ONLY if p in body), None):
            raise _not_supported(found, model)
        fmt = body.get("response_format", "url")
        if fmt not in ("url", "b64_json"):
            raise _invalid_value("response_format", fmt, ("url", "b64_json"))
        url = fmt == "url"
    return ImageRequest(model, spec, prompt, width, height, n, url, quality, body)


def _image_size(body: dict[str, Any], model: str, spec: ImageModel) -> tuple[int, int]:
    size = body.get("size", "auto" if spec.gpt else "1024x1024")
    if not isinstance(size, str):
        raise _invalid_type("size", "a string", size)
    if size == "auto" and spec.gpt:
        return 1024, 1024
    if size in spec.sizes:
        w, h = size.split("x")
        return int(w), int(h)
    if spec.any_size:
        try:
            width, height = (int(v) for v in size.split("x"))
        except ValueError:
            width = height = 0
        long, short = max(width, height), min(width, height)
        if (
            short > 0
            and width % 16 == height % 16 == 0
            and long <= 3 * short
            and long <= 3840
            and short <= 2160
        ):
            return width, height
        message = (
            f"Invalid value: '{size[:40]}'. For {model} the size must be WIDTHxHEIGHT with both sides "
            "divisible by 16, an aspect ratio between 1:3 and 3:1, and at most 3840x2160."
        )
        raise OpenAIError(400, message, param="size", code="invalid_value")
    raise _invalid_value("size", size, spec.sizes)


def _gpt_image_options(body: dict[str, Any]) -> None:
    if body.get("stream"):
        raise _simulator_limit("stream", "does not stream: send stream false")
    fmt = body.get("output_format", "png")
    if fmt not in ("png", "jpeg", "webp"):
        raise _invalid_value("output_format", fmt, ("png", "jpeg", "webp"))
    if fmt != "png":
        raise _simulator_limit("output_format", "renders png only")
    if "output_compression" in body:
        _integer(body, "output_compression", 0, 100, 100)
    if body.get("background", "auto") not in ("transparent", "opaque", "auto"):
        raise _invalid_value("background", body["background"], ("transparent", "opaque", "auto"))
    if body.get("moderation", "auto") not in ("low", "auto"):
        raise _invalid_value("moderation", body["moderation"], ("low", "auto"))
    if "partial_images" in body:
        _integer(body, "partial_images", 0, 3, 0)


# ── the endpoints ─────────────────────────────────────────────────────────────────────────────────────────
def _text(content: str | list[dict[str, Any]] | None) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(part.get("text", "")) for part in content)
    return content or ""


def _tokens(text: str) -> int:
    return len(text) // 4 + 1


def _refuse_by_draw(state: SimState, key: str | None, executor: str) -> Draw | None:
    """The executor profile's fate for a billed call, drawn like the jobs protocol's.

    Refusals (429 / 500) are raised here, before anything is billed; a drawn ``dropped`` is returned for the
    caller to act on *after* it billed the call (charge, then lose the answer). None: an unbilled call.
    """
    if key is None:
        return None
    with state.lock:
        _, _, draw = state.draw(key, executor)
    refuse(draw, request_timeout=False)
    return draw


def _drop_if_drawn(draw: Draw | None) -> None:
    """A synchronous vendor's worst habits: the call ran and was billed, but its answer never arrives, or a
    gateway in front of it answers a 5xx (its upstream timed out after the model had answered)."""
    if draw is not None and draw.dropped:
        raise SimError(502, "bad_gateway", "upstream connection reset")
    if draw is not None and draw.gateway_error:
        status = draw.gateway_error_status
        raise SimError(status, "gateway_error", f"upstream timed out ({status})")


def chat(state: SimState, raw: bytes, request_id: str | None) -> dict[str, Any]:
    """``POST /v1/chat/completions``: the request checked, a scripted answer in the document's shape."""
    with _openai_errors():
        return _chat(state, chat_request(raw), request_id)


def _chat(state: SimState, body: ChatRequest, request_id: str | None) -> dict[str, Any]:
    cfg = state.config
    if cfg.chat_latency_seconds:
        time.sleep(cfg.chat_latency_seconds)  # on uvicorn's thread pool: other requests go on meanwhile
    if cfg.chat_error_status is not None:
        state.record_chat(0, 0)  # a refused call is still a call (nothing is billed for it)
        raise SimError(cfg.chat_error_status, "chat_unavailable", "the model is unavailable")
    draw = _refuse_by_draw(state, request_id, "chat")
    texts = [_text(m.content) for m in body.messages]
    last_user = next((_text(m.content) for m in reversed(body.messages) if m.role == "user"), "")
    rule = next((r for r in cfg.chat_script if r.applies(cfg.seed, last_user)), None)
    content: str | None = rule.content if rule else cfg.chat_default
    refusal: str | None = None
    finish_reason = "stop"
    if draw is not None and draw.failure == "content_rejected":
        structured = (body.response_format or {}).get("type") == "json_schema"
        # Structured Outputs carry a model's refusal in ``refusal``; otherwise the content filter cuts it.
        content, refusal, finish_reason = (
            (None, REFUSAL, "stop") if structured else (None, None, "content_filter")
        )
    prompt_tokens = sum(_tokens(t) for t in texts)
    generated = content if content is not None else refusal  # a filtered answer generated nothing shown
    completion_tokens = body.n * (_tokens(generated) if generated is not None else 0)
    state.record_chat(prompt_tokens, completion_tokens)
    digest = hashlib.sha256(json.dumps([body.model, texts]).encode()).hexdigest()[:24]
    if request_id is not None:
        amount = cfg.chat_price_per_1k_tokens * (prompt_tokens + completion_tokens) / 1000
        with state.lock:
            state.charge(request_id, f"chatcmpl-{digest}", "chat", str(amount.normalize()), "chat")
    _drop_if_drawn(draw)
    message = {"role": "assistant", "content": content, "refusal": refusal}
    return {
        "id": f"chatcmpl-{digest}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": [
            {"index": i, "message": message, "logprobs": None, "finish_reason": finish_reason}
            for i in range(body.n)
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        | {k: _number(v) for k, v in (cfg.chat_usage_override or {}).items()},  # odd figures, raw numbers
    }


def images(state: SimState, raw: bytes, request_id: str | None) -> dict[str, Any]:
    """``POST /v1/images/generations``: PNGs of the size the model was asked, as base64 or as CDN URLs."""
    with _openai_errors():
        return _images(state, image_request(raw), request_id)


def _images(state: SimState, req: ImageRequest, request_id: str | None) -> dict[str, Any]:
    draw = _refuse_by_draw(state, request_id, "images")
    if draw is not None and draw.failure == "content_rejected":  # refused before anything is billed
        message = "Your request was rejected as a result of our safety system."
        if req.spec.gpt:
            raise OpenAIError(
                400, message, error_type="image_generation_user_error", code="moderation_blocked"
            )
        raise OpenAIError(400, message, code="content_policy_violation")
    size = f"{req.width}x{req.height}"
    data = []
    digest = hashlib.sha256(json.dumps([req.model, req.prompt, size, req.n]).encode()).hexdigest()[:20]
    for i in range(req.n):
        png = keyframe_png(req.width, req.height, lineage={"prompt": req.prompt[:200], "index": i})
        item: dict[str, Any]
        if req.url:
            file_id = f"img_{digest}_{i}"
            with state.lock:
                state.files[file_id] = Output(png, {"format": "png"}, "image/png")
            item = {"url": f"{state.cdn_base}/files/{file_id}"}
        else:
            item = {"b64_json": base64.b64encode(png).decode()}
        if req.model == "dall-e-3":
            item["revised_prompt"] = req.prompt
        data.append(item)
    if request_id is not None:
        with state.lock:
            state.charge(
                request_id, f"img-{digest}", "images", str(state.config.image_price * req.n), "images"
            )
    _drop_if_drawn(draw)
    answer: dict[str, Any] = {"created": int(time.time()), "data": data}
    if req.spec.gpt:
        quality = "medium" if req.quality == "auto" else req.quality
        input_tokens = _tokens(req.prompt)
        output_tokens = req.n * math.ceil(_IMAGE_TOKENS[quality] * req.width * req.height / (1024 * 1024))
        answer |= {
            "background": "transparent" if req.body.get("background") == "transparent" else "opaque",
            "output_format": "png",
            "quality": quality,
            "usage": {
                "input_tokens": input_tokens,
                "output_tokens": output_tokens,
                "total_tokens": input_tokens + output_tokens,
                "input_tokens_details": {"text_tokens": input_tokens, "image_tokens": 0},
                "output_tokens_details": {"image_tokens": output_tokens, "text_tokens": 0},
            },
        }
        if size in ("1024x1024", "1536x1024", "1024x1536"):  # the document's enum for ImagesResponse.size
            answer["size"] = size
    return answer


def _number(text: str) -> int | float:
    """A figure as the raw JSON number a vendor would send: an integer if it is one, else a float (NaN …)."""
    return int(text) if text.lstrip("-").isdigit() else float(text)
