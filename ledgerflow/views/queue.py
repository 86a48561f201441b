"""The operator's views of the people in the loop: the queue (ordered by consequence, grouped by root cause),
a request's detail and the dead letters — what ``ledgerflow queue``, ``request`` and ``dlq`` show.

Pure (folds and events in, views out), but not part of the decision: kept out of ``rules/`` so the workflow's
sandbox never imports it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, Final

from rules.actions import Dispatch, HumanRequest, RequestKind
from rules.admission import node_price
from rules.changes import RESERVED_FIELDS
from rules.envelope import StoredEvent
from rules.events import (
    ExecutionResult,
    Failure,
    FailureKind,
    Intent,
    MarkerKind,
    Outcome,
    SystemMarker,
    Verdict,
    parse,
)
from rules.people import (
    allowed_approvers,
    context_package,
    describe_resolution,
    describe_view,
    resolutions,
)
from rules.plan import COMPOSE, REVIEW, Value
from rules.projection import NodeStatus, Projection, RequestView
from rules.table import TASK_STOPPING, request_input

# ── the queue ────────────────────────────────────────────────────────────────────────────────────────

_VALUE_RANK: Final = {Value.HERO: 0, Value.STANDARD: 1, Value.BACKGROUND: 2}


@dataclass(frozen=True, slots=True)
class QueueItem:
    """One open request, with what orders it in the queue."""

    task_id: str
    request_id: str
    kind: RequestKind
    node: str | None
    value: Value
    blocking: bool  # stops the task, or blocks compliance or the release
    opened_at: datetime
    reason: str
    options: tuple[str, ...]
    deadline: datetime | None
    cause: str | None  # the normalised root cause (failure text), for grouping; None: stands alone

    @property
    def global_id(self) -> str:
        return f"{self.task_id}/{self.request_id}"

    @property
    def consequence(self) -> int:
        """0: escalations and compliance/release-blocking requests, 1: dead letters, 2: approvals."""
        if self.blocking:
            return 0
        return 1 if self.kind == RequestKind.DEAD_LETTER else 2

    def sort_key(self) -> tuple[int, int, datetime, str, str]:
        return (self.consequence, _VALUE_RANK[self.value], self.opened_at, self.task_id, self.request_id)

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.global_id,
            "task_id": self.task_id,
            "request_id": self.request_id,
            "kind": self.kind.value,
            "node": self.node,
            "value": self.value.value,
            "blocking": self.blocking,
            "opened_at": self.opened_at.isoformat(),
            "deadline": self.deadline.isoformat() if self.deadline else None,
            "reason": self.reason,
            "options": list(self.options),
            "cause": self.cause,
        }


def root_cause(text: str, *, task_id: str = "", node: str | None = None) -> str:
    """A failure's text with what differs between otherwise identical failures masked: the task and node
    ids, numbers and hex ids. Requests whose texts normalise alike share a root cause."""
    t = text
    for name in (task_id, node, node.rsplit("/", 1)[-1] if node else None):
        if name:
            t = t.replace(name, "<id>")
    t = re.sub(r"\b[0-9a-f]{8,}\b|\d+(?:\.\d+)?", "#", t.lower())
    return " ".join(t.split())[:300]


def open_items(p: Projection, opened_at: Mapping[int, datetime]) -> list[QueueItem]:
    """The task's open requests as queue items. ``opened_at`` maps the seq of each request's INTENT to its
    recorded time (requests are ordered oldest first within a kind and value)."""
    if p.terminal:
        return []
    best = min((s.value for s in p.plan.stages), key=_VALUE_RANK.__getitem__, default=Value.STANDARD)
    out = []
    for rid, r in p.requests.items():
        if not r.open:
            continue
        req = r.request
        spec = p.graph.nodes.get(req.node) if req.node else None
        stage = spec.stage if spec is not None else None
        blocking = req.kind in TASK_STOPPING or (
            stage is not None and (stage.gate or stage.id in (COMPOSE, REVIEW))
        )
        out.append(
            QueueItem(
                task_id=p.task_id,
                request_id=rid,
                kind=req.kind,
                node=req.node,
                value=stage.value if stage is not None else best,  # a task-level stop blocks its best node
                blocking=blocking,
                opened_at=opened_at.get(r.opened_seq, p.created_at),
                reason=req.reason,
                options=tuple(o.value for o in req.options),
                deadline=req.deadline,
                cause=_cause(p, req),
            )
        )
    return out


def _cause(p: Projection, req: HumanRequest) -> str | None:
    if req.kind == RequestKind.APPROVAL:
        return None  # an approval is a checkpoint, not a problem: it shares no cause
    view = p.nodes.get(req.node) if req.node else None
    if view is not None and view.last_failure is not None:
        return root_cause(view.last_failure.error, task_id=p.task_id, node=req.node)
    if req.kind == RequestKind.ESCALATION:
        return root_cause(req.reason, task_id=p.task_id, node=req.node)
    return None


def order(items: Iterable[QueueItem]) -> list[QueueItem]:
    """By consequence, then hero before standard before background, then oldest first."""
    return sorted(items, key=QueueItem.sort_key)


def group(items: Iterable[QueueItem]) -> list[list[QueueItem]]:
    """Ordered items grouped by root cause within each consequence tier (a shared cause never lifts a dead
    letter above an escalation); a group sits where its most pressing member does."""
    groups: dict[tuple[int, str], list[QueueItem]] = {}
    out: list[list[QueueItem]] = []
    for item in order(items):
        if item.cause is None:
            out.append([item])
            continue
        key = (item.consequence, item.cause)
        members = groups.get(key)
        if members is None:
            members = groups[key] = []
            out.append(members)
        members.append(item)
    return out


# ── dead letters and request details ─────────────────────────────────────────────────────────────────

_SUGGESTIONS: Final = {
    FailureKind.TECHNICAL: "retry with a different model or vendor (technical failures used up the retries)",
    FailureKind.STALLED: "retry with a different model or vendor (the job kept stalling)",
    FailureKind.CONTENT: "edit the input by hand (the vendor refused the content: never resend it unchanged)",
    FailureKind.INVALID_OUTPUT: "edit the input by hand (the output failed validation)",
    FailureKind.UNKNOWN_OUTCOME: "a person decides: check at the vendor whether the job ran before resuming",
}


def suggestion(kind: FailureKind | None) -> str:
    return _SUGGESTIONS.get(kind, "a person decides") if kind is not None else "a person decides"


def attempts(events: Iterable[StoredEvent], node: str, *, up_to: int | None = None) -> list[dict[str, Any]]:
    """Every dispatched attempt of ``node`` (up to seq ``up_to``): its action, result, error and cost."""
    out: dict[str, dict[str, Any]] = {}
    for stored in events:
        if up_to is not None and stored.seq > up_to:
            break
        if stored.type not in ("Intent", "Failure", "Outcome", "ExecutionResult"):
            continue
        event = parse(stored)
        if isinstance(event, Intent) and isinstance(event.action, Dispatch) and event.action.node == node:
            a = event.action
            out[a.operation_key] = {
                "attempt": a.attempt,
                "operation_key": a.operation_key,
                "executor": a.executor,
                "estimate": str(a.estimate),
                "dispatched_at": stored.recorded_at.isoformat(),
                "result": "in flight",
                "error": None,
                "cost": "0",
            }
        elif isinstance(event, Failure | Outcome | ExecutionResult) and event.operation_key in out:
            row = out[event.operation_key]
            row["cost"] = str(event.actual_cost)
            if isinstance(event, Failure):
                row["result"], row["error"] = f"failed ({event.kind.value})", event.error
            else:  # an output (an Outcome), or a review's verdict (an ExecutionResult)
                row["result"] = "succeeded"
    return list(out.values())


def first_dispatch(events: Iterable[StoredEvent], node: str) -> dict[str, Any] | None:
    """The original request: the action of the node's first Dispatch INTENT."""
    for stored in events:
        if stored.type != "Intent":
            continue
        event = parse(stored)
        if isinstance(event, Intent) and isinstance(event.action, Dispatch) and event.action.node == node:
            return event.action.model_dump(mode="json")
    return None


