"""Traces on real servers (runtime/telemetry.py): one task is one trace, from the client's start of the
workflow down to each vendor call and ledger write of each operation, every operation span naming its task,
node, OperationKey, epoch and route.

The spans go to an in-memory exporter: a tracer provider of the test's own, installed for ledgerflow's spans
(``telemetry.install``) and given to Temporal's interceptor on a client of the test's own, whose worker
inherits it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from decimal import Decimal
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from temporalio.client import Client
from temporalio.contrib.opentelemetry import TracingInterceptor
from temporalio.contrib.pydantic import pydantic_data_converter

from rules.plan import load_plan
from runtime import telemetry
from runtime.settings import ConfigError, Settings
from vendors.routes import deployment_table
from workflows.contracts import TaskInput, workflow_id
from workflows.task import TaskWorkflow

PLAN = """
goal: two keyframes, traced
budget_ceiling: 10
stages:
  - {id: art, executor: image.keyframe, estimate: 1, fan_out: 2, canary: false}
"""
IDS = ("ledgerflow.task_id", "ledgerflow.node", "ledgerflow.operation_key", "ledgerflow.epoch")


@pytest.fixture
def otel() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """A tracer provider exporting to memory, installed for ledgerflow's spans (the global one afterwards)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.install(provider)
    try:
        yield provider, exporter
    finally:
        telemetry.install(None)


@asynccontextmanager
async def traced_worker(
    temporal: Client, pg_url: str, simulator_url: str, sim_key: str, workdir: Path, provider: TracerProvider
) -> AsyncIterator[tuple[Client, str]]:
    """A client with Temporal's tracing interceptor, and a worker built on it (as ``lf`` builds one)."""
    from worker import build_worker

    address = temporal.service_client.config.target_host
    client = await Client.connect(
        address,
        namespace=temporal.namespace,
        data_converter=pydantic_data_converter,
        interceptors=[TracingInterceptor(provider.get_tracer("temporalio"))],
    )
    queue = f"q-{uuid.uuid4().hex[:10]}"
    settings = Settings(
        temporal_address=address,
        task_queue=queue,
        database_url=pg_url,
        vendor_url=simulator_url,
        vendor_api_key=sim_key,
        llm_api_key=sim_key,
        artifact_dir=workdir / "artifacts",
        poll_interval_seconds=0.02,
        env="dev",
    )
    async with AsyncExitStack() as stack:
        worker = await build_worker(client, settings, stack, task_queue=queue)
        async with worker:
            yield client, queue


def tree(spans: tuple[ReadableSpan, ...]) -> str:
    """The spans as an indented tree (for a failing assertion's message)."""
    children: dict[int | None, list[ReadableSpan]] = {}
    for s in spans:
        children.setdefault(s.parent.span_id if s.parent else None, []).append(s)
    lines: list[str] = []

    def walk(parent: int | None, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: s.start_time or 0):
            lines.append("  " * depth + f"{s.name} {dict(s.attributes or {})}")
            assert s.context is not None
            walk(s.context.span_id, depth + 1)

    walk(None, 0)
    return "\n".join(lines)


async def run_task(client: Client, queue: str) -> str:
    """Run PLAN to completion through ``client``; returns its task id."""
    plan = load_plan(
        PLAN, deployment_table(Settings(env="dev")).names(), task_id=f"t-{uuid.uuid4().hex[:12]}"
    )
    assert plan.task_id is not None
    result = await client.execute_workflow(
        TaskWorkflow.run,
        TaskInput(task_id=plan.task_id, plan=plan),
        id=workflow_id(plan.task_id),
        task_queue=queue,
    )
    assert result.state == "Completed", result.summary
    return plan.task_id


