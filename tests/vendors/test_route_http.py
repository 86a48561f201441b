"""Issue 29 §1, route-configurable HTTP: a jobs-like vendor with other paths and words, behind each ``auth:``
scheme, with no code — only a route file.

Everything is real HTTP on 127.0.0.1: ``Acme`` (uvicorn on a thread) is a vendor whose tasks are
``/v2/tasks`` with ``task_id`` / ``state`` and its own status words, which checks each scheme's credential
itself (bearer, an API-key header, basic, a query parameter, an OAuth2 client-credentials token from its own
token endpoint that counts what it issues, an HMAC signature made by the hook in this module), and which
answers 401 to anything else. A second server on another port is a CDN: it records every request, so a
result URL there must arrive without any credential. The routes are loaded from YAML (``load_table``) and the
adapters built through the registry (``vendors.registry.Adapters``), as a worker does.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from artifacts.store import ArtifactStore
from vendors.adapter import JobStatus, VendorAdapter, VendorJob
from vendors.auth import BearerAuth, OAuth2Token
from vendors.errors import VendorAuthError, VendorBadResponse, VendorRejected
from vendors.registry import Adapters
from vendors.routes import RouteError, load_table, parse_table
from vendors.traced import TracedAdapter

SECRET = "acme-secret-7Qx9"  # the route's credential: the key, a password, the OAuth2 client secret
USER = "acme-user"
CLIENT_ID = "acme-client"
CREDENTIALS = {"ACME_KEY": SECRET, "ACME_USER": USER, "ACME_CLIENT_ID": CLIENT_ID}
API_VERSION = "2024-06-01"
SCHEMES = ("bearer", "header", "basic", "query", "oauth2", "signed")
WORDS = {
    "queued": "running",
    "working": "running",
    "done": "succeeded",
    "error": "failed",
    "aborted": "cancelled",
}
PAYLOAD = b"acme output bytes"


def sign(request: httpx.Request, credential: str) -> None:
    """The ``signed`` route's hook: HMAC-SHA256 of the method, the path with its query and the body."""
    stamp = str(int(time.time()))
    request.headers["X-Acme-Timestamp"] = stamp
    request.headers["X-Acme-Signature"] = _mac(
        credential, request.method, request.url.raw_path, stamp, request.content
    )


def _mac(secret: str, method: str, raw_path: bytes, stamp: str, body: bytes) -> str:
    message = b"\n".join([method.encode(), raw_path, stamp.encode(), body])
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


# ── the vendor ─────────────────────────────────────────────────────────────────────────────────────────────
@dataclass
class AcmeState:
    """What the vendor and its CDN saw and hold (the servers run on a thread: one lock)."""

    cdn_base: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)
    tasks: dict[int, dict[str, Any]] = field(default_factory=dict)
    by_key: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)  # issued token -> when it stops working
    token_requests: int = 0
    token_lifetime: float = 3600.0
    token_delay: float = 0.0
    refused: list[str] = field(default_factory=list)  # "scheme path" of every 401 answered
    api_seen: list[dict[str, Any]] = field(default_factory=list)
    cdn_seen: list[dict[str, Any]] = field(default_factory=list)


def _authorised(scheme: str, request: Request, body: bytes, state: AcmeState) -> bool:
    headers, query = request.headers, request.query_params
    if scheme != "query" and "key" in query:
        return False
    if scheme == "bearer":
        return headers.get("authorization") == f"Bearer {SECRET}"
    if scheme == "header":
        return headers.get("x-api-key") == f"Token {SECRET}" and "authorization" not in headers
    if scheme == "basic":
        return (
            headers.get("authorization") == "Basic " + base64.b64encode(f"{USER}:{SECRET}".encode()).decode()
        )
    if scheme == "query":
        return query.get("key") == SECRET and "authorization" not in headers
    if scheme == "oauth2":
        token = (headers.get("authorization") or "").removeprefix("Bearer ")
        with state.lock:
            return time.time() < state.tokens.get(token, 0.0)
    if scheme == "signed":
        stamp, given = headers.get("x-acme-timestamp", ""), headers.get("x-acme-signature", "")
        raw_path = request.url.path.encode() + (
            b"?" + request.url.query.encode() if request.url.query else b""
        )
        return hmac.compare_digest(given, _mac(SECRET, request.method, raw_path, stamp, body))
    return False


def _task(task: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in task.items() if not k.startswith("_")}


