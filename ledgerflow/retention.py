"""Retention (issue 27 §6): an ended task's artifacts leave the store after its project's period, unless a
release or a task that may still use them references them; the ledger records each deletion.

The store is content-addressed, so one object may be the output of several tasks (a reuse, the same bytes
made twice): an object is deleted only when every task that names it may lose it — ended longer ago than
its project keeps artifacts, and never released. A task still open, a released task, a task within its
period, or a project with no period keeps every object it names. Each deletion is an ``artifact_expired``
marker in the ledger of each task that named it (its dedup key makes a second run a no-op); the fold then
counts the output lost, so no later task reuses it. The ledger's events themselves stay (append-only):
retention never deletes a row (docs/operations.md, "Retention").

Cost: one read of every task's events per run (a fold each), and one store request per object deleted: a
daily schedule is plenty.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from artifacts.store import ArtifactStore
from ledger.recorder import Recorder
from rules.envelope import StoredEvent
from rules.events import MarkerKind, SystemMarker, to_new
from rules.projection import fold


@dataclass(frozen=True, slots=True)
class Held:
    """One task's hold on the objects it names."""

    task_id: str
    project: str
    ended_at: datetime | None  # None: still open
    released: bool
    objects: dict[str, tuple[str, str]]  # sha256 -> (node, uri)
    readable: bool = True


def _shas(value: object) -> Iterator[str]:
    """Every ``sha256`` field's value anywhere in a payload."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k == "sha256" and isinstance(v, str):
                yield v
            else:
                yield from _shas(v)
    elif isinstance(value, list):
        for v in value:
            yield from _shas(v)


@dataclass
class Expiry:
    """What one run found: the objects to delete (sha256 -> uri), who named them, and why others stay."""

    due: dict[str, str] = field(default_factory=dict)
    named_by: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # sha256 -> [(task, node)]
    kept: dict[str, str] = field(default_factory=dict)  # sha256 -> why it stays
    deleted: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # due, but already gone from the store
    unreadable: list[str] = field(default_factory=list)  # tasks whose record would not fold: they keep all


def holds(events: list[StoredEvent], released: bool) -> Held:
    """What a task's ledger says about the objects it names (``released``: the releases table lists it).
    A record that will not fold keeps every object any of its events mentions (read as open)."""
    try:
        p = fold(events)
    except (ValueError, KeyError, TypeError, StopIteration):  # pydantic's ValidationError is a ValueError
        mentioned = {sha: ("?", "") for e in events for sha in _shas(e.payload)}
        return Held(events[0].task_id, "?", None, released, mentioned, readable=False)
    objects: dict[str, tuple[str, str]] = {}
    for node in p.nodes.values():
        for out in node.outputs:
            if out.lost:
                continue  # expired (or found lost) already: nothing of it to keep or to delete again
            sha, uri = out.artifact.get("sha256"), out.artifact.get("uri")
            if isinstance(sha, str) and isinstance(uri, str):
                objects[sha] = (node.id, uri)
    ended = events[-1].recorded_at if p.terminal else None
    return Held(p.task_id, p.plan.project, ended, released, objects)


def period(days: dict[str, float], project: str) -> timedelta | None:
    """How long ``project`` keeps an ended task's artifacts (None: for ever)."""
    value = days.get(project, days.get("*"))
    return None if value is None else timedelta(days=value)


def plan_expiry(held: Iterable[Held], days: dict[str, float], now: datetime) -> Expiry:
    """The objects every task naming them may lose at ``now``, and why each other object stays."""
    out = Expiry()
    by_object: dict[str, list[Held]] = defaultdict(list)
    for h in held:
        for sha in h.objects:
            by_object[sha].append(h)
    for sha, tasks in by_object.items():
        why = next((w for h in tasks if (w := _keeps(h, days, now)) is not None), None)
        if why is not None:
            out.kept[sha] = why
            continue
        out.due[sha] = tasks[0].objects[sha][1]
        out.named_by[sha] = [(h.task_id, h.objects[sha][0]) for h in tasks]
    return out


def _keeps(h: Held, days: dict[str, float], now: datetime) -> str | None:
    if not h.readable:
        return f"task {h.task_id}'s record does not fold: it keeps all it mentions"
    if h.ended_at is None:
        return f"task {h.task_id} is open"
    if h.released:
        return f"task {h.task_id} was released"
    kept_for = period(days, h.project)
    if kept_for is None:
        return f"project {h.project} keeps artifacts for ever"
    if h.ended_at + kept_for > now:
        return f"task {h.task_id} ended less than {kept_for.days} days ago"
    return None


def expire(
    recorder: Recorder,
    store_for: Callable[[str], ArtifactStore],
    days: dict[str, float],
    now: datetime,
    *,
    dry_run: bool = False,
) -> Expiry:
    """Delete the artifacts due at ``now`` and record each deletion in every ledger that named the object
    (recorded first, then deleted: a run stopped between the two leaves a marker for bytes still there,
    which the next run deletes; never bytes gone with no record)."""
    released = recorder.released_tasks()
    held = [holds(events, t in released) for t in recorder.task_ids() if (events := recorder.read_events(t))]
    found = plan_expiry(held, days, now)
    found.unreadable = [h.task_id for h in held if not h.readable]
    if dry_run:
        return found
    for sha, uri in found.due.items():
        for task_id, node in found.named_by[sha]:
            marker = SystemMarker(kind=MarkerKind.ARTIFACT_EXPIRED, node=node, detail=sha)
            recorder.append_idempotent(task_id, to_new(marker, dedup_key=f"{task_id}:expired:{sha}"))
        (found.deleted if store_for(uri).delete(uri) else found.missing).append(sha)
    return found
