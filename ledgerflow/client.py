"""Starting and inspecting tasks through the Temporal client and the ledger (used by the CLI and tests)."""

from __future__ import annotations

from typing import Any

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from ledger.recorder import Recorder
from ledgerflow.errors import ClientError as ClientError  # where it always was, for callers
from reconcile.takeover import needs_a_run, orphaned_tasks
from rules.envelope import StoredEvent
from rules.plan import Plan, Routes, load_plan
from rules.projection import fold, node_state, summary, waiting_nodes
from runtime import telemetry
from runtime.settings import Settings, get_settings
from runtime.signing import ApproverKey, demo_public_keys
from runtime.temporal_config import connect_options
from vendors.routes import deployment_table
from workflows.contracts import TaskInput, TaskResult, starting_story, workflow_id
from workflows.policies import start_priority
from workflows.task import TaskWorkflow


def parse_plan(text: str, task_id: str | None = None, routes: Routes | None = None) -> Plan:
    """Validate a plan against this deployment's route table (``LEDGERFLOW_ROUTES_FILE``, or the default)."""
    return load_plan(text, routes or deployment_table(get_settings()).names(), task_id=task_id)


async def connect(settings: Settings) -> Client:
    """A client for the CLI; traced (its starts, signals and queries) when the OTEL_* variables turn tracing
    on (runtime/telemetry.py): a task it starts is then one trace, down to each vendor call."""
    options = connect_options(settings)  # Temporal's envconfig (TLS, API key) + our address
    address = options["target_host"]
    try:
        return await Client.connect(
            **options,
            data_converter=pydantic_data_converter,
            interceptors=telemetry.client_interceptors(),
        )
    except RuntimeError as e:
        raise ClientError(f"cannot reach Temporal at {address} ({str(e).splitlines()[0][:120]})") from None


def recorder(settings: Settings) -> Recorder:
    rec = Recorder(settings.resolved_database_url())
    rec.check_schema()  # never DDL: `ledgerflow db upgrade` migrates (ledger/migrate.py)
    return rec


def stack_dev(settings: Settings) -> Settings:
    """``settings`` in dev mode if the stack this client talks to is a dev stack (for ``decide --as`` and
    ``sign --as``: the demo approvers' keys).

    LEDGERFLOW_ENV, when set at process start, decides. Otherwise the stack tells, never a file: its ledger's
    approver registry holds an active demo key only in a dev stack (``ledgerflow up`` registers them; a
    production worker refuses to start while one is registered, and refuses every decision signed with one).
    A stack.json dropped in a working directory may name another ledger; then what is signed is good for
    that ledger's workers only.
    """
    if settings.env is not None:
        return settings
    rec = recorder(settings)
    try:
        demo = demo_public_keys()
        dev = any(k.public_key in demo and k.revoked_at is None for k in rec.key_registry().values())
    finally:
        rec.dispose()
    return settings.model_copy(update={"env": "dev"}) if dev else settings


async def submit(settings: Settings, plan: Plan, task_id: str, *, wait: bool = False) -> dict[str, Any]:
    """Start the task's workflow. A task id already in the ledger or in Temporal is refused, not rerun."""
    rec = recorder(settings)
    try:
        if rec.current_epoch(task_id) is not None:
            raise ClientError(f"task {task_id!r} already exists in the ledger; use a new --task-id")
    finally:
        rec.dispose()
    client = await connect(settings)
    plan = plan.model_copy(update={"task_id": task_id})
    try:
        handle = await client.start_workflow(
            TaskWorkflow.run,
            TaskInput(
                task_id=task_id, plan=plan, heartbeat_timeout_seconds=settings.heartbeat_timeout_seconds
            ),
            id=workflow_id(task_id),
            task_queue=settings.task_queue,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
            static_summary=plan.goal[:200],
            priority=start_priority(plan.priority),
            **starting_story(plan),
        )
    except WorkflowAlreadyStartedError:
        raise ClientError(
            f"task {task_id!r} was already submitted (workflow {workflow_id(task_id)})"
        ) from None
    except RPCError as e:
        raise ClientError(f"Temporal refused to start task {task_id!r}: {e.message}") from None
    return await _outcome(handle, task_id, wait)


