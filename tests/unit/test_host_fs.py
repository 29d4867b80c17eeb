"""HostFS against a real temporary directory as root: modes, atomicity, idempotence, refusals."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_agent.base.errors import HostError, HostIOError, UnsafePathError
from node_agent.host.fs import TEMP_PREFIX, HostFS, WriteResult


@pytest.fixture(params=[0o077, 0o000, 0o022], ids=["umask077", "umask000", "umask022"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    path.mkdir()
    return path


@pytest.fixture
def fs(root: Path) -> HostFS:
    return HostFS(root)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(TEMP_PREFIX)]


# --- modes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o600, 0o644, 0o640, 0o755, 0o400, 0o000, 0o777, 0o1777, 0o4755])
def test_file_mode_is_exact_whatever_the_umask(
    fs: HostFS, root: Path, umask: int, mode: int
) -> None:
    assert fs.write_atomic("/etc/a/b/c.conf", b"x", mode) is WriteResult.CREATED
    assert mode_of(root / "etc/a/b/c.conf") == mode
    for parent in ("etc", "etc/a", "etc/a/b"):
        assert mode_of(root / parent) == 0o755, parent
    assert (root / "etc/a/b/c.conf").read_bytes() == b"x"


def test_dir_mode_is_exact_and_only_for_created_parents(fs: HostFS, root: Path, umask: int) -> None:
    (root / "etc").mkdir(mode=0o700)
    os.chmod(root / "etc", 0o750)
    fs.write_atomic("/etc/new/f", b"", 0o600, dir_mode=0o711)
    assert mode_of(root / "etc") == 0o750  # existing directories keep their mode
    assert mode_of(root / "etc/new") == 0o711


def test_ensure_dir(fs: HostFS, root: Path, umask: int) -> None:
    assert fs.ensure_dir("/var/lib/agent", 0o700) is True
    assert mode_of(root / "var") == mode_of(root / "var/lib") == 0o755
    assert mode_of(root / "var/lib/agent") == 0o700
    assert fs.ensure_dir("/var/lib/agent", 0o755) is False
    assert mode_of(root / "var/lib/agent") == 0o700
    (root / "file").write_bytes(b"")
    with pytest.raises(HostIOError):
        fs.ensure_dir("/file")


def test_mode_out_of_range_is_refused(fs: HostFS) -> None:
    with pytest.raises(ValueError, match="permission mode"):
        fs.write_atomic("/f", b"", 0o10000)
    with pytest.raises(ValueError, match="permission mode"):
        fs.write_atomic("/f", b"", -1)


# --- atomic replace and idempotence ------------------------------------------------------------


def test_replace_is_a_rename_and_leaves_no_temp_files(fs: HostFS, root: Path) -> None:
    fs.write_atomic("/etc/f", b"old", 0o644)
    inode = os.stat(root / "etc/f").st_ino
    assert fs.write_atomic("/etc/f", b"new content", 0o644) is WriteResult.REPLACED
    assert (root / "etc/f").read_bytes() == b"new content"
    assert os.stat(root / "etc/f").st_ino != inode  # a new file was renamed into place
    assert temp_files(root) == []
    assert sorted(os.listdir(root / "etc")) == ["f"]


def test_same_content_same_mode_writes_nothing(fs: HostFS, root: Path) -> None:
    fs.write_atomic("/etc/f", b"same", 0o640)
    os.utime(root / "etc/f", ns=(1_000_000_000, 1_000_000_000))
    os.utime(root / "etc", ns=(2_000_000_000, 2_000_000_000))
    before = os.stat(root / "etc/f")
    assert fs.write_atomic("/etc/f", b"same", 0o640) is WriteResult.UNCHANGED
    assert not fs.write_atomic("/etc/f", b"same", 0o640)
    after = os.stat(root / "etc/f")
    assert (after.st_ino, after.st_mtime_ns, after.st_ctime_ns) == (
        before.st_ino,
        before.st_mtime_ns,
        before.st_ctime_ns,
    )
    assert os.stat(root / "etc").st_mtime_ns == 2_000_000_000  # no temp file came and went


def test_same_size_different_content_is_replaced(fs: HostFS, root: Path) -> None:
    fs.write_atomic("/f", b"aaaa", 0o600)
    assert fs.write_atomic("/f", b"aaab", 0o600) is WriteResult.REPLACED
    assert (root / "f").read_bytes() == b"aaab"


def test_chmod_only_change_is_applied_in_place(fs: HostFS, root: Path) -> None:
    fs.write_atomic("/etc/f", b"data", 0o600)
    os.utime(root / "etc/f", ns=(1_000_000_000, 1_000_000_000))
    inode = os.stat(root / "etc/f").st_ino
    assert fs.write_atomic("/etc/f", b"data", 0o644) is WriteResult.ATTRS_CHANGED
    st = os.stat(root / "etc/f")
    assert stat.S_IMODE(st.st_mode) == 0o644
    assert (st.st_ino, st.st_mtime_ns) == (inode, 1_000_000_000)
    assert fs.write_atomic("/etc/f", b"data", 0o644) is WriteResult.UNCHANGED


def test_empty_and_large_files(fs: HostFS, root: Path) -> None:
    big = os.urandom(3 * (1 << 20) + 17)
    assert fs.write_atomic("/big", big, 0o600) is WriteResult.CREATED
    assert fs.read("/big") == big
    assert fs.write_atomic("/big", big, 0o600) is WriteResult.UNCHANGED
    assert fs.write_atomic("/empty", b"", 0o600) is WriteResult.CREATED
    assert fs.read("/empty") == b""
    assert fs.write_atomic("/empty", b"", 0o600) is WriteResult.UNCHANGED


def test_owner_is_set_and_compared(fs: HostFS, root: Path) -> None:
    assert fs.write_atomic("/f", b"x", 0o4750, uid=1234, gid=5678) is WriteResult.CREATED
    st = os.stat(root / "f")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1234, 5678, 0o4750)
    assert fs.write_atomic("/f", b"x", 0o4750, uid=1234, gid=5678) is WriteResult.UNCHANGED
    assert fs.write_atomic("/f", b"x", 0o4750) is WriteResult.UNCHANGED  # owner not asked for
    assert fs.write_atomic("/f", b"x", 0o4750, gid=0) is WriteResult.ATTRS_CHANGED
    st = os.stat(root / "f")
    # fchown clears set-id bits; the mode must still be exact afterwards
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1234, 0, 0o4750)
    assert fs.stat_matches("/f", mode=0o4750, uid=1234, gid=0)


# --- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["etc/x", "", "./x", "/etc/../x", "/..", "/etc/x/..", "/etc/x\0y", f"/etc/{TEMP_PREFIX}x"],
)
def test_unsafe_paths_are_refused(fs: HostFS, root: Path, path: str) -> None:
    with pytest.raises(UnsafePathError):
        fs.write_atomic(path, b"x", 0o600)
    with pytest.raises(UnsafePathError):
        fs.remove(path)
    assert list(root.iterdir()) == []


def test_root_itself_is_not_a_file(fs: HostFS, root: Path) -> None:
    with pytest.raises(UnsafePathError, match="root"):
        fs.write_atomic("/", b"x", 0o600)
    assert fs.resolve("/") == root
    assert fs.resolve("//etc/./x") == root / "etc/x"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "outside"
    path.mkdir()
    (path / "victim").write_bytes(b"precious")
    return path


@pytest.mark.parametrize("link", ["etc", "etc/ssl"])
def test_symlinked_parent_is_refused_everywhere(
    fs: HostFS, root: Path, outside: Path, link: str
) -> None:
    (root / link).parent.mkdir(parents=True, exist_ok=True)
    (root / link).symlink_to(outside)
    target = f"/{link}/victim"
    with pytest.raises(UnsafePathError, match="symlink"):
        fs.write_atomic(target, b"pwned", 0o600)
    with pytest.raises(UnsafePathError):
        fs.write_atomic(f"/{link}/new/deeper", b"pwned", 0o600)
    with pytest.raises(UnsafePathError):
        fs.read(target)
    with pytest.raises(UnsafePathError):
        fs.remove(target)
    with pytest.raises(UnsafePathError):
        fs.resolve(target)
    with pytest.raises(UnsafePathError):
        fs.list_dir(f"/{link}")
    with pytest.raises(UnsafePathError):
        fs.symlink_atomic(f"/{link}/l", "/x")
    with pytest.raises(UnsafePathError):
        fs.cleanup_temp_files([f"/{link}"])
    with pytest.raises(UnsafePathError):
        fs.stat_matches(target)
    assert sorted(os.listdir(outside)) == ["victim"]
    assert (outside / "victim").read_bytes() == b"precious"


def test_symlink_into_the_root_is_refused_too(fs: HostFS, root: Path) -> None:
    (root / "real").mkdir()
    (root / "etc").symlink_to("real")
    with pytest.raises(UnsafePathError):
        fs.write_atomic("/etc/f", b"x", 0o600)


def test_unsafe_path_error_is_a_host_error() -> None:
    assert issubclass(UnsafePathError, HostError)
    assert issubclass(HostIOError, HostError)


def test_final_symlink_is_replaced_not_followed(fs: HostFS, root: Path, outside: Path) -> None:
    (root / "f").symlink_to(outside / "victim")
    with pytest.raises(UnsafePathError, match="symlink"):
        fs.read("/f")
    assert not fs.stat_matches("/f")
    assert fs.write_atomic("/f", b"mine", 0o600) is WriteResult.REPLACED
    assert not (root / "f").is_symlink()
    assert (root / "f").read_bytes() == b"mine"
    assert (outside / "victim").read_bytes() == b"precious"


def test_remove_of_a_symlink_removes_only_the_link(fs: HostFS, root: Path, outside: Path) -> None:
    (root / "f").symlink_to(outside / "victim")
    assert fs.remove("/f") is True
    assert not os.path.lexists(root / "f")
    assert (outside / "victim").read_bytes() == b"precious"


def test_fifo_is_not_read_and_does_not_hang(fs: HostFS, root: Path) -> None:
    os.mkfifo(root / "fifo")
    with pytest.raises(UnsafePathError, match="regular"):
        fs.read("/fifo")
    assert not fs.stat_matches("/fifo")
    with pytest.raises(UnsafePathError, match="is a FIFO"):
        fs.write_atomic("/fifo", b"x", 0o600)
    assert stat.S_ISFIFO(os.lstat(root / "fifo").st_mode)  # left alone, not replaced
    assert temp_files(root) == []


def test_directory_at_target_is_an_error(fs: HostFS, root: Path) -> None:
    (root / "d").mkdir()
    with pytest.raises(UnsafePathError, match="is a directory") as err:
        fs.write_atomic("/d", b"x", 0o600)
    assert err.value.path == "/d"
    with pytest.raises(HostIOError, match="remove /d: Is a directory"):
        fs.remove("/d")
    assert (root / "d").is_dir()
    assert temp_files(root) == []


def test_file_where_a_parent_directory_should_be(fs: HostFS, root: Path) -> None:
    (root / "etc").write_bytes(b"")
    with pytest.raises(UnsafePathError, match="component '/etc' is not a directory"):
        fs.write_atomic("/etc/f", b"x", 0o600)
    with pytest.raises(UnsafePathError, match="component '/etc' is not a directory"):
        fs.write_atomic("/etc/new/deeper/f", b"x", 0o600)
    with pytest.raises(HostIOError, match="Not a directory"):
        fs.read("/etc/f")
    assert fs.remove("/etc/f") is False  # cannot exist: already gone
    assert fs.remove_dir_if_empty("/etc/d") is False
    assert fs.read("/missing/f") is None
    assert (root / "etc").read_bytes() == b""


# --- reading, checking, removing ---------------------------------------------------------------


def test_read_and_stat_matches(fs: HostFS) -> None:
    assert fs.read("/nope") is None
    assert fs.read("/no/such/dir/f") is None
    assert fs.lstat("/no/such/dir/f") is None
    fs.write_atomic("/etc/f", b"hello", 0o640)
    digest = hashlib.sha256(b"hello").hexdigest()
    assert fs.read("/etc/f") == b"hello"
    assert fs.exists("/etc/f")
    assert fs.stat_matches("/etc/f", sha256=digest, mode=0o640)
    assert fs.stat_matches("/etc/f", sha256=digest.upper())
    assert fs.stat_matches("/etc/f")
    assert not fs.stat_matches("/etc/f", mode=0o644)
    assert not fs.stat_matches("/etc/f", sha256=hashlib.sha256(b"other").hexdigest())
    assert not fs.stat_matches("/etc/missing", mode=0o640)
    assert fs.list_dir("/etc") == ["f"]
    assert fs.list_dir("/nope") is None


def test_remove(fs: HostFS, root: Path) -> None:
    assert fs.remove("/nope") is False
    assert fs.remove("/no/such/dir/f") is False
    fs.write_atomic("/etc/f", b"x", 0o600)
    assert fs.remove("/etc/f") is True
    assert fs.remove("/etc/f") is False
    assert (root / "etc").is_dir()


def test_remove_dir_if_empty(fs: HostFS, root: Path) -> None:
    fs.write_atomic("/etc/d/f", b"x", 0o600)
    assert fs.remove_dir_if_empty("/etc/d") is False
    assert fs.remove_dir_if_empty("/etc/d/f") is False  # a file is not removed
    fs.remove("/etc/d/f")
    assert fs.remove_dir_if_empty("/etc/d") is True
    assert not (root / "etc/d").exists()
    assert fs.remove_dir_if_empty("/etc/d") is False
    assert fs.remove_dir_if_empty("/no/such") is False


def test_symlink_atomic(fs: HostFS, root: Path) -> None:
    assert fs.symlink_atomic("/etc/l", "/dev/null") is True
    assert os.readlink(root / "etc/l") == "/dev/null"
    assert fs.symlink_atomic("/etc/l", "/dev/null") is False
    assert fs.symlink_atomic("/etc/l", "../x") is True
    assert os.readlink(root / "etc/l") == "../x"
    fs.write_atomic("/etc/f", b"x", 0o600)
    assert fs.symlink_atomic("/etc/f", "/dev/null") is True
    assert os.readlink(root / "etc/f") == "/dev/null"
    assert temp_files(root) == []


def test_cleanup_temp_files(fs: HostFS, root: Path) -> None:
    fs.write_atomic("/etc/keep", b"x", 0o600)
    (root / "etc" / f"{TEMP_PREFIX}abc-keep").write_bytes(b"partial")
    (root / "etc" / f"{TEMP_PREFIX}link").symlink_to("/nowhere")
    (root / "etc" / f"{TEMP_PREFIX}dir").mkdir()  # not ours to remove
    (root / "etc" / "sub").mkdir()
    (root / "etc" / "sub" / f"{TEMP_PREFIX}deeper").write_bytes(b"")  # not recursive
    removed = fs.cleanup_temp_files(["/etc", "/etc", "/missing"])
    assert removed == [f"/etc/{TEMP_PREFIX}abc-keep", f"/etc/{TEMP_PREFIX}link"]
    assert sorted(os.listdir(root / "etc")) == [f"{TEMP_PREFIX}dir", "keep", "sub"]
    assert fs.cleanup_temp_files(["/etc"]) == []


async def test_async_wrappers(fs: HostFS, root: Path) -> None:
    assert await fs.write_atomic_async("/etc/f", b"async", 0o600) is WriteResult.CREATED
    assert await fs.read_async("/etc/f") == b"async"
    assert await fs.remove_async("/etc/f") is True
    assert not (root / "etc/f").exists()


def test_path_objects_are_accepted(fs: HostFS, root: Path) -> None:
    from pathlib import PurePosixPath

    fs.write_atomic(PurePosixPath("/etc/p"), b"x", 0o600)
    assert (root / "etc/p").read_bytes() == b"x"
    assert repr(fs) == f"HostFS({str(root)!r})"


# --- follow_system_symlinks (merged-/usr hosts) -------------------------------------------------


@pytest.fixture
def sysfs(root: Path) -> HostFS:
    return HostFS(root, follow_system_symlinks=True)


def test_strict_by_default_on_merged_usr(fs: HostFS, root: Path) -> None:
    (root / "usr/lib").mkdir(parents=True)
    (root / "lib").symlink_to("usr/lib")
    with pytest.raises(UnsafePathError, match="'lib' is a symlink"):
        fs.write_atomic("/lib/systemd/system/x.service", b"x", 0o644)


def test_relative_system_symlink_is_followed_inside_root(sysfs: HostFS, root: Path) -> None:
    (root / "usr/lib").mkdir(parents=True)
    (root / "lib").symlink_to("usr/lib")
    assert sysfs.write_atomic("/lib/systemd/system/x.service", b"x", 0o644)
    assert (root / "usr/lib/systemd/system/x.service").read_bytes() == b"x"
    assert (
        sysfs.resolve("/lib/systemd/system/x.service") == root / "usr/lib/systemd/system/x.service"
    )
    assert sysfs.read("/lib/systemd/system/x.service") == b"x"
    (root / "usr/lib/systemd/system" / f"{TEMP_PREFIX}left").write_bytes(b"")
    assert sysfs.cleanup_temp_files(["/lib/systemd/system"]) == [
        f"/usr/lib/systemd/system/{TEMP_PREFIX}left"
    ]


def test_absolute_and_escaping_targets_are_re_anchored_at_root(
    sysfs: HostFS, root: Path, outside: Path
) -> None:
    (root / "var").mkdir()
    (root / "var/run").symlink_to("/run")  # on the host this would be the host's /run
    assert sysfs.write_atomic("/var/run/agent.pid", b"1", 0o644)
    assert (root / "run/agent.pid").read_bytes() == b"1"  # created inside the root
    (root / "lib").symlink_to(outside)  # absolute, pointing outside the root
    sysfs.write_atomic("/lib/victim", b"pwned", 0o600)
    assert (outside / "victim").read_bytes() == b"precious"
    assert (root / outside.relative_to("/") / "victim").read_bytes() == b"pwned"
    (root / "sbin").symlink_to("../../../../../../../tmp-escape")
    sysfs.write_atomic("/sbin/f", b"clamped", 0o600)
    assert (root / "tmp-escape/f").read_bytes() == b"clamped"


def test_only_system_layout_links_are_followed(sysfs: HostFS, root: Path, outside: Path) -> None:
    (root / "etc").symlink_to(outside)  # planted: not one of the distribution's layout links
    with pytest.raises(UnsafePathError, match="not a system layout link"):
        sysfs.write_atomic("/etc/victim", b"pwned", 0o600)
    assert (outside / "victim").read_bytes() == b"precious"
    assert not (root / outside.relative_to("/")).exists()


def test_untrusted_symlinks_are_refused_even_when_following(sysfs: HostFS, root: Path) -> None:
    (root / "var").mkdir()
    os.chmod(root / "var", 0o777)
    (root / "real").mkdir()
    (root / "var/run").symlink_to("/real")
    with pytest.raises(UnsafePathError, match="planted"):
        sysfs.write_atomic("/var/run/f", b"x", 0o600)
    if os.geteuid() == 0:
        (root / "lib").symlink_to("real")
        os.lchown(root / "lib", 1234, 1234)
        with pytest.raises(UnsafePathError, match="planted"):
            sysfs.write_atomic("/lib/f", b"x", 0o600)
    assert list((root / "real").iterdir()) == []


def test_symlink_loops_are_refused(sysfs: HostFS, root: Path) -> None:
    (root / "bin").symlink_to("lib")
    (root / "lib").symlink_to("bin")
    with pytest.raises(UnsafePathError, match="too many"):
        sysfs.write_atomic("/bin/f", b"x", 0o600)


# --- targets that are not regular files, and the preflight check ------------------------------


def make_special(root: Path, kind: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Create a directory, FIFO, unix socket or device node at ``root/name``."""
    path = root / name
    if kind == "directory":
        path.mkdir()
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "socket":
        monkeypatch.chdir(path.parent)  # sun_path is short; bind by a relative name
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(path.name)
        monkeypatch.undo()
    elif kind == "character device":
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # like /dev/null
    else:
        os.mknod(path, stat.S_IFBLK | 0o600, os.makedev(7, 0))  # like /dev/loop0
    assert kind == "directory" or not stat.S_ISREG(os.lstat(path).st_mode)


