"""Issue 26 §6: people are told. A project that names a webhook gets a signed notification (Standard
Webhooks) when one of its task's requests opens, nears its deadline and is resolved — a failed delivery is
retried with backoff under the same id — each linking to the request on the reviewer page.

Real Temporal, Postgres and worker; the webhook is a real HTTP endpoint of the test's own that refuses its
first delivery.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request, Response

from ledgerflow.testing import serving
from ledgerflow.webhooks.signatures import verify_standard

SECRET = "whsec_" + "bm90aWZ5LXRoZS1wZW9wbGUtc2VjcmV0LTAxMjM0NTY="
PLAN = """
goal: a storyboard approved by silence after three seconds
project: {project}
budget_ceiling: 5
approval: {{timeout: 3s, policy: approve}}
stages:
  - {{id: board, executor: llm.text, estimate: 0.5, approval: true}}
"""


def receiver(got: list[dict[str, Any]]) -> FastAPI:
    app = FastAPI()
    refused: set[str] = set()

    @app.post("/hook")
    async def hook(request: Request) -> Response:
        body = await request.body()
        headers = dict(request.headers)
        delivery = headers["webhook-id"]
        if delivery not in refused and not got:  # the very first delivery fails: it must come again
            refused.add(delivery)
            return Response(status_code=503)
        verdict = verify_standard(SECRET, headers, body, time.time(), 300)
        got.append(
            {"id": delivery, "verdict": verdict.kind, "retried": delivery in refused, **json.loads(body)}
        )
        return Response(status_code=204)

    return app


async def test_a_projects_webhook_is_told_of_a_request_opening_nearing_its_deadline_and_resolved(
    lf_with: Any, sim: Any
) -> None:
    project = f"told-{uuid.uuid4().hex[:8]}"
    got: list[dict[str, Any]] = []
    os.environ["LEDGERFLOW_NOTIFY_SECRET"] = SECRET
    with serving.served(receiver(got)) as url:
        async with lf_with(
            notify_webhooks={project: f"{url}/hook"}, review_url="https://review.example.com"
        ) as lf:
            plan = lf.plan(PLAN.format(project=project))
            result = await lf.run(plan)
            assert result.state == "Completed", result.summary
            for _ in range(100):  # the last one goes out as the task ends
                if len(got) >= 3:
                    break
                await asyncio.sleep(0.05)
    assert [g["type"] for g in got] == ["request.opened", "request.due_soon", "request.resolved"], got
    assert all(g["verdict"] == "accepted" for g in got), "each signed with the project's secret"
    assert got[0]["retried"], "the refused first delivery came again, under the same id"
    rid = got[0]["request_id"]
    assert rid.startswith("approval:board") and all(g["request_id"] == rid for g in got)
    assert got[0]["page_url"] == f"https://review.example.com/requests/{plan.task_id}/{rid}"
    assert got[2]["resolution"] == "timed out" and got[0]["deadline"] is not None
