"""Helpers of the metrics and alert tests: scrapes parsed into samples, a worker as a subprocess, an exporter
on a database of the test's own, and scrapes replayed as promtool input series."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from temporalio.client import Client

from ledger.recorder import Recorder
from ledgerflow.stack.pg import free_port
from runtime.metrics import MetricsServer, MetricsSettings, Routes, ScanReader, serve_metrics

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


@contextmanager
def fresh_ledger(pg_url: str) -> Iterator[str]:
    """A database of the test's own on the session's server, with the ledger's schema and nothing in it
    (the session's ledger holds every other test's tasks): its URL, dropped afterwards."""
    name = f"lf_metrics_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    url = sa.make_url(pg_url).set(database=name).render_as_string(hide_password=False)
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        rec = Recorder(url, pool_size=1)
        try:
            rec.create_schema()
        finally:
            rec.dispose()
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@contextmanager
def exporter(
    database_url: str,
    client: Client,
    *,
    routes: Routes | None = None,
    ledger: bool = True,
    scans: ScanReader | None = None,
) -> Iterator[MetricsServer]:
    """``serve_metrics`` on a free port (no SDK relay), as the worker serves it."""
    settings = MetricsSettings(metrics_port=free_port(), metrics_ledger=ledger)
    loop = asyncio.get_running_loop()
    with serve_metrics(settings, database_url, client, loop, sdk=False, routes=routes, scans=scans) as server:
        yield server


def promtool() -> str:
    """promtool's path. Missing, the test fails (never skips): ``make test`` installs Debian's prometheus."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: `apt-get install -y prometheus` (make test installs it)")
    return path


def series_text(name: str, labels: Labels) -> str:
    """A sample's name and labels as promtool's ``input_series`` writes them."""
    if not labels:
        return name

    def quoted(v: str) -> str:
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'

    escaped = ",".join(f"{k}={quoted(v)}" for k, v in labels)
    return f"{name}{{{escaped}}}"


def input_series(*phases: tuple[Scrape, int]) -> list[dict[str, str]]:
    """promtool ``input_series`` replaying real scrapes: each phase's scrape held for its number of steps, in
    order; a series a phase's scrape did not expose is missing (``_``) for those steps."""
    keys = sorted({key for scrape, _ in phases for key in scrape.samples})
    out = []
    for name, labels in keys:
        values = []
        for scrape, steps in phases:
            value = scrape.samples.get((name, labels))
            values.append(f"_x{steps}" if value is None else f"{value!r}x{steps}")
        out.append({"series": series_text(name, labels), "values": " ".join(values)})
    return out
