"""The S3-compatible store (AWS S3, MinIO, R2, …) through obstore: key ``<prefix>/<sha[:2]>/<sha>``.

Bytes stage in a local directory (``<staging_dir>/<host>-<pid>/``), are hashed and checked there, then go up
in one streaming upload. S3 makes an upload visible only once it is complete (a single PUT, or the final
CompleteMultipartUpload), so readers see no object or the whole object: the same guarantee the local
store's rename gives. An upload interrupted by a crash leaves the staging file (swept later) and, for a
multipart upload, parts the bucket keeps until a lifecycle rule aborts them: configure one
(AbortIncompleteMultipartUpload) on any real bucket.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

import obstore
from obstore.store import S3Store as _ObstoreS3

from artifacts.store import (
    CHUNK_SIZE,
    ArtifactError,
    ArtifactMissing,
    StagedStore,
    Staging,
    StagingArea,
    StoredArtifact,
    content_path,
    rechunk,
)

if TYPE_CHECKING:
    from obstore.store import S3Config  # a TypedDict that exists only in the type stubs

PART_SIZE = 8 * 1024 * 1024
"""Multipart part size (S3's minimum is 5 MiB); smaller artifacts go up in a single PUT."""
PART_CONCURRENCY = 2
"""Parts in flight at once: the upload holds at most PART_SIZE × PART_CONCURRENCY bytes, whatever the size."""
_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")  # as urlparse gives hostnames (no brackets)


def default_staging_dir() -> Path:
    """Where S3 uploads stage by default: ``$TMPDIR/ledgerflow-s3-staging``.

    Mind a ``/tmp`` on tmpfs: staged bytes then sit in RAM until uploaded; pass ``staging_dir`` (a disk)
    for large artifacts.
    """
    return Path(tempfile.gettempdir()) / "ledgerflow-s3-staging"


def split_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` → ``(bucket, key)``."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ArtifactError(f"not an S3 URI: {uri}")
    return parsed.netloc, unquote(parsed.path.lstrip("/"))


class S3Store(StagedStore):
    """Artifacts as objects in an S3 bucket under a prefix, addressed by their sha256.

    Reads accept any key of the bucket (an artifact recorded under an earlier prefix stays readable); writes
    go under ``prefix``. Credentials live only inside the obstore client: never in ``describe``, ``repr``, or
    a URI.
    """

    scheme = "s3"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        region: str = "us-east-1",
        staging_dir: Path | None = None,
    ) -> None:
        """Connect to ``bucket`` (no request is made until the first operation).

        Args:
            bucket: The bucket; it must exist.
            prefix: The key prefix artifacts are written under ("" for the bucket's top).
            endpoint: An S3-compatible endpoint (``http://127.0.0.1:9000``); None for AWS itself. Plain http
                is allowed only to this machine (localhost), so credentials never cross a network unencrypted.
            access_key_id: None leaves credentials to obstore's chain (env, profile, instance role).
            secret_access_key: Goes with ``access_key_id``.
            region: The bucket's region.
            staging_dir: Where uploads stage locally; default ``default_staging_dir()``.

        Raises:
            ArtifactError: A plain-http endpoint that is not this machine.
        """
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint = endpoint.rstrip("/") if endpoint else None
        allow_http = False
        if self.endpoint:
            url = urlparse(self.endpoint)
            if url.scheme == "http":
                if url.hostname not in _LOCAL_HOSTS:
                    raise ArtifactError(
                        f"refusing plain http to {self.endpoint}: only a localhost endpoint may skip TLS"
                    )
                allow_http = True
        config: S3Config = {"region": region}
        if self.endpoint:
            config["endpoint"] = self.endpoint
        if access_key_id and secret_access_key:
            config["access_key_id"] = access_key_id
            config["secret_access_key"] = secret_access_key
        # No obstore prefix: keys are computed here, so reads can reach any key of the bucket.
        self._store = _ObstoreS3(bucket, config=config, client_options={"allow_http": allow_http})
        self._area = StagingArea(staging_dir or default_staging_dir())
        self._bucket_seen = False

    @classmethod
    def from_env(cls, url: str, *, staging_dir: Path | None = None) -> S3Store:
        """A store for ``s3://bucket/prefix`` configured from the environment, read now.

        Reads ``LEDGERFLOW_S3_ENDPOINT`` (preferred: it is ledgerflow's alone) or ``AWS_ENDPOINT_URL``,
        ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION`` (default ``us-east-1``).

        Args:
            url: ``s3://bucket`` or ``s3://bucket/prefix``.
            staging_dir: Where uploads stage locally; default ``default_staging_dir()``.
        """
        bucket, prefix = split_s3_uri(url)
        return cls(
            bucket,
            prefix,
            endpoint=os.environ.get("LEDGERFLOW_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL") or None,
            access_key_id=os.environ.get("AWS_ACCESS_KEY_ID"),
            secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
            region=os.environ.get("AWS_REGION") or "us-east-1",
            staging_dir=staging_dir,
        )

    def __repr__(self) -> str:
        return f"S3Store({self.describe()!r})"

    def _key(self, sha256: str) -> str:
        address = content_path(sha256)
        return f"{self.prefix}/{address}" if self.prefix else address

    def _uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _key_of(self, uri: str) -> str:
        bucket, key = split_s3_uri(uri)
        if bucket != self.bucket:
            raise ArtifactError(f"{uri} is not in this store's bucket {self.bucket}")
        return key

    def _confirm_bucket(self) -> None:
        """Raise ArtifactError unless the bucket exists (checked once, on the first "not found").

        obstore reports a missing bucket exactly like a missing object (``FileNotFoundError``; a HEAD has
        no body to tell them apart), so without this a misconfigured bucket would make every artifact look
        missing, and a reconciler would conclude they were never stored.
        """
        if self._bucket_seen:
            return
        try:
            obstore.list_with_delimiter(self._store, prefix=self.prefix or None)
        except Exception as err:  # obstore raises a GenericError for NoSuchBucket on a LIST
            raise ArtifactError(
                f"cannot list bucket {self.bucket} ({self.describe()}): {type(err).__name__}"
            ) from err
        self._bucket_seen = True

    def _place(self, staging: Staging) -> StoredArtifact:
        """Upload the staging file to its content address, streaming it from disk."""
        key = self._key(staging.sha256)
        # Streamed from the open file: obstore reads PART_SIZE at a time (a multipart upload above PART_SIZE),
        # so memory stays bounded. Overwriting is harmless: the key is the bytes' hash, so a retry or a
        # concurrent upload of the same artifact writes the same bytes, and S3 shows one or the other whole.
        with staging.path.open("rb") as f:
            obstore.put(self._store, key, f, chunk_size=PART_SIZE, max_concurrency=PART_CONCURRENCY)
        return StoredArtifact(self._uri(key), staging.sha256, staging.size)

    def delete(self, uri: str) -> bool:
        """Delete the object at ``uri`` (retention); False if there was none (one HEAD, one DELETE)."""
        key = self._key_of(uri)
        try:
            obstore.head(self._store, key)
        except FileNotFoundError:
            self._confirm_bucket()
            return False
        obstore.delete(self._store, key)
        return True

    def find(self, sha256: str) -> str | None:
        """The URI of the object with this content address, or None if there is none (one HEAD)."""
        key = self._key(sha256)
        try:
            obstore.head(self._store, key)
        except FileNotFoundError:  # obstore's NotFoundError: no such object, or no such bucket
            self._confirm_bucket()
            return None
        return self._uri(key)

    def open_read(self, uri: str) -> Iterator[bytes]:
        """Start a GET (raising ArtifactMissing now if there is no object) and return its chunks."""
        try:
            result = obstore.get(self._store, self._key_of(uri))
        except FileNotFoundError:
            self._confirm_bucket()
            raise ArtifactMissing(f"no artifact at {uri}") from None
        # min_chunk_size is a lower bound (network frames are coalesced up to it); rechunk caps the size.
        return rechunk(result.stream(min_chunk_size=CHUNK_SIZE // 4), CHUNK_SIZE)

    @contextmanager
    def local_copy(self, uri: str) -> Iterator[Path]:
        """A temp file holding the object, streamed down into the staging directory; removed on exit.

        In the staging directory, so a download interrupted by a crash is swept like an upload.

        Raises:
            ArtifactMissing: No object at ``uri``.
        """
        chunks = self.open_read(uri)
        with self._area.temp_file("dl-") as path:
            with path.open("wb") as f:
                for chunk in chunks:
                    f.write(chunk)
            yield path

    def fetch_url(self, uri: str, expires_seconds: int = 3600) -> str:
        """A presigned GET URL for the object, for a vendor that fetches its inputs by URL.

        WARNING: A presigned URL IS A CREDENTIAL. Anyone holding it can read the object until it expires,
        with this store's identity. Never put it in a workflow argument or result, a heartbeat, an exception
        message, a log line or a ledger event (all are persisted, replayed and shown in UIs). Create it inside
        the activity, immediately before the vendor call, pass it only to the vendor, and record the ``s3://``
        URI instead.

        Args:
            uri: The artifact's ``s3://`` URI (this store's bucket).
            expires_seconds: How long the URL stays valid; keep it as short as the vendor allows.

        Returns:
            The presigned URL (signed locally: no request is made, and the object is not checked to exist).
        """
        return obstore.sign(self._store, "GET", self._key_of(uri), timedelta(seconds=expires_seconds))

    def describe(self) -> str:
        """``s3 bucket/prefix at <endpoint>`` (never credentials)."""
        where = f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket
        return f"s3 {where} at {self.endpoint or 'AWS'}"

    def can_read(self, uri: str) -> bool:
        """Whether ``uri`` is an ``s3://`` URI of this store's bucket."""
        try:
            return split_s3_uri(uri)[0] == self.bucket
        except ArtifactError:
            return False
