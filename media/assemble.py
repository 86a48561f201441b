"""Assemble shots and an audio track into one playable MP4 (the compose stage's real output).

Shots are decoded and re-encoded back to back as H.264 at the first shot's size and frame rate; audio is
re-encoded as AAC and trimmed or padded with silence to exactly the video's length. Re-encoding (rather than
stream copy) is what makes concatenation safe across independently encoded shots: their H.264 parameter
sets and timestamps need not agree. Every input is probed first, so a truncated or undecodable shot fails
the assembly instead of being silently shortened.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
from av.audio.fifo import AudioFifo
from av.audio.resampler import AudioResampler
from av.audio.stream import AudioStream
from av.container import InputContainer, OutputContainer
from av.video.frame import PictureType

from media.probe import MediaInvalid, MediaProbe, probe, probe_in_process
from media.render import _MP4_OPTIONS, _X264_OPTIONS, LINEAGE_TAG, _replacing, lineage_json

_AAC_BITS_PER_CHANNEL = 48_000


def assemble(
    shots: Sequence[Path], audio: Path | None, out: Path, *, lineage: dict[str, Any] | None = None
) -> MediaProbe:
    """Concatenate shots in order, add an audio track, and atomically write one MP4.

    All shots must have the first shot's size and frame rate: a mismatch raises ``ValueError`` rather than
    scaling or re-timing, because either would silently change what the reviewed shots look like or how
    long they last. The output has exactly the sum of the shots' frames, so its duration is the sum of
    theirs. Encoding is single-threaded with fixed options, so the same inputs give the same bytes.

    Args:
        shots: Video files, in playback order; at least one.
        audio: An audio file (any format FFmpeg decodes) to lay under the video, or ``None`` for a video-only
            file. It is cut at, or padded with silence to, the video's duration.
        out: Destination ``.mp4``. Written to a temporary file beside it, checked, then renamed into place.
        lineage: Stored as JSON in the container ``comment``; ``None`` writes no comment.

    Returns:
        The probe of the written file.

    Raises:
        ValueError: ``shots`` is empty; a shot is a still image, has no video, or differs from the first in
            size or frame rate; the first shot's size is odd; or ``audio`` has no audio stream. The message
            names the shot by index and path.
        MediaInvalid: A shot or the audio file is invalid (the message names which), or the written file
            does not probe back with the expected frame count.
    """
    if not shots:
        raise ValueError("assemble needs at least one shot")
    shot_probes = [_probe_input(f"shot {i} ({path})", path) for i, path in enumerate(shots)]
    first = shot_probes[0]
    if first.width is not None and first.height is not None and (first.width % 2 or first.height % 2):
        raise ValueError(
            f"shot 0 ({shots[0]}) is {first.width}x{first.height}; yuv420p H.264 needs even sizes"
        )
    fps = _frame_rate(shots[0])
    for i, (path, shot) in enumerate(zip(shots, shot_probes, strict=True)):
        if shot.frames is None or shot.width is None or shot.height is None:
            raise ValueError(f"shot {i} ({path}) has no video stream")
        if shot.duration_s is None:
            raise ValueError(f"shot {i} ({path}) is a still image, not a shot")
        if (shot.width, shot.height) != (first.width, first.height):
            raise ValueError(
                f"shot {i} ({path}) is {shot.width}x{shot.height}, the first shot is "
                f"{first.width}x{first.height}; assemble does not scale"
            )
        if (shot_fps := _frame_rate(path)) != fps:
            raise ValueError(
                f"shot {i} ({path}) is {shot_fps} fps, the first shot is {fps} fps; no re-timing"
            )
    if audio is not None and not _probe_input(f"audio ({audio})", audio).audio:
        raise ValueError(f"audio ({audio}) has no audio stream")
    total_frames = sum(shot.frames or 0 for shot in shot_probes)
    size = (first.width or 0, first.height or 0)

    out = Path(out)
    with _replacing(out) as tmp:
        with av.open(str(tmp), "w", format="mp4", options=_MP4_OPTIONS) as container:
            if lineage is not None:
                container.metadata[LINEAGE_TAG] = lineage_json(lineage)
            _encode(container, shots, fps, size, audio, total_frames)
        result = probe_in_process(tmp)  # our own file: no child (the shots, a vendor's, were probed in one)
        # Belt and braces: never rename into place a file that does not hold every frame that went in.
        if result.frames != total_frames:
            raise MediaInvalid(f"assembled {result.frames} frames, expected {total_frames}")
    return result


def _probe_input(label: str, path: Path) -> MediaProbe:
    """Probe one input, prefixing any failure with which input it was."""
    try:
        return probe(path)
    except MediaInvalid as err:
        raise MediaInvalid(f"{label}: {err}") from err


def _frame_rate(path: Path) -> Fraction:
    """A video file's nominal frame rate (header only; probe has already decoded and validated it)."""
    with av.open(str(path), "r") as container:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
    if not rate:
        raise ValueError(f"shot ({path}) has no frame rate")
    return Fraction(rate)


