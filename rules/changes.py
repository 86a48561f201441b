"""People's signed changes to a running task (issue 26 §2): what a change is, what its signer signs, and the
ruling on it. Pure: the key registry and the verifier are passed in (``rules.people.Keys``).

A change is not an answer to a request (that is a decision, ``rules.people``): a person steers the task on
their own initiative. It is signed like a decision (Ed25519 over a canonical message with an issued-at time,
refused outside the decision window), authorised like one (the key's ``kinds`` must allow ``change:<kind>``
where it lists kinds, its scopes must cover the task, and where the plan names approvers the signer must be
one), recorded as a ``TaskChange`` event carrying the exact message and signature (the audit re-verifies it),
and applied by the rules at the loop's next decision (``rules.table``: a paused task dispatches nothing).

Kinds: ``pause`` (no new dispatch; work in flight finishes and is recorded; people's requests, their
deadlines and the time ceiling go on), ``resume``, ``edit`` (a node not running and not succeeded is asked
again with the fields it sets — the dead-letter recovery: its open dead letter is resolved by a
``PartialResolution`` naming who changed what), ``reroute`` (a node's or a stage's next attempts go to
another route, re-quoted at its declared price first), ``skip`` (a node not yet succeeded, and every node only
it feeds, never runs: a fan-out item's cancellation; its dead letter is resolved), ``waive`` (a review's
rework finding on one output, or on the whole composition, accepted as it is with a reason — compliance
findings never), and ``restore`` (an earlier version of a node's output made current again: its descendants
are asked again, and one whose input hash then equals an earlier output of its own reuses it, unpaid).
``docs/reviewers.md`` shows each from the CLI and the page.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from enum import StrEnum
from typing import Any, Final

from rules.actions import RequestKind
from rules.admission import headroom, node_price
from rules.approvers import refusal
from rules.envelope import StoredEvent
from rules.events import (
    ChangeKind,
    MarkerKind,
    PartialResolution,
    SystemMarker,
    TaskChange,
    Verdict,
    parse,
)
from rules.inputs import ref_paths, sources
from rules.people import Answer, Keys, Reverified, outside_window, parse_issued_at, unendorsed
from rules.plan import COMPOSE, REVIEW, budget_scopes
from rules.pricing import RoutePrice, declared_bound
from rules.projection import NodeStatus, Projection
from rules.table import REWORK_LIMIT

CANONICAL_CHANGE_V1: Final = "ledgerflow-change-v1"
FIELDS: Final = (
    "change_id",
    "kind",
    "node",
    "input",
    "approver",
    "key_id",
    "note",
    "issued_at",
    "signature",
)
MAX_NOTE: Final = 2000
MAX_EDIT_BYTES: Final = 16_000  # an edit's fields, as canonical JSON
MAX_EDIT_FIELDS: Final = 20
# Request fields an edit may not set: what the rules make (inputs, the fan-out item, the feedback).
RESERVED_FIELDS: Final = frozenset({"inputs", "item", "feedback"})

_UUID: Final = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_APPROVER: Final = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_KEY_ID: Final = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_NODE: Final = re.compile(r"[A-Za-z0-9_./-]{1,200}")
_ROUTE: Final = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_SIGNATURE: Final = re.compile(r"[0-9a-f]{128}")
_ISSUED_AT: Final = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?Z")
MAX_VERSION: Final = 10_000
# Kinds that name a node (pause and resume are the task's).
_NODE_KINDS: Final[frozenset[ChangeKind]] = frozenset(
    {ChangeKind.EDIT, ChangeKind.REROUTE, ChangeKind.SKIP, ChangeKind.WAIVE, ChangeKind.RESTORE}
)


class Status(StrEnum):
    ACCEPTED = "accepted"
    REJECTED = "rejected"


def key_kind(kind: ChangeKind) -> str:
    """The key kind a change of ``kind`` needs, where a key lists kinds (``ledgerflow keys add --kind``)."""
    return f"change:{kind.value}"


def canonical_change(
    task_id: str,
    change_id: str,
    kind: str,
    node: str | None,
    edit: dict[str, Any] | None,
    approver: str,
    key_id: str,
    issued_at: str,
    note: str,
) -> str:
    """The signed message (UTF-8): a version line, then one field per line — an edit's fields as canonical
    JSON (sorted keys, no spaces, ASCII) — and ``note`` last (the only one that may hold newlines), so two
    different changes never sign the same text. The task id is signed, not sent: a change signed for one task
    fails verification in every other."""
    fields = [task_id, change_id, kind, node or "", canonical_json(edit), approver, key_id, issued_at, note]
    return "\n".join([CANONICAL_CHANGE_V1, *fields])


def canonical_json(value: dict[str, Any] | None) -> str:
    """An edit's fields as the signed message holds them ("" for none)."""
    if value is None:
        return ""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


