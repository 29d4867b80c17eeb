"""The single-file launcher (packaging/launcher.c) on this host, with small payloads.

Each single file is the real launcher with the real payload format (``packaging/image.py``: one
zstd frame, at a lower level where a test says so); its bundle holds a tiny compiled stand-in
for PyInstaller's bootloader that prints what it was started with. The real bundle is covered
by test_agent_image.py.
"""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.testbed.agent_image import (
    ARCHES,
    ELF_MACHINES,
    agent_image_layout,
    elf_machine,
    image_tool,
)

pytestmark = pytest.mark.integration

BOOTLOADER_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
int main(int argc, char **argv) {
    char self[4096], tag[256] = "";
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    self[n < 0 ? 0 : n] = '\0';
    strcpy(strrchr(self, '/') + 1, "tag");
    FILE *f = fopen(self, "r");
    if (f) { fgets(tag, sizeof tag, f); fclose(f); }
    printf("argv0=%s\nexe=%s\nbundle=%s\ntag=%s\n", argv[0],
           getenv("NODE_AGENT_EXECUTABLE"), getenv("NODE_AGENT_BUNDLE"), tag);
    for (int i = 1; i < argc; i++) printf("arg=%s\n", argv[i]);
    fflush(stdout);
    if (argc > 1 && strcmp(argv[1], "hold") == 0) pause();
    return 0;
}
"""


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes]:
    """(launcher, stand-in bootloader), both compiled here."""
    build = tmp_path_factory.mktemp("launcher-build")
    image_tool().compile_launcher(build / "launcher")
    (build / "boot.c").write_text(BOOTLOADER_C)
    subprocess.run(["gcc", "-O2", "-o", str(build / "boot"), str(build / "boot.c")], check=True)
    return (build / "launcher").read_bytes(), (build / "boot").read_bytes()


def write_single(
    parts: tuple[bytes, bytes], path: Path, entries: Sequence[bytes], *, level: int | None = None
) -> str:
    """A single file at ``path`` with the stand-in bootloader and ``entries``; returns its key
    (the sha256 of the payload as stored, read back from the trailer)."""
    tool = image_tool()
    launcher, boot = parts
    payload = tool.payload_from_entries(
        [tool.payload_entry(b"f", "node-agent", 0o755, boot), *entries]
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    single = tool.single_file(launcher, payload, level=level or tool.ZSTD_LEVEL)
    path.write_bytes(single)
    path.chmod(0o755)
    magic, _, kind, offset, length, digest = tool.TRAILER.unpack(single[-tool.TRAILER.size :])
    assert (magic, kind) == (tool.MAGIC, tool.ZSTD)
    assert hashlib.sha256(single[offset : offset + length]).digest() == digest
    return bytes(digest).hex()


def make_single(parts: tuple[bytes, bytes], path: Path, tag: str) -> str:
    """A single file at ``path`` whose bundle prints ``tag``; returns its content key."""
    tool = image_tool()
    return write_single(
        parts,
        path,
        [
            tool.payload_entry(b"d", "sub", 0o755, b""),
            tool.payload_entry(b"l", "sub/link", 0o777, b"../tag"),
            tool.payload_entry(b"f", "tag", 0o644, tag.encode()),
        ],
    )


def this_boot() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def synced(copy: Path, timeout: float = 60.0) -> None:
    """Wait until the background sync has marked ``copy`` as on disk (``.complete``)."""
    deadline = time.monotonic() + timeout
    while not (copy / ".complete").is_file():
        assert time.monotonic() < deadline, f"{copy} never got its .complete"
        time.sleep(0.01)
    assert (copy / ".complete").read_text() == copy.name + "\n"


def run(
    exe: Path, root: Path, *args: str, argv0: str = "gardener-node-agent"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [argv0, *args],
        executable=str(exe),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin", "NODE_AGENT_UNPACK_DIR": str(root)},
    )


def output(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    assert result.returncode == 0, result.stderr
    return dict(line.split("=", 1) for line in result.stdout.splitlines())


def copies(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if not p.name.startswith(".")}


def leftovers(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.name.startswith(".tmp-")}


def test_first_start_unpacks_warm_start_reuses(parts: tuple[bytes, bytes], tmp_path: Path) -> None:
    exe, root = tmp_path / "bin" / "gardener-node-agent", tmp_path / "unpack"
    key = make_single(parts, exe, "one")
    first = output(run(exe, root, "version", "--x"))
    assert first == {
        "argv0": "gardener-node-agent",  # argv[0] reaches the bundle unchanged
        "exe": str(exe),
        "bundle": str(root / key),
        "tag": "one",
        "arg": "--x",  # the last of the arguments, in order
    }
    assert copies(root) == {key}
    assert leftovers(root) == set()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert os.readlink(root / key / "sub" / "link") == "../tag"
    assert stat.S_IMODE((root / key / "node-agent").stat().st_mode) == 0o755
    assert (root / key / ".boot").read_text() == this_boot() + "\n"
    synced(root / key)  # in the background, after the start
    before = {p: (p.lstat().st_ino, p.lstat().st_mtime_ns) for p in (root / key).rglob("*")}
    before[root / key] = ((root / key).stat().st_ino, (root / key).stat().st_mtime_ns)
    root_mtime = root.stat().st_mtime_ns

    for _ in range(3):
        assert output(run(exe, root, "version"))["tag"] == "one"
    after = {p: (p.lstat().st_ino, p.lstat().st_mtime_ns) for p in (root / key).rglob("*")}
    after[root / key] = ((root / key).stat().st_ino, (root / key).stat().st_mtime_ns)
    assert after == before  # nothing unpacked again, nothing touched
    assert root.stat().st_mtime_ns == root_mtime


def test_at_most_two_copies(parts: tuple[bytes, bytes], tmp_path: Path) -> None:
    root = tmp_path / "unpack"
    keys = [make_single(parts, tmp_path / f"v{i}" / "agent", f"v{i}") for i in range(3)]
    for i in range(3):
        assert output(run(tmp_path / f"v{i}" / "agent", root))["tag"] == f"v{i}"
        time.sleep(0.01)  # distinct unpack times
    # The current one and the newest other one: a hand rollback stays fast.
    assert copies(root) == {keys[2], keys[1]}
    before = (root / keys[1]).stat().st_ino
    assert output(run(tmp_path / "v1" / "agent", root))["tag"] == "v1"  # rollback: warm
    assert (root / keys[1]).stat().st_ino == before
    assert output(run(tmp_path / "v0" / "agent", root))["tag"] == "v0"  # unpacked again
    # Kept: the newest unpacked other (use is not tracked, so a warm start writes nothing).
    assert copies(root) == {keys[0], keys[2]}


def test_copy_in_use_is_never_removed(parts: tuple[bytes, bytes], tmp_path: Path) -> None:
    root = tmp_path / "unpack"
    keys = [make_single(parts, tmp_path / f"v{i}" / "agent", f"v{i}") for i in range(5)]
    running = subprocess.Popen(
        ["gardener-node-agent", "hold"],
        executable=str(tmp_path / "v0" / "agent"),
        stdout=subprocess.PIPE,
        text=True,
        env={"NODE_AGENT_UNPACK_DIR": str(root)},
    )
    try:
        assert running.stdout is not None
        assert running.stdout.readline() == "argv0=gardener-node-agent\n"
        for i in (1, 2, 3):
            assert output(run(tmp_path / f"v{i}" / "agent", root))["tag"] == f"v{i}"
            assert copies(root) == {keys[0], keys[i]}  # the running one is the kept other
        assert (root / keys[0] / "tag").read_text() == "v0"
        assert running.poll() is None
    finally:
        running.kill()
        running.wait()
    assert output(run(tmp_path / "v4" / "agent", root))["tag"] == "v4"
    assert copies(root) == {keys[3], keys[4]}  # no longer in use: the newest other is kept


def test_killed_while_unpacking_leaves_no_half_copy(
    parts: tuple[bytes, bytes], tmp_path: Path
) -> None:
    root = tmp_path / "unpack"
    block = os.urandom(1 << 20)
    extra = [(f"data/{i:03d}", block + i.to_bytes(4, "big")) for i in range(120)]
    exe = tmp_path / "bin" / "agent"
    tool = image_tool()
    key = write_single(  # 120 MiB of files below data/, the directory's entry first
        parts,
        exe,
        [
            tool.payload_entry(b"d", "data", 0o755, b""),
            *(tool.payload_entry(b"f", name, 0o644, data) for name, data in extra),
            tool.payload_entry(b"f", "tag", 0o644, b"big"),
        ],
        level=1,  # random bytes do not compress: the fastest level stores them as they come
    )

    killed_during_unpack = False
    for _ in range(5):  # a few tries in case a start finishes between two polls
        proc = subprocess.Popen(
            ["agent"], executable=str(exe), env={"NODE_AGENT_UNPACK_DIR": str(root)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            if root.is_dir() and any((root / name / "data").is_dir() for name in leftovers(root)):
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait()
        if proc.returncode == -signal.SIGKILL:
            killed_during_unpack = True
            break
        for name in copies(root):  # it finished first: start over
            synced(root / name)
            subprocess.run(["rm", "-rf", str(root / name)], check=True)
    assert killed_during_unpack
    assert leftovers(root)  # the half copy stays under its temporary name ...
    assert copies(root) == set()  # ... and never under the key

    assert output(run(exe, root))["tag"] == "big"
    assert copies(root) == {key}
    assert leftovers(root) == set()  # the next start collected it
    synced(root / key)
    assert len(list((root / key / "data").iterdir())) == 120


def test_corrupted_or_truncated_file_is_refused(parts: tuple[bytes, bytes], tmp_path: Path) -> None:
    root = tmp_path / "unpack"
    exe = tmp_path / "agent"
    key = make_single(parts, exe, "good")
    good = exe.read_bytes()

    exe.write_bytes(good[:-1000])  # e.g. a copy cut short
    result = run(exe, root)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"gardener-node-agent: {exe} has no node-agent payload trailer: "
        "the file is truncated or corrupted"
    )

    broken = bytearray(good)
    broken[len(parts[0]) + 100] ^= 0xFF  # one flipped bit pattern inside the payload
    exe.write_bytes(bytes(broken))
    result = run(exe, root)
    assert result.returncode == 2
    assert "is corrupted: its payload does not match its checksum" in result.stderr
    assert result.stdout == ""
    assert copies(root) == set()
    assert leftovers(root) == set()

    # Compressed, the payload is checked by zstd's own checksum while it is decompressed: a
    # trailer naming the damaged bytes does not make them good.
    tool = image_tool()
    launcher = parts[0]
    magic, fmt, kind, offset, length, _ = tool.TRAILER.unpack(good[-tool.TRAILER.size :])
    assert kind == tool.ZSTD
    stored = bytearray(good[offset : offset + length])
    stored[len(stored) // 2] ^= 0xFF  # inside zstd's compressed blocks
    forged = hashlib.sha256(stored).digest()
    exe.write_bytes(
        launcher + bytes(stored) + tool.TRAILER.pack(magic, fmt, kind, offset, length, forged)
    )
    result = run(exe, root)
    assert result.returncode == 2
    assert "is corrupted: its payload does not match its checksum (zstd: " in result.stderr
    assert copies(root) == set()
    assert leftovers(root) == set()

    # A payload stored as it is (compression 0) is no payload of this launcher's.
    plain = good[offset : offset + length]
    exe.write_bytes(launcher + plain + tool.TRAILER.pack(magic, fmt, 0, offset, length, forged))
    result = run(exe, root)
    assert result.returncode == 2
    assert result.stderr.strip() == f"gardener-node-agent: {exe}: unknown payload compression 0"
    assert copies(root) == set()

    exe.write_bytes(good)
    assert output(run(exe, root))["tag"] == "good"
    assert copies(root) == {key}


@pytest.mark.parametrize("problem", ["world-writable", "foreign-owner"])
def test_unsafe_unpack_directory_is_refused(
    parts: tuple[bytes, bytes], tmp_path: Path, problem: str
) -> None:
    root = tmp_path / "unpack"
    root.mkdir()
    if problem == "world-writable":
        root.chmod(0o1777)
    else:
        os.chown(root, 65534, 65534)
    exe = tmp_path / "agent"
    make_single(parts, exe, "x")
    result = run(exe, root)
    assert result.returncode == 2
    assert "refusing to run from it" in result.stderr
    assert list(root.iterdir()) == []


def test_layout_is_reproducible(tmp_path: Path) -> None:
    """Same single files, same layout bytes and index digest; each platform's launcher compiles
    the same; and ``make image``'s layout is exactly what its single files give."""
    tool = image_tool()
    built = agent_image_layout(tmp_path / "dist")
    executables = {arch: built.single_file(arch).read_bytes() for arch in ARCHES}
    layout, digest = tool.image_layout(executables, built.version)
    assert built.layout.read_bytes() == layout  # another process, another time: same bytes
    smalls = {"amd64": b"\x7fELF small", "arm64": b"\x7fELF small arm"}
    small = tool.image_layout(smalls, built.version)
    assert tool.image_layout(smalls, built.version) == small
    assert small[1] != digest
    assert tool.image_layout({**smalls, "arm64": b"\x7fELF other"}, built.version)[1] != small[1]

    for arch in ARCHES:
        tool.compile_launcher(tmp_path / f"a-{arch}", arch)
        tool.compile_launcher(tmp_path / f"b-{arch}", arch)
        launcher = (tmp_path / f"a-{arch}").read_bytes()
        assert launcher == (tmp_path / f"b-{arch}").read_bytes()
        assert executables[arch].startswith(launcher), arch
        assert elf_machine(launcher) == ELF_MACHINES[arch], arch


