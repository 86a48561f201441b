"""Probe real media files: decode them and report what is actually there.

The review must not trust what a vendor *says* it delivered (its metadata, its headers). ``probe`` opens the
file with PyAV, decodes every video frame and every audio sample, and derives duration from what decoded.
Anything it cannot open or fully decode raises :class:`MediaInvalid` with a one-line reason, so a truncated
upload fails review instead of passing on the strength of an intact header.

The files come from vendors, so FFmpeg parses hostile bytes: ``probe`` decodes in a child interpreter (this
module run as a script) with a clean environment, an address-space limit, a CPU limit, no core dumps and a
wall-clock timeout. A file that makes the decoder crash, hang or balloon fails as :class:`MediaInvalid`
(that output only); the worker's memory and threads are never at stake. ``probe_in_process`` is the
decoding itself, for the child and for files we wrote ourselves (``media.assemble``'s output).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import struct
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import av
from av.audio.stream import AudioStream
from av.container import InputContainer
from av.video.stream import VideoStream

# PNG tEXt chunks (and other per-image text) surface as frame metadata; render.keyframe_png stores the
# lineage under this keyword, and probe lifts it into MediaProbe.metadata under the same key.
PNG_LINEAGE_KEY = "ledgerflow"

# FFmpeg's single demuxer for the whole ISO base media family; the major brand tells the members apart.
_ISO_BMFF_NAMES = frozenset({"mov", "mp4", "m4a", "3gp", "3g2", "mj2"})
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# The child's limits. Address space counts the interpreter and FFmpeg's libraries (~120 MiB) and reserved
# thread stacks, so it is a ceiling, not a working set; a 1080p decode needs a few hundred MiB.
PROBE_TIMEOUT_S = 120.0
PROBE_MEMORY_MB = 1024
# The child's exit status when decoding ran out of memory (MemoryError or FFmpeg's ENOMEM).
_MEMORY_EXIT = 86
_CHILD_PATH = "/usr/local/bin:/usr/bin:/bin"


class MediaInvalid(Exception):
    """The file is missing, empty, truncated, undecodable or not media.

    The message is a single line that starts with the reason, e.g. ``"truncated: decoded 20 of 48 frames"``
    or ``"not decodable: Invalid data found when processing input"``.
    """


@dataclass(frozen=True)
class MediaProbe:
    """What decoding a media file actually found.

    Attributes:
        format: Short container name: ``"mp4"``, ``"mov"``, ``"m4a"``, ``"3gp"``, ``"png"``, ``"wav"``, …
        codec: The video codec's name, or the audio codec's for an audio-only file.
        duration_s: Decoded duration in seconds: video frames / frame rate, or samples / sample rate for an
            audio-only file. ``None`` for a still image.
        width: Video width in pixels, ``None`` without video.
        height: Video height in pixels, ``None`` without video.
        frames: Video frames actually decoded, ``None`` without video.
        sample_rate: Audio sample rate in Hz, ``None`` without audio.
        channels: Audio channel count, ``None`` without audio.
        audio: Whether the file has an audio stream.
        metadata: Container metadata, plus the first video frame's own metadata (where a PNG's tEXt chunks,
            including the ``ledgerflow`` lineage, end up) for keys the container does not already have.
    """

    format: str
    codec: str | None
    duration_s: float | None
    width: int | None
    height: int | None
    frames: int | None
    sample_rate: int | None
    channels: int | None
    audio: bool
    metadata: dict[str, str] = field(default_factory=dict)


def probe(path: Path, *, timeout_s: float = PROBE_TIMEOUT_S, memory_mb: int = PROBE_MEMORY_MB) -> MediaProbe:
    """Decode a media file in a limited child process and report what it really contains.

    See ``probe_in_process`` for what is decoded and checked. The child gets ``timeout_s`` of wall-clock
    time (and as much CPU time), ``memory_mb`` of address space and an environment without our secrets.

    Args:
        path: The file to probe.
        timeout_s: Wall-clock limit for the whole decode.
        memory_mb: Address-space limit of the decoding process.

    Returns:
        The decoded facts about the file.

    Raises:
        MediaInvalid: As ``probe_in_process``, and when the decoder ran out of time or memory or crashed.
    """
    path = Path(path)
    argv = [
        sys.executable,
        "-I",
        os.path.abspath(__file__),
        os.fspath(path.absolute()),
        str(memory_mb * 1024 * 1024),
        str(max(1, int(timeout_s + 0.999))),
    ]
    env = {"PATH": _CHILD_PATH, "LANG": "C.UTF-8", "MALLOC_ARENA_MAX": "2"}
    child = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill(child)
        raise MediaInvalid(f"not decodable: the decoder did not finish within {timeout_s:g}s") from None
    except BaseException:
        _kill(child)
        raise
    finally:
        # Nothing the decoder started may outlive it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
    return _outcome(child.returncode, out, err, memory_mb)


def _outcome(code: int, out: bytes, err: bytes, memory_mb: int) -> MediaProbe:
    """Turn how the child ended into a probe or a ``MediaInvalid``."""
    if code == 0:
        answer = json.loads(out)
        if "invalid" in answer:
            raise MediaInvalid(answer["invalid"])
        return MediaProbe(**answer["probe"])
    last = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
    if code == _MEMORY_EXIT or code == -signal.SIGKILL:
        raise MediaInvalid(f"not decodable: the decoder exceeded the memory limit of {memory_mb} MiB")
    if code == -signal.SIGXCPU:
        raise MediaInvalid("not decodable: the decoder ran out of CPU time")
    if code < 0:
        raise MediaInvalid(f"not decodable: the decoder crashed ({_signal_name(-code)})")
    raise MediaInvalid(f"not decodable: the probe failed: {last[0][:300]}")


def _kill(child: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    child.kill()
    child.communicate()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _child_main(argv: list[str]) -> int:
    """The decoding child: limits first, then probe, then one JSON line on stdout."""
    path, memory, cpu = argv[1], int(argv[2]), int(argv[3])
    for which, value in (
        (resource.RLIMIT_AS, memory),
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(which, (value, value))
    try:
        found = probe_in_process(Path(path))
    except MediaInvalid as e:
        if "Cannot allocate memory" in str(e):
            return _MEMORY_EXIT
        answer: dict[str, Any] = {"invalid": str(e)}
    except MemoryError:
        return _MEMORY_EXIT
    else:
        answer = {"probe": asdict(found)}
    sys.stdout.write(json.dumps(answer))
    return 0


def probe_in_process(path: Path) -> MediaProbe:
    """Open and fully decode a media file, and report what it really contains.

    Every video frame and audio sample of the first video and first audio stream is decoded (the files
    this is meant for are small), so the counts and the duration describe the content, not the header.

    Args:
        path: The file to probe.

    Returns:
        The decoded facts about the file.

    Raises:
        MediaInvalid: The file is missing or empty, is not a media container FFmpeg recognises, has no audio
            or video stream, fails to decode, decodes fewer video frames than its header promises, or its
            container structure (MP4 boxes, WAV or PNG chunks) runs past the end of the file.
    """
    path = Path(path)
    if not path.is_file():
        raise MediaInvalid(f"missing: no such file {path}")
    size = path.stat().st_size
    if size == 0:
        raise MediaInvalid("empty: the file has 0 bytes")
    try:
        container = av.open(str(path), "r")
    except av.FFmpegError as err:
        # A cut-off MP4 whose moov box was at the end cannot even be opened ("moov atom not found"): say
        # it is truncated when the structure shows that, rather than a vaguer "invalid data".
        raise MediaInvalid(_truncation(path, size) or f"not decodable: {_reason(err)}") from err
    with container:
        video = container.streams.video[0] if container.streams.video else None
        audio = container.streams.audio[0] if container.streams.audio else None
        if video is None and audio is None:
            reason = f"not media: no audio or video stream in {container.format.name} container"
            raise MediaInvalid(_truncation(path, size) or reason)
        decoded = _decode(container, video, audio)
        # Header facts are read after decoding: some (the codec context's size) settle only once decoded.
        promised = video.frames if video is not None else 0
        rate = (video.average_rate or video.guessed_rate) if video is not None else None
        container_metadata = dict(container.metadata)
        format_name = container.format.name

    if video is not None and promised and decoded.frames < promised:
        suffix = f" ({decoded.error})" if decoded.error else ""
        raise MediaInvalid(f"truncated: decoded {decoded.frames} of {promised} frames{suffix}")
    # Decoding can fail, or even succeed, on a file whose tail is gone (the end of a moov box, of a WAV's
    # data chunk, of a PNG): the container's own length fields still show it, and it is the better reason.
    truncated = _truncation(path, size)
    if truncated:
        raise MediaInvalid(truncated)
    if decoded.error:
        raise MediaInvalid(f"not decodable: {decoded.error}")
    if video is not None and decoded.frames == 0:
        raise MediaInvalid("not decodable: no video frame decoded")
    if audio is not None and video is None and decoded.samples == 0:
        raise MediaInvalid("not decodable: no audio sample decoded")

    codec = decoded.video_codec or decoded.audio_codec
    short = _short_format(format_name, container_metadata, codec)
    still = video is not None and _is_still_image(format_name)
    duration: float | None = None
    if video is not None and not still:
        duration = float(decoded.frames / rate) if rate else None
    elif video is None and decoded.sample_rate:
        duration = decoded.samples / decoded.sample_rate
    metadata = {**decoded.frame_metadata, **container_metadata}
    return MediaProbe(
        format=short,
        codec=codec,
        duration_s=duration,
        width=decoded.width,
        height=decoded.height,
        frames=decoded.frames if video is not None else None,
        sample_rate=decoded.sample_rate,
        channels=decoded.channels,
        audio=audio is not None,
        metadata=metadata,
    )


def lineage_of(p: MediaProbe) -> dict[str, Any] | None:
    """The lineage a file carries, parsed back from its metadata.

    Looks at the PNG ``ledgerflow`` text chunk first, then the container ``comment`` (MP4, WAV).

    Args:
        p: A probe result.

    Returns:
        The lineage object, or ``None`` when there is none or it is not a JSON object.
    """
    for key in (PNG_LINEAGE_KEY, "comment"):
        raw = p.metadata.get(key)
        if raw is None:
            continue
        try:
            value = json.loads(raw)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


@dataclass
class _Decoded:
    """Running tallies while decoding (private)."""

    frames: int = 0
    samples: int = 0
    width: int | None = None
    height: int | None = None
    sample_rate: int | None = None
    channels: int | None = None
    video_codec: str | None = None
    audio_codec: str | None = None
    frame_metadata: dict[str, str] = field(default_factory=dict)
    error: str | None = None


def _decode(container: InputContainer, video: VideoStream | None, audio: AudioStream | None) -> _Decoded:
    """Decode every packet of the chosen streams; stop at the first decoding error and record it."""
    out = _Decoded()
    if video is not None:
        out.video_codec = video.codec_context.name
    if audio is not None:
        out.audio_codec = audio.codec_context.name
    streams = [s for s in (video, audio) if s is not None]
    try:
        # One demux pass over both streams: interleaved files are read once, and PyAV ends each stream with
        # an empty packet whose decode() flushes the decoder's delayed frames.
        for packet in container.demux(streams):
            for frame in packet.decode():
                if isinstance(frame, av.VideoFrame):
                    if out.frames == 0:
                        out.width, out.height = frame.width, frame.height
                        out.frame_metadata = dict(frame.metadata)
                    out.frames += 1
                elif isinstance(frame, av.AudioFrame):
                    if out.sample_rate is None:
                        out.sample_rate = frame.sample_rate
                        out.channels = frame.layout.nb_channels
                    out.samples += frame.samples
    except av.FFmpegError as err:
        out.error = _reason(err)
    if audio is not None and out.sample_rate is None:
        # An audio stream that decoded nothing still has header facts worth reporting.
        out.sample_rate = audio.codec_context.sample_rate or None
        out.channels = audio.codec_context.channels or None
    return out


def _reason(err: av.FFmpegError) -> str:
    """FFmpeg's message without PyAV's ``[Errno …]`` prefix and file name, so it stays one short line."""
    return (err.strerror or str(err)).splitlines()[0]


def _is_still_image(format_name: str) -> bool:
    """Whether FFmpeg opened the file with an image demuxer (``png_pipe``, ``image2``, …)."""
    return format_name.endswith("_pipe") or format_name.startswith("image2")


def _short_format(format_name: str, metadata: dict[str, str], codec: str | None) -> str:
    """Map FFmpeg's demuxer name to the short name a reviewer expects (``mp4``, ``png``, ``wav``, …)."""
    names = format_name.split(",")
    if _ISO_BMFF_NAMES.intersection(names):
        brand = metadata.get("major_brand", "").strip().lower()
        if brand == "qt":
            return "mov"
        if brand.startswith(("m4a", "m4b")):
            return "m4a"
        if brand.startswith("3g2"):
            return "3g2"
        if brand.startswith("3g"):
            return "3gp"
        # isom, iso2…, mp41, mp42, avc1, dash, and a missing brand are all plain MP4 in practice.
        return "mp4"
    if _is_still_image(format_name):
        if format_name.endswith("_pipe") and not format_name.startswith("image2"):
            return format_name.removesuffix("_pipe")
        # image2 names the file pattern, not the picture: the codec does ("png", "mjpeg"…).
        return "jpeg" if codec == "mjpeg" else (codec or "image")
    return names[0]


