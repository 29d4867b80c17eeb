"""The apply history: the model, the last 50 kept in the state directory (atomically, an
unreadable file set aside), reading another agent version's file, and the rendering."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import unicodedata
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from structlog.testing import capture_logs

from node_agent.commands.show_history import history_document, render_history
from node_agent.host.documents import ItemFailure
from node_agent.host.fs import TEMP_PREFIX, HostFS
from node_agent.host.history import (
    HISTORY,
    HISTORY_LIMIT,
    ITEMS_LIMIT,
    HistoryEntry,
    HistoryLog,
    HistoryRollback,
    history_entry,
)
from node_agent.host.state import CORRUPT_SUFFIX, STATE_DIR, StateStore

pytestmark = pytest.mark.usefixtures("virtual_clock")

T0 = datetime(2026, 11, 20, 10, 0, 0, tzinfo=UTC)
A, B = "a" * 64, "b" * 64
REPO = Path(__file__).resolve().parents[2]


def _entry(n: int, **extra: object) -> HistoryEntry:
    fields: dict[str, object] = {
        "trigger": "secret",
        "result": "succeeded",
        "started_at": T0 + timedelta(minutes=n),
        "finished_at": T0 + timedelta(minutes=n, seconds=2),
        "checksum_to": f"{n:064x}",
    }
    fields.update(extra)
    return history_entry(**fields)  # type: ignore[arg-type]


def _file(root: Path) -> Path:
    return root / STATE_DIR.lstrip("/") / HISTORY


def _rolled_back() -> HistoryEntry:
    return history_entry(
        trigger="secret",
        result="rolled-back",
        started_at=T0,
        finished_at=T0 + timedelta(seconds=95),
        checksum_from=A,
        checksum_to=B,
        items_changed=["/var/lib/kubelet/config/kubelet", "kubelet.service"],
        restarted_units=["kubelet.service"],
        failures=[ItemFailure(kind="command", item="kubelet.service", error="restart: failed")],
        rollback=HistoryRollback(
            unit="kubelet.service",
            evidence="kubelet.service: Main process exited, status=1/FAILURE\nE1120 bad flag",
            from_checksum=B,
            to_checksum=A,
        ),
        error="kubelet.service did not come up",
    )


def test_round_trip_and_derived_fields() -> None:
    entry = _rolled_back()
    assert entry.duration_seconds == 95
    assert entry.items_changed_count == 2
    again = HistoryEntry.model_validate_json(entry.model_dump_json())
    assert again == entry
    log = HistoryLog(entries=(entry,))
    assert HistoryLog.model_validate_json(log.to_json()) == log


def test_naive_times_and_unknown_trigger_are_refused() -> None:
    try:
        history_entry(trigger="secret", result="succeeded", started_at=datetime(2026, 1, 1))
    except ValidationError:
        pass
    else:
        raise AssertionError("a naive datetime was accepted")
    try:
        _entry(1, trigger="cron")
    except ValidationError:
        pass
    else:
        raise AssertionError("an unknown trigger was accepted")


def test_many_changed_items_are_counted_and_the_first_named() -> None:
    names = [f"/etc/f{i}" for i in range(ITEMS_LIMIT + 30)]
    entry = _entry(1, items_changed=names)
    assert entry.items_changed == tuple(names[:ITEMS_LIMIT])
    assert entry.items_changed_count == ITEMS_LIMIT + 30
    assert entry.items_not_named == 30


def test_fields_of_another_version_are_ignored_and_unreadable_entries_left_out() -> None:
    good = _entry(1).model_dump(mode="json")
    newer = dict(good, trigger="scheduled", checksum_to="c" * 64)  # a trigger we do not know
    extra = dict(good, checksum_to="d" * 64, node_uptime=17, rollback={"unit": "x", "why": 3})
    doc = {"version": 2, "entries": [good, newer, extra], "compacted": True}
    log = HistoryLog.model_validate_json(json.dumps(doc))
    assert [e.checksum_to for e in log.entries] == [f"{1:064x}", "d" * 64]
    assert log.entries[1].rollback == HistoryRollback(unit="x")
    # an older agent's entry: no duration, no count, no rollback/error fields
    older = {k: v for k, v in good.items() if k not in ("duration_seconds", "items_changed_count")}
    older["items_changed"] = ["/etc/a"]
    assert HistoryEntry.model_validate(older).duration_seconds == 2
    assert HistoryEntry.model_validate(older).items_changed_count == 1


async def test_append_keeps_the_newest_50_in_a_0600_file(tmp_path: Path) -> None:
    store = StateStore(HostFS(tmp_path))
    for n in range(HISTORY_LIMIT + 7):
        log = await store.append_history_async(_entry(n))
    assert len(log.entries) == HISTORY_LIMIT
    path = _file(tmp_path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    on_disk = StateStore(HostFS(tmp_path)).load_history()
    assert [e.checksum_to for e in on_disk.entries] == [f"{n:064x}" for n in range(7, 57)]
    assert on_disk == log
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(TEMP_PREFIX)] == []


async def test_the_sync_and_async_paths_share_one_history(tmp_path: Path) -> None:
    store = StateStore(HostFS(tmp_path))
    store.append_history(_entry(1))
    await store.append_history_async(_entry(2))
    fresh = StateStore(HostFS(tmp_path))
    assert [e.started_at for e in (await fresh.load_history_async()).entries] == [
        _entry(1).started_at,
        _entry(2).started_at,
    ]


async def test_an_unreadable_file_is_set_aside_and_history_starts_empty(tmp_path: Path) -> None:
    path = _file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(b'{"entries": "truncated')
    store = StateStore(HostFS(tmp_path))
    with capture_logs() as logs:
        assert (await store.load_history_async()).entries == ()
    assert any(e["event"] == "unreadable state file moved aside and ignored" for e in logs)
    aside = path.with_name(HISTORY + CORRUPT_SUFFIX)
    assert aside.read_bytes() == b'{"entries": "truncated'
    assert not path.exists()
    log = await store.append_history_async(_entry(1))
    assert len(log.entries) == 1
    assert StateStore(HostFS(tmp_path)).load_history() == log


async def test_a_failed_write_is_logged_and_kept_for_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = StateStore(HostFS(tmp_path))
    await store.append_history_async(_entry(1))

    def no_space(*_args: object, **_kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "rename", no_space)
    with capture_logs() as logs:
        log = await store.append_history_async(_entry(2))
    assert len(log.entries) == 2
    assert any(e["event"] == "apply history not written" for e in logs)
    monkeypatch.undo()
    await store.append_history_async(_entry(3))
    on_disk = StateStore(HostFS(tmp_path)).load_history()
    assert [e.started_at for e in on_disk.entries] == [_entry(n).started_at for n in (1, 2, 3)]


@settings(max_examples=60, deadline=None)
@given(
    st.integers(min_value=0, max_value=3 * HISTORY_LIMIT).flatmap(
        lambda n: st.lists(st.integers(min_value=0, max_value=10**6), min_size=n, max_size=n)
    )
)
def test_any_appends_keep_at_most_50_in_order_the_tail(values: list[int]) -> None:
    log = HistoryLog()
    for v in values:
        log = log.appended(_entry(0, checksum_to=f"{v:064x}"))
        assert len(log.entries) <= HISTORY_LIMIT
    expected = [f"{v:064x}" for v in values[-HISTORY_LIMIT:]]
    assert [e.checksum_to for e in log.entries] == expected
    assert [e.checksum_to for e in log.newest_first()] == expected[::-1]
    assert HistoryLog.model_validate_json(log.to_json()) == log


CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from datetime import UTC, datetime
    from node_agent.host.fs import HostFS
    from node_agent.host.history import history_entry
    from node_agent.host.state import StateStore

    async def main() -> None:
        store = StateStore(HostFS(sys.argv[1]))
        entries = (await store.load_history_async()).entries
        n = int(entries[-1].checksum_to, 16) + 1 if entries else 0
        print("ready", flush=True)
        while True:
            entry = history_entry(trigger="drift", result="succeeded",
                started_at=datetime.now(UTC), checksum_to=f"{n:064x}",
                items_changed=[f"/etc/file-{i}.conf" for i in range(40)])
            await store.append_history_async(entry)
            n += 1

    asyncio.run(main())
    """
)