SPECIAL = ["directory", "FIFO", "socket", "character device", "block device"]


@pytest.mark.parametrize("kind", SPECIAL)
def test_special_target_is_refused_and_left_alone(
    fs: HostFS, root: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert os.geteuid() == 0, "device nodes need root"
    (root / "etc").mkdir()
    make_special(root, kind, "etc/t", monkeypatch)
    before = os.lstat(root / "etc/t")
    with pytest.raises(UnsafePathError, match=f"refusing host path '/etc/t': is a {kind}$"):
        fs.check_target("/etc/t")
    with pytest.raises(UnsafePathError, match=f"is a {kind}$") as err:
        fs.write_atomic("/etc/t", b"x", 0o600)
    assert (err.value.path, err.value.reason) == ("/etc/t", f"is a {kind}")
    with pytest.raises(UnsafePathError, match=f"is a {kind}$"):
        fs.symlink_atomic("/etc/t", "/dev/null")
    after = os.lstat(root / "etc/t")
    assert (after.st_ino, after.st_mode, after.st_rdev) == (
        before.st_ino,
        before.st_mode,
        before.st_rdev,
    )
    assert temp_files(root) == []
    if kind != "directory":
        with pytest.raises(UnsafePathError, match="not a regular file"):
            fs.chmod("/etc/t", 0o644)
        assert fs.remove("/etc/t") is True  # deleting a special file is allowed (it is no write)
        assert not os.path.lexists(root / "etc/t")


def test_check_target_accepts_what_a_write_can_replace_and_creates_nothing(
    fs: HostFS, root: Path, outside: Path
) -> None:
    fs.check_target("/etc/a/b/c.conf")  # nothing exists yet
    assert list(root.iterdir()) == []
    fs.write_atomic("/etc/f", b"x", 0o600)
    fs.check_target("/etc/f")  # a regular file is replaced
    (root / "etc/l").symlink_to(outside / "victim")
    fs.check_target("/etc/l")  # a final symlink is replaced, its target untouched
    (root / "etc/dl").symlink_to(outside)
    fs.check_target("/etc/dl")  # even one pointing at a directory
    fs.check_target("/etc/new/deeper/f")
    assert sorted(os.listdir(root / "etc")) == ["dl", "f", "l"]


def test_check_target_refuses_non_directory_parents(fs: HostFS, root: Path) -> None:
    (root / "etc").write_bytes(b"")
    os.mkfifo(root / "pipe")
    for path, where in [
        ("/etc/f", "/etc"),
        ("/etc/a/b/f", "/etc"),
        ("/pipe/f", "/pipe"),  # must not hang on the FIFO either
    ]:
        with pytest.raises(UnsafePathError, match=f"component '{where}' is not a directory"):
            fs.check_target(path)
    assert sorted(os.listdir(root)) == ["etc", "pipe"]


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("etc/x", "not absolute"),
        ("/", "root directory"),
        ("/etc/../x", "'..'"),
        (f"/etc/{TEMP_PREFIX}x", "reserved"),
        ("/etc/" + "x" * 256, "is 256 bytes long"),
        ("/" + "\u00e9" * 128 + "/f", "is 256 bytes long"),
    ],
)
def test_check_target_refuses_paths_no_write_can_take(fs: HostFS, path: str, reason: str) -> None:
    with pytest.raises(UnsafePathError, match=re.escape(reason)):
        fs.check_target(path)