@dataclass(frozen=True, slots=True)
class SignedChange:
    change_id: str
    kind: ChangeKind
    node: str | None
    edit: dict[str, Any] | None
    approver: str
    key_id: str
    note: str
    issued_at: str
    signature: str

    def message(self, task_id: str) -> str:
        return canonical_change(
            task_id, self.change_id, self.kind.value, self.node, self.edit, self.approver, self.key_id,
            self.issued_at, self.note,
        )  # fmt: skip


def change_ref(raw: Any) -> str:
    """The change's id if it carries a well-formed one, else a stand-in naming it as malformed."""
    if isinstance(raw, dict):
        cid = raw.get("change_id")
        if isinstance(cid, str) and _UUID.fullmatch(cid):
            return cid
    return "malformed-change"


def parse_change(raw: Any) -> SignedChange | str:
    """The payload as a :class:`SignedChange`, or a one-line reason it is malformed or unsigned."""
    if not isinstance(raw, dict):
        return "malformed change: expected a JSON object"
    unknown = sorted(str(k) for k in raw if k not in FIELDS)
    if unknown:
        return f"malformed change: unknown field {unknown[0][:40]!r}"
    if not raw.get("signature"):
        return "unsigned change: no signature"
    shapes = (
        ("change_id", _UUID, True, "a lowercase UUID"),
        ("approver", _APPROVER, True, "a valid approver name"),
        ("key_id", _KEY_ID, True, "a key id"),
        ("issued_at", _ISSUED_AT, True, "an ISO 8601 UTC time like 2026-12-03T10:00:00.000Z"),
        ("signature", _SIGNATURE, True, "128 lowercase hex digits (an Ed25519 signature)"),
        ("node", _NODE, False, "a node id"),
    )
    for name, pattern, required, shape in shapes:
        value = raw.get(name)
        if value is None:
            if required:
                return f"malformed change: {name} is required"
            continue
        if not isinstance(value, str) or not pattern.fullmatch(value):
            return f"malformed change: {name} {str(value)[:60]!r} is not {shape}"
    kind = raw.get("kind")
    if kind not in {k.value for k in ChangeKind}:
        kinds = ", ".join(k.value for k in ChangeKind)
        return f"malformed change: kind {str(kind)[:40]!r} is not one of {kinds}"
    note = raw.get("note") or ""
    if not isinstance(note, str) or len(note) > MAX_NOTE:
        return f"malformed change: note must be text of at most {MAX_NOTE} characters"
    edit = raw.get("input")
    if kind == ChangeKind.EDIT.value:
        if (why := _edit_problem(edit)) is not None:
            return f"malformed change: {why}"
    elif kind == ChangeKind.REROUTE.value:
        route = edit.get("route") if isinstance(edit, dict) and len(edit) == 1 else None
        if not isinstance(route, str) or not _ROUTE.fullmatch(route):
            return 'malformed change: a reroute sets input {"route": NAME}, a route of the route file'
    elif kind == ChangeKind.RESTORE.value:
        version = edit.get("version") if isinstance(edit, dict) and len(edit) == 1 else None
        if type(version) is not int or not 1 <= version <= MAX_VERSION:
            return 'malformed change: a restore sets input {"version": N}, N the output version from 1'
    elif edit is not None:
        return f"malformed change: a {kind} sets no input"
    if kind in {k.value for k in _NODE_KINDS} and raw.get("node") is None:
        return f"malformed change: a {kind} names a node"
    if kind == ChangeKind.WAIVE.value and not note.strip():
        return "malformed change: a waiver says why in its note"
    return SignedChange(
        change_id=raw["change_id"],
        kind=ChangeKind(kind),
        node=raw.get("node"),
        edit=edit,
        approver=raw["approver"],
        key_id=raw["key_id"],
        note=note,
        issued_at=raw["issued_at"],
        signature=raw["signature"],
    )


