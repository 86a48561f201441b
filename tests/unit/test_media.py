"""Real media: rendered files decode to what was asked, carry their lineage, and damage is caught."""

from __future__ import annotations

import hashlib
import json
from fractions import Fraction
from pathlib import Path

import av
import pytest

from media import (
    MediaInvalid,
    assemble,
    audio_wav,
    keyframe_png,
    lineage_of,
    probe,
    shot_mp4,
)

LINEAGE = {"task": "t1", "attempt": "a1", "vendor": "sim", "seed": 7}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_shot_decodes_to_the_asked_size_duration_frames_and_codec_and_carries_its_lineage(
    tmp_path: Path,
) -> None:
    shot_mp4(tmp_path / "s.mp4", 320, 180, 4.0, fps=12, lineage=LINEAGE)
    p = probe(tmp_path / "s.mp4")
    assert (p.format, p.codec, p.width, p.height) == ("mp4", "h264", 320, 180)
    assert p.frames == 48 and p.duration_s == pytest.approx(4.0)
    assert p.audio is False and p.sample_rate is None
    assert lineage_of(p) == LINEAGE
    assert [f.name for f in tmp_path.iterdir()] == ["s.mp4"], "no temporary file is left behind"


def test_a_shot_of_fractional_duration_has_round_duration_times_fps_frames(tmp_path: Path) -> None:
    shot_mp4(tmp_path / "s.mp4", 64, 36, 1.3, fps=10, lineage=LINEAGE)
    p = probe(tmp_path / "s.mp4")
    assert p.frames == 13 and p.duration_s == pytest.approx(1.3)


@pytest.mark.parametrize(("width", "height"), [(321, 180), (320, 181), (0, 180)])
def test_a_shot_of_odd_or_empty_size_is_refused(tmp_path: Path, width: int, height: int) -> None:
    with pytest.raises(ValueError, match="even"):
        shot_mp4(tmp_path / "s.mp4", width, height, 1.0, lineage=LINEAGE)
    assert not (tmp_path / "s.mp4").exists()


def test_the_same_arguments_give_identical_bytes_and_different_lineage_different_bytes(
    tmp_path: Path,
) -> None:
    other = {**LINEAGE, "attempt": "a2"}
    shot_mp4(tmp_path / "a.mp4", 320, 180, 2.0, lineage=LINEAGE)
    shot_mp4(tmp_path / "b.mp4", 320, 180, 2.0, lineage=LINEAGE)
    shot_mp4(tmp_path / "c.mp4", 320, 180, 2.0, lineage=other)
    assert _sha(tmp_path / "a.mp4") == _sha(tmp_path / "b.mp4")
    assert _sha(tmp_path / "a.mp4") != _sha(tmp_path / "c.mp4")

    assert keyframe_png(64, 48, lineage=LINEAGE) == keyframe_png(64, 48, lineage=LINEAGE)
    assert keyframe_png(64, 48, lineage=LINEAGE) != keyframe_png(64, 48, lineage=other)

    audio_wav(tmp_path / "a.wav", 1.0, lineage=LINEAGE)
    audio_wav(tmp_path / "b.wav", 1.0, lineage=LINEAGE)
    audio_wav(tmp_path / "c.wav", 1.0, lineage=other)
    assert _sha(tmp_path / "a.wav") == _sha(tmp_path / "b.wav")
    assert _sha(tmp_path / "a.wav") != _sha(tmp_path / "c.wav")


def test_different_lineage_changes_the_pixels_not_only_the_embedded_text(tmp_path: Path) -> None:
    def pixels(lineage: dict[str, object]) -> bytes:
        (tmp_path / "k.png").write_bytes(keyframe_png(32, 16, lineage=lineage))
        with av.open(str(tmp_path / "k.png")) as c:
            return bytes(next(c.decode(video=0)).planes[0])

    assert pixels(LINEAGE) != pixels({**LINEAGE, "attempt": "a2"})


