"""Issue 24 §4: the reviewer page's session secret is shared by replicas. Cookies are signed with
``LEDGERFLOW_REVIEW_SESSION_SECRET``: a cookie one replica set is good on another built with the same secret
(logged in, and its CSRF token accepted), and refused by one built with a different secret. Outside dev mode
the page will not start without the secret (one line); in dev mode, unset, each process makes its own.

Logging out revokes the session on every replica, and across restarts: the revocation is a row in the ledger
(``review_logouts``), checked on each logged-in request; a replica that cannot reach the ledger refuses the
cookie rather than guess (fails closed)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr
from web.reviewkit import TOKENS

from ledgerflow.review import create_app
from ledgerflow.review.auth import COOKIE
from runtime.settings import ConfigError, Settings

SECRET = "replica-shared-session-secret-0123456789"
SIGNED_IN = 'signed in as <b id="who">director</b>'
OFFLINE_DB = "postgresql+psycopg://nobody@127.0.0.1:1/none"


def replica(tmp_path: Path, secret: str | None, database_url: str = OFFLINE_DB) -> httpx.AsyncClient:
    """One replica of the page (its own app, its own process state), reached in memory."""
    settings = Settings(
        state_dir=tmp_path,
        database_url=database_url,
        review_session_secret=None if secret is None else SecretStr(secret),
    )
    app = create_app(settings, tokens=TOKENS)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://review.test")


async def csrf_of(client: httpx.AsyncClient) -> str:
    text = (await client.get("/login")).text
    marker = 'name="csrf-token" content="'
    return text[text.index(marker) + len(marker) :].split('"', 1)[0]


async def logged_in_cookie(client: httpx.AsyncClient) -> tuple[str, str]:
    """Log in as director on ``client``: its session cookie and that session's CSRF token."""
    form = {"token": TOKENS["director"], "csrf_token": await csrf_of(client)}
    assert (await client.post("/login", data=form)).status_code == 303
    assert SIGNED_IN in (await client.get("/login")).text
    return client.cookies[COOKIE], await csrf_of(client)


async def test_a_cookie_from_one_replica_works_on_another_with_the_same_secret(tmp_path, recorder, pg_url):
    async with replica(tmp_path, SECRET, pg_url) as a, replica(tmp_path, SECRET, pg_url) as b:
        cookie, csrf = await logged_in_cookie(a)
        b.cookies.set(COOKIE, cookie)
        assert SIGNED_IN in (await b.get("/login")).text  # the load balancer sent the next request to b
        # the session's CSRF token, minted on a, is good on b too: a state-changing request goes through
        out = await b.post("/logout", data={"csrf_token": csrf})
        assert (out.status_code, out.headers["location"]) == (303, "/login")


async def test_a_replica_with_a_different_secret_refuses_the_cookie(tmp_path, recorder, pg_url):
    other = "another-replicas-session-secret-9876543210"
    async with replica(tmp_path, SECRET, pg_url) as a, replica(tmp_path, other, pg_url) as b:
        cookie, csrf = await logged_in_cookie(a)
        b.cookies.set(COOKIE, cookie)
        assert SIGNED_IN not in (await b.get("/login")).text
        b.cookies.set(COOKIE, cookie)  # the page above handed b a fresh (logged-out) cookie of its own
        queue = await b.get("/queue")
        assert (queue.status_code, queue.headers["location"]) == (303, "/login")
        b.cookies.set(COOKIE, cookie)
        assert (await b.post("/logout", data={"csrf_token": csrf})).status_code == 403


async def test_a_logout_on_one_replica_is_refused_by_every_other_and_after_a_restart(
    tmp_path, recorder, pg_url
):
    async with replica(tmp_path, SECRET, pg_url) as a, replica(tmp_path, SECRET, pg_url) as b:
        cookie, csrf = await logged_in_cookie(a)
        b.cookies.set(COOKIE, cookie)
        assert SIGNED_IN in (await b.get("/login")).text  # b knows the session
        assert (await a.post("/logout", data={"csrf_token": csrf})).status_code == 303  # logged out on a
        b.cookies.set(COOKIE, cookie)  # a copy of the cookie, replayed on b
        queue = await b.get("/queue")
        assert (queue.status_code, queue.headers["location"]) == (303, "/login")
        b.cookies.set(COOKIE, cookie)
        assert SIGNED_IN not in (await b.get("/login")).text
    async with replica(tmp_path, SECRET, pg_url) as restarted:  # a replica started after the logout
        restarted.cookies.set(COOKIE, cookie)
        assert SIGNED_IN not in (await restarted.get("/login")).text


async def test_a_replica_that_cannot_reach_the_ledger_refuses_a_logged_in_cookie(tmp_path, recorder, pg_url):
    async with replica(tmp_path, SECRET, pg_url) as a, replica(tmp_path, SECRET) as cut_off:
        cookie, _ = await logged_in_cookie(a)
        cut_off.cookies.set(COOKIE, cookie)
        page = await cut_off.get("/login")  # it cannot tell whether the session was logged out
        assert page.status_code == 503 and "ledger database unavailable" in page.text
        assert SIGNED_IN not in page.text
        cut_off.cookies.set(COOKIE, cookie)
        api = await cut_off.get("/api/queue")
        assert api.status_code == 503


async def test_in_dev_mode_without_a_secret_each_process_signs_with_its_own(tmp_path, recorder, pg_url):
    async with replica(tmp_path, None, pg_url) as a, replica(tmp_path, None, pg_url) as b:
        cookie, _ = await logged_in_cookie(a)
        b.cookies.set(COOKIE, cookie)
        assert SIGNED_IN not in (await b.get("/login")).text


def test_outside_dev_mode_the_page_will_not_start_without_the_secret(tmp_path, monkeypatch):
    monkeypatch.delenv("LEDGERFLOW_ENV", raising=False)
    monkeypatch.delenv("LEDGERFLOW_REVIEW_SESSION_SECRET", raising=False)
    with pytest.raises(ConfigError, match=r"^LEDGERFLOW_REVIEW_SESSION_SECRET is not set") as refused:
        replica(tmp_path, None)
    assert len(str(refused.value).splitlines()) == 1
    with pytest.raises(ConfigError, match=r"^LEDGERFLOW_REVIEW_SESSION_SECRET must be 32\+ characters$"):
        replica(tmp_path, "short")
    replica(tmp_path, SECRET)  # with it, the page starts in production


def test_the_secret_is_read_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("LEDGERFLOW_ENV", raising=False)
    monkeypatch.setenv("LEDGERFLOW_REVIEW_SESSION_SECRET", SECRET)
    settings = Settings(state_dir=tmp_path, database_url=OFFLINE_DB)
    assert settings.review_session_secret is not None
    assert settings.review_session_secret.get_secret_value() == SECRET
    assert SECRET not in repr(settings)  # a SecretStr: never printed
    create_app(settings, tokens=TOKENS)