def acme_app(state: AcmeState) -> FastAPI:
    app = FastAPI()

    @app.post("/oauth/token")
    async def token(request: Request) -> Response:
        form = await request.form()
        with state.lock:
            state.token_requests += 1
            count, lifetime, delay = state.token_requests, state.token_lifetime, state.token_delay
        if delay:
            await asyncio.sleep(delay)
        expected = "Basic " + base64.b64encode(f"{CLIENT_ID}:{SECRET}".encode()).decode()
        if form.get("grant_type") != "client_credentials" or request.headers.get("authorization") != expected:
            return JSONResponse({"error": "invalid_client"}, status_code=401)
        issued = f"tok-{count}"
        with state.lock:
            state.tokens[issued] = time.time() + lifetime
        return JSONResponse({"access_token": issued, "token_type": "Bearer", "expires_in": lifetime})

    @app.api_route("/{scheme}/{rest:path}", methods=["GET", "POST"])
    async def api(scheme: str, rest: str, request: Request) -> Response:
        body = await request.body()
        with state.lock:
            state.api_seen.append({"path": request.url.path, "headers": dict(request.headers)})
        if not _authorised(scheme, request, body, state):
            with state.lock:
                state.refused.append(f"{scheme} {request.url.path}")
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        if request.headers.get("x-acme-version") != API_VERSION:
            return JSONResponse({"error": "X-Acme-Version is required"}, status_code=400)
        if rest == "v2/echo":  # a careless vendor: echoes what it was sent into its error message
            echoed = f"{dict(request.headers)} {request.url}"
            return JSONResponse({"error": {"message": f"cannot parse {echoed}"}}, status_code=422)
        if rest == "v2/result":
            return Response(PAYLOAD, media_type="application/octet-stream")
        return _tasks(scheme, rest, request, body, state)

    return app


def _tasks(scheme: str, rest: str, request: Request, body: bytes, state: AcmeState) -> Response:
    with state.lock:
        if rest == "v2/tasks" and request.method == "POST":
            key = request.headers.get("idempotency-key")
            if not key:
                return JSONResponse({"error": "Idempotency-Key is required"}, status_code=400)
            if key in state.by_key:
                return JSONResponse(_task(state.tasks[state.by_key[key]]), status_code=200)
            task_id = 1000 + len(state.tasks)
            where = f"{state.cdn_base}/files/{task_id}.bin" if b"cdn" in body else f"/{scheme}/v2/result"
            state.tasks[task_id] = {"task_id": task_id, "state": "queued", "client_token": key, "_url": where}
            state.by_key[key] = task_id
            return JSONResponse(_task(state.tasks[task_id]), status_code=201)
        if rest == "v2/tasks" and request.method == "GET":
            key = request.query_params.get("client_token")
            found = [_task(t) for t in state.tasks.values() if t["client_token"] == key]
            return JSONResponse({"tasks": found})
        name = rest.removeprefix("v2/tasks/")
        abort = name.endswith(":abort")
        task = (
            state.tasks.get(int(name.removesuffix(":abort")))
            if name.removesuffix(":abort").isdigit()
            else None
        )
        if task is None:
            return JSONResponse({"error": "no such task"}, status_code=404)
        if abort and request.method == "POST":
            task["state"] = "aborted"
        elif request.method == "GET" and task["state"] == "queued":
            task["state"] = "working"
        elif request.method == "GET" and task["state"] == "working":
            task["state"] = "done"
            task["result"] = {"url": task["_url"], "size": len(PAYLOAD)}
            task["cost"] = "0.25"
        return JSONResponse(_task(task))


def cdn_app(state: AcmeState) -> FastAPI:
    app = FastAPI()

    @app.get("/files/{name}")
    async def files(name: str, request: Request) -> Response:
        with state.lock:
            state.cdn_seen.append({"headers": dict(request.headers), "query": dict(request.query_params)})
        return Response(PAYLOAD, media_type="application/octet-stream")

    return app


class Served:
    """An ASGI app served by real uvicorn on a thread, on a free 127.0.0.1 port."""

    def __init__(self, app: FastAPI) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._server.serve(sockets=[self._socket])), daemon=True
        )

    def __enter__(self) -> Served:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, f"{self.url} did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._socket.close()


@dataclass
class Acme:
    url: str
    cdn_url: str
    state: AcmeState


@pytest.fixture(scope="module")
def acme() -> Iterator[Acme]:
    state = AcmeState()
    with Served(acme_app(state)) as api, Served(cdn_app(state)) as cdn:
        state.cdn_base = cdn.url
        yield Acme(api.url, cdn.url, state)


