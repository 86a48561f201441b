"""``ledgerflow artifacts TASK``: every artifact a task registered, what it was made from, and how.

Read from the ledger alone: each Outcome (the artifact: URI, sha256, size, probed media, reuse) joined to the
INTENT that asked for it (its input hash and the artifact references of its inputs). Nothing is fetched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

from rules.actions import Compensate, Dispatch
from rules.envelope import StoredEvent
from rules.events import Intent, Outcome, parse, parse_as
from rules.inputs import refs


@dataclass(frozen=True)
class ArtifactRow:
    seq: int
    node: str
    operation_key: str
    uri: str
    sha256: str
    size: int
    media: dict[str, Any] | None
    input_hash: str | None
    reused_from: str | None
    cost: str
    current: bool  # the node's registered version now (a later Outcome of the node replaces it)
    inputs: list[dict[str, Any]] = field(default_factory=list)  # {name, node, sha256}

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


def artifact_rows(events: list[StoredEvent]) -> list[ArtifactRow]:
    """One row per registered artifact, oldest first, with the inputs its request named (an undo's receipt,
    from a failed task's compensation, is not a node's artifact)."""
    asked: dict[str, Dispatch] = {}
    undos: set[str] = set()
    for e in events:
        if e.type == "Intent" and e.operation_key is not None:
            intent = parse(e)
            if isinstance(intent, Intent) and isinstance(intent.action, Dispatch):
                asked[e.operation_key] = intent.action
            elif isinstance(intent, Intent) and isinstance(intent.action, Compensate):
                undos.add(e.operation_key)
    outcomes = [
        (e.seq, parse_as(e, Outcome)) for e in events if e.type == "Outcome" and e.operation_key not in undos
    ]
    latest = {o.node: seq for seq, o in outcomes}
    rows = []
    for seq, o in outcomes:
        assert isinstance(o, Outcome)
        dispatch = asked.get(o.operation_key)
        inputs = []
        if dispatch is not None:
            for name, value in (dispatch.input.get("inputs") or {}).items():
                inputs += [{"name": name, "node": r.get("node"), "sha256": r["sha256"]} for r in refs(value)]
        media = o.artifact.media.model_dump(exclude_none=True) if o.artifact.media else None
        rows.append(
            ArtifactRow(
                seq=seq,
                node=o.node,
                operation_key=o.operation_key,
                uri=o.artifact.uri,
                sha256=o.artifact.sha256,
                size=o.artifact.size,
                media=media,
                input_hash=o.input_hash,
                reused_from=o.reused_from,
                cost=str(o.actual_cost),
                current=latest[o.node] == seq,
                inputs=inputs,
            )
        )
    return rows


def artifacts_table(task_id: str, rows: list[ArtifactRow]) -> Table:
    table = Table(title=f"artifacts of {task_id}", title_justify="left")
    for col in ("seq", "node", "sha256", "media", "made from", "how"):
        table.add_column(col)
    for r in rows:
        media = ""
        if r.media:
            bits = [str(r.media.get("format") or "")]
            if r.media.get("width"):
                bits.append(f"{r.media['width']}×{r.media.get('height')}")
            if r.media.get("duration_s") is not None:
                bits.append(f"{r.media['duration_s']:g}s")
            media = " ".join(b for b in bits if b)
        made_from = ", ".join(f"{i['node']}@{i['sha256'][:8]}" for i in r.inputs[:4])
        if len(r.inputs) > 4:
            made_from += f" … (+{len(r.inputs) - 4})"
        how = f"reused {r.reused_from}" if r.reused_from else f"paid {r.cost}"
        node = r.node if r.current else f"[dim]{r.node} (replaced)[/dim]"
        table.add_row(str(r.seq), node, r.sha256[:12], media, made_from, how)
    return table