def _edit_problem(edit: Any) -> str | None:
    """Why an edit's fields cannot be a node's request fields (None: they can)."""
    if not isinstance(edit, dict) or not edit:
        return "an edit sets input: a JSON object of the request fields it changes"
    if len(edit) > MAX_EDIT_FIELDS:
        return f"an edit sets at most {MAX_EDIT_FIELDS} fields"
    reserved = sorted(k for k in edit if k in RESERVED_FIELDS)
    if reserved:
        return f"input.{reserved[0]} is made by the rules, not edited"
    try:
        size = len(canonical_json(edit))
    except (TypeError, ValueError, RecursionError):
        return "input is not plain JSON"
    if size > MAX_EDIT_BYTES:
        return f"input is {size} bytes as JSON, more than {MAX_EDIT_BYTES}"
    path = next((path for path, _ in ref_paths(edit, "input")), None)
    if path is not None:
        return (
            f"{path} is an artifact reference (uri and sha256): a node receives artifacts only through inputs"
        )
    return None


def targets(p: Projection, change: SignedChange) -> list[str]:
    """The nodes a change names: its node, or — a re-route may name a stage — every node of that stage."""
    if change.node is None:
        return []
    if change.node in p.nodes:
        return [change.node]
    if change.kind == ChangeKind.REROUTE:
        return [n.id for n in p.nodes.values() if n.stage == change.node]
    return []


def _to_move(p: Projection, nodes: list[str]) -> list[str]:
    """The nodes a re-route moves: those with an attempt still to come (not succeeded)."""
    return [n for n in nodes if p.nodes[n].status != NodeStatus.SUCCEEDED]


def applies(p: Projection, change: SignedChange) -> str | None:
    """Why ``change`` cannot apply to the task as ``p`` has it (None: it can)."""
    if p.terminal:
        return f"task {p.task_id} is {p.state.value}: nothing to change"
    if change.kind in _NODE_KINDS and not targets(p, change):
        what = "node or stage" if change.kind == ChangeKind.REROUTE else "node"
        return f"no {what} {str(change.node)[:200]!r} in task {p.task_id}"
    if change.kind == ChangeKind.REROUTE:
        route = (change.edit or {}).get("route")
        moving = _to_move(p, targets(p, change))
        if not moving:
            return f"{change.node} has nothing left to run: every node of it succeeded"
        if all(p.nodes[n].route == route for n in moving):
            return f"{change.node} already goes to {route}"
    if change.kind not in _NODE_KINDS and change.node is not None:
        return f"a {change.kind.value} is the task's: it names no node"
    if change.kind == ChangeKind.PAUSE and p.paused_by is not None:
        return f"already paused by {p.paused_by}"
    if change.kind == ChangeKind.RESUME and p.paused_by is None:
        return "not paused"
    if change.kind == ChangeKind.EDIT:
        assert change.node is not None
        n = p.nodes[change.node]
        if n.in_flight:
            return f"node {change.node} is running: wait for its result (or pause the task) to edit it"
        if n.status == NodeStatus.SUCCEEDED:
            return (
                f"node {change.node} already succeeded: its output stands (a rework or a restore redoes it)"
            )
        if n.skipped:
            return f"node {change.node} was skipped"
    if change.kind == ChangeKind.SKIP:
        return _skip_problem(p, change.node or "")
    if change.kind == ChangeKind.WAIVE:
        return _waive_problem(p, change.node or "")
    if change.kind == ChangeKind.RESTORE:
        return _restore_problem(p, change.node or "", int((change.edit or {})["version"]))
    return None


