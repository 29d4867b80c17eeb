"""The removals of what the agent wrote: only the bytes it recorded, never through a symlink."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from node_agent.base.errors import HostIOError, UnsafePathError
from node_agent.host.fs import HostFS, Removed


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def fs(tmp_path: Path) -> HostFS:
    (tmp_path / "node/etc").mkdir(parents=True)
    return HostFS(tmp_path / "node")


def test_remove_written_removes_only_the_recorded_bytes(fs: HostFS) -> None:
    fs.write_atomic("/etc/a", b"mine", 0o644)
    assert fs.remove_written("/etc/a", sha(b"other")) is Removed.OTHER_CONTENT
    assert (fs.root / "etc/a").read_bytes() == b"mine"
    assert fs.remove_written("/etc/a", sha(b"mine").upper()) is Removed.REMOVED
    assert not (fs.root / "etc/a").exists()
    assert fs.remove_written("/etc/a", sha(b"mine")) is Removed.ABSENT
    assert fs.remove_written("/etc/missing/a", sha(b"mine")) is Removed.ABSENT


def test_remove_written_leaves_a_symlink_a_fifo_and_what_they_point_to(
    fs: HostFS, tmp_path: Path
) -> None:
    (tmp_path / "target").write_bytes(b"mine")
    (fs.root / "etc/link").symlink_to(tmp_path / "target")
    assert fs.remove_written("/etc/link", sha(b"mine")) is Removed.SYMLINK
    assert (fs.root / "etc/link").is_symlink()
    os.mkfifo(fs.root / "etc/fifo")
    assert fs.remove_written("/etc/fifo", sha(b"")) is Removed.SPECIAL
    assert (fs.root / "etc/fifo").exists()


def test_remove_written_refuses_a_directory_and_a_symlinked_parent(
    fs: HostFS, tmp_path: Path
) -> None:
    (fs.root / "etc/dir").mkdir()
    with pytest.raises(HostIOError, match="Is a directory"):
        fs.remove_written("/etc/dir", sha(b""))
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside/a").write_bytes(b"mine")
    (fs.root / "etc/linked").symlink_to(tmp_path / "outside")
    with pytest.raises(UnsafePathError, match="symlink"):
        fs.remove_written("/etc/linked/a", sha(b"mine"))
    assert (tmp_path / "outside/a").exists()


def test_remove_tree_never_follows_a_symlink(fs: HostFS, tmp_path: Path) -> None:
    (tmp_path / "outside/deep").mkdir(parents=True)
    (tmp_path / "outside/deep/f").write_bytes(b"keep")
    tree = fs.root / "var/cache/node-agent"
    (tree / "k1").mkdir(parents=True)
    (tree / "k1/f").write_bytes(b"copy")
    (tree / "k1/escape").symlink_to(tmp_path / "outside")
    assert fs.remove_tree("/var/cache/node-agent")
    assert not tree.exists()
    assert (tmp_path / "outside/deep/f").exists()
    assert not fs.remove_tree("/var/cache/node-agent")

    (fs.root / "var/cache/node-agent").symlink_to(tmp_path / "outside")
    with pytest.raises(UnsafePathError, match="is a symlink"):
        fs.remove_tree("/var/cache/node-agent")
    (fs.root / "var/cache/node-agent").unlink()
    (fs.root / "var/cache").rmdir()
    (fs.root / "var/cache").symlink_to(tmp_path / "outside")
    with pytest.raises(UnsafePathError, match="symlink"):
        fs.remove_tree("/var/cache/deep")
    assert (tmp_path / "outside/deep/f").exists()
