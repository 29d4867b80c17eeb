"""The kubelet data volume (``bootstrap.kubeletDataVolumeSize``): one disk, formatted once.

Gardener sets the size when the worker pool names a data volume for the kubelet; the machine
then has one extra disk of exactly that many bytes, blank. Bootstrap finds it, makes an ext4 file
system with quotas (project quota is what the kubelet's ephemeral-storage accounting uses),
copies what is already in ``/var/lib/kubelet`` onto it and mounts it there, labelled ``KUBEDEV``.
The OSC ships ``var-lib-kubelet.mount`` to mount that label on every boot; bootstrap writes the
same unit (same bytes) and enables it, so a reboot before the first apply keeps the mount too.

Every step can be re-run (bootstrap runs on every boot). The label is the commit point: the file
system is made as ``KUBEDEV-PREP`` and renamed ``KUBEDEV`` only once the copy is complete, so an
interrupted run is redone from scratch on a disk that holds nothing but its own half-done work,
and a ``KUBEDEV`` disk is never formatted again.

The choice of the disk is pure (:func:`choose_disk`, from ``lsblk --json``); the side effects go
through :class:`Commands` (mkfs, mount, cp) and the systemd and host seams.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from node_agent.base.digest import sha256_hex
from node_agent.base.errors import NodeAgentError
from node_agent.base.layout import BASE_DIR, UNIT_DIR
from node_agent.base.log import get_logger
from node_agent.host.documents import Claim
from node_agent.host.fs import HostFS
from node_agent.host.state import StateStore
from node_agent.systemd import SystemdSeam

log = get_logger("node-agent.bootstrap")

KUBELET_DIR = "/var/lib/kubelet"
KUBELET_UNIT = "kubelet.service"
#: The file system label of a finished data volume; the mount unit mounts it by this label.
LABEL = "KUBEDEV"
#: The label while the volume is being filled: such a disk holds only an interrupted bootstrap.
PREP_LABEL = "KUBEDEV-PREP"
MOUNT_UNIT = "var-lib-kubelet.mount"
MOUNT_OPTIONS = "defaults,prjquota,errors=remount-ro"
#: ext4 with user, group and project quota, inode tables and journal initialised right away.
MKFS_OPTIONS = (
    "-O",
    "quota",
    "-E",
    "lazy_itable_init=0,lazy_journal_init=0,quotatype=usrquota:grpquota:prjquota",
)
#: Without quotas, for kernels built without quota support (they cannot mount the above).
MOUNT_OPTIONS_NO_QUOTA = "defaults,errors=remount-ro"
MKFS_OPTIONS_NO_QUOTA = ("-E", "lazy_itable_init=0,lazy_journal_init=0")
#: ``off`` makes bootstrap format and mount without quotas (and write the unit that way).
QUOTA_ENV = "NODE_AGENT_KUBELET_DATA_VOLUME_QUOTA"
#: Whole disks only; a loop device of the right size counts as one (images, test machines).
DISK_TYPES = ("disk", "loop")
LSBLK = (
    "lsblk",
    "--json",
    "--bytes",
    "--output",
    "NAME,PATH,TYPE,SIZE,FSTYPE,PTTYPE,LABEL,MOUNTPOINT,RO",
)
#: Where the new file system is mounted while the kubelet's directory is copied onto it.
COPY_MOUNT = f"{BASE_DIR}/tmp/kubelet-data-volume"
#: Devices named in an error message, at most.
MAX_NAMED = 8


def mount_unit_text(options: str = MOUNT_OPTIONS) -> str:
    """``var-lib-kubelet.mount`` byte for byte as Gardener's OSC ships it (no final newline),
    so the OSC's copy finds it unchanged; ``options`` differ only without quotas."""
    return (
        "[Unit]\n"
        f"Description=mount {KUBELET_DIR} on kubelet data device\n"
        f"Before={KUBELET_UNIT}\n"
        "[Mount]\n"
        f"What=/dev/disk/by-label/{LABEL}\n"
        f"Where={KUBELET_DIR}\n"
        "Type=ext4\n"
        f"Options={options}\n"
        "[Install]\n"
        "WantedBy=local-fs.target"
    )


class DataVolumeError(NodeAgentError):
    """The kubelet data volume could not be set up; the message names the size and the disks."""


