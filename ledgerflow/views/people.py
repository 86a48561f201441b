"""People in the loop, the operator's side: the queue of open requests, one request's context package,
signing and sending a decision, and the dead-letter view (the CLI's ``queue``, ``request``, ``decide``,
``dlq``). The ledger is the source: every view folds the tasks' events; a decision counts once the worker
has recorded it, which ``decide`` waits for.

Requests are named globally as ``TASK_ID/REQUEST_ID`` (a task id never contains ``/``; a request id may).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text
from temporalio.client import (
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
    WorkflowUpdateStage,
)
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from ledgerflow import client
from ledgerflow.client import ClientError, connect, recorder
from ledgerflow.views.queue import (
    QueueItem,
    dead_letters,
    group,
    open_items,
    request_detail,
)
from reconcile.takeover import task_histories
from reconcile.takeover import unfinished as still_running
from rules.actions import RequestKind
from rules.changes import canonical_change
from rules.envelope import StoredEvent
from rules.events import ChangeKind
from rules.people import (
    answer,
    canonical,
    describe_resolution,
    issued_now,
    parse_money,
    resolutions,
    rules_on,
)
from rules.plan import ID_PATTERN
from rules.projection import Projection, apply, fold
from runtime.settings import Settings
from runtime.signing import DEMO_APPROVERS, ApproverKey, KeyFileError, demo_key, load_key_file

DECISIONS = {"approve": "approve", "resume": "resume", "abort": "abort", "add-budget": "add_budget"}
POLL_SECONDS = 30.0
# How long a decision's Update may wait for a worker to accept it before the signal carries it instead.
ACCEPT_SECONDS = 5.0


def parse_global_id(text: str) -> tuple[str, str]:
    """``TASK_ID/REQUEST_ID`` -> (task id, request id); ClientError if it is not one."""
    import re

    task_id, sep, request_id = text.partition("/")
    if not sep or not re.fullmatch(ID_PATTERN, task_id) or not request_id:
        raise ClientError(f"{text[:80]!r} is not a request id of the form TASK_ID/REQUEST_ID")
    return task_id, request_id


def _tasks(settings: Settings, *, unfinished: bool) -> list[tuple[Projection, list[StoredEvent]]]:
    rec = recorder(settings)
    try:
        return task_histories(rec, keep=still_running if unfinished else None)
    finally:
        rec.dispose()


def _task(settings: Settings, task_id: str) -> tuple[Projection, list[StoredEvent]]:
    history = client.events(settings, task_id)
    return fold(history), history


# ── queue ────────────────────────────────────────────────────────────────────────────────────────────


def queue(settings: Settings) -> list[list[QueueItem]]:
    """Open requests across unfinished tasks, most consequential first, grouped by root cause."""
    items: list[QueueItem] = []
    for p, events in _tasks(settings, unfinished=True):
        opened_at = {e.seq: e.recorded_at for e in events if e.type == "Intent"}
        items += open_items(p, opened_at)
    return group(items)


def queue_json(groups: list[list[QueueItem]]) -> list[dict[str, Any]]:
    return [{"group": n, "group_size": len(g), **i.as_json()} for n, g in enumerate(groups, 1) for i in g]


def queue_table(groups: list[list[QueueItem]], now: datetime | None = None) -> Text:
    """One line per request (print with ``soft_wrap``: lines are never wrapped); a group's first member
    shows its size, the others ``↳``."""
    if not groups:
        return Text("no open requests")
    now = now or datetime.now(UTC)
    rows = [("#", "REQUEST", "KIND", "VALUE", "AGE", "GROUP", "REASON")]
    n = 0
    for g in groups:
        for i, item in enumerate(g):
            n += 1
            size = (f"×{len(g)}" if i == 0 else "↳") if len(g) > 1 else ""
            kind = item.kind.value + ("*" if item.blocking and item.kind == RequestKind.DEAD_LETTER else "")
            reason = item.reason if len(item.reason) <= 100 else item.reason[:99] + "…"
            rows.append(
                (str(n), item.global_id, kind, item.value.value, _age(now - item.opened_at), size, reason)
            )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
    text = Text(f"{n} open requests, most consequential first\n", style="bold")
    for j, row in enumerate(rows):
        cells = [
            row[c].rjust(widths[c]) if c in (0, 4, 5) else row[c].ljust(widths[c]) for c in range(len(widths))
        ]
        line = "  ".join(cells) + "  " + row[-1]
        text.append(line.rstrip() + "\n", style="dim" if j == 0 else ("" if row[5] != "↳" else "italic"))
    if any(i.blocking and i.kind == RequestKind.DEAD_LETTER for g in groups for i in g):
        text.append("* blocks compliance or the release\n", style="dim")
    return text


def _age(delta: Any) -> str:
    seconds = max(0, int(delta.total_seconds()))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h"


# ── one request ──────────────────────────────────────────────────────────────────────────────────────


def request(settings: Settings, task_id: str, request_id: str) -> dict[str, Any]:
    p, events = _task(settings, task_id)
    detail = request_detail(p, events, request_id)
    if detail is None:
        raise ClientError(f"no request {request_id!r} in task {task_id}")
    return detail


def request_view(d: dict[str, Any]) -> Group:
    """The context package, for a person to read."""
    ctx = d["context_now"]
    spend = ctx["spend"]
    approvers = d["approvers"]
    lines: list[Any] = [
        Text(f"{d['id']} — {d['kind']} — {d['status']}", style="bold"),
        Text(f"task {d['task_id']} ({d['task_state']}): {d['goal']}"),
        Text(f"reason:   {d['reason']}"),
        Text(
            f"node:     {d['node'] or '—'}   opened {d['opened_at']}   deadline {d['deadline'] or 'none'}"
            f" (then: {d['timeout_policy'] or '—'})"
        ),
        Text(
            f"spend:    spent {spend['spent']} + reserved {spend['reserved']} of {spend['ceiling']}"
            f" — remaining {spend['remaining']}"
        ),
        Text(f"approvers: {approvers if isinstance(approvers, str) else ', '.join(approvers)}"),
    ]
    options = Table(title="options", title_justify="left", show_edge=False)
    options.add_column("decision")
    options.add_column("effect")
    for o in ctx["options"]:
        options.add_row(o["decision"].replace("_", "-"), o["effect"])
    lines.append(options)
    if d["attempts"]:
        attempts = Table(title="attempts", title_justify="left", show_edge=False)
        for col in ("#", "executor", "result", "cost", "error"):
            attempts.add_column(col, overflow="fold")
        for a in d["attempts"]:
            attempts.add_row(
                str(a["attempt"]), a["executor"], a["result"], a["cost"], (a["error"] or "")[:200]
            )
        lines.append(attempts)
    if ctx["failures"] and not d["attempts"]:
        failures = Table(title="failure history", title_justify="left", show_edge=False)
        for col in ("node", "attempt", "kind", "error"):
            failures.add_column(col, overflow="fold")
        for f in ctx["failures"]:
            failures.add_row(f["node"], str(f["attempt"]), f["kind"], f["error"][:300])
        lines.append(failures)
    for a in ctx["artifacts"]:
        lines.append(Text(f"artifact ({a['role']}) {a['node']}: {a['uri']} sha256 {a['sha256'][:16]}…"))
    for r in d["refused"]:
        lines.append(Text(f"refused #{r['seq']}: {r['detail']}", style="yellow"))
    return Group(*lines)


# ── deciding ─────────────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Sent:
    decision_id: str
    status: str  # accepted | already resolved | rejected | pending
    detail: str

    @property
    def line(self) -> str:
        if self.status == "accepted":
            return f"accepted ({self.detail})"
        if self.status == "already resolved":
            what, by, who = self.detail.rpartition(" by ")
            return f"already resolved (by {who}: {what})" if by else f"already resolved ({self.detail})"
        if self.status == "rejected":
            return f"rejected: {self.detail}"
        return f"pending: {self.detail}"


def signed_payload(
    key: ApproverKey,
    task_id: str,
    request_id: str,
    decision: str,
    *,
    note: str = "",
    amount: str | None = None,
    scope: str | None = None,
    decision_id: str | None = None,
    issued_at: datetime | None = None,
) -> dict[str, Any]:
    """A decision signed with the approver's private ``key`` (checks the user's input first), issued now
    (or at ``issued_at``): the worker refuses it once it arrives outside its window of that time."""
    if decision not in DECISIONS:
        raise ClientError(f"decision {decision[:40]!r} is not one of {', '.join(DECISIONS)}")
    wire = DECISIONS[decision]
    if wire == "add_budget":
        if amount is None:
            raise ClientError("add-budget needs --amount")
        try:
            amount = format(parse_money(amount), "f")
        except ValueError as e:
            raise ClientError(f"amount {amount[:40]!r} {e}") from None
    elif amount is not None:
        raise ClientError(f"--amount is only for add-budget, not {decision}")
    elif scope is not None:
        raise ClientError(f"--scope is only for add-budget, not {decision}")
    did = decision_id or str(uuid.uuid4())
    issued = issued_now(issued_at or datetime.now(UTC))
    message = canonical(task_id, did, request_id, wire, key.approver, key.key_id, amount, scope, note, issued)
    return {
        "decision_id": did,
        "request_id": request_id,
        "decision": wire,
        "approver": key.approver,
        "key_id": key.key_id,
        "note": note,
        "amount": amount,
        "scope": scope,
        "issued_at": issued,
        "signature": key.sign(message),
    }


def approver_key(settings: Settings, key_file: Path | None, approver: str | None) -> ApproverKey:
    """The key to sign with: ``key_file``, else (dev mode only) a demo approver's key. ClientError if none."""
    if key_file is not None:
        try:
            key = load_key_file(key_file)
        except KeyFileError as e:
            raise ClientError(str(e)) from None
        if approver is not None and approver != key.approver:
            raise ClientError(f"key file {key_file} is {key.approver}'s, not {approver}'s")
        return key
    if settings.dev and approver in DEMO_APPROVERS:
        return demo_key(approver)
    raise ClientError("no key to sign with: pass --key-file (the approver's key file)")


