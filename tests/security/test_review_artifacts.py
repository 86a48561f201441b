"""Issue 24 §4: the reviewer page serves an artifact only if the task's fold registered it and its URI lies
inside the configured store, and the bytes it streams hash to the recorded sha256.

Each task here is seeded in the real ledger as an earlier run (or an older version of the validator) left it:
a plan recorded as it was accepted then, and an Outcome registering a node's output. The page reads it as it
reads any task, over real Postgres; the media is streamed by a real uvicorn where the wire matters.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from web.reviewkit import TOKENS, served

from artifacts import LocalStore, S3Store
from ledgerflow.review import create_app
from rules.actions import Dispatch
from rules.events import ArtifactRef, Intent, Outcome, TaskCreated, to_new
from rules.plan import Plan, budget_scopes, load_plan
from rules.projection import fold
from rules.table import decide
from runtime.settings import Settings
from vendors.routes import DEFAULT_ROUTES

BEARER = {"Authorization": f"Bearer {TOKENS['director']}"}
ONE_STAGE = "goal: g\nbudget_ceiling: 5\nstages:\n  - {id: a, executor: llm.text, estimate: 1}\n"


def seed(recorder: Any, plan: Plan, output: ArtifactRef | None = None) -> str:
    """Record ``plan`` as a task, and ``output`` (if given) as its first node's registered output."""
    task_id = str(plan.task_id)
    epoch = recorder.take_lease(task_id, "an earlier run")
    recorder.open_budget(task_id, budget_scopes(plan, task_id))
    recorder.append_fenced(task_id, epoch, [to_new(TaskCreated(plan=plan), dedup_key=f"{task_id}:created")])
    if output is None:
        return task_id
    p = fold(recorder.read_events(task_id))
    decided = decide(p, p.created_at)
    assert decided is not None and isinstance(decided[1], Dispatch), decided
    rule, action = decided
    intent = Intent(
        action=action, rule=rule, watermark=p.watermark, decided_at=p.created_at, reservation=action.estimate
    )
    key = action.operation_key
    new = to_new(intent, dedup_key=f"{task_id}:intent:{p.watermark}:1", operation_key=key)
    recorder.append_fenced(task_id, epoch, [new], reserve=action.estimate)
    outcome = Outcome(node=action.node, operation_key=key, artifact=output, actual_cost=0)
    # Settled as the executor settles it (the reservation released), so the shared project's accounts still
    # equal the fold of its tasks (other tests audit them).
    result = to_new(outcome, dedup_key=f"{key}:result", operation_key=key)
    recorder.append_idempotent(task_id, result, release=action.estimate)
    registered = fold(recorder.read_events(task_id)).nodes[action.node].artifact
    assert registered is not None and registered["uri"] == output.uri  # the fold registered it
    return task_id


def task_id() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def page(settings: Settings) -> httpx.AsyncClient:
    app = create_app(settings, tokens=TOKENS)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://review.test")


def secret_file(tmp_path: Path) -> tuple[Path, str]:
    """A file outside every store, as the page's own environment file would be."""
    path = tmp_path / "page.env"
    path.write_bytes(b"LEDGERFLOW_REVIEW_TOKENS={...}\nPGPASSWORD=hunter2\n")
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


async def test_an_artifact_shaped_value_in_a_plans_input_is_never_served(recorder, pg_url, tmp_path):
    path, sha = secret_file(tmp_path)
    # Built by the model alone: the plan an older validator accepted, with a "reference" a plan author typed.
    leak = {"uri": path.as_uri(), "sha256": sha, "size": path.stat().st_size}
    plan = Plan.model_validate(
        {
            "task_id": task_id(),
            "goal": "g",
            "budget_ceiling": 5,
            "stages": [{"id": "a", "executor": "llm.text", "estimate": 1, "input": {"style": {"ref": leak}}}],
        }
    )
    tid = seed(recorder, plan)
    settings = Settings(database_url=pg_url, state_dir=tmp_path, artifact_dir=tmp_path / "store")
    async with page(settings) as client:
        served_ = await client.get(f"/artifacts/{tid}/{sha}", headers=BEARER)
    assert served_.status_code == 404, served_.text
    assert "PGPASSWORD" not in served_.text
    assert served_.json()["error"] == f"task {tid} has no artifact {sha[:16]}…"