@dataclass(frozen=True)
class BlockDevice:
    """One row of ``lsblk --json``, with its partitions as children."""

    name: str
    path: str
    type: str
    size: int
    fstype: str | None = None
    pttype: str | None = None
    label: str | None = None
    mountpoint: str | None = None
    read_only: bool = False
    children: tuple[BlockDevice, ...] = ()

    def walk(self) -> list[BlockDevice]:
        """This device and everything below it."""
        found = [self]
        for child in self.children:
            found += child.walk()
        return found

    def mounted_at(self) -> list[str]:
        return [d.mountpoint for d in self.walk() if d.mountpoint]

    def describe(self) -> str:
        return f"{self.path} ({self.type}, {self.size} bytes)"


def _text(value: Any) -> str | None:
    return str(value) if value not in (None, "") else None


def _device(row: Mapping[str, Any]) -> BlockDevice:
    name = str(row.get("name") or "")
    ro = row.get("ro")
    return BlockDevice(
        name=name,
        path=str(row.get("path") or f"/dev/{name}"),
        type=str(row.get("type") or ""),
        size=int(row.get("size") or 0),
        fstype=_text(row.get("fstype")),
        pttype=_text(row.get("pttype")),
        label=_text(row.get("label")),
        mountpoint=_text(row.get("mountpoint")),
        read_only=ro is True or ro in ("1", 1),
        children=tuple(_device(c) for c in row.get("children") or () if isinstance(c, dict)),
    )


def parse_lsblk(raw: bytes | str) -> list[BlockDevice]:
    """The top-level devices of ``lsblk --json --bytes`` (older lsblk prints numbers as text)."""
    try:
        doc = json.loads(raw)
        rows = doc["blockdevices"]
        return [_device(row) for row in rows if isinstance(row, dict)]
    except (ValueError, KeyError, TypeError) as exc:
        raise DataVolumeError(f"cannot read the output of lsblk: {exc}") from exc


async def list_devices(commands: Commands) -> list[BlockDevice]:
    """lsblk's devices, with what is on each disk and partition read from the device itself:
    without udev's database (early boot, containers) lsblk shows no file system at all, and a
    disk that only looks blank must never be formatted."""

    async def probed(device: BlockDevice) -> BlockDevice:
        children = tuple([await probed(c) for c in device.children])
        if device.type not in (*DISK_TYPES, "part") or device.size <= 0:
            return replace(device, children=children)
        found = await commands.probe(device.path)
        return replace(
            device,
            fstype=found.get("TYPE") or device.fstype,
            label=found.get("LABEL") or device.label,
            pttype=found.get("PTTYPE") or device.pttype,
            children=children,
        )

    return [await probed(d) for d in parse_lsblk(await commands.run(LSBLK))]


def why_not(device: BlockDevice) -> str | None:
    """Why ``device`` cannot become the data volume, or None if it can."""
    if device.type not in DISK_TYPES:
        return f"not a disk ({device.type})"
    if device.read_only:
        return "read-only"
    if device.mounted_at():
        return "mounted on " + ", ".join(device.mounted_at())
    if device.pttype or device.children:
        return f"partitioned ({device.pttype or 'partitions'})"
    if device.fstype and not (device.label == PREP_LABEL and device.fstype == "ext4"):
        label = f", label {device.label}" if device.label else ""
        return f"formatted ({device.fstype}{label})"
    return None


def choose_disk(devices: Sequence[BlockDevice], size: int) -> BlockDevice:
    """The one disk of exactly ``size`` bytes that is blank: no partition table, no file system,
    not mounted, writable (or one left half-done as ``KUBEDEV-PREP`` by an interrupted run).

    None or several: :class:`DataVolumeError` naming the size and the disks considered."""
    same_size = [d for d in devices if d.size == size and d.type in DISK_TYPES]
    usable = [d for d in same_size if why_not(d) is None]
    if len(usable) == 1:
        return usable[0]
    wanted = f"kubelet data volume (bootstrap.kubeletDataVolumeSize {size} bytes)"
    if usable:
        names = ", ".join(d.path for d in usable[:MAX_NAMED])
        raise DataVolumeError(
            f"{len(usable)} blank disks of {size} bytes could be the {wanted}: {names}; "
            "refusing to guess which one to format"
        )
    if same_size:
        seen = "; ".join(f"{d.path} {why_not(d)}" for d in same_size[:MAX_NAMED])
        raise DataVolumeError(f"no blank disk for the {wanted}: {seen}")
    disks = [d for d in devices if d.type in DISK_TYPES and d.size > 0]
    seen = ", ".join(d.describe() for d in disks[:MAX_NAMED]) or "none"
    raise DataVolumeError(f"no disk of {size} bytes for the {wanted}; disks: {seen}")


