"""The agent's own state files in every shape a broken or tampered node can give them: a
directory, a symlink (to a file, to /dev/zero), a FIFO, garbage, a file too large. Every read
answers at once (absent, the thing set aside), nothing raises or blocks, and the next write puts
a good file back. ``node-agent status --history`` answers with one line and exit 1."""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from node_agent.host import state as state_module
from node_agent.host.documents import ApplyRecord
from node_agent.host.fs import HostFS
from node_agent.host.history import HISTORY, history_entry
from node_agent.host.state import (
    CHANGES,
    CHANGES_DONE,
    CORRUPT_SUFFIX,
    INVENTORY,
    LAST_APPLIED_OSC,
    STATE_DIR,
    STATUS,
    StateStore,
)

REPO = Path(__file__).resolve().parents[2]
LIMIT = 64 * 1024  # the read bound, lowered for the test (the agent's is far larger)
#: the agent's own bound, for the subprocess (which the fixture below does not lower)
REAL_LIMIT: int = getattr(state_module, "STATE_READ_LIMIT", 64 << 20)
SHAPES = ["directory", "symlink", "fifo", "dev-zero", "garbage", "huge"]


def _state(root: Path, name: str) -> Path:
    return root / STATE_DIR.lstrip("/") / name


def plant(root: Path, name: str, shape: str, limit: int = LIMIT) -> Path:
    path = _state(root, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    if shape == "directory":
        path.mkdir()
        (path / "inside").write_text("x")
    elif shape == "symlink":
        target = root / "elsewhere.json"
        target.write_text("{}")
        path.symlink_to(target)
    elif shape == "fifo":
        os.mkfifo(path)
    elif shape == "dev-zero":
        path.symlink_to("/dev/zero")
    elif shape == "garbage":
        path.write_bytes(b"\x00\xff{{not a document")
    else:  # sparse: larger than the bound without using the disk
        path.write_bytes(b'{"entries": [')
        os.truncate(path, limit + 1)
    return path


@pytest.fixture(autouse=True)
def small_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_module, "STATE_READ_LIMIT", LIMIT, raising=False)


@pytest.fixture
def unblock() -> Iterator[Callable[[Path], None]]:
    """Arms a watchdog that releases a reader blocked on a FIFO after 5 s (so an unfixed agent
    fails the test instead of hanging it); the test asserts it never had to."""
    fired: list[Path] = []
    timers: list[threading.Timer] = []

    def release(path: Path) -> None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return
        fired.append(path)
        os.close(fd)

    def arm(path: Path) -> None:
        timer = threading.Timer(5.0, release, (path,))
        timer.daemon = True
        timer.start()
        timers.append(timer)

    yield arm
    for timer in timers:
        timer.cancel()
    assert fired == [], "a read blocked on a FIFO"


def _entry() -> object:
    now = datetime.now(UTC)
    return history_entry(trigger="secret", result="succeeded", started_at=now, finished_at=now)


def _record() -> ApplyRecord:
    now = datetime.now(UTC)
    return ApplyRecord(started_at=now, finished_at=now, duration_seconds=0, result="succeeded")


async def _loads(store: StateStore, name: str) -> object:
    """The loop's read of state file ``name``, and what "absent" looks like for it."""
    readers: dict[str, Callable[[], Awaitable[object]]] = {
        HISTORY: lambda: store.load_history_async(),
        STATUS: lambda: store.load_status_async(),
        INVENTORY: lambda: store.inventory_async(),
        CHANGES: lambda: store.pending_async(),
        LAST_APPLIED_OSC: lambda: store.applied_checksum_async(),
    }
    return await asyncio.wait_for(readers[name](), 10)


ABSENT: dict[str, Callable[[object], bool]] = {
    HISTORY: lambda v: getattr(v, "entries", None) == (),
    STATUS: lambda v: v is None,
    INVENTORY: lambda v: getattr(v, "entries", None) == {},
    CHANGES: lambda v: v is None,
    LAST_APPLIED_OSC: lambda v: v == "",
}


#: every state file with every shape; garbage in last-applied-osc.yaml is not among them: those
#: bytes are what was applied, whatever they are (an unparsable one is planned from scratch)
CASES = [
    (name, shape)
    for name in (HISTORY, STATUS, INVENTORY, CHANGES, LAST_APPLIED_OSC)
    for shape in SHAPES
    if (name, shape) != (LAST_APPLIED_OSC, "garbage")
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "shape"), CASES)
async def test_loop_reads_treat_a_bad_state_file_as_absent_and_set_it_aside(
    tmp_path: Path, name: str, shape: str, unblock: Callable[[Path], None]
) -> None:
    path = plant(tmp_path, name, shape)
    unblock(path)
    store = StateStore(HostFS(tmp_path))
    value = await _loads(store, name)
    assert ABSENT[name](value), value
    assert not os.path.lexists(path), "the bad file is still in the way"
    assert os.path.lexists(str(path) + CORRUPT_SUFFIX)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "shape"), CASES)
