"""The local artifact store: atomic, content-addressed, whatever form its root is given in."""

from __future__ import annotations

import hashlib
from pathlib import Path
from urllib.parse import urlparse

import pytest

from activities.artifacts import ArtifactCorrupt, LocalArtifactStore


def test_a_relative_root_stores_and_returns_an_absolute_uri(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the default artifact_dir is relative: .ledgerflow/artifacts
    store = LocalArtifactStore(Path(".ledgerflow/artifacts"))
    data = b"a frame"
    uri = store.put(data, hashlib.sha256(data).hexdigest(), "t:a:a1")
    path = Path(urlparse(uri).path)
    assert path.is_absolute() and path.read_bytes() == data
    assert path.is_relative_to(tmp_path / ".ledgerflow" / "artifacts")
    assert list(store.staging.iterdir()) == [], "nothing left in staging"


def test_bytes_that_do_not_hash_to_the_promise_are_refused_and_nothing_is_stored(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path)
    with pytest.raises(ArtifactCorrupt, match="does not match"):
        store.put(b"a frame", "0" * 64)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
