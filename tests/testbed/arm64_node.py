"""A throwaway node that is an arm64 machine to everything that asks, under qemu-user emulation.

The kernel stays the host's (x86-64); what makes the node arm64 is what runs on it. Its
containerd and ``ctr`` are Debian's arm64 builds, taken from ``packaging/rootfs.sh``'s arm64 root
file system, so ``ctr images pull`` without ``--platform`` (Gardener's ``init.sh``) and the agent's
own pulls pick the linux/arm64 manifest of an index, because ``ctr``'s default platform is the
one it was built for; the kernel runs them, the agent and every other arm64 program through
Debian's qemu-aarch64 (binfmt_misc, F flag, registered by ``rootfs.sh``). The arm64 programs
find their loader and glibc, libsystemd and the rest of the base system's shared libraries
where Debian's multiarch layout has them (``/usr/lib/aarch64-linux-gnu``), copied from the same
root. The rest of the node (systemd, the shell, coreutils) stays x86-64, as an arm64 node's
userland does not matter to the agent beyond the programs it runs by name.

Go programs under qemu-user now and then hang for good (Go's signal-based asynchronous
preemption; golang/go#36981, #70329): the node's service manager hands every unit, and so
containerd and each ``ctr`` the init script and the agent start, ``GODEBUG=asyncpreemptoff=1``.
A real arm64 machine runs them natively and needs nothing of the kind.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.testbed.agent_image import REPO
from tests.testbed.containerd import ContainerdNode
from tests.testbed.systemd_ns import HarnessError, IsolatedSystemd

TRIPLET = "aarch64-linux-gnu"
LOADER = "ld-linux-aarch64.so.1"
#: the arm64 programs the node gets, in place of its x86-64 ones
PROGRAMS = ("/usr/bin/containerd", "/usr/bin/ctr")
#: what the service manager hands every unit: Go under qemu-user without async preemption
GO_UNDER_QEMU = "GODEBUG=asyncpreemptoff=1"
#: what every systemd host has: the agent's host libraries besides glibc
HOST_LIBRARIES = ("libsystemd.so.0",)
_NEEDED = re.compile(r"\(NEEDED\)\s+Shared library: \[([^]]+)\]")


def arm64_rootfs() -> Path:
    """``packaging/rootfs.sh arm64`` (cached; it also makes sure binfmt_misc runs arm64)."""
    found = subprocess.run(
        ["sh", str(REPO / "packaging" / "rootfs.sh"), "arm64"],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if found.returncode != 0:
        raise HarnessError(f"packaging/rootfs.sh arm64 failed:\n{found.stderr[-3000:]}")
    return Path(found.stdout.strip().splitlines()[-1])


def _needed(path: Path) -> list[str]:
    out = subprocess.run(
        ["readelf", "-d", str(path)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return _NEEDED.findall(out)


def _find_library(root: Path, soname: str) -> Path:
    for directory in (f"lib/{TRIPLET}", f"usr/lib/{TRIPLET}"):
        candidate = root / directory / soname
        if candidate.is_symlink() or candidate.exists():
            return candidate
    raise HarnessError(f"{soname} is not in the arm64 root file system {root}")


def _inside(root: Path, path: Path) -> Path:
    """``path`` with its symlinks followed inside ``root`` (absolute ones name root's files)."""
    for _ in range(40):
        if not path.is_symlink():
            return path
        target = path.readlink()
        path = root / str(target).lstrip("/") if target.is_absolute() else path.parent / target
    raise HarnessError(f"too many symlinks at {path}")


def base_libraries(root: Path) -> dict[str, Path]:
    """The shared libraries an arm64 node brings, by file name (symlinks followed inside
    ``root``): the base system's (``/lib/aarch64-linux-gnu``: glibc and the essential
    packages') and what the node's arm64 programs and host libraries need besides,
    recursively."""
    base = root / "lib" / TRIPLET
    found = {p.name: _inside(root, p) for p in base.iterdir() if not p.is_dir()}
    todo = [root / program.lstrip("/") for program in PROGRAMS]
    todo += [_find_library(root, name) for name in HOST_LIBRARIES]
    seen: set[str] = set()
    while todo:
        path = todo.pop()
        real = _inside(root, path)
        if path.name.startswith("lib") or path.name.startswith("ld-"):
            found.setdefault(path.name, real)
        for soname in _needed(real):
            if soname not in seen:
                seen.add(soname)
                todo.append(_find_library(root, soname))
    return found


def make_arm64(node: IsolatedSystemd, root: Path) -> None:
    """Turn the (not yet started) containerd node into an arm64 one, in its overlay only."""
    libdir = node.path(f"/usr/lib/{TRIPLET}")
    libdir.mkdir(parents=True, exist_ok=True)
    for name, source in sorted(base_libraries(root).items()):
        target = libdir / name
        target.unlink(missing_ok=True)
        target.write_bytes(source.read_bytes())
        target.chmod(0o644)
    # The program interpreter arm64 binaries name (/lib is /usr/lib on the host).
    loader = node.path(f"/usr/lib/{LOADER}")
    loader.unlink(missing_ok=True)
    loader.symlink_to(f"{TRIPLET}/{LOADER}")
    for program in PROGRAMS:
        target = node.path(program)
        target.unlink(missing_ok=True)
        target.write_bytes((root / program.lstrip("/")).read_bytes())
        target.chmod(0o755)


@contextlib.contextmanager
def arm64_containerd_node(workdir: Path, ca_cert: Path | None = None) -> Iterator[ContainerdNode]:
    """A throwaway node with arm64 ``containerd.service`` running (the test CA inside)."""
    root = arm64_rootfs()
    node = IsolatedSystemd(workdir, overlay=True, unmask=("containerd.service",))
    node.start()
    try:
        make_arm64(node, root)
        node.run(["systemctl", "set-environment", GO_UNDER_QEMU])
        instance = ContainerdNode(node, ca_cert)
        instance.prepare()
        instance.start(timeout=120)
        yield instance
    finally:
        node.stop()
