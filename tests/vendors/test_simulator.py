"""The vendor simulator and JobsAdapter, over real HTTP against a real uvicorn server."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from ledgerflow.stack.pg import free_port
from media import probe
from vendors.adapter import JobErrorKind, JobStatus, ResultFile, VendorJob
from vendors.errors import (
    ArtifactHashMismatch,
    VendorCannotTell,
    VendorConflict,
    VendorError,
    VendorNotFound,
    VendorRateLimited,
    VendorUnavailable,
    VendorWaitTimeout,
)
from vendors.jobs import JobsAdapter
from vendors.routes import RouteSpec, Timeouts
from vendors.simulator import Draw, ExecutorProfile

if TYPE_CHECKING:
    from tests.vendors.conftest import SimAdmin

EXECUTOR = "video.motion"
INPUT = {"prompt": "a fox crossing a frozen river", "seconds": 4}
ESTIMATE = Decimal("2.50")
BODY = {"executor": EXECUTOR, "input": INPUT, "estimate": "2.50"}


async def submit(vendor: JobsAdapter, key: str, **overrides: object) -> VendorJob:
    args: dict = {"operation_key": key, "executor": EXECUTOR, "request": INPUT, "estimate": ESTIMATE}
    return await vendor.submit(**{**args, **overrides})


async def test_same_key_same_body_returns_the_same_job_and_charges_once(
    sim: SimAdmin, vendor: JobsAdapter, key: str
) -> None:
    created = await sim.client.post("/jobs", json=BODY, headers={"Idempotency-Key": key})
    replayed = await sim.client.post("/jobs", json=BODY, headers={"Idempotency-Key": key})
    via_adapter = await submit(vendor, key)

    assert (created.status_code, replayed.status_code) == (201, 200)
    assert created.json()["id"] == replayed.json()["id"] == via_adapter.id
    charges = await sim.charges()
    assert (charges["count"], charges["total"]) == (1, "2.5000")


async def test_same_key_different_body_is_a_conflict(sim: SimAdmin, vendor: JobsAdapter, key: str) -> None:
    await submit(vendor, key)

    raw = await sim.client.post(
        "/jobs", json={**BODY, "input": {"prompt": "other"}}, headers={"Idempotency-Key": key}
    )
    assert raw.status_code == 409
    assert raw.json()["error"]["code"] == "idempotency_conflict"
    with pytest.raises(VendorConflict):
        await submit(vendor, key, estimate=Decimal("3"))
    assert (await sim.charges())["count"] == 1


async def test_dropped_response_is_unavailable_yet_charged_and_found_by_key(
    sim: SimAdmin, vendor: JobsAdapter, key: str
) -> None:
    await sim.configure(default={"drop_response": 1})

    with pytest.raises(VendorUnavailable) as lost:
        await submit(vendor, key)

    assert lost.value.status_code == 502
    charges = await sim.charges()
    assert charges["count"] == 1
    found = await vendor.find_by_key(key)
    assert [job.id for job in found] == [charges["charges"][0]["job_id"]]
    # Resubmitting under the same key adopts the charged job instead of paying twice.
    assert (await submit(vendor, key)).id == found[0].id
    assert (await sim.charges())["count"] == 1


async def test_rate_limit_raises_rate_limited_with_retry_after_and_charges_nothing(
    sim: SimAdmin, vendor: JobsAdapter, key: str
) -> None:
    await sim.configure(default={"rate_limit": 1})

    with pytest.raises(VendorRateLimited) as limited:
        await submit(vendor, key)

    assert limited.value.retry_after == 1.0
    raw = await sim.client.post("/jobs", json=BODY, headers={"Idempotency-Key": key})
    assert (raw.status_code, raw.headers["retry-after"]) == (429, "1")
    assert (await sim.charges())["count"] == 0
    assert await vendor.find_by_key(key) == []


async def test_server_error_raises_unavailable_and_charges_nothing(
    sim: SimAdmin, vendor: JobsAdapter, key: str
) -> None:
    await sim.configure(default={"server_error": 1})

    with pytest.raises(VendorUnavailable) as failed:
        await submit(vendor, key)

    assert failed.value.status_code == 500
    assert (await sim.charges())["count"] == 0
    assert await vendor.find_by_key(key) == []


async def test_content_rejection_fails_the_job_with_content_rejected_and_still_charges(
    sim: SimAdmin, vendor: JobsAdapter, key: str
) -> None:
    await sim.configure(default={"reject_content": 1})

    job = await submit(vendor, key)

    assert job.status is JobStatus.FAILED
    assert job.error is not None and job.error.kind is JobErrorKind.CONTENT_REJECTED
    assert job.result is None
    assert (await sim.charges())["count"] == 1


async def test_executor_profile_overrides_default_for_technical_failures(
    sim: SimAdmin, vendor: JobsAdapter, key: str
) -> None:
    await sim.configure(executors={EXECUTOR: {"fail_technical": 1}})

    failing = await submit(vendor, key)
    other = await submit(vendor, key + "-img", executor="image.still")

    assert failing.status is JobStatus.FAILED
    assert failing.error is not None and failing.error.kind is JobErrorKind.TECHNICAL
    assert other.status is JobStatus.SUCCEEDED


async def test_cost_is_profile_cost_or_estimate_times_multiplier(
    sim: SimAdmin, vendor: JobsAdapter, key: str
) -> None:
    await sim.configure(
        default={"cost_multiplier": "1.5"}, executors={EXECUTOR: {"cost": "0.75", "cost_multiplier": "2"}}
    )

    fixed = await submit(vendor, key)
    estimated = await submit(vendor, key + "-img", executor="image.still")

    assert (Decimal(fixed.cost or "nan"), Decimal(estimated.cost or "nan")) == (
        Decimal("1.5"),
        Decimal("3.75"),
    )
    charges = await sim.charges()
    assert [c["amount"] for c in charges["charges"]] == ["1.5000", "3.7500"]
    assert charges["total"] == "5.2500"


async def test_latency_reports_running_with_growing_progress_then_succeeded(
    sim: SimAdmin, vendor: JobsAdapter, key: str
) -> None:
    await sim.configure(executors={EXECUTOR: {"latency_seconds": 0.3}})
    polls: list[VendorJob] = []

    job = await submit(vendor, key)
    done = await vendor.wait(job.id, poll_interval=0.04, on_poll=polls.append, timeout=5)

    assert job.status is JobStatus.RUNNING and job.progress < 0.5
    assert done.status is JobStatus.SUCCEEDED and done.progress == 1.0
    running = [p.progress for p in polls if p.status is JobStatus.RUNNING]
    assert len(running) >= 2 and running == sorted(running) and 0 < running[-1] < 1
    assert polls[-1] == done


async def test_hung_job_stays_running_without_progress_and_wait_times_out(
    sim: SimAdmin, vendor: JobsAdapter, key: str
) -> None:
    await sim.configure(default={"hang": 1})

    job = await submit(vendor, key)
    with pytest.raises(VendorWaitTimeout):
        await vendor.wait(job.id, poll_interval=0.05, timeout=0.2)

    still = await vendor.get(job.id)
    assert (still.status, still.progress) == (JobStatus.RUNNING, 0.0)
    assert (await sim.charges())["count"] == 1


async def test_fetch_result_returns_bytes_matching_the_advertised_sha256(
    sim: SimAdmin, vendor: JobsAdapter, key: str
) -> None:
    job = await submit(vendor, key)

    content = await vendor.fetch_result(job)

    assert job.result is not None
    assert hashlib.sha256(content).hexdigest() == job.result.sha256
    assert len(content) == job.result.size
    assert json.loads(content)["input"] == INPUT


async def test_fetch_result_rejects_a_corrupted_artifact(
    sim: SimAdmin, vendor: JobsAdapter, key: str
) -> None:
    await sim.configure(default={"corrupt_result": 1})
    job = await submit(vendor, key)

    with pytest.raises(ArtifactHashMismatch) as mismatch:
        await vendor.fetch_result(job)

    assert job.result is not None and mismatch.value.expected == job.result.sha256


async def test_result_of_an_unfinished_job_is_409(sim: SimAdmin, vendor: JobsAdapter, key: str) -> None:
    await sim.configure(default={"latency_seconds": 30})
    job = await submit(vendor, key)

    response = await sim.client.get(f"/jobs/{job.id}/result")

    assert response.status_code == 409


async def test_cancel_stops_a_running_job_idempotently_and_keeps_the_charge(
    sim: SimAdmin, vendor: JobsAdapter, key: str
) -> None:
    await sim.configure(default={"latency_seconds": 30})
    job = await submit(vendor, key)

    cancelled = await vendor.cancel(job.id)
    again = await vendor.cancel(job.id)

    assert cancelled.status is again.status is JobStatus.CANCELLED
    assert (await vendor.get(job.id)).status is JobStatus.CANCELLED
    assert (await sim.charges())["count"] == 1


async def test_cancel_of_a_finished_job_answers_409_and_leaves_it_succeeded(
    sim: SimAdmin, vendor: JobsAdapter, key: str
) -> None:
    job = await submit(vendor, key)

    raw = await sim.client.post(f"/jobs/{job.id}/cancel")
    via_adapter = await vendor.cancel(job.id)

    assert raw.status_code == 409
    assert via_adapter.status is JobStatus.SUCCEEDED


async def test_lookup_only_mode_charges_every_post_but_lookup_finds_them_all(
    sim: SimAdmin, vendor: JobsAdapter, key: str
) -> None:
    await sim.configure(mode="lookup_only")

    first = await submit(vendor, key)
    second = await submit(vendor, key)

    assert first.id != second.id
    assert (await sim.charges())["count"] == 2
    assert [job.id for job in await vendor.find_by_key(key)] == [first.id, second.id]


async def test_none_mode_cannot_tell_on_lookup(sim: SimAdmin, vendor: JobsAdapter, key: str) -> None:
    await sim.configure(mode="none")
    await submit(vendor, key)
    await submit(vendor, key)

    with pytest.raises(VendorCannotTell):
        await vendor.find_by_key(key)
    raw = await sim.client.get("/jobs", params={"idempotency_key": key})
    assert raw.status_code == 501
    assert (await sim.charges())["count"] == 2


async def _outcomes(vendor: JobsAdapter, order: list[str]) -> dict[tuple[str, int], str]:
    """Submit each key in ``order``; describe every attempt's outcome by (key, attempt number)."""
    seen: dict[tuple[str, int], str] = {}
    for key in order:
        attempt = sum(1 for k, _ in seen if k == key)
        try:
            job = await submit(vendor, key)
            seen[key, attempt] = f"{job.id} {job.status} {job.error.kind if job.error else ''}"
        except VendorError as e:
            seen[key, attempt] = type(e).__name__
    return seen


