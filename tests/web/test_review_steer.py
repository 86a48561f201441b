"""Steering a running task from the reviewer page, in Debian's chromium (headless): a waiver of the review's
findings on the rework-limit escalation, a restore of an earlier version on an approval, and the steering form
(pause, then resume). Each change is signed in the browser (rules/changes.py's canonical message), relayed as
the workflow's ``change`` Update, and its ruling shown; the ledger then holds the ``TaskChange``, whose
signature verifies with the director's key.

``LEDGERFLOW_SCREENSHOT_DIR=DIR`` saves ``DIR/review-waive.png``, ``DIR/review-restore.png`` and
``DIR/review-steer.png`` (docs/reviewers.md shows them).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

from peoplekit import wait_open
from playwright.async_api import Page, expect
from reviewkit import SHOT_APPROVAL, TOKENS, served
from test_review_page import chromium_page, log_in_and_open

from ledgerflow.review import create_app
from ledgerflow.views import people
from rules.events import TaskChange, parse
from rules.projection import fold
from runtime.signing import demo_key, verify

PASS = json.dumps({"scores": {"visual": 0.9}, "blame": {}, "reasons": []})


def blame(*nodes: str) -> str:
    """A review model's judgement asking for rework of ``nodes``."""
    return json.dumps(
        {"scores": {"visual": 0.4}, "blame": {"visual": list(nodes)}, "reasons": ["the board is off model"]}
    )


async def screenshot(page: Page, name: str) -> None:
    screenshots = os.environ.get("LEDGERFLOW_SCREENSHOT_DIR")
    if screenshots:
        await page.screenshot(path=str(Path(screenshots) / name), full_page=True)
        # After a full-page shot of a page taller than the window, headless chromium may drop the next click
        # on an element below the fold (it never reaches the page): start the page from its top again.
        await page.evaluate("window.scrollTo(0, 0)")


def changes(lf, task_id: str) -> list[TaskChange]:
    out = [parse(e) for e in lf.recorder.read_events(task_id) if e.type == "TaskChange"]
    assert all(isinstance(c, TaskChange) for c in out)
    return out  # type: ignore[return-value]


def signed_by_director(c: TaskChange) -> bool:
    return verify(demo_key("director").public_key, c.signed, c.signature)


async def test_the_review_is_waived_in_the_browser_with_a_reason_and_the_task_completes(lf, sim, tmp_path):
    """The rework limit (0 rounds) is reached at the first rework verdict: the escalation's page lists what
    the review blames and why; the director waives the whole review with a reason, signed in the browser; the
    escalation is resolved and the task completes, its findings kept as warnings."""
    began = time.monotonic()
    await sim.configure(chat_default=blame("board", "script"))  # never satisfied
    plan = lf.plan(
        """
goal: a storyboard the review never likes
budget_ceiling: 10
rework_limit: 0
stages:
  - {id: script, executor: llm.text, estimate: 0.2, input: {prompt: a script}}
  - {id: board, executor: llm.text, estimate: 0.2, depends_on: [script], input: {prompt: a storyboard}}
"""
    )
    handle = await lf.start(plan)
    tid = plan.task_id
    assert tid is not None
    rid = await wait_open(lf, tid, "escalation:", timeout=30)
    assert (
        fold(lf.recorder.read_events(tid)).requests[rid].request.reason == "rework limit of 0 rounds reached"
    )
    demo_key("director").write(tmp_path / "director.key.json")
    reason = "the board is what the client signed off; the model dislikes the style"

    with served(create_app(lf.settings, tokens=TOKENS, relay_timeout=15)) as url:
        async with chromium_page() as page:
            await log_in_and_open(page, url, tid, rid, "escalation")
            await expect(page.locator("#verdict")).to_have_text("The review asks for rework.")
            findings = page.locator("#findings")
            await expect(findings.locator("tr[data-node=script]")).to_contain_text("script")
            await expect(findings.locator("tr[data-node=board]")).to_contain_text("sha256")
            await expect(page.locator("#all-findings")).to_contain_text("the board is off model")
            options = await page.locator("#waive select[name=node] option").all_inner_texts()
            assert options[0] == "every finding of the review"
            assert sorted(options[1:]) == ["the findings on board", "the findings on script"]
            await page.set_input_files("#key-file", tmp_path / "director.key.json")
            await expect(page.locator("#sign-waive")).to_be_enabled()
            await page.select_option("#waive select[name=node]", "review")
            await page.fill("#waive textarea[name=note]", reason)
            await screenshot(page, "review-waive.png")
            async with page.expect_request(f"{url}/api/changes/{tid}") as posted:
                await page.click("#sign-waive")
            sent = (await posted.value).post_data_json
            await expect(page.locator("#outcome")).to_have_text(
                "accepted (waive by director)", timeout=20_000
            )
            await expect(page.locator("#status")).to_have_text("resolved by your waiver")
            result = await asyncio.wait_for(handle.result(), 30)
            assert result.state == "Completed"

    assert (sent["kind"], sent["node"], sent["input"], sent["note"]) == ("waive", "review", None, reason)
    [change] = changes(lf, tid)
    assert (change.kind.value, change.node, change.note) == ("waive", "review", reason)
    assert signed_by_director(change), "signed in the browser with the director's key"
    p = fold(lf.recorder.read_events(tid))
    assert not p.requests[rid].open and p.review is not None and p.review.waived_all
    # The verdict stands as the review gave it; the summary names what people waived.
    assert result.summary["verdict"] == "QualityRework"
    assert result.summary["waived"] == ["board", "review", "script"]
    print(f"waive browser test: {time.monotonic() - began:.1f} s")


