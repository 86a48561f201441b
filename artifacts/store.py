"""The artifact store protocol and what every backend shares: staging, hashing, publishing, sweeping.

An artifact is stored under its content address (its sha256), so storing the same bytes twice is harmless,
two workers uploading the same bytes at once cannot conflict, and a URI never changes meaning. Bytes are
never held whole in memory: they stream into a staging file (hashed and sized while they are written),
which is fsynced, checked against the hash the vendor promised, and only then placed under its address in
one atomic step (a rename for the local store, a single PUT or multipart upload for S3). A crash at any
point leaves either nothing or a whole object under the address, plus at most a staging file, which
``sweep_temp`` removes once its worker is dead.

Every method is synchronous (blocking file and network I/O): async callers wrap them in
``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol, runtime_checkable

from runtime.faults import mark
from runtime.process import process_alive

CHUNK_SIZE = 1024 * 1024
"""The unit of streaming: reads, copies and ``open_read`` chunks are at most this big."""

_SHA256 = re.compile(r"[0-9a-f]{64}")


class ArtifactError(Exception):
    """Something is wrong with an artifact or with where it is stored."""


class ArtifactCorrupt(ArtifactError):
    """The bytes did not hash to what was promised."""


class ArtifactMissing(ArtifactError):
    """No object is stored at the URI."""


@dataclass(frozen=True)
class StoredArtifact:
    """A published artifact: where it is and what it is.

    Attributes:
        uri: ``file:///abs/path`` or ``s3://bucket/key``; safe to record anywhere (it is no credential).
        sha256: The hex sha256 of the bytes, which is also their address.
        size: The number of bytes.
    """

    uri: str
    sha256: str
    size: int


def check_sha256(sha256: str) -> str:
    """Return ``sha256`` if it is 64 lowercase hex digits, else raise ``ValueError``.

    A content address becomes part of a path or key, so anything else (``..``, ``/``) must never reach one.
    """
    if not _SHA256.fullmatch(sha256):
        raise ValueError(f"not a sha256 hex digest: {sha256!r}")
    return sha256


def content_path(sha256: str) -> str:
    """The address of ``sha256`` relative to a store's root: ``<sha[:2]>/<sha>``.

    The two-character fan-out keeps any one directory (or S3 listing page) from growing without bound.
    """
    return f"{sha256[:2]}/{check_sha256(sha256)}"


def sha256_of(chunks: Iterable[bytes | memoryview]) -> tuple[str, int]:
    """Hash a stream of chunks; returns ``(hex sha256, size)`` without keeping more than one chunk."""
    digest = hashlib.sha256()
    size = 0
    for chunk in chunks:
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def read_chunks(f: IO[bytes], chunk_size: int = CHUNK_SIZE) -> Iterator[bytes]:
    """Yield ``f``'s remaining bytes in chunks of at most ``chunk_size``."""
    while chunk := f.read(chunk_size):
        yield chunk


def rechunk(chunks: Iterable[bytes], chunk_size: int = CHUNK_SIZE) -> Iterator[bytes]:
    """Split any chunk bigger than ``chunk_size`` (a network stream's chunks may be) into pieces that fit."""
    for chunk in chunks:
        if len(chunk) <= chunk_size:
            yield chunk
            continue
        view = memoryview(chunk)
        for start in range(0, len(view), chunk_size):
            yield bytes(view[start : start + chunk_size])


