"""Helpers of the metrics tests: free ports, scrapes parsed into samples, a worker as a subprocess."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Scrape:
    """One /metrics body: every sample's value, and every metric name the text exposes."""

    samples: dict[tuple[str, Labels], float]
    names: frozenset[str]

    @classmethod
    def parse(cls, body: str) -> Scrape:
        samples: dict[tuple[str, Labels], float] = {}
        for family in text_string_to_metric_families(body):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return cls(samples, exposed_names(body))

    def series(self, name: str, **match: str) -> dict[Labels, float]:
        """The samples of ``name`` whose labels include ``match``, keyed by their other labels."""
        out = {}
        for (n, labels), value in self.samples.items():
            if n == name and all((k, v) in labels for k, v in match.items()):
                out[tuple((k, v) for k, v in labels if k not in match)] = value
        return out

    def value(self, name: str, **labels: str) -> float:
        return self.samples[(name, tuple(sorted(labels.items())))]


def exposed_names(body: str) -> frozenset[str]:
    """The names a Prometheus server would store from this text, read from the text itself (the parser
    renames counters): every sample's, and every declared family's with its type's series (a family may
    have no sample yet, e.g. no operation open right now)."""
    names = set()
    suffixes = {"summary": ("", "_sum", "_count"), "histogram": ("_bucket", "_sum", "_count")}
    for line in body.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.update(name + suffix for suffix in suffixes.get(kind, ("",)))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return frozenset(names)


async def scrape(base: str) -> Scrape:
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.get(f"{base}/metrics")
        r.raise_for_status()
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        return Scrape.parse(r.text)


@asynccontextmanager
async def worker_process(env: dict[str, str], log: Path, base: str) -> AsyncIterator[subprocess.Popen[bytes]]:
    """``python worker.py`` with ``env``, once its /healthz says ready; stopped with SIGTERM afterwards."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "worker.py")],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 30
        async with httpx.AsyncClient(timeout=5) as http:
            while True:
                assert proc.poll() is None, f"the worker exited: {log.read_text()[-2000:]}"
                try:
                    if (await http.get(f"{base}/healthz")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, f"the worker never got ready: {log.read_text()[-2000:]}"
                await asyncio.sleep(0.1)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
