"""Real media files for ledgerflow, made and checked with PyAV (FFmpeg's libraries; no binary, no subprocess).

Three users, one module each:

* the vendor simulator renders small, deterministic PNG keyframes, H.264 MP4 shots and WAV tones that
  satisfy the declared bounds and embed their lineage (:mod:`media.render`);
* the review probes the delivered files by decoding them, instead of trusting vendor metadata, and reads the
  lineage back (:mod:`media.probe`);
* the compose stage assembles shots and audio into one playable MP4 (:mod:`media.assemble`).
"""

from __future__ import annotations

from media.assemble import assemble
from media.probe import MediaInvalid, MediaProbe, lineage_of, probe
from media.render import audio_wav, keyframe_png, shot_mp4

__all__ = [
    "MediaInvalid",
    "MediaProbe",
    "assemble",
    "audio_wav",
    "keyframe_png",
    "lineage_of",
    "probe",
    "shot_mp4",
]
