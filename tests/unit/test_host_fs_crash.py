"""Crash safety of HostFS writes: a child process dies mid-write; the target is old or new.

Each test forks: the child installs a fault hook that calls ``os._exit`` at one named point of
``write_atomic`` (or is SIGKILLed at a random moment), the parent then checks the target holds
exactly the old or the new bytes and that ``cleanup_temp_files`` removes any leftover.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from node_agent.host import fs as fs_module
from node_agent.host.fs import TEMP_PREFIX, HostFS

OLD = b"old content\n" * 1000
NEW = b"NEW" * 50_000

CRASH_EXIT = 42


def _run_child(fs: HostFS, point: str) -> int:
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:

            def crash(name: str) -> None:
                if name == point:
                    os._exit(CRASH_EXIT)

            fs_module._fault_point = crash
            fs.write_atomic("/etc/target.conf", NEW, 0o600)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "etc").iterdir() if p.name.startswith(TEMP_PREFIX))


@pytest.mark.parametrize(
    ("point", "expect_new", "expect_temp"),
    [
        ("temp-created", False, True),
        ("temp-written", False, True),
        ("after-fsync", False, True),
        ("before-rename", False, True),
        ("after-rename", True, False),
    ],
)
def test_crash_at_each_point_leaves_old_or_new(
    tmp_path: Path, point: str, expect_new: bool, expect_temp: bool
) -> None:
    fs = HostFS(tmp_path)
    fs.write_atomic("/etc/target.conf", OLD, 0o644)
    assert _run_child(fs, point) == CRASH_EXIT
    target = tmp_path / "etc/target.conf"
    assert target.read_bytes() == (NEW if expect_new else OLD)
    assert (os.stat(target).st_mode & 0o7777) == (0o600 if expect_new else 0o644)
    assert bool(_leftovers(tmp_path)) == expect_temp
    removed = fs.cleanup_temp_files(["/etc"])
    assert len(removed) == int(expect_temp)
    assert _leftovers(tmp_path) == []
    # after cleanup, the next attempt converges
    assert bool(fs.write_atomic("/etc/target.conf", NEW, 0o600)) is not expect_new
    assert target.read_bytes() == NEW


def test_crash_before_first_write_leaves_no_target(tmp_path: Path) -> None:
    fs = HostFS(tmp_path)
    fs.ensure_dir("/etc")
    assert _run_child(fs, "before-rename") == CRASH_EXIT
    assert not (tmp_path / "etc/target.conf").exists()
    assert len(fs.cleanup_temp_files(["/etc"])) == 1


def test_no_fault_completes(tmp_path: Path) -> None:
    fs = HostFS(tmp_path)
    assert _run_child(fs, "never") == 0
    assert (tmp_path / "etc/target.conf").read_bytes() == NEW


def test_sigkill_at_random_moments_never_leaves_a_partial_file(tmp_path: Path) -> None:
    """A child rewrites the file in a loop, alternating two big contents; kill it at random."""
    fs = HostFS(tmp_path)
    a, b = b"a" * (1 << 20), b"b" * (1 << 20) + b"tail"
    fs.write_atomic("/etc/target.conf", a, 0o600)
    rng = random.Random(1234)
    for _ in range(8):
        pid = os.fork()
        if pid == 0:
            try:
                while True:
                    fs.write_atomic("/etc/target.conf", b, 0o600)
                    fs.write_atomic("/etc/target.conf", a, 0o644)
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.001, 0.05))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        content = (tmp_path / "etc/target.conf").read_bytes()
        assert content in (a, b)
        fs.cleanup_temp_files(["/etc"])
        assert _leftovers(tmp_path) == []
