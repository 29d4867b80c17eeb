"""The self-update guard script, run by the real /bin/sh on files in a temporary directory, and
the agent's side of it (ready, record, report)."""

from __future__ import annotations

import hashlib
import shlex
import subprocess
from pathlib import Path

import pytest

from node_agent.base import layout
from node_agent.host import selfupdate
from node_agent.host.fs import HostFS

OLD = b"old agent\n"
NEW = b"new agent that crashes\n"


def guard(tmp_path: Path) -> tuple[Path, Path]:
    """The script for state in ``tmp_path/state`` and the binary ``tmp_path/bin/agent``."""
    state = tmp_path / "state"
    state.mkdir()
    script = tmp_path / "guard.sh"
    script.write_bytes(selfupdate.guard_script(str(state)))
    (tmp_path / "bin").mkdir()
    return script, tmp_path / "bin" / "agent"


def start(script: Path, binary: Path) -> str:
    """What systemd does before each start of the unit."""
    done = subprocess.run(
        ["/bin/sh", str(script), str(binary)], capture_output=True, text=True, check=True
    )
    return done.stdout


def test_the_fourth_start_without_a_ready_agent_puts_the_previous_binary_back(
    tmp_path: Path,
) -> None:
    script, binary = guard(tmp_path)
    binary.write_bytes(NEW)
    binary.with_name("agent.previous").write_bytes(OLD)
    outputs = [start(script, binary) for _ in range(3)]
    assert binary.read_bytes() == NEW  # three failed starts: still the new one
    assert outputs == ["", "", ""]
    said = start(script, binary)
    assert "was not ready after 3 starts; the previous binary is back in place" in said
    assert binary.read_bytes() == OLD
    record = (tmp_path / "state" / layout.SELF_UPDATE_FALLBACK).read_text()
    assert f"failed={hashlib.sha256(NEW).hexdigest()}" in record
    assert f"restored={hashlib.sha256(OLD).hexdigest()}" in record
    assert "starts=3" in record
    # the previous binary fails too (e.g. a config it cannot read): no flip-flop
    for _ in range(6):
        start(script, binary)
    assert binary.read_bytes() == OLD


def test_a_binary_that_was_ready_once_or_no_previous_is_never_replaced(tmp_path: Path) -> None:
    script, binary = guard(tmp_path)
    binary.write_bytes(NEW)
    for _ in range(5):
        start(script, binary)  # no .previous: first install
    assert binary.read_bytes() == NEW
    binary.with_name("agent.previous").write_bytes(OLD)
    (tmp_path / "state" / layout.SELF_UPDATE_GOOD).write_text(hashlib.sha256(NEW).hexdigest())
    for _ in range(5):
        start(script, binary)  # it ran before: its trouble is not the update's
    assert binary.read_bytes() == NEW
    assert not (tmp_path / "state" / layout.SELF_UPDATE_FALLBACK).exists()


def test_garbage_in_the_counter_counts_as_zero(tmp_path: Path) -> None:
    script, binary = guard(tmp_path)
    binary.write_bytes(NEW)
    binary.with_name("agent.previous").write_bytes(OLD)
    (tmp_path / "state" / layout.SELF_UPDATE_STARTS).write_text("lots\n")
    start(script, binary)
    assert (tmp_path / "state" / layout.SELF_UPDATE_STARTS).read_text() == "1\n"


def test_ready_resets_the_count_and_a_later_good_binary_clears_the_record(tmp_path: Path) -> None:
    fs = HostFS(tmp_path)
    fs.write_atomic("/opt/bin/agent", OLD, 0o755)
    fs.write_atomic(
        selfupdate.RECORD_FILE,
        (
            "binary=/opt/bin/agent\n"
            f"failed={hashlib.sha256(NEW).hexdigest()}\n"
            f"restored={hashlib.sha256(OLD).hexdigest()}\n"
            "starts=3\nat=2026-01-01T00:00:00Z\n"
        ).encode(),
        0o644,
    )
    fs.write_atomic(selfupdate.STARTS_FILE, b"2\n", 0o644)
    record = selfupdate.reached_ready(fs, "/opt/bin/agent")  # the previous one, back
    assert record is not None
    assert record.starts == 3
    assert not record.reported
    assert "was not ready after 3 starts in a row" in record.message()
    assert fs.read(selfupdate.STARTS_FILE) == b"0\n"
    selfupdate.mark_reported(fs, record, "2026-01-01T00:01:00Z")
    again = selfupdate.read_fallback(fs)
    assert again is not None
    assert again.reported == "2026-01-01T00:01:00Z"
    fs.write_atomic("/opt/bin/agent", b"a later, good update\n", 0o755)
    assert selfupdate.reached_ready(fs, "/opt/bin/agent") is None
    assert selfupdate.read_fallback(fs) is None


