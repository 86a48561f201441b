"""The reviewer page in a real browser: Debian's chromium, headless, driven by Playwright (never a downloaded
browser: ``make test`` installs the Debian package). A reviewer logs in, finds the request in the queue, reads
it (attempts, money, options, the shot and its keyframe playing inline), loads their key file once, approves,
and sees the worker's ruling; the task then moves on and completes.

``LEDGERFLOW_SCREENSHOT_DIR=DIR`` saves screenshots of the request page as ``DIR/review-page.png`` and of a
dead letter's edit form as ``DIR/review-edit.png`` (docs/reviewers.md shows both).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal
from pathlib import Path

from peoplekit import wait_open
from playwright.async_api import Page, async_playwright, expect
from reviewkit import SHOT_APPROVAL, TOKENS, served

from ledgerflow.review import create_app
from rules.events import HumanDecision, Intent, parse
from rules.people import canonical
from rules.projection import fold
from runtime.signing import demo_key, verify

CHROMIUM = "/usr/bin/chromium"  # Debian's package; `make test` installs it when it is missing


async def test_a_reviewer_approves_in_the_browser_signing_there_and_the_task_moves_on(lf, sim, tmp_path):
    began = time.monotonic()
    plan = lf.plan(SHOT_APPROVAL)
    handle = await lf.start(plan)
    tid = plan.task_id
    assert tid is not None
    rid = await wait_open(lf, tid, "approval:shot")
    key = demo_key("director")
    key_file = tmp_path / "director.key.json"
    key.write(key_file)

    with served(create_app(lf.settings, tokens=TOKENS, relay_timeout=15)) as url:
        async with chromium_page() as page:
            await log_in_and_open(page, url, tid, rid, "approval")
            await expect(page.locator("#attempts")).to_contain_text("video.motion")
            await expect(page.locator("#attempts")).to_contain_text("succeeded")
            await expect(page.locator("#spend")).to_contain_text("remaining")
            await expect(page.locator("#options")).to_contain_text("its dependents may run")
            # What approving releases, in money; the deadline in this browser's time and what silence does.
            await expect(page.locator("#options")).to_contain_text(
                "node(s) after it may run, reserving about"
            )
            await expect(page.locator("#deadline")).to_contain_text(re.compile(r"\(in (5[0-9]|60) min\)"))
            await expect(page.locator("#then")).to_have_text(
                ", then: goes to a person with the authority to resume or stop the task"
            )
            ceiling = page.locator("#spend tr:nth-child(2) td:nth-child(4) .money")
            await expect(ceiling).to_have_text("10.00")
            await expect(ceiling).to_have_attribute("title", "10")
            await media_plays(page)

            # The key file is imported once, then found in IndexedDB on the next visit.
            await expect(page.locator("#key-status")).to_contain_text("No key in this browser")
            await expect(page.locator("#sign")).to_be_disabled()
            await page.set_input_files("#key-file", key_file)
            await expect(page.locator("#key-status")).to_contain_text("with key demo-director")
            await page.reload()
            await expect(page.locator("#key-status")).to_contain_text("with key demo-director")
            await expect(page.locator("#sign")).to_be_enabled()
            screenshots = os.environ.get("LEDGERFLOW_SCREENSHOT_DIR")
            if screenshots:
                await page.screenshot(path=str(Path(screenshots) / "review-page.png"), full_page=True)

            # Approve: the page signs, the server relays, the page shows the worker's ruling.
            await page.fill("textarea[name=note]", "good shot\nship it")
            async with page.expect_request(f"{url}/api/decisions/{tid}") as posted:
                await page.click("#sign")
            sent = (await posted.value).post_data_json
            outcome = page.locator("#outcome")
            await expect(outcome).to_have_text("accepted (approve by director)", timeout=20_000)

            # The task moves on: the request is resolved, the next stage runs, the task completes.
            assert (await asyncio.wait_for(handle.result(), 30)).state == "Completed"
            await page.reload()
            await expect(page.locator("#status")).to_have_text("approve by director")
            await expect(page.locator("#closed")).to_contain_text("the task is Completed")

    # What the browser signed is rules/people.py's canonical message, under the director's key.
    assert sent["approver"] == "director" and sent["key_id"] == "demo-director"
    assert (sent["decision"], sent["amount"], sent["scope"]) == ("approve", None, None)
    fields = [sent[f] for f in ("decision_id", "request_id", "decision", "approver", "key_id")]
    signed = canonical(tid, *fields, None, None, sent["note"], sent["issued_at"])  # v3: with issued-at
    assert verify(key.public_key, signed, sent["signature"])
    events = lf.recorder.read_events(tid)
    decisions = [d for d in map(parse, events) if isinstance(d, HumanDecision)]
    assert [(d.decision_id, d.approver, d.note) for d in decisions] == [
        (sent["decision_id"], "director", "good shot\nship it")
    ]
    p = fold(events)
    assert not p.requests[rid].open
    assert p.nodes["cut"].status.value == "succeeded" and p.nodes["cut"].attempts == 1
    decided = next(e.seq for e in events if e.type == "HumanDecision")
    cut = [e.seq for e in events if e.type == "Intent" and e.payload["action"].get("node") == "cut"]
    assert cut and min(cut) > decided  # nothing after the approval point ran before the decision
    print(f"browser test: {time.monotonic() - began:.1f} s")


async def test_a_budget_escalation_is_answered_in_the_browser_with_an_amount_and_a_scope(lf, sim, tmp_path):
    # The keyframe costs three times its estimate: the task's money is gone before the shot.
    await sim.configure(executors={"image.keyframe": {"cost_multiplier": "3"}})
    plan = lf.plan(
        """
