"""StateStore's async methods (what the event loop calls): the same documents as the sync ones,
read and written by the same code through HostFS in a worker thread, durably; the applied
checksum kept in memory."""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from node_agent.base.errors import UnsafePathError
from node_agent.host.documents import ApplyRecord, Claim, Inventory, OwnedEntry
from node_agent.host.fs import TEMP_PREFIX, HostFS
from node_agent.host.history import history_entry
from node_agent.host.state import (
    CORRUPT_SUFFIX,
    INVENTORY,
    LAST_APPLIED_OSC,
    STATE_DIR,
    STATUS,
    StateStore,
)
from node_agent.osc.plan import ChangeSet, FileWrite


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    old = os.umask(0o077)  # the modes must not depend on the umask
    try:
        yield tmp_path
    finally:
        os.umask(old)


def state_file(root: Path, name: str) -> Path:
    return root / STATE_DIR.lstrip("/") / name


def record(result: str = "succeeded") -> ApplyRecord:
    start = datetime(2026, 5, 6, 7, 8, 9, tzinfo=UTC)
    return ApplyRecord.model_validate(
        {
            "osc_checksum": "abc",
            "started_at": start,
            "finished_at": start + timedelta(seconds=1),
            "duration_seconds": 1.0,
            "result": result,
        }
    )


def change_set() -> ChangeSet:
    data = b"a"
    digest = hashlib.sha256(data).hexdigest()
    return ChangeSet(
        files_to_write=(
            FileWrite(path="/etc/a.conf", mode=0o644, content=data, sha256=digest, reason="new"),
        )
    )


async def test_status_is_written_with_aiofiles_durably_and_seen_by_the_sync_reader(
    root: Path,
) -> None:
    saved: list[ApplyRecord] = []

    class Observed(StateStore):
        def status_saved(self, rec: ApplyRecord) -> None:
            saved.append(rec)

    store = Observed(HostFS(root))
    assert await store.load_status_async() is None  # no state directory yet
    await store.save_status_async(record("failed"))
    await store.save_status_async(record())
    assert StateStore(HostFS(root)).load_status() == record()
    assert await StateStore(HostFS(root)).load_status_async() == record()
    assert stat.S_IMODE(state_file(root, STATUS).stat().st_mode) == 0o644
    assert [r.result for r in saved] == ["failed", "succeeded"]
    assert not [p for p in state_file(root, "").iterdir() if p.name.startswith(TEMP_PREFIX)]