def test_kill_9_while_appending_leaves_the_old_or_the_new_file(tmp_path: Path) -> None:
    rng = random.Random(7)
    seen = -1
    for _ in range(6):
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tmp_path)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        time.sleep(rng.uniform(0.05, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        raw = _file(tmp_path).read_bytes()
        log = HistoryLog.model_validate_json(raw)  # whole: never a torn file
        numbers = [int(e.checksum_to or "", 16) for e in log.entries]
        assert len(json.loads(raw)["entries"]) == len(numbers) <= HISTORY_LIMIT
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
        assert numbers[-1] >= seen  # never older than what a previous round left
        seen = numbers[-1]
        StateStore(HostFS(tmp_path)).cleanup_temp_files()
        leftovers = [p for p in _file(tmp_path).parent.iterdir() if p.name.startswith(TEMP_PREFIX)]
        assert leftovers == []
    assert seen > HISTORY_LIMIT  # the children really appended, beyond the cap


# --- rendering ---------------------------------------------------------------------------------


@pytest.fixture
def utc_local_time(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.usefixtures("utc_local_time")
def test_text_is_newest_first_with_every_fact() -> None:
    log = HistoryLog().appended(_entry(0, items_changed=[f"/etc/f{i}" for i in range(11)]))
    log = log.appended(_rolled_back().model_copy(update={"started_at": T0 + timedelta(hours=1)}))
    annotation = _entry(
        120,
        trigger="annotation",
        result="failed",
        checksum_from=A,
        checksum_to=A,
        restarted_units=["a.service"],
        failures=[ItemFailure(kind="command", item="b.service", error="Unit b.service not found.")],
        error="1 of 2 restarts failed",
    )
    log = log.appended(annotation)
    text = render_history(log, now=T0 + timedelta(hours=3))
    lines = text.splitlines()
    assert lines[0] == "Apply history (3 of the last 50, newest first):"
    assert lines[1] == (
        "2026-11-20T12:00:00+00:00 (1h00m ago)  annotation aaaaaaaaaaaa (same OSC)  failed in 2.0s"
    )
    assert lines[2] == "  restarted (1): a.service"
    assert lines[3] == "  failed command b.service: Unit b.service not found."
    assert lines[4] == "  error: 1 of 2 restarts failed"
    assert lines[5].startswith("2026-11-20T11:00:00+00:00 (2h00m ago)  secret     ")
    assert lines[5].endswith("aaaaaaaaaaaa -> bbbbbbbbbbbb  rolled-back in 1m35s")
    assert "  changed (2): /var/lib/kubelet/config/kubelet, kubelet.service" in lines
    assert "  rolled back because of kubelet.service: bbbbbbbbbbbb -> aaaaaaaaaaaa" in lines
    assert "    E1120 bad flag" in lines
    first = lines.index(next(line for line in lines if line.startswith("2026-11-20T10:00:00")))
    assert "none -> 000000000000  succeeded in 2.0s" in lines[first]
    assert lines[first + 1] == (
        "  changed (11): /etc/f0, /etc/f1, /etc/f2, /etc/f3, /etc/f4, /etc/f5, /etc/f6, "
        "/etc/f7, ... and 3 more"
    )
    assert render_history(HistoryLog()) == "No applies recorded yet.\n"


def test_json_is_the_stored_entries_newest_first() -> None:
    log = HistoryLog().appended(_entry(1)).appended(_rolled_back())
    doc = history_document(log)
    assert list(doc) == ["history"]
    assert doc["history"] == [e.model_dump(mode="json") for e in reversed(log.entries)]
    assert doc["history"][0]["rollback"]["evidence"].endswith("E1120 bad flag")
    stored = json.loads(log.to_json())["entries"]
    assert doc["history"] == stored[::-1]


def test_control_characters_from_the_file_are_escaped_in_the_text() -> None:
    """A stored error or unit name with terminal escapes (ESC, CR, bidi overrides) must not
    drive the operator's terminal: they are shown as escapes."""
    entry = history_entry(
        trigger="secret",
        result="failed",
        started_at=T0,
        finished_at=T0 + timedelta(seconds=1),
        checksum_to=B,
        items_changed=["/etc/\x1b[2Jwiped"],
        restarted_units=["evil\x07.service"],
        failures=[ItemFailure(kind="command", item="x\x1b]0;title\x07", error="\x1b[31mred\r")],
        rollback=HistoryRollback(unit="u\x9b.service", evidence="line\x1b[1A\nabc\u202edef"),
        error="boom\x1b[0m\x00",
    )
    text = render_history(HistoryLog(entries=(entry,)), now=T0)
    for line in text.splitlines():
        bad = [ch for ch in line if unicodedata.category(ch) in ("Cc", "Cf")]
        assert bad == [], line
    assert "\\x1b[2Jwiped" in text
    assert "evil\\x07.service" in text
    assert "\\x1b[31mred" in text
    assert "u\\x9b.service" in text
    assert "abc\\u202edef" in text
    assert "boom\\x1b[0m\\x00" in text
