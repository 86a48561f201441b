"""Backpressure from the people in the loop: concurrency is limited by human review capacity too
(docs/design.md#concurrency-limits).

Each project's people can hold so many open requests (``human_capacity``). When more wait, producing more
work for them only lengthens their queue: a fan-out then widens slowly — one node in flight, one more for each
node of the stage that finished, never more than the stage's width scaled down by the overload.

The load is a cross-task input. It is read in the same statement that writes a dispatch's INTENT (the
project's rows of ``human_queue``) and recorded in that INTENT (``pressure``); the rules use the latest
reading in the task's own ledger, so every decision stays recomputable from the task's record. A reading lags
by one INTENT at most, and the width never drops to zero: the node still in flight writes the next reading.

Pure: ``queue_changes`` tells what an event does to the shared queue (the recorder applies it in the event's
own transaction), ``width`` what a stage may have in flight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rules.events import MarkerKind


@dataclass(frozen=True, slots=True)
class Reading:
    """The project's open human requests when an event was written, and how many its people can hold."""

    load: int
    capacity: int

    @property
    def over(self) -> bool:
        return 0 < self.capacity < self.load

    def as_payload(self) -> dict[str, int]:
        return {"load": self.load, "capacity": self.capacity}

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> Reading | None:
        """The reading an event's payload recorded (``pressure``: a dispatch's INTENT, a person's decision),
        or None."""
        raw = payload.get("pressure")
        if not isinstance(raw, Mapping):
            return None
        return cls(int(raw["load"]), int(raw["capacity"]))


def width(full: int, finished: int, reading: Reading | None) -> int:
    """How many of a stage's nodes may be in flight: ``full`` (the plan's width) unless the people are over
    capacity; then 1 + the stage's finished nodes, capped at ``full × capacity / load`` (at least 1)."""
    if reading is None or not reading.over:
        return full
    return min(max(1, full * reading.capacity // reading.load), 1 + finished)


def describe(full: int, allowed: int, reading: Reading) -> str:
    """Why a fan-out is narrower than the plan's width (recorded in the dispatch's reason)."""
    return (
        f"backpressure: {reading.load} open requests for people who hold {reading.capacity}: "
        f"{allowed} of {full} in flight"
    )


@dataclass(frozen=True, slots=True)
class QueueChange:
    """What one event does to the shared queue of open human requests: requests opened (id, kind), requests
    closed, or every request of the task closed (it ended)."""

    opened: tuple[tuple[str, str], ...] = ()
    closed: tuple[str, ...] = ()
    close_all: bool = False


_ENDS_TASK = frozenset({"Complete"})
_CLOSES_ALL_MARKERS = frozenset({MarkerKind.CLOSING.value})


def queue_changes(event_type: str, payload: Mapping[str, Any]) -> QueueChange | None:
    """The change an event (its type and payload, as appended) makes to the queue; None for most events.

    A request opens with the INTENT that asks it (SuspendForHuman, or a resumable escalation); it closes with
    a person's recorded decision, its timeout marker, or the task's end (a terminal escalation, completion,
    the closing marker). A decision the recording path refused is a marker, not a HumanDecision: it closes
    nothing."""
    if event_type == "Intent":
        action = payload.get("action") or {}
        kind = action.get("kind")
        if kind in _ENDS_TASK or (kind == "Escalate" and action.get("terminal")):
            return QueueChange(close_all=True)
        request = action.get("request")
        if kind in ("SuspendForHuman", "Escalate") and isinstance(request, Mapping):
            resolves = action.get("resolves")
            return QueueChange(
                opened=((str(request["id"]), str(request["kind"])),),
                closed=(str(resolves),) if resolves else (),
            )
        return None
    if event_type == "HumanDecision":
        return QueueChange(closed=(str(payload["request_id"]),))
    if event_type == "SystemMarker":
        if payload.get("kind") == MarkerKind.TIMEOUT.value and payload.get("request_id"):
            return QueueChange(closed=(str(payload["request_id"]),))
        if payload.get("kind") in _CLOSES_ALL_MARKERS:
            return QueueChange(close_all=True)
        return None
    if event_type == "Escalation" and payload.get("terminal"):
        return QueueChange(close_all=True)
    return None
