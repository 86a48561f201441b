"""The artifact store contract, written once and run against every backend (local disk, S3 via moto).

``StoreContract`` holds the assertions; each ``Test…Store`` subclass only provides a ``store`` and a
``backdoor`` (direct access to the backend's storage, to count, damage or delete objects behind the store's
back). Backend-specific behaviour (relative roots, presigned URLs) lives in the subclasses.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlparse

import httpx
import obstore
import pytest
from obstore.store import S3Store as ObstoreS3

from artifacts import (
    CHUNK_SIZE,
    ArtifactCorrupt,
    ArtifactError,
    ArtifactMissing,
    ArtifactStore,
    LocalStore,
    S3Store,
    StoredArtifact,
    open_store,
    store_for_uri,
)
from artifacts.local import path_of
from artifacts.s3 import split_s3_uri

if TYPE_CHECKING:  # conftest is pytest's to import; importing it again would load it twice
    from s3kit import S3Endpoint

MiB = 1024 * 1024


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_all(store: ArtifactStore, uri: str) -> bytes:
    return b"".join(store.open_read(uri))


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


class Backdoor(Protocol):
    """Direct access to a backend's storage, bypassing the store under test."""

    def objects(self) -> list[str]:
        """The URIs of every published object of the store (staging excluded)."""
        ...

    def corrupt(self, uri: str) -> None:
        """Replace the object's bytes with others."""
        ...

    def remove(self, uri: str) -> None:
        """Delete the object."""
        ...