def test_a_keyframe_png_has_its_size_and_format_and_carries_its_lineage(tmp_path: Path) -> None:
    data = keyframe_png(333, 77, lineage=LINEAGE)
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and b"tEXtledgerflow\x00" in data
    (tmp_path / "k.png").write_bytes(data)
    p = probe(tmp_path / "k.png")
    assert (p.format, p.codec, p.width, p.height, p.frames) == ("png", "png", 333, 77, 1)
    assert p.duration_s is None, "a still has no duration"
    assert json.loads(p.metadata["ledgerflow"]) == LINEAGE
    assert lineage_of(p) == LINEAGE


def test_a_wav_has_its_duration_and_sample_rate_and_carries_its_lineage(tmp_path: Path) -> None:
    audio_wav(tmp_path / "a.wav", 2.5, sample_rate=22050, lineage=LINEAGE)
    p = probe(tmp_path / "a.wav")
    assert (p.format, p.codec, p.sample_rate, p.channels, p.audio) == ("wav", "pcm_s16le", 22050, 1, True)
    assert p.duration_s == pytest.approx(2.5, abs=1 / 22050)
    assert (p.width, p.frames) == (None, None)
    assert lineage_of(p) == LINEAGE


def test_a_truncated_mp4_raises_media_invalid_naming_truncation(tmp_path: Path) -> None:
    shot_mp4(tmp_path / "s.mp4", 320, 180, 4.0, lineage=LINEAGE)
    data = (tmp_path / "s.mp4").read_bytes()
    (tmp_path / "cut.mp4").write_bytes(data[: int(len(data) * 0.7)])
    with pytest.raises(MediaInvalid, match=r"^truncated: decoded \d+ of 48 frames"):
        probe(tmp_path / "cut.mp4")


def test_an_mp4_cut_before_its_index_is_reported_truncated_not_just_undecodable(tmp_path: Path) -> None:
    # Without faststart the moov index is written last, so a cut tail takes the index with it and FFmpeg
    # cannot even open the file; probe still names the truncation from the box sizes.
    path = tmp_path / "late_moov.mp4"
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=12, options={"preset": "ultrafast"})
        stream.width, stream.height, stream.pix_fmt = 64, 36, "yuv420p"
        for i in range(12):
            frame = av.VideoFrame(64, 36, "yuv420p")
            frame.pts, frame.time_base = i, Fraction(1, 12)
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    data = path.read_bytes()
    # Where the cut lands (inside mdat or moov, or just after a box boundary) depends on the encoder's
    # box sizes; what must hold is that it is reported as a truncation, not a decodable file.
    for cut in (int(len(data) * 0.7), len(data) - 5):
        path.write_bytes(data[:cut])
        with pytest.raises(MediaInvalid, match=r"^truncated: "):
            probe(path)