def outcome(events: list[StoredEvent], decision_id: str) -> Sent | None:
    """What the worker made of the decision ``decision_id``, if it has ruled yet."""
    found = answer(events, decision_id)
    return Sent(found.decision_id, found.status, found.detail) if found is not None else None


def ruling(p: Projection, events: list[StoredEvent], decision_id: str, request_id: str) -> Sent | None:
    """The worker's ruling on ``decision_id`` (``events`` folded into ``p``), or None if there is none yet.

    A task in a terminal state rules on nothing more (its loop has ended): a decision still without a ruling
    then never gets one, and is answered from the ledger: its request was resolved, or the task ended.
    """
    found = outcome(events, decision_id)
    if found is not None or rules_on(p, request_id):
        return found
    resolution = resolutions(events, p.task_id).get(request_id)
    if resolution is not None:
        return Sent(decision_id, "already resolved", describe_resolution(resolution))
    return Sent(decision_id, "rejected", f"task {p.task_id} is already {p.state.value}")


async def send(settings: Settings, task_id: str, payload: dict[str, Any]) -> None:
    """Signal the task's workflow with the payload (as is: the worker validates it)."""
    from workflows.contracts import workflow_id

    client = await connect(settings)
    handle = client.get_workflow_handle(workflow_id(task_id))
    try:
        await handle.signal("decide", payload)
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            raise ClientError(f"task {task_id!r} has no running workflow ({e.message})") from None
        raise ClientError(f"Temporal refused the signal to {handle.id}: {e.message}") from None


