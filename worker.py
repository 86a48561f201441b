"""Start a ledgerflow worker: TaskWorkflow and every activity, on the configured task queue.

``python worker.py`` and ``ledgerflow worker`` do the same thing. Workers are stateless: run as many as you
like on the same task queue; the ledger's fencing epoch keeps them from acting twice for one task.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from datetime import timedelta

import httpx
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import Runtime
from temporalio.worker import Interceptor, Worker

from activities.billing import BillingActivities
from activities.callbacks import CallbackWaker
from activities.ledger import LedgerActivities
from activities.llm import ChatClient, LlmActivities
from activities.people import PeopleActivities
from activities.review import ReviewActivities
from activities.stages import StageActivities
from artifacts import ArtifactStore, open_store, store_for_uri
from ledger.recorder import Recorder
from ledgerflow.views.schedules import last_success
from reconcile.scans import Runs, ScanActivities
from runtime import logs, telemetry
from runtime.metrics import MetricsSettings, known_routes, sdk_runtime, serve_metrics
from runtime.settings import ConfigError, Settings, get_settings
from runtime.signing import demo_public_keys
from runtime.stickiness import ReleaseStickinessOnRetry
from runtime.temporal_config import connect_options
from vendors.registry import Adapters
from vendors.routes import deployment_table
from vendors.sandbox import runtime_non_dumpable
from workflows.contracts import workflow_id
from workflows.reconciliation import SCAN_WORKFLOWS, BillingReconciliationWorkflow
from workflows.takeover import start_takeover
from workflows.task import TaskWorkflow
from workflows.visibility import ensure_search_attributes

log = logging.getLogger("ledgerflow.worker")


async def build_worker(
    client: Client,
    settings: Settings,
    stack: AsyncExitStack,
    *,
    task_queue: str | None = None,
    interceptors: Sequence[Interceptor] | None = None,
) -> Worker:
    """Wire the activities to their dependencies and return an (unstarted) worker.

    ``interceptors``: besides the client's (a worker inherits those); None: tracing's, when the environment
    turns it on and the client has not got it (runtime/telemetry.py).
    """
    compile_workflow_modules()
    recorder = Recorder(settings.resolved_database_url(), pool_size=settings.db_pool_size)
    recorder.check_schema()  # never DDL: `ledgerflow db upgrade` migrates (ledger/migrate.py)
    stack.callback(recorder.dispose)
    refuse_dev_secrets(settings, recorder)
    settings.root_keys()  # a malformed LEDGERFLOW_KEY_ROOTS stops the start (ConfigError), not each decision
    await ensure_search_attributes(client)
    http = await stack.enter_async_context(httpx.AsyncClient(timeout=30.0))
    store = open_store(settings.store_location())
    stores = [store]

    def store_for(uri: str) -> ArtifactStore:
        return store_for_uri(uri, stores)

    table = deployment_table(settings)
    adapters = Adapters(
        table,
        vendor_url=settings.vendor_url_or_none(),
        credential=settings.credential,
        client=http,
        store_for=store_for,
    )
    stack.push_async_callback(adapters.aclose)
    chat = ChatClient.from_settings(http, settings)
    ledger = LedgerActivities(
        recorder,
        table,
        price_history=settings.price_history,
        price_cache_s=settings.price_cache_seconds,
        notify_projects=frozenset(settings.notify_webhooks),
        active_tasks=settings.active_tasks,
    )
    store.sweep_temp()  # temp files of uploads interrupted by a crash: never registered, safe to delete
    waker = None
    if any(spec.callback is not None for spec in table.routes.values()):
        # Routes whose vendor calls back: one LISTEN connection wakes their waiting attempts.
        waker = CallbackWaker(settings.resolved_database_url())
        await waker.start()
        stack.push_async_callback(waker.close)
    stages = StageActivities(
        recorder,
        adapters,
        store,
        settings.poll_interval_seconds,
        store_for=store_for,
        pause_retry_s=settings.route_pause_retry_seconds,
        max_poll_interval=settings.max_poll_interval_seconds,
        human_capacity=settings.human_capacity,
        waker=waker,
    )
    review = ReviewActivities(recorder, store, chat, adapters=adapters, store_for=store_for)
    llm = LlmActivities(recorder, chat)
    people = PeopleActivities(recorder, settings, client)
    vendor_url = settings.vendor_url_or_none()
    billing = BillingActivities(recorder, adapters.table, adapters.get, vendor_url=vendor_url)
    queue = task_queue or settings.task_queue
    beat = settings.heartbeat_timeout_seconds
    take_over = functools.partial(start_takeover, task_queue=queue, heartbeat_timeout_seconds=beat)
    scans = ScanActivities(recorder, client, table, Runs(workflow_id, take_over), task_queue=queue)
    executor = ThreadPoolExecutor(max_workers=64)
    stack.callback(executor.shutdown, wait=False)
    return Worker(
        client,
        task_queue=queue,
        workflows=[TaskWorkflow, BillingReconciliationWorkflow, *SCAN_WORKFLOWS],
        activities=[
            ledger.open_task,
            ledger.append,
            ledger.mark,
            ledger.read,
            ledger.admit,
            ledger.release,
            stages.run,
            stages.close,
            stages.sweep,
            review.compose,
            review.review,
            review.gate,
            llm.decide,
            people.record_batch,
            people.record_changes,
            people.notify,
            people.arrivals,
            billing.reconcile,
            scans.orphans,
            scans.route_holds,
            scans.consistency,
        ],
        activity_executor=executor,
        max_concurrent_activities=settings.max_concurrent_activities,
        # On SIGTERM the worker stops polling and gives its in-flight activities this long to finish; the rest
        # are cancelled as a shutdown (their operations stay open for the next attempt to reconcile).
        graceful_shutdown_timeout=timedelta(seconds=settings.graceful_shutdown_seconds),
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=settings.sticky_schedule_to_start_seconds),
        interceptors=[
            *(telemetry.worker_interceptors(client) if interceptors is None else interceptors),
            # A retried activity frees its workflow from a worker that may be dead (runtime/stickiness.py).
            ReleaseStickinessOnRetry(client),
        ],
    )


def refuse_dev_secrets(settings: Settings, recorder: Recorder) -> None:
    """Outside dev mode a worker does not start with a secret anyone can know: a default vendor or LLM key,
    or a demo approver key still registered (anyone could sign as that approver). ConfigError, one line."""
    if settings.dev:
        return
    problem = settings.default_secret()
    if problem is not None:
        raise ConfigError(problem)
    demo = demo_public_keys()
    found = sorted(
        k.key_id for k in recorder.key_registry().values() if k.public_key in demo and not k.revoked_at
    )
    if found:
        raise ConfigError(
            f"the approver key registry holds demo keys ({', '.join(found)}): revoke them with "
            "`ledgerflow keys revoke KEY_ID`, or run in dev mode (LEDGERFLOW_ENV=dev)"
        )


def compile_workflow_modules(dirs: Iterable[str] | None = None) -> bool:
    """Write the bytecode caches of the workflow modules where they are missing or stale; False if a file
    could not be compiled or written (logged; the worker runs, compiling as before). ``dirs``: these
    package directories instead (tests).

    Temporal's sandbox imports a workflow's modules afresh for every workflow it builds in memory (each
    start, each replay after its cache lost the run). Without a bytecode cache — PYTHONDONTWRITEBYTECODE, as
    container images often set — each of those compiles workflows/task.py from source (~40 ms; 5 % of a
    worker's samples in the 200-task soak). Python reads caches even when told not to write them, so they
    are written here, for these modules only.
    """
    import compileall

    import workflows

    ok = all([compileall.compile_dir(d, quiet=2, maxlevels=0) for d in dirs or workflows.__path__])
    if not ok:
        log.warning("the workflow modules' bytecode caches could not be written: each run compiles them")
    return ok


async def connect(settings: Settings, runtime: Runtime | None = None) -> Client:
    """The worker's client: on ``runtime`` if given (one exporting the SDK's metrics), else the default."""
    return await Client.connect(
        **connect_options(
            settings
        ),  # Temporal's envconfig (TLS, API key) + our address (runtime/temporal_config)
        data_converter=pydantic_data_converter,
        runtime=runtime,
    )


async def run_worker(settings: Settings | None = None) -> None:
    settings = settings or get_settings()
    metrics = MetricsSettings()  # LEDGERFLOW_METRICS_PORT: /metrics and /healthz (runtime/metrics.py)
    runtime = sdk_runtime(metrics)
    client = await connect(settings, runtime)
    async with AsyncExitStack() as stack:
        worker = await build_worker(client, settings, stack)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with worker, AsyncExitStack() as serving:
            if metrics.metrics_port is not None:
                # Served only while the worker runs: /healthz never says ready for a worker shutting down.
                url = settings.resolved_database_url()
                # Every route of the route file is exported (at 0 while idle), not only those with rows.
                routes = known_routes(deployment_table(settings))
                server = serving.enter_context(
                    serve_metrics(
                        metrics,
                        url,
                        client,
                        loop,
                        sdk=runtime is not None,
                        routes=routes,
                        scans=functools.partial(last_success, client, settings.task_queue),
                        queues=(settings.task_queue,),
                    )
                )
                log.info("metrics on %s/metrics, health on %s/healthz", server.url, server.url)
            log.info("worker on task queue %s", settings.task_queue)
            print(f"MARK worker_ready queue={settings.task_queue}", flush=True)
            await stop.wait()


if __name__ == "__main__":
    try:
        # Before anything runs: what the worker starts (an example's sandbox, a probe) cannot read its
        # /proc/<pid>/environ (the database URL, the vendor keys) even under the same uid.
        runtime_non_dumpable()
        logs.configure()  # LEDGERFLOW_LOG_FORMAT=json: one JSON object per line (runtime/logs.py)
        asyncio.run(run_worker())
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