def _encode(
    container: OutputContainer,
    shots: Sequence[Path],
    fps: Fraction,
    size: tuple[int, int],
    audio: Path | None,
    total_frames: int,
) -> None:
    """Re-encode every shot's frames, interleaving audio so each second of video sits near its sound."""
    time_base = 1 / fps
    video = container.add_stream("libx264", rate=fps, options=_X264_OPTIONS)
    video.width, video.height = size
    video.pix_fmt = "yuv420p"
    video.codec_context.thread_count = 1
    video.codec_context.time_base = time_base

    sound = _AudioTrack(container, audio, total_frames, fps) if audio is not None else None
    index = 0
    for path in shots:
        for shot_index, frame in enumerate(_video_frames(path)):
            frame = frame if frame.format.name == "yuv420p" else frame.reformat(format="yuv420p")
            frame.pts, frame.time_base = index, time_base
            # Each shot starts on a keyframe (so a player can seek to shot boundaries); inside a shot the
            # encoder decides, instead of copying the decoded frame's original picture type.
            frame.pict_type = PictureType.I if shot_index == 0 else PictureType.NONE
            container.mux(video.encode(frame))
            index += 1
            if sound is not None:
                sound.write_until(index)
    container.mux(video.encode(None))
    if sound is not None:
        sound.finish()


def _video_frames(path: Path) -> Iterator[av.VideoFrame]:
    """Decode a file's first video stream."""
    with av.open(str(path), "r") as src:
        yield from src.decode(src.streams.video[0])


class _AudioTrack:
    """The output's AAC track: the source decoded into a FIFO, cut or padded to the video's length."""

    def __init__(self, container: OutputContainer, path: Path, total_frames: int, fps: Fraction) -> None:
        with av.open(str(path), "r") as src:
            source = src.streams.audio[0]
            self.rate = source.codec_context.sample_rate
            # AAC in MP4 is mono or stereo here; anything wider is downmixed to stereo by the resampler.
            layout = "mono" if source.codec_context.channels == 1 else "stereo"
            self.fps = fps
            self.total = round(total_frames * self.rate / fps)
            self.fifo = AudioFifo()
            resampler = AudioResampler(format="fltp", layout=layout, rate=self.rate)
            for frame in _decoded_then_flush(src, source):
                for chunk in resampler.resample(frame):
                    # The FIFO insists on contiguous pts; we retime on the way out, so drop them here.
                    chunk.pts = None
                    self.fifo.write(chunk)
                if self.fifo.samples >= self.total:
                    break
        if self.fifo.samples < self.total:
            self.fifo.write(_silence(self.total - self.fifo.samples, layout, self.rate))
        self.container = container
        self.stream: AudioStream = container.add_stream("aac", rate=self.rate, layout=layout)
        # 48 kbit/s per channel is ample for AAC-LC at the simulator's 16 kHz; FFmpeg's default (~69k for mono
        # 16 kHz) makes its twoloop coder about 4x slower (1.2 s vs 0.3 s for 76 s) for no audible gain.
        self.stream.bit_rate = _AAC_BITS_PER_CHANNEL * (1 if layout == "mono" else 2)
        self.written = 0

    def write_until(self, video_frames: int) -> None:
        """Encode audio up to the end of video frame ``video_frames`` (interleaving with the video)."""
        self._write(min(self.total, round(video_frames * self.rate / self.fps)))

    def finish(self) -> None:
        """Encode what is left of the track and flush the encoder."""
        self._write(self.total)
        self.container.mux(self.stream.encode(None))

    def _write(self, upto: int) -> None:
        count = upto - self.written
        if count <= 0:
            return
        frame = self.fifo.read(count)
        if frame is None:  # cannot happen: the FIFO was filled to self.total
            raise RuntimeError(f"audio FIFO ran dry at sample {self.written}")
        frame.pts, frame.time_base = self.written, Fraction(1, self.rate)
        self.container.mux(self.stream.encode(frame))
        self.written = upto


def _decoded_then_flush(src: InputContainer, stream: AudioStream) -> Iterator[av.AudioFrame | None]:
    """Decoded frames of ``stream``, then ``None`` (which tells a resampler to flush)."""
    yield from src.decode(stream)
    yield None


def _silence(samples: int, layout: str, rate: int) -> av.AudioFrame:
    """A frame of planar-float silence (all-zero bytes are 0.0)."""
    frame = av.AudioFrame(format="fltp", layout=layout, samples=samples)
    for plane in frame.planes:
        plane.update(bytes(plane.buffer_size))
    frame.sample_rate = rate
    return frame