goal: an expensive keyframe
budget_ceiling: 3
stages:
  - {id: frame, executor: image.keyframe, estimate: 1, input: {format: png, width: 320, height: 180}}
  - {id: cut, executor: llm.text, estimate: 1, depends_on: [frame]}
"""
    )
    handle = await lf.start(plan)
    tid = plan.task_id
    assert tid is not None
    rid = await wait_open(lf, tid, "escalation:")
    demo_key("producer").write(tmp_path / "producer.key.json")
    demo_key("director").write(tmp_path / "director.key.json")

    with served(create_app(lf.settings, tokens=TOKENS, relay_timeout=15)) as url:
        async with chromium_page() as page:
            await log_in_and_open(page, url, tid, rid, "escalation")
            await expect(page.locator("#options")).to_contain_text("raise the task's ceiling")
            # Someone else's key file is refused, with why.
            await page.set_input_files("#key-file", tmp_path / "producer.key.json")
            await expect(page.locator("#outcome")).to_have_text(
                "producer.key.json is producer's key; you are signed in as director"
            )
            await page.set_input_files("#key-file", tmp_path / "director.key.json")
            await expect(page.locator("#sign")).to_be_enabled()
            # The amount and the scope appear with add_budget; the scope offered first is the task's own.
            await expect(page.locator("#budget")).to_be_hidden()
            await page.check("input[value=add_budget]")
            await expect(page.locator("#budget")).to_be_visible()
            scopes = await page.locator("select[name=scope] option").all_inner_texts()
            assert scopes == [f"project:{plan.project}", f"task:{tid}"]
            assert await page.input_value("select[name=scope]") == f"task:{tid}"
            await page.fill("input[name=amount]", "five")
            await page.click("#sign")
            await expect(page.locator("#outcome")).to_have_text(
                "not sent: the amount must be a positive decimal number, like 2.5"
            )
            await page.fill("input[name=amount]", "5")
            async with page.expect_request(f"{url}/api/decisions/{tid}") as posted:
                await page.click("#sign")
            sent = (await posted.value).post_data_json
            outcome = page.locator("#outcome")
            await expect(outcome).to_have_text("accepted (add_budget 5 by director)", timeout=20_000)
            assert (await asyncio.wait_for(handle.result(), 30)).state == "Completed"

    assert (sent["decision"], sent["amount"], sent["scope"]) == ("add_budget", "5", f"task:{tid}")
    account = lf.recorder.account(f"task:{tid}")
    assert account is not None and account.ceiling == Decimal(8)


async def test_a_dead_letter_is_recovered_in_the_browser_by_a_signed_edit_of_its_request(lf, sim, tmp_path):
    """Issue 26 §2: the page offers a dead letter's text fields for editing; the edit is signed in the
    browser (canonical JSON and all, non-ASCII included) and the node runs again with the edited prompt."""
    await sim.configure(executors={"image.keyframe": {"reject_content": 1.0}})
    plan = lf.plan(
        """
goal: a keyframe the vendor refuses until a person rewrites its prompt
budget_ceiling: 5
stages:
  - id: frame
    executor: image.keyframe
    estimate: 1
    retries: 0
    input: {prompt: a storm at sea, format: png, width: 320, height: 180}
