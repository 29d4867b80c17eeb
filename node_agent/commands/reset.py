"""``node-agent reset``: take back from a node exactly what the agent put there.

Why its own module: reset runs from a shell as root, often while the agent's service is running,
and must never delete what the agent did not create. It therefore works from the inventory
alone (``host.state``): only entries the agent *created* are removed; a distro unit that got
drop-ins, or a pre-existing file an OSC overwrote, stays. The order matters:

1. stop the agent's own unit first (so it cannot re-apply while we delete), then
   ``kubelet.service``, then the units the agent created; disable those that are enabled;
2. remove the created files, unit files and drop-ins, then the ``<unit>.d`` directories left
   empty, and reload systemd;
3. empty the agent's state: the state documents (and their ``.corrupt`` siblings) and the
   credentials. Upstream's reset empties the whole ``/var/lib/gardener-node-agent``; we remove
   the credentials too, since a reset node must not keep a token for the cluster, but leave the
   rest of that directory unless the inventory says the agent created it.

Every step is idempotent: a second reset finds nothing and says so. A crash part-way leaves the
inventory in place, so the next reset finishes the job. Two resets at once take turns
(``reset_lock``): otherwise both stop and disable the same units, and the slower one fails on a
unit file the other already deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import posixpath
import shutil
import stat
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from node_agent.base import layout
from node_agent.base.errors import HostError, ResetBusyError, SystemdError
from node_agent.base.layout import AGENT_UNIT
from node_agent.host.documents import OwnedEntry
from node_agent.host.fs import HostFS
from node_agent.host.state import StateStore
from node_agent.systemd.types import JobResult, UnitFileChange, UnitState

KUBELET_UNIT = "kubelet.service"
LOCK_WAIT = 300.0  # seconds a reset waits for another one to finish
NOTHING_TO_DO = "nothing to do: no units, files or state of the agent on this node"
_INACTIVE = frozenset({"inactive", "failed"})


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
    """Reset the node below ``root``; prints and returns one line per action taken.

    ``systemd`` None skips every unit operation (an image being built). ``caller_units`` are
    the units this process runs in (default: read from its cgroup); the agent's unit is not
    stopped when reset runs inside it, as that would kill reset itself. The agent's own program
    goes too (see :func:`_own_program`), and ``unpack_root``, where the single file's launcher
    keeps its unpacked copies.
    """
    actions: list[str] = []

    def act(line: str) -> None:
        actions.append(line)
        out(line)

    fs = HostFS(root, follow_system_symlinks=True)
    store = StateStore(fs)
    entries = store.inventory().entries
    created = {path: entry for path, entry in sorted(entries.items()) if entry.created}
    units = [posixpath.basename(p) for p, e in created.items() if e.kind == "unit"]
    own_program = _own_program(fs, entries, agent_unit)  # read before the unit file goes

    if systemd is not None:
        inside = _cgroup_units() if caller_units is None else caller_units
        await _stop_and_disable(systemd, agent_unit, units, inside, act, job_timeout)

    reload = False
    for path, entry in created.items():
        if fs.remove(path):
            act(f"removed {entry.kind} {path}")
            reload = reload or entry.kind != "file"
    guard = layout.drop_in_path(agent_unit, layout.SELF_UPDATE_DROP_IN)  # not in the inventory
    if fs.remove(guard):
        act(f"removed dropin {guard}")
        reload = True
    for path in [*(p for p, e in created.items() if e.kind == "dropin"), guard]:
        if fs.remove_dir_if_empty(posixpath.dirname(path)):
            act(f"removed empty directory {posixpath.dirname(path)}")
    if reload and systemd is not None:
        await systemd.daemon_reload()
        act("reloaded systemd")

    for path in own_program:
        if _is_regular(fs, path) and fs.remove(path):
            act(f"removed {path}")
    unpacked = Path(root) / unpack_root.lstrip("/")
    if _remove_tree(unpacked):
        act(f"removed unpacked copies {unpack_root}")

    state = [f"{layout.BASE_DIR}/{name}" for name in layout.STATE_FILES]
    state += [f"{path}{layout.CORRUPT_SUFFIX}" for path in state]
    for path in (*state, *layout.CREDENTIAL_FILES):
        if fs.remove(path):
            act(f"removed {path}")
    if not actions:
        out(NOTHING_TO_DO)
    return actions


def _remove_tree(path: Path) -> bool:
    if not path.is_dir():
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def _is_regular(fs: HostFS, path: str) -> bool:
    try:
        st = fs.lstat(path)
    except HostError:
        return False
    return st is not None and stat.S_ISREG(st.st_mode)


def _own_program(fs: HostFS, entries: Mapping[str, OwnedEntry], agent_unit: str) -> list[str]:
    """The agent's own single file and the ``.previous`` a self-update kept: the program named
    by ``ExecStart=`` of the agent's unit, when that unit is the agent's (in the inventory:
    written by ``bootstrap`` or by an OSC). On a Gardener node it is ``/opt/bin/
    gardener-node-agent``, put there by the user-data and replaced by OSCs, so no inventory
    entry says "created"; it is the agent all the same. Only regular files are removed: the
    standalone install's ``bin/node-agent`` is a symlink into its own directory and stays."""
    unit_file = layout.unit_path(agent_unit)
    if unit_file not in entries:
        return []
    try:
        text = (fs.read(unit_file) or b"").decode(errors="replace")
    except HostError:
        return []
    for line in text.splitlines():
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
    act: Callable[[str], None],
    job_timeout: float,
) -> None:
    order = [agent_unit, KUBELET_UNIT, *(u for u in created_units if u not in (agent_unit,))]
    order = list(dict.fromkeys(order))
    states = await systemd.unit_states(order)
    for unit in order:
        state = states[unit]
        if state.load_state == "not-found" or state.active_state in _INACTIVE:
            continue
        if unit == agent_unit and unit in inside:
            act(f"not stopping {unit}: reset runs inside it")
            continue
        result = await systemd.stop_unit(unit, job_timeout=job_timeout)
        if not result.ok:
            raise SystemdError(f"cannot stop {unit}: {result.describe()}")
        act(f"stopped {unit}")
    enabled = [u for u in created_units if states[u].unit_file_state == "enabled"]
    if enabled:
        await systemd.disable(enabled)
        for unit in enabled:
            act(f"disabled {unit}")
