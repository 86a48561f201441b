"""Reconciliation: how an operation whose INTENT has no result ends, from the ledger and the vendor.

``operations``: an open operation's next step, decided before anything is sent (resume its job, submit under
the same key, look the key up at the vendor, void it once it provably never landed, or count it as an
unknown outcome for a person); ``watchdog``: when a job's progress stopped for too long; ``takeover``: the
unfinished tasks whose workflow no longer runs.

All three can find what an earlier attempt or run left behind because every external call's key is
``task:node:aN`` (stable across retries, restarts and resets), executors check the task's epoch before any
vendor call, and the result key ``{operation_key}:result`` admits exactly one result per operation.
"""