"""
    )
    handle = await lf.start(plan)
    tid = plan.task_id
    assert tid is not None
    rid = await wait_open(lf, tid, "dead_letter:")
    demo_key("director").write(tmp_path / "director.key.json")
    edited = "a calm evening at sea — café colours"  # non-ASCII: the browser must escape it as Python does

    with served(create_app(lf.settings, tokens=TOKENS, relay_timeout=15)) as url:
        async with chromium_page() as page:
            await log_in_and_open(page, url, tid, rid, "dead_letter")
            prompt = page.locator('#edit textarea[data-field="prompt"]')
            await expect(prompt).to_have_value("a storm at sea")
            await expect(page.locator("#sign-edit")).to_be_disabled()
            await page.set_input_files("#key-file", tmp_path / "director.key.json")
            await expect(page.locator("#sign-edit")).to_be_enabled()
            await sim.configure()  # the vendor takes the edited request
            await prompt.fill(edited)
            await page.fill("#edit textarea[name=note]", "the filter trips on storm")
            screenshots = os.environ.get("LEDGERFLOW_SCREENSHOT_DIR")
            if screenshots:
                await page.screenshot(path=str(Path(screenshots) / "review-edit.png"), full_page=True)
            async with page.expect_request(f"{url}/api/changes/{tid}") as posted:
                await page.click("#sign-edit")
            sent = (await posted.value).post_data_json
            await expect(page.locator("#outcome")).to_have_text("accepted (edit by director)", timeout=20_000)
            assert (await asyncio.wait_for(handle.result(), 30)).state == "Completed"

    assert (sent["kind"], sent["node"], sent["input"]["prompt"]) == ("edit", "frame", edited)
    events = lf.recorder.read_events(tid)
    [change] = [parse(e) for e in events if e.type == "TaskChange"]
    assert verify(demo_key("director").public_key, change.signed, change.signature), "signed in the browser"
    frames = [
        i.action.input["prompt"]
        for e in events
        if e.type == "Intent"
        and isinstance(i := parse(e), Intent)
        and i.action.kind == "Dispatch"
        and i.action.node == "frame"
    ]
    assert frames == ["a storm at sea", edited], "the node ran again with the prompt edited in the page"


async def test_a_text_output_is_read_in_the_page_as_text(lf, sim, tmp_path):
    """Issue 26 §5: the storyboard being approved is shown inline (as text, JSON indented), not only as a
    hash link that starts a download."""
    plan = lf.plan(
        """
goal: a storyboard a person reads before approving
budget_ceiling: 5
approval: {timeout: 1h, policy: escalate}
stages:
  - {id: board, executor: llm.text, estimate: 0.5, approval: true, input: {prompt: a storyboard}}
  - {id: cut, executor: llm.text, estimate: 0.5, depends_on: [board]}
"""
    )
    await lf.start(plan)
    tid = plan.task_id
    assert tid is not None
    rid = await wait_open(lf, tid, "approval:board")
    with served(create_app(lf.settings, tokens=TOKENS, relay_timeout=15)) as url:
        async with chromium_page() as page:
            await log_in_and_open(page, url, tid, rid, "approval")
            text = page.locator(".artifacts pre.text-artifact")
            await expect(text).to_have_count(1)
            await expect(text).to_contain_text('"prompt": "a storyboard"')  # what the vendor made, as text
            assert "\n  " in await text.inner_text(), "JSON is shown indented"


async def log_in_and_open(page: Page, url: str, task_id: str, request_id: str, kind: str) -> None:
    """Log in as the director (the queue sends a stranger to the login form first), find the request in
    the queue and follow its link to the request page."""
    await page.goto(f"{url}/queue")
    assert page.url == f"{url}/login"
    await page.fill("input[name=token]", TOKENS["director"])
    await page.click("button:has-text('Log in')")
    await page.wait_for_url(f"{url}/queue")
    row = page.locator("#queue tr", has=page.get_by_role("link", name=f"{task_id}/{request_id}"))
    await expect(row).to_contain_text(kind)
    await row.get_by_role("link").click()
    await page.wait_for_url(f"{url}/requests/{task_id}/{request_id}")
    await expect(page.locator("#status")).to_have_text("open")


@asynccontextmanager
async def chromium_page() -> AsyncIterator[Page]:
    """A page in Debian's chromium, headless (Playwright drives it; it never downloads a browser). The test
    fails if the page logged an error."""
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: `make test` installs Debian's chromium package"
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = await browser.new_page()
            errors: list[str] = []  # script errors, CSP violations, failed loads: the page must have none
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            yield page
            assert errors == []
        finally:
            await browser.close()


async def media_plays(page: Page) -> None:
    """The shot (MP4) and its keyframe (PNG), served by the app from the artifact store, load in the page."""
    image = page.locator(".artifacts img")
    video = page.locator(".artifacts video")
    await expect(image).to_have_count(1)
    await expect(video).to_have_count(1)
    await page.wait_for_function("document.querySelector('.artifacts img').naturalWidth === 320")
    await page.wait_for_function("document.querySelector('.artifacts video').readyState >= 1")
    assert await video.evaluate("v => [v.videoWidth, v.videoHeight]") == [160, 96]
