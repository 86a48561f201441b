"""The reviewer app without a browser (httpx against the ASGI app): login, the session cookie, CSRF, rate
limits, one-line errors, and the JSON API deciding with a payload signed in Python."""

from __future__ import annotations

import asyncio
import hashlib
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from peoplekit import wait_open
from reviewkit import SHOT_APPROVAL, TOKENS

from ledgerflow.review import create_app, serve
from ledgerflow.review.auth import RateLimiter
from ledgerflow.views import people
from rules.events import HumanDecision, parse
from runtime.settings import ConfigError, Settings
from runtime.signing import demo_key

SAMPLE_DECISION = {
    "decision_id": "6f1c2b9e-0a4d-4c55-9a7e-2b1d3c4e5f60",
    "request_id": "approval:shot:v1",
    "decision": "approve",
    "approver": "director",
    "key_id": "demo-director",
    "note": "",
    "amount": None,
    "scope": None,
    "signature": "ab" * 64,
}


OFFLINE_DB = "postgresql+psycopg://nobody@127.0.0.1:1/none"


def offline_app(tmp_path: Path, database_url: str = OFFLINE_DB, **kw: Any) -> httpx.AsyncClient:
    """A client of an app whose settings point at nothing: for what is decided before any ledger read. A
    logged-in cookie is looked up in the ledger's logouts: a test that logs in passes the real
    ``database_url``."""
    settings = Settings(state_dir=tmp_path, database_url=database_url)
    app = create_app(settings, tokens=TOKENS, **kw)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://review.test")


def csrf_of(page: httpx.Response) -> str:
    found = re.search(r'name="csrf-token" content="([^"]+)"', page.text)
    assert found, page.text[:500]
    return found.group(1)


async def log_in(client: httpx.AsyncClient, approver: str = "director") -> str:
    """Log in through the form; returns the new session's CSRF token."""
    form = {"token": TOKENS[approver], "csrf_token": csrf_of(await client.get("/login"))}
    response = await client.post("/login", data=form)
    assert response.status_code == 303 and response.headers["location"] == "/queue", response.text
    return csrf_of(await client.get("/login"))


