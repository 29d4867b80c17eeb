"""HostFS on a real read-only bind mount: removing what is already gone succeeds.

On a read-only mount ``unlinkat``/``rmdir`` fail with EROFS even for a name that does not exist
(the kernel checks write access to the mount before looking the name up), so a removal that
did not look first could never succeed there, and an apply that only drops a file that was
never written would fail for good. Needs root for ``mount``.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_agent.base.errors import HostIOError
from node_agent.host.fs import HostFS


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


@pytest.fixture
def ro_root(tmp_path: Path) -> Iterator[Path]:
    """A root whose ``/srv/ro`` (holding a file, a non-empty and an empty directory) and
    ``/srv/empty-ro`` (empty) are read-only bind mounts of themselves."""
    assert os.geteuid() == 0, "read-only bind mounts need root"
    root = tmp_path / "root"
    ro = root / "srv/ro"
    (ro / "sub").mkdir(parents=True)
    (ro / "empty").mkdir()
    (ro / "old").write_bytes(b"kept")
    (ro / "sub/x").write_bytes(b"")
    (root / "srv/empty-ro").mkdir()
    mounted: list[Path] = []
    try:
        for path in (ro, root / "srv/empty-ro"):
            _mount("--bind", str(path), str(path))
            mounted.append(path)
            _mount("-o", "remount,bind,ro", str(path))
        with pytest.raises(OSError, match="Read-only file system") as probe:
            (ro / "probe").write_bytes(b"")
        assert probe.value.errno == errno.EROFS
        yield root
    finally:
        for path in reversed(mounted):
            subprocess.run(["umount", str(path)], check=True)


def test_removing_what_was_never_written_succeeds(ro_root: Path) -> None:
    fs = HostFS(ro_root)
    assert fs.remove("/srv/ro/new") is False
    assert fs.remove("/srv/ro/missing/dir/new") is False
    assert fs.remove("/srv/ro/old/new") is False  # a file where a directory would be
    assert fs.remove_dir_if_empty("/srv/ro/missing") is False
    assert fs.remove_dir_if_empty("/srv/ro/old") is False  # not a directory
    assert fs.remove_dir_if_empty("/srv/ro/sub") is False  # not empty
    assert fs.remove_dir_if_empty("/srv/ro") is False  # a non-empty mount point
    assert fs.remove_dir_if_empty("/srv/empty-ro") is False  # an empty one, in use
    assert sorted(os.listdir(ro_root / "srv/ro")) == ["empty", "old", "sub"]


def test_what_exists_on_a_read_only_mount_still_fails_loudly(ro_root: Path) -> None:
    fs = HostFS(ro_root)
    for call in (
        lambda: fs.remove("/srv/ro/old"),
        lambda: fs.remove_dir_if_empty("/srv/ro/empty"),
        lambda: fs.write_atomic("/srv/ro/new", b"x", 0o600),
        lambda: fs.write_atomic("/srv/ro/a/b/new", b"x", 0o600),
        lambda: fs.chmod("/srv/ro/old", 0o600),
    ):
        with pytest.raises(HostIOError) as err:
            call()
        assert err.value.errno == errno.EROFS
    assert (ro_root / "srv/ro/old").read_bytes() == b"kept"
    assert (ro_root / "srv/ro/empty").is_dir()


def test_checks_and_reads_need_no_write_access(ro_root: Path) -> None:
    fs = HostFS(ro_root)
    fs.check_target("/srv/ro/new")
    fs.check_target("/srv/ro/old")
    fs.check_target("/srv/ro/a/b/new")
    assert fs.read("/srv/ro/old") == b"kept"
    assert fs.read("/srv/ro/new") is None
    assert not fs.chmod("/srv/ro/old", os.stat(ro_root / "srv/ro/old").st_mode & 0o7777)
    assert fs.cleanup_temp_files(["/srv/ro", "/srv/ro/sub"]) == []
