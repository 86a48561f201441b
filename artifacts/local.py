"""The local filesystem store: ``<root>/<sha[:2]>/<sha>``, staged under ``<root>/tmp/<host>-<pid>/``.

Staging lives under the root on purpose: the final step is an ``os.replace`` from the staging file to the
content address, which is atomic only within one filesystem (readers see no file or the whole file, never a
partial one).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from artifacts.store import (
    ArtifactError,
    ArtifactMissing,
    StagedStore,
    Staging,
    StagingArea,
    StoredArtifact,
    content_path,
    read_chunks,
)


def path_of(uri: str) -> Path:
    """The local path of a ``file://`` URI (percent-decoded, as ``Path.as_uri`` encodes it)."""
    parsed = urlparse(uri)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise ArtifactError(f"not a local file URI: {uri}")
    return Path(url2pathname(parsed.path))


def _existing(uri: str) -> Path:
    """The file of a stored artifact (ArtifactMissing if there is none)."""
    path = path_of(uri)
    if not path.is_file():
        raise ArtifactMissing(f"no artifact at {uri}")
    return path


def _fsync_dir(path: Path) -> None:
    """Flush a directory's entries, so a rename into it survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(StagedStore):
    """Artifacts as files under a root directory, addressed by their sha256.

    Reads accept any ``file://`` URI (an artifact recorded under an earlier root stays readable); writes go
    under ``root``.
    """

    scheme = "file"

    def __init__(self, root: Path) -> None:
        """Open (and create) a store rooted at ``root``.

        Args:
            root: The store's directory; a relative path is resolved now, so URIs are always absolute.
        """
        self.root = root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self._area = StagingArea(self.root / "tmp")

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _place(self, staging: Staging) -> StoredArtifact:
        """Rename the staging file onto its content address, then make the rename durable."""
        final = self.root / content_path(staging.sha256)
        final.parent.mkdir(exist_ok=True)
        # Atomic on one filesystem: readers see no file or the whole file. Same bytes already there (a retry,
        # or another worker storing the same artifact): replacing them is harmless, and heals a damaged copy.
        os.replace(staging.path, final)
        # The caller records the URI in the ledger next: the directory entry must be on disk before that.
        _fsync_dir(final.parent)
        return StoredArtifact(final.as_uri(), staging.sha256, staging.size)

    def find(self, sha256: str) -> str | None:
        """The URI of the object with this content address, or None if there is none."""
        final = self.root / content_path(sha256)
        return final.as_uri() if final.is_file() else None

    def delete(self, uri: str) -> bool:
        """Delete the file at ``uri`` (retention); False if there was none."""
        try:
            path_of(uri).unlink()
        except FileNotFoundError:
            return False
        return True

    def open_read(self, uri: str) -> Iterator[bytes]:
        """The file's bytes, in chunks of at most 1 MiB.

        Raises:
            ArtifactMissing: No file at ``uri`` (raised by the call, before iterating).
        """
        return self._chunks(_existing(uri), uri)

    @staticmethod
    def _chunks(path: Path, uri: str) -> Iterator[bytes]:
        # Opened lazily, inside the generator: an iterator dropped unread then leaks no file handle.
        try:
            f = path.open("rb")
        except FileNotFoundError:
            raise ArtifactMissing(f"no artifact at {uri}") from None
        with f:
            yield from read_chunks(f)

    @contextmanager
    def local_copy(self, uri: str) -> Iterator[Path]:
        """The artifact's own file (no copy): read it, never write it; it is the stored object.

        Raises:
            ArtifactMissing: No file at ``uri``.
        """
        yield _existing(uri)

    def fetch_url(self, uri: str, expires_seconds: int = 3600) -> str:
        """The ``file://`` URI itself: only a vendor running on this machine can fetch a local artifact.

        Args:
            uri: The artifact's URI.
            expires_seconds: Ignored (a file URI does not expire); kept for the protocol.

        Returns:
            ``uri``, unchanged.
        """
        path_of(uri)  # refuse anything that is not a file URI
        return uri

    def describe(self) -> str:
        """``local /abs/root``."""
        return f"local {self.root}"

    def can_read(self, uri: str) -> bool:
        """Whether ``uri`` is a local file URI (any path: artifacts of an earlier root stay readable)."""
        try:
            path_of(uri)
        except ArtifactError:
            return False
        return True