def _slug(operation_key: str) -> str:
    """A file-name-safe, short form of an operation key, to tell staging files apart when debugging."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", operation_key)[-48:]


class Staging:
    """A temp file that bytes stream into, hashed and sized as they are written.

    Obtained from ``ArtifactStore.staging()``; consumed by ``ArtifactStore.publish()``, which removes or
    moves the file whatever happens; leaving the ``with`` block without publishing removes it too.

    Attributes:
        path: The temp file. Read it, or hand it to a tool that needs a file, but write only through
            ``write``: bytes written behind its back are not in the running hash, and ``publish`` refuses
            the file (for a file a tool wrote elsewhere, use ``put_file``).
        operation_key: The operation the bytes belong to (for the crash-test mark and the file name).
    """

    def __init__(self, area: StagingArea, operation_key: str = "") -> None:
        self.operation_key = operation_key
        self._area = area
        fd, name = tempfile.mkstemp(dir=area.directory(), prefix=f"up-{_slug(operation_key)}-")
        self.path = Path(name)
        # Unbuffered: every write lands in the file at once, so the file's size always equals ``size``
        # (nothing waits in a Python buffer) and a crash loses at most the write in progress.
        self._file: IO[bytes] | None = os.fdopen(fd, "wb", buffering=0)
        self._digest = hashlib.sha256()
        self._size = 0

    @property
    def sha256(self) -> str:
        """The hex sha256 of the bytes written so far."""
        return self._digest.hexdigest()

    @property
    def size(self) -> int:
        """The number of bytes written so far."""
        return self._size

    @property
    def relative_path(self) -> Path:
        """The temp file relative to the staging root (``<host>-<pid>/<name>``), as crash tests see it."""
        return self.path.relative_to(self._area.root)

    def write(self, chunk: bytes | bytearray | memoryview) -> None:
        """Append ``chunk`` to the temp file and to the running hash and size."""
        if self._file is None:
            raise ArtifactError(f"staging file {self.path.name} is already sealed")
        view = memoryview(chunk).cast("B")
        written = 0
        while written < len(view):  # a raw write may be partial
            written += self._file.write(view[written:]) or 0
        self._digest.update(view)
        self._size += len(view)

    def seal(self) -> None:
        """Flush the bytes to disk and close the file; no more writes.

        The fsync comes before the bytes are placed under their address: a crash after placing must not
        leave an address whose file the kernel never wrote (a rename can reach the disk before the data).
        """
        if self._file is None:
            return
        try:
            os.fsync(self._file.fileno())
            on_disk = os.fstat(self._file.fileno()).st_size
        finally:
            self._file.close()
            self._file = None
        if on_disk != self._size:
            raise ArtifactError(
                f"staging file {self.path.name} holds {on_disk} bytes but {self._size} were written through"
                " Staging.write: write only through it, or use put_file"
            )

    def discard(self) -> None:
        """Close and remove the temp file if it is still there (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self.path.unlink(missing_ok=True)


class StagingArea:
    """Per-worker staging directories ``<root>/<host>-<pid>/``, and the sweep of dead workers' leftovers.

    Each worker process stages under its own directory, so a starting worker sweeps only what dead workers
    of its host left behind, never a live worker's upload in progress.
    """

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self._host = socket.gethostname()
        self.directory()

    def directory(self) -> Path:
        """This process's staging directory, created if needed.

        Named by the current pid (not the pid at construction), so a forked child never stages in its
        parent's directory, which the sweep would treat as dead once the parent exits.
        """
        path = self.root / f"{self._host}-{os.getpid()}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    @contextmanager
    def temp_file(self, prefix: str) -> Iterator[Path]:
        """An empty temp file in this process's staging directory, removed on exit."""
        fd, name = tempfile.mkstemp(dir=self.directory(), prefix=prefix)
        os.close(fd)
        try:
            yield Path(name)
        finally:
            Path(name).unlink(missing_ok=True)

    def sweep(self) -> int:
        """Delete the staging files of dead workers of this host; returns how many files."""
        count = 0
        mine = f"{self._host}-{os.getpid()}"
        for staging in self.root.iterdir() if self.root.is_dir() else ():
            host, _, pid = staging.name.rpartition("-")
            if (
                staging.name == mine
                or not staging.is_dir()
                or host != self._host  # another host's pids mean nothing here (a shared volume)
                or not pid.isdigit()
                or process_alive(int(pid))
            ):
                continue
            for leftover in staging.iterdir():
                if leftover.is_file() or leftover.is_symlink():
                    leftover.unlink(missing_ok=True)
                    count += 1
            # Something other than a file in it: leave the directory, it costs nothing.
            with contextlib.suppress(OSError):
                staging.rmdir()
        return count


@runtime_checkable
class ArtifactStore(Protocol):
    """Where artifacts live: content-addressed, written atomically, read as streams.

    All methods block (file or network I/O): call them from async code through ``asyncio.to_thread``.
    """

    scheme: str
    """The URI scheme of the store's URIs: ``"file"`` or ``"s3"``."""

    def staging(self, operation_key: str = "") -> AbstractContextManager[Staging]:
        """A temp file to stream an artifact into; removed on exit unless published."""
        ...

    def publish(
        self, staging: Staging, expected_sha256: str | None = None, *, operation_key: str = ""
    ) -> StoredArtifact:
        """Check the staged bytes against ``expected_sha256`` and place them atomically under their hash.

        Raises:
            ArtifactCorrupt: The bytes do not hash to ``expected_sha256``; nothing is published and the
                staging file is removed.
        """
        ...

    def put_bytes(
        self, data: bytes, expected_sha256: str | None = None, *, operation_key: str = ""
    ) -> StoredArtifact:
        """Store a small artifact already in memory (through a staging file)."""
        ...

    def put_file(
        self, path: Path, expected_sha256: str | None = None, *, operation_key: str = ""
    ) -> StoredArtifact:
        """Store an existing local file, copying it in chunks into staging."""
        ...

    def find(self, sha256: str) -> str | None:
        """The URI of the object with this content address, or None if there is none."""
        ...

    def verify(self, uri: str, sha256: str) -> bool:
        """Whether the object at ``uri`` exists and still hashes to ``sha256`` (re-read as a stream)."""
        ...

    def delete(self, uri: str) -> bool:
        """Delete the object at ``uri`` (retention); False if there was none."""
        ...

    def open_read(self, uri: str) -> Iterator[bytes]:
        """The object's bytes, in chunks of at most ``CHUNK_SIZE``.

        Raises:
            ArtifactMissing: No object at ``uri`` (raised by the call itself, before iterating).
        """
        ...

    def local_copy(self, uri: str) -> AbstractContextManager[Path]:
        """A local file holding the object's bytes, for tools that need a path (PyAV); read it only."""
        ...

    def fetch_url(self, uri: str, expires_seconds: int = 3600) -> str:
        """A URL a vendor can fetch the object from: a presigned GET URL for S3, the ``file://`` URI locally.

        WARNING: A presigned URL IS A CREDENTIAL (anyone holding it can read the object until it expires).
        Never put one in a workflow argument or result, a heartbeat, an error, a log line or a ledger event:
        create it inside the activity, just before the vendor call, and record the artifact's URI instead.
        """
        ...

    def sweep_temp(self) -> int:
        """Remove the staging files of interrupted uploads of dead workers of this host; returns how many."""
        ...

    def describe(self) -> str:
        """A one-line, credential-free description, e.g. ``local /abs/root``."""
        ...

    def can_read(self, uri: str) -> bool:
        """Whether ``uri`` belongs to this store (its scheme, and for S3 its bucket)."""
        ...


class StagedStore:
    """What every backend shares: staging, the checks before publishing, and the convenience writers.

    A backend sets ``scheme`` and ``_area`` and implements ``_place``, the one atomic final step.
    """

    scheme: str
    _area: StagingArea

    def _place(self, staging: Staging) -> StoredArtifact:
        """Put the sealed, checked staging file under its content address; the backend's atomic step."""
        raise NotImplementedError

    def open_read(self, uri: str) -> Iterator[bytes]:
        """The object's bytes, in chunks of at most ``CHUNK_SIZE`` (ArtifactMissing if there is none)."""
        raise NotImplementedError

    def verify(self, uri: str, sha256: str) -> bool:
        """Whether the object at ``uri`` exists and still hashes to ``sha256`` (re-read as a stream)."""
        try:
            digest, _ = sha256_of(self.open_read(uri))
        except ArtifactMissing:
            return False
        return digest == sha256.lower()

    @contextmanager
    def staging(self, operation_key: str = "") -> Iterator[Staging]:
        """A temp file to stream an artifact into; removed on exit unless published.

        Args:
            operation_key: The operation the artifact belongs to (shown in the crash-test mark).

        Yields:
            A ``Staging``: ``write`` chunks into it, then ``publish`` it.
        """
        staging = Staging(self._area, operation_key)
        try:
            yield staging
        finally:
            staging.discard()

    def publish(
        self, staging: Staging, expected_sha256: str | None = None, *, operation_key: str = ""
    ) -> StoredArtifact:
        """Seal the staging file, check its hash, and place it atomically under its content address.

        The staging file is consumed whatever happens: moved into place, or removed.

        Args:
            staging: From ``staging()``, with every byte written through ``Staging.write``.
            expected_sha256: The hash the producer (the vendor) promised; None skips the check.
            operation_key: Shown in the crash-test mark; defaults to the staging's own.

        Returns:
            Where the artifact is, its hash and size.

        Raises:
            ArtifactCorrupt: The bytes do not hash to ``expected_sha256``; nothing was published.
        """
        try:
            staging.seal()
            digest = staging.sha256
            if expected_sha256 is not None and digest != expected_sha256.lower():
                raise ArtifactCorrupt(
                    f"artifact hash {digest[:12]}… does not match the expected {expected_sha256[:12]}…"
                )
            # Crash tests hold or kill the worker here: the bytes are staged and fsynced, not yet placed.
            mark("artifact_staged", op=operation_key or staging.operation_key, tmp=staging.relative_path)
            return self._place(staging)
        finally:
            staging.discard()

    def put_bytes(
        self, data: bytes, expected_sha256: str | None = None, *, operation_key: str = ""
    ) -> StoredArtifact:
        """Store a small artifact already in memory (through a staging file, like any other).

        Args:
            data: The bytes.
            expected_sha256: The promised hash, checked before publishing; None skips the check.
            operation_key: The operation the artifact belongs to.

        Returns:
            Where the artifact is, its hash and size.
        """
        with self.staging(operation_key) as staging:
            staging.write(data)
            return self.publish(staging, expected_sha256, operation_key=operation_key)

    def put_file(
        self, path: Path, expected_sha256: str | None = None, *, operation_key: str = ""
    ) -> StoredArtifact:
        """Store an existing local file, copied chunk by chunk into staging (``path`` is left as it is).

        A copy, not a move: ``path`` may be on another filesystem, and it may still be in use.

        Args:
            path: The file.
            expected_sha256: The promised hash, checked before publishing; None skips the check.
            operation_key: The operation the artifact belongs to.

        Returns:
            Where the artifact is, its hash and size.
        """
        buffer = bytearray(CHUNK_SIZE)  # one reused buffer: the copy allocates nothing per chunk
        view = memoryview(buffer)
        with self.staging(operation_key) as staging, path.open("rb", buffering=0) as source:
            while n := source.readinto(buffer):
                staging.write(view[:n])
            return self.publish(staging, expected_sha256, operation_key=operation_key)

    def sweep_temp(self) -> int:
        """Remove the staging files of interrupted uploads of dead workers of this host; returns how many.

        Safe at any time: a staging file is never registered anywhere, and a live worker's is never touched.
        """
        return self._area.sweep()