async def resume(settings: Settings, task_id: str, *, wait: bool = False) -> dict[str, Any]:
    """Start a new run for a task whose workflow is gone, from the ledger alone (takeover).

    The plan comes from the task's TaskCreated event; the new run takes a new fencing epoch (so anything left
    of an old run is fenced off), folds the ledger and resumes every open operation through reconciliation.
    """
    rows = events(settings, task_id)
    projection = fold(rows)
    if not needs_a_run(projection):  # an ended task with an operation still open needs a run to close it
        raise ClientError(f"task {task_id!r} is already {projection.state.value}; nothing to resume")
    client = await connect(settings)
    handle = client.get_workflow_handle(workflow_id(task_id))
    try:
        described = await handle.describe()
        if described.status == WorkflowExecutionStatus.RUNNING:
            raise ClientError(f"task {task_id!r} is running (workflow {handle.id}); nothing to resume")
    except RPCError as e:
        if e.status != RPCStatusCode.NOT_FOUND:
            raise ClientError(f"Temporal refused to describe {handle.id}: {e.message}") from None
    plan = projection.plan.model_copy(update={"task_id": task_id})
    new = await client.start_workflow(
        TaskWorkflow.run,
        TaskInput(task_id=task_id, plan=plan, heartbeat_timeout_seconds=settings.heartbeat_timeout_seconds),
        id=workflow_id(task_id),
        task_queue=settings.task_queue,
        # The old run is closed (terminated, failed, timed out) or unknown to this namespace: a new run of the
        # same task id is what takeover means. A running one is refused above and by the conflict policy.
        id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
        id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
        priority=start_priority(plan.priority),
    )
    return await _outcome(new, task_id, wait)


async def _outcome(handle: WorkflowHandle[Any, TaskResult], task_id: str, wait: bool) -> dict[str, Any]:
    """What a started run tells its caller: ids, or with ``wait`` the final summary (state included)."""
    if not wait:
        return {"task_id": task_id, "workflow_id": handle.id, "run_id": handle.result_run_id}
    try:
        result = await handle.result()
    except WorkflowFailureError as e:
        return {"task_id": task_id, "workflow_id": handle.id, "state": "Failed", "error": str(e.cause or e)}
    return {"workflow_id": handle.id, **result.summary}


async def open_tasks_without_a_run(settings: Settings) -> list[str]:
    """Tasks the ledger says are unfinished but whose workflow is not running (reconcile.takeover)."""
    rec = recorder(settings)
    try:
        return await orphaned_tasks(rec, await connect(settings), workflow_id)
    finally:
        rec.dispose()


async def status(settings: Settings, task_id: str) -> dict[str, Any]:
    """The live status from the workflow's query; the ledger's fold if the workflow is gone or closed."""
    try:
        client = await connect(settings)
        handle = client.get_workflow_handle(workflow_id(task_id))
        live = dict(await handle.query("status"))
    except (RPCError, ClientError):
        return summary(fold(events(settings, task_id)))
    # Each node's state from the ledger, which has what the workflow has not read yet (a vendor's job id
    # recorded mid-attempt): "running" there while the workflow only knows its executor was started.
    p = fold(events(settings, task_id))
    waiting = waiting_nodes(p)
    for node_id, view in live.get("nodes", {}).items():
        if node_id in p.nodes:
            view["state"] = node_state(p, p.nodes[node_id], waiting).value
    return live


def events(settings: Settings, task_id: str) -> list[StoredEvent]:
    rec = recorder(settings)
    try:
        rows = rec.read_events(task_id)
    finally:
        rec.dispose()
    if not rows:
        raise ClientError(f"no task {task_id!r} in the ledger")
    return rows


async def change(
    settings: Settings,
    key: ApproverKey,
    task_id: str,
    kind: str,
    *,
    node: str | None = None,
    edit: dict[str, Any] | None = None,
    note: str = "",
) -> Any:
    """Steer a running task: sign a change (pause, resume, edit, reroute, skip, waive, restore — see
    ``rules.changes``) with the approver's ``key`` and send it as the task's ``change`` Update; the ruling,
    once recorded (``.status``: accepted, rejected or pending; ``.detail``: by whom, or why not).

    ``edit``: an edit's request fields, a re-route's ``{"route": R}``, a restore's ``{"version": N}``.
    The same signing and sending as ``ledgerflow change`` and the reviewer page."""
    from ledgerflow.views import people  # the views import this module: imported when called

    return await people.change(settings, key, task_id, kind, node=node, edit=edit, note=note)
