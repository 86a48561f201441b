"""An ASGI app on a real uvicorn, on a free port, for as long as a ``with`` lasts (tests and fakes)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import uvicorn


@contextmanager
def served(app: Any, *, lifespan: Literal["on", "off"] = "off", host: str = "127.0.0.1") -> Iterator[str]:
    """Serve ``app`` on a daemon thread; yields its base URL once uvicorn says it started.

    The socket is bound before the server starts (the port is known up front and nobody takes it meanwhile);
    IPPROTO_TCP explicitly, so asyncio sets TCP_NODELAY on the connections it accepts.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan=lifespan))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{type(app).__name__} did not start on {host}")
            time.sleep(0.01)
        try:
            yield f"http://{host}:{sock.getsockname()[1]}"
        finally:
            server.should_exit = True
            thread.join(10)
    finally:
        sock.close()
