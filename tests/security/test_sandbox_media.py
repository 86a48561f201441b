"""Issue 24 §2: hostile media reaches FFmpeg only in a limited child process.

A vendor's file is decoded by ``media.probe`` in a child with time and memory limits: a file that balloons,
hangs or breaks the decoder fails that output (``MediaInvalid``) and leaves the worker as it was.
"""

from __future__ import annotations

import resource
import struct
import time
import zlib
from pathlib import Path

import pytest

from media import MediaInvalid, probe, shot_mp4


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(path: Path) -> Path:
    """A 600-byte PNG declaring 16000 x 16000 pixels of 16-bit RGBA: FFmpeg allocates 2 GB to decode it."""
    header = struct.pack(">IIBBBBB", 16000, 16000, 16, 6, 0, 0, 0)
    data = _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(b"\0" * 1000)) + _chunk(b"IEND", b"")
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + data)
    return path


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_decompression_bomb_fails_on_the_memory_limit_not_in_the_worker(tmp_path: Path) -> None:
    bomb = png_bomb(tmp_path / "keyframe.png")
    before = _peak_rss_mb()

    started = time.monotonic()
    with pytest.raises(MediaInvalid) as refused:
        probe(bomb)

    assert str(refused.value) == "not decodable: the decoder exceeded the memory limit of 1024 MiB"
    assert _peak_rss_mb() - before < 100  # decoded in-process, our peak grew by about 2 GB
    assert time.monotonic() - started < 4  # in-process, the decoder churned for about 5 s


def test_a_decode_that_runs_past_its_time_fails_on_the_timeout(tmp_path: Path) -> None:
    # With room to allocate, the bomb keeps the decoder busy for seconds: a hang, as far as we can tell.
    bomb = png_bomb(tmp_path / "keyframe.png")

    started = time.monotonic()
    with pytest.raises(MediaInvalid) as refused:
        probe(bomb, timeout_s=1, memory_mb=4096)

    assert str(refused.value) == "not decodable: the decoder did not finish within 1s"
    assert time.monotonic() - started < 2


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda data: b"\x00\x00\x00\x18ftypisom" + bytes(range(256)) * 8, "^(not decodable|truncated): "),
        (lambda data: data[: len(data) // 2], r"^truncated: decoded \d+ of 24 frames"),
    ],
    ids=["garbage", "truncated"],
)
def test_garbage_and_truncated_files_fail_that_output_only(tmp_path: Path, make: object, reason: str) -> None:
    assert callable(make)
    shot_mp4(tmp_path / "good.mp4", 64, 36, 2.0, fps=12, lineage={"case": "hostile"})
    data = (tmp_path / "good.mp4").read_bytes()
    (tmp_path / "bad.mp4").write_bytes(make(data))

    with pytest.raises(MediaInvalid, match=reason) as refused:
        probe(tmp_path / "bad.mp4")

    assert "\n" not in str(refused.value)
    assert probe(tmp_path / "good.mp4").frames == 24  # the next output probes as usual
