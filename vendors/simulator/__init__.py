"""A vendor simulator: paid generation APIs with seeded faults, served over real HTTP.

Three wire protocols on one server, sharing one billing record:

* ``jobs`` — "submit, then poll" with an ``Idempotency-Key`` (``POST /jobs`` …) and a billing API;
* ``predictions`` — Replicate-style predictions with no idempotency key, found again by listing;
* ``openai`` — OpenAI-compatible chat completions and image generation (synchronous).

It charges at acceptance, can charge and then drop the response (or answer 503/504 as a gateway does),
create a job only after the client gave up, forget idempotency keys, purge outputs, serve results from a CDN
on a second port (the API's + 1), refuse, redirect or drip result downloads, report odd cost figures, refuse a
rotated key, answer 408 or slowly; and it delivers real files (PNG, H.264 MP4, WAV, Markdown) that carry
their lineage. Every outcome is drawn from ``random.Random(f"{seed}:{key}:{attempt}")``,
so the same workload gives the same outcomes whatever the interleaving, and again after ``POST /admin/reset``.

Run it with ``python -m vendors.simulator --port 8700 [--config sim.json] [--seed 7]``, or in-process with
``BackgroundSimulator`` (tests).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import time
from pathlib import Path

import uvicorn

from vendors.routes import CDN_PORT_OFFSET
from vendors.simulator.app import create_app, create_cdn_app
from vendors.simulator.config import ChatRule, Draw, ExecutorProfile, SimConfig
from vendors.simulator.state import JobRequest, SimError, SimState

__all__ = [
    "BackgroundSimulator",
    "ChatRule",
    "Draw",
    "ExecutorProfile",
    "JobRequest",
    "SimConfig",
    "SimError",
    "SimState",
    "create_app",
    "main",
]


def _bind(host: str, port: int) -> socket.socket:
    # Bind before starting so the port is known up front and no other process can take it meanwhile.
    # IPPROTO_TCP explicitly: asyncio only sets TCP_NODELAY on accepted sockets whose proto says TCP, and
    # proto 0 costs every request a 40 ms Nagle / delayed-ACK stall.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()  # a port taken: this socket is never used (left open, it leaked until collected)
        raise
    return sock


def _bind_pair(host: str, port: int, cdn_port: int | None) -> tuple[socket.socket, socket.socket]:
    """The API's socket and the CDN's: by default the CDN listens on the API's port + 1 (``CDN_PORT_OFFSET``),
    so a dev deployment can allow-list it knowing only the vendor URL (vendors.routes.deployment_table)."""
    for _ in range(50):
        api = _bind(host, port)
        if cdn_port is not None:
            return api, _bind(host, cdn_port)
        try:
            return api, _bind(host, api.getsockname()[1] + CDN_PORT_OFFSET)
        except OSError:
            if port != 0:  # a port asked for: serve anyway (a dev worker will refuse this CDN's results)
                print(f"simulator: port {port + CDN_PORT_OFFSET} is taken; the CDN takes any free port")
                return api, _bind(host, 0)
            api.close()
    raise OSError(f"no free pair of ports for the simulator and its CDN on {host}")


class _Servers:
    """The vendor API and its CDN: two uvicorn servers over one state, on two bound sockets."""

    def __init__(
        self, config: SimConfig | None, host: str, port: int, cdn_port: int | None, log_level: str
    ) -> None:
        self.state = SimState(config or SimConfig())
        self.app = create_app(self.state)
        self._api_socket, self._cdn_socket = _bind_pair(host, port, cdn_port)
        self.url = f"http://{host}:{self._api_socket.getsockname()[1]}"
        self.cdn_url = f"http://{host}:{self._cdn_socket.getsockname()[1]}"
        self.state.cdn_base = self.cdn_url
        common = {"log_level": log_level, "access_log": False, "lifespan": "off"}
        self.api = uvicorn.Server(uvicorn.Config(self.app, **common))  # type: ignore[arg-type]
        self.cdn = uvicorn.Server(uvicorn.Config(create_cdn_app(self.state), **common))  # type: ignore[arg-type]

    async def serve(self) -> None:
        await asyncio.gather(
            self.api.serve(sockets=[self._api_socket]), self.cdn.serve(sockets=[self._cdn_socket])
        )

    def close(self) -> None:
        self._api_socket.close()
        self._cdn_socket.close()


class BackgroundSimulator:
    """The simulator (API and CDN) served by real uvicorn on a daemon thread, bound to free ports.

    ``start()`` returns once both servers report ``started``; then ``url`` is the API's base URL and
    ``cdn_url`` the CDN's. A context manager too.
    """

    def __init__(self, config: SimConfig | None = None, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self._servers = _Servers(config, host, port, None, "warning")
        self.app = self._servers.app
        self.url = self._servers.url
        self.cdn_url = self._servers.cdn_url
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._servers.serve()), name="vendor-simulator", daemon=True
        )

    def start(self, timeout: float = 10.0) -> BackgroundSimulator:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not (self._servers.api.started and self._servers.cdn.started):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"vendor simulator did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._servers.api.should_exit = True
        self._servers.cdn.should_exit = True
        self._thread.join(timeout=5)
        self._servers.close()

    def __enter__(self) -> BackgroundSimulator:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve the ledgerflow vendor simulator.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8700)
    parser.add_argument(
        "--cdn-port", type=int, default=None, help="the CDN's port (default: the API's + 1; 0: any free port)"
    )
    parser.add_argument("--config", type=Path, help="a SimConfig JSON file")
    parser.add_argument("--seed", type=int, help="overrides the config's seed")
    args = parser.parse_args(argv)
    config = SimConfig.model_validate_json(args.config.read_text()) if args.config else SimConfig()
    if args.seed is not None:
        config = config.model_copy(update={"seed": args.seed})
    servers = _Servers(config, args.host, args.port, args.cdn_port, "info")
    try:
        asyncio.run(servers.serve())
    finally:
        servers.close()
