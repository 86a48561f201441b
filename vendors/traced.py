"""A vendor adapter whose every call is a ``vendor.*`` client span (``runtime.telemetry``'s spans).

Each span carries the operation's attributes (task, node, key, epoch, route: ``runtime.telemetry.span``) and
what the call saw (the job id and status; the vendor's cost figure as ``ledgerflow.cost`` and its token counts
as the GenAI conventions' ``gen_ai.usage.*`` where it reports them; the route's model as
``gen_ai.request.model``); never a request, a URL or a key. Cheap when tracing is off:
OpenTelemetry's no-op spans. Every adapter ``vendors.registry.Adapters`` hands out is one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from decimal import Decimal
from typing import Any

from opentelemetry import trace

from runtime.telemetry import span
from vendors.adapter import Capabilities, Sent, VendorAdapter, VendorJob
from vendors.routes import RouteSpec


class TracedAdapter:
    """A vendor adapter whose every call is a ``vendor.*`` client span (with the job id and status it saw)."""

    def __init__(self, inner: VendorAdapter) -> None:
        self.inner = inner
        self.route: RouteSpec = inner.route

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    @contextmanager
    def _span(self, call: str, job_id: str | None = None) -> Iterator[trace.Span]:
        adapter = {"ledgerflow.adapter": self.route.adapter, "gen_ai.request.model": self.route.model}
        with span(f"vendor.{call}", adapter, kind=trace.SpanKind.CLIENT) as s:
            if job_id is not None:
                s.set_attribute("ledgerflow.job_id", job_id)
            yield s

    @staticmethod
    def _saw(s: trace.Span, job: VendorJob) -> VendorJob:
        s.set_attributes({"ledgerflow.job_id": job.id, "ledgerflow.job_status": str(job.status)})
        if job.cost is not None:
            s.set_attribute("ledgerflow.cost", job.cost[:40])  # the vendor's figure as reported
        if job.tokens_in or job.tokens_out:
            s.set_attributes(
                {"gen_ai.usage.input_tokens": job.tokens_in, "gen_ai.usage.output_tokens": job.tokens_out}
            )
        return job

    async def submit(
        self,
        *,
        operation_key: str,
        executor: str,
        request: dict[str, Any],
        estimate: Decimal,
        files: dict[str, str] | None = None,
    ) -> VendorJob:
        with self._span("submit") as s:
            job = await self.inner.submit(
                operation_key=operation_key,
                executor=executor,
                request=request,
                estimate=estimate,
                files=files,
            )
            return self._saw(s, job)

    async def get(self, job_id: str) -> VendorJob:
        with self._span("get", job_id) as s:
            return self._saw(s, await self.inner.get(job_id))

    async def find_by_key(
        self, operation_key: str, *, since: datetime | None = None, sent: Sent | None = None
    ) -> list[VendorJob]:
        with self._span("find_by_key") as s:
            jobs = await self.inner.find_by_key(operation_key, since=since, sent=sent)
            s.set_attribute("ledgerflow.jobs_found", len(jobs))
            return jobs

    async def cancel(self, job_id: str) -> VendorJob:
        with self._span("cancel", job_id) as s:
            return self._saw(s, await self.inner.cancel(job_id))

    async def download(self, job: VendorJob, sink: Callable[[bytes], Awaitable[None] | None]) -> None:
        with self._span("download", job.id):
            await self.inner.download(job, sink)

    async def charged(self, operation_key: str, job_id: str | None) -> str | None:
        with self._span("charged", job_id):
            return await self.inner.charged(operation_key, job_id)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def __getattr__(self, name: str) -> Any:
        # Whatever an adapter offers beyond the protocol (e.g. a billing listing) reaches it, untraced.
        return getattr(self.inner, name)
