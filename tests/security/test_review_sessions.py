"""Issue 24 §4: who a reviewer-page login lets see what, and for how long. A token carries scopes as an
approver key does (a token for project A sees nothing of project B); logging out revokes the session cookie;
behind a trusted proxy the login limits are per client address, and a client's own X-Forwarded-For is
believed only from a trusted proxy; a slow ledger never stalls the page's event loop."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import uvicorn
from peoplekit import wait_open
from web.reviewkit import SHOT_APPROVAL, TOKENS, served

from ledgerflow.review import create_app, server_config
from ledgerflow.review.auth import parse_scopes
from ledgerflow.views import people
from runtime.settings import ConfigError, Settings
from runtime.signing import demo_key


def bearer(approver: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[approver]}"}


def offline(tmp_path: Path, **kw: Any) -> httpx.AsyncClient:
    settings = Settings(state_dir=tmp_path, database_url="postgresql+psycopg://nobody@127.0.0.1:1/none")
    app = create_app(settings, tokens=TOKENS, **kw)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://review.test")


async def csrf_of(client: httpx.AsyncClient) -> str:
    text = (await client.get("/login")).text
    marker = 'name="csrf-token" content="'
    return text[text.index(marker) + len(marker) :].split('"', 1)[0]


# ── scopes ───────────────────────────────────────────────────────────────────────────────────────────


async def test_a_token_scoped_to_one_project_sees_nothing_of_another(lf, sim):
    a, b = f"pa-{uuid.uuid4().hex[:6]}", f"pb-{uuid.uuid4().hex[:6]}"
    plans = [lf.plan(f"project: {p}\n{SHOT_APPROVAL}") for p in (a, b)]
    handles = [await lf.start(p) for p in plans]
    try:
        ta, tb = (str(p.task_id) for p in plans)
        ra, rb = [await wait_open(lf, t, "approval:shot") for t in (ta, tb)]
        scopes = {"director": (f"project:{a}",), "producer": ("*",)}
        app = create_app(lf.settings, tokens=TOKENS, scopes=scopes, relay_timeout=1)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r.t") as client:
            mine = {
                row["task_id"] for row in (await client.get("/api/queue", headers=bearer("director"))).json()
            }
            assert ta in mine and tb not in mine
            every = {
                row["task_id"] for row in (await client.get("/api/queue", headers=bearer("producer"))).json()
            }
            assert {ta, tb} <= every

            assert (
                await client.get(f"/api/requests/{ta}/{ra}", headers=bearer("director"))
            ).status_code == 200
            detail = (await client.get(f"/api/requests/{tb}/{rb}", headers=bearer("producer"))).json()
            sha = detail["context_now"]["artifacts"][0]["sha256"]
            denied = f"task {tb} is outside director's scopes (project:{a})"
            for response in (
                await client.get(f"/api/requests/{tb}/{rb}", headers=bearer("director")),
                await client.get(f"/artifacts/{tb}/{sha}", headers=bearer("director")),
                await client.post(
                    f"/api/decisions/{tb}",
                    json=people.signed_payload(demo_key("director"), tb, rb, "approve"),
                    headers=bearer("director"),
                ),
            ):
                assert response.status_code == 403 and response.json() == {"error": denied}, response.text
            assert (await client.get(f"/artifacts/{tb}/{sha}", headers=bearer("producer"))).status_code == 200
        still = await wait_open(lf, tb, "approval:shot")  # nothing was relayed for the refused decision
        assert still == rb
    finally:
        for handle in handles:
            await handle.terminate("test over")


def test_scopes_are_read_from_one_json_object_and_a_bad_one_is_one_line():
    assert parse_scopes('{"director": ["project:a", "task:t-1"], "producer": ["*"]}') == {
        "director": ("project:a", "task:t-1"),
        "producer": ("*",),
    }
    for text in ("[1]", '{"director": "project:a"}', '{"director": ["proj:a"]}', "{"):
        with pytest.raises(ConfigError, match=r"^LEDGERFLOW_REVIEW_SCOPES must be a JSON object"):
            parse_scopes(text)


# ── logout ───────────────────────────────────────────────────────────────────────────────────────────


async def test_a_logged_out_session_cookie_is_refused_afterwards(tmp_path, recorder, pg_url):
    settings = Settings(state_dir=tmp_path, database_url=pg_url)
    app = create_app(settings, tokens=TOKENS)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://review.test"
    ) as client:
        form = {"token": TOKENS["director"], "csrf_token": await csrf_of(client)}
        assert (await client.post("/login", data=form)).status_code == 303
        stolen = client.cookies["ledgerflow_review"]  # what someone copied from the browser
        assert 'signed in as <b id="who">director</b>' in (await client.get("/login")).text
        assert (await client.post("/logout", data={"csrf_token": await csrf_of(client)})).status_code == 303
        client.cookies.clear()
        client.cookies.set("ledgerflow_review", stolen)  # replayed after the logout
        replay = await client.get("/queue")
        assert (replay.status_code, replay.headers["location"]) == (303, "/login")
        assert "signed in as" not in (await client.get("/login")).text


# ── behind a proxy ───────────────────────────────────────────────────────────────────────────────────


@contextmanager
def serving(config: uvicorn.Config) -> Iterator[str]:
    """A uvicorn server made from ``config`` (the one ``serve`` runs) on a free port, in a thread."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the reviewer page did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