def _kinds(outcomes: dict[tuple[str, int], str]) -> dict[tuple[str, int], str]:
    """The outcomes without job ids, which differ between seeds by construction."""
    return {attempt: outcome.split(" ", 1)[-1] for attempt, outcome in outcomes.items()}


async def test_same_seed_and_keys_give_the_same_outcomes_across_a_reset_whatever_the_order(
    sim: SimAdmin, vendor: JobsAdapter
) -> None:
    faults = {"fail_technical": 0.2, "reject_content": 0.2, "rate_limit": 0.15, "server_error": 0.15}
    faults["drop_response"] = 0.15
    await sim.configure(seed=7, default=faults)
    keys = [f"determinism-{i}" for i in range(25)]

    first = await _outcomes(vendor, [k for k in keys for _ in range(2)])
    first_total = (await sim.charges())["total"]
    await sim.reset()
    second = await _outcomes(vendor, list(reversed(keys)) * 2)
    assert (await sim.charges())["total"] == first_total
    await sim.reset()
    await sim.configure(seed=8, default=faults)
    other_seed = await _outcomes(vendor, keys * 2)

    assert second == first
    assert len(set(_kinds(first).values())) >= 4  # the workload really exercises several outcomes
    limited = [[first[k, n] == "VendorRateLimited" for n in (0, 1)] for k in keys]
    assert [True, False] in limited  # a retry of a key draws afresh rather than repeating its first fate
    assert _kinds(other_seed) != _kinds(first)