def test_longest_names_fit_and_their_temp_names_too(fs: HostFS, root: Path) -> None:
    """A 255-byte name of 4-byte characters: the temp file's name must fit as well."""
    for name in ["x" * 255, "\U0001f600" * 63, "\u00e9" * 127]:
        assert len(os.fsencode(name)) <= 255
        fs.check_target(f"/d/{name}")
        assert fs.write_atomic(f"/d/{name}", b"x", 0o600) is WriteResult.CREATED
        assert fs.write_atomic(f"/d/{name}", b"y", 0o600) is WriteResult.REPLACED
        assert (root / "d" / name).read_bytes() == b"y"
    assert temp_files(root) == []


def test_check_target_applies_the_symlink_rules(
    fs: HostFS, sysfs: HostFS, root: Path, outside: Path
) -> None:
    (root / "etc").symlink_to(outside)
    with pytest.raises(UnsafePathError, match="'etc' is a symlink"):
        fs.check_target("/etc/victim")
    (root / "usr/lib/x").mkdir(parents=True)
    (root / "lib").symlink_to("usr/lib")
    with pytest.raises(UnsafePathError, match="'lib' is a symlink"):
        fs.check_target("/lib/f")
    sysfs.check_target("/lib/f")
    with pytest.raises(UnsafePathError, match="is a directory"):
        sysfs.check_target("/lib/x")  # checked where the trusted link leads