def status_of(r: RequestView, resolution: StoredEvent | None) -> str:
    if r.open:
        return "open"
    return describe_resolution(resolution) if resolution is not None else describe_view(r)


def dead_letters(p: Projection, events: Sequence[StoredEvent]) -> list[dict[str, Any]]:
    """Every dead-letter request of the task, open or resolved, with the whole story of its node."""
    resolved = resolutions(events, p.task_id)
    out = []
    for rid, r in p.requests.items():
        req = r.request
        if req.kind != RequestKind.DEAD_LETTER or req.node is None or req.node not in p.nodes:
            continue
        tries = attempts(events, req.node, up_to=r.opened_seq)
        last = p.nodes[req.node].last_failure
        stage = p.graph.nodes[req.node].stage
        item = p.graph.nodes[req.node].item
        original = first_dispatch(events, req.node)
        out.append(
            {
                "id": f"{p.task_id}/{rid}",
                "task_id": p.task_id,
                "project": p.plan.project,
                "request_id": rid,
                "node": req.node,
                # A task that ended rules on nothing more: its dead letter is closed, answered or not.
                "status": status_of(r, resolved.get(rid)) if not p.terminal else "closed",
                "reason": req.reason,
                "original_request": {
                    "action": original,
                    "input": {**stage.input, **({"item": item} if item else {})},
                },
                "attempts": tries,
                "cost": str(sum((Decimal(a["cost"]) for a in tries), Decimal(0))),
                "failure_kind": last.kind.value if last is not None else None,
                "cause": cause(last.kind.value if last is not None else None, last.error if last else ""),
                "suggested_action": suggestion(last.kind if last is not None else None),
            }
        )
    return out