# Draws of seed 7 for keys golden-0..5 (attempt 0), recorded before bad_media and missing_rights existed:
# (rate_limited, server_error, dropped, hang, failure, corrupt, fail_at).
GOLDEN_DRAWS = [
    (False, False, True, False, None, False, 0.4425016703673994),
    (False, False, True, False, "technical", True, 0.17723594385917343),
    (False, False, False, False, None, False, 0.6780392167811664),
    (False, True, True, False, "content_rejected", False, 0.2999583693690241),
    (True, False, False, True, None, False, 0.7065697180013316),
    (True, True, False, False, "content_rejected", False, 0.25499841384454136),
]
OLD_RATES = {
    "fail_technical": 0.3,
    "reject_content": 0.3,
    "rate_limit": 0.3,
    "server_error": 0.3,
    "drop_response": 0.3,
    "hang": 0.3,
    "corrupt_result": 0.3,
}
ASKED = {"prompt": "a fox", "format": "mp4", "duration_s": 3, "width": 320, "height": 180}


@pytest.mark.parametrize("new_rates", [{}, {"bad_media": 1.0, "missing_rights": 1.0}])
def test_the_media_rates_leave_every_earlier_seeded_draw_unchanged(new_rates: dict[str, float]) -> None:
    profile = ExecutorProfile(**OLD_RATES, **new_rates)
    draws = [Draw.for_attempt(7, f"golden-{i}", 0, profile) for i in range(6)]
    old = [
        (d.rate_limited, d.server_error, d.dropped, d.hang, d.failure, d.corrupt, d.fail_at) for d in draws
    ]
    assert old == GOLDEN_DRAWS
    assert all(d.bad_media == d.missing_rights == bool(new_rates) for d in draws)