# --- removals that look before they write -----------------------------------------------------


def test_removing_what_is_gone_makes_no_write_syscall(
    fs: HostFS, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs.write_atomic("/etc/d/f", b"x", 0o600)
    (root / "file").write_bytes(b"")

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    from node_agent.host import fs as fs_module

    for name in ("unlink", "rmdir", "mkdir", "rename", "fsync"):
        monkeypatch.setattr(f"{fs_module.__name__}.os.{name}", refuse)
    assert fs.remove("/etc/missing") is False
    assert fs.remove("/no/such/dir/f") is False
    assert fs.remove("/file/f") is False
    assert fs.remove_dir_if_empty("/etc/missing") is False
    assert fs.remove_dir_if_empty("/etc/d") is False  # not empty
    assert fs.remove_dir_if_empty("/etc/d/f") is False  # not a directory
    assert fs.remove_dir_if_empty("/file/d") is False
    with pytest.raises(HostIOError) as err:
        fs.remove("/etc/d/f")  # something to remove: the write is attempted
    assert err.value.errno == errno.EROFS


def test_remove_dir_if_empty_leaves_a_symlinked_directory(
    fs: HostFS, root: Path, outside: Path
) -> None:
    (root / "empty").mkdir()
    (root / "link").symlink_to(root / "empty")
    assert fs.remove_dir_if_empty("/link") is False
    assert (root / "link").is_symlink()
    assert fs.remove_dir_if_empty("/empty") is True


# --- mode-only repair ---------------------------------------------------------------------------


def test_chmod_changes_the_mode_in_place(fs: HostFS, root: Path, umask: int) -> None:
    fs.write_atomic("/etc/systemd/system/x.service", b"[Unit]\n", 0o644)
    target = root / "etc/systemd/system/x.service"
    os.utime(target, ns=(1_000_000_000, 1_000_000_000))
    inode = os.stat(target).st_ino
    assert fs.chmod("/etc/systemd/system/x.service", 0o600) is True
    st = os.stat(target)
    assert (stat.S_IMODE(st.st_mode), st.st_ino, st.st_mtime_ns) == (0o600, inode, 1_000_000_000)
    assert target.read_bytes() == b"[Unit]\n"
    assert fs.chmod("/etc/systemd/system/x.service", 0o600) is False
    assert fs.stat_matches("/etc/systemd/system/x.service", mode=0o600)
    for mode in (0o000, 0o4755, 0o1777, 0o640):
        assert fs.chmod("/etc/systemd/system/x.service", mode) is True
        assert mode_of(target) == mode


def test_chmod_never_follows_a_symlink(fs: HostFS, root: Path, outside: Path) -> None:
    os.chmod(outside / "victim", 0o644)
    (root / "f").symlink_to(outside / "victim")
    with pytest.raises(UnsafePathError, match="is a symlink"):
        fs.chmod("/f", 0o600)
    assert mode_of(outside / "victim") == 0o644
    (root / "etc").symlink_to(outside)
    with pytest.raises(UnsafePathError, match="'etc' is a symlink"):
        fs.chmod("/etc/victim", 0o600)
    assert mode_of(outside / "victim") == 0o644


def test_chmod_of_what_is_missing_or_not_a_file(fs: HostFS, root: Path) -> None:
    for path in ("/missing", "/no/such/f"):
        with pytest.raises(HostIOError, match=f"^chmod {path}: No such file or directory$") as err:
            fs.chmod(path, 0o600)
        assert err.value.errno == errno.ENOENT
    (root / "d").mkdir()
    with pytest.raises(UnsafePathError, match="not a regular file"):
        fs.chmod("/d", 0o700)
    with pytest.raises(ValueError, match="permission mode"):
        fs.chmod("/d", 0o10000)
    assert mode_of(root / "d") == 0o755


# --- setting aside ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["file", "symlink", "directory", "fifo"])
@pytest.mark.parametrize("older", [None, "file", "symlink", "directory"])
def test_move_aside_renames_any_kind_over_any_older_one(
    fs: HostFS, root: Path, outside: Path, shape: str, older: str | None
) -> None:
    state = root / "var/lib/state"
    state.mkdir(parents=True)
    target, aside = state / "a.json", state / "a.json.corrupt"
    (outside / "keep").write_text("outside")
    for path, kind in ((target, shape), (aside, older)):
        if kind == "file":
            path.write_text(str(path))
        elif kind == "symlink":
            path.symlink_to(outside)
        elif kind == "directory":
            (path / "sub").mkdir(parents=True)
            (path / "sub" / "link").symlink_to(outside)
        elif kind == "fifo":
            os.mkfifo(path)
    st = fs.move_aside("/var/lib/state/a.json", ".corrupt")
    assert st is not None
    assert stat.S_IFMT(st.st_mode) == stat.S_IFMT(os.lstat(aside).st_mode)
    assert not os.path.lexists(target)
    assert (outside / "keep").read_text() == "outside"  # nothing followed
    assert fs.move_aside("/var/lib/state/a.json", ".corrupt") is None


def test_move_aside_never_walks_a_symlinked_parent(fs: HostFS, root: Path, outside: Path) -> None:
    (outside / "a.json").write_text("outside")
    (root / "var").mkdir()
    (root / "var/lib").symlink_to(outside)
    with pytest.raises(UnsafePathError):
        fs.move_aside("/var/lib/a.json", ".corrupt")
    assert sorted(p.name for p in outside.iterdir()) == ["a.json", "victim"]
    with pytest.raises(UnsafePathError):
        fs.move_aside("/var/a.json", "/../x")


def test_a_link_is_followed_only_to_a_file_beside_it(fs: HostFS, root: Path) -> None:
    """The kubelet's ``kubelet-client-current.pem``: a link to its dated file, by full path
    or by bare name; a link anywhere else is refused, never followed."""
    pki = root / "var/lib/kubelet/pki"
    pki.mkdir(parents=True)
    (pki / "kubelet-client-2026.pem").write_bytes(b"cert and key\n")
    current = pki / "kubelet-client-current.pem"
    path = "/var/lib/kubelet/pki/kubelet-client-current.pem"
    assert fs.read_through_sibling_link(path, limit=100) is None
    current.symlink_to("/var/lib/kubelet/pki/kubelet-client-2026.pem")
    assert fs.read_through_sibling_link(path, limit=100) == b"cert and key\n"
    with pytest.raises(UnsafePathError, match="larger than 5 bytes"):
        fs.read_through_sibling_link(path, limit=5)
    current.unlink()
    current.symlink_to("kubelet-client-2026.pem")
    assert fs.read_through_sibling_link(path, limit=100) == b"cert and key\n"
    (root / "etc").mkdir()
    (root / "etc/shadow").write_bytes(b"secret\n")
    for elsewhere in ("/etc/shadow", "../../../../etc/shadow", "..", "kubelet-client-current.pem"):
        current.unlink()
        current.symlink_to(elsewhere)
        with pytest.raises(UnsafePathError, match="not to a file beside it"):
            fs.read_through_sibling_link(path, limit=100)
    current.unlink()
    current.symlink_to("kubelet-client-missing.pem")  # a dangling link: no certificate
    assert fs.read_through_sibling_link(path, limit=100) is None
    current.unlink()
    current.write_bytes(b"a plain file\n")
    assert fs.read_through_sibling_link(path, limit=100) == b"a plain file\n"
    (pki / "sub").mkdir()
    current.unlink()
    current.symlink_to("sub")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        fs.read_through_sibling_link(path, limit=100)
