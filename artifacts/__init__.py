"""Artifact storage: content-addressed, streamed, published atomically; on local disk or S3.

``open_store`` picks the backend from a path or URL; ``store_for_uri`` picks, among configured stores, the
one that can read a recorded URI. See ``artifacts.store`` for the protocol and its guarantees.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlparse

from artifacts.local import LocalStore, path_of
from artifacts.s3 import S3Store
from artifacts.store import (
    CHUNK_SIZE,
    ArtifactCorrupt,
    ArtifactError,
    ArtifactMissing,
    ArtifactStore,
    Staging,
    StoredArtifact,
)

__all__ = [
    "CHUNK_SIZE",
    "ArtifactCorrupt",
    "ArtifactError",
    "ArtifactMissing",
    "ArtifactStore",
    "LocalStore",
    "S3Store",
    "Staging",
    "StoredArtifact",
    "open_store",
    "store_for_uri",
]

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def open_store(url_or_path: str, *, staging_dir: Path | None = None) -> ArtifactStore:
    """The store a setting names: a path or ``file://`` URL → ``LocalStore``; ``s3://bucket/prefix`` → S3.

    An S3 store takes its endpoint and credentials from the environment, read now (see
    ``S3Store.from_env``).

    Args:
        url_or_path: ``/var/artifacts``, ``.ledgerflow/artifacts``, ``file:///var/artifacts`` or
            ``s3://bucket/prefix``.
        staging_dir: For S3, where uploads stage locally (the local store always stages under its root).

    Raises:
        ArtifactError: An unsupported scheme.
    """
    if not _URL.match(url_or_path):
        return LocalStore(Path(url_or_path))
    scheme = urlparse(url_or_path).scheme.lower()
    if scheme == "file":
        return LocalStore(path_of(url_or_path))
    if scheme == "s3":
        return S3Store.from_env(url_or_path, staging_dir=staging_dir)
    raise ArtifactError(f"unsupported artifact store {url_or_path!r}: expected a path, file:// or s3://")


def store_for_uri(uri: str, stores: Sequence[ArtifactStore]) -> ArtifactStore:
    """The first of ``stores`` that can read ``uri`` (by scheme, and for S3 by bucket).

    Raises:
        ArtifactError: None of them can.
    """
    for store in stores:
        if store.can_read(uri):
            return store
    configured = ", ".join(store.describe() for store in stores) or "none"
    raise ArtifactError(f"no configured artifact store can read {uri} (configured: {configured})")
