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
``SELECT … FOR UPDATE`` is a read. A caller may label what runs in its context (``labelled("node")``: a paid
node's executor), so the bench tells a node's own writes from its task's (``snapshot("node")``); the label
follows ``asyncio.to_thread`` into the recorder's threads (it copies the context).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, event

_LABEL: ContextVar[str] = ContextVar("ledgerflow_txcount_label", default="")
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
        self._counts: dict[str, Counts] = {}  # by label ("": unlabelled)
        self._watched: set[int] = set()
        self._flag = f"ledgerflow_wrote_{id(self)}"  # on the connection's info: this transaction has written

    def add(self, **delta: int) -> None:
        label = _LABEL.get()
        with self._lock:
            self._counts[label] = self._counts.get(label, Counts()) + Counts(**delta)

    def snapshot(self, label: str | None = None) -> Counts:
        """Every transaction so far, or only those run under ``label``."""
        with self._lock:
            if label is not None:
                return self._counts.get(label, Counts())
            total = Counts()
            for counts in self._counts.values():
                total = total + counts
            return total

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


def snapshot(label: str | None = None) -> Counts:
    """The process's ledger transactions so far (only those run under ``label``, if given)."""
    return _COUNTER.snapshot(label)


@contextmanager
def labelled(label: str) -> Iterator[None]:
    """Count the transactions run in this context (and the threads it hands work to) under ``label``."""
    token = _LABEL.set(label)
    try:
        yield
    finally:
        _LABEL.reset(token)