def find_labelled(devices: Sequence[BlockDevice]) -> BlockDevice | None:
    """The finished data volume (label ``KUBEDEV``), if there is one; two are an error."""
    found = [d for top in devices for d in top.walk() if d.label == LABEL]
    if len(found) > 1:
        names = ", ".join(d.path for d in found[:MAX_NAMED])
        raise DataVolumeError(f"several file systems are labelled {LABEL}: {names}")
    return found[0] if found else None


class Commands(Protocol):
    """The programs the data volume needs (util-linux, e2fsprogs); raises DataVolumeError."""

    async def run(self, argv: Sequence[str]) -> str: ...

    async def probe(self, device: str) -> dict[str, str]:
        """What is on ``device`` (``TYPE``, ``LABEL``, ``PTTYPE``...), read from the device
        itself; empty when it holds nothing."""
        ...

    def mounted(self, target: str, device: str) -> bool:
        """Whether ``device`` is mounted on ``target``."""
        ...


class HostCommands:
    """Runs the programs on this host, bounded in time."""

    def __init__(self, timeout: float = 300.0) -> None:
        self.timeout = timeout

    async def run(self, argv: Sequence[str]) -> str:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as exc:
            raise DataVolumeError(f"cannot run {argv[0]}: {exc.strerror or exc}") from exc
        try:
            async with asyncio.timeout(self.timeout):
                out, err = await proc.communicate()
        except TimeoutError as exc:
            proc.kill()
            await proc.wait()
            raise DataVolumeError(f"{argv[0]} did not finish within {self.timeout:.0f}s") from exc
        if proc.returncode != 0:
            detail = " ".join((err or out).decode(errors="replace").split())[:500]
            raise DataVolumeError(
                f"{' '.join(argv)} failed (exit {proc.returncode}): {detail or 'no output'}"
            )
        return out.decode(errors="replace")

    async def probe(self, device: str) -> dict[str, str]:
        try:
            out = await self.run(["blkid", "--probe", "--output", "export", device])
        except DataVolumeError as exc:
            if "(exit 2)" in str(exc):  # nothing found
                return {}
            if "(exit 8)" in str(exc):  # several signatures: anything but blank
                return {"TYPE": "ambivalent"}
            raise
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def mounted(self, target: str, device: str) -> bool:
        return mounted_from(target, device)


async def check_kubelet_data_volume(size: int, fs: HostFS, commands: Commands) -> str | None:
    """What is wrong with the kubelet data volume right now, for the Node's Events; None when
    it is mounted on ``/var/lib/kubelet``. Read-only: bootstrap is the one that sets it up."""
    wanted = f"bootstrap.kubeletDataVolumeSize {size} bytes"
    try:
        devices = await list_devices(commands)
        done = find_labelled(devices)
        if done is not None:
            if commands.mounted(_target(fs), done.path):
                return None
            return f"{done.path} (label {LABEL}, {wanted}) is not mounted on {KUBELET_DIR}"
        disk = choose_disk(devices, size)
    except DataVolumeError as exc:
        return f"{KUBELET_DIR} is on the root disk: {exc}"
    return f"{disk.path} ({wanted}) is still blank; the next bootstrap sets it up"


@dataclass
class DataVolumeResult:
    """What :func:`ensure_kubelet_data_volume` found or did; ``changed`` is empty on a no-op."""

    device: str
    state: str
    changed: list[str] = field(default_factory=list)


async def _ensure_unit(fs: HostFS, systemd: SystemdSeam, options: str, changed: list[str]) -> None:
    """The mount unit, claimed like the agent's own unit, loaded and enabled."""
    unit_file = f"{UNIT_DIR}/{MOUNT_UNIT}"
    text = mount_unit_text(options)
    StateStore(fs).claim(
        [Claim("unit", unit_file, sha256_hex(text.encode()), 0o644, by="bootstrap")]
    )
    written = fs.write_atomic(unit_file, text.encode(), 0o644)
    state = (await systemd.unit_states([MOUNT_UNIT]))[MOUNT_UNIT]
    if written or state.load_state != "loaded":
        await systemd.daemon_reload()
        changed.append(f"{MOUNT_UNIT} written")
        state = (await systemd.unit_states([MOUNT_UNIT]))[MOUNT_UNIT]
    if state.unit_file_state != "enabled":
        await systemd.enable([MOUNT_UNIT])
        changed.append(f"{MOUNT_UNIT} enabled")