async def decide(
    settings: Settings,
    key: ApproverKey,
    task_id: str,
    request_id: str,
    decision: str,
    *,
    note: str = "",
    amount: str | None = None,
    scope: str | None = None,
    timeout: float = POLL_SECONDS,
) -> Sent:
    """Sign, send, and wait (up to ``timeout``) for the worker's ruling in the ledger."""
    payload = signed_payload(key, task_id, request_id, decision, note=note, amount=amount, scope=scope)
    return await relay(settings, task_id, payload, timeout=timeout)


async def relay(
    settings: Settings, task_id: str, payload: dict[str, Any], *, timeout: float = POLL_SECONDS
) -> Sent:
    """Send a signed decision as it is (the CLI's, or one the reviewer page signed in the browser) and return
    the worker's ruling (``pending`` after ``timeout``). ClientError if there is nothing to decide.

    Sent as a Temporal Update: the ruling comes back as the Update's result, at once. A decision the Update's
    validator refuses (malformed, naming no open request) is refused without a trace in the ledger or the
    history. An Update needs a worker to accept it; if none does within a few seconds (every worker down, or
    the task opening), the same decision goes as the ``decide`` signal, which Temporal keeps and times by its
    arrival (a decision sent before a deadline still wins over the timeout), and its ruling is read from the
    ledger. Both carry one decision id: it is ruled on once.
    """
    p, events = _task(settings, task_id)
    request_id = str(payload.get("request_id", ""))
    if not rules_on(p, request_id):
        raise ClientError(f"task {task_id} is {p.state.value}: nothing to decide")
    if request_id not in p.requests:
        raise ClientError(f"no request {request_id[:200]!r} in task {task_id}")
    did = str(payload.get("decision_id", ""))
    started = time.monotonic()
    ruled = await ask(settings, task_id, payload, accept_within=min(ACCEPT_SECONDS, timeout), timeout=timeout)
    if ruled is not None:
        return ruled
    await send(settings, task_id, payload)
    rec = recorder(settings)
    try:
        deadline = started + timeout
        while True:
            new = rec.read_events(task_id, after_seq=events[-1].seq)
            for e in new:
                apply(p, e)
            events += new
            found = ruling(p, events, did, request_id)
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                return Sent(did, "pending", f"no ruling within {timeout:g}s (is a worker running?)")
            await asyncio.sleep(0.1)
    finally:
        rec.dispose()


