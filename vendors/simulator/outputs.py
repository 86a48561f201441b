"""What a simulated job delivers: real files (PNG, H.264 MP4, WAV, a Markdown lesson) or a JSON record.

The request says what to make: ``format`` (png / mp4 / wav / md; anything else gets a JSON record),
``width``, ``height``, ``duration_s``. Every file carries its lineage — the executor, the fan-out item and the
sha256 of every input artifact the request named — in its metadata, so a test can prove what a file was made
from. The bytes depend on the request only, never on the key: the same request always yields the same file
(a duplicate job of one request delivers identical bytes, and an unchanged input really is unchanged).
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from media import audio_wav, keyframe_png, shot_mp4

FPS = 12
MAX_SIDE = 1920


@dataclass(frozen=True)
class Output:
    data: bytes
    media: dict[str, Any]  # what the vendor reports it delivered (format, duration, size, rights)
    content_type: str


def input_hashes(value: Any) -> list[str]:
    """Every ``sha256`` named anywhere in a request's ``inputs`` (artifact references), in order."""
    found: list[str] = []
    if isinstance(value, dict):
        if isinstance(value.get("sha256"), str):
            found.append(value["sha256"])
        else:
            for v in value.values():
                found += input_hashes(v)
    elif isinstance(value, list):
        for v in value:
            found += input_hashes(v)
    return found


def lineage(executor: str, request: dict[str, Any]) -> dict[str, Any]:
    """What a file is made from: the executor, the item, its inputs' hashes and a digest of the rest of the
    request (a rework's findings change the file, as they change a real model's output)."""
    rest = {k: v for k, v in request.items() if k != "inputs"}
    digest = hashlib.sha256(json.dumps(rest, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {
        "executor": executor,
        "item": request.get("item"),
        "inputs": input_hashes(request.get("inputs")),
        "request": digest,
    }


def _number(value: Any) -> float | None:
    """A number the request asked for (never a bool), else None: nothing usable was asked."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _side(value: Any, default: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return default
    return min(MAX_SIDE, value + value % 2)  # H.264 in yuv420p needs even sides


def render(
    executor: str,
    request: dict[str, Any],
    *,
    bad_media: bool,
    broken_code: bool,
    rights: dict[str, str] | None,
) -> Output:
    """The deliverable for ``request`` (``bad_media``: half the size and twice the duration asked for)."""
    fmt = request.get("format") if isinstance(request.get("format"), str) else "json"
    width, height = _side(request.get("width"), 320), _side(request.get("height"), 180)
    duration = _number(request.get("duration_s")) or 4.0
    if bad_media:
        width, height, duration = max(16, width // 2 // 2 * 2), max(16, height // 2 // 2 * 2), duration * 2
    lin = lineage(executor, request)
    media: dict[str, Any] = {
        "format": fmt,
        "duration_s": None,
        "width": None,
        "height": None,
        "rights": rights,
    }
    if fmt == "png":
        data = keyframe_png(width, height, lineage=lin)
        media.update(width=width, height=height)
        return Output(data, media, "image/png")
    if fmt in ("mp4", "wav"):
        with tempfile.TemporaryDirectory(prefix="sim-render-") as tmp:
            path = Path(tmp) / f"out.{fmt}"
            if fmt == "mp4":
                shot_mp4(path, width, height, duration, fps=FPS, lineage=lin)
                media.update(width=width, height=height, duration_s=round(round(duration * FPS) / FPS, 6))
            else:
                audio_wav(path, duration, lineage=lin)
                media.update(duration_s=duration)
            return Output(path.read_bytes(), media, "video/mp4" if fmt == "mp4" else "audio/wav")
    if fmt == "md":
        return Output(lesson(request, lin, broken=broken_code).encode(), media, "text/markdown")
    payload = {"executor": executor, "input": request}
    record = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return Output(record, {**media, "format": fmt}, "application/json")


def lesson(request: dict[str, Any], lin: dict[str, Any], *, broken: bool) -> str:
    """A drafted Markdown lesson with runnable Python examples (the last one broken, if asked)."""
    topic = str(request.get("prompt") or request.get("objective") or "recursion")[:200]
    digest = hashlib.sha256(json.dumps(lin, sort_keys=True).encode()).hexdigest()[:12]
    last = (
        "def walk_depth(n):\n    # the base case is missing: this recurses until Python gives up\n"
        "    return 1 + walk_depth(n - 1)\n\nprint(walk_depth(3))\n"
        if broken
        else "def walk_depth(n):\n    if n == 0:\n        return 0\n    return 1 + walk_depth(n - 1)\n\n"
        "print(walk_depth(3))\n"
    )
    return (
        f"# Recursion, step by step\n\n<!-- lineage {digest} -->\n\n{topic}\n\n"
        "A recursive function calls itself on a smaller problem until it reaches a base case.\n\n"
        "```python\ndef factorial(n):\n    if n <= 1:\n        return 1\n    return n * factorial(n - 1)\n\n"
        "assert factorial(5) == 120\nprint(factorial(5))\n```\n\n"
        "Each call waits on the call stack until the one below it returns.\n\n"
        f"```python\n{last}```\n"
    )
