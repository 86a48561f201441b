"""Issue 26 §5 in a real browser: dead letters grouped by systemic cause, with one action for the group.

Three tasks whose one step the vendor refuses alike, and a fourth that fails otherwise: the queue page shows
the three as one group (75% of the open dead letters, and why), the director loads their key file on the queue
page itself and presses "Resume all 3": the page signs one resume per member, shows each one's ruling, and
each task completes. The odd one out is offered no group action and stays open.

``LEDGERFLOW_SCREENSHOT_DIR=DIR`` saves the queue with the group resumed as ``DIR/review-groups.png``
(docs/reviewers.md shows it).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path

from peoplekit import wait_open
from playwright.async_api import expect
from reviewkit import TOKENS, served
from test_review_page import chromium_page

from ledgerflow.review import create_app
from rules.events import HumanDecision, parse
from rules.people import canonical
from rules.projection import fold
from runtime.signing import demo_key, verify

REFUSED = """
goal: a keyframe the vendor refuses ({n})
project: {project}
budget_ceiling: 5
stages:
  - id: frame
    executor: image.keyframe
    estimate: 1
    retries: 0
    input: {{prompt: a storm at sea, format: png, width: 320, height: 180}}
"""

BROKEN = """
goal: a script whose vendor is down
project: {project}
budget_ceiling: 5
stages:
  - {{id: script, executor: llm.text, estimate: 1, retries: 0, input: {{prompt: a script}}}}
"""


async def test_a_group_of_dead_letters_is_resumed_in_the_browser_with_one_signed_decision_each(
    lf, sim, tmp_path
):
    began = time.monotonic()
    # Tasks of a project of their own, and a login that sees only it: the session's other tests' dead
    # letters (the ledger is shared) stay out of this queue.
    project = f"groups-{uuid.uuid4().hex[:8]}"
    await sim.configure(
        executors={"image.keyframe": {"reject_content": 1.0}, "llm.text": {"fail_technical": 1.0}}
    )
    plans = [lf.plan(REFUSED.format(n=n, project=project)) for n in range(3)]
    handles = [await lf.start(plan) for plan in plans]
    odd = lf.plan(BROKEN.format(project=project))
    await lf.start(odd)
    tids = [str(plan.task_id) for plan in plans]
    rids = [await wait_open(lf, tid, "dead_letter:") for tid in tids]
    odd_rid = await wait_open(lf, str(odd.task_id), "dead_letter:")
    await sim.configure()  # the vendor is fixed: it takes the same requests now
    key = demo_key("director")
    key_file = tmp_path / "director.key.json"
    key.write(key_file)

    app = create_app(
        lf.settings, tokens=TOKENS, relay_timeout=15, scopes={"director": [f"project:{project}"]}
    )
    with served(app) as url:
        async with chromium_page() as page:
            await page.goto(f"{url}/login")
            await page.fill("input[name=token]", TOKENS["director"])
            await page.click("button:has-text('Log in')")
            await page.wait_for_url(f"{url}/queue")

            # One group: the three refused alike, their share of the open dead letters and their cause.
            group = page.locator("form.group")
            await expect(group).to_have_count(1)
            await expect(group.locator(".share")).to_contain_text("75% of open dead letters (3 of 4)")
            await expect(group.locator(".share")).to_contain_text("failed with content the vendor refused")
            await expect(group).to_contain_text("Suggested: edit the input by hand")
            members = group.locator("li[data-request-id]")
            await expect(members).to_have_count(3)
            shown = sorted(await members.get_by_role("link").all_inner_texts())
            assert shown == sorted(f"{t}/{r}" for t, r in zip(tids, rids, strict=True))
            assert f"{odd.task_id}/{odd_rid}" not in await group.inner_text(), "another cause, not grouped"

            # The key is loaded on the queue page itself; until then the group's button is disabled.
            button = group.get_by_role("button", name="Resume all 3")
            await expect(page.locator("#key-status")).to_contain_text("No key in this browser")
            await expect(button).to_be_disabled()
            await page.set_input_files("#key-file", key_file)
            await expect(page.locator("#key-status")).to_contain_text("with key demo-director")
            await expect(button).to_be_enabled()

            await group.locator("textarea[name=note]").fill("the vendor's filter was fixed at 14:02")
            posted = []
            page.on(
                "request",
                lambda r: (
                    posted.append(r.post_data_json) if r.url.startswith(f"{url}/api/decisions/") else None
                ),
            )
            await button.click()
            for li in await members.all():
                await expect(li.locator(".ruling")).to_have_text(
                    "accepted (resume by director)", timeout=30_000
                )
            await expect(page.locator("#outcome")).to_have_text(
                "3 resume decision(s) sent: 3 accepted", timeout=10_000
            )
            await expect(button).to_be_disabled()
            screenshots = os.environ.get("LEDGERFLOW_SCREENSHOT_DIR")
            if screenshots:
                await page.screenshot(path=str(Path(screenshots) / "review-groups.png"), full_page=True)
                await page.evaluate("window.scrollTo(0, 0)")  # headless Chromium: back to the top after

            # Every task of the group completes: each failed step got its one more attempt.
            for tid, handle in zip(tids, handles, strict=True):
                try:
                    result = await asyncio.wait_for(handle.result(), 60)
                except TimeoutError:
                    raise AssertionError(f"{tid} is not over: {await handle.query('status')}") from None
                assert result.state == "Completed", tid

            # Reloaded, the queue holds only the odd one out: no group left to resume.
            await page.reload()
            await expect(page.locator("form.group")).to_have_count(0)
            await expect(page.locator("#queue")).to_contain_text(f"{odd.task_id}/{odd_rid}")

    # One resume per member, signed in the browser with the director's key, with the note, in the ledger.
    assert sorted(p["request_id"] for p in posted) == sorted(rids)
    for tid, rid in zip(tids, rids, strict=True):
        events = lf.recorder.read_events(tid)
        decisions = [d for d in map(parse, events) if isinstance(d, HumanDecision)]
        assert len(decisions) == 1, f"{tid}: one decision"
        [d] = decisions
        assert (d.request_id, d.decision.value, d.approver, d.key_id) == (
            rid,
            "resume",
            "director",
            "demo-director",
        )
        assert d.note == "the vendor's filter was fixed at 14:02"
        [sent] = [p for p in posted if p["decision_id"] == d.decision_id]
        assert sent["issued_at"] and (sent["amount"], sent["scope"]) == (None, None)
        fields = (d.decision_id, d.request_id, d.decision.value, d.approver, d.key_id)
        assert d.signed == canonical(tid, *fields, None, None, d.note, sent["issued_at"])
        assert d.signature == sent["signature"], f"{tid}: the ledger holds the browser's signature"
        assert d.signed is not None and d.signature is not None
        assert verify(key.public_key, d.signed, d.signature), f"{tid}: signed in the browser, verifies"
        assert not fold(events).requests[rid].open
    odd_events = lf.recorder.read_events(str(odd.task_id))
    assert fold(odd_events).requests[odd_rid].open, "the odd one out was not resumed"
    print(f"group test: {time.monotonic() - began:.1f} s")