class StoreContract:
    """Every backend must pass these. Subclasses provide the ``store`` and ``backdoor`` fixtures."""

    @pytest.fixture
    def store(self) -> ArtifactStore:
        raise NotImplementedError

    @pytest.fixture
    def backdoor(self) -> Backdoor:
        raise NotImplementedError

    def test_is_an_artifact_store(self, store: ArtifactStore) -> None:
        assert isinstance(store, ArtifactStore)
        assert store.scheme in ("file", "s3")

    def test_round_trip(self, store: ArtifactStore, backdoor: Backdoor) -> None:
        data = b"a frame" * 1000
        art = store.put_bytes(data, sha(data), operation_key="t:a:a1")
        assert art == StoredArtifact(art.uri, sha(data), len(data))
        assert urlparse(art.uri).scheme == store.scheme
        assert read_all(store, art.uri) == data
        assert store.verify(art.uri, sha(data))
        assert store.find(sha(data)) == art.uri
        assert store.can_read(art.uri)
        assert backdoor.objects() == [art.uri]

    def test_an_empty_artifact_is_an_artifact(self, store: ArtifactStore) -> None:
        art = store.put_bytes(b"", sha(b""))
        assert (art.size, read_all(store, art.uri)) == (0, b"")
        assert store.verify(art.uri, sha(b""))

    def test_same_bytes_same_uri_one_object(
        self, store: ArtifactStore, backdoor: Backdoor, tmp_path: Path
    ) -> None:
        data = os.urandom(3000)
        source = tmp_path / "render.bin"
        source.write_bytes(data)
        first = store.put_bytes(data)
        again = store.put_file(source, sha(data), operation_key="retry")
        assert first == again
        assert backdoor.objects() == [first.uri]
        assert source.read_bytes() == data, "put_file copies; the source is left as it was"

    def test_concurrent_identical_publishes_agree(self, store: ArtifactStore, backdoor: Backdoor) -> None:
        data = os.urandom(64 * 1024)
        with ThreadPoolExecutor(4) as pool:
            stored = list(
                pool.map(lambda i: store.put_bytes(data, sha(data), operation_key=f"w{i}"), range(4))
            )
        assert {a.uri for a in stored} == {stored[0].uri}
        assert backdoor.objects() == [stored[0].uri]
        assert store.verify(stored[0].uri, sha(data))

    def test_a_hash_mismatch_publishes_nothing_and_leaves_no_staging_file(
        self, store: ArtifactStore, backdoor: Backdoor
    ) -> None:
        data = b"not what the vendor promised"
        promised = "0123456789ab" + "0" * 52
        with store.staging("t:a:a1") as staging:
            staging.write(data)
            staging_dir = staging.path.parent
            with pytest.raises(ArtifactCorrupt) as raised:
                store.publish(staging, promised, operation_key="t:a:a1")
            assert not staging.path.exists(), "a refused staging file is removed at once"
        message = str(raised.value)
        assert "\n" not in message and sha(data)[:12] in message and promised[:12] in message
        assert backdoor.objects() == []
        assert store.find(sha(data)) is None
        assert list(staging_dir.iterdir()) == []

    def test_put_file_refuses_a_mismatch_too(
        self, store: ArtifactStore, backdoor: Backdoor, tmp_path: Path
    ) -> None:
        source = tmp_path / "render.bin"
        source.write_bytes(b"frames")
        with pytest.raises(ArtifactCorrupt, match="does not match"):
            store.put_file(source, "f" * 64)
        assert backdoor.objects() == []

    def test_twenty_mib_stream_through_staging_one_chunk_at_a_time(self, store: ArtifactStore) -> None:
        expected = hashlib.sha256()
        with store.staging("big") as staging:
            for i in range(20):
                chunk = os.urandom(MiB)
                staging.write(chunk)
                expected.update(chunk)
                # Written through at once (no buffer accumulating the artifact), hashed and sized as it goes.
                assert staging.path.stat().st_size == staging.size == (i + 1) * MiB
                assert staging.sha256 == expected.hexdigest()
            art = store.publish(staging, expected.hexdigest(), operation_key="big")
        assert (art.sha256, art.size) == (expected.hexdigest(), 20 * MiB)
        sizes = []
        read_back = hashlib.sha256()
        for chunk in store.open_read(art.uri):
            sizes.append(len(chunk))
            read_back.update(chunk)
        assert max(sizes) <= CHUNK_SIZE and sum(sizes) == 20 * MiB
        assert read_back.hexdigest() == art.sha256
        assert store.verify(art.uri, art.sha256)

    def test_verify_is_false_once_the_object_is_corrupted(
        self, store: ArtifactStore, backdoor: Backdoor
    ) -> None:
        data = os.urandom(5000)
        art = store.put_bytes(data, sha(data))
        backdoor.corrupt(art.uri)
        assert not store.verify(art.uri, sha(data))
        assert store.verify(art.uri, sha(read_all(store, art.uri))), "it hashes to whatever is there now"

    def test_a_removed_object_is_missing_everywhere(self, store: ArtifactStore, backdoor: Backdoor) -> None:
        data = os.urandom(5000)
        art = store.put_bytes(data, sha(data))
        backdoor.remove(art.uri)
        assert not store.verify(art.uri, sha(data))
        assert store.find(sha(data)) is None
        with pytest.raises(ArtifactMissing):
            store.open_read(art.uri)  # raised by the call, not on the first iteration
        with pytest.raises(ArtifactMissing), store.local_copy(art.uri):
            pass

    def test_republishing_heals_a_corrupted_object(self, store: ArtifactStore, backdoor: Backdoor) -> None:
        data = os.urandom(5000)
        art = store.put_bytes(data)
        backdoor.corrupt(art.uri)
        assert store.put_bytes(data, sha(data)) == art
        assert store.verify(art.uri, sha(data))

    def test_local_copy_is_a_readable_file_with_the_bytes(self, store: ArtifactStore) -> None:
        data = os.urandom(3 * MiB + 17)
        art = store.put_bytes(data, sha(data))
        with store.local_copy(art.uri) as path:
            assert path.is_file() and sha(path.read_bytes()) == art.sha256
        # The local store hands out the object itself; a downloaded copy is temporary.
        assert path.exists() == (store.scheme == "file")

    def test_find_only_finds_what_is_stored(self, store: ArtifactStore) -> None:
        assert store.find(sha(b"never stored")) is None
        with pytest.raises(ValueError):
            store.find("../../etc/passwd")

    def test_leaving_staging_unpublished_removes_the_file(
        self, store: ArtifactStore, backdoor: Backdoor
    ) -> None:
        with store.staging("abandoned") as staging:
            staging.write(b"half")
        assert not staging.path.exists()
        with pytest.raises(RuntimeError), store.staging("failed") as staging:
            staging.write(b"half")
            raise RuntimeError("the download broke")
        assert not staging.path.exists()
        assert backdoor.objects() == []

    def test_bytes_written_behind_the_staging_are_refused(
        self, store: ArtifactStore, backdoor: Backdoor
    ) -> None:
        with store.staging() as staging:
            staging.write(b"counted")
            with staging.path.open("ab") as f:
                f.write(b" and not counted")
            with pytest.raises(ArtifactError, match=r"Staging\.write"):
                store.publish(staging)
        assert backdoor.objects() == []

    def test_the_crash_test_mark_names_the_staged_file(
        self, store: ArtifactStore, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        monkeypatch.setenv("LEDGERFLOW_MARKS", "1")
        store.put_bytes(b"a frame", operation_key="t:a:a1")
        line = next(
            ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("MARK artifact_staged")
        )
        assert line.startswith(f"MARK artifact_staged op=t:a:a1 tmp={socket.gethostname()}-{os.getpid()}/")

    def test_sweep_removes_only_dead_workers_leftovers(self, store: ArtifactStore) -> None:
        with store.staging("in-flight") as live:
            live.write(b"a live upload")
            root = live.path.parent.parent  # <staging root>/<host>-<pid>/<file>
            host = socket.gethostname()
            dead = root / f"{host}-{dead_pid()}"
            dead.mkdir()
            (dead / "up-a").write_bytes(b"interrupted")
            (dead / "up-b").write_bytes(b"interrupted")
            other_host = root / f"elsewhere-{dead_pid()}"  # its pids mean nothing on this host
            other_host.mkdir()
            (other_host / "up-c").write_bytes(b"someone else's")
            living = root / f"{host}-{os.getppid()}"
            living.mkdir(exist_ok=True)
            (living / "up-d").write_bytes(b"a live worker's")

            assert store.sweep_temp() == 2
            assert not dead.exists()
            assert live.path.read_bytes() == b"a live upload"
            assert (other_host / "up-c").exists() and (living / "up-d").exists()
            art = store.publish(live)
        assert read_all(store, art.uri) == b"a live upload"


class LocalBackdoor:
    def __init__(self, root: Path) -> None:
        self.root = root

    def objects(self) -> list[str]:
        return sorted(p.resolve().as_uri() for p in self.root.glob("??/*") if p.is_file())

    def corrupt(self, uri: str) -> None:
        path = path_of(uri)
        path.write_bytes(b"tampered" + path.read_bytes()[8:])

    def remove(self, uri: str) -> None:
        path_of(uri).unlink()


class TestLocalStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> ArtifactStore:
        return LocalStore(tmp_path / "artifacts")

    @pytest.fixture
    def backdoor(self, tmp_path: Path) -> Backdoor:
        return LocalBackdoor(tmp_path / "artifacts")

    def test_a_relative_root_gives_absolute_uris(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.chdir(tmp_path)  # the default artifact_dir is relative: .ledgerflow/artifacts
        store = open_store(".ledgerflow/artifacts")
        art = store.put_bytes(b"a frame", sha(b"a frame"), operation_key="t:a:a1")
        path = path_of(art.uri)
        assert path.is_absolute() and path.read_bytes() == b"a frame"
        assert path == tmp_path / ".ledgerflow" / "artifacts" / sha(b"a frame")[:2] / sha(b"a frame")
        assert list((tmp_path / ".ledgerflow" / "artifacts" / "tmp").glob("*/*")) == []

    def test_stages_under_its_root_per_worker(self, store: ArtifactStore, tmp_path: Path) -> None:
        with store.staging() as staging:
            assert (
                staging.path.parent
                == tmp_path / "artifacts" / "tmp" / f"{socket.gethostname()}-{os.getpid()}"
            )

    def test_fetch_url_is_the_file_uri_and_describe_names_the_root(
        self, store: ArtifactStore, tmp_path: Path
    ) -> None:
        art = store.put_bytes(b"x")
        assert store.fetch_url(art.uri) == art.uri
        assert store.describe() == f"local {tmp_path / 'artifacts'}"

    def test_a_path_with_spaces_round_trips_through_its_uri(self, tmp_path: Path) -> None:
        store = open_store(str(tmp_path / "my artifacts"))
        art = store.put_bytes(b"x")
        assert "%20" in art.uri and read_all(store, art.uri) == b"x"
        assert open_store(art.uri.rsplit("/", 2)[0]).find(sha(b"x")) == art.uri


class S3Backdoor:
    def __init__(self, raw: ObstoreS3, bucket: str, prefix: str) -> None:
        self.raw, self.bucket, self.prefix = raw, bucket, prefix

    def objects(self) -> list[str]:
        return sorted(
            f"s3://{self.bucket}/{meta['path']}"
            for batch in obstore.list(self.raw, prefix=self.prefix)
            for meta in batch
        )

    def corrupt(self, uri: str) -> None:
        obstore.put(self.raw, split_s3_uri(uri)[1], b"tampered")

    def remove(self, uri: str) -> None:
        obstore.delete(self.raw, split_s3_uri(uri)[1])


@pytest.fixture
def s3_env(s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> S3Endpoint:
    """The environment ``open_store`` reads for an S3 store, pointing at the test server."""
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("LEDGERFLOW_S3_ENDPOINT", s3_endpoint.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_endpoint.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_endpoint.secret_access_key)
    monkeypatch.setenv("AWS_REGION", s3_endpoint.region)
    return s3_endpoint


class TestS3Store(StoreContract):
    @pytest.fixture
    def prefix(self) -> str:
        return f"runs/{uuid.uuid4().hex[:12]}"  # one prefix per test: the bucket is shared by the session

    @pytest.fixture
    def store(self, s3_env: S3Endpoint, prefix: str, tmp_path: Path) -> ArtifactStore:
        return open_store(f"s3://{s3_env.bucket}/{prefix}", staging_dir=tmp_path / "staging")

    @pytest.fixture
    def backdoor(self, s3_endpoint: S3Endpoint, prefix: str) -> Backdoor:
        raw = ObstoreS3(
            s3_endpoint.bucket,
            endpoint=s3_endpoint.url,
            access_key_id=s3_endpoint.access_key_id,
            secret_access_key=s3_endpoint.secret_access_key,
            region=s3_endpoint.region,
            client_options={"allow_http": True},
        )
        return S3Backdoor(raw, s3_endpoint.bucket, prefix)

    def test_keys_are_content_addresses_under_the_prefix(
        self, store: ArtifactStore, s3_env: S3Endpoint, prefix: str
    ) -> None:
        digest = sha(b"a frame")
        art = store.put_bytes(b"a frame", digest)
        assert art.uri == f"s3://{s3_env.bucket}/{prefix}/{digest[:2]}/{digest}"
        assert store.describe() == f"s3 {s3_env.bucket}/{prefix} at {s3_env.url}"

    def test_a_presigned_url_fetches_the_bytes_without_credentials(
        self, store: ArtifactStore, s3_env: S3Endpoint
    ) -> None:
        data = os.urandom(100_000)
        art = store.put_bytes(data, sha(data))
        url = store.fetch_url(art.uri, expires_seconds=300)
        assert "X-Amz-Signature=" in url and "X-Amz-Expires=300" in url
        assert s3_env.secret_access_key not in url
        response = httpx.get(url)  # a vendor: no credentials, only the URL
        assert response.status_code == 200 and response.content == data

    def test_credentials_never_show_in_describe_or_repr(
        self, store: ArtifactStore, s3_env: S3Endpoint
    ) -> None:
        for text in (store.describe(), repr(store)):
            assert s3_env.secret_access_key not in text and s3_env.access_key_id not in text

    def test_a_missing_bucket_is_an_error_not_a_missing_artifact(
        self, s3_env: S3Endpoint, tmp_path: Path
    ) -> None:
        # obstore reports NoSuchBucket as it reports NoSuchKey: the store must not read it as "not stored".
        bucket = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
        store = open_store(f"s3://{bucket}/p", staging_dir=tmp_path)
        with pytest.raises(ArtifactError, match="cannot list bucket"):
            store.find(sha(b"x"))
        with pytest.raises(ArtifactError, match="cannot list bucket"):
            store.verify(f"s3://{bucket}/p/ab/cd", sha(b"x"))

    def test_uris_of_another_bucket_are_refused(self, store: ArtifactStore) -> None:
        assert not store.can_read("s3://another-bucket/ab/cd")
        with pytest.raises(ArtifactError, match="another-bucket"):
            store.fetch_url("s3://another-bucket/ab/cd")


def test_open_store_picks_the_backend(s3_env: S3Endpoint, tmp_path: Path) -> None:
    local = open_store(str(tmp_path / "a"))
    assert isinstance(local, LocalStore)
    assert open_store((tmp_path / "a").as_uri()).describe() == local.describe()
    s3 = open_store(f"s3://{s3_env.bucket}/p", staging_dir=tmp_path / "staging")
    assert isinstance(s3, S3Store) and s3.describe() == f"s3 {s3_env.bucket}/p at {s3_env.url}"
    with pytest.raises(ArtifactError, match="unsupported"):
        open_store("gs://bucket/p")


def test_the_ledgerflow_endpoint_wins_and_remote_http_is_refused(
    s3_env: S3Endpoint, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://s3.example.com")
    assert open_store(f"s3://{s3_env.bucket}", staging_dir=tmp_path).describe().endswith(f"at {s3_env.url}")
    monkeypatch.delenv("LEDGERFLOW_S3_ENDPOINT")
    assert (
        open_store(f"s3://{s3_env.bucket}", staging_dir=tmp_path)
        .describe()
        .endswith("at https://s3.example.com")
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://s3.example.com")
    with pytest.raises(ArtifactError, match="plain http"):
        open_store(f"s3://{s3_env.bucket}", staging_dir=tmp_path)


def test_store_for_uri_picks_by_scheme_and_bucket(s3_env: S3Endpoint, tmp_path: Path) -> None:
    local = open_store(str(tmp_path / "a"))
    s3 = open_store(f"s3://{s3_env.bucket}/p", staging_dir=tmp_path / "staging")
    stores = [local, s3]
    assert store_for_uri((tmp_path / "a" / "ab" / "cd").as_uri(), stores) is local
    assert store_for_uri(f"s3://{s3_env.bucket}/old-prefix/ab/cd", stores) is s3
    with pytest.raises(ArtifactError, match=re.escape("s3://another-bucket/ab/cd")):
        store_for_uri("s3://another-bucket/ab/cd", stores)
    with pytest.raises(ArtifactError, match=re.escape("https://example.com/x")):
        store_for_uri("https://example.com/x", stores)