def test_the_media_rates_draw_independently_of_each_other() -> None:
    half = ExecutorProfile(bad_media=0.5, missing_rights=0.5)
    draws = [Draw.for_attempt(3, f"k{i}", 0, half) for i in range(200)]
    pairs = {(d.bad_media, d.missing_rights) for d in draws}
    assert pairs == {(False, False), (False, True), (True, False), (True, True)}


async def test_a_result_reports_the_media_that_was_asked_for_with_rights(
    sim: SimAdmin, vendor: JobsAdapter, key: str
) -> None:
    job = await submit(vendor, key, request=ASKED)
    plain = await submit(vendor, key + "-plain")

    assert job.result is not None and job.result.media is not None
    assert job.result.media.model_dump() == {
        "format": "mp4",
        "duration_s": 3.0,
        "width": 320,
        "height": 180,
        "rights": {"license": "sim-commercial-1.0", "holder": f"simulator/{EXECUTOR}"},
    }
    assert plain.result is not None and plain.result.media is not None  # nothing asked: defaults
    assert (plain.result.media.format, plain.result.media.duration_s, plain.result.media.width) == (
        "json",
        None,
        None,
    )


async def test_bad_media_delivers_a_real_file_outside_what_was_asked_and_says_so(
    sim: SimAdmin, vendor: JobsAdapter, key: str, tmp_path: Path
) -> None:
    good = await submit(vendor, key, request=ASKED)
    await sim.reset()
    await sim.configure(executors={EXECUTOR: {"bad_media": 1.0}})
    bad = await submit(vendor, key, request=ASKED)

    assert bad.result is not None and bad.result.media is not None and good.result is not None
    media = bad.result.media
    assert (media.format, media.duration_s, media.width, media.height) == ("mp4", 6.0, 160, 90)
    assert media.rights is not None  # only the media is off, not the rights
    assert bad.result.sha256 != good.result.sha256  # another file
    (tmp_path / "bad.mp4").write_bytes(await vendor.fetch_result(bad))
    found = probe(tmp_path / "bad.mp4")  # the file really is what the vendor said, not what was asked
    assert (found.codec, found.width, found.height, found.frames) == ("h264", 160, 90, 72)