def skipped_with(p: Projection, node: str) -> tuple[str, ...]:
    """What skipping ``node`` skips: it, and every node whose declared inputs all come from skipped nodes
    (what only it feeds: the shot of a cancelled keyframe item, not a join that reads the other items too)."""
    # Only what is built on ``node`` can lose its last unskipped input now; in order, so a node's producers
    # are decided before it.
    out = {node} | {n for n, v in p.nodes.items() if v.skipped}
    newly = [node]
    for d in p.in_order(p.graph.descendants(node)):
        if d.skipped:
            continue
        spec = p.graph.nodes[d.id]
        fed = [s for src in sources(p.graph, spec).values() for s in ([src] if isinstance(src, str) else src)]
        if fed and all(s in out for s in fed):
            out.add(d.id)
            newly.append(d.id)
    return tuple(newly)


def _skip_problem(p: Projection, node: str) -> str | None:
    n = p.nodes[node]
    if n.stage in (COMPOSE, REVIEW):
        return f"the {n.stage} is never skipped (abort the task to stop it)"
    if n.skipped:
        return f"node {node} is already skipped"
    if n.in_flight:
        return f"node {node} is running: wait for its result (or pause the task) to skip it"
    if n.status == NodeStatus.SUCCEEDED:
        return f"node {node} already succeeded: its output stands"
    for lost in skipped_with(p, node):
        if p.nodes[lost].stage in (COMPOSE, REVIEW):
            return f"skipping {node} would leave the {p.nodes[lost].stage} nothing to work on"
        if p.nodes[lost].in_flight:
            return f"node {lost}, fed only by {node}, is running: wait for it (or pause the task)"
    return None


def _waive_problem(p: Projection, node: str) -> str | None:
    review = p.review
    if p.failed_gate is not None or (review is not None and review.verdict == Verdict.COMPLIANCE_BLOCK):
        return "compliance findings are never waivable"
    if review is None or review.verdict != Verdict.QUALITY_REWORK:
        return "no review asks for rework: there is nothing to waive"
    if node != REVIEW and node not in review.flagged:
        blamed = ", ".join(review.flagged) or "none, only the composition as a whole"
        return f"the review does not blame {node} (it blames: {blamed}; waive {REVIEW} for all)"
    if node in review.waived or review.waived_all:
        return f"the review's findings on {node} are already waived"
    if review.handled and _rework_escalation(p) is None:
        return "the rework the review asked for is under way: its next verdict may be waived"
    return None


def _rework_escalation(p: Projection) -> str | None:
    """The open escalation that stands for a rework verdict (its rework limit reached), if any: a waiver
    answers it, and so does a restore (which drops the verdict: a new review judges the restored output)."""
    review = p.review
    return next(
        (
            rid
            for rid, r in p.requests.items()
            if r.open
            and r.request.kind == RequestKind.ESCALATION
            and r.request.node == REVIEW
            and r.request.reason.startswith(REWORK_LIMIT)
            and (review is None or r.opened_seq > review.seq)
        ),
        None,
    )


def _restore_problem(p: Projection, node: str, version: int) -> str | None:
    n = p.nodes[node]
    if n.stage in (COMPOSE, REVIEW):
        return f"the {n.stage} is made again from its inputs, never restored"
    if version > len(n.outputs):
        return f"node {node} has {len(n.outputs)} output version(s): no version {version}"
    out = n.outputs[version - 1]
    if out.lost:
        return f"version {version} of {node} was found missing or corrupt: it cannot be restored"
    if n.in_flight:
        return f"node {node} is running: wait for its result (or pause the task) to restore a version"
    if n.status == NodeStatus.SUCCEEDED and n.artifact == out.artifact:
        return f"version {version} of {node} is already current"
    running = [d.id for d in p.in_order(p.graph.descendants(node)) if d.in_flight]
    if running:
        return f"node {running[0]}, built on {node}, is running: wait for it (or pause the task)"
    return None