async def failed_logins(base: str, forwarded_for: str, n: int) -> list[int]:
    async with httpx.AsyncClient(base_url=base, headers={"X-Forwarded-For": forwarded_for}) as client:
        csrf = await csrf_of(client)
        return [
            (await client.post("/login", data={"token": f"guess-{i:016d}", "csrf_token": csrf})).status_code
            for i in range(n)
        ]


async def test_behind_a_trusted_proxy_login_limits_are_per_client_address(tmp_path):
    settings = Settings(state_dir=tmp_path, review_tokens='{"director": "director-review-token-1"}')
    app = create_app(settings, login_rate=(2, 600.0))
    with serving(server_config(settings, "127.0.0.1", 0, app=app, forwarded_allow_ips="127.0.0.1")) as base:
        assert await failed_logins(base, "203.0.113.5", 3) == [401, 401, 429]
        assert await failed_logins(base, "203.0.113.6", 1) == [401]  # another person behind the same proxy


async def test_a_forwarded_for_header_from_an_untrusted_peer_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("FORWARDED_ALLOW_IPS", raising=False)
    settings = Settings(state_dir=tmp_path, review_tokens='{"director": "director-review-token-1"}')
    app = create_app(settings, login_rate=(2, 600.0))
    with serving(server_config(settings, "127.0.0.1", 0, app=app)) as base:  # trusts no proxy by default
        assert await failed_logins(base, "203.0.113.5", 3) == [401, 401, 429]
        assert await failed_logins(base, "198.51.100.9", 1) == [429]  # a made-up address buys no attempts


# ── the event loop ───────────────────────────────────────────────────────────────────────────────────


async def test_a_decision_waiting_on_a_locked_ledger_never_stalls_the_page(lf, sim, pg_url):
    plan = lf.plan(SHOT_APPROVAL)
    handle = await lf.start(plan)
    tid = str(plan.task_id)
    rid = await wait_open(lf, tid, "approval:shot")
    payload = people.signed_payload(demo_key("director"), tid, rid, "approve")
    engine = sa.create_engine(pg_url)
    try:
        with served(create_app(lf.settings, tokens=TOKENS, relay_timeout=15)) as base:
            async with httpx.AsyncClient(base_url=base, timeout=20) as client:
                with engine.connect() as conn:
                    conn.execute(sa.text("LOCK TABLE events IN ACCESS EXCLUSIVE MODE"))  # a slow ledger
                    decision = asyncio.create_task(
                        client.post(f"/api/decisions/{tid}", json=payload, headers=bearer("director"))
                    )
                    await asyncio.sleep(0.5)  # the decision is now reading the locked ledger
                    started = time.monotonic()
                    login = await client.get("/login", timeout=3)
                    assert login.status_code == 200 and time.monotonic() - started < 2
                    assert not decision.done()
                    conn.rollback()  # the lock goes; the decision goes on
                response = await decision
        assert response.status_code == 200 and response.json()["status"] == "accepted", response.text
        assert (await asyncio.wait_for(handle.result(), 30)).state == "Completed"
    finally:
        engine.dispose()
