"""``python -m bench.ledger``: how many of the ledger's own write transactions Postgres commits per second.

A capacity input (docs/capacity.md): the two statements a paid node writes in the common case — its INTENT
(a fenced append reserving on the task's three budget scopes) and its result (an idempotent append settling
them) — through the real ``Recorder`` on an embedded PostgreSQL, from 1, 4 and 16 threads at once (each thread
its own tasks, as workers' activities are). Prints commits per second and the Postgres CPU per commit.

    python -m bench.ledger --seconds 10
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
import uuid
from decimal import Decimal
from pathlib import Path

import psutil

from ledger import migrate, txcount
from ledger.recorder import Recorder
from ledgerflow.stack import pg
from rules import scopes
from rules.envelope import NewEvent


def _node(rec: Recorder, task: str, epoch: int, n: int) -> None:
    """One node's two writes: its INTENT with a reservation, its result settling it."""
    key = f"{task}:s{n}:a1"
    intent = NewEvent(type="Intent", dedup_key=f"{key}:intent", operation_key=key, payload={"node": f"s{n}"})
    rec.append_fenced(task, epoch, [intent], reserve=Decimal("0.01"))
    result = NewEvent(type="Outcome", dedup_key=f"{key}:result", operation_key=key, payload={"node": f"s{n}"})
    rec.append_idempotent(task, result, release=Decimal("0.01"), spend=Decimal("0.01"))


def _worker(rec: Recorder, stop: float, done: list[int]) -> None:
    count = 0
    while time.monotonic() < stop:
        task = f"bench-{uuid.uuid4().hex[:12]}"
        epoch = rec.take_lease(task, "bench")
        rec.open_budget(
            task, scopes.chain("bench", "ep", task, Decimal(1_000_000))
        )  # one project: its row is shared
        for n in range(50):  # a task of 50 nodes: the lease and accounts are a small share, as in a run
            if time.monotonic() >= stop:
                break
            _node(rec, task, epoch, n)
            count += 1
    done.append(count)


def postgres_cpu(data: Path) -> float:
    pid = pg.postmaster_pid(data) or 0
    proc = psutil.Process(pid)
    t = proc.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    return total + sum(c.cpu_times().user + c.cpu_times().system for c in proc.children())


def main(seconds: float, threads: list[int]) -> None:
    work = Path(tempfile.mkdtemp(prefix="ledgerflow-bench-ledger-"))
    data = work / "pg" / "data"
    instance = pg.init_and_start(data)
    try:
        migrate.upgrade(instance.url)
        print(f"{'threads':>7} {'nodes/s':>9} {'commits/s':>10} {'PG CPU ms/commit':>17} {'writes/node':>12}")
        for n in threads:
            rec = Recorder(instance.url, pool_size=n)
            done: list[int] = []
            before, cpu = txcount.snapshot(), postgres_cpu(data)
            t0 = time.monotonic()
            workers = [threading.Thread(target=_worker, args=(rec, t0 + seconds, done)) for _ in range(n)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            elapsed = time.monotonic() - t0
            counts, used = txcount.snapshot() - before, postgres_cpu(data) - cpu
            nodes = sum(done)
            print(
                f"{n:7d} {nodes / elapsed:9.0f} {counts.writes / elapsed:10.0f} "
                f"{used / max(counts.writes, 1) * 1000:17.3f} {counts.writes / max(nodes, 1):12.2f}"
            )
            rec.dispose()
    finally:
        pg.stop(data)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    main(args.seconds, args.threads)