def precheck_change(p: Projection | None, raw: Any) -> str | None:
    """Why a change cannot be taken at all, judged without I/O (the ``change`` Update's validator): its shape
    and whether it applies to the task now. The signature and the signer's authority are judged after."""
    if p is None:
        return "the task is still opening: send it again in a moment"
    parsed = parse_change(raw)
    if isinstance(parsed, str):
        return parsed
    if p.changes.get(parsed.change_id) is not None:
        return None  # the same change again: answered as it stood
    return applies(p, parsed)


@dataclass(frozen=True, slots=True)
class ChangeRuling:
    ref: str
    event: TaskChange | None = None
    rejection: str | None = None
    duplicate: bool = False

    def marker(self) -> SystemMarker:
        """The audit record of a refusal: ``detail`` is ``"<change id>: <reason>"``."""
        assert self.rejection is not None
        return SystemMarker(kind=MarkerKind.REJECTED_INPUT, detail=f"{self.ref}: {self.rejection}"[:2000])


def evaluate_change(
    task_id: str,
    raw: Any,
    p: Projection,
    keys: Keys,
    received_at: datetime,
    routes: Mapping[str, RoutePrice] | None = None,
) -> ChangeRuling:
    """Rule on one raw change against the task's fold ``p`` and the key registry, as of ``received_at``.

    ``routes``: the deployment's routes and their declared prices (a re-route must name one, and is
    re-quoted at its price: refused, naming the shortfall, where the task's budget cannot carry it)."""
    ref = change_ref(raw)
    parsed = parse_change(raw)
    if isinstance(parsed, str):
        return ChangeRuling(ref, rejection=parsed)
    c = parsed
    if ref in p.changes:
        return ChangeRuling(ref, duplicate=True)  # recorded already: the same signed change again
    key = keys.registry.get(c.key_id)
    if key is None:
        return ChangeRuling(ref, rejection=f"unknown key {c.key_id!r} (not in the approver key registry)")
    signed = c.message(task_id)
    if not keys.verify(key.public_key, signed, c.signature):
        return ChangeRuling(
            ref, rejection=f"bad signature for key {c.key_id!r} (forged, altered or signed for another task)"
        )
    if (why := unendorsed(key, keys)) is not None:
        return ChangeRuling(ref, rejection=why)
    issued = parse_issued_at(c.issued_at)
    if keys.window is not None and (why := outside_window(issued, received_at, keys.window)) is not None:
        return ChangeRuling(ref, rejection=why)
    chain = [s for s, _ in budget_scopes(p.plan, task_id)]
    why = refusal(
        key, approver=c.approver, kind=key_kind(c.kind), chain=chain, scope=chain[-1], at=received_at
    )
    if why is not None:
        return ChangeRuling(ref, rejection=why)
    allowed = p.plan.approval.approvers
    if allowed and c.approver not in allowed:
        return ChangeRuling(
            ref, rejection=f"{c.approver} may not change this task (its approvers: {', '.join(allowed)})"
        )
    if (why := applies(p, c)) is not None:
        return ChangeRuling(ref, rejection=why)
    moved: tuple[str, ...] = ()
    route_price = None
    if c.kind == ChangeKind.REROUTE:
        quoted = requote(p, c, routes or {})
        if isinstance(quoted, str):
            return ChangeRuling(ref, rejection=quoted)
        moved, route_price = quoted
    elif c.kind in (ChangeKind.SKIP, ChangeKind.WAIVE, ChangeKind.RESTORE):
        moved = affected(p, c)
    event = TaskChange(
        change_id=c.change_id,
        kind=c.kind,
        node=c.node,
        input=c.edit,
        nodes=moved,
        route_price=route_price,
        approver=c.approver,
        key_id=c.key_id,
        note=c.note,
        signed=signed,
        signature=c.signature,
        issued_at=issued,
        received_at=received_at,
    )
    return ChangeRuling(ref, event=event)