async def test_a_false_claim_describes_other_media_than_the_file_holds(
    sim: SimAdmin, vendor: JobsAdapter, key: str, tmp_path: Path
) -> None:
    await sim.configure(executors={EXECUTOR: {"false_claim": 1.0}})
    job = await submit(vendor, key, request=ASKED)

    assert job.result is not None and job.result.media is not None
    assert job.result.media.duration_s == 6.0  # the claim
    (tmp_path / "shot.mp4").write_bytes(await vendor.fetch_result(job))
    assert probe(tmp_path / "shot.mp4").duration_s == 3.0  # the file


async def test_missing_rights_reports_no_rights_metadata(
    sim: SimAdmin, vendor: JobsAdapter, key: str
) -> None:
    await sim.configure(executors={EXECUTOR: {"missing_rights": 1.0}})

    job = await submit(vendor, key, request=ASKED)

    assert job.result is not None and job.result.media is not None
    assert job.result.media.rights is None and job.result.media.format == "mp4"


@pytest.mark.parametrize(
    "media", [None, "not an object", {"width": "wide"}, {"rights": {"license": 3}}], ids=repr
)
def test_an_artifact_without_readable_media_metadata_parses_with_media_none(media: object) -> None:
    body: dict[str, object] = {"url": "/r", "sha256": "ab", "size": 2}
    if media is not None:
        body["media"] = media
    assert ResultFile.model_validate(body).media is None


async def test_chat_completion_accepts_a_json_schema_response_format(sim: SimAdmin) -> None:
    await sim.configure(chat_default='{"scores": {"visual": 0.9}}')
    schema = {"type": "object", "properties": {"scores": {"type": "object"}}}
    request = {
        "model": "sim-reviewer-1",
        "messages": [{"role": "user", "content": "judge"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "judgement", "schema": schema}},
    }

    response = await sim.client.post("/v1/chat/completions", json=request)

    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == '{"scores": {"visual": 0.9}}'


async def test_a_chat_rule_with_a_rate_answers_that_share_of_questions_and_each_always_alike(
    sim: SimAdmin,
) -> None:
    await sim.configure(seed=3, chat_script=[{"match": "take", "rate": 0.3, "content": '{"hit": 1}'}])

    async def ask(text: str) -> str:
        request = {"model": "m", "messages": [{"role": "user", "content": text}]}
        reply = (await sim.client.post("/v1/chat/completions", json=request)).json()
        return str(reply["choices"][0]["message"]["content"])

    answers = [await ask(f"review take {n}") for n in range(200)]
    hits = sum(a == '{"hit": 1}' for a in answers)
    assert 40 <= hits <= 80, hits  # 30% of 200, within a wide binomial margin
    assert [await ask(f"review take {n}") for n in range(20)] == answers[:20], "same question, same answer"
    assert await ask("no match here") != '{"hit": 1}'


