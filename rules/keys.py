"""The key scheme: every OperationKey and every event dedup key, built in one place.

An **OperationKey** names one external call, stable across retries, takeovers and workflow resets (it is built
from the task id, the node and the business attempt, never from a Temporal run id). It is the vendor's
idempotency key and the ledger's index for reconciliation. A **dedup key** names one logical write; the
ledger's UNIQUE constraint makes the first write of a key win. Keys derived from an operation start with its
OperationKey, so ``events_by_operation_key`` finds all of them.

Changing a format here changes what an existing ledger deduplicates against: keep old formats readable.
"""

from __future__ import annotations

import hashlib
from typing import Final

RESULT: Final = "result"  # an operation's one resolution: Outcome, Failure, ExecutionResult or void


def operation_key(task_id: str, node: str, attempt: int) -> str:
    """One business attempt of a node: ``task:node:aN``."""
    return f"{task_id}:{node}:a{attempt}"


def gate_key(task_id: str, stage: str, input_version: int) -> str:
    """The static gate of a stage at one input version (one per version, shared by a fan-out's nodes)."""
    return f"{task_id}:{stage}:gate{input_version}"


def compensation_key(op: str, attempt: int) -> str:
    """The n-th attempt to undo the output of operation ``op`` (its stage's compensation)."""
    return f"{op}:undo{attempt}"


def result_key(op: str) -> str:
    """An operation's one resolution, shared by Outcome, Failure and the void marker: the first one wins."""
    return f"{op}:{RESULT}"


def is_result_key(dedup_key: str) -> bool:
    return dedup_key.endswith(f":{RESULT}")


def submitting_key(op: str, n: int) -> str:
    """The write-ahead marker of the n-th submit attempt of an operation (one per activity attempt)."""
    return f"{op}:submitting:{n}"


def refused_key(op: str, n: int) -> str:
    """The vendor refused the n-th submit before accepting anything (429, 401 …): that one was not sent."""
    return f"{op}:refused:{n}"


def progress_key(op: str, job_id: str) -> str:
    return f"{op}:progress:{job_id}"


def anomaly_key(op: str, what: str = "") -> str:
    """A cost anomaly of an operation; ``what`` tells several apart (e.g. ``precision``, ``late:JOB``)."""
    return f"{op}:cost_anomaly" + (f":{what}" if what else "")


def late_charge_key(op: str, job_id: str) -> str:
    """A charge for a job the vendor created after the operation was resolved (a late creation)."""
    return f"{op}:late_charge:{job_id}"


def lost_key(op: str, sha256: str) -> str:
    """An operation found an artifact (an input, or an output to reuse) missing or corrupt."""
    return f"{op}:lost:{sha256[:16]}"


def created_key(task_id: str) -> str:
    return f"{task_id}:created"


def intent_key(task_id: str, watermark: int, n: int) -> str:
    """The loop's n-th INTENT, decided on ``fold(events <= watermark)``."""
    return f"{task_id}:intent:{watermark}:{n}"


def closing_key(task_id: str) -> str:
    """The marker a task writes as it begins to close: no executor writes an INTENT after it."""
    return f"{task_id}:closing"


def refused_intent_key(intent: str) -> str:
    """The record of a dispatch's INTENT the ledger refused to write (a budget scope was short)."""
    return f"{intent}:refused"


def effect_key(intent: str, effect: str) -> str:
    """An INTENT's immediate effect (``rollback``, ``escalation``), written in the same transaction."""
    return f"{intent}:{effect}"


def decision_key(task_id: str, watermark: int) -> str:
    """The LLM planner's Decision on the fold at ``watermark``."""
    return f"{task_id}:decision:{watermark}"


def resolution_key(task_id: str, request_id: str) -> str:
    """The one resolution of a human request: a person's decision or the timeout marker, first wins."""
    return f"{task_id}:resolution:{request_id}"


def change_key(task_id: str, change_id: str) -> str:
    """A person's signed change (rules.changes): recorded once, however often it is sent."""
    return f"{task_id}:change:{change_id}"


def rejected_key(task_id: str, decision_ref: str) -> str:
    return f"{task_id}:rejected:{decision_ref}"


def rejected_burst_key(task_id: str, request_id: str, digest: str) -> str:
    """One burst of refused decisions on a request (``digest``: of the refs counted in it)."""
    return f"{task_id}:rejected-burst:{request_id}:{digest}"


def backups_key(task_id: str, request_id: str) -> str:
    """A request's one offer to the plan's backup approvers."""
    return f"{task_id}:backups:{request_id}"


def key_fraction(key: str) -> float:
    """A number in [0, 1) from ``key``'s hash: jitter that is a function of the record (rules stay pure)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") / 2**32
