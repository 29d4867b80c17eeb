"""The kubelet data volume (``bootstrap.kubeletDataVolumeSize``) on a throwaway node.

Loop devices stand in for the machine's data disk: sparse files of a size no other device has
(so tests running side by side never see each other's disks), attached on the host, where the
node's lsblk sees them like the cloud's disk. The real artifact is installed by the real init
script; bootstrap must format the one blank disk of that size, keep what ``/var/lib/kubelet``
held, mount it there with Gardener's unit, change nothing on a re-run, and with no or two such
disks say so, leave every disk as it was, still start the agent, and put the error on the Node.
"""

from __future__ import annotations

import contextlib
import random
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
import yaml
from kubernetes_asyncio.client import ApiClient

from node_agent.host.data_volume import (
    LABEL,
    MOUNT_OPTIONS_NO_QUOTA,
    MOUNT_UNIT,
    PREP_LABEL,
    QUOTA_ENV,
    mount_unit_text,
)
from tests.testbed.agent_harness import (
    OSCAgent,
    inline_file,
    osc_document,
    wait_for,
    warning_messages,
)
from tests.testbed.controlplane import ControlPlane
from tests.testbed.systemd_ns import IsolatedSystemd
from tests.testbed.userdata import (
    BASE,
    UNIT,
    Artifact,
    hide_python,
    install_credentials,
    play_user_data,
    sh,
    show,
)

pytestmark = pytest.mark.integration

MIB = 1 << 20
KUBELET = "/var/lib/kubelet"
DiskFactory = Callable[[int], str]
Boot = Callable[..., Awaitable["Booted"]]
#: This kernel (a micro-VM's, built without CONFIG_QUOTA) cannot mount ext4 with quotas: the
#: tests format without them unless they are about upstream's quota format itself.
NO_QUOTA = {QUOTA_ENV: "off"}


@pytest.fixture
def size() -> int:
    """A disk size in bytes that no other device on this machine has."""
    return 48 * MIB + random.randrange(1, 4096) * 4096