async def test_chat_completion_answers_from_the_script_with_deterministic_usage(sim: SimAdmin) -> None:
    await sim.configure(chat_script=[{"match": "storyboard", "content": '{"verdict": "fail"}'}])
    system, user = "You are a strict reviewer.", "Review this storyboard, please."
    request = {
        "model": "sim-planner-1",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "response_format": {"type": "json_object"},
    }

    first = (await sim.client.post("/v1/chat/completions", json=request)).json()
    second = (await sim.client.post("/v1/chat/completions", json=request)).json()
    unmatched = {**request, "messages": [{"role": "user", "content": "anything else"}]}
    fallback = (await sim.client.post("/v1/chat/completions", json=unmatched)).json()

    assert first["object"] == "chat.completion"
    assert first["choices"] == second["choices"]
    assert first["choices"][0]["message"] == {
        "role": "assistant",
        "content": '{"verdict": "fail"}',
        "refusal": None,
    }
    prompt_tokens = len(system) // 4 + 1 + len(user) // 4 + 1
    completion_tokens = len('{"verdict": "fail"}') // 4 + 1
    assert first["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    assert json.loads(fallback["choices"][0]["message"]["content"])["verdict"] == "pass"
    stats = (await sim.client.get("/chat/stats")).json()
    assert stats["calls"] == 3
    assert stats["prompt_tokens"] == 2 * prompt_tokens + fallback["usage"]["prompt_tokens"]
    assert (await sim.charges())["count"] == 0


async def test_missing_or_malformed_bearer_token_is_401_on_every_vendor_endpoint(sim: SimAdmin) -> None:
    endpoints = [
        ("POST", "/jobs"),
        ("GET", "/jobs?idempotency_key=k"),
        ("GET", "/jobs/job_x"),
        ("GET", "/jobs/job_x/result"),
        ("POST", "/jobs/job_x/cancel"),
        ("POST", "/v1/chat/completions"),
    ]
    async with httpx.AsyncClient(base_url=sim.url) as anonymous:
        for method, path in endpoints:
            for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": "Basic dXNlcjpwdw=="}):
                response = await anonymous.request(method, path, headers=headers, json=BODY)
                assert response.status_code == 401, (method, path, headers)
    assert (await sim.charges())["count"] == 0


async def test_missing_idempotency_key_is_400(sim: SimAdmin) -> None:
    response = await sim.client.post("/jobs", json=BODY)

    assert response.status_code == 400
    assert (await sim.charges())["count"] == 0


async def test_unknown_job_is_not_found(sim: SimAdmin, vendor: JobsAdapter) -> None:
    with pytest.raises(VendorNotFound):
        await vendor.get("job_does_not_exist")


async def test_errors_never_reveal_the_api_key(sim: SimAdmin, vendor: JobsAdapter, api_key: str) -> None:
    unreachable = JobsAdapter(
        RouteSpec(timeouts=Timeouts(request=1.0)), f"http://127.0.0.1:{free_port()}", api_key
    )
    errors: list[VendorError] = []
    for call in (unreachable.get("job_x"), vendor.get("job_x")):
        with pytest.raises(VendorError) as raised:
            await call
        errors.append(raised.value)
    await unreachable.aclose()

    assert isinstance(errors[0], VendorUnavailable)
    assert all(api_key not in str(e) for e in errors)
    assert api_key not in repr(unreachable)


async def test_admin_config_round_trips_and_rejects_unknown_fields(sim: SimAdmin) -> None:
    config = await sim.configure(
        seed=3, mode="lookup_only", executors={EXECUTOR: {"cost": "1.25", "hang": 0.5}}
    )

    current = (await sim.client.get("/admin/config")).json()
    typo = await sim.client.put("/admin/config", json={"default": {"rate_limits": 1}})

    assert current == config.model_dump(mode="json")
    assert typo.status_code == 422


def test_module_entry_point_serves_with_the_given_config_and_seed(tmp_path: Path) -> None:
    config_file = tmp_path / "sim.json"
    config_file.write_text(json.dumps({"seed": 1, "mode": "none"}))
    port = free_port()
    command = [sys.executable, "-m", "vendors.simulator", "--port", str(port)]
    process = subprocess.Popen(
        [*command, "--config", str(config_file), "--seed", "42"],
        cwd=Path(__file__).parents[2],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                config = httpx.get(f"http://127.0.0.1:{port}/admin/config").json()
                break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline, "simulator did not start"
                time.sleep(0.05)
    finally:
        process.terminate()
        process.wait(timeout=10)

    assert (config["seed"], config["mode"]) == (42, "none")