def assert_one_line_json(response: httpx.Response, status: int, needle: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert needle in error and "\n" not in error and "Traceback" not in error, error


def test_serving_without_any_token_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.delenv("LEDGERFLOW_REVIEW_TOKENS", raising=False)
    with pytest.raises(ConfigError, match="no reviewer tokens: set LEDGERFLOW_REVIEW_TOKENS"):
        serve(Settings(state_dir=tmp_path), "127.0.0.1", 0)


# ── who may do what ──────────────────────────────────────────────────────────────────────────────────


async def test_pages_and_the_api_need_a_login(tmp_path):
    async with offline_app(tmp_path) as client:
        page = await client.get("/queue")
        assert (page.status_code, page.headers["location"]) == (303, "/login")
        assert (await client.get("/requests/t-1/approval:x")).headers["location"] == "/login"
        assert_one_line_json(await client.get("/api/queue"), 401, "not logged in")
        assert_one_line_json(await client.get(f"/api/requests/t-1/{'a' * 10}"), 401, "not logged in")
        assert (await client.get(f"/artifacts/t-1/{'0' * 64}")).status_code == 401
        anonymous = await client.post("/api/decisions/t-1", json=SAMPLE_DECISION)
        assert_one_line_json(anonymous, 401, "not logged in")


async def test_login_sets_a_signed_http_only_same_site_strict_cookie_and_a_bad_token_is_refused(
    tmp_path, recorder, pg_url
):
    async with offline_app(tmp_path, pg_url) as client:
        csrf = csrf_of(await client.get("/login"))
        bad = await client.post("/login", data={"token": "director-review-token-2", "csrf_token": csrf})
        assert bad.status_code == 401 and "unknown token" in bad.text and "Traceback" not in bad.text
        ok = await client.post("/login", data={"token": TOKENS["director"], "csrf_token": csrf})
        assert ok.status_code == 303
        cookie = ok.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie
        assert 'signed in as <b id="who">director</b>' in (await client.get("/login")).text
        # Login gives a new session with a new CSRF token (the one from before login is dead).
        assert csrf_of(await client.get("/login")) != csrf
        # A cookie altered by hand is no session at all.
        value = client.cookies["ledgerflow_review"]
        client.cookies.set("ledgerflow_review", value[:-2] + ("AA" if not value.endswith("AA") else "BB"))
        assert (await client.get("/queue")).headers["location"] == "/login"


async def test_every_state_changing_request_by_cookie_needs_its_sessions_csrf_token(
    tmp_path, recorder, pg_url
):
    async with offline_app(tmp_path, pg_url) as client, offline_app(tmp_path, pg_url) as other:
        assert (await client.post("/login", data={"token": TOKENS["director"]})).status_code == 403
        csrf = await log_in(client)
        theirs = await log_in(other, "producer")
        url = "/api/decisions/t-1"
        assert_one_line_json(await client.post(url, json=SAMPLE_DECISION), 403, "CSRF token")
        wrong = await client.post(url, json=SAMPLE_DECISION, headers={"X-CSRF-Token": "x" * 43})
        assert_one_line_json(wrong, 403, "CSRF token")
        stolen = await client.post(url, json=SAMPLE_DECISION, headers={"X-CSRF-Token": theirs})
        assert_one_line_json(stolen, 403, "CSRF token")
        logout = await client.post("/logout", data={})
        assert logout.status_code == 403 and "CSRF" in logout.text
        # With its own token the request gets past CSRF (and is refused for what it says: a bad task id).
        passed = await client.post("/api/decisions/t!1", json=SAMPLE_DECISION, headers={"X-CSRF-Token": csrf})
        assert_one_line_json(passed, 404, "is not a task id")
        assert (await client.post("/logout", data={"csrf_token": csrf})).status_code == 303
        assert (await client.get("/queue")).headers["location"] == "/login"


async def test_bearer_tokens_need_no_csrf_and_a_bad_one_is_401(tmp_path):
    async with offline_app(tmp_path) as client:
        bad = await client.get("/api/queue", headers={"Authorization": "Bearer nope-nope-nope-nope"})
        assert_one_line_json(bad, 401, "unknown bearer token")
        assert bad.headers["www-authenticate"] == "Bearer"
        bearer = {"Authorization": f"Bearer {TOKENS['director']}"}
        response = await client.post("/api/decisions/t!1", json=SAMPLE_DECISION, headers=bearer)
        assert_one_line_json(response, 404, "is not a task id")


async def test_a_trusted_proxy_header_names_the_approver_and_still_needs_csrf(tmp_path):
    async with offline_app(tmp_path, trusted_header="X-Forwarded-User") as client:
        as_director = {"X-Forwarded-User": "director"}
        page = await client.get("/login", headers=as_director)
        assert 'signed in as <b id="who">director</b>' in page.text
        url = "/api/decisions/t!1"
        assert_one_line_json(await client.post(url, json=SAMPLE_DECISION, headers=as_director), 403, "CSRF")
        with_csrf = {**as_director, "X-CSRF-Token": csrf_of(page)}
        assert_one_line_json(await client.post(url, json=SAMPLE_DECISION, headers=with_csrf), 404, "task id")
        odd = {**with_csrf, "X-Forwarded-User": "robert'); drop"}
        assert_one_line_json(await client.post(url, json=SAMPLE_DECISION, headers=odd), 403, "valid approver")
    async with offline_app(tmp_path) as client:  # without the parameter the header means nothing
        assert (await client.get("/queue", headers={"X-Forwarded-User": "director"})).status_code == 303


async def test_login_attempts_and_decisions_are_rate_limited_with_429(tmp_path):
    async with offline_app(tmp_path, login_rate=(3, 60.0), decision_rate=(2, 60.0)) as client:
        csrf = csrf_of(await client.get("/login"))
        codes = [
            (await client.post("/login", data={"token": f"guess-{i:016d}", "csrf_token": csrf})).status_code
            for i in range(4)
        ]
        assert codes == [401, 401, 401, 429]
        limited = await client.post("/login", data={"token": TOKENS["director"], "csrf_token": csrf})
        assert limited.status_code == 429 and "too many login attempts" in limited.text
        assert int(limited.headers["retry-after"]) > 0
    async with offline_app(tmp_path, decision_rate=(2, 60.0)) as client:
        director = {"Authorization": f"Bearer {TOKENS['director']}"}
        url = "/api/decisions/t-1"
        codes = [(await client.post(url, content=b"{", headers=director)).status_code for _ in range(3)]
        assert codes == [400, 400, 429]
        limited = await client.post(url, content=b"{", headers=director)
        assert_one_line_json(limited, 429, "too many decisions from director: try again in")
        assert int(limited.headers["retry-after"]) > 0
        producer = {"Authorization": f"Bearer {TOKENS['producer']}"}  # per approver: the producer may go on
        assert (await client.post(url, content=b"{", headers=producer)).status_code == 400


def test_a_token_bucket_refills_one_token_per_period_per_key():
    now = [0.0]
    limiter = RateLimiter(2, 10.0, clock=lambda: now[0])
    assert [limiter.take("director") for _ in range(3)] == [0.0, 0.0, pytest.approx(10.0)]
    assert limiter.take("producer") == 0.0
    now[0] = 5.0
    assert limiter.take("director") == pytest.approx(5.0)  # half a token back: not yet
    now[0] = 10.0
    assert limiter.take("director") == 0.0
    assert limiter.take("director") == pytest.approx(10.0)


async def test_bad_input_gets_one_clear_message_and_a_proper_status(tmp_path, recorder, pg_url):
    async with offline_app(tmp_path, pg_url) as client:
        bearer = {"Authorization": f"Bearer {TOKENS['director']}"}
        url = "/api/decisions/t-1"
        assert_one_line_json(await client.post(url, content=b"{", headers=bearer), 400, "not JSON")
        huge = await client.post(url, content=b"[" + b"1," * 20000 + b"1]", headers=bearer)
        assert_one_line_json(huge, 413, "larger than")
        shapes = [
            ([1], "expected a JSON object, got an array"),
            ({**SAMPLE_DECISION, "signature": ""}, "unsigned decision"),
            ({**SAMPLE_DECISION, "decision": "approve!"}, "is not one of approve"),
            ({**SAMPLE_DECISION, "admin": True}, "unknown field 'admin'"),
        ]
        for payload, needle in shapes:
            assert_one_line_json(await client.post(url, json=payload, headers=bearer), 400, needle)
        as_producer = await client.post(url, json={**SAMPLE_DECISION, "approver": "producer"}, headers=bearer)
        assert_one_line_json(as_producer, 403, "signed as producer is not yours to send")
        assert_one_line_json(await client.get("/api/queue/more", headers=bearer), 404, "no page")
        assert_one_line_json(await client.get("/api/requests/t!1/x", headers=bearer), 404, "not a task id")
        async with offline_app(tmp_path) as cut_off:  # the ledger cannot be reached: one line, 503
            unreachable = await cut_off.get("/api/queue", headers=bearer)
            assert_one_line_json(unreachable, 503, "ledger database unavailable")
        await log_in(client)
        page = await client.get("/nowhere")
        assert page.status_code == 404 and "no page /nowhere" in page.text and "Traceback" not in page.text
        bad_sha = await client.get("/artifacts/t-1/not-a-sha")
        assert bad_sha.status_code == 404 and "is not an artifact" in bad_sha.text


async def test_a_bug_is_a_500_that_names_no_detail(tmp_path, monkeypatch, recorder, pg_url):
    def broken(settings: Settings) -> None:
        raise RuntimeError("secret internals\nTraceback (most recent call last)")

    monkeypatch.setattr(people, "queue", broken)
    settings = Settings(state_dir=tmp_path, database_url=pg_url)
    app = create_app(settings, tokens=TOKENS)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # the server logs it; we look
    async with httpx.AsyncClient(transport=transport, base_url="http://review.test") as client:
        bearer = {"Authorization": f"Bearer {TOKENS['director']}"}
        api = await client.get("/api/queue", headers=bearer)
        assert_one_line_json(api, 500, "internal error (RuntimeError)")
        await log_in(client)
        page = await client.get("/queue")
        assert page.status_code == 500 and "internal error" in page.text
        assert "secret internals" not in page.text and "Traceback" not in page.text


# ── the JSON API on real servers ─────────────────────────────────────────────────────────────────────


async def test_the_json_api_lists_shows_serves_media_and_relays_a_decision_signed_in_python(lf, sim):
    plan = lf.plan(SHOT_APPROVAL)
    handle = await lf.start(plan)
    tid = plan.task_id
    assert tid is not None
    rid = await wait_open(lf, tid, "approval:shot")
    app = create_app(lf.settings, tokens=TOKENS, relay_timeout=15)
    bearer = {"Authorization": f"Bearer {TOKENS['director']}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r.test") as client:
        queue = (await client.get("/api/queue", headers=bearer)).json()
        mine = [row for row in queue if row["task_id"] == tid]
        assert [(r["request_id"], r["kind"]) for r in mine] == [(rid, "approval")]
        assert set(mine[0]["options"]) == {"approve", "abort"}

        detail = (await client.get(f"/api/requests/{tid}/{rid}", headers=bearer)).json()
        assert detail["status"] == "open" and detail["node"] == "shot"
        assert detail["budget_scopes"][-1] == detail["default_scope"] == f"task:{tid}"
        assert [(a["node"], a["role"]) for a in detail["context_now"]["artifacts"]] == [
            ("shot", "output"),
            ("frame", "input"),
        ]
        assert [a["result"] for a in detail["attempts"]] == ["succeeded"]
        missing = await client.get(f"/api/requests/{tid}/approval:nope", headers=bearer)
        assert_one_line_json(missing, 404, "no request 'approval:nope'")
        assert_one_line_json(await client.get(f"/api/requests/t-nope/{rid}", headers=bearer), 404, "no task")

        # The media the page shows: exactly the bytes the ledger names, with the probed content type.
        media = zip(detail["context_now"]["artifacts"], ["video/mp4", "image/png"], strict=True)
        for artifact, content_type in media:
            served = await client.get(f"/artifacts/{tid}/{artifact['sha256']}", headers=bearer)
            assert served.status_code == 200 and served.headers["content-type"] == content_type
            assert hashlib.sha256(served.content).hexdigest() == artifact["sha256"]
            assert served.headers["content-security-policy"].startswith("sandbox")
        foreign = await client.get(f"/artifacts/{tid}/{'0' * 64}", headers=bearer)
        assert_one_line_json(foreign, 404, "has no artifact")

        key = demo_key("director")
        forged = {**people.signed_payload(key, tid, rid, "approve"), "note": "changed after signing"}
        refused = (await client.post(f"/api/decisions/{tid}", json=forged, headers=bearer)).json()
        assert refused["status"] == "rejected" and "bad signature" in refused["detail"], refused

        payload = people.signed_payload(key, tid, rid, "approve", note="signed in python")
        response = await client.post(f"/api/decisions/{tid}", json=payload, headers=bearer)
        assert response.status_code == 200, response.text
        outcome = response.json()
        assert outcome == {
            "decision_id": payload["decision_id"],
            "status": "accepted",
            "detail": "approve by director",
            "line": "accepted (approve by director)",
        }
        assert (await asyncio.wait_for(handle.result(), 30)).state == "Completed"
        late = people.signed_payload(key, tid, rid, "abort")
        assert_one_line_json(
            await client.post(f"/api/decisions/{tid}", json=late, headers=bearer), 409, "nothing to decide"
        )
    decisions = [parse(e) for e in lf.recorder.read_events(tid) if e.type == "HumanDecision"]
    assert [(d.decision_id, d.note) for d in decisions if isinstance(d, HumanDecision)] == [
        (payload["decision_id"], "signed in python")
    ]
