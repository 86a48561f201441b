"""Traces: OpenTelemetry spans from the client's start of a task down to each vendor call and ledger write.

Off unless OpenTelemetry's standard variables ask for it, so tests and the embedded stack pay nothing (no
provider: OpenTelemetry's no-op, and no Temporal interceptor):

* ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) set: OTLP over HTTP/protobuf
  to it (``http://collector:4318``); ``OTEL_EXPORTER_OTLP_HEADERS``, ``…_TIMEOUT``, ``…_COMPRESSION`` apply;
* ``OTEL_TRACES_EXPORTER``: ``otlp`` (to ``http://localhost:4318`` without an endpoint), ``console``
  (stdout, to look at), ``none``; a comma-separated list for several;
* ``OTEL_SERVICE_NAME`` (default ``ledgerflow``), ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``,
  ``OTEL_BSP_*`` as OpenTelemetry defines them; ``OTEL_SDK_DISABLED=true`` turns it all off.

Where spans come from:

* Temporal's ``TracingInterceptor`` (``temporalio.contrib.opentelemetry``) on the client (``ledgerflow``'s
  CLI: ``StartWorkflow:TaskWorkflow``, ``SignalWorkflow:…``, ``QueryWorkflow:…``) and on the worker
  (``RunWorkflow:TaskWorkflow``, ``StartActivity:…`` and ``RunActivity:…``; the workflow's spans are made by
  the interceptor outside the sandbox, so replay stays deterministic). Workflow spans exist only under a
  traced client's start; a task started by another client still has its activities' spans.
* ``span`` around the operation lifecycle's ledger work (``ledger.intent``, ``ledger.open``,
  ``ledger.submitting``, ``ledger.result``, ``ledger.append``: ``activities/operation.py``), reconciliation
  (``reconcile``: ``reconcile/operations.py``) and every vendor call (``vendor.submit``, ``vendor.get``,
  ``vendor.find_by_key``, ``vendor.cancel``, ``vendor.download``, ``vendor.charged``: ``vendors.traced``).

Each of these spans, and the ``RunActivity`` span of an operation, carries ``ledgerflow.task_id``,
``ledgerflow.node``, ``ledgerflow.operation_key``, ``ledgerflow.epoch`` and (for a vendor's route)
``ledgerflow.route``, taken from the operation the lifecycle bound (``runtime.logs.bind``); the log lines
logged meanwhile carry the span's ``trace_id``. Attributes never hold a request, a URL or a key.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Final

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.util.types import AttributeValue
from temporalio.client import Client
from temporalio.client import Interceptor as ClientInterceptor
from temporalio.contrib.opentelemetry import TracingInterceptor
from temporalio.worker import Interceptor as WorkerInterceptor

from runtime.logs import OperationContext, current
from runtime.settings import ConfigError

SCOPE: Final = "ledgerflow"
_lock = threading.Lock()
_configured: bool | None = None  # None: the environment not read yet
_provider: trace.TracerProvider | None = None  # installed by ``install`` (tests), else by ``setup``
_tracer: trace.Tracer = trace.get_tracer(SCOPE)  # OpenTelemetry's proxy: a no-op until a provider is set


def setup() -> bool:
    """Configure tracing from the environment, once per process; True if spans are exported.

    Sets OpenTelemetry's global tracer provider (flushed at exit) when the variables ask for an exporter.
    """
    global _configured
    with _lock:
        if _configured is None:
            found = exporters(os.environ)
            if found:
                name = os.environ.get("OTEL_SERVICE_NAME") or "ledgerflow"
                provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
                for exporter in found:
                    provider.add_span_processor(BatchSpanProcessor(exporter))
                trace.set_tracer_provider(provider)
            _configured = bool(found)
        return _configured or _provider is not None


def exporters(env: Mapping[str, str]) -> list[SpanExporter]:
    """The span exporters the OTEL_* variables in ``env`` ask for (none: tracing stays off)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names and (
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        names = ["otlp"]
    found: list[SpanExporter] = []
    for name in names:
        if name == "none":
            continue
        if name == "console":
            found.append(ConsoleSpanExporter())
        elif name == "otlp":
            protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            if protocol not in (None, "", "http/protobuf"):
                raise ConfigError(
                    f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: ledgerflow exports OTLP over http/protobuf "
                    "(port 4318 on a collector)"
                )
            # Imported only when used: the exporter pulls in requests and protobuf.
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            found.append(OTLPSpanExporter())  # endpoint, headers, timeout: from OTEL_EXPORTER_OTLP_*
        else:
            raise ConfigError(f"OTEL_TRACES_EXPORTER={name!r}: use otlp, console or none")
    return found


def install(provider: trace.TracerProvider | None) -> None:
    """Send ledgerflow's spans (and new interceptors') to ``provider``; None: back to the global one.

    For tests, which cannot replace OpenTelemetry's global provider (it is set once per process).
    """
    global _provider, _tracer
    _provider = provider
    _tracer = (provider or trace.get_tracer_provider()).get_tracer(SCOPE)


def tracer() -> trace.Tracer:
    return _tracer


def client_interceptors() -> list[ClientInterceptor]:
    """What a client connects with: Temporal's tracing interceptor when tracing is on, else nothing."""
    if not setup():
        return []
    return [TracingInterceptor(_provider.get_tracer("temporalio") if _provider is not None else None)]


def worker_interceptors(client: Client) -> list[WorkerInterceptor]:
    """What a worker adds to its client's interceptors: the tracing interceptor, when tracing is on and the
    client does not have it already (a worker inherits its client's; twice would double every span)."""
    if any(isinstance(i, TracingInterceptor) for i in client.config()["interceptors"]):
        return []
    return [i for i in client_interceptors() if isinstance(i, WorkerInterceptor)]


def attributes(ctx: OperationContext | None = None) -> dict[str, AttributeValue]:
    """The ``ledgerflow.*`` attributes of an operation (default: the current one)."""
    ctx = ctx or current()
    if ctx is None:
        return {}
    found: dict[str, AttributeValue] = {
        "ledgerflow.task_id": ctx.task_id,
        "ledgerflow.node": ctx.node,
        "ledgerflow.operation_key": ctx.operation_key,
        "ledgerflow.epoch": ctx.epoch,
    }
    if ctx.route is not None:
        found["ledgerflow.route"] = ctx.route
    return found


def annotate(ctx: OperationContext) -> None:
    """Put the operation's attributes on the current span (an operation's ``RunActivity`` span)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(attributes(ctx))


@contextmanager
def span(
    name: str,
    extra: Mapping[str, AttributeValue | None] | None = None,
    *,
    kind: trace.SpanKind = trace.SpanKind.INTERNAL,
) -> Iterator[trace.Span]:
    """A span named ``name``, a child of the current one, with the current operation's attributes and
    ``extra`` (None values left out); an exception escaping it is recorded on it."""
    attrs = attributes()
    attrs.update({k: v for k, v in (extra or {}).items() if v is not None})
    with _tracer.start_as_current_span(name, kind=kind, attributes=attrs) as s:
        yield s
