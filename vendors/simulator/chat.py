"""The OpenAI-compatible surface: chat completions (scripted answers) and image generation.

Both are synchronous and take no idempotency key: a lost answer cannot be looked up. A call carrying an
``X-Client-Request-Id`` header (what ledgerflow's adapters send: the OperationKey) is billed under that id,
chat at ``chat_price_per_1k_tokens`` of its usage and images at ``image_price`` each, so money checks can
match a charge to its operation.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from media import keyframe_png
from vendors.simulator.config import Draw
from vendors.simulator.outputs import Output
from vendors.simulator.state import SimError, SimState, refuse


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    response_format: dict[str, Any] | None = None


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
    """A synchronous vendor's worst habit: the call ran and was billed, but its answer never arrives."""
    if draw is not None and draw.dropped:
        raise SimError(502, "bad_gateway", "upstream connection reset")


def chat(state: SimState, body: ChatRequest, request_id: str | None) -> dict[str, Any]:
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
    content = rule.content if rule else cfg.chat_default
    prompt_tokens = sum(_tokens(t) for t in texts)
    completion_tokens = _tokens(content)
    state.record_chat(prompt_tokens, completion_tokens)
    digest = hashlib.sha256(json.dumps([body.model, texts]).encode()).hexdigest()[:24]
    if request_id is not None:
        amount = cfg.chat_price_per_1k_tokens * (prompt_tokens + completion_tokens) / 1000
        with state.lock:
            state.charge(request_id, f"chatcmpl-{digest}", "chat", str(amount.normalize()), "chat")
    _drop_if_drawn(draw)
    return {
        "id": f"chatcmpl-{digest}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        | {k: _number(v) for k, v in (cfg.chat_usage_override or {}).items()},  # odd figures, raw numbers
    }


def images(state: SimState, body: dict[str, Any], request_id: str | None) -> dict[str, Any]:
    """``POST /v1/images/generations``: PNGs of the asked size, as base64 or as CDN URLs."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise SimError(400, "invalid_request", "prompt is required")
    size = str(body.get("size") or "256x256")
    try:
        width, height = (int(v) for v in size.split("x"))
    except ValueError:
        raise SimError(400, "invalid_request", f"size {size[:20]!r} is not WIDTHxHEIGHT") from None
    n = body.get("n") or 1
    if not isinstance(n, int) or not 1 <= n <= 4 or not (16 <= width <= 2048 and 16 <= height <= 2048):
        raise SimError(400, "invalid_request", "n must be 1-4 and each side 16-2048")
    draw = _refuse_by_draw(state, request_id, "images")
    data = []
    digest = hashlib.sha256(json.dumps([prompt, size, n]).encode()).hexdigest()[:20]
    for i in range(n):
        png = keyframe_png(width, height, lineage={"prompt": prompt[:200], "index": i})
        if body.get("response_format") == "url":
            file_id = f"img_{digest}_{i}"
            with state.lock:
                state.files[file_id] = Output(png, {"format": "png"}, "image/png")
            data.append({"url": f"{state.cdn_base}/files/{file_id}"})
        else:
            data.append({"b64_json": base64.b64encode(png).decode()})
    if request_id is not None:
        with state.lock:
            state.charge(request_id, f"img-{digest}", "images", str(state.config.image_price * n), "images")
    _drop_if_drawn(draw)
    return {"created": int(time.time()), "data": data, "usage": {"images": n}}


def _number(text: str) -> int | float:
    """A figure as the raw JSON number a vendor would send: an integer if it is one, else a float (NaN …)."""
    return int(text) if text.lstrip("-").isdigit() else float(text)
