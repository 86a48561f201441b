"""Atomic artifact storage: temp file → verify hash → rename → (the caller) register in the ledger.

Content-addressed, so storing the same bytes twice is harmless and an interrupted upload leaves only a
temp file, which ``sweep_temp`` removes. Each worker process stages under its own ``tmp/<host>-<pid>/``, so a
starting worker sweeps only what dead workers of its host left behind, never a live worker's upload.
Pluggable: anything with ``put`` and ``sweep_temp`` will do.
"""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
from pathlib import Path

from ledgerflow.faults import mark
from ledgerflow.pg import process_alive


class ArtifactCorrupt(Exception):
    """The bytes did not hash to what the vendor promised."""


class LocalArtifactStore:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()  # the default is relative (.ledgerflow/artifacts); temp files are absolute
        self._host = socket.gethostname()
        self.staging = self.root / "tmp" / f"{self._host}-{os.getpid()}"
        self.staging.mkdir(parents=True, exist_ok=True)

    def put(self, data: bytes, expected_sha256: str, operation_key: str = "") -> str:
        """Store ``data`` atomically under its hash and return its URI."""
        digest = hashlib.sha256(data).hexdigest()
        if digest != expected_sha256:
            raise ArtifactCorrupt(
                f"artifact hash {digest[:12]}… does not match the vendor's {expected_sha256[:12]}…"
            )
        final = self.root / digest[:2] / digest
        if final.exists():
            return final.resolve().as_uri()
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.staging, prefix=digest[:12])
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            mark("artifact_staged", op=operation_key, tmp=Path(tmp).relative_to(self.root / "tmp"))
            os.replace(tmp, final)  # atomic on one filesystem: readers see no file or the whole file
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return final.resolve().as_uri()

    def sweep_temp(self) -> int:
        """Delete the temp files of interrupted uploads (dead workers of this host); returns how many."""
        count = 0
        for staging in (self.root / "tmp").iterdir():
            host, _, pid = staging.name.rpartition("-")
            if staging == self.staging or host != self._host or not pid.isdigit() or process_alive(int(pid)):
                continue
            for leftover in staging.iterdir():
                leftover.unlink(missing_ok=True)
                count += 1
            staging.rmdir()
        return count
