"""The ``local`` adapter: work that costs no vendor money, done by the worker itself.

Two bodies today, each a route an executor can name:

* ``code.validate`` — runs every Python example of the input lessons (``vendors/codecheck.py``: a subprocess
  each, with time and memory limits and no network). A broken example is a content failure carrying the real
  traceback; an example that runs out of time is a technical one.
* ``media.assemble`` — concatenates video shots and an audio track into one MP4 (``media.assemble``).

A call is synchronous and free: ``submit`` does the work and returns it finished, its output inline.
Redoing it after a crash costs nothing, so reconciliation simply runs it again (``Capabilities.free``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from artifacts.store import ArtifactError, ArtifactStore
from media import MediaInvalid, assemble
from rules.inputs import refs
from vendors.adapter import (
    Capabilities,
    JobError,
    JobErrorKind,
    JobStatus,
    MediaInfo,
    ResultFile,
    Sent,
    VendorCharge,
    VendorJob,
)
from vendors.codecheck import check_markdown
from vendors.errors import VendorNotFound, VendorRejected
from vendors.routes import RouteSpec
from vendors.sandbox import SandboxUnavailable

if TYPE_CHECKING:
    from vendors.plugins import AdapterContext

Body = Callable[[dict[str, Any]], Awaitable[VendorJob]]
# Work the worker does itself is ours: its outputs carry our own rights metadata (the review checks
# every artifact for a licence and a holder).
OWN_RIGHTS = {"license": "own-work", "holder": "ledgerflow/local"}


def _done(data: bytes, fmt: str) -> VendorJob:
    job_id = "local-" + hashlib.sha256(data).hexdigest()[:16]
    result = ResultFile(url="inline:", media=MediaInfo(format=fmt, rights=OWN_RIGHTS))
    return VendorJob(
        id=job_id, status=JobStatus.SUCCEEDED, progress=1.0, cost="0", inline=data, result=result
    )


class LocalAdapter:
    """Runs a local body for an executor; reads its inputs from the artifact store."""

    @classmethod
    def build(cls, context: AdapterContext) -> LocalAdapter:
        """The plugin factory (``vendors.plugins``): no URL, no credential, only the artifact stores."""
        return cls(context.route, context.store_for)

    def __init__(self, route: RouteSpec, store_for: Callable[[str], ArtifactStore]) -> None:
        self.route = route
        self._store_for = store_for
        self._bodies: dict[str, Body] = {
            "code.validate": self._validate_code,
            "media.assemble": self._assemble,
        }

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            can_lookup=False,
            can_cancel=False,
            synchronous=True,
            has_billing=False,
            free=True,
            can_list_charges=True,
        )

    async def submit(
        self,
        *,
        operation_key: str,
        executor: str,
        request: dict[str, Any],
        estimate: Decimal,
        files: dict[str, str] | None = None,
    ) -> VendorJob:
        body = self._bodies.get(executor)
        if body is None:
            raise VendorRejected(f"no local body for executor {executor!r}")
        return await body(request)

    async def get(self, job_id: str) -> VendorJob:
        raise VendorNotFound(f"{job_id}: local work keeps no jobs")

    async def find_by_key(
        self, operation_key: str, *, since: datetime | None = None, sent: Sent | None = None
    ) -> list[VendorJob]:
        return []

    async def cancel(self, job_id: str) -> VendorJob:
        raise VendorNotFound(f"{job_id}: local work keeps no jobs")

    async def download(self, job: VendorJob, sink: Callable[[bytes], Awaitable[None] | None]) -> None:
        raise VendorNotFound(f"{job.id}: local work delivers its output inline")

    async def charged(self, operation_key: str, job_id: str | None) -> str | None:
        return "0"

    async def charges(self, since: datetime) -> list[VendorCharge]:
        return []  # no vendor, no bill

    async def aclose(self) -> None:
        return None

    # ── inputs ────────────────────────────────────────────────────────────────────────────────────────
    @contextlib.contextmanager
    def _local(self, ref: dict[str, Any]) -> Iterator[Path]:
        store = self._store_for(ref["uri"])
        with store.local_copy(ref["uri"]) as path:
            yield path

    def _read_text(self, ref: dict[str, Any]) -> str:
        with self._local(ref) as path:
            data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != ref["sha256"]:
            raise ArtifactError(f"input {ref['sha256'][:12]}… does not match its recorded sha256")
        return data.decode("utf-8", errors="replace")

    # ── bodies ────────────────────────────────────────────────────────────────────────────────────────
    async def _validate_code(self, request: dict[str, Any]) -> VendorJob:
        inputs = refs(request.get("inputs"))
        if not inputs:
            raise VendorRejected("code.validate needs an input lesson (inputs: {draft: …})")
        texts = [await asyncio.to_thread(self._read_text, r) for r in inputs]
        timeout = float(request.get("timeout_seconds") or 10)
        memory = int(request.get("memory_mb") or 256)
        try:
            report = await check_markdown("\n\n".join(texts), timeout_s=timeout, memory_mb=memory)
        except SandboxUnavailable as e:
            # The deployment lacks its sandbox (docs/sandbox.md): nothing ran. The node fails with the one
            # line naming what is missing; after its retries a person reads it (a dead letter).
            error = JobError(kind=JobErrorKind.TECHNICAL, message=str(e))
            failed = JobStatus.FAILED
            return VendorJob(id="local-no-sandbox", status=failed, progress=1.0, cost="0", error=error)
        data = json.dumps(report.to_json(), sort_keys=True).encode()
        job_id = "local-" + hashlib.sha256(data).hexdigest()[:16]
        if report.ok:
            return _done(data, "json")
        first = report.failures[0]
        # Every failure of an example is the example's: one that sleeps forever is refused like one that reads
        # secrets or forks without end (the sandbox's limits made each a failure), never retried unchanged.
        kind = JobErrorKind.CONTENT_REJECTED
        message = f"example {first.index + 1} (line {first.line}) {first.kind}: {first.message}"
        error = JobError(kind=kind, message=message)
        return VendorJob(id=job_id, status=JobStatus.FAILED, progress=1.0, cost="0", error=error)

    async def _assemble(self, request: dict[str, Any]) -> VendorJob:
        shots = refs(request.get("shots"))
        audio = refs(request.get("audio"))
        if not shots:
            raise VendorRejected("media.assemble needs shots")
        return await asyncio.to_thread(self._assemble_files, shots, audio[0] if audio else None, request)

    def _assemble_files(
        self, shots: list[dict[str, Any]], audio: dict[str, Any] | None, request: dict[str, Any]
    ) -> VendorJob:
        with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="lf-assemble-") as tmp:
            shot_paths = [stack.enter_context(self._local(r)) for r in shots]
            audio_path = stack.enter_context(self._local(audio)) if audio is not None else None
            out = Path(tmp) / "episode.mp4"
            lineage = {"shots": [r["sha256"] for r in shots], "audio": audio["sha256"] if audio else None}
            try:
                assemble(shot_paths, audio_path, out, lineage=lineage)
            except (MediaInvalid, ValueError) as e:
                error = JobError(kind=JobErrorKind.TECHNICAL, message=f"assembly failed: {e}")
                return VendorJob(id="local-assemble", status=JobStatus.FAILED, cost="0", error=error)
            data = out.read_bytes()
        return _done(data, "mp4")
