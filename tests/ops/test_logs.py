"""Structured logs on real servers (runtime/logs.py): a task runs with the worker logging JSON, and every line
an operation logs is JSON naming its task, node, OperationKey, epoch and run, and no line holds a key."""

from __future__ import annotations

import contextvars
import io
import json
import logging
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span
from temporalio import activity

from runtime import logs, telemetry
from runtime.logs import LogSettings
from workflows.contracts import workflow_id

# The keyframes cost more than their estimate (the simulator is told so): each also logs a cost anomaly.
PLAN = """
goal: a script and two keyframes, logged
budget_ceiling: 10
stages:
  - {id: script, executor: llm.text, estimate: 0.5}
  - {id: art, executor: image.keyframe, estimate: 0.5, fan_out: 2, canary: false, depends_on: [script]}
"""
# The activities that run an operation's lifecycle (activities/operation.py).
OPERATIONS = {"stage.run", "compose.run", "review.run", "gate.run", "operation.close"}
FIELDS = ("task_id", "node", "operation_key", "epoch", "run_id")


async def test_every_line_an_operation_logs_is_json_naming_it_and_no_line_holds_a_key(lf, sim, sim_key):
    await sim.configure(executors={"image.keyframe": {"cost_multiplier": "1.5"}})
    out = io.StringIO()
    undo = logs.configure(LogSettings(log_format="json"), stream=out)
    try:
        plan = lf.plan(PLAN)
        handle = await lf.start(plan)
        result = await handle.result()
    finally:
        undo()
    assert result.state == "Completed", result.summary
    text = out.getvalue()
    assert sim_key not in text
    lines = [json.loads(line) for line in text.splitlines()]  # every line is one JSON object

    def of_task(line: dict[str, Any]) -> bool:
        return bool(line.get("temporal_activity", {}).get("workflow_id") == workflow_id(plan.task_id or ""))

    ours = [
        line for line in lines if of_task(line) and line["temporal_activity"]["activity_type"] in OPERATIONS
    ]
    assert ours, text
    for line in ours:
        assert {f: line.get(f) is not None for f in FIELDS} == dict.fromkeys(FIELDS, True), line
        assert line["task_id"] == plan.task_id and line["run_id"] == handle.result_run_id, line
        assert line["operation_key"] == f"{plan.task_id}:{line['node']}:a1", line
        assert line["epoch"] == 1 and line["level"] in ("INFO", "WARNING"), line
        assert "(" not in line["message"] or "activity_id" not in line["message"], line  # info is a field

    said: dict[str, list[str]] = {}
    for line in ours:
        said.setdefault(line["node"], []).append(line["message"])
    for node in ("script", "art/S01", "art/S02"):
        messages = said[node]
        assert messages[:3] == [
            "INTENT recorded, 0.5 reserved",
            "opened: nothing sent yet",
            "reconciled: submit (never sent)",
        ], messages
        # The built-in routes find jobs by our key: the INTENT is the send's write-ahead.
        assert messages[3].startswith(
            "submitting send 1 under its INTENT's write-ahead (the client gives up after "
        ), messages
        assert messages[-1].startswith("result recorded: Outcome, cost "), messages
    for node in ("art/S01", "art/S02"):
        [anomaly] = [line for line in ours if line["node"] == node and line["level"] == "WARNING"]
        assert anomaly["message"].startswith("cost anomaly (above_estimate): actual "), anomaly
    assert any(m.startswith("result recorded: ExecutionResult(review)") for m in said["review"]), said


def test_a_line_names_the_operation_and_span_it_was_logged_in_and_hides_url_credentials():
    out = io.StringIO()
    undo = logs.configure(LogSettings(log_format="json"), stream=out)
    telemetry.install(TracerProvider())

    def operation() -> Span:
        logs.bind(logs.OperationContext("t-1", "art/S01", "t-1:art/S01:a1", 3, run_id="r-1", route="image.x"))
        with telemetry.span("vendor.submit") as span:
            url = "https://bucket.example/o?X-Amz-Signature=abc&X-Amz-Credential=def"
            activity.logger.info("fetching %s with Bearer sk-123", url)
        logging.getLogger("httpx").info("HTTP Request: GET https://vendor.example/jobs/1 200")  # quietened
        return span

    try:
        span = contextvars.copy_context().run(operation)  # the binding ends with it, as with an attempt
    finally:
        telemetry.install(None)
        undo()
    [line] = [json.loads(raw) for raw in out.getvalue().splitlines()]
    assert {k: line[k] for k in ("task_id", "node", "operation_key", "epoch", "run_id", "route")} == {
        "task_id": "t-1",
        "node": "art/S01",
        "operation_key": "t-1:art/S01:a1",
        "epoch": 3,
        "run_id": "r-1",
        "route": "image.x",
    }
    assert line["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert line["message"] == "fetching https://bucket.example/o?[redacted] with Bearer [redacted]"
    assert line["level"] == "INFO" and line["logger"] == "temporalio.activity" and line["time"]


def test_text_lines_name_the_operation_too():
    out = io.StringIO()
    undo = logs.configure(LogSettings(log_format="text"), stream=out)

    def operation() -> None:
        logs.bind(logs.OperationContext("t-2", "mix", "t-2:mix:a2", 1))
        logging.getLogger("ledgerflow.test").info("hello")

    try:
        contextvars.copy_context().run(operation)
    finally:
        undo()
    assert out.getvalue().rstrip().endswith("INFO ledgerflow.test hello [t-2:mix:a2 epoch 1]")