async def test_a_registered_output_outside_the_local_store_is_not_served(recorder, pg_url, tmp_path):
    path, sha = secret_file(tmp_path)
    tid = seed(
        recorder,
        load_plan(ONE_STAGE, DEFAULT_ROUTES, task_id=task_id()),
        ArtifactRef(uri=path.as_uri(), sha256=sha),
    )
    settings = Settings(database_url=pg_url, state_dir=tmp_path, artifact_dir=tmp_path / "store")
    async with page(settings) as client:
        served_ = await client.get(f"/artifacts/{tid}/{sha}", headers=BEARER)
    assert served_.status_code == 404, served_.text
    assert "PGPASSWORD" not in served_.text
    error = served_.json()["error"]
    assert error == f"artifact {sha[:16]}… of task {tid} is not in the configured artifact store", error


async def test_a_registered_output_escaping_the_store_by_dot_dot_is_not_served(recorder, pg_url, tmp_path):
    path, sha = secret_file(tmp_path)
    store = tmp_path / "store"
    store.mkdir()
    sneaky = f"{store.as_uri()}/../{path.name}"  # starts with the store's root, resolves outside it
    tid = seed(
        recorder, load_plan(ONE_STAGE, DEFAULT_ROUTES, task_id=task_id()), ArtifactRef(uri=sneaky, sha256=sha)
    )
    settings = Settings(database_url=pg_url, state_dir=tmp_path, artifact_dir=store)
    async with page(settings) as client:
        served_ = await client.get(f"/artifacts/{tid}/{sha}", headers=BEARER)
    assert served_.status_code == 404 and "not in the configured artifact store" in served_.text


async def test_a_registered_output_outside_the_s3_prefix_is_not_served(
    recorder, pg_url, tmp_path, s3_endpoint, monkeypatch
):
    monkeypatch.setenv("LEDGERFLOW_S3_ENDPOINT", s3_endpoint.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_endpoint.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_endpoint.secret_access_key)
    prefix = f"arts-{uuid.uuid4().hex[:8]}"
    # Another prefix of the same bucket (another deployment's, or a sibling whose name starts the same).
    other = S3Store(
        s3_endpoint.bucket,
        f"{prefix}-other",
        endpoint=s3_endpoint.url,
        access_key_id=s3_endpoint.access_key_id,
        secret_access_key=s3_endpoint.secret_access_key,
        staging_dir=tmp_path / "staging",
    )
    stored = other.put_bytes(b"someone else's bytes")
    tid = seed(
        recorder,
        load_plan(ONE_STAGE, DEFAULT_ROUTES, task_id=task_id()),
        ArtifactRef(uri=stored.uri, sha256=stored.sha256, size=stored.size),
    )
    settings = Settings(
        database_url=pg_url, state_dir=tmp_path, artifact_store=f"s3://{s3_endpoint.bucket}/{prefix}"
    )
    async with page(settings) as client:
        served_ = await client.get(f"/artifacts/{tid}/{stored.sha256}", headers=BEARER)
    assert served_.status_code == 404, served_.text
    assert "not in the configured artifact store" in served_.json()["error"]


async def test_bytes_that_no_longer_hash_to_their_sha256_end_the_response_and_are_logged(
    recorder, pg_url, tmp_path, caplog
):
    store = LocalStore(tmp_path / "store")
    data = bytes(range(256)) * (10 * 1024)  # 2.5 MiB: several chunks
    stored = store.put_bytes(data)
    ref = ArtifactRef(uri=stored.uri, sha256=stored.sha256, size=stored.size)
    tid = seed(recorder, load_plan(ONE_STAGE, DEFAULT_ROUTES, task_id=task_id()), ref)
    settings = Settings(database_url=pg_url, state_dir=tmp_path, artifact_dir=tmp_path / "store")
    url = f"/artifacts/{tid}/{stored.sha256}"
    with served(create_app(settings, tokens=TOKENS)) as base:
        async with httpx.AsyncClient(base_url=base, headers=BEARER) as client:
            whole = await client.get(url)
            assert whole.status_code == 200 and hashlib.sha256(whole.content).hexdigest() == stored.sha256

            # The stored file is changed behind the ledger's back (same size, one byte different).
            on_disk = Path(store.root / stored.sha256[:2] / stored.sha256)
            corrupt = bytearray(data)
            corrupt[-1] ^= 0xFF
            on_disk.write_bytes(bytes(corrupt))
            caplog.set_level(logging.ERROR, logger="ledgerflow.review")
            got = b""
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream("GET", url) as response:
                    assert response.status_code == 200  # the headers left before the last byte was read
                    async for chunk in response.aiter_bytes():
                        got += chunk
    assert len(got) < len(data)  # never the whole body, as if it were fine
    logged = [r.getMessage() for r in caplog.records if r.name == "ledgerflow.review"]
    assert any(
        f"artifact {stored.sha256[:16]}… of task {tid}" in m and "does not hash" in m for m in logged
    ), logged