async def test_an_earlier_version_is_made_current_again_in_the_browser(lf, sim, tmp_path):
    """The director approves the storyboard's version 1; the review blames it, so the board is made again
    (version 2) and its approval asked again. On that page both versions are listed; the director makes
    version 1 current again (signed in the browser): the approval is resolved, the cut reuses what it made
    from version 1, the review (asked again, with its earlier findings) passes, and the task completes with
    version 1 as the board."""
    began = time.monotonic()
    # The review blames the board until it is asked again in a rework round (it then sees its findings).
    await sim.configure(
        chat_default=blame("board"), chat_script=[{"match": "previous_findings", "content": PASS}]
    )
    plan = lf.plan(
        """
goal: a storyboard the director prefers as first drawn
budget_ceiling: 10
rework_limit: 1
approval: {timeout: 1h, policy: escalate}
stages:
  - {id: board, executor: llm.text, estimate: 0.5, approval: true, input: {prompt: a storyboard}}
  - {id: cut, executor: llm.text, estimate: 0.5, depends_on: [board]}
"""
    )
    handle = await lf.start(plan)
    tid = plan.task_id
    assert tid is not None
    first = await wait_open(lf, tid, "approval:board:v1")
    told = await people.decide(lf.settings, demo_key("director"), tid, first, "approve")
    assert told.status == "accepted", told
    rid = await wait_open(lf, tid, "approval:board:v2", timeout=30)
    board = fold(lf.recorder.read_events(tid)).nodes["board"]
    v1, v2 = (o.artifact["sha256"] for o in board.outputs)
    assert v1 != v2 and board.artifact is not None and board.artifact["sha256"] == v2
    demo_key("director").write(tmp_path / "director.key.json")

    with served(create_app(lf.settings, tokens=TOKENS, relay_timeout=15)) as url:
        async with chromium_page() as page:
            await log_in_and_open(page, url, tid, rid, "approval")
            versions = page.locator("#versions figure")
            await expect(versions).to_have_count(2)
            await expect(versions.nth(0)).to_contain_text("version 1 (the review blamed it)")
            await expect(versions.nth(0)).to_contain_text(f"sha256 {v1[:12]}")
            await expect(versions.nth(1)).to_contain_text("version 2 (current)")
            await expect(versions.nth(1)).to_contain_text(f"sha256 {v2[:12]}")
            await expect(versions.nth(0).locator("pre.text-artifact")).to_contain_text('"prompt"')
            await expect(versions.nth(1).locator("input[name=version]")).to_have_count(0)  # already current
            await page.set_input_files("#key-file", tmp_path / "director.key.json")
            await expect(page.locator("#sign-restore")).to_be_enabled()
            await page.check("#restore input[name=version][value='1']")
            await expect(page.locator("#sign-restore")).to_have_text("Make version 1 current")
            await page.fill("#restore textarea[name=note]", "the first board had the right framing")
            await screenshot(page, "review-restore.png")
            async with page.expect_request(f"{url}/api/changes/{tid}") as posted:
                await page.click("#sign-restore")
            sent = (await posted.value).post_data_json
            await expect(page.locator("#outcome")).to_have_text(
                "accepted (restore by director)", timeout=20_000
            )
            await expect(page.locator("#status")).to_have_text("resolved: an earlier version made current")
            result = await asyncio.wait_for(handle.result(), 30)
            assert result.state == "Completed", result.summary

    assert (sent["kind"], sent["node"], sent["input"]) == ("restore", "board", {"version": 1})
    [change] = changes(lf, tid)
    assert change.kind.value == "restore" and signed_by_director(change)
    p = fold(lf.recorder.read_events(tid))
    assert not p.requests[rid].open
    assert p.nodes["board"].artifact is not None and p.nodes["board"].artifact["sha256"] == v1
    # What was made from version 1 before is reused, not paid for again; the review then passes.
    made, reused = p.nodes["cut"].outputs
    assert reused.reused_from == made.operation_key and reused.artifact == made.artifact
    assert p.review is not None and p.review.verdict.value == "Pass"
    print(f"restore browser test: {time.monotonic() - began:.1f} s")


