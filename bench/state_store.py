"""The state store's async API on the apply hot path, per call, on a real file system.

An apply calls ``record_written_async`` and ``mark_done_async`` for its steps and
``pending_async`` around them; each is one atomic, durable rewrite of a small state file (temp
file, fsync, rename, directory fsync) or a read from memory. Measured in a fresh temporary
directory per round (``--dir`` picks its parent: put it on the disk the agent's state lives on):

- ``mark_done_async``: a journal of N one-file steps begun, then each step marked done alone
  (the progress file grows with every step, as in a real apply);
- ``record_written_async``: N claims, one per call (the inventory grows);
- ``pending_async``: N calls once the journal is known (memory only);
- ``save_status_async`` / ``load_status_async`` / ``append_history_async``: N each.

Prints the median and best round per operation in microseconds per call. ``--no-fsync`` makes
``os.fsync`` a no-op, leaving the code path's own cost (syscalls, thread hops, serialising)
without the disk's flush latency, which otherwise dominates and varies.

Run from the repository root: ``.venv/bin/python -m bench.state_store [--calls 1000] [--rounds 5]
[--no-fsync]``
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path

from node_agent.host.documents import ApplyRecord, Claim
from node_agent.host.fs import HostFS
from node_agent.host.history import history_entry
from node_agent.host.state import StateStore
from node_agent.osc.plan import ChangeSet, FileWrite

Bench = Callable[[StateStore, int], Coroutine[None, None, float]]


def change_set(n: int) -> ChangeSet:
    data = b"x"
    digest = hashlib.sha256(data).hexdigest()
    return ChangeSet(
        files_to_write=tuple(
            FileWrite(
                path=f"/etc/bench/{i}.conf", mode=0o644, content=data, sha256=digest, reason="new"
            )
            for i in range(n)
        )
    )


async def mark_done(store: StateStore, n: int) -> float:
    pending = await store.begin_async(change_set(n), "c1")
    start = time.perf_counter()
    for step in pending.steps:
        await store.mark_done_async(step)
    return time.perf_counter() - start


async def record_written(store: StateStore, n: int) -> float:
    await store.begin_async(change_set(n), "c1")
    start = time.perf_counter()
    for i in range(n):
        await store.record_written_async([Claim("file", f"/etc/bench/{i}.conf", "0" * 64, 0o644)])
    return time.perf_counter() - start


async def pending(store: StateStore, n: int) -> float:
    await store.begin_async(change_set(8), "c1")
    start = time.perf_counter()
    for _ in range(n):
        await store.pending_async()
    return time.perf_counter() - start


def _record(i: int) -> ApplyRecord:
    now = datetime.now(UTC)
    return ApplyRecord(
        osc_checksum=f"{i:064x}",
        started_at=now,
        finished_at=now,
        duration_seconds=0,
        result="succeeded",
    )


async def save_status(store: StateStore, n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        await store.save_status_async(_record(i))
    return time.perf_counter() - start


async def load_status(store: StateStore, n: int) -> float:
    await store.save_status_async(_record(0))
    start = time.perf_counter()
    for _ in range(n):
        await store.load_status_async()
    return time.perf_counter() - start


async def append_history(store: StateStore, n: int) -> float:
    now = datetime.now(UTC)
    entries = [
        history_entry(trigger="secret", result="succeeded", started_at=now, checksum_to=f"{i:064x}")
        for i in range(n)
    ]  # all different: a rewrite of the same bytes would be skipped
    start = time.perf_counter()
    for entry in entries:
        await store.append_history_async(entry)
    return time.perf_counter() - start


BENCHES: dict[str, Bench] = {
    "mark_done_async": mark_done,
    "record_written_async": record_written,
    "pending_async": pending,
    "save_status_async": save_status,
    "load_status_async": load_status,
    "append_history_async": append_history,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="parent of the temporary directories")
    parser.add_argument("--only", default=None, help="comma-separated operation names")
    parser.add_argument("--no-fsync", action="store_true", help="os.fsync does nothing")
    args = parser.parse_args()
    if args.no_fsync:

        def no_fsync(fd: object) -> None:
            del fd

        os.fsync = no_fsync
    names = args.only.split(",") if args.only else list(BENCHES)
    flush = "without fsync" if args.no_fsync else "with fsync"
    print(f"{args.calls} calls per round, {args.rounds} rounds, {flush}; microseconds per call")
    for name in names:
        times = []
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                store = StateStore(HostFS(Path(tmp)))
                times.append(asyncio.run(BENCHES[name](store, args.calls)) / args.calls * 1e6)
        print(f"{name:22} median {statistics.median(times):8.1f}  best {min(times):8.1f}")


if __name__ == "__main__":
    main()