async def ask(
    settings: Settings, task_id: str, payload: dict[str, Any], *, accept_within: float, timeout: float
) -> Sent | None:
    """The decision as a ``decide`` Update: its ruling, or None if no worker accepted it within
    ``accept_within`` seconds (the caller then sends the signal). A ruling that takes past ``timeout`` is
    ``pending`` (the Update goes on: its ruling lands in the ledger)."""
    from workflows.contracts import DECIDE

    did = str(payload.get("decision_id", ""))
    return await _update(settings, task_id, DECIDE, did, payload, accept_within, timeout)


async def _update(
    settings: Settings,
    task_id: str,
    name: str,
    ref: str,
    payload: dict[str, Any],
    accept_within: float,
    timeout: float,
    *,
    keep_asking: bool = False,
) -> Sent | None:
    """Send ``payload`` as the task's ``name`` Update and return its ruling; None if no worker accepted it
    within ``accept_within`` seconds. A validator's refusal is the sender's to read (nothing was recorded).

    The Update's id is ``ref`` (the decision's or the change's id), so asking again is the same Update:
    Temporal answers a repeat with the first one's outcome. ``keep_asking``: ask again each ``accept_within``
    seconds until ``timeout`` — a worker killed while ruling on it (the change recorded, its workflow task
    never completed) leaves the Update unaccepted, and the next worker takes it."""
    from workflows.contracts import DecisionRuling, workflow_id

    client = await connect(settings)
    handle = client.get_workflow_handle(workflow_id(task_id))
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                update = await handle.start_update(
                    name,
                    payload,
                    id=ref,
                    wait_for_stage=WorkflowUpdateStage.ACCEPTED,
                    result_type=DecisionRuling,
                    rpc_timeout=timedelta(seconds=accept_within),
                )
                break
            except WorkflowUpdateRPCTimeoutOrCancelledError:
                if not keep_asking or time.monotonic() + accept_within > deadline:
                    raise
        told: DecisionRuling = await asyncio.wait_for(update.result(), max(0.0, deadline - time.monotonic()))
    except WorkflowUpdateFailedError as e:
        cause = e.cause
        reason = cause.message if isinstance(cause, ApplicationError) else str(cause or e)
        if reason.startswith("already resolved: "):
            return Sent(ref, "already resolved", reason.removeprefix("already resolved: "))
        return Sent(ref, "rejected", reason)
    except WorkflowUpdateRPCTimeoutOrCancelledError:
        return None
    except TimeoutError:
        return Sent(ref, "pending", f"no ruling within {timeout:g}s (the worker is busy)")
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            raise ClientError(f"task {task_id!r} has no running workflow ({e.message})") from None
        raise ClientError(f"Temporal refused the {name} for {handle.id}: {e.message}") from None
    return Sent(told.decision_id, told.status, told.detail)


