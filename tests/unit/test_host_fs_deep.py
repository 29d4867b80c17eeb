"""HostFS on paths thousands of components deep: a constant number of descriptors whatever the
depth, and a creating operation that fails leaves none of the directories it created behind."""

from __future__ import annotations

import errno
import os
import resource
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_agent.base.errors import HostIOError
from node_agent.host import fs as fs_module
from node_agent.host.fs import TEMP_PREFIX, HostFS

DEPTH = 3000  # the old walk held one fd per component and failed at about 1,017
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def deep(name: str, depth: int = DEPTH) -> str:
    return "/" + "/".join([name] * depth)


def open_fds() -> list[int]:
    return sorted(int(n) for n in os.listdir("/proc/self/fd"))


def remove_chain(top: Path) -> None:
    """Remove a tree that is a single chain of directories, at any depth, with one fd at a time
    (shutil.rmtree recurses once per level and cannot)."""
    fd = os.open(top, _DIR)
    names: list[str] = []
    while True:
        sub = None
        for name in os.listdir(fd):
            if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                assert sub is None, "not a chain"
                sub = name
            else:
                os.unlink(name, dir_fd=fd)
        if sub is None:
            break
        child = os.open(sub, _DIR, dir_fd=fd)
        os.close(fd)
        fd = child
        names.append(sub)
    while names:
        parent = os.open("..", _DIR, dir_fd=fd)
        os.close(fd)
        fd = parent
        os.rmdir(names.pop(), dir_fd=fd)
    os.close(fd)


def chain_depth(top: Path) -> int:
    """How many directories deep the chain under ``top`` goes."""
    fd = os.open(top, _DIR)
    depth = 0
    try:
        while True:
            subs = [
                n
                for n in os.listdir(fd)
                if stat.S_ISDIR(os.stat(n, dir_fd=fd, follow_symlinks=False).st_mode)
            ]
            if not subs:
                return depth
            child = os.open(subs[0], _DIR, dir_fd=fd)
            os.close(fd)
            fd = child
            depth += 1
    finally:
        os.close(fd)


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "root"
    path.mkdir()
    yield path
    for name in ("d", "e"):  # the deep chains; pytest removes the shallow rest
        if (path / name).is_dir():
            remove_chain(path / name)


def test_deep_path_under_a_low_descriptor_limit(root: Path) -> None:
    """In a child whose descriptor limit is a few above what is already open, every operation
    on a 3,000-component path works (the old walk needed 3,000 descriptors)."""
    fs = HostFS(root)
    target = deep("d") + "/f"
    report = root.parent / "child-error"
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:
            _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_fds()[-1] + 1 + 8, hard))
            fs.check_target(target)
            assert fs.write_atomic(target, b"deep", 0o640)
            assert fs.read(target) == b"deep"
            assert fs.stat_matches(target, mode=0o640)
            assert not fs.chmod(target, 0o640)
            fs.check_target(target)
            assert fs.list_dir(deep("d")) == ["f"]
            assert fs.resolve(target) == root.joinpath(*target.strip("/").split("/"))
            assert fs.cleanup_temp_files([deep("d")]) == []
            assert fs.write_atomic(target, b"deeper", 0o600)
            code = 0
        except BaseException as exc:
            report.write_text(f"{type(exc).__name__}: {str(exc)[-200:]}")
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, report.read_text()
    assert chain_depth(root) == DEPTH
    assert HostFS(root).read(target) == b"deeper"


def test_the_low_limit_is_real(root: Path) -> None:
    """The same limit does stop something that needs one descriptor per component, so the test
    above would fail for a walk that held one per level."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_fds()[-1] + 1 + 8, hard))
            held = []
            try:
                for _ in range(DEPTH):
                    held.append(os.open(root, _DIR))
            except OSError as exc:
                code = 3 if exc.errno == errno.EMFILE else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3


def test_no_descriptor_is_leaked(root: Path) -> None:
    fs = HostFS(root)
    before = open_fds()
    target = deep("d") + "/f"
    fs.write_atomic(target, b"x", 0o600)
    fs.read(target)
    fs.check_target(target)
    assert fs.remove(target)
    assert fs.read(deep("e") + "/f") is None
    with pytest.raises(HostIOError):
        fs.write_atomic(deep("d", 10) + "/" + "x" * 300 + "/f", b"x", 0o600)
    assert open_fds() == before


def test_a_deep_write_failing_part_way_leaves_nothing_behind(root: Path) -> None:
    fs = HostFS(root)
    path = deep("d", 2000) + "/" + "x" * 300 + deep("e", 10) + "/f"  # one name too long
    with pytest.raises(HostIOError, match="File name too long") as err:
        fs.write_atomic(path, b"x", 0o600)
    assert err.value.errno == errno.ENAMETOOLONG
    assert list(root.iterdir()) == []


def test_only_directories_created_by_the_failing_call_are_removed(root: Path) -> None:
    fs = HostFS(root)
    fs.ensure_dir("/keep/this")
    fs.write_atomic("/keep/other/f", b"x", 0o600)
    with pytest.raises(HostIOError):
        fs.write_atomic("/keep/this/new/a/b/" + "x" * 300 + "/f", b"x", 0o600)
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == [
        "keep",
        "keep/other",
        "keep/other/f",
        "keep/this",
    ]
    with pytest.raises(HostIOError):
        fs.ensure_dir("/keep/this/new/" + "x" * 300)
    assert list((root / "keep/this").iterdir()) == []


def test_a_write_failing_after_the_walk_removes_the_parents_it_created(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = HostFS(root)
    fs.ensure_dir("/etc")

    def full(name: str) -> None:
        if name == "temp-written":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fs_module, "_fault_point", full)
    with pytest.raises(HostIOError, match="No space left") as err:
        fs.write_atomic("/etc/new/deeper/f", b"x", 0o600)
    assert err.value.errno == errno.ENOSPC
    assert list((root / "etc").iterdir()) == []  # neither the temp file nor new/deeper
    with pytest.raises(HostIOError):
        fs.write_atomic("/etc/f", b"x", 0o600)
    assert (root / "etc").is_dir()  # existed before: kept
    monkeypatch.undo()
    assert fs.write_atomic("/etc/new/deeper/f", b"x", 0o600)


def test_rollback_stops_at_a_directory_that_gained_entries(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A created directory someone else put something into meanwhile is not removed, and
    neither is anything above it."""
    fs = HostFS(root)

    def intruder(name: str) -> None:
        if name == "temp-created":
            (root / "a/b/theirs").write_bytes(b"")
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(fs_module, "_fault_point", intruder)
    with pytest.raises(HostIOError):
        fs.write_atomic("/a/b/c/f", b"x", 0o600)
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == [
        "a",
        "a/b",
        "a/b/theirs",
    ]
    assert not [p for p in root.rglob("*") if p.name.startswith(TEMP_PREFIX)]


def test_dotdot_in_a_system_link_target_reopens_from_the_root(root: Path) -> None:
    (root / "usr/lib").mkdir(parents=True)
    (root / "usr/lib64").mkdir()
    (root / "lib").symlink_to("usr/lib/../lib64")
    fs = HostFS(root, follow_system_symlinks=True)
    assert fs.write_atomic("/lib/x/f", b"x", 0o600)
    assert (root / "usr/lib64/x/f").read_bytes() == b"x"
    assert fs.resolve("/lib/x/f") == root / "usr/lib64/x/f"
    (root / "sbin").symlink_to("usr/lib/../../../../sbin-real")  # clamped at the root
    assert fs.write_atomic("/sbin/f", b"y", 0o600)
    assert (root / "sbin-real/f").read_bytes() == b"y"
