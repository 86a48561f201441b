"""The reviewer page's test kit: login tokens, a plan with an approval whose node makes real media, the app
served by a real uvicorn on a free port (in a thread, so the session's event loop keeps running the worker).
Waiting for a request is ``peoplekit.wait_open``."""

from __future__ import annotations

from contextlib import AbstractContextManager

from fastapi import FastAPI

from ledgerflow.testing import serving

TOKENS = {"director": "director-review-token-1", "producer": "producer-review-token-1"}

# A keyframe, then a short shot animated from it that a person must approve (its request shows both as
# media: the shot's MP4 and its input PNG), then one more stage that runs only once the shot is approved.
SHOT_APPROVAL = """
goal: a shot a person approves before the cut
budget_ceiling: 10
approval: {timeout: 1h, policy: escalate}
stages:
  - {id: frame, executor: image.keyframe, estimate: 1, input: {format: png, width: 320, height: 180}}
  - id: shot
    executor: video.motion
    estimate: 1
    depends_on: [frame]
    inputs: {keyframe: frame}
    approval: true
    input: {format: mp4, duration_s: 1, width: 160, height: 96}
  - {id: cut, executor: llm.text, estimate: 1, depends_on: [shot]}
"""


def served(app: FastAPI) -> AbstractContextManager[str]:
    """``app`` on a real uvicorn in a background thread; yields its base URL."""
    return serving.served(app)