def _truncation(path: Path, size: int) -> str | None:
    """A one-line reason if the file's top-level structure runs past its end (or is malformed), else ``None``.

    Only the containers this package writes are walked: ISO-BMFF (MP4/MOV: size+type boxes), RIFF (WAV:
    id+size chunks) and PNG (length+type+data+CRC chunks ending in IEND). Other formats return ``None``.
    """
    with path.open("rb") as f:
        head = f.read(12)
        if len(head) >= 8 and head[4:8] == b"ftyp":
            return _walk_boxes(f, size)
        if len(head) == 12 and head[:4] == b"RIFF" and head[8:12] == b"WAVE":
            return _walk_riff(f, size)
        if head[:8] == _PNG_SIGNATURE:
            return _walk_png(f, size)
    return None


def _cut(kind: str, name: bytes, offset: int, needed: int, size: int) -> str:
    """The one-line reason for a box or chunk that starts at ``offset`` but does not fit in the file."""
    label = name.decode("latin-1")
    return f"truncated: {label!r} {kind} at byte {offset} needs {needed} bytes, the file ends at {size}"


def _walk_boxes(f: BinaryIO, size: int) -> str | None:
    """Walk ISO-BMFF top-level boxes; report the first whose declared size exceeds the file."""
    offset = 0
    while offset + 8 <= size:
        f.seek(offset)
        box_size, box_type = struct.unpack(">I4s", f.read(8))
        if box_size == 1:  # a 64-bit "largesize" follows the type
            largesize = f.read(8)
            if len(largesize) < 8:
                break
            box_size = struct.unpack(">Q", largesize)[0]
        elif box_size == 0:  # "extends to the end of the file": cannot be short by definition
            return None
        if box_size < 8:
            return f"not decodable: malformed {box_type.decode('latin-1')!r} box at byte {offset}"
        if offset + box_size > size:
            return _cut("box", box_type, offset, box_size, size)
        offset += box_size
    if offset < size:
        return f"truncated: the last {size - offset} bytes are not a whole box"
    return None


