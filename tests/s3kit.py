"""A real S3 endpoint for the tests: moto's S3 server, in a thread of this process (session fixture).

No S3 server installs from PyPI, so moto's server is the stand-in: it speaks the S3 wire protocol (single
and multipart PUT, ranged and streamed GET, HEAD, LIST, presigned URLs) over real HTTP, which is what obstore
talks. It does not check signatures, so it proves nothing about credentials.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import boto3  # type: ignore[import-untyped]
import pytest
from moto.server import ThreadedMotoServer


@dataclass(frozen=True)
class S3Endpoint:
    """Where the test S3 server listens, a bucket on it, and the (dummy) credentials it accepts."""

    url: str
    bucket: str
    access_key_id: str = "testing-key-id"
    secret_access_key: str = "testing-secret-8f2c"
    region: str = "us-east-1"


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[S3Endpoint]:
    """Moto's S3 server on a free port of 127.0.0.1, with one bucket; stopped (socket closed) at the end."""
    # werkzeug logs every request at INFO: noise in every failure report, and not what is under test.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)  # port 0: the OS picks
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = S3Endpoint(url=f"http://{host}:{port}", bucket=f"lf-{uuid.uuid4().hex[:12]}")
        # obstore cannot create buckets: one signed CreateBucket through boto3 (a dependency of moto).
        client = boto3.client(
            "s3",
            endpoint_url=endpoint.url,
            aws_access_key_id=endpoint.access_key_id,
            aws_secret_access_key=endpoint.secret_access_key,
            region_name=endpoint.region,
        )
        try:
            client.create_bucket(Bucket=endpoint.bucket)
        finally:
            client.close()
        yield endpoint
    finally:
        server.stop()
        # stop() shuts the serving loop down but leaves the listening socket open, which would surface as a
        # ResourceWarning (an error under filterwarnings=error) when the server object is collected.
        if server._server is not None:
            server._server.server_close()
