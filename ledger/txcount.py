"""How many transactions the ledger commits, and of what kind: the recorder's own instrumentation.

Throughput on a small machine follows the number of round trips and commits, so the bench (``bench/compare``)
prints the ledger's write transactions per paid node from these counts, not from a guess. Every ``Recorder``
engine in the process is watched (``watch``); the counts are process-wide and only grow (``snapshot`` and
subtract, as with any counter). Three kinds:

* ``writes``: committed transactions that ran an INSERT, UPDATE or DELETE (an append, a lease, a breaker
  observation) — each one a commit Postgres must flush;
* ``reads``: committed or rolled-back transactions that wrote nothing, and single statements on the
  AUTOCOMMIT reader (an operation's open, a lookup);
* ``rollbacks``: transactions that wrote and were rolled back (a stale epoch, an already-resolved operation).

The statement's text tells a write (``INSERT INTO``, ``UPDATE … SET``, ``DELETE FROM``, also inside a CTE);
``SELECT … FOR UPDATE`` is a read.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, event

_WRITE = re.compile(r"\bINSERT\s+INTO\b|\bUPDATE\s+\S+\s+SET\b|\bDELETE\s+FROM\b", re.IGNORECASE)


@dataclass(frozen=True)
class Counts:
    """Transactions so far (or between two snapshots: ``b - a``)."""

    writes: int = 0
    reads: int = 0
    rollbacks: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.writes + other.writes, self.reads + other.reads, self.rollbacks + other.rollbacks)

    def __sub__(self, other: Counts) -> Counts:
        return Counts(self.writes - other.writes, self.reads - other.reads, self.rollbacks - other.rollbacks)


class Counter:
    """Counts the transactions of the engines it watches (the process has one, ``watch``; a test may hold
    its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = Counts()
        self._watched: set[int] = set()
        self._flag = f"ledgerflow_wrote_{id(self)}"  # on the connection's info: this transaction has written

    def add(self, **delta: int) -> None:
        with self._lock:
            c = self._counts
            self._counts = Counts(
                c.writes + delta.get("writes", 0),
                c.reads + delta.get("reads", 0),
                c.rollbacks + delta.get("rollbacks", 0),
            )

    def snapshot(self) -> Counts:
        with self._lock:
            return self._counts

    def watch(self, engine: Engine) -> None:
        with self._lock:
            if id(engine) in self._watched:
                return
            self._watched.add(id(engine))
        event.listen(engine, "after_cursor_execute", self._executed)
        event.listen(engine, "commit", self._committed)
        event.listen(engine, "rollback", self._rolled_back)

    def _executed(self, conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        wrote = _WRITE.search(statement) is not None
        if _autocommit(conn):
            self.add(writes=int(wrote), reads=int(not wrote))  # each statement is its own transaction
        elif wrote:
            conn.info[self._flag] = True

    def _committed(self, conn: Any) -> None:
        if not _autocommit(conn):
            self.add(**({"writes": 1} if conn.info.pop(self._flag, False) else {"reads": 1}))

    def _rolled_back(self, conn: Any) -> None:
        if not _autocommit(conn):
            self.add(**({"rollbacks": 1} if conn.info.pop(self._flag, False) else {"reads": 1}))


def _autocommit(conn: Any) -> bool:
    return bool(conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT")


_COUNTER = Counter()


def watch(engine: Engine) -> None:
    """Count ``engine``'s transactions (idempotent; the recorder calls it for its engine)."""
    _COUNTER.watch(engine)


def snapshot() -> Counts:
    """The process's ledger transactions so far."""
    return _COUNTER.snapshot()