def route(acme: Acme, scheme: str) -> dict[str, Any]:
    """The route file's entry for ``scheme``: the jobs adapter in Acme's words, only configuration."""
    auth: dict[str, Any] = {
        "bearer": {"scheme": "bearer"},
        "header": {"scheme": "header", "name": "X-Api-Key", "prefix": "Token "},
        "basic": {"scheme": "basic", "username_env": "ACME_USER"},
        "query": {"scheme": "query", "name": "key"},
        "oauth2": {
            "scheme": "oauth2_client_credentials",
            "token_url": f"{acme.url}/oauth/token",
            "client_id_env": "ACME_CLIENT_ID",
            "scope": "tasks.write",
        },
        "signed": {"scheme": "signed", "hook": f"{__name__}:sign"},
    }[scheme]
    return {
        "adapter": "jobs",
        "base_url": f"{acme.url}/{scheme}",
        "credential_env": "ACME_KEY",
        "auth": auth,
        "headers": {"X-Acme-Version": API_VERSION},
        "paths": {
            "submit": "/v2/tasks",
            "get": "/v2/tasks/{job_id}",
            "cancel": "/v2/tasks/{job_id}:abort",
            "find": "/v2/tasks?client_token={operation_key}",
        },
        "shape": {"id_field": "task_id", "status_field": "state", "list_field": "tasks", "statuses": WORDS},
        "allow_private": [acme.cdn_url],  # the CDN is on loopback: allow-listed, and so fetched without a key
        "timeouts": {"request": 5},
    }


def no_store(uri: str) -> ArtifactStore:
    raise AssertionError("no artifacts here")


@pytest.fixture
async def adapters(acme: Acme, tmp_path: Path) -> AsyncIterator[Adapters]:
    """Every scheme's route, from a route file, built by the registry as a worker builds them."""
    (tmp_path / "routes.yaml").write_text(
        yaml.safe_dump({"routes": {f"acme.{s}": route(acme, s) for s in SCHEMES}})
    )
    table = load_table(tmp_path / "routes.yaml")
    async with httpx.AsyncClient() as client:
        built = Adapters(
            table, vendor_url=None, credential=CREDENTIALS.__getitem__, client=client, store_for=no_store
        )
        yield built
        await built.aclose()


async def submit(adapter: VendorAdapter, key: str, *, cdn: bool = False) -> VendorJob:
    return await adapter.submit(
        operation_key=key,
        executor="acme.task",
        request={"prompt": "cdn" if cdn else "own"},
        estimate=Decimal(1),
    )


async def finished(adapter: VendorAdapter, job: VendorJob) -> VendorJob:
    while job.status == JobStatus.RUNNING:
        job = await adapter.get(job.id)
    return job


async def fetch(adapter: VendorAdapter, job: VendorJob) -> bytes:
    chunks: list[bytes] = []
    await adapter.download(job, chunks.append)
    return b"".join(chunks)


def token_requests(acme: Acme) -> int:
    with acme.state.lock:
        return acme.state.token_requests


def oauth(adapters: Adapters) -> OAuth2Token:
    adapter = adapters.get("acme.oauth2")
    assert isinstance(adapter, TracedAdapter)
    auth = adapter.inner._auth  # type: ignore[attr-defined]
    assert isinstance(auth, OAuth2Token)
    return auth


