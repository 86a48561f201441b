"""A retried activity frees its workflow from the worker that cached it.

Temporal hands a workflow's next task to the worker that ran its last one (its *sticky* queue: that worker
holds the workflow in memory), and moves it to any worker only after the sticky schedule-to-start timeout.
That timeout is a trade: short, and a worker that merely falls behind under load loses its workflows to
other workers, which replay each from its full history — more CPU on a saturated machine, so more tasks
wait past the timeout (seen in the soak at 2 s: a quarter of all workflow tasks timed out on their sticky
queue; Temporal's SDKs describe the same snowball); long, and a worker that died (or hangs) holds its
workflows' next step that long.

This interceptor takes the second half of the trade away, so the timeout can be long (Temporal's 10 s,
``Settings.sticky_schedule_to_start_seconds``). An activity's second attempt usually means its first one's
worker stopped answering (a heartbeat timeout), and that worker may be the one caching the workflow: before
the attempt runs, it resets the workflow's stickiness (``ResetStickyTaskQueue``, what a worker's graceful
shutdown does), so the task that brings this attempt's result goes to any live worker at once. Where the
first attempt failed for another reason (a 429, a vendor error) the reset costs one replay of the workflow on
whichever worker takes its next task; stickiness is only a cache, so it never changes what a workflow does.
Local activities run inside their workflow's own task: they are left alone.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Final

from temporalio import activity
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import ResetStickyTaskQueueRequest
from temporalio.client import Client
from temporalio.service import RPCError
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
)

log = logging.getLogger("ledgerflow.worker")

RESET_TIMEOUT: Final = timedelta(seconds=5)  # the reset is an optimisation: never hold the attempt longer


class ReleaseStickinessOnRetry(Interceptor):
    """Worker interceptor: an activity attempt after the first resets its workflow's stickiness first."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _Inbound(next, self._client)


class _Inbound(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, client: Client) -> None:
        super().__init__(next)
        self._client = client

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        info = activity.info()
        if info.attempt > 1 and not info.is_local and info.workflow_id and info.workflow_namespace:
            await release(self._client, info.workflow_namespace, info.workflow_id, info.workflow_run_id)
        return await super().execute_activity(input)


async def release(client: Client, namespace: str, workflow_id: str, run_id: str | None) -> None:
    """Reset one workflow run's stickiness; a failure is logged and ignored (the timeout still applies)."""
    try:
        await client.workflow_service.reset_sticky_task_queue(
            ResetStickyTaskQueueRequest(
                namespace=namespace, execution=WorkflowExecution(workflow_id=workflow_id, run_id=run_id or "")
            ),
            timeout=RESET_TIMEOUT,
        )
    except RPCError as e:
        log.info("could not reset the stickiness of %s: %s", workflow_id, e.message)