def test_sync_reads_treat_a_bad_state_file_as_absent(
    tmp_path: Path, name: str, shape: str, unblock: Callable[[Path], None]
) -> None:
    path = plant(tmp_path, name, shape)
    unblock(path)
    store = StateStore(HostFS(tmp_path))
    readers: dict[str, Callable[[], object]] = {
        HISTORY: store.load_history,
        STATUS: store.load_status,
        INVENTORY: store.inventory,
        CHANGES: store.pending,
        LAST_APPLIED_OSC: store.applied_checksum,
    }
    assert ABSENT[name](readers[name]())
    assert not os.path.lexists(path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", SHAPES)
async def test_history_and_status_writes_go_through_whatever_is_there(
    tmp_path: Path, shape: str, unblock: Callable[[Path], None]
) -> None:
    """A bad file planted after the history was read: the next append still lands."""
    store = StateStore(HostFS(tmp_path))
    await store.append_history_async(_entry())  # type: ignore[arg-type]
    for name in (HISTORY, STATUS):
        path = _state(tmp_path, name)
        if os.path.lexists(path):
            path.unlink()
        unblock(plant(tmp_path, name, shape))
    log = await asyncio.wait_for(store.append_history_async(_entry()), 10)  # type: ignore[arg-type]
    await asyncio.wait_for(store.save_status_async(_record()), 10)
    assert len(log.entries) == 2
    fresh = StateStore(HostFS(tmp_path))
    assert len((await fresh.load_history_async()).entries) == 2
    assert await fresh.load_status_async() is not None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_journal_begins_and_finishes_whatever_is_at_its_progress_file(
    tmp_path: Path, shape: str, unblock: Callable[[Path], None]
) -> None:
    """No journal, but something at its progress file (never read then): beginning a journal
    clears it (a directory set aside), and the apply is not failed by it; nor is finishing."""
    from node_agent.osc.plan import ChangeSet

    store = StateStore(HostFS(tmp_path))
    path = plant(tmp_path, CHANGES_DONE, shape)
    unblock(path)
    assert store.pending() is None
    began = store.begin(ChangeSet(), "sum1")
    store.mark_done()
    assert StateStore(HostFS(tmp_path)).pending() == began
    progress = _state(tmp_path, CHANGES_DONE)
    if os.path.lexists(progress):
        progress.unlink()
    plant(tmp_path, CHANGES_DONE, shape)  # and once more before the journal is dropped
    store.finish()
    assert not os.path.lexists(_state(tmp_path, CHANGES))
    assert not os.path.lexists(_state(tmp_path, CHANGES_DONE))
    assert StateStore(HostFS(tmp_path)).pending() is None


async def test_a_set_aside_file_is_reported_once(tmp_path: Path) -> None:
    plant(tmp_path, HISTORY, "directory")
    store = StateStore(HostFS(tmp_path))
    await store.append_history_async(_entry())  # type: ignore[arg-type]
    (note,) = store.take_set_aside()
    assert HISTORY in note
    assert "directory" in note
    assert CORRUPT_SUFFIX in note
    assert store.take_set_aside() == []


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


@pytest.mark.parametrize("shape", SHAPES)
def test_status_history_answers_at_once_whatever_the_file_is(tmp_path: Path, shape: str) -> None:
    path = plant(tmp_path, HISTORY, shape, limit=REAL_LIMIT)
    cmd = [sys.executable, "-m", "node_agent", "status", "--history", "--root", str(tmp_path)]
    try:
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=20,
            preexec_fn=_limit_memory,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"status --history hung on a {shape} at {path}")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("apply history unreadable:")
    assert HISTORY in line
    assert os.path.lexists(path), "the status command writes nothing"


@pytest.mark.parametrize("shape", ["fifo", "dev-zero", "directory"])
def test_offline_status_answers_at_once_whatever_the_files_are(tmp_path: Path, shape: str) -> None:
    for name in (STATUS, INVENTORY, CHANGES, LAST_APPLIED_OSC):
        plant(tmp_path, name, shape)
    cmd = [sys.executable, "-m", "node_agent", "status", "--json", "--root", str(tmp_path)]
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, capture_output=True, text=True, timeout=20, preexec_fn=_limit_memory
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"status hung on a {shape}")
    assert proc.returncode == 3, proc.stderr  # not running: the offline document
    assert '"running": false' in proc.stdout


def test_the_status_commands_never_read_through_a_symlinked_directory(tmp_path: Path) -> None:
    """``/var/lib`` planted as a symlink to another directory holding state files: ``status``
    and ``status --history`` show them as absent or unreadable, never their contents."""
    from node_agent.commands.show_history import HistoryUnreadable, read_history
    from node_agent.commands.status import offline_document

    outside = tmp_path / "outside" / "gardener-node-agent"
    outside.mkdir(parents=True)
    (tmp_path / "outside-root").mkdir()
    store = StateStore(HostFS(tmp_path / "outside-root"))
    store.append_history(_entry())  # type: ignore[arg-type]
    store.save_last_applied(b"osc: planted\n")
    for path in (tmp_path / "outside-root" / STATE_DIR.lstrip("/")).iterdir():
        path.rename(outside / path.name)
    root = tmp_path / "root"
    (root / "var").mkdir(parents=True)
    (root / "var" / "lib").symlink_to(outside.parent)
    with pytest.raises(HistoryUnreadable, match="symlink"):
        read_history(root)
    assert offline_document(root, None, "test")["osc"]["applied_checksum"] is None