# ── every scheme, end to end ──────────────────────────────────────────────────────────────────────────────
@pytest.mark.parametrize("scheme", SCHEMES)
async def test_a_jobs_like_vendor_in_other_words_works_behind_each_auth_scheme(
    acme: Acme, adapters: Adapters, scheme: str
) -> None:
    adapter = adapters.get(f"acme.{scheme}")
    key = f"op-{scheme}-{time.monotonic_ns()}"
    with acme.state.lock:
        refused_before = len(acme.state.refused)

    job = await submit(adapter, key)
    assert (
        job.status == JobStatus.RUNNING and job.id.isdigit()
    )  # task_id (a number) and "queued", read as ours
    again = await submit(adapter, key)  # the Idempotency-Key still goes: the same task
    assert again.id == job.id
    done = await finished(adapter, job)
    assert done.status == JobStatus.SUCCEEDED and done.cost == "0.25" and done.result is not None
    assert [j.id for j in await adapter.find_by_key(key)] == [job.id]  # found by its key, in its list
    assert await fetch(adapter, done) == PAYLOAD  # the result on the route's own origin: with the credential

    other = await submit(adapter, f"{key}-b")
    cancelled = await adapter.cancel(other.id)
    assert cancelled.status == JobStatus.CANCELLED  # "aborted", through the cancel path template

    with acme.state.lock:
        assert acme.state.refused[refused_before:] == []  # every call carried what this scheme needs


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_a_result_on_another_origin_gets_no_credential_whatever_the_scheme(
    acme: Acme, adapters: Adapters, scheme: str
) -> None:
    adapter = adapters.get(f"acme.{scheme}")
    job = await finished(adapter, await submit(adapter, f"cdn-{scheme}-{time.monotonic_ns()}", cdn=True))
    assert job.result is not None and job.result.url.startswith(acme.cdn_url)
    with acme.state.lock:
        before = len(acme.state.cdn_seen)

    assert await fetch(adapter, job) == PAYLOAD

    with acme.state.lock:
        (seen,) = acme.state.cdn_seen[before:]
    assert seen["query"] == {}
    sent = {k.lower(): v for k, v in seen["headers"].items()}
    assert not {"authorization", "x-api-key", "x-acme-signature", "x-acme-version"} & set(sent)
    assert all(SECRET not in v and "tok-" not in v for v in sent.values())


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_the_credential_never_reaches_an_error_message(
    acme: Acme, adapters: Adapters, scheme: str
) -> None:
    adapter = adapters.get(f"acme.{scheme}")
    inner = adapter.inner  # type: ignore[attr-defined]
    with pytest.raises(VendorRejected) as e:
        await inner.request("GET", "/v2/echo")  # the vendor echoes every header and the URL into its error
    assert "cannot parse" in str(e.value)
    assert SECRET not in str(e.value) and base64.b64encode(f"{USER}:{SECRET}".encode()).decode() not in str(
        e.value
    )
    assert "tok-" not in str(e.value)


# ── OAuth2: one token for many calls, renewed before expiry and after a 401 ──────────────────────────────
async def test_an_oauth2_token_is_fetched_once_for_many_concurrent_calls(
    acme: Acme, adapters: Adapters
) -> None:
    adapter = adapters.get("acme.oauth2")
    acme.state.token_delay = 0.2  # the calls all arrive while the first fetch is still under way
    before = token_requests(acme)
    try:
        jobs = await asyncio.gather(*(submit(adapter, f"many-{i}-{time.monotonic_ns()}") for i in range(10)))
    finally:
        acme.state.token_delay = 0.0
    assert len({j.id for j in jobs}) == 10
    await asyncio.gather(*(adapter.get(j.id) for j in jobs))
    assert token_requests(acme) - before == 1
    assert oauth(adapters).fetches == 1


async def test_an_oauth2_token_is_renewed_shortly_before_it_expires(acme: Acme, adapters: Adapters) -> None:
    adapter = adapters.get("acme.oauth2")
    acme.state.token_lifetime = 1.0  # renewed a tenth of its life early: after 0.9 s
    before = token_requests(acme)
    try:
        job = await submit(adapter, f"expiry-{time.monotonic_ns()}")
        await adapter.get(job.id)
        assert token_requests(acme) - before == 1
        await asyncio.sleep(1.0)
        await adapter.get(job.id)
    finally:
        acme.state.token_lifetime = 3600.0
    assert token_requests(acme) - before == 2
    with acme.state.lock:
        assert not [r for r in acme.state.refused if r.startswith("oauth2 ")]  # renewed before, not after


async def test_an_oauth2_token_revoked_early_is_renewed_after_one_401(acme: Acme, adapters: Adapters) -> None:
    adapter = adapters.get("acme.oauth2")
    job = await submit(adapter, f"revoked-{time.monotonic_ns()}")
    before = token_requests(acme)
    with acme.state.lock:
        acme.state.tokens.clear()  # the vendor revokes every token it issued
        refused_before = len(acme.state.refused)

    polled = await adapter.get(job.id)

    assert polled.id == job.id
    assert token_requests(acme) - before == 1
    with acme.state.lock:
        assert len(acme.state.refused[refused_before:]) == 1  # one 401, then the resend with a fresh token


async def test_an_oauth2_client_the_token_endpoint_refuses_is_an_auth_error_without_its_secret(
    acme: Acme, tmp_path: Path
) -> None:
    wrong = {**CREDENTIALS, "ACME_CLIENT_ID": "someone-else"}
    table = parse_table({"routes": {"acme.oauth2": route(acme, "oauth2")}})
    async with httpx.AsyncClient() as client:
        built = Adapters(
            table, vendor_url=None, credential=wrong.__getitem__, client=client, store_for=no_store
        )
        with pytest.raises(VendorAuthError) as e:
            await submit(built.get("acme.oauth2"), f"refused-{time.monotonic_ns()}")
    assert e.value.refused and "invalid_client" in str(e.value) and SECRET not in str(e.value)