# ── signed changes to a running task (rules.changes) ───────────────────────────────────────────────────


def signed_change(
    key: ApproverKey,
    task_id: str,
    kind: str,
    *,
    node: str | None = None,
    edit: dict[str, Any] | None = None,
    note: str = "",
    change_id: str | None = None,
    issued_at: datetime | None = None,
) -> dict[str, Any]:
    """A change signed with the approver's private ``key``, issued now (or at ``issued_at``); an ``edit``
    names its ``node`` and the request fields it sets."""
    if kind not in {k.value for k in ChangeKind}:
        raise ClientError(f"change {kind[:40]!r} is not one of {', '.join(k.value for k in ChangeKind)}")
    cid = change_id or str(uuid.uuid4())
    issued = issued_now(issued_at or datetime.now(UTC))
    message = canonical_change(task_id, cid, kind, node, edit, key.approver, key.key_id, issued, note)
    return {
        "change_id": cid,
        "kind": kind,
        "node": node,
        "input": edit,
        "approver": key.approver,
        "key_id": key.key_id,
        "note": note,
        "issued_at": issued,
        "signature": key.sign(message),
    }


async def change(
    settings: Settings,
    key: ApproverKey,
    task_id: str,
    kind: str,
    *,
    node: str | None = None,
    edit: dict[str, Any] | None = None,
    note: str = "",
    timeout: float = POLL_SECONDS,
) -> Sent:
    """Sign a change and send it as the task's ``change`` Update; the ruling, once recorded."""
    payload = signed_change(key, task_id, kind, node=node, edit=edit, note=note)
    return await send_change(settings, task_id, payload, timeout=timeout)


async def send_change(
    settings: Settings, task_id: str, payload: dict[str, Any], *, timeout: float = POLL_SECONDS
) -> Sent:
    """Send a signed change as it is and return its ruling. A change has no signal to fall back on: it is
    asked again, as the same Update, until a worker takes it or ``timeout`` passes; then it is reported
    ``pending`` (send it again once a worker runs: the same change id is recorded once)."""
    from workflows.contracts import CHANGE

    cid = str(payload.get("change_id", ""))
    within = min(ACCEPT_SECONDS, timeout)
    told = await _update(settings, task_id, CHANGE, cid, payload, within, timeout, keep_asking=True)
    if told is None:
        why = f"no worker took the change within {timeout:g}s"
        return Sent(cid, "pending", f"{why}: send it again once one runs (it is recorded at most once)")
    return told


# ── dead letters ─────────────────────────────────────────────────────────────────────────────────────


def dlq(settings: Settings, project: str | None = None) -> list[dict[str, Any]]:
    """Every node with a dead-letter request, open or resolved, across the ledger (or one project's); open
    ones first."""
    entries: list[dict[str, Any]] = []
    for p, events in _tasks(settings, unfinished=False):
        if project is None or p.plan.project == project:
            entries += dead_letters(p, events)
    return sorted(entries, key=lambda e: e["status"] != "open")


def dlq_view(entries: list[dict[str, Any]]) -> Group | Text:
    if not entries:
        return Text("no dead letters")
    parts: list[Any] = []
    for e in entries:
        action = e["original_request"]["action"] or {}
        parts.append(
            Text(
                f"{e['id']} — {e['status']} — node {e['node']} — cost {e['cost']}",
                style="bold" if e["status"] == "open" else "",
            )
        )
        parts.append(
            Text(
                f"  original: {action.get('executor', '?')} estimate {action.get('estimate', '?')} "
                f"input {e['original_request']['input']}"
            )
        )
        for a in e["attempts"]:
            error = f": {a['error'][:160]}" if a["error"] else ""
            parts.append(Text(f"  attempt {a['attempt']}: {a['result']}, cost {a['cost']}{error}"))
        parts.append(Text(f"  suggested: {e['suggested_action']}", style="cyan"))
    return Group(*parts)