def blkid(device: str, tag: str) -> str:
    got = subprocess.run(
        ["blkid", "-p", "-o", "value", "-s", tag, device],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return got.stdout.strip()


def loop_device(image: Path, size: int) -> str:
    """A blank sparse file of ``size`` bytes at ``image`` (no space used until written),
    attached as a loop device: its path."""
    with image.open("wb") as f:
        f.truncate(size)
    return subprocess.run(
        ["losetup", "--find", "--show", str(image)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.strip()


@pytest.fixture
def disks(tmp_path: Path) -> Iterator[DiskFactory]:
    """Attach blank loop devices; detached (and their files removed) whatever the test did.

    Requested before ``node``, so the node (and the mounts in its namespace) is gone first."""
    attached: list[tuple[str, Path]] = []

    def attach(size: int) -> str:
        image = tmp_path / f"disk-{len(attached)}.img"
        device = loop_device(image, size)
        attached.append((device, image))
        return device

    try:
        yield attach
    finally:
        for device, image in attached:
            # A device still mounted somewhere is detached when it is unmounted (autoclear).
            subprocess.run(["losetup", "-d", device], capture_output=True, timeout=30, check=False)
            with contextlib.suppress(OSError):
                image.unlink()
        listed = subprocess.run(
            ["losetup", "--list", "--noheadings", "--output", "BACK-FILE"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout
        assert not [image for _, image in attached if f"{image} " in f"{listed} "]


@dataclass
class Booted:
    node: IsolatedSystemd
    agent: OSCAgent
    init: subprocess.CompletedProcess[str]


@pytest_asyncio.fixture(loop_scope="session")
async def boot(
    workdir: Path,
    control_plane: ControlPlane,
    admin_api: ApiClient,
    artifact: Artifact,
    server: str,
    node: IsolatedSystemd,
) -> AsyncIterator[Boot]:
    """User-data on ``node`` with ``bootstrap.kubeletDataVolumeSize`` and some kubelet state."""
    agents: list[OSCAgent] = []

    async def play(size: int, env: dict[str, str] | None = None) -> Booted:
        agent = OSCAgent(admin_api, control_plane, node, workdir)
        agents.append(agent)
        await agent.setup()
        node.run(["hostname", agent.node_name])
        hide_python(node)
        install_credentials(agent, control_plane)
        config = node.path(f"{BASE}/config.yaml")
        doc = yaml.safe_load(config.read_text())
        doc["bootstrap"] = {"kubeletDataVolumeSize": size}
        config.write_text(yaml.safe_dump(doc))
        # What the kubelet directory may hold before bootstrap: kept on the new volume.
        sh(
            node,
            f"mkdir -p {KUBELET}/pki && chmod 0700 {KUBELET}/pki && echo cert > {KUBELET}/pki/c"
            f" && echo hidden > {KUBELET}/.hidden && ln -s pki/c {KUBELET}/link"
            f" && chown 1234:5678 {KUBELET}/pki/c && chmod 0640 {KUBELET}/pki/c",
        ).check_returncode()
        url = f"{server}/{artifact.path.name}"
        init, _ = play_user_data(
            node, url, artifact, check=False, env=NO_QUOTA if env is None else env
        )
        return Booted(node, agent, init)

    try:
        yield play
    finally:
        for agent in agents:
            await agent.stop()


def findmnt(node: IsolatedSystemd, *columns: str) -> list[str]:
    got = node.run(
        ["findmnt", "--noheadings", "--mountpoint", KUBELET, "--output", ",".join(columns)],
        check=False,
    )
    return got.stdout.split()


def mounts_on_kubelet_dir(node: IsolatedSystemd) -> int:
    """How many mounts are stacked on the kubelet directory, in the node's mount table."""
    table = node.run(["cat", "/proc/self/mountinfo"]).stdout
    return sum(1 for line in table.splitlines() if line.split()[4] == KUBELET)


def bootstrap_again(node: IsolatedSystemd) -> subprocess.CompletedProcess[str]:
    command = f"/opt/node-agent/current/bin/node-agent bootstrap --config {BASE}/config.yaml"
    return sh(node, f"{QUOTA_ENV}=off {command}")


def assert_rest_of_bootstrap_done(node: IsolatedSystemd) -> None:
    state = show(node, UNIT)
    assert state["ActiveState"] == "active", state
    assert state["UnitFileState"] == "enabled"
    assert node.path(f"{KUBELET}/kubeconfig-bootstrap").is_file()


async def test_the_one_blank_disk_becomes_the_kubelet_directory(
    disks: DiskFactory, boot: Boot, size: int
) -> None:
    device = disks(size)
    other = disks(size + 4096)  # another size: never touched
    booted = await boot(size)
    node = booted.node
    assert booted.init.returncode == 0, booted.init.stdout[-3000:]
    assert f"kubelet data volume formatted and mounted ({device})" in booted.init.stdout

    source, fstype, options = findmnt(node, "SOURCE", "FSTYPE", "OPTIONS")
    assert (source, fstype) == (device, "ext4")
    assert "errors=remount-ro" in options.split(","), options
    assert blkid(device, "LABEL") == LABEL
    assert blkid(other, "TYPE") == ""

    # What was there is there, on the new file system (owner, mode, dot file, symlink).
    content = sh(
        node, f"stat -c '%n %u:%g %a' {KUBELET}/pki {KUBELET}/pki/c && cat {KUBELET}/.hidden"
    ).stdout.split("\n")
    assert content[:3] == [f"{KUBELET}/pki 0:0 700", f"{KUBELET}/pki/c 1234:5678 640", "hidden"]
    assert sh(node, f"readlink {KUBELET}/link").stdout.strip() == "pki/c"
    assert sh(node, f"cat {KUBELET}/link").stdout.strip() == "cert"
    assert node.path(f"{KUBELET}/kubeconfig-bootstrap").is_file()  # written before the copy
    tmp = sorted(p.name for p in node.path(f"{BASE}/tmp").iterdir())
    assert "kubelet-data-volume" in tmp
    assert not sh(node, f"findmnt --noheadings {BASE}/tmp/kubelet-data-volume").stdout

    # Gardener's mount unit, so the next boot mounts it again.
    unit = node.path(f"/etc/systemd/system/{MOUNT_UNIT}").read_text()
    assert unit == mount_unit_text(MOUNT_OPTIONS_NO_QUOTA)
    mount = show(node, MOUNT_UNIT)
    assert mount["UnitFileState"] == "enabled", mount
    assert mount["ActiveState"] == "active", mount
    assert_rest_of_bootstrap_done(node)

    # Every boot runs bootstrap again: nothing changes, nothing is mounted twice.
    uuid = blkid(device, "UUID")
    before = mounts_on_kubelet_dir(node)
    again = bootstrap_again(node)
    assert again.returncode == 0, again.stderr
    assert f"kubelet data volume already mounted ({device})" in again.stdout
    assert blkid(device, "UUID") == uuid
    assert mounts_on_kubelet_dir(node) == before == 1

    # The mount unit is bootstrap's: an apply whose OSC does not name it leaves it mounted (its
    # orphan sweep takes only what OSCs had written); reset takes it back.
    checksum = await booted.agent.publish(osc_document([inline_file("/etc/dv/a.conf", "a\n")], []))
    await booted.agent.wait_applied(checksum)
    assert node.path("/etc/dv/a.conf").exists()
    assert show(node, MOUNT_UNIT)["ActiveState"] == "active"
    assert node.path(f"/etc/systemd/system/{MOUNT_UNIT}").read_text() == unit
    reset = sh(node, "/opt/node-agent/current/bin/node-agent reset")
    assert reset.returncode == 0, reset.stdout + reset.stderr
    assert f"removed unit /etc/systemd/system/{MOUNT_UNIT}" in reset.stdout.splitlines()
    assert not node.path(f"/etc/systemd/system/{MOUNT_UNIT}").exists()
    assert mounts_on_kubelet_dir(node) == 0
    print(f"\n{options} on {device} ({size} bytes)", end="")


async def test_no_disk_of_that_size_is_an_error_on_the_node_and_the_rest_is_done(
    disks: DiskFactory, boot: Boot, admin_api: ApiClient, size: int
) -> None:
    other = disks(size + 4096)
    booted = await boot(size)
    node = booted.node
    assert booted.init.returncode != 0  # the init unit shows that bootstrap is incomplete
    wanted = f"bootstrap.kubeletDataVolumeSize {size} bytes"
    assert f"no disk of {size} bytes for the kubelet data volume ({wanted})" in booted.init.stdout
    assert f"{other} (loop, {size + 4096} bytes)" in booted.init.stdout
    assert findmnt(node, "SOURCE") == []
    assert blkid(other, "TYPE") == ""
    assert_rest_of_bootstrap_done(node)
    assert not node.path(f"/etc/systemd/system/{MOUNT_UNIT}").exists()

    # Once the agent knows its Node: the same error as a Warning Event on it.
    name = booted.agent.node_name
    await wait_for(
        lambda: warning_messages(admin_api, name, f"no disk of {size} bytes", other),
        30,
        "a Warning Event naming the size and the disks",
    )


async def test_two_disks_of_that_size_are_an_error_and_neither_is_formatted(
    disks: DiskFactory, boot: Boot, size: int
) -> None:
    first, second = disks(size), disks(size)
    booted = await boot(size)
    assert booted.init.returncode != 0
    assert f"2 blank disks of {size} bytes could be the kubelet data volume" in booted.init.stdout
    assert f"{first}, {second}; refusing to guess" in booted.init.stdout
    assert blkid(first, "TYPE") == blkid(second, "TYPE") == ""
    assert findmnt(booted.node, "SOURCE") == []
    assert_rest_of_bootstrap_done(booted.node)


@pytest.fixture(scope="module")
def kernel_mounts_quota(tmp_path_factory: pytest.TempPathFactory) -> bool:
    """Whether this kernel mounts ext4 made with upstream's quota options (a scratch disk)."""
    image = tmp_path_factory.mktemp("quota") / "probe.img"
    device = loop_device(image, 32 * MIB)
    mnt = image.with_suffix(".mnt")
    mnt.mkdir()
    try:
        subprocess.run(
            [
                "mkfs.ext4",
                "-q",
                "-O",
                "quota",
                "-E",
                "quotatype=usrquota:grpquota:prjquota",
                device,
            ],
            capture_output=True,
            timeout=60,
            check=True,
        )
        mounted = (
            subprocess.run(
                ["mount", "-t", "ext4", "-o", "prjquota", device, str(mnt)],
                capture_output=True,
                timeout=30,
                check=False,
            ).returncode
            == 0
        )
        if mounted:
            subprocess.run(["umount", str(mnt)], timeout=30, check=True)
        return mounted
    finally:
        subprocess.run(["losetup", "-d", device], capture_output=True, timeout=30, check=False)


async def test_upstreams_quota_format_works_or_says_why_on_this_kernel(
    disks: DiskFactory, boot: Boot, size: int, kernel_mounts_quota: bool
) -> None:
    device = disks(size)
    booted = await boot(size, {})  # no override: upstream's ext4 with quotas, prjquota
    node = booted.node
    print(f"\nkernel mounts ext4 with quotas: {kernel_mounts_quota}", end="")
    if kernel_mounts_quota:
        assert booted.init.returncode == 0, booted.init.stdout[-3000:]
        assert "prjquota" in findmnt(node, "OPTIONS")[0].split(",")
        assert node.path(f"/etc/systemd/system/{MOUNT_UNIT}").read_text() == mount_unit_text()
        features = subprocess.run(
            ["tune2fs", "-l", device], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        line = next(x for x in features.splitlines() if x.startswith("Filesystem features:"))
        assert {"quota", "project"} <= set(line.split(":", 1)[1].split()), line
    else:
        assert booted.init.returncode != 0
        assert (
            f"cannot mount the new file system on {device} (a kernel without quota support "
            f"cannot; {QUOTA_ENV}=off formats without quotas)" in booted.init.stdout
        )
        assert findmnt(node, "SOURCE") == []
        assert blkid(device, "LABEL") == PREP_LABEL  # never taken for a finished volume
        assert not node.path(f"/etc/systemd/system/{MOUNT_UNIT}").exists()
        assert node.path(f"{KUBELET}/pki/c").read_text() == "cert\n"  # the kubelet's dir as it was
        assert_rest_of_bootstrap_done(node)