async def test_a_task_is_one_trace_from_the_clients_start_to_each_vendor_call_and_ledger_write(
    temporal, pg_url, simulator_url, recorder, sim, sim_key, tmp_path, otel
):
    provider, spans = otel
    async with traced_worker(temporal, pg_url, simulator_url, sim_key, tmp_path, provider) as (client, queue):
        task = await run_task(client, queue)
    finished = spans.get_finished_spans()
    shown = tree(finished)

    # The client's start is the root; the workflow's spans and every activity's hang below it, in one trace.
    [root] = [
        s
        for s in finished
        if s.name == "StartWorkflow:TaskWorkflow"
        and s.attributes
        and s.attributes.get("temporalWorkflowID") == workflow_id(task)
    ]
    assert root.parent is None and root.kind == SpanKind.CLIENT and root.context is not None, shown
    trace_id = root.context.trace_id
    ours = [s for s in finished if s.context is not None and s.context.trace_id == trace_id]
    assert [s for s in finished if (s.attributes or {}).get("ledgerflow.task_id") == task], shown
    assert all(s in ours for s in finished if (s.attributes or {}).get("ledgerflow.task_id") == task), shown
    by_id = {s.context.span_id: s for s in ours if s.context is not None}

    def parent(s: ReadableSpan) -> ReadableSpan:
        assert s.parent is not None, f"{s.name} has no parent\n{shown}"
        return by_id[s.parent.span_id]

    def children(s: ReadableSpan) -> list[ReadableSpan]:
        assert s.context is not None
        kids = [c for c in ours if c.parent is not None and c.parent.span_id == s.context.span_id]
        return sorted(kids, key=lambda c: c.start_time or 0)

    assert any(parent(s) is root for s in ours if s.name == "RunWorkflow:TaskWorkflow"), shown

    for node in ("art/S01", "art/S02"):
        key = f"{task}:{node}:a1"
        ids = {
            "ledgerflow.task_id": task,
            "ledgerflow.node": node,
            "ledgerflow.operation_key": key,
            "ledgerflow.epoch": 1,
        }
        [run] = [
            s
            for s in ours
            if s.name == "RunActivity:stage.run" and (s.attributes or {}).get("ledgerflow.node") == node
        ]
        assert parent(run).name == "StartActivity:stage.run" and parent(parent(run)) is root, shown
        assert {k: (run.attributes or {}).get(k) for k in IDS} == ids, shown
        assert (run.attributes or {}).get("ledgerflow.route") == "image.keyframe", shown

        steps = [c for c in children(run) if c.name != "vendor.get"]  # a poll, if the job was not done yet
        # The built-in routes find jobs by our key: the INTENT is the send's write-ahead (no marker of its
        # own).
        assert [c.name for c in steps] == [
            "ledger.intent",
            "ledger.open",
            "reconcile",
            "vendor.submit",
            "vendor.download",
            "ledger.result",
        ], shown
        named = {c.name: c for c in steps}
        for c in steps:
            assert {k: (c.attributes or {}).get(k) for k in IDS} == ids, f"{c.name}\n{shown}"
        reconcile, submit = named["reconcile"], named["vendor.submit"]
        assert (reconcile.attributes or {}).get("ledgerflow.reconcile.next") == "submit", shown
        assert submit.kind == SpanKind.CLIENT and (submit.attributes or {}).get("ledgerflow.route") == (
            "image.keyframe"
        ), shown
        job = (submit.attributes or {}).get("ledgerflow.job_id")
        assert job and (named["vendor.download"].attributes or {}).get("ledgerflow.job_id") == job, shown
        # Write-ahead, as the trace shows it: the INTENT, naming its window for send 1, is written before the
        # send leaves, and the result after the output was fetched.
        assert (named["ledger.intent"].attributes or {}).get("ledgerflow.send_ahead_s", 0) > 0, shown
        assert (named["ledger.intent"].end_time or 0) <= (submit.start_time or 0), shown
        assert (named["vendor.download"].end_time or 0) <= (named["ledger.result"].start_time or 0), shown
        assert (named["ledger.result"].attributes or {}).get("ledgerflow.event") == "Outcome", shown
        # Money on the trace (issue 27 §3): what the result booked, as the ledger holds it.
        [booked] = [e for e in recorder.read_events(task) if e.type == "Outcome" and e.operation_key == key]
        cost = (named["ledger.result"].attributes or {}).get("ledgerflow.cost")
        assert cost == str(booked.payload["actual_cost"]) and Decimal(cost) > 0, shown

    # The review's model call: a client span in the GenAI conventions' shape, with its usage and its cost.
    [chat] = [s for s in ours if s.name.startswith("chat ")]
    attrs = dict(chat.attributes or {})
    assert chat.kind == SpanKind.CLIENT and attrs["ledgerflow.node"] == "review", shown
    assert (attrs["gen_ai.operation.name"], attrs["gen_ai.provider.name"]) == ("chat", "openai")
    assert attrs["gen_ai.request.model"] and attrs["gen_ai.response.model"], attrs
    assert int(attrs["gen_ai.usage.input_tokens"]) > 0 and int(attrs["gen_ai.usage.output_tokens"]) > 0, attrs
    [judged] = [e for e in recorder.read_events(task) if e.type == "ExecutionResult"]
    assert attrs["ledgerflow.cost"] == str(judged.payload["actual_cost"]), attrs

    # Attributes name operations, never a request, a URL or a key.
    for s in ours:
        for value in (s.attributes or {}).values():
            assert sim_key not in str(value) and "://" not in str(value), f"{s.name}: {value}"


async def test_a_worker_adds_the_tracing_interceptor_only_where_its_client_has_none(temporal, otel):
    [added] = telemetry.worker_interceptors(temporal)  # the session's client is not traced
    assert isinstance(added, TracingInterceptor)
    traced = await Client.connect(
        temporal.service_client.config.target_host,
        namespace=temporal.namespace,
        interceptors=telemetry.client_interceptors(),
    )
    assert telemetry.worker_interceptors(traced) == []  # inherited from the client: twice doubles each span


def test_tracing_is_off_unless_the_otel_variables_ask_for_an_exporter():
    assert telemetry.exporters({}) == []
    assert telemetry.exporters({"OTEL_TRACES_EXPORTER": "none"}) == []
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    [otlp] = telemetry.exporters(endpoint)
    assert isinstance(otlp, OTLPSpanExporter)
    assert telemetry.exporters({**endpoint, "OTEL_SDK_DISABLED": "true"}) == []
    [console] = telemetry.exporters({"OTEL_TRACES_EXPORTER": "console"})
    assert isinstance(console, ConsoleSpanExporter)
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER='zipkin'"):
        telemetry.exporters({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ConfigError, match="http/protobuf"):
        telemetry.exporters({**endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