def test_install_writes_the_drop_in_once(tmp_path: Path) -> None:
    fs = HostFS(tmp_path)
    assert selfupdate.install(fs, "gardener-node-agent.service", "/opt/bin/gardener-node-agent")
    assert not selfupdate.install(fs, "gardener-node-agent.service", "/opt/bin/gardener-node-agent")
    text = (
        tmp_path / selfupdate.drop_in_path("gardener-node-agent.service").lstrip("/")
    ).read_text()
    assert (
        "ExecStartPre=-/bin/sh /var/lib/gardener-node-agent/self-update-guard.sh "
        "/opt/bin/gardener-node-agent\n" in text
    )
    script = tmp_path / selfupdate.GUARD_SCRIPT.lstrip("/")
    assert script.stat().st_mode & 0o777 == 0o755


#: counters the guard cannot count on: too big for sh's arithmetic (2^63 and up, a 10 MB
#: number), not a number, or an octal-looking one sh refuses ("08")
UNUSABLE_COUNTERS: dict[str, bytes | None] = {
    "2^63-1": b"9223372036854775807\n",
    "2^63": b"9223372036854775808\n",
    "2^64+5": b"18446744073709551621\n",
    "-1": b"-1\n",
    "abc": b"abc\n",
    "empty": b"",
    "NUL": b"\x00",
    "digit and NUL": b"2\x00\n",
    "08": b"08\n",
    "10 MB of digits": b"7" * (10 * 1024 * 1024),
    "missing": None,
}


def exec_start_pre(binary: Path, script: Path) -> list[str]:
    """The drop-in's ``ExecStartPre=`` command for ``binary``, exactly as systemd runs it (its
    ``-`` prefix only tells systemd to ignore a failure), with the guard script at ``script``
    in place of its host path."""
    (line,) = [
        line
        for line in selfupdate.drop_in(str(binary)).decode().splitlines()
        if line.startswith("ExecStartPre=")
    ]
    argv = shlex.split(line.removeprefix("ExecStartPre=").removeprefix("-"))
    assert argv == ["/bin/sh", selfupdate.GUARD_SCRIPT, str(binary)]
    return [argv[0], str(script), argv[2]]


@pytest.mark.parametrize("content", UNUSABLE_COUNTERS.values(), ids=UNUSABLE_COUNTERS.keys())
def test_a_counter_the_guard_cannot_use_starts_again_from_one(
    tmp_path: Path, content: bytes | None
) -> None:
    """Never "no guard": an unreadable, huge or broken count is the first start of a new count,
    and the fourth start without a ready agent still puts the previous binary back."""
    script, binary = guard(tmp_path)
    binary.write_bytes(NEW)
    binary.with_name("agent.previous").write_bytes(OLD)
    counter = tmp_path / "state" / layout.SELF_UPDATE_STARTS
    if content is not None:
        counter.write_bytes(content)
    command = exec_start_pre(binary, script)
    first = subprocess.run(command, capture_output=True, timeout=60, check=False)
    assert (first.returncode, first.stderr) == (0, b"")
    assert counter.read_bytes() == b"1\n"
    for _ in range(3):
        subprocess.run(command, capture_output=True, timeout=60, check=True)
    assert binary.read_bytes() == OLD
    assert "starts=3\n" in (tmp_path / "state" / layout.SELF_UPDATE_FALLBACK).read_text()


@pytest.mark.parametrize("content", UNUSABLE_COUNTERS.values(), ids=UNUSABLE_COUNTERS.keys())
def test_a_ready_agent_sets_any_counter_back_to_zero(tmp_path: Path, content: bytes | None) -> None:
    """The agent's side never parses the count: once ready it writes 0 over whatever is there."""
    fs = HostFS(tmp_path)
    fs.write_atomic("/opt/bin/agent", OLD, 0o755)
    if content is not None:
        fs.write_atomic(selfupdate.STARTS_FILE, content, 0o644)
    assert selfupdate.reached_ready(fs, "/opt/bin/agent") is None
    assert fs.read(selfupdate.STARTS_FILE) == b"0\n"


def test_a_usable_counter_goes_on_counting(tmp_path: Path) -> None:
    script, binary = guard(tmp_path)
    binary.write_bytes(NEW)
    counter = tmp_path / "state" / layout.SELF_UPDATE_STARTS
    for before, after in ((b"0\n", b"1\n"), (b"2", b"3\n"), (b"999999998\n", b"999999999\n")):
        counter.write_bytes(before)
        subprocess.run(exec_start_pre(binary, script), capture_output=True, check=True)
        assert counter.read_bytes() == after