async def test_status_write_runs_in_a_worker_thread(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        threads.append(threading.get_ident())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    store = StateStore(HostFS(root))
    await store.save_status_async(record())  # creates the state directory: fsyncs there too
    threads.clear()
    await store.save_status_async(record("failed"))
    assert len(threads) == 2  # the temp file and the directory
    assert threading.get_ident() not in threads


async def test_a_symlinked_state_file_is_not_followed_but_set_aside(
    root: Path, tmp_path: Path
) -> None:
    store = StateStore(HostFS(root))
    await store.save_status_async(record())
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(record().model_dump_json())
    state_file(root, STATUS).unlink()
    state_file(root, STATUS).symlink_to(elsewhere)
    assert await store.load_status_async() is None
    assert state_file(root, STATUS + CORRUPT_SUFFIX).is_symlink()
    assert not os.path.lexists(state_file(root, STATUS))
    assert elsewhere.read_text() == record().model_dump_json()
    (note,) = store.take_set_aside()
    assert "symlink" in note


async def test_unreadable_status_is_moved_aside(root: Path) -> None:
    fs = HostFS(root)
    fs.write_atomic(f"{STATE_DIR}/{STATUS}", b"{not json", 0o644)
    assert await StateStore(fs).load_status_async() is None
    assert state_file(root, STATUS + CORRUPT_SUFFIX).read_bytes() == b"{not json"
    assert not state_file(root, STATUS).exists()


async def test_journal_through_the_async_methods_survives_a_restart(root: Path) -> None:
    store = StateStore(HostFS(root))
    assert await store.pending_async() is None
    pending = await store.begin_async(change_set(), "c1")
    assert await store.pending_async() == pending
    await store.record_written_async([Claim("file", "/etc/a.conf", "x", 0o644)])
    await store.mark_done_async(*pending.steps)
    restarted = StateStore(HostFS(root))  # a new process after a crash
    resumed = await restarted.pending_async()
    assert resumed is not None
    assert resumed.id == pending.id
    assert resumed.remaining() == ()
    assert (await restarted.inventory_async()).owns("/etc/a.conf")
    await restarted.finish_async()
    assert await restarted.pending_async() is None
    assert StateStore(HostFS(root)).pending() is None
    await restarted.release_async(["/etc/a.conf"])
    assert StateStore(HostFS(root)).inventory().entries == {}


async def test_applied_checksum_is_read_once_then_kept_in_memory(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = b"osc: 1\n"
    StateStore(HostFS(root)).save_last_applied(raw)
    fs = HostFS(root)
    reads: list[str] = []
    real_read = fs.read

    def counting_read(path: str, *, limit: int | None = None) -> bytes | None:
        reads.append(path)
        return real_read(path, limit=limit)

    monkeypatch.setattr(fs, "read", counting_read)
    store = StateStore(fs)
    assert await store.applied_checksum_async() == hashlib.sha256(raw).hexdigest()
    last = await store.load_last_applied_async()
    assert last is not None
    assert last.raw == raw
    assert last.resolved == {}
    reads.clear()
    for _ in range(100):  # e.g. /metrics and /readyz requests
        assert store.applied_checksum() == hashlib.sha256(raw).hexdigest()
    assert reads == []
    await store.save_last_applied_async(b"osc: 2\n")
    assert store.applied_checksum() == hashlib.sha256(b"osc: 2\n").hexdigest()
    store.clear_last_applied()
    assert store.applied_checksum() == ""


def test_sync_applied_checksum_without_async_priming(root: Path) -> None:
    store = StateStore(HostFS(root))
    assert store.applied_checksum() == ""
    other = StateStore(HostFS(root))
    other.save_last_applied(b"x")
    assert StateStore(HostFS(root)).applied_checksum() == hashlib.sha256(b"x").hexdigest()


async def test_concurrent_state_changes_are_serialised(root: Path) -> None:
    store = StateStore(HostFS(root))
    pending = await store.begin_async(change_set(), "c1")
    steps = pending.steps
    await asyncio.gather(*(store.mark_done_async(s) for s in steps))
    resumed = StateStore(HostFS(root)).pending()
    assert resumed is not None
    assert resumed.done == frozenset(steps)


async def test_a_symlink_in_a_parent_of_the_state_dir_is_never_followed(root: Path) -> None:
    """``/var/lib`` planted as a symlink to elsewhere: the loop's reads find nothing there and
    its writes are refused, so nothing outside the root is read, written or moved aside."""
    host, outside = root / "host", root / "outside"
    planted = outside / "gardener-node-agent"
    planted.mkdir(parents=True)
    (planted / STATUS).write_text(record().model_dump_json())
    (planted / LAST_APPLIED_OSC).write_bytes(b"osc: planted\n")
    owned = OwnedEntry(kind="file", created=True, sha256="0" * 64, mode=0o644)
    (planted / INVENTORY).write_text(Inventory(entries={"/etc/shadow": owned}).model_dump_json())
    (host / "var").mkdir(parents=True)
    (host / "var" / "lib").symlink_to(outside)
    before = {p.name: p.read_bytes() for p in planted.iterdir()}
    store = StateStore(HostFS(host))
    assert await store.load_status_async() is None
    assert await store.applied_checksum_async() == ""
    assert not (await store.inventory_async()).owns("/etc/shadow")
    assert await store.pending_async() is None
    with pytest.raises(UnsafePathError):
        await store.save_status_async(record("failed"))
    with pytest.raises(UnsafePathError):
        await store.save_doc_async("health-gate.json", record())
    now = datetime.now(UTC)
    await store.append_history_async(
        history_entry(trigger="secret", result="succeeded", started_at=now)
    )
    assert {p.name: p.read_bytes() for p in planted.iterdir()} == before
