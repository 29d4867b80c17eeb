"""The kubelet data volume: which disk (pure, from lsblk's JSON) and the order of the steps."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from node_agent.apply.applier import Applier
from node_agent.base.layout import AGENT_UNIT
from node_agent.commands.reset import reset_node
from node_agent.host.data_volume import (
    COPY_MOUNT,
    LABEL,
    MOUNT_OPTIONS,
    MOUNT_UNIT,
    PREP_LABEL,
    BlockDevice,
    DataVolumeError,
    check_kubelet_data_volume,
    choose_disk,
    ensure_kubelet_data_volume,
    find_labelled,
    mount_unit_text,
    mounted_from,
    parse_lsblk,
)
from node_agent.host.fs import HostFS
from node_agent.host.state import StateStore
from node_agent.osc.applied import Applied
from tests.unit.fakes import ACTIVE, INACTIVE, FakeSystemd

GIB = 1 << 30
MKFS_E = "lazy_itable_init=0,lazy_journal_init=0,quotatype=usrquota:grpquota:prjquota"
SIZE = 64 * GIB

# What lsblk 2.38 prints for a node with a partitioned root disk and a blank data disk.
LSBLK = """{
   "blockdevices": [
      {"name":"vda", "path":"/dev/vda", "type":"disk", "size":53687091200, "fstype":null,
       "pttype":"gpt", "label":null, "mountpoint":null, "ro":false,
       "children": [
          {"name":"vda1", "path":"/dev/vda1", "type":"part", "size":53686042112,
           "fstype":"ext4", "pttype":"gpt", "label":"ROOT", "mountpoint":"/", "ro":false}
       ]},
      {"name":"vdb", "path":"/dev/vdb", "type":"disk", "size":68719476736, "fstype":null,
       "pttype":null, "label":null, "mountpoint":null, "ro":false},
      {"name":"zram0", "path":"/dev/zram0", "type":"disk", "size":0, "fstype":null,
       "pttype":null, "label":null, "mountpoint":null, "ro":false}
   ]
}"""


def disk(name: str, size: int = SIZE, **kw: Any) -> BlockDevice:
    return BlockDevice(name=name, path=f"/dev/{name}", type=kw.pop("type", "disk"), size=size, **kw)


def test_lsblk_json_is_read_with_partitions_as_children() -> None:
    vda, vdb, zram = parse_lsblk(LSBLK)
    assert (vdb.path, vdb.size, vdb.fstype, vdb.pttype) == ("/dev/vdb", SIZE, None, None)
    assert vda.pttype == "gpt"
    assert vda.mounted_at() == ["/"]
    assert vda.children[0].label == "ROOT"
    assert zram.size == 0
    assert choose_disk([vda, vdb, zram], SIZE) == vdb


def test_older_lsblk_prints_numbers_as_text() -> None:
    raw = '{"blockdevices":[{"name":"sdb","type":"disk","size":"1024","ro":"0"}]}'
    (sdb,) = parse_lsblk(raw)
    assert (sdb.path, sdb.size, sdb.read_only) == ("/dev/sdb", 1024, False)


def test_unreadable_lsblk_output_is_a_clear_error() -> None:
    with pytest.raises(DataVolumeError, match="cannot read the output of lsblk"):
        parse_lsblk("lsblk: unknown column")


def test_only_a_blank_whole_disk_of_exactly_that_size_is_chosen() -> None:
    blank = disk("vdc")
    devices = [
        disk("vdb", SIZE + 512),
        disk("sda", pttype="dos"),
        disk("sdb", fstype="xfs"),
        disk("sdc", read_only=True),
        disk("sdd", mountpoint="/mnt"),
        disk("sr0", type="rom"),
        disk("loop3", type="loop", fstype="squashfs"),
        blank,
    ]
    assert choose_disk(devices, SIZE) == blank
    assert choose_disk([disk("loop0", type="loop")], SIZE).path == "/dev/loop0"


def test_a_disk_with_a_mounted_partition_is_not_blank() -> None:
    part = BlockDevice("sdb1", "/dev/sdb1", "part", SIZE - 1024, mountpoint="/data")
    with pytest.raises(DataVolumeError, match="/dev/sdb mounted on /data"):
        choose_disk([disk("sdb", children=(part,))], SIZE)


def test_no_disk_of_that_size_names_the_size_and_the_disks() -> None:
    with pytest.raises(DataVolumeError) as err:
        choose_disk(parse_lsblk(LSBLK), 32 * GIB)
    message = str(err.value)
    assert "bootstrap.kubeletDataVolumeSize 34359738368 bytes" in message
    assert "/dev/vda (disk, 53687091200 bytes), /dev/vdb (disk, 68719476736 bytes)" in message
    assert "zram0" not in message  # an empty device is no disk


def test_disks_of_that_size_that_are_not_blank_are_named_with_why() -> None:
    with pytest.raises(DataVolumeError) as err:
        choose_disk([disk("sdb", fstype="ext4", label="data"), disk("sdc", pttype="gpt")], SIZE)
    assert str(err.value) == (
        "no blank disk for the kubelet data volume (bootstrap.kubeletDataVolumeSize "
        "68719476736 bytes): /dev/sdb formatted (ext4, label data); "
        "/dev/sdc partitioned (gpt)"
    )


def test_two_blank_disks_of_that_size_are_an_error_not_a_guess() -> None:
    with pytest.raises(DataVolumeError) as err:
        choose_disk([disk("vdb"), disk("vdc")], SIZE)
    assert str(err.value) == (
        "2 blank disks of 68719476736 bytes could be the kubelet data volume "
        "(bootstrap.kubeletDataVolumeSize 68719476736 bytes): /dev/vdb, /dev/vdc; "
        "refusing to guess which one to format"
    )


def test_an_interrupted_run_leaves_a_disk_that_is_formatted_again() -> None:
    half = disk("vdb", fstype="ext4", label=PREP_LABEL)
    assert choose_disk([half], SIZE) == half
    with pytest.raises(DataVolumeError, match=r"/dev/vdb formatted \(ext4, label other\)"):
        choose_disk([disk("vdb", fstype="ext4", label="other")], SIZE)


def test_two_finished_volumes_are_an_error() -> None:
    assert find_labelled([disk("vdb", fstype="ext4", label=LABEL)]) is not None
    with pytest.raises(DataVolumeError, match=f"several file systems are labelled {LABEL}"):
        find_labelled([disk("vdb", label=LABEL), disk("vdc", label=LABEL)])


def test_mount_unit_is_gardeners() -> None:
    text = mount_unit_text()
    assert "What=/dev/disk/by-label/KUBEDEV\nWhere=/var/lib/kubelet\nType=ext4\n" in text
    assert f"Options={MOUNT_OPTIONS}\n" in text
    assert text.startswith("[Unit]\n")
    assert text.endswith("WantedBy=local-fs.target")


class FakeDisks:
    """lsblk, mkfs.ext4, e2label, mount and umount over one in-memory disk; records argv."""

    def __init__(
        self, device: dict[str, Any], *, failing: str = "", hide_from_lsblk: bool = False
    ) -> None:
        self.device = device
        self.failing = failing  # a program that fails
        #: like a host without udev: lsblk shows no file system, only blkid's probe does
        self.hide_from_lsblk = hide_from_lsblk
        self.calls: list[list[str]] = []
        self.probes: list[str] = []  # blkid --probe, apart from the calls that change things

    async def run(self, argv: Sequence[str]) -> str:
        argv = list(argv)
        self.calls.append(argv)
        d = self.device
        if argv[0] == self.failing:
            raise DataVolumeError(f"{argv[0]} failed (exit 32): wrong fs type, bad option")
        if argv[0] == "lsblk":
            if self.hide_from_lsblk:
                return json.dumps({"blockdevices": [d | {"fstype": None, "label": None}]})
            return json.dumps({"blockdevices": [d]})
        if argv[0] == "mkfs.ext4":
            d.update(fstype="ext4", label=argv[argv.index("-L") + 1])
        elif argv[0] == "e2label":
            d["label"] = argv[2]
        elif argv[0] == "mount":
            d["mountpoint"] = argv[-1]
        elif argv[0] == "umount":
            d["mountpoint"] = None
        return ""

    async def probe(self, device: str) -> dict[str, str]:
        self.probes.append(device)
        d = self.device
        found = {"TYPE": d.get("fstype"), "LABEL": d.get("label"), "PTTYPE": d.get("pttype")}
        if self.hide_from_lsblk:
            return {k: str(v) for k, v in found.items() if v}
        return {}

    def mounted(self, target: str, device: str) -> bool:
        return bool(self.device.get("mountpoint") == target and self.device["path"] == device)


@pytest.fixture
def fs(tmp_path: Path) -> HostFS:
    return HostFS(tmp_path)


def blank_disk() -> dict[str, Any]:
    return {"name": "vdb", "path": "/dev/vdb", "type": "disk", "size": SIZE}


async def test_a_blank_disk_is_filled_labelled_last_and_mounted(fs: HostFS) -> None:
    disks = FakeDisks(blank_disk())
    systemd = FakeSystemd({MOUNT_UNIT: INACTIVE})
    result = await ensure_kubelet_data_volume(SIZE, fs, systemd, disks)
    copy, kubelet = f"{fs.root}{COPY_MOUNT}", f"{fs.root}/var/lib/kubelet"
    assert [c[0] for c in disks.calls] == [
        "lsblk", "mkfs.ext4", "mount", "cp", "umount", "e2label", "mount"
    ]  # fmt: skip
    assert disks.calls[1][-1] == "/dev/vdb"
    assert PREP_LABEL in disks.calls[1]
    assert disks.calls[1][-5:-1] == ["-O", "quota", "-E", MKFS_E]
    assert disks.calls[2] == ["mount", "-t", "ext4", "-o", MOUNT_OPTIONS, "/dev/vdb", copy]
    assert disks.calls[3] == ["cp", "-a", f"{kubelet}/.", f"{copy}/"]
    assert disks.calls[5] == ["e2label", "/dev/vdb", LABEL]  # after the copy: the commit point
    assert disks.calls[6] == [
        "mount", "-t", "ext4", "-o", MOUNT_OPTIONS, "/dev/vdb", kubelet
    ]  # fmt: skip
    assert (result.device, result.state) == ("/dev/vdb", "formatted and mounted")
    assert fs.read(f"/etc/systemd/system/{MOUNT_UNIT}") == mount_unit_text().encode()
    assert StateStore(fs).owns(f"/etc/systemd/system/{MOUNT_UNIT}")
    assert MOUNT_UNIT in systemd.enabled

    # The next boot: mounted by its unit, nothing to do.
    disks.calls.clear()
    systemd.calls.clear()
    again = await ensure_kubelet_data_volume(SIZE, fs, systemd, disks)
    assert (again.state, again.changed) == ("already mounted", [])
    assert disks.calls == [disks.calls[0]]
    assert systemd.calls == []


async def test_a_finished_volume_that_is_not_mounted_is_mounted(fs: HostFS) -> None:
    disks = FakeDisks(blank_disk() | {"fstype": "ext4", "label": LABEL})
    result = await ensure_kubelet_data_volume(SIZE, fs, FakeSystemd({MOUNT_UNIT: INACTIVE}), disks)
    assert [c[0] for c in disks.calls] == ["lsblk", "mount"]  # never formatted again
    assert result.state == "mounted"


async def test_nothing_is_mounted_under_a_running_kubelet(fs: HostFS) -> None:
    disks = FakeDisks(blank_disk())
    systemd = FakeSystemd({MOUNT_UNIT: INACTIVE, "kubelet.service": ACTIVE})
    with pytest.raises(
        DataVolumeError, match=r"kubelet\.service is active; not formatting /dev/vdb"
    ):
        await ensure_kubelet_data_volume(SIZE, fs, systemd, disks)
    assert [c[0] for c in disks.calls] == ["lsblk"]


async def test_a_copy_cut_short_is_started_over(fs: HostFS) -> None:
    copy = f"{fs.root}{COPY_MOUNT}"
    disks = FakeDisks(blank_disk() | {"fstype": "ext4", "label": PREP_LABEL, "mountpoint": copy})
    await ensure_kubelet_data_volume(SIZE, fs, FakeSystemd({MOUNT_UNIT: INACTIVE}), disks)
    assert [c[0] for c in disks.calls[:3]] == ["lsblk", "umount", "lsblk"]
    assert disks.calls[3][:3] == ["mkfs.ext4", "-q", "-F"]  # its own PREP file system
    assert disks.device["label"] == LABEL


def test_the_mount_table_says_what_is_mounted_on_the_kubelet_directory(tmp_path: Path) -> None:
    rdev = os.stat("/dev/null").st_rdev
    dev = f"{os.major(rdev)}:{os.minor(rdev)}"
    table = tmp_path / "mountinfo"
    table.write_text(
        f"30 1 {dev} / /var/lib/kubelet/pods/x/volumes rw - ext4 /dev/null rw\n"
        f"31 1 {dev} / /var/lib/kubelet rw,relatime - ext4 /dev/null rw,prjquota\n"
    )
    assert mounted_from("/var/lib/kubelet", "/dev/null", str(table))
    assert not mounted_from("/var/lib/kubelet", "/dev/zero", str(table))
    table.write_text(f"30 1 {dev} / /var/lib/kubelet/pods/x/volumes rw - ext4 /dev/null rw\n")
    assert not mounted_from("/var/lib/kubelet", "/dev/null", str(table))


async def test_the_agent_names_what_is_wrong_and_nothing_when_mounted(fs: HostFS) -> None:
    kubelet = f"{fs.root}/var/lib/kubelet"
    blank = FakeDisks(blank_disk())
    assert await check_kubelet_data_volume(SIZE, fs, blank) == (
        "/dev/vdb (bootstrap.kubeletDataVolumeSize 68719476736 bytes) is still blank; "
        "the next bootstrap sets it up"
    )
    problem = await check_kubelet_data_volume(SIZE + 1, fs, blank)
    assert problem is not None
    assert problem.startswith("/var/lib/kubelet is on the root disk: no disk of 68719476737 bytes")
    done = FakeDisks(blank_disk() | {"fstype": "ext4", "label": LABEL})
    assert await check_kubelet_data_volume(SIZE, fs, done) == (
        "/dev/vdb (label KUBEDEV, bootstrap.kubeletDataVolumeSize 68719476736 bytes) "
        "is not mounted on /var/lib/kubelet"
    )
    done.device["mountpoint"] = kubelet
    assert await check_kubelet_data_volume(SIZE, fs, done) is None
    assert [c[0] for c in done.calls] == ["lsblk", "lsblk"]  # it only looks


async def test_without_quotas_for_kernels_that_have_none(fs: HostFS) -> None:
    disks = FakeDisks(blank_disk())
    systemd = FakeSystemd({MOUNT_UNIT: INACTIVE})
    await ensure_kubelet_data_volume(SIZE, fs, systemd, disks, quota=False)
    mkfs = disks.calls[1]
    assert "quota" not in " ".join(mkfs)
    assert mkfs[-3:] == ["-E", "lazy_itable_init=0,lazy_journal_init=0", "/dev/vdb"]
    assert disks.calls[-1][:5] == ["mount", "-t", "ext4", "-o", "defaults,errors=remount-ro"]
    unit = fs.read(f"/etc/systemd/system/{MOUNT_UNIT}")
    assert unit == mount_unit_text("defaults,errors=remount-ro").encode()


async def test_a_file_system_the_kernel_cannot_mount_is_never_labelled_done(fs: HostFS) -> None:
    disks = FakeDisks(blank_disk(), failing="mount")
    with pytest.raises(DataVolumeError) as err:
        await ensure_kubelet_data_volume(SIZE, fs, FakeSystemd({MOUNT_UNIT: INACTIVE}), disks)
    assert str(err.value).startswith(
        "cannot mount the new file system on /dev/vdb (a kernel without quota support cannot; "
        "NODE_AGENT_KUBELET_DATA_VOLUME_QUOTA=off formats without quotas): mount failed"
    )
    assert [c[0] for c in disks.calls] == ["lsblk", "mkfs.ext4", "mount"]
    assert disks.device["label"] == PREP_LABEL  # formatted again by the next run
    assert not fs.exists(f"/etc/systemd/system/{MOUNT_UNIT}")


async def test_what_lsblk_does_not_show_the_device_itself_does(fs: HostFS) -> None:
    disks = FakeDisks(blank_disk() | {"fstype": "xfs", "label": "data"}, hide_from_lsblk=True)
    with pytest.raises(DataVolumeError, match=r"/dev/vdb formatted \(xfs, label data\)"):
        await ensure_kubelet_data_volume(SIZE, fs, FakeSystemd({MOUNT_UNIT: INACTIVE}), disks)
    assert [c[0] for c in disks.calls] == ["lsblk"]
    assert disks.probes == ["/dev/vdb"]

    done = FakeDisks(blank_disk() | {"fstype": "ext4", "label": LABEL}, hide_from_lsblk=True)
    done.device["mountpoint"] = f"{fs.root}/var/lib/kubelet"
    result = await ensure_kubelet_data_volume(SIZE, fs, FakeSystemd({MOUNT_UNIT: INACTIVE}), done)
    assert result.state == "already mounted"


async def test_the_sweep_leaves_the_mount_unit_to_reset(fs: HostFS) -> None:
    """bootstrap's mount unit is the agent's (reset takes it back) but no OSC's: the orphan
    sweep after an apply whose OSC does not name it neither stops nor removes it."""
    systemd = FakeSystemd({MOUNT_UNIT: INACTIVE})
    await ensure_kubelet_data_volume(SIZE, fs, systemd, FakeDisks(blank_disk()))
    unit_file = fs.root / "etc/systemd/system" / MOUNT_UNIT
    entry = StateStore(fs).inventory().entries[f"/etc/systemd/system/{MOUNT_UNIT}"]
    assert (entry.created, entry.by) == (True, "bootstrap")
    systemd.units[MOUNT_UNIT] = ACTIVE
    systemd.calls.clear()

    applier = Applier(fs, StateStore(fs), systemd, host_name="h", agent_unit=AGENT_UNIT)
    assert await applier.remove_orphans(Applied()) == []
    assert unit_file.read_bytes() == mount_unit_text().encode()
    assert systemd.calls == []  # not stopped, not disabled
    assert StateStore(fs).owns(f"/etc/systemd/system/{MOUNT_UNIT}")

    lines: list[str] = []
    await reset_node(fs.root, systemd, out=lines.append, caller_units=set())
    assert f"stopped {MOUNT_UNIT}" in lines
    assert f"removed unit /etc/systemd/system/{MOUNT_UNIT}" in lines
    assert not unit_file.exists()
