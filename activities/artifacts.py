"""Atomic artifact storage: temp file → verify hash → rename → (the caller) register in the ledger.

Content-addressed, so storing the same bytes twice is harmless and an interrupted upload leaves only a
temp file, which ``sweep_temp`` removes. Pluggable: anything with ``put`` and ``sweep_temp`` will do.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from ledgerflow.faults import mark


class ArtifactCorrupt(Exception):
    """The bytes did not hash to what the vendor promised."""


class LocalArtifactStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "tmp").mkdir(parents=True, exist_ok=True)

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
        fd, tmp = tempfile.mkstemp(dir=self.root / "tmp", prefix=digest[:12])
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            mark("artifact_staged", op=operation_key, tmp=Path(tmp).name)
            os.replace(tmp, final)  # atomic on one filesystem: readers see no file or the whole file
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return final.resolve().as_uri()

    def sweep_temp(self) -> int:
        """Delete temp files left by interrupted uploads; returns how many."""
        count = 0
        for leftover in (self.root / "tmp").iterdir():
            leftover.unlink(missing_ok=True)
            count += 1
        return count
