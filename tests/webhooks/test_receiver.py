"""Issue 29 §3: the webhook receiver, end to end on the session's real Postgres.

The app (``ledgerflow.webhooks.create_app``) is served by a real uvicorn on a free port, with its lifespan
(its own database engine), logged in as ``lf_receiver`` (made by ``ledgerflow db roles``'s code); callbacks
are real HTTP. A psycopg connection LISTENs on ``ledgerflow_callbacks`` as a waiting worker would. Whether a
refused callback woke anybody is settled without sleeping: NOTIFYs arrive in commit order, so once an
accepted callback sent after it has been heard, any notification of the refused one would have been too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager

import httpx
import psycopg
import pytest
import sqlalchemy as sa
import yaml
from fastapi import FastAPI

from ledger import roles
from ledger.callbacks import CHANNEL, CallbackRow, callbacks_for, open_engine
from ledger.recorder import Recorder
from ledgerflow.testing import serving
from ledgerflow.webhooks import create_app
from ledgerflow.webhooks.signatures import sign_standard
from runtime.settings import Settings

STANDARD_SECRET = "whsec_" + "c2VjcmV0LWZvci10ZXN0cy1vbmx5LTAxMjM0NTY3ODk="
HMAC_SECRET = "acme-hook-secret-0123"
ENV = {"LF_TEST_MOTION_HOOK": STANDARD_SECRET, "LF_TEST_ACME_HOOK": HMAC_SECRET}
PASSWORD = "test-receiver-password-0123456789"
HOOK = "https://hooks.example.com/callbacks/{route}?operation_key={{operation_key}}"
ROUTES = {
    "routes": {
        "video.motion": {  # Replicate: Standard Webhooks
            "adapter": "predictions",
            "base_url": "https://api.replicate.com",
            "webhook_url": HOOK.format(route="video.motion"),
            "callback": {"secret_env": "LF_TEST_MOTION_HOOK", "tolerance": "5m"},
        },
        "image.keyframe": {  # a jobs vendor signing the body's hex HMAC
            "adapter": "jobs",
            "base_url": "https://api.acme.example",
            "webhook_url": HOOK.format(route="image.keyframe"),
            "callback": {"secret_env": "LF_TEST_ACME_HOOK", "scheme": "hmac-sha256", "header": "X-Acme-Sig"},
        },
        "audio.tts": {  # calls back, but its secret is not set in this environment
            "adapter": "jobs",
            "base_url": "https://api.voice.example",
            "webhook_url": HOOK.format(route="audio.tts"),
            "callback": {"secret_env": "LF_TEST_UNSET_HOOK", "scheme": "hmac-sha256"},
        },
        "llm.text": {"adapter": "jobs", "base_url": "https://api.text.example"},  # no callbacks
    }
}


def served(app: FastAPI) -> AbstractContextManager[str]:
    """``app`` on a real uvicorn with its lifespan (the receiver's engine); yields its base URL."""
    return serving.served(app, lifespan="on")


class Listener:
    """A LISTENing connection on ``ledgerflow_callbacks``, as a worker waiting for a callback holds."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True)
        self.conn.execute(f"LISTEN {CHANNEL}")
        self.heard: list[str] = []

    def until(self, key: str, timeout: float = 5.0) -> list[str]:
        """Every operation key notified, up to and including ``key``; fails if ``key`` never comes."""
        deadline = time.monotonic() + timeout
        while key not in self.heard:
            left = deadline - time.monotonic()
            assert left > 0, f"no notification for {key} (heard {self.heard})"
            self.heard += [n.payload for n in self.conn.notifies(timeout=left, stop_after=1)]
        return self.heard

    def close(self) -> None:
        self.conn.close()


@pytest.fixture(scope="module")
def receiver_url(recorder: Recorder, pg_url: str) -> str:
    """The ledger URL logged in as ``lf_receiver`` (the receiver's own login)."""
    roles.ensure_logins(pg_url, {roles.ENV["receiver"]: PASSWORD})
    url = sa.engine.make_url(pg_url).set(username=roles.USERS["receiver"], password=PASSWORD)
    return url.render_as_string(hide_password=False)


@pytest.fixture(scope="module")
def base(receiver_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("webhooks") / "routes.yaml"
    path.write_text(yaml.safe_dump(ROUTES))
    with pytest.MonkeyPatch.context() as mp:
        for name, value in ENV.items():
            mp.setenv(name, value)
        mp.delenv("LF_TEST_UNSET_HOOK", raising=False)
        settings = Settings(routes_file=path, database_url=receiver_url)
        with served(create_app(settings)) as url:
            yield url


@pytest.fixture
def listener(pg_url: str) -> Iterator[Listener]:
    heard = Listener(pg_url)
    yield heard
    heard.close()


@pytest.fixture(scope="module")
def owner(pg_url: str) -> Iterator[sa.Engine]:
    """The owner's engine: the receiver's login cannot read what it recorded."""
    engine = open_engine(pg_url, pool_size=1)
    yield engine
    engine.dispose()


def prediction(status: str = "succeeded") -> bytes:
    return json.dumps(
        {"id": "ufawqhfynnddngldkgtslldrkq", "status": status, "output": ["https://x/y.mp4"]}
    ).encode()


def post_standard(
    base: str, key: str, body: bytes, *, msg_id: str | None = None, at: float | None = None, secret: str = ""
) -> httpx.Response:
    headers = sign_standard(
        secret or STANDARD_SECRET, msg_id or f"msg_{uuid.uuid4().hex}", int(at or time.time()), body
    )
    return httpx.post(
        f"{base}/callbacks/video.motion", params={"operation_key": key}, content=body, headers=headers
    )


def accepted_sentinel(base: str, listener: Listener) -> list[str]:
    """Send an accepted callback and wait for its NOTIFY: every notification committed before it is heard."""
    key = f"sentinel-{uuid.uuid4().hex}"
    assert post_standard(base, key, prediction()).status_code == 204
    return listener.until(key)


def only(rows: list[CallbackRow]) -> CallbackRow:
    assert len(rows) == 1, rows
    return rows[0]


def new_key() -> str:
    return f"op-{uuid.uuid4().hex}"


def test_healthz(base: str) -> None:
    response = httpx.get(f"{base}/healthz")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


def test_a_signed_callback_is_accepted_recorded_with_its_claimed_status_and_wakes_its_operation(
    base: str, listener: Listener, owner: sa.Engine
) -> None:
    key = new_key()
    body = prediction("succeeded")

    response = post_standard(base, key, body, msg_id="msg_accepted_" + key)

    assert (response.status_code, response.content) == (204, b"")
    assert key in listener.until(key)
    row = only(callbacks_for(owner, key))
    assert (row.route, row.verdict, row.delivery_id, row.claimed_status) == (
        "video.motion",
        "accepted",
        "msg_accepted_" + key,
        "succeeded",
    )
    assert row.reason == "signature verified (standard)"
    assert row.body_sha256 == hashlib.sha256(body).hexdigest()
    assert row.body == json.loads(body)


def test_the_same_delivery_again_is_recorded_replayed_and_wakes_nobody(
    base: str, listener: Listener, owner: sa.Engine
) -> None:
    key = new_key()
    body, msg_id, at = prediction(), f"msg_{uuid.uuid4().hex}", time.time()
    assert post_standard(base, key, body, msg_id=msg_id, at=at).status_code == 204
    listener.until(key)

    again = post_standard(base, key, body, msg_id=msg_id, at=at)  # the very same request, replayed

    assert (again.status_code, again.json()) == (200, {"verdict": "replayed"})
    heard = accepted_sentinel(base, listener)
    assert heard.count(key) == 1
    first, replay = callbacks_for(owner, key)
    assert (first.verdict, replay.verdict, replay.delivery_id, replay.body) == (
        "accepted",
        "replayed",
        msg_id,
        None,
    )
    assert replay.reason == (
        f"delivery {msg_id} was already accepted at {first.received_at.isoformat(timespec='milliseconds')}"
    )


def test_a_forged_signature_is_refused_401_recorded_and_wakes_nobody(
    base: str, listener: Listener, owner: sa.Engine
) -> None:
    key, body = new_key(), prediction()
    forger = "whsec_" + "Zm9yZ2VyLWtleS1ub3QtdGhlLXZlbmRvcnMtMDEyMzQ1"

    response = post_standard(base, key, body, msg_id="msg_forged", secret=forger)

    assert (response.status_code, response.json()) == (401, {"verdict": "forged"})
    real = sign_standard(STANDARD_SECRET, "msg_forged", int(time.time()), body)["webhook-signature"]
    for secret in (STANDARD_SECRET, STANDARD_SECRET.removeprefix("whsec_"), real[3:15]):
        assert secret not in response.text
    assert key not in accepted_sentinel(base, listener)
    row = only(callbacks_for(owner, key))
    assert (row.verdict, row.reason, row.delivery_id, row.claimed_status, row.body) == (
        "forged",
        "the signature matches none of 1 v1 entries",
        "msg_forged",
        "succeeded",
        None,
    )


def test_a_correctly_signed_but_old_callback_is_refused_as_stale(
    base: str, listener: Listener, owner: sa.Engine
) -> None:
    key = new_key()

    response = post_standard(base, key, prediction(), at=time.time() - 3600)

    assert (response.status_code, response.json()) == (401, {"verdict": "stale"})
    assert key not in accepted_sentinel(base, listener)
    row = only(callbacks_for(owner, key))
    assert row.verdict == "stale"
    assert row.reason.startswith("webhook-timestamp is 3600 s old") or row.reason.startswith(
        "webhook-timestamp is 3601 s old"
    )


def test_an_unknown_route_or_one_without_callbacks_is_404_and_recorded(base: str, owner: sa.Engine) -> None:
    key = new_key()
    for route in ("no.such.route", "llm.text"):
        response = httpx.post(
            f"{base}/callbacks/{route}", params={"operation_key": key}, content=prediction()
        )
        assert (response.status_code, response.json()) == (404, {"verdict": "unknown_route"})
    assert [(r.route, r.verdict, r.reason) for r in callbacks_for(owner, key)] == [
        ("no.such.route", "unknown_route", "no such route"),
        ("llm.text", "unknown_route", "the route takes no callbacks (no callback:)"),
    ]


def test_what_postgres_text_cannot_hold_does_not_stop_a_callback_being_recorded(
    base: str, listener: Listener, owner: sa.Engine
) -> None:
    """A NUL (or a lone surrogate) in the route, the operation key or the body is the sender's: it is recorded
    without it, never a 503 the vendor would retry forever."""
    key = new_key()
    unknown = httpx.post(f"{base}/callbacks/bad%00route", params={"operation_key": key}, content=b"{}")
    body = b'{"status": "done\\u0000", "note": "\\ud800"}'
    accepted = post_standard(base, key, body)

    assert (unknown.status_code, accepted.status_code) == (404, 204)
    listener.until(key)
    assert [(r.route, r.verdict, r.claimed_status, r.body) for r in callbacks_for(owner, key)] == [
        ("bad\ufffdroute", "unknown_route", None, None),
        ("video.motion", "accepted", "done\ufffd", None),
    ]


def test_an_hmac_sha256_route_accepts_its_digest_and_refuses_another(
    base: str, listener: Listener, owner: sa.Engine
) -> None:
    good, bad = new_key(), new_key()
    body = json.dumps({"task_id": "t-1", "state": "done"}).encode()
    digest = hmac.new(HMAC_SECRET.encode(), body, hashlib.sha256).hexdigest()
    url = f"{base}/callbacks/image.keyframe"

    accepted = httpx.post(
        url, params={"operation_key": good}, content=body, headers={"X-Acme-Sig": f"sha256={digest}"}
    )
    forged = httpx.post(
        url, params={"operation_key": bad}, content=body + b" ", headers={"X-Acme-Sig": digest}
    )

    assert accepted.status_code == 204
    assert (forged.status_code, forged.json()) == (401, {"verdict": "forged"})
    assert bad not in listener.until(good)
    ok = only(callbacks_for(owner, good))
    assert (ok.verdict, ok.delivery_id, ok.claimed_status) == (
        "accepted",
        hashlib.sha256(body).hexdigest(),
        None,
    )
    refused = only(callbacks_for(owner, bad))
    assert (refused.verdict, refused.reason) == ("forged", "the signature does not match the body")


def test_a_callback_without_operation_key_or_signature_headers_is_malformed_400(
    base: str, owner: sa.Engine
) -> None:
    key = new_key()
    body = prediction()
    no_key = httpx.post(
        f"{base}/callbacks/video.motion",
        content=body,
        headers=sign_standard(STANDARD_SECRET, "m", int(time.time()), body),
    )
    unsigned = httpx.post(f"{base}/callbacks/video.motion", params={"operation_key": key}, content=body)

    assert no_key.status_code == 400
    assert no_key.json()["verdict"] == "malformed"
    assert (unsigned.status_code, unsigned.json()) == (
        400,
        {"verdict": "malformed", "error": "missing header webhook-id, webhook-timestamp, webhook-signature"},
    )
    row = only(callbacks_for(owner, key))
    assert (row.verdict, row.delivery_id) == ("malformed", hashlib.sha256(body).hexdigest())


def test_a_body_over_one_megabyte_is_413_and_recorded_malformed(base: str, owner: sa.Engine) -> None:
    key = new_key()
    body = b"{" + b" " * (1 << 20) + b"}"

    response = post_standard(base, key, body)

    assert (response.status_code, response.json()["verdict"]) == (413, "malformed")
    row = only(callbacks_for(owner, key))
    assert row.verdict == "malformed" and row.reason.startswith("the body is larger than 1048576 bytes")


def test_an_unset_secret_is_503_logged_and_not_recorded(
    base: str, owner: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    key = new_key()
    assert "LF_TEST_UNSET_HOOK" not in os.environ

    with caplog.at_level("ERROR", logger="ledgerflow.webhooks"):
        response = httpx.post(
            f"{base}/callbacks/audio.tts",
            params={"operation_key": key},
            content=b"{}",
            headers={"X-Signature": "0" * 64},
        )

    assert (response.status_code, response.json()) == (
        503,
        {"error": "callbacks of this route are not configured"},
    )
    assert callbacks_for(owner, key) == []
    assert [r.getMessage() for r in caplog.records] == [
        "callbacks of route 'audio.tts' refused: LF_TEST_UNSET_HOOK is not set"
    ]