def _walk_riff(f: BinaryIO, size: int) -> str | None:
    """Walk a RIFF/WAVE file's chunks; report a ``data`` (or any) chunk that runs past the file's end."""
    offset = 12
    while offset + 8 <= size:
        f.seek(offset)
        chunk_id, chunk_size = struct.unpack("<4sI", f.read(8))
        # Streaming writers that could not seek back leave 0 or 0xFFFFFFFF as "unknown": nothing to check.
        if chunk_id == b"data" and chunk_size in (0, 0xFFFFFFFF):
            return None
        if offset + 8 + chunk_size > size:
            return _cut("chunk", chunk_id, offset, 8 + chunk_size, size)
        offset += 8 + chunk_size + (chunk_size & 1)  # chunks are padded to an even length
    return None


def _walk_png(f: BinaryIO, size: int) -> str | None:
    """Walk PNG chunks; report one that runs past the file's end, or a file that stops before IEND."""
    offset = len(_PNG_SIGNATURE)
    while offset + 8 <= size:
        f.seek(offset)
        length, chunk_type = struct.unpack(">I4s", f.read(8))
        end = offset + 12 + length  # length and type, data, CRC
        if end > size:
            return _cut("chunk", chunk_type, offset, end - offset, size)
        if chunk_type == b"IEND":
            return None
        offset = end
    return f"truncated: the PNG ends at byte {size} without an IEND chunk"


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv))
