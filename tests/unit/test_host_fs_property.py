"""Property test: any sequence of writes and removes under the root leaves exactly the tree a
simple in-memory model predicts, with exact modes and no temp files."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from node_agent.base.errors import UnsafePathError
from node_agent.host.fs import TEMP_PREFIX, HostFS, WriteResult

# Files are always named a/b, directories d..h, so no path is ever both.
FILES = ["/a", "/d/a", "/d/b", "/d/e/a", "/f/g/h/a", "/f/b"]
DIRS = ["/d", "/d/e", "/f", "/f/g", "/f/g/h"]

write_op = st.tuples(
    st.just("write"),
    st.sampled_from(FILES),
    st.sampled_from([b"", b"x", b"y", b"xy", b"\0\xff" * 3]),
    st.sampled_from([0o600, 0o644, 0o400, 0o000, 0o755]),
)
remove_op = st.tuples(st.just("remove"), st.sampled_from(FILES))
rmdir_op = st.tuples(st.just("rmdir"), st.sampled_from(DIRS))
ops = st.lists(st.one_of(write_op, remove_op, rmdir_op), max_size=25)


def _parents(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _actual(root: Path) -> tuple[set[str], dict[str, tuple[bytes, int]]]:
    dirs: set[str] = set()
    files: dict[str, tuple[bytes, int]] = {}
    for here, dirnames, filenames in os.walk(root):
        rel = "/" + os.path.relpath(here, root).removeprefix(".").lstrip("/")
        for d in dirnames:
            path = f"{rel.rstrip('/')}/{d}"
            assert stat.S_IMODE(os.lstat(root / path.lstrip("/")).st_mode) == 0o755, path
            dirs.add(path)
        for f in filenames:
            assert not f.startswith(TEMP_PREFIX)
            path = f"{rel.rstrip('/')}/{f}"
            full = root / path.lstrip("/")
            files[path] = (full.read_bytes(), stat.S_IMODE(os.lstat(full).st_mode))
    return dirs, files


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_random_writes_and_removes_match_the_model(
    sequence: list[tuple[str, ...] | tuple[str, str, bytes, int]],
) -> None:
    old_umask = os.umask(0o077)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            fs = HostFS(root)
            files: dict[str, tuple[bytes, int]] = {}
            dirs: set[str] = set()
            for op in sequence:
                if op[0] == "write":
                    _, path, data, mode = op
                    assert isinstance(path, str)
                    assert isinstance(data, bytes)
                    assert isinstance(mode, int)
                    old = files.get(path)
                    expected = (
                        WriteResult.CREATED
                        if old is None
                        else WriteResult.UNCHANGED
                        if old == (data, mode)
                        else WriteResult.ATTRS_CHANGED
                        if old[0] == data
                        else WriteResult.REPLACED
                    )
                    assert fs.write_atomic(path, data, mode) is expected
                    files[path] = (data, mode)
                    dirs.update(_parents(path))
                elif op[0] == "remove":
                    path = str(op[1])
                    assert fs.remove(path) is (files.pop(path, None) is not None)
                else:
                    path = str(op[1])
                    empty = path in dirs and not any(
                        p.startswith(path + "/") for p in [*files, *dirs]
                    )
                    assert fs.remove_dir_if_empty(path) is empty
                    if empty:
                        dirs.discard(path)
            assert _actual(root) == (dirs, files)
    finally:
        os.umask(old_umask)


# --- check_target predicts write_atomic ---------------------------------------------------------

NAMES = ["a", "b", "c"]
node_path = st.lists(st.sampled_from(NAMES), min_size=1, max_size=3).map(
    lambda parts: "/" + "/".join(parts)
)
KINDS = ["file", "dir", "fifo", "link-out", "link-in"]
tree = st.lists(st.tuples(node_path, st.sampled_from(KINDS)), max_size=8)


def _plant(root: Path, outside: Path, path: str, kind: str) -> None:
    """Create one node by hand where its parent already is a real directory; skip otherwise."""
    full = root / path.lstrip("/")
    parent = full.parent
    if not parent.is_dir() or parent.is_symlink() or os.path.lexists(full):
        return
    if kind == "file":
        full.write_bytes(b"old")
    elif kind == "dir":
        full.mkdir()
    elif kind == "fifo":
        os.mkfifo(full)
    elif kind == "link-out":
        full.symlink_to(outside)
    else:
        full.symlink_to(root / "a")


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (os.lstat(p).st_ino, os.lstat(p).st_mode) for p in root.rglob("*")
    }


def _refusal(call: Callable[[], object]) -> str | None:
    """The reason ``call`` was refused with, or None if it went through."""
    try:
        call()
    except UnsafePathError as exc:
        return exc.reason
    return None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree, st.lists(node_path, min_size=1, max_size=4))
def test_check_target_predicts_write_atomic(
    nodes: list[tuple[str, str]], targets: list[str]
) -> None:
    """Whatever is on disk, ``check_target`` refuses exactly the targets ``write_atomic`` would
    refuse, for the same reason; a refused write changes nothing, an accepted one lands."""
    with tempfile.TemporaryDirectory() as tmp:
        root, outside = Path(tmp) / "root", Path(tmp) / "outside"
        root.mkdir()
        outside.mkdir()
        for path, kind in nodes:
            _plant(root, outside, path, kind)
        fs = HostFS(root)
        refused = 0
        for target in targets:
            expected = _refusal(lambda: fs.check_target(target))  # noqa: B023 (called at once)
            before = _snapshot(root)
            actual = _refusal(lambda: fs.write_atomic(target, b"new", 0o600))  # noqa: B023
            assert actual == expected, target
            if expected is None:
                assert fs.read(target) == b"new"
                assert fs.remove(target) is True
                assert fs.remove(target) is False
            else:
                refused += 1
                assert _snapshot(root) == before
            assert list(outside.iterdir()) == []
        event("refused" if refused else "all written")