def affected(p: Projection, c: SignedChange) -> tuple[str, ...]:
    """The nodes a skip skips, a waiver waives, or a restore makes stale (recorded with the change)."""
    node = c.node or ""
    if c.kind == ChangeKind.SKIP:
        return skipped_with(p, node)
    if c.kind == ChangeKind.WAIVE:
        assert p.review is not None
        return (*p.review.unwaived(), REVIEW) if node == REVIEW else (node,)
    if c.kind == ChangeKind.RESTORE:
        return tuple(d.id for d in p.in_order(p.graph.descendants(node)) if d.status == NodeStatus.SUCCEEDED)
    return ()


def requote(
    p: Projection, c: SignedChange, routes: Mapping[str, RoutePrice]
) -> tuple[tuple[str, ...], Decimal | None] | str:
    """A re-route's nodes and the new route's declared bound for one of them — or why it is refused: the
    route is not one of the deployment's, or the task's budget cannot carry the moved nodes at the price
    admission would reserve on it (the dearer of today's admission price and the route's declared bound)."""
    route = str((c.edit or {}).get("route"))
    price = routes.get(route)
    if price is None:
        known = ", ".join(sorted(routes)[:20]) or "none"
        return f"route {route!r} is not in this deployment's route file (routes: {known})"
    moved = _to_move(p, targets(p, c))
    stage = p.graph.nodes[moved[0]].stage
    bound = declared_bound(stage, price)
    each = max(node_price(p, stage)[0], bound or Decimal(0))
    pending = [n for n in moved if not p.nodes[n].in_flight]  # one in flight holds its reservation already
    need = each * len(pending)
    room = headroom(p)
    if need > room:
        short, left = _plain(need - room), _plain(room)
        return (
            f"task:{p.task_id} is short by {short} for this re-route: {len(pending)} node(s) of stage "
            f"{stage.id} at {_plain(each)} each on {route}, {left} left under the ceiling {_plain(p.ceiling)}"
        )
    return tuple(moved), bound


def _plain(amount: Decimal) -> str:
    """An amount as a person reads it: no trailing zeros, no exponent (50, 89.05, 0.000088)."""
    return format(amount.normalize(), "f")


def recovery(p: Projection, raw: Any) -> tuple[str, PartialResolution] | None:
    """The open request a recorded change settles, and the ``PartialResolution`` that resolves it, naming who
    changed what and why: an edit's or a skip's node's dead letter, a restored node's approval or dead
    letter, a waiver's rework-limit escalation. Recorded under the request's resolution key, so the change,
    a person's decision or the timeout resolves it, whichever is first. None when there is none."""
    parsed = parse_change(raw)
    if isinstance(parsed, str) or parsed.node not in p.nodes or parsed.change_id not in p.changes:
        return None  # malformed, the task's own, or not recorded (refused): it resolves nothing
    node, who = parsed.node, parsed.approver
    view = p.nodes[node]
    rid: str | None = None
    if parsed.kind in (ChangeKind.EDIT, ChangeKind.SKIP):
        rid = view.dead_letter
    elif parsed.kind == ChangeKind.RESTORE:
        kinds = (RequestKind.APPROVAL, RequestKind.DEAD_LETTER)
        rid = next(
            (
                i
                for i, r in p.requests.items()
                if r.open and r.request.node == node and r.request.kind in kinds
            ),
            None,
        ) or (_rework_escalation(p) if p.review is None else None)
    elif parsed.kind == ChangeKind.WAIVE:
        rid = _rework_escalation(p)
    request = p.requests.get(rid) if rid else None
    if rid is None or request is None or not request.open:
        return None
    if parsed.kind == ChangeKind.EDIT:
        resolution = f"request edited ({', '.join(sorted(parsed.edit or {}))}) by {who}"
    elif parsed.kind == ChangeKind.SKIP:
        resolution = f"skipped by {who}"
    elif parsed.kind == ChangeKind.RESTORE:
        resolution = f"version {(parsed.edit or {}).get('version')} restored by {who}"
    else:
        resolution = f"findings on {node} waived by {who}"
    note = parsed.note[:2000]
    return rid, PartialResolution(
        node=request.request.node or node, resolution=resolution, note=note, request_id=rid
    )