def test_copy_of_another_boot_without_sync_is_unpacked_again(
    parts: tuple[bytes, bytes], tmp_path: Path
) -> None:
    """A copy is trusted without its sync only in the boot that unpacked it: after a crash the
    page cache that held its files is gone, and so is the boot id."""
    exe, root = tmp_path / "agent", tmp_path / "unpack"
    key = make_single(parts, exe, "one")
    assert output(run(exe, root))["tag"] == "one"
    copy = root / key
    synced(copy)

    # Unpacked in this boot, not (yet) synced: used as it is, and synced again behind the start.
    (copy / ".complete").unlink()
    inode = copy.stat().st_ino
    assert output(run(exe, root))["tag"] == "one"
    assert copy.stat().st_ino == inode
    synced(copy)

    # Unpacked in another boot whose sync never finished: unpacked again.
    (copy / ".complete").unlink()
    (copy / ".boot").write_text("00000000-0000-0000-0000-000000000000\n")
    (copy / "tag").write_text("")  # what a crash may leave of a file never written back
    assert output(run(exe, root))["tag"] == "one"
    assert copy.stat().st_ino != inode
    assert (copy / ".boot").read_text() == this_boot() + "\n"
    assert copies(root) == {key}
    assert leftovers(root) == set()
    synced(copy)


def test_without_a_boot_id_the_copy_is_synced_before_it_runs(
    parts: tuple[bytes, bytes], tmp_path: Path
) -> None:
    """Where the boot id cannot be read, nothing could tell a copy unpacked before a crash from
    a good one: the launcher syncs before exec, and the copy is complete when the start is."""
    exe, root = tmp_path / "agent", tmp_path / "unpack"
    key = make_single(parts, exe, "one")
    hidden = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount --bind /dev/null /proc/sys/kernel/random/boot_id && exec "$@"', "sh",
         "env", "-i", f"NODE_AGENT_UNPACK_DIR={root}", str(exe)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert output(hidden)["tag"] == "one"
    assert (root / key / ".complete").read_text() == key + "\n"  # already, not eventually
    assert not (root / key / ".boot").exists()
