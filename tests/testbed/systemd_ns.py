"""A real systemd, booted as PID 1 of private namespaces, for tests.

Fakes of D-Bus hide exactly the bugs a node agent has, so tests talk to the machine's own
systemd instead, isolated so that nothing it does reaches the host: own PID, mount, UTS,
IPC and cgroup namespaces, private tmpfs on every place systemd writes to, and every
host-touching unit masked (see ``systemd-init.sh``).

From outside the namespaces, systemd's private socket refuses us, so callers use the
namespace's own dbus-daemon (``bus_address``) and reach its files under ``root``
(``/proc/<pid>/root``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

INIT_SCRIPT = Path(__file__).with_name("systemd-init.sh")
SYSTEMD = Path("/lib/systemd/systemd")
CGROUP2_CANDIDATES = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
BOOT_TIMEOUT = 30.0


class HarnessError(RuntimeError):
    """The test bed could not be brought up or torn down."""


def _cgroup2_root() -> Path:
    """The cgroup2 hierarchy: ``/sys/fs/cgroup/unified`` on hybrid hosts, else the root."""
    for candidate in CGROUP2_CANDIDATES:
        if (candidate / "cgroup.controllers").exists():
            return candidate
    raise HarnessError("no cgroup2 hierarchy is mounted (looked at /sys/fs/cgroup[/unified])")


def _remove_cgroup_tree(path: Path, timeout: float = 5.0) -> None:
    """Remove a cgroup and all its children, deepest first, once their processes are gone."""
    deadline = time.monotonic() + timeout
    while path.exists():
        dirs = sorted(
            (Path(root) for root, _, _ in os.walk(path)),
            key=lambda p: len(p.parts),
            reverse=True,
        )
        busy = False
        for directory in dirs:
            try:
                directory.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                busy = True
        if not busy:
            return
        if time.monotonic() > deadline:
            raise HarnessError(f"cgroup {path} still busy after {timeout:.0f}s")
        time.sleep(0.02)


class IsolatedSystemd:
    """One systemd instance in its own namespaces; several can run side by side.

    ``overlay=True`` makes it a throwaway node: the root is an overlay of the host's ``/``
    with a tmpfs upper layer, so code under test may write anywhere. ``unmask`` names
    distribution units (e.g. ``containerd.service``) that stay unmasked so a test can run them.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        overlay: bool = False,
        name: str | None = None,
        unmask: Sequence[str] = (),
    ) -> None:
        self.name = name or f"na-test-{uuid.uuid4().hex[:8]}"
        self.overlay = overlay
        self.unmask = tuple(unmask)
        self.workdir = workdir / self.name
        self.log_path = self.workdir / "systemd.log"
        self._cgroup = _cgroup2_root() / self.name
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None

    # -- life cycle -------------------------------------------------------------------
    def start(self, timeout: float = BOOT_TIMEOUT) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        scratch = self.workdir / "scratch"
        scratch.mkdir(exist_ok=True)
        self._cgroup.mkdir()
        procs = self._cgroup / "cgroup.procs"

        def enter_cgroup() -> None:  # runs in the child, before exec
            procs.write_text(str(os.getpid()))

        log = self.log_path.open("wb")
        try:
            self._proc = subprocess.Popen(
                [
                    "unshare",
                    "--pid",
                    "--fork",
                    "--kill-child=SIGKILL",
                    "--mount",
                    "--mount-proc",
                    "--uts",
                    "--ipc",
                    "--cgroup",
                    "--propagation",
                    "private",
                    "/bin/sh",
                    str(INIT_SCRIPT),
                    "overlay" if self.overlay else "plain",
                    str(scratch),
                    " ".join(self.unmask),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=enter_cgroup,
                start_new_session=True,
            )
        finally:
            log.close()
        try:
            self._wait_booted(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_booted(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            if self._pid is None:
                self._pid = self._find_pid1()
            if self._pid is not None and self._state() in ("running", "degraded"):
                return
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"systemd in {self.name} did not boot within {timeout:.0f}s "
                    f"(state {self._state()!r}); log tail:\n{self.log_tail()}"
                )
            time.sleep(0.02)

    def _check_alive(self) -> None:
        assert self._proc is not None
        if self._proc.poll() is not None:
            raise HarnessError(
                f"systemd in {self.name} exited with {self._proc.returncode}; "
                f"log tail:\n{self.log_tail()}"
            )

    def _find_pid1(self) -> int | None:
        """The host PID of the namespace's PID 1, once it is systemd."""
        assert self._proc is not None
        children = Path(f"/proc/{self._proc.pid}/task/{self._proc.pid}/children")
        try:
            pids = children.read_text().split()
        except OSError:
            return None
        for pid in pids:
            try:
                if os.readlink(f"/proc/{pid}/exe") == str(SYSTEMD.resolve()):
                    return int(pid)
            except OSError:
                continue
        return None

    def _state(self) -> str:
        if self._pid is None or not (self.root / "run/dbus/system_bus_socket").exists():
            return "no-bus"
        result = subprocess.run(
            [
                "busctl",
                f"--address={self.bus_address.decode()}",
                "--timeout=2",
                "get-property",
                "org.freedesktop.systemd1",
                "/org/freedesktop/systemd1",
                "org.freedesktop.systemd1.Manager",
                "SystemState",
            ],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if result.returncode != 0:
            return "bus-not-ready"
        return result.stdout.split()[-1].strip('"')

    def stop(self) -> None:
        """Kill systemd and everything in its namespaces; leave no process or cgroup behind."""
        if self._pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGKILL)
        if self._proc is not None:
            if self._proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired as exc:
                raise HarnessError(f"unshare for {self.name} did not exit") from exc
        for pid in self._cgroup_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self._cgroup.exists():
            _remove_cgroup_tree(self._cgroup)
        self._pid = None
        self._proc = None
        shutil.rmtree(self.workdir / "scratch", ignore_errors=True)

    def _cgroup_pids(self) -> list[int]:
        pids: list[int] = []
        if not self._cgroup.exists():
            return pids
        for root, _, files in os.walk(self._cgroup):
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError):
                    pids += [int(p) for p in Path(root, "cgroup.procs").read_text().split()]
        return pids

    def __enter__(self) -> IsolatedSystemd:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- access -------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        if self._pid is None:
            raise HarnessError(f"{self.name} is not running")
        return self._pid

    @property
    def root(self) -> Path:
        """The namespace's root directory, as seen from the host."""
        return Path(f"/proc/{self.pid}/root")

    @property
    def bus_address(self) -> bytes:
        """D-Bus address of the namespace's system bus, usable from the host."""
        return f"unix:path={self.root}/run/dbus/system_bus_socket".encode()

    def path(self, inner: str) -> Path:
        """Host-side path of ``inner`` (an absolute path inside the namespace)."""
        return self.root / inner.lstrip("/")

    def run(
        self, argv: Sequence[str], *, timeout: float = 30.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside the namespaces (mount, PID, UTS, IPC, cgroup; its root)."""
        return subprocess.run(
            ["nsenter", "-t", str(self.pid), "-m", "-p", "-u", "-i", "-C", "-r", "-w", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@contextlib.contextmanager
def isolated_systemd(workdir: Path, *, overlay: bool = False) -> Iterator[IsolatedSystemd]:
    instance = IsolatedSystemd(workdir, overlay=overlay)
    instance.start()
    try:
        yield instance
    finally:
        instance.stop()