def change_answer(events: Iterable[StoredEvent], p: Projection, raw: Any) -> Answer:
    """What a change's sender is told once its batch was recorded (``events``: what it recorded)."""
    ref = change_ref(raw)
    for stored in events:
        if stored.type == "TaskChange" and stored.payload.get("change_id") == ref:
            c = parse(stored)
            assert isinstance(c, TaskChange)
            return Answer(ref, Status.ACCEPTED.value, f"{c.kind.value} by {c.approver}")
        if (
            stored.type == "SystemMarker"
            and stored.payload.get("kind") == MarkerKind.REJECTED_INPUT.value
            and str(stored.payload.get("detail", "")).startswith(f"{ref}: ")
        ):
            return Answer(ref, Status.REJECTED.value, str(stored.payload["detail"])[len(ref) + 2 :])
    recorded = p.changes.get(ref)
    if recorded is not None:
        return Answer(ref, Status.ACCEPTED.value, recorded)
    return Answer(ref, Status.REJECTED.value, "this change was refused before (the ledger holds why)")


def reverify_change(task_id: str, stored: StoredEvent, p: Projection, keys: Keys) -> Reverified:
    """Re-verify one recorded ``TaskChange`` as the worker verified it when it arrived: the stored signature
    over the stored message, the message saying exactly what the event says, and the key allowed to sign it
    as of its arrival (``ledgerflow audit``)."""
    c = parse(stored)
    assert isinstance(c, TaskChange)
    who = f"#{stored.seq} {c.kind.value} by {c.approver}"
    key = keys.registry.get(c.key_id)
    if key is None:
        return Reverified(stored.seq, problem=f"{who}: key {c.key_id!r} is not in the approver key registry")
    if not keys.verify(key.public_key, c.signed, c.signature):
        return Reverified(stored.seq, problem=f"{who}: its signature does not verify with key {key.key_id}")
    lines = c.signed.split("\n", 9)
    issued = lines[8] if len(lines) == 10 else ""
    try:
        same_time = parse_issued_at(issued) == c.issued_at
    except ValueError:
        same_time = False
    says = canonical_change(
        task_id, c.change_id, c.kind.value, c.node, c.input, c.approver, c.key_id, issued, c.note
    )
    if not same_time or says != c.signed:
        return Reverified(stored.seq, problem=f"{who}: what was signed is not what the ledger records")
    if (why := unendorsed(key, keys)) is not None:
        return Reverified(stored.seq, problem=f"{who}: {why}")
    if key.added_at is not None and key.added_at > c.received_at:
        late = f"key {key.key_id} was registered at {key.added_at.isoformat()}, after the change arrived"
        return Reverified(stored.seq, problem=f"{who}: {late} at {c.received_at.isoformat()}")
    chain = [scope for scope, _ in budget_scopes(p.plan, task_id)]
    why = refusal(
        key, approver=c.approver, kind=key_kind(c.kind), chain=chain, scope=chain[-1], at=c.received_at
    )
    if why is not None:
        return Reverified(stored.seq, problem=f"{who}: {why}")
    if keys.window is not None and (why := outside_window(c.issued_at, c.received_at, keys.window)):
        return Reverified(stored.seq, problem=f"{who}: {why}")
    return Reverified(stored.seq)