def test_a_truncated_wav_raises_media_invalid_naming_truncation(tmp_path: Path) -> None:
    audio_wav(tmp_path / "a.wav", 1.0, lineage=LINEAGE)
    data = (tmp_path / "a.wav").read_bytes()
    (tmp_path / "cut.wav").write_bytes(data[: len(data) // 2])
    with pytest.raises(MediaInvalid, match=r"^truncated: 'data' chunk"):
        probe(tmp_path / "cut.wav")


def test_a_truncated_png_raises_media_invalid_naming_truncation(tmp_path: Path) -> None:
    data = keyframe_png(64, 48, lineage=LINEAGE)
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(MediaInvalid, match=r"^truncated: 'IDAT' chunk"):
        probe(tmp_path / "cut.png")


def test_a_json_file_raises_media_invalid(tmp_path: Path) -> None:
    (tmp_path / "shot.mp4").write_text(json.dumps({"url": "https://vendor.example/shot.mp4", "frames": 48}))
    with pytest.raises(MediaInvalid, match=r"^not decodable: Invalid data found") as caught:
        probe(tmp_path / "shot.mp4")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("content", "reason"), [(None, "^missing: "), (b"", "^empty: ")])
def test_a_missing_or_empty_file_raises_media_invalid(
    tmp_path: Path, content: bytes | None, reason: str
) -> None:
    if content is not None:
        (tmp_path / "x.mp4").write_bytes(content)
    with pytest.raises(MediaInvalid, match=reason):
        probe(tmp_path / "x.mp4")


def test_assemble_concatenates_shots_with_audio_into_one_mp4_of_their_summed_length(tmp_path: Path) -> None:
    shots = []
    for i, seconds in enumerate((3, 4, 5)):
        shots.append(tmp_path / f"s{i}.mp4")
        shot_mp4(shots[-1], 320, 180, seconds, fps=12, lineage={**LINEAGE, "shot": i})
    audio_wav(tmp_path / "a.wav", 10.0, lineage=LINEAGE)  # shorter than the video: padded with silence
    out = tmp_path / "final.mp4"

    result = assemble(shots, tmp_path / "a.wav", out, lineage={"compose": "c1", "shots": 3})

    assert result == probe(out)
    assert (result.format, result.codec, result.width, result.height) == ("mp4", "h264", 320, 180)
    assert result.frames == 144
    assert result.duration_s == pytest.approx(12.0, abs=1 / 12)
    assert result.audio and result.sample_rate == 16000 and result.channels == 1
    assert lineage_of(result) == {"compose": "c1", "shots": 3}
    with av.open(str(out)) as c:  # the audio track lasts as long as the video, to the sample
        track = c.streams.audio[0]
        assert track.codec_context.name == "aac"
        assert track.duration is not None and track.time_base is not None
        assert float(track.duration * track.time_base) == pytest.approx(12.0, abs=1 / 12)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["a.wav", "final.mp4", "s0.mp4", "s1.mp4", "s2.mp4"]


def test_assemble_without_audio_or_lineage_gives_video_only(tmp_path: Path) -> None:
    shot_mp4(tmp_path / "s.mp4", 64, 36, 1.0, lineage=LINEAGE)
    result = assemble([tmp_path / "s.mp4", tmp_path / "s.mp4"], None, tmp_path / "out.mp4")
    assert (result.frames, result.audio, lineage_of(result)) == (24, False, None)


def test_assemble_refuses_no_shots_and_a_shot_of_another_size_or_frame_rate(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one shot"):
        assemble([], None, tmp_path / "out.mp4")
    shot_mp4(tmp_path / "a.mp4", 64, 36, 1.0, lineage=LINEAGE)
    shot_mp4(tmp_path / "b.mp4", 128, 72, 1.0, lineage=LINEAGE)
    with pytest.raises(ValueError, match=r"^shot 1 \(.*b\.mp4\) is 128x72, the first shot is 64x36"):
        assemble([tmp_path / "a.mp4", tmp_path / "b.mp4"], None, tmp_path / "out.mp4")
    shot_mp4(tmp_path / "c.mp4", 64, 36, 1.0, fps=24, lineage=LINEAGE)
    with pytest.raises(ValueError, match=r"^shot 1 \(.*c\.mp4\) is 24 fps, the first shot is 12 fps"):
        assemble([tmp_path / "a.mp4", tmp_path / "c.mp4"], None, tmp_path / "out.mp4")
    assert not (tmp_path / "out.mp4").exists()


def test_assemble_with_a_truncated_shot_fails_and_leaves_the_previous_output_in_place(tmp_path: Path) -> None:
    shot_mp4(tmp_path / "a.mp4", 64, 36, 2.0, lineage=LINEAGE)
    data = (tmp_path / "a.mp4").read_bytes()
    (tmp_path / "cut.mp4").write_bytes(data[: int(len(data) * 0.7)])
    out = tmp_path / "out.mp4"
    out.write_bytes(b"the previous good output")
    with pytest.raises(MediaInvalid, match=r"^shot 1 \(.*cut\.mp4\): truncated: "):
        assemble([tmp_path / "a.mp4", tmp_path / "cut.mp4"], None, out)
    assert out.read_bytes() == b"the previous good output"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["a.mp4", "cut.mp4", "out.mp4"]
