"""The reviewer page's test kit: login tokens, a plan with an approval whose node makes real media, the app
served by a real uvicorn on a free port (in a thread, so the session's event loop keeps running the worker).
Waiting for a request is ``peoplekit.wait_open``."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

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


@contextmanager
def served(app: FastAPI) -> Iterator[str]:
    """``app`` on a real uvicorn in a background thread; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the reviewer app did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