_VARYING: Final = re.compile(
    r"[0-9a-f]{8}-[0-9a-f-]{27}|\b[0-9a-f]{12,}\b|\bt-[0-9a-f]+\b|[A-Za-z0-9_./-]*:[A-Za-z0-9_./-]+:a[0-9]+|\d+(\.\d+)?"
)


def cause(kind: str | None, error: str) -> str:
    """A failure's systemic cause: its kind and its error with what varies from one occurrence to the next
    (numbers, ids, operation keys, task ids) blanked, so "40% of the dead letters are validator timeouts"
    shows as one cause."""
    shape = " ".join(_VARYING.sub("#", error[:300]).split())
    return f"{kind or 'unknown'}: {shape}" if shape else kind or "unknown"


def dead_letter_groups(entries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The open dead letters grouped by cause, the largest group first: its share, its requests, and the one
    action that answers them all."""
    open_ = [e for e in entries if e["status"] == "open"]
    groups: dict[str, list[dict[str, Any]]] = {}
    for e in open_:
        groups.setdefault(e["cause"], []).append(e)
    ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    return [
        {
            "group": i,
            "cause": c,
            "count": len(members),
            "share": f"{100 * len(members) / len(open_):.0f}%",
            "ids": [m["id"] for m in members],
            "suggested_action": members[0]["suggested_action"],
        }
        for i, (c, members) in enumerate(ranked, start=1)
    ]


def request_detail(p: Projection, events: Sequence[StoredEvent], request_id: str) -> dict[str, Any] | None:
    """Everything about one request: the question, its status, the context package as it stood when asked
    and as it stands now, the node's attempts, the decision, and every refused answer."""
    r = p.requests.get(request_id)
    if r is None:
        return None
    req = r.request
    resolution = resolutions(events, p.task_id).get(request_id)
    refused = []
    for stored in events:
        if stored.type != "SystemMarker" or stored.payload.get("request_id") != request_id:
            continue
        marker = parse(stored)
        if isinstance(marker, SystemMarker) and marker.kind == MarkerKind.REJECTED_INPUT:
            refused.append({"seq": stored.seq, "at": stored.recorded_at.isoformat(), "detail": marker.detail})
    opened = next((e for e in events if e.seq == r.opened_seq), None)
    return {
        "id": f"{p.task_id}/{request_id}",
        "task_id": p.task_id,
        "task_state": p.state.value,
        "goal": p.plan.goal,
        "request_id": request_id,
        "kind": req.kind.value,
        "node": req.node,
        "reason": req.reason,
        "options": [o.value for o in req.options],
        "deadline": req.deadline.isoformat() if req.deadline else None,
        "timeout_policy": req.timeout_policy.value if req.timeout_policy else None,
        "opened_at": opened.recorded_at.isoformat() if opened is not None else None,
        "approvers": list(allowed_approvers(p.plan.approval, req.kind)) or "any approver with a key",
        "status": status_of(r, resolution),
        "resolution": resolution.payload if resolution is not None else None,
        "context_at_request": req.context,
        "context_now": context_package(p, req.kind, req.node, req.options),
        "attempts": attempts(events, req.node) if req.node in p.nodes and req.node is not None else [],
        "refused": refused,
        # A dead letter's node can be asked again with its request edited (rules.changes, kind edit): the
        # text fields of its request as the next attempt would send them, for a person to change.
        "editable": editable(p, req.node) if req.kind == RequestKind.DEAD_LETTER else {},
        "releases": releases(p, req.node) if req.kind == RequestKind.APPROVAL else None,
        "then": THEN.get(req.timeout_policy.value) if req.timeout_policy else None,
        # What a person may steer from the request's page (rules.changes): the review's findings to waive,
        # the node's earlier output versions to restore, and the task's nodes and stages to pause, skip or
        # re-route.
        "review": review_findings(p) if _about_rework(p, req) else None,
        "versions": versions(p, req.node) if req.kind in _RESTORABLE else [],
        "steer": steer(p),
    }


# What happens when nobody answers in time, in a person's words.
THEN: Final = {
    "approve": "approved automatically",
    "escalate": "goes to a person with the authority to resume or stop the task",
    "abort": "the task is stopped",
}


def releases(p: Projection, node: str | None) -> str | None:
    """What approving ``node`` lets run, and roughly what it reserves: its dependents not yet made, each at
    the price admission would reserve for it now (rules.admission), against what is left of the ceiling."""
    if node is None or node not in p.nodes:
        return None
    after = [n for n in p.graph.descendants(node) if p.nodes[n].status != NodeStatus.SUCCEEDED]
    if not after:
        return "nothing else waits on it"
    total = sum((node_price(p, p.graph.nodes[n].stage)[0] for n in after), Decimal(0))
    left = p.ceiling - p.spent - p.reserved
    return f"the {len(after)} node(s) after it may run, reserving about {total:.2f} of the {left:.2f} left"


def editable(p: Projection, node: str | None) -> dict[str, str]:
    """The text fields of ``node``'s next request (the plan's, with any edit over them): what the page lets
    a person edit. Inputs, the fan-out item and the feedback are the rules' and are left out."""
    if node is None or node not in p.nodes:
        return {}
    request = request_input(p, p.nodes[node])
    return {k: v for k, v in request.items() if isinstance(v, str) and k not in RESERVED_FIELDS}


# ── what a person may steer from a request's page (rules.changes) ───────────────────────────────────

_RESTORABLE: Final = frozenset({RequestKind.APPROVAL, RequestKind.DEAD_LETTER})


def _about_rework(p: Projection, req: HumanRequest) -> bool:
    """Whether ``req`` stands for a review's rework verdict: the escalation at the rework limit."""
    return (
        req.kind == RequestKind.ESCALATION
        and req.node == REVIEW
        and p.review is not None
        and p.review.verdict == Verdict.QUALITY_REWORK
    )


def review_findings(p: Projection) -> dict[str, Any] | None:
    """The current review's verdict: each output it blames (its current version and the findings that name
    it), every finding, and what people waived. None when there is no review."""
    review = p.review
    if review is None:
        return None
    blamed = []
    for node in review.flagged:
        view = p.nodes.get(node)
        artifact = view.artifact if view is not None else None
        blamed.append(
            {
                "node": node,
                "version": view.versions if view is not None else None,
                "sha256": artifact.get("sha256") if artifact else None,
                "findings": [f for f in review.findings if node in f],
                "waived": node in review.waived or review.waived_all,
            }
        )
    return {
        "verdict": review.verdict.value,
        "blamed": blamed,
        "findings": list(review.findings),
        "waived": sorted(review.waived),
        "waived_all": review.waived_all,
        # Compliance findings are never waivable (rules.changes).
        "waivable": review.verdict == Verdict.QUALITY_REWORK and p.failed_gate is None,
    }


def versions(p: Projection, node: str | None) -> list[dict[str, Any]]:
    """Every output version of ``node`` (1-based, oldest first) when it has more than one: what a restore
    may make current again. Empty for a node with one version or none, and for the compose and the review
    (made again from their inputs, never restored)."""
    view = p.nodes.get(node) if node is not None else None
    if view is None or len(view.outputs) < 2 or view.stage in (COMPOSE, REVIEW):
        return []
    current = view.artifact.get("sha256") if view.artifact else None
    return [
        {
            "version": i,
            **out.artifact,
            "current": out.artifact.get("sha256") == current and view.status == NodeStatus.SUCCEEDED,
            "lost": out.lost,
            "flagged": out.flagged,
            "reused": out.reused_from is not None,
        }
        for i, out in enumerate(view.outputs, start=1)
    ]


def steer(p: Projection) -> dict[str, Any]:
    """What the page's steering form offers: whether (and by whom) the task is paused, the nodes a person
    may name (not the compose or the review), with what each is doing, and the stages."""
    nodes = [
        {"id": n.id, "stage": n.stage, "status": n.status.value, "skipped": n.skipped}
        for n in p.in_order(p.nodes)
        if n.stage not in (COMPOSE, REVIEW)
    ]
    stages = [s.id for s in p.plan.stages if s.id not in (COMPOSE, REVIEW)]
    return {"paused_by": p.paused_by, "nodes": nodes, "stages": stages}