async def test_a_running_task_is_paused_and_resumed_from_the_page(lf, sim, tmp_path):
    """On an open approval's page the steering form pauses the task, then resumes it (each signed in the
    browser); the ledger holds the two changes, in order, both verifying with the director's key; the
    approval then lets the task complete."""
    began = time.monotonic()
    plan = lf.plan(SHOT_APPROVAL)
    handle = await lf.start(plan)
    tid = plan.task_id
    assert tid is not None
    rid = await wait_open(lf, tid, "approval:shot")
    demo_key("director").write(tmp_path / "director.key.json")

    with served(create_app(lf.settings, tokens=TOKENS, relay_timeout=15)) as url:
        async with chromium_page() as page:
            await log_in_and_open(page, url, tid, rid, "approval")
            steer = page.locator("#steer")
            await expect(steer.locator("select[name=kind]")).to_have_value("pause")
            await expect(steer.locator("input[name=node]")).to_be_hidden()
            # Skip and re-route name a node (re-route a route too): their fields appear with them.
            await steer.locator("select[name=kind]").select_option("reroute")
            await expect(steer.locator("input[name=node]")).to_be_visible()
            await expect(steer.locator("input[name=route]")).to_be_visible()
            nodes = await page.locator("#steer-nodes option").evaluate_all("os => os.map(o => o.value)")
            assert {"frame", "shot", "cut"} <= set(nodes)
            routes = await page.locator("#steer-routes option").evaluate_all("os => os.map(o => o.value)")
            assert "video.motion" in routes
            await steer.locator("select[name=kind]").select_option("skip")
            await expect(steer.locator("input[name=route]")).to_be_hidden()
            await page.set_input_files("#key-file", tmp_path / "director.key.json")
            await expect(page.locator("#sign-steer")).to_be_enabled()
            await page.click("#sign-steer")  # a skip with no node: refused here, nothing sent
            await expect(page.locator("#outcome")).to_have_text("not sent: name the node to skip")

            await steer.locator("select[name=kind]").select_option("pause")
            await steer.locator("textarea[name=note]").fill("the vendor's colours are off")
            await page.click("#sign-steer")
            await expect(page.locator("#outcome")).to_have_text(
                "accepted (pause by director)", timeout=20_000
            )
            await expect(page.locator("#paused")).to_contain_text("Paused by director")
            await expect(steer.locator("select[name=kind]")).to_have_value("resume")
            await page.reload()  # the page reads the pause from the ledger
            await expect(page.locator("#paused")).to_contain_text("Paused by director")
            await expect(steer.locator("select[name=kind]")).to_have_value("resume")
            await screenshot(page, "review-steer.png")
            await page.click("#sign-steer")
            await expect(page.locator("#outcome")).to_have_text(
                "accepted (resume by director)", timeout=20_000
            )
            await expect(page.locator("#paused")).to_contain_text("Running")

    kinds = [(c.kind.value, c.approver, c.note) for c in changes(lf, tid)]
    assert kinds == [("pause", "director", "the vendor's colours are off"), ("resume", "director", "")]
    assert all(signed_by_director(c) for c in changes(lf, tid))
    assert fold(lf.recorder.read_events(tid)).paused_by is None
    told = await people.decide(lf.settings, demo_key("director"), tid, rid, "approve")
    assert told.status == "accepted", told
    assert (await asyncio.wait_for(handle.result(), 30)).state == "Completed"
    print(f"steer browser test: {time.monotonic() - began:.1f} s")
