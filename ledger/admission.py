"""Admission at the task level: at most N tasks of a task queue run their work at once
(docs/design.md#admission-at-the-task-level).

A thousand tasks started together all compete for the workers' slots, and every one of them crawls; bounded,
the waiting happens before a task's first dispatch, in one ordered queue, and the tasks admitted run at the
speed the workers have. ``task_admission`` (revision 0012) holds one row per task that entered the queue:
waiting, or admitted; the task's last run deletes it as the task ends (``release``). Every change takes one
advisory lock per queue, so two workers never admit past the bound.

What counts as running: an admitted row whose task is not stopped for a person — no open request in
``human_queue`` of a kind that stops the whole task (an escalation, a refused LLM proposal: rules.table R5). A
stopped task holds no worker, and a hundred of them must not stop the queue for a day; when its person
answers, it runs again without asking (over the bound for that while). An approval or a dead letter stops only
its node's dependents, so a task that has one open still counts.

Whoever changes the queue admits what now fits — the best-ranked waiting rows (a hero task first, then by
when each asked) — and returns their task ids: its workflow wakes them with a signal; a waiting workflow
also asks again now and then (``workflows.policies.admission_recheck``), so a lost wake-up costs time, never
the task. ``capacity`` 0 means no bound: nothing enters the queue, and whatever still waits is admitted.

A release is a local activity: a worker that dies after its transaction committed and before its workflow
task completed runs it again, and the delete finds nothing to delete. So each admitted row says whose change
admitted it (``admitted_by``), and a release returns every row its task's end admitted, not only those of
this call: the wake-ups are sent whichever attempt's result is recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from sqlalchemy import Connection, text

from ledger.schema import task_admission
from rules.table import TASK_STOPPING

__all__ = ["Admission", "admit", "release"]

_LOCK: Final = text("SELECT pg_advisory_xact_lock(hashtext('task-admission:' || :b_queue))")
_ENTER: Final = text(
    f"INSERT INTO {task_admission.name} (task_id, queue, rank) VALUES (:b_task_id, :b_queue, :b_rank)"
    " ON CONFLICT (task_id) DO NOTHING"
)
# The running count, and the best-ranked waiting rows that fit beside it, admitted in one statement (by
# :b_by). :b_capacity 0 (no bound) admits every waiting row.
_STOPPING: Final = ", ".join(f"'{kind.value}'" for kind in sorted(TASK_STOPPING))
_ADMIT_NEXT: Final = text(
    f"""
    WITH running AS (
        SELECT count(*) AS n FROM {task_admission.name} a
        WHERE a.queue = :b_queue AND a.admitted_at IS NOT NULL
          AND NOT EXISTS (
              SELECT 1 FROM human_queue h WHERE h.task_id = a.task_id AND h.kind IN ({_STOPPING}))
    ), fits AS (
        SELECT task_id FROM {task_admission.name}
        WHERE queue = :b_queue AND admitted_at IS NULL
        ORDER BY rank, asked_at, task_id
        LIMIT CASE WHEN :b_capacity = 0 THEN NULL
                   ELSE greatest(:b_capacity - (SELECT n FROM running), 0) END
    )
    UPDATE {task_admission.name} SET admitted_at = clock_timestamp(), admitted_by = :b_by
    WHERE task_id IN (SELECT task_id FROM fits)
    RETURNING task_id
    """
)
_ADMITTED_BY: Final = text(
    f"SELECT task_id FROM {task_admission.name} WHERE queue = :b_queue AND admitted_by = :b_by"
    " ORDER BY rank, asked_at, task_id"
)
# The task's own place: whether it holds a row, whether admitted, and how many waiting rows stand before it.
_PLACE: Final = text(
    f"""
    SELECT me.admitted_at IS NOT NULL,
           (SELECT count(*) FROM {task_admission.name} w
            WHERE w.queue = me.queue AND w.admitted_at IS NULL
              AND (w.rank, w.asked_at, w.task_id) < (me.rank, me.asked_at, me.task_id))
    FROM {task_admission.name} me WHERE me.task_id = :b_task_id
    """
)
_LEAVE: Final = text(f"DELETE FROM {task_admission.name} WHERE task_id = :b_task_id")


@dataclass(frozen=True)
class Admission:
    """A task's place in its queue, and the other tasks this change admitted (to be woken)."""

    admitted: bool  # the task may run its work (admitted, or never entered the queue)
    held: bool  # the task holds a row: its last run releases it as the task ends
    ahead: int  # waiting tasks ranked before it (0 once admitted)
    woken: tuple[str, ...]  # the other tasks admitted by this change


def admit(conn: Connection, task_id: str, queue: str, rank: int, capacity: int, *, enter: bool) -> Admission:
    """Ask for ``task_id``'s admission, in the caller's transaction. ``enter``: a task that has not started
    its work yet joins the queue (with ``capacity`` > 0); one already running is never made to wait."""
    params = {"b_task_id": task_id, "b_queue": queue, "b_rank": rank, "b_capacity": capacity, "b_by": task_id}
    conn.execute(_LOCK, params)
    if enter and capacity > 0:
        conn.execute(_ENTER, params)
    admitted = [r[0] for r in conn.execute(_ADMIT_NEXT, params)]
    place = conn.execute(_PLACE, params).first()
    woken = tuple(t for t in admitted if t != task_id)
    if place is None:
        return Admission(admitted=True, held=False, ahead=0, woken=woken)
    return Admission(admitted=bool(place[0]), held=True, ahead=0 if place[0] else int(place[1]), woken=woken)


def release(conn: Connection, task_id: str, queue: str, capacity: int) -> tuple[str, ...]:
    """The task ended: leave the queue, and admit what now fits. Returns every task its end admitted (this
    call's, and a crashed earlier attempt's that are still there), in their order."""
    params = {"b_task_id": task_id, "b_queue": queue, "b_capacity": capacity, "b_by": f"release:{task_id}"}
    conn.execute(_LOCK, params)
    conn.execute(_LEAVE, params)
    conn.execute(_ADMIT_NEXT, params)
    return tuple(r[0] for r in conn.execute(_ADMITTED_BY, params))