# ── what a jobs-like vendor's words do at the edges ─────────────────────────────────────────────────────────
async def test_a_status_word_the_route_does_not_list_is_an_unreadable_answer(acme: Acme) -> None:
    spec = route(acme, "bearer")
    spec["shape"] = {
        **spec["shape"],
        "statuses": {"queued": "running", "done": "succeeded", "error": "failed"},
    }
    table = parse_table({"routes": {"acme.few": spec}})
    async with httpx.AsyncClient() as client:
        built = Adapters(
            table, vendor_url=None, credential=CREDENTIALS.__getitem__, client=client, store_for=no_store
        )
        adapter = built.get("acme.few")
        job = await submit(adapter, f"words-{time.monotonic_ns()}")
        with pytest.raises(VendorBadResponse, match=r"'working' is not in the route's shape\.statuses"):
            await adapter.get(job.id)


def test_a_route_file_refuses_each_mistake_in_one_line_naming_the_route_and_the_field(acme: Acme) -> None:
    good = route(acme, "bearer")
    cases: list[tuple[dict[str, Any], tuple[str, ...]]] = [
        ({"auth": {"scheme": "kerberos"}}, ("auth scheme 'kerberos' is not one of bearer, header, basic",)),
        ({"auth": {"scheme": "header"}}, ("auth.name is required",)),
        ({"auth": {"scheme": "basic", "username_env": "not a name"}}, ("auth.username_env",)),
        (
            {"auth": {"scheme": "oauth2_client_credentials", "token_url": "ftp://x", "client_id_env": "A"}},
            ("auth.token_url",),
        ),
        ({"auth": {"scheme": "signed", "hook": "no_such_module_x:sign"}}, ("auth.hook", "No module named")),
        (
            {"auth": {"scheme": "signed", "hook": "not a path"}},
            ("auth.hook must be package.module:function",),
        ),
        ({"auth": {"scheme": "query", "name": "key", "value": SECRET}}, ("auth.value is not a known field",)),
        ({"headers": {"Authorization": "Bearer x"}}, ("headers 'Authorization' may not be set by a route",)),
        ({"headers": {"Cookie": "a=b"}}, ("headers 'Cookie' may not be set",)),
        ({"headers": {"Host": "evil.example"}}, ("headers 'Host' may not be set",)),
        ({"headers": {"Bad Name": "x"}}, ("'Bad Name' is not a header name",)),
        ({"headers": {"X-Ok": "two\nlines"}}, ("'X-Ok': the value must be one line",)),
        (
            {"paths": {**good["paths"], "get": "/v2/tasks/{id}"}},
            ("paths.get: {id} is not one of its placeholders ({job_id})",),
        ),
        ({"paths": {**good["paths"], "cancel": "/v2/tasks/abort"}}, ("paths.cancel must hold {job_id}",)),
        (
            {"paths": {**good["paths"], "find": "https://evil.example/x?k={operation_key}"}},
            ("paths.find must be a path",),
        ),
        ({"paths": {**good["paths"], "get": "/v2/tasks/{job_id"}}, ("paths.get has an unbalanced brace",)),
        (
            {"paths": {**good["paths"], "list": "/v2/tasks"}},
            ("paths.list is not a path of the 'jobs' adapter",),
        ),
        (
            {"adapter": "openai", "shape": None},
            ("paths: the 'openai' adapter has no paths a route may change",),
        ),
        ({"adapter": "openai", "paths": {}}, ("shape is not read by the 'openai' adapter",)),
        (
            {"shape": {"statuses": {"queued": "running", "done": "succeeded"}}},
            ("shape.statuses must map a vendor word to failed",),
        ),
        ({"shape": {"statuses": {"queued": "pending"}}}, ("shape.statuses.queued",)),
        ({"shape": {"id_field": "task id"}}, ("shape.id_field",)),
    ]
    for change, needles in cases:
        spec = {k: v for k, v in {**good, **change}.items() if v is not None}
        with pytest.raises(RouteError) as e:
            parse_table({"routes": {"acme.r": spec}}, where="route file r.yaml")
        line = str(e.value)
        assert "\n" not in line and line.startswith("route file r.yaml: route 'acme.r':"), line
        for needle in needles:
            assert needle in line, (change, line)
        assert SECRET not in line


def test_auth_defaults_to_bearer_and_a_bare_scheme_name_is_its_shorthand() -> None:
    routes = parse_table({"routes": {"plain": {}, "short": {"auth": "bearer"}}}).routes
    assert routes["plain"].auth == routes["short"].auth == BearerAuth()
    assert (routes["plain"].headers, routes["plain"].paths, routes["plain"].shape) == ({}, {}, None)
