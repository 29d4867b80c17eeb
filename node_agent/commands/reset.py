"""``node-agent reset``: take back from a node exactly what the agent put there.

Why its own module: reset runs from a shell as root, often while the agent's service is running,
and must never delete what the agent did not create. It therefore works from the inventory
alone (``host.state``): only entries the agent *created* are removed, and only while they hold
the bytes recorded for them, never in the agent's own directory (``state.remove_created``); a
distro unit that got drop-ins, a pre-existing file an OSC overwrote, a file changed since,
stays. The order matters:

1. stop the agent's own unit first (so it cannot re-apply while we delete), then
   ``kubelet.service``, then the units the agent created; disable those that are enabled;
2. remove the created files, unit files and drop-ins, then the ``<unit>.d`` directories left
   empty, and reload systemd;
3. empty the agent's state: the state documents (and their ``.corrupt`` siblings) and the
   credentials. Upstream's reset empties the whole ``/var/lib/gardener-node-agent``; we remove
   the credentials too, since a reset node must not keep a token for the cluster, but leave the
   rest of that directory (its config, the cluster's CA), whatever the inventory says.

An item that cannot be taken back (a directory where a file was, a parent that became a
symlink, a unit that does not stop) is named, skipped, and kept in the inventory; everything
else goes on, the credentials go in any case, and ResetIncompleteError comes last. Every step is
idempotent: a second reset tries only what is left, or finds nothing and says so. A crash
part-way leaves the inventory in place, so the next reset finishes the job. Two resets at once
take turns (``reset_lock``): otherwise both stop and disable the same units, and the slower one
fails on a unit file the other already deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import posixpath
import stat
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from node_agent.base import layout
from node_agent.base.digest import sha256_hex
from node_agent.base.errors import (
    HostError,
    ResetBusyError,
    ResetIncompleteError,
    SystemdError,
    UnsafePathError,
)
from node_agent.base.layout import AGENT_UNIT
from node_agent.base.log import get_logger
from node_agent.host.documents import OwnedEntry
from node_agent.host.fs import HostFS
from node_agent.host.state import StateStore, not_written, remove_created
from node_agent.systemd.types import JobResult, UnitFileChange, UnitState

KUBELET_UNIT = "kubelet.service"
LOCK_WAIT = 300.0  # seconds a reset waits for another one to finish
NOTHING_TO_DO = "nothing to do: no units, files or state of the agent on this node"
_INACTIVE = frozenset({"inactive", "failed"})

log = get_logger("node-agent.reset")


class ResetSystemd(Protocol):
    """The part of the systemd seam reset needs (``node_agent.systemd.Systemd`` has it)."""

    async def unit_states(self, names: Sequence[str]) -> dict[str, UnitState]: ...

    async def stop_unit(self, unit: str, *, job_timeout: float = 10.0) -> JobResult: ...

    async def disable(self, units: Sequence[str]) -> list[UnitFileChange]: ...

    async def daemon_reload(self) -> None: ...


@contextlib.contextmanager
def reset_lock(
    root: Path,
    *,
    wait: float = LOCK_WAIT,
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> Iterator[None]:
    """Hold the node's reset lock: an exclusive ``flock`` on the agent's state directory below
    ``root`` (the root itself while there is none), so no lock file is left behind. A second
    reset says that it waits, and gives up with ResetBusyError after ``wait`` seconds."""
    state_dir = root / layout.BASE_DIR.lstrip("/")
    target = state_dir if state_dir.is_dir() else root
    try:
        fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise HostError(f"cannot take the reset lock on {target}: {exc.strerror or exc}") from exc
    try:
        if not _try_lock(fd):
            say("another node-agent reset is running on this node; waiting for it to finish")
            deadline = time.monotonic() + wait
            while not _try_lock(fd):
                if time.monotonic() >= deadline:
                    raise ResetBusyError(
                        f"another node-agent reset still holds the lock on {target} after {wait:g}s"
                    )
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # releases the lock


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _cgroup_units(cgroup_file: Path = Path("/proc/self/cgroup")) -> set[str]:
    """The systemd units this process runs in (from its cgroup path)."""
    try:
        text = cgroup_file.read_text()
    except OSError:
        return set()
    units: set[str] = set()
    for line in text.splitlines():
        for part in line.rpartition(":")[2].split("/"):
            if "." in part:
                units.add(part)
    return units


class _Report:
    """The lines of one reset, each printed as it happens; what was kept or could not be done is
    also one log event per item (``kept``: a warning, ``not removed``/``not stopped``/...: an
    error), and what could not be done makes the reset fail at its end."""

    def __init__(self, out: Callable[[str], None]) -> None:
        self.out = out
        self.lines: list[str] = []
        self.failed: list[tuple[str, str]] = []

    def did(self, line: str) -> None:
        self.lines.append(line)
        self.out(line)

    def kept(self, what: str, path: str, why: str) -> None:
        """``path`` stays: it is not provably what the agent wrote (not an error)."""
        self.did(f"kept {what} {path}: {why}")
        log.warning("kept", kind=what, path=path, reason=why)

    def not_removed(self, what: str, path: str, exc: HostError) -> None:
        self.did(f"not removed {what} {path}: {exc}")
        log.error("not removed", kind=what, path=path, error=str(exc))
        self.failed.append((path, str(exc)))

    def not_done(self, action: str, unit: str, why: str) -> None:
        self.did(f"{action} {unit}: {why}")
        log.error(action, unit=unit, error=why)
        self.failed.append((unit, why))


async def reset_node(
    root: Path,
    systemd: ResetSystemd | None,
    *,
    agent_unit: str = AGENT_UNIT,
    out: Callable[[str], None] = print,
    job_timeout: float = 60.0,
    caller_units: set[str] | None = None,
    unpack_root: str = layout.UNPACK_ROOT,
) -> list[str]:
    """Reset the node below ``root``; prints and returns one line per item.

    ``systemd`` None skips every unit operation (an image being built). ``caller_units`` are
    the units this process runs in (default: read from its cgroup); the agent's unit is not
    stopped when reset runs inside it, as that would kill reset itself. The agent's own program
    goes too (see :func:`_own_program`), and ``unpack_root``, where the single file's launcher
    keeps its unpacked copies. An item that cannot be taken back is named and skipped; the
    credentials are removed whatever happened before; ResetIncompleteError at the end names
    what is left (the inventory keeps those entries, so the next reset tries them again).
    """
    report = _Report(out)
    fs = HostFS(root, follow_system_symlinks=True)
    try:
        inside = (_cgroup_units() if caller_units is None else caller_units) if systemd else set()
        await _take_back(fs, systemd, report, agent_unit, inside, job_timeout, unpack_root)
    finally:
        # A reset node must not keep a token for the cluster, whatever failed before.
        for path in layout.CREDENTIAL_FILES:
            _remove(fs, path, report)
    if report.failed:
        raise ResetIncompleteError(report.failed)
    if not report.lines:
        out(NOTHING_TO_DO)
    return report.lines


async def _take_back(
    fs: HostFS,
    systemd: ResetSystemd | None,
    report: _Report,
    agent_unit: str,
    inside: set[str],
    job_timeout: float,
    unpack_root: str,
) -> None:
    """Everything of reset but the credentials, in order (see the module's docstring)."""
    store = StateStore(fs)
    inventory = f"{layout.BASE_DIR}/{layout.INVENTORY}"
    try:
        entries = store.inventory().entries
    except HostError as exc:  # what the agent created is unknown: its state stays as it is
        report.not_removed("file", inventory, exc)
        return
    created = {path: entry for path, entry in sorted(entries.items()) if entry.created}
    own_program = _own_program(fs, entries, agent_unit)  # read before the unit file goes
    left: dict[str, OwnedEntry] = {}  # created paths still there, for the next reset
    done: set[str] = set()  # paths already dealt with
    units: list[str] = []
    for path, entry in created.items():
        if entry.kind != "unit":
            continue
        try:
            why = not_written(fs, path, entry)
        except HostError as exc:
            report.not_removed(entry.kind, path, exc)
            left[path] = entry
            done.add(path)
            continue
        if why is not None:  # not the agent's unit: neither stopped nor disabled
            report.kept(entry.kind, path, why)
            done.add(path)
        else:
            units.append(posixpath.basename(path))

    stuck: set[str] = set()  # units that did not stop or were not disabled
    if systemd is not None:
        stuck = await _stop_and_disable(systemd, agent_unit, units, inside, report, job_timeout)

    reload = False
    for path, entry in created.items():
        if path in done:
            continue
        if _unit_of(path) in stuck:  # its unit is named above; it keeps its files
            left[path] = entry
            continue
        try:
            removal = remove_created(fs, path, entry)
        except HostError as exc:
            report.not_removed(entry.kind, path, exc)
            left[path] = entry
            continue
        if removal.kept is not None:
            report.kept(entry.kind, path, removal.kept)
        elif removal.removed:
            report.did(f"removed {entry.kind} {path}")
            reload = reload or entry.kind != "file"
    guard = layout.drop_in_path(agent_unit, layout.SELF_UPDATE_DROP_IN)  # not in the inventory
    if agent_unit not in stuck and _remove(fs, guard, report, "dropin"):
        reload = True
    dropins = [p for p, e in created.items() if e.kind == "dropin" and p not in left]
    for directory in dict.fromkeys(posixpath.dirname(p) for p in [*dropins, guard]):
        try:
            if fs.remove_dir_if_empty(directory):
                report.did(f"removed empty directory {directory}")
        except HostError as exc:
            report.not_removed("directory", directory, exc)
    if reload and systemd is not None:
        try:
            await systemd.daemon_reload()
        except SystemdError as exc:
            report.not_done("not reloaded", "systemd", str(exc))
        else:
            report.did("reloaded systemd")

    for path in own_program:
        try:
            if _is_regular(fs, path) and fs.remove(path):
                report.did(f"removed {path}")
        except UnsafePathError:
            continue  # reached through a symlink (the standalone install's ``current``): it stays
        except HostError as exc:
            report.not_removed("file", path, exc)
    try:
        found = fs.lstat(unpack_root)
        if found is not None and not stat.S_ISDIR(found.st_mode):
            report.kept("directory", unpack_root, "is not a directory (the launcher makes one)")
        elif found is not None and fs.remove_tree(unpack_root):
            report.did(f"removed unpacked copies {unpack_root}")
    except HostError as exc:
        report.not_removed("directory", unpack_root, exc)

    if left:
        try:
            store.keep_only(left)
        except HostError as exc:  # the whole inventory stays: the next reset starts over
            report.not_removed("file", inventory, exc)
            return
    state = [f"{layout.BASE_DIR}/{name}" for name in layout.STATE_FILES]
    state += [f"{path}{layout.CORRUPT_SUFFIX}" for path in state]
    for path in state:
        if not (left and path == inventory):
            _remove(fs, path, report)


def _remove(fs: HostFS, path: str, report: _Report, what: str = "") -> bool:
    """Remove the file ``path`` reset removes by name; whether it did (a failure is named)."""
    try:
        if not fs.remove(path):
            return False
    except HostError as exc:
        report.not_removed(what or "file", path, exc)
        return False
    report.did(f"removed {what} {path}" if what else f"removed {path}")
    return True


def _unit_of(path: str) -> str | None:
    """The unit a unit file or drop-in under the unit directory belongs to."""
    rest = path.removeprefix(layout.UNIT_DIR + "/")
    if rest == path:
        return None
    head, _, name = rest.partition("/")
    return head.removesuffix(".d") if name else head


def _is_regular(fs: HostFS, path: str) -> bool:
    st = fs.lstat(path)
    return st is not None and stat.S_ISREG(st.st_mode)


def _own_program(fs: HostFS, entries: Mapping[str, OwnedEntry], agent_unit: str) -> list[str]:
    """The agent's own single file and the ``.previous`` a self-update kept: the program named
    by ``ExecStart=`` of the agent's unit, when that unit is the agent's (in the inventory:
    written by ``bootstrap`` or by an OSC, and still holding the bytes recorded then). On a
    Gardener node it is ``/opt/bin/gardener-node-agent``, put there by the user-data and
    replaced by OSCs, so no inventory entry says "created"; it is the agent all the same. Only
    regular files reached without a symlink are removed: the standalone install's program, run
    through its ``current`` symlink (and ``bin/node-agent`` a symlink itself), stays."""
    unit_file = layout.unit_path(agent_unit)
    entry = entries.get(unit_file)
    if entry is None or entry.sha256 is None:
        return []
    try:
        raw = fs.read(unit_file)
    except HostError:
        return []
    if raw is None or sha256_hex(raw) != entry.sha256:
        return []
    for line in raw.decode(errors="replace").splitlines():
        key, _, value = line.strip().partition("=")
        if key.strip() == "ExecStart" and value.strip():
            program = value.split()[0].lstrip("-@:+!")
            if posixpath.isabs(program):
                return [program, f"{program}.previous"]
    return []


async def _stop_and_disable(
    systemd: ResetSystemd,
    agent_unit: str,
    created_units: list[str],
    inside: set[str],
    report: _Report,
    job_timeout: float,
) -> set[str]:
    """Stop the agent's unit, kubelet and the units the agent created, and disable those of
    them that are enabled; returns the units that did not stop or were not disabled (each
    named), which keep their unit files and drop-ins."""
    order = list(dict.fromkeys([agent_unit, KUBELET_UNIT, *created_units]))
    try:
        states = await systemd.unit_states(order)
    except SystemdError as exc:
        for unit in order:
            report.not_done("not stopped", unit, f"its state could not be read: {exc}")
        return set(order)
    stuck: set[str] = set()
    for unit in order:
        state = states[unit]
        if state.load_state == "not-found" or state.active_state in _INACTIVE:
            continue
        if unit == agent_unit and unit in inside:
            report.did(f"not stopping {unit}: reset runs inside it")
            continue
        try:
            result = await systemd.stop_unit(unit, job_timeout=job_timeout)
        except SystemdError as exc:
            why = str(exc)
        else:
            if result.ok:
                report.did(f"stopped {unit}")
                continue
            why = result.describe()
        report.not_done("not stopped", unit, why)
        stuck.add(unit)
    enabled = [
        u for u in created_units if u not in stuck and states[u].unit_file_state == "enabled"
    ]
    if not enabled:
        return stuck
    try:
        await systemd.disable(enabled)
    except SystemdError:  # one unit refused: each on its own, to name the one
        for unit in enabled:
            try:
                await systemd.disable([unit])
            except SystemdError as exc:
                report.not_done("not disabled", unit, str(exc))
                stuck.add(unit)
            else:
                report.did(f"disabled {unit}")
        return stuck
    for unit in enabled:
        report.did(f"disabled {unit}")
    return stuck
