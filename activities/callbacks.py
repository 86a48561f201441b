"""Waking the attempts that wait on a vendor's callback: one LISTEN connection per worker.

A route with ``callback`` (``vendors.routes.CallbackSpec``) has a vendor that calls back when a job ends. The
webhook receiver (``ledgerflow.webhooks``, a process of its own) verifies the call, records it in the ledger
(``vendor_callbacks``) and, for an accepted one, NOTIFYs ``ledger.callbacks.CHANNEL`` with the operation key.
This module is the other end: ``CallbackWaker`` LISTENs on that channel and sets the event of the attempt
waiting on that operation (``stage.run``'s poll loop, ``activities.stages``), which then reads the job from
the vendor itself — the same authenticated GET a poll makes. So a callback decides nothing: a forged or
replayed one never reaches a worker (the receiver refuses it), and even one that did would only cause a read.

Why a wake-up and not Temporal's async completion or a signal: the result of an operation is its fenced ledger
row, written by the run holding the task's epoch, with the output downloaded, verified and stored and its
cost settled — the executor's work, with the vendor's credential and the artifact store. A receiver that
completed the activity would need all of that on the internet-facing side; this one holds only the webhook
secret and a database role that may insert callbacks. A signal would wake the workflow, not the executor.

Without the listener (the database unreachable, the connection lost) nothing is lost: every wait is bounded by
the route's ``callback.window``, after which the attempt polls the vendor anyway; the listener reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

import psycopg
from sqlalchemy.engine import make_url

from ledger.callbacks import CHANNEL

log = logging.getLogger("ledgerflow.callbacks")
RECONNECT_S: Final = 2.0


class CallbackWaker:
    """Per worker: the events of the attempts waiting on callbacks, set by Postgres notifications."""

    def __init__(self, database_url: str) -> None:
        # SQLAlchemy's URL (postgresql+psycopg://…) as libpq's: the same server, the same credentials.
        self._conninfo = make_url(database_url).set(drivername="postgresql").render_as_string(False)
        self._waiting: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._task: asyncio.Task[None] | None = None
        self.listening = asyncio.Event()  # set while the LISTEN connection is up
        self.woken = 0  # notifications that woke an attempt (a figure for tests and metrics)

    async def start(self, ready_within: float = 10.0) -> None:
        """Start listening, and wait (up to ``ready_within`` s) until the LISTEN is in place: a worker that
        took activities before it would have their waits woken all at once by the first connect (which
        wakes every waiter, for notifications it may have missed), ending shots early that no callback
        woke (seen under load in CI). A database too slow to answer in time: the polls carry on meanwhile."""
        if self._task is None:
            self._task = asyncio.create_task(self._listen(), name="callback-waker")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.listening.wait(), ready_within)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @asynccontextmanager
    async def waiting(self, operation_key: str) -> AsyncIterator[asyncio.Event]:
        """An event set whenever a callback for ``operation_key`` is accepted, while the context lasts.

        Register before reading the job's state: a callback accepted after the read then sets the event, so
        none falls between the read and the wait.
        """
        event = asyncio.Event()
        self._waiting[operation_key].add(event)
        try:
            yield event
        finally:
            waiters = self._waiting.get(operation_key)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    del self._waiting[operation_key]

    def _wake(self, operation_key: str) -> None:
        for event in self._waiting.get(operation_key, ()):
            event.set()
            self.woken += 1

    async def _listen(self) -> None:
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(self._conninfo, autocommit=True) as conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    self.listening.set()
                    # Anything accepted while the listener was down is caught by the waits' windows; wake
                    # every waiter once now so none sits out a whole window for a notification it missed.
                    for key in list(self._waiting):
                        self._wake(key)
                    async for note in conn.notifies():
                        self._wake(note.payload)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the database went away: polls carry on, the listener comes back
                log.warning("callback listener lost (%s); reconnecting in %gs", type(e).__name__, RECONNECT_S)
            finally:
                self.listening.clear()
            await asyncio.sleep(RECONNECT_S)
