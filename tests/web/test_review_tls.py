"""The reviewer page as the deployment serves it (issue 27 §3): over TLS, with a certificate of the
deployment's private CA (ops/compose/private_ca.py, the job docker-compose.yml runs for it), on a real uvicorn
configured by ``ledgerflow.review.server_config`` — the page answers HTTPS to a client that trusts that CA,
and nothing to a client that does not, nor to plain HTTP."""

from __future__ import annotations

import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from reviewkit import TOKENS

from ledgerflow.review import create_app, server_config
from ledgerflow.stack.pg import free_port
from runtime.settings import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private CA and a server certificate for localhost, made by the deployment's own job."""
    base = tmp_path_factory.mktemp("pki")
    for d in ("ca", "review", "trust"):
        (base / d).mkdir()  # the job's volumes exist before it runs
    made = subprocess.run(
        [
            sys.executable,
            str(ROOT / "ops" / "compose" / "private_ca.py"),
            f"--ca-dir={base / 'ca'}",
            f"--server-dir={base / 'review'}",
            f"--trust-dir={base / 'trust'}",
            "--host=review",
            "--host=localhost",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    return base


@contextmanager
def serving(config: uvicorn.Config) -> Iterator[None]:
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the page did not start"
        time.sleep(0.02)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(10)


def test_the_page_speaks_https_with_the_private_cas_certificate_and_nothing_else(lf: Any, pki: Path) -> None:
    port = free_port()
    app = create_app(lf.settings, tokens=TOKENS)
    config = server_config(
        lf.settings,
        "127.0.0.1",
        port,
        app=app,
        tls_cert=pki / "review" / "tls.crt",
        tls_key=pki / "review" / "tls.key",
    )
    with serving(config):
        page = httpx.get(
            f"https://localhost:{port}/login",
            verify=ssl.create_default_context(cafile=pki / "trust" / "bundle.pem"),
            timeout=10,
        )
        assert page.status_code == 200 and "<form" in page.text
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"https://localhost:{port}/login", timeout=10)  # the public CAs alone: refused
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://localhost:{port}/login", timeout=10)  # no plain HTTP on the TLS port


def test_a_certificate_without_its_key_or_a_missing_file_is_one_clear_error(lf: Any, pki: Path) -> None:
    with pytest.raises(ConfigError, match="--tls-cert and --tls-key go together"):
        server_config(lf.settings, "127.0.0.1", 1, tls_cert=pki / "review" / "tls.crt")
    with pytest.raises(ConfigError, match=r"--tls-key .*nope\.key: no such file"):
        server_config(
            lf.settings, "127.0.0.1", 1, tls_cert=pki / "review" / "tls.crt", tls_key=pki / "nope.key"
        )