async def _refuse_under_running_kubelet(systemd: SystemdSeam, what: str) -> None:
    """Mounting over the directory of a running kubelet would pull its state from under it."""
    kubelet = (await systemd.unit_states([KUBELET_UNIT]))[KUBELET_UNIT]
    if kubelet.active_state in ("active", "activating", "reloading", "deactivating"):
        raise DataVolumeError(
            f"{KUBELET_UNIT} is {kubelet.active_state}; not {what} under it "
            f"(stop it and run bootstrap again)"
        )


def _target(fs: HostFS) -> str:
    return KUBELET_DIR if fs.root == Path("/") else str(fs.root / KUBELET_DIR.lstrip("/"))


def mounted_from(target: str, device: str, mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Whether ``target`` is a mount point of ``device`` (its file system's major:minor).

    lsblk names one mount point per device, and the kubelet bind-mounts parts of its directory:
    only the mount table says reliably what is mounted on ``target``."""
    try:
        rdev = os.stat(device).st_rdev
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return False
    wanted = f"{os.major(rdev)}:{os.minor(rdev)}"
    return any(
        len(fields) > 4 and fields[4] == target and fields[2] == wanted
        for fields in (line.split() for line in lines)
    )


async def ensure_kubelet_data_volume(
    size: int, fs: HostFS, systemd: SystemdSeam, commands: Commands, *, quota: bool = True
) -> DataVolumeResult:
    """Make ``/var/lib/kubelet`` the data volume of ``size`` bytes; see the module docstring.

    ``quota=False`` formats and mounts without quotas (kernels without quota support)."""
    options = MOUNT_OPTIONS if quota else MOUNT_OPTIONS_NO_QUOTA
    target = _target(fs)
    devices = await list_devices(commands)
    copy_mount = str(fs.root / COPY_MOUNT.lstrip("/"))
    left = [d for d in devices if d.label == PREP_LABEL and d.mounted_at() == [copy_mount]]
    if left:  # an interrupted run stopped while copying: that disk starts over
        await commands.run(["umount", copy_mount])
        devices = await list_devices(commands)
    done = find_labelled(devices)
    changed: list[str] = []
    if done is not None:
        await _ensure_unit(fs, systemd, options, changed)
        if commands.mounted(target, done.path):
            return DataVolumeResult(done.path, "already mounted", changed)
        await _refuse_under_running_kubelet(systemd, f"mounting {done.path} on {KUBELET_DIR}")
        await _mount(commands, done.path, target, options)
        changed.append(f"mounted {done.path}")
        return DataVolumeResult(done.path, "mounted", changed)

    disk = choose_disk(devices, size)
    await _refuse_under_running_kubelet(systemd, f"formatting {disk.path} for {KUBELET_DIR}")
    log.info("formatting the kubelet data volume", device=disk.path, size=size)
    fs.ensure_dir(KUBELET_DIR, 0o755)
    fs.ensure_dir(COPY_MOUNT, 0o700)
    again = ("-F",) if disk.fstype else ()  # our own half-done PREP file system
    mkfs = MKFS_OPTIONS if quota else MKFS_OPTIONS_NO_QUOTA
    await commands.run(["mkfs.ext4", "-q", *again, "-L", PREP_LABEL, *mkfs, disk.path])
    # The final options already: a kernel that cannot mount it fails here, before any copy.
    try:
        await _mount(commands, disk.path, copy_mount, options)
    except DataVolumeError as exc:
        hint = (
            f" (a kernel without quota support cannot; {QUOTA_ENV}=off formats without quotas)"
            if quota
            else ""
        )
        message = f"cannot mount the new file system on {disk.path}{hint}: {exc}"
        raise DataVolumeError(message) from exc
    try:
        await commands.run(["cp", "-a", f"{target}/.", f"{copy_mount}/"])
    finally:
        await commands.run(["umount", copy_mount])
    await commands.run(["e2label", disk.path, LABEL])
    changed += [f"formatted {disk.path}", f"copied {KUBELET_DIR}"]
    await _ensure_unit(fs, systemd, options, changed)
    await _mount(commands, disk.path, target, options)
    changed.append(f"mounted {disk.path}")
    return DataVolumeResult(disk.path, "formatted and mounted", changed)


async def _mount(commands: Commands, device: str, target: str, options: str) -> None:
    await commands.run(["mount", "-t", "ext4", "-o", options, device, target])
