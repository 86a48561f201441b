"""Render small, real, deterministic media files that carry their lineage.

The vendor simulator uses these to deliver actual PNG/MP4/WAV bytes that honour the declared bounds (size,
duration, frame rate), so review and compose run against real decoders. Content is a pure function of the
arguments: pixels and tones are derived from ``sha256`` of the lineage JSON, and encoding is single-threaded
with fixed options, so the same call yields the same bytes (with the same FFmpeg build) and different
lineage yields different bytes. Lineage is embedded where a standard reader finds it: a PNG ``tEXt``
chunk with keyword ``ledgerflow``, and the container ``comment`` tag for MP4 (``©cmt``) and WAV
(``LIST/INFO/ICMT``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import uuid
import zlib
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from pathlib import Path
from typing import Any

import av

from media.probe import PNG_LINEAGE_KEY

# The container tag that holds lineage JSON in MP4 and WAV; both muxers write it and both demuxers read
# it back without extra options.
LINEAGE_TAG = "comment"

# Fixed encoder settings: ultrafast keeps a 4 s 320x180 shot in the tens of milliseconds. Callers also set
# codec_context.thread_count = 1: x264's frame threads (one per core by default) change the bitstream, and
# the bytes must not depend on the machine.
_X264_OPTIONS = {"preset": "ultrafast"}
# Moov first: the file can be played while downloading, and a cut-off tail loses frames (which probe
# counts) rather than the index.
_MP4_OPTIONS = {"movflags": "+faststart"}


def lineage_json(lineage: dict[str, Any]) -> str:
    """The canonical JSON form of a lineage: sorted keys, ASCII only (PNG tEXt is Latin-1).

    Args:
        lineage: Any JSON-serialisable mapping.

    Returns:
        The JSON text that is both hashed for content and stored in the file.
    """
    return json.dumps(lineage, sort_keys=True)


def keyframe_png(width: int, height: int, *, lineage: dict[str, Any]) -> bytes:
    """A PNG still of the given size whose pixels and ``ledgerflow`` text chunk come from the lineage.

    The picture is a horizontal gradient between two lineage-derived colours with a lineage-placed
    vertical band, so any change in lineage changes the pixels, not only the text chunk.

    Args:
        width: Width in pixels (> 0).
        height: Height in pixels (> 0).
        lineage: JSON-serialisable lineage; stored verbatim (canonical JSON) in a ``tEXt`` chunk.

    Returns:
        The PNG file's bytes.

    Raises:
        ValueError: A dimension is not positive.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"keyframe size must be positive, got {width}x{height}")
    text = lineage_json(lineage)
    seed = hashlib.sha256(text.encode()).digest()
    left, right, band = seed[0:3], seed[3:6], seed[6:9]
    band_x = int.from_bytes(seed[9:11], "big") % width
    band_w = max(1, width // 16)

    row = bytearray()
    for x in range(width):
        if band_x <= x < band_x + band_w:
            row += band
        else:
            # Integer arithmetic keeps the gradient bit-identical on every platform.
            row += bytes(a + (b - a) * x // max(1, width - 1) for a, b in zip(left, right, strict=True))

    frame = av.VideoFrame(width, height, "rgb24")
    _fill_plane(frame.planes[0], bytes(row), height)
    codec = av.CodecContext.create("png", "w")
    codec.width, codec.height, codec.pix_fmt = width, height, "rgb24"
    png = b"".join(bytes(packet) for packet in [*codec.encode(frame), *codec.encode(None)])
    return _insert_text_chunk(png, PNG_LINEAGE_KEY, text)


def shot_mp4(
    path: Path, width: int, height: int, duration_s: float, *, fps: int = 12, lineage: dict[str, Any]
) -> None:
    """Write an H.264 MP4 shot of exactly ``round(duration_s * fps)`` frames carrying its lineage.

    Frames show a lineage-coloured background with a bar that moves one step per frame, so every frame
    differs and any change in lineage changes the picture. The lineage JSON is the container ``comment``.
    The file is written next to ``path`` and renamed into place, so readers never see a partial shot.

    Args:
        path: Where to write the ``.mp4``.
        width: Width in pixels; even and positive (yuv420p halves chroma in both directions).
        height: Height in pixels; even and positive.
        duration_s: Duration in seconds; must give at least one frame.
        fps: Frame rate in frames per second (> 0).
        lineage: JSON-serialisable lineage.

    Raises:
        ValueError: A dimension is odd or not positive, ``fps`` is not positive, or the duration rounds to
            zero frames.
    """
    if width <= 0 or height <= 0 or width % 2 or height % 2:
        raise ValueError(f"shot size must be positive and even, got {width}x{height}")
    if fps <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    frames = round(duration_s * fps)
    if frames < 1:
        raise ValueError(f"duration {duration_s}s at {fps} fps gives no frame")
    text = lineage_json(lineage)
    seed = hashlib.sha256(text.encode()).digest()
    # Background and bar colours in YUV directly: no colour conversion, so nothing platform-dependent.
    bg = (16 + seed[0] % 160, 64 + seed[1] % 128, 64 + seed[2] % 128)
    bar = ((bg[0] + 96) % 220 + 16, 255 - bg[1], 255 - bg[2])
    bar_w = max(2, (width // 8) & ~1)  # even, so the chroma band lines up with the luma band
    travel = max(1, width - bar_w)
    start = int.from_bytes(seed[3:5], "big")
    step = 2 * (1 + seed[5] % 4)
    time_base = Fraction(1, fps)

    with _replacing(path) as tmp, av.open(str(tmp), "w", format="mp4", options=_MP4_OPTIONS) as out:
        out.metadata[LINEAGE_TAG] = text
        stream = out.add_stream("libx264", rate=fps, options=_X264_OPTIONS)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.thread_count = 1
        stream.codec_context.time_base = time_base
        for index in range(frames):
            x = ((start + index * step) % travel) & ~1
            frame = av.VideoFrame(width, height, "yuv420p")
            for plane, bg_v, bar_v, scale in zip(frame.planes, bg, bar, (1, 2, 2), strict=True):
                w, bx, bw = width // scale, x // scale, bar_w // scale
                row = bytes([bg_v]) * bx + bytes([bar_v]) * bw + bytes([bg_v]) * (w - bx - bw)
                _fill_plane(plane, row, height // scale)
            frame.pts, frame.time_base = index, time_base
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))


def audio_wav(path: Path, duration_s: float, *, sample_rate: int = 16000, lineage: dict[str, Any]) -> None:
    """Write a mono 16-bit PCM WAV of a lineage-derived tone, carrying its lineage.

    The tone's frequency (220–879 Hz) comes from the lineage hash; samples are ``round(duration_s *
    sample_rate)``. The lineage JSON is the ``comment`` tag, which FFmpeg's WAV muxer writes as a
    ``LIST/INFO/ICMT`` chunk and its demuxer reads back. Written next to ``path`` and renamed into place.

    Args:
        path: Where to write the ``.wav``.
        duration_s: Duration in seconds; must give at least one sample.
        sample_rate: Samples per second (> 0).
        lineage: JSON-serialisable lineage.

    Raises:
        ValueError: ``sample_rate`` is not positive or the duration rounds to zero samples.
    """
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be positive, got {sample_rate}")
    total = round(duration_s * sample_rate)
    if total < 1:
        raise ValueError(f"duration {duration_s}s at {sample_rate} Hz gives no sample")
    text = lineage_json(lineage)
    seed = hashlib.sha256(text.encode()).digest()
    freq = 220 + int.from_bytes(seed[0:2], "big") % 660
    # An integer frequency repeats exactly every second, so one second of samples is computed and tiled.
    period = [round(0.3 * 32767 * math.sin(2 * math.pi * freq * i / sample_rate)) for i in range(sample_rate)]
    # Native byte order on purpose: PyAV's "s16" frames are native-endian, and the pcm_s16le encoder does
    # the conversion to WAV's little-endian.
    one_second = array("h", period).tobytes()

    with _replacing(path) as tmp, av.open(str(tmp), "w", format="wav") as out:
        out.metadata[LINEAGE_TAG] = text
        stream = out.add_stream("pcm_s16le", rate=sample_rate, layout="mono")
        written = 0
        while written < total:
            count = min(sample_rate, total - written)
            frame = av.AudioFrame(format="s16", layout="mono", samples=count)
            data = one_second[: 2 * count]
            plane = frame.planes[0]
            plane.update(data + bytes(plane.buffer_size - len(data)))
            frame.sample_rate, frame.pts, frame.time_base = sample_rate, written, Fraction(1, sample_rate)
            out.mux(stream.encode(frame))
            written += count
        out.mux(stream.encode(None))


def _fill_plane(plane: Any, row: bytes, rows: int) -> None:
    """Fill a frame plane with ``rows`` copies of ``row``, honouring FFmpeg's padded line size."""
    padded = row + bytes(plane.line_size - len(row))
    data = padded * rows
    plane.update(data + bytes(plane.buffer_size - len(data)))


def _insert_text_chunk(png: bytes, keyword: str, text: str) -> bytes:
    """Insert a ``tEXt`` chunk right after IHDR (a chunk is length, type, data, CRC-32 of type+data)."""
    if png[:8] != b"\x89PNG\r\n\x1a\n" or png[12:16] != b"IHDR":
        raise ValueError("not a PNG with a leading IHDR chunk")
    ihdr_end = 8 + 12 + struct.unpack(">I", png[8:12])[0]
    body = b"tEXt" + keyword.encode("latin-1") + b"\x00" + text.encode("latin-1")
    chunk = struct.pack(">I", len(body) - 4) + body + struct.pack(">I", zlib.crc32(body))
    return png[:ihdr_end] + chunk + png[ihdr_end:]


@contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; move it over ``path`` only if the block succeeds.

    The name is random rather than ``mkstemp``'d so the result gets ordinary umask permissions, and it
    sits in the same directory so ``os.replace`` is an atomic rename.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
