"""A real machine for the bed: a QEMU VM booting the bed's Debian image (``vm/build-image.sh``)
with a NoCloud seed, so that cloud-init runs the user data on a kernel of the machine's own.

- **Boot.** QEMU's direct kernel boot of the image's cloud kernel and initrd. The image's disk
  is opened with ``snapshot=on``: writes go to a temporary overlay that lives as long as the
  QEMU process, so a reboot inside the guest keeps them and nothing reaches the cached image.
- **Acceleration.** KVM only where it works (``acceleration``): the host's CPU must offer
  hardware virtualization (``vmx`` or ``svm``), ``/dev/kvm`` must open, and a probe boot of the
  image's kernel with KVM must reach its first user-space process within a minute; the
  verdict is cached per QEMU, host kernel and image. Otherwise software emulation (TCG): on
  machines whose ``/dev/kvm`` opens without the CPU offering virtualization, a guest kernel was
  seen to hang right after decompression with KVM.
- **Seed.** A FAT file system labelled ``CIDATA`` (``mkfs.vfat`` and ``mcopy``): ``user-data``
  unchanged from the caller, the machine's ``meta-data`` (instance id, host name) and the
  platform's ``vendor-data`` (the bed's registry mirror and its CA; ``vendor_data``).
- **Network.** QEMU's user networking with ``restrict=on``: the guest reaches nothing but the
  ports of ``GUEST_ALIAS`` that ``guestfwd`` forwards, each connection through ``socat`` to a
  loopback port of the host (kube-apiserver, the registry).
- **Disks.** The image's disk, the seed, and, when the machine has one, a blank data disk of an
  exact size (a sparse file, written through: it is the machine's own).
- **Console and journal.** The first serial port (the kernel's console) is written to
  ``console.log`` in the VM's directory, the second, which the image's journald forwards every
  line to, to ``journal.log``: the bed's only view into the running machine, across reboots (a
  guest reboot is a reset inside the same QEMU process, so both files go on).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.testbed.controlplane import GUEST_ALIAS
from tests.testbed.systemd_ns import HarnessError

BUILD_SCRIPT = Path(__file__).parent / "vm" / "build-image.sh"
#: the guest's ports for the bed's services (forwarded to whatever loopback port each has)
API_PORT, REGISTRY_PORT = 6443, 5000
#: where the seed's vendor-data puts the registries' CA in the guest
GUEST_CA = "/etc/node-agent-test/registry-ca.crt"


def image_dir() -> Path:
    """Build (or reuse from the cache) the machine image; return its directory."""
    result = subprocess.run(
        ["sh", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=1800, check=False
    )
    if result.returncode != 0:
        raise HarnessError(f"building the VM image failed:\n{result.stderr[-4000:]}")
    return Path(result.stdout.strip().splitlines()[-1])


def vendor_data(
    registry_ca: bytes, mirrors: Mapping[str, str], files: Sequence[GuestFile] = ()
) -> str:
    """The platform's part of the seed, as a cloud provider's image would carry it: the
    registries' CA, a ``hosts.toml`` sending each upstream of ``mirrors`` (upstream ->
    ``host:port`` as the guest reaches it) to the bed's registry, and ``files`` of the image."""
    written = [{"path": GUEST_CA, "permissions": "0644", "content": registry_ca.decode()}]
    for f in files:
        written.append({"path": f.path, "permissions": f"{f.mode:04o}", "content": f.content})
    for upstream, host in mirrors.items():
        text = (
            f'server = "https://{upstream}"\n\n[host."https://{host}"]\n'
            f'  capabilities = ["pull", "resolve"]\n  ca = "{GUEST_CA}"\n'
        )
        path = f"/etc/containerd/certs.d/{upstream}/hosts.toml"
        written.append({"path": path, "permissions": "0644", "content": text})
    return "#cloud-config\n" + yaml.safe_dump({"write_files": written})


#: what the kernel prints once its first user-space process (the probe's ``/bin/true``) ended
PROBE_REACHED = "Attempted to kill init"
PROBE_TIMEOUT = 60.0


def kvm_possible(cpuinfo: str, kvm_opens: bool) -> bool:
    """Whether KVM is worth a probe: ``/dev/kvm`` opens and the CPU offers virtualization."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags.update(value.split())
    return kvm_opens and bool(flags & {"vmx", "svm"})


def _kvm_opens() -> bool:
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


def probe_kvm(image: Path, workdir: Path) -> bool:
    """Boot the image's kernel with KVM and ``init=/bin/true``: does it get to user space?"""
    workdir.mkdir(parents=True, exist_ok=True)
    console = workdir / "kvm-probe.log"
    argv = [
        "qemu-system-x86_64", "-machine", "q35,accel=kvm", "-cpu", "host", "-m", "512",
        "-nographic", "-no-reboot", "-monitor", "none", "-serial", f"file:{console}",
        "-kernel", str(image / "vmlinuz"), "-initrd", str(image / "initrd.img"),
        "-append", "root=LABEL=root ro console=ttyS0 init=/bin/true panic=-1",
        "-drive", f"file={image / 'disk.raw'},format=raw,if=virtio,snapshot=on",
    ]  # fmt: skip
    with subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as qemu:
        try:
            qemu.wait(timeout=PROBE_TIMEOUT)
        except subprocess.TimeoutExpired:
            qemu.kill()
            qemu.wait()
    try:
        return PROBE_REACHED in console.read_text(errors="replace")
    except OSError:
        return False


def acceleration(image: Path, workdir: Path) -> str:
    """``kvm`` where a probe boot with it works on this machine, else ``tcg``; the probe's
    verdict is kept in the cache beside the image, per QEMU and host kernel."""
    cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
    if not kvm_possible(cpuinfo, _kvm_opens()):
        return "tcg"
    qemu = subprocess.run(
        ["qemu-system-x86_64", "--version"], capture_output=True, text=True, check=False
    ).stdout.split("\n")[0]
    key = hashlib.sha256(f"{qemu}\0{os.uname().release}".encode()).hexdigest()[:16]
    verdict = image / f"accel-{key}"
    if not verdict.exists():
        tmp = verdict.with_name(f"{verdict.name}.{os.getpid()}")
        tmp.write_text("kvm" if probe_kvm(image, workdir) else "tcg")
        tmp.replace(verdict)
    return verdict.read_text().strip()


@dataclass(frozen=True)
class GuestFile:
    """A file the platform's image brings (written by cloud-init from the vendor-data)."""

    path: str
    content: str
    mode: int = 0o644


@dataclass
class VM:
    """One QEMU guest; ``forwards`` maps a guest port of ``GUEST_ALIAS`` to a host port."""

    workdir: Path
    hostname: str
    user_data: str
    vendor_data: str
    forwards: dict[int, int]
    memory_mb: int = 2048
    cpus: int = 2
    #: the size of a blank data disk, in bytes (none when 0)
    data_disk_bytes: int = 0
    #: QEMU's accelerator (``acceleration``); set by ``start``
    accel: str = "tcg"
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    started_at: float = 0.0

    @property
    def console(self) -> Path:
        return self.workdir / "console.log"

    @property
    def journal(self) -> Path:
        return self.workdir / "journal.log"

    @property
    def data_disk(self) -> Path:
        return self.workdir / "data.raw"

    def seed(self) -> Path:
        """The NoCloud seed image (FAT, label ``CIDATA``)."""
        files = self.workdir / "seed"
        files.mkdir(parents=True, exist_ok=True)
        (files / "user-data").write_text(self.user_data)
        (files / "vendor-data").write_text(self.vendor_data)
        meta = {"instance-id": f"iid-{self.hostname}", "local-hostname": self.hostname}
        (files / "meta-data").write_text(yaml.safe_dump(meta))
        image = self.workdir / "seed.img"
        image.unlink(missing_ok=True)
        for argv in (
            ["mkfs.vfat", "-n", "CIDATA", "-C", str(image), "2048"],
            ["mcopy", "-i", str(image), *(str(p) for p in sorted(files.iterdir())), "::/"],
        ):
            subprocess.run(argv, capture_output=True, check=True, timeout=60)
        return image

    def argv(self, image: Path, seed: Path) -> list[str]:
        forwards = [
            f"guestfwd=tcp:{GUEST_ALIAS}:{guest}-cmd:socat - TCP:127.0.0.1:{host}"
            for guest, host in sorted(self.forwards.items())
        ]
        return [
            "qemu-system-x86_64",
            "-machine",
            f"q35,accel={self.accel}",
            *(["-cpu", "host"] if self.accel == "kvm" else []),
            "-m",
            str(self.memory_mb),
            "-smp",
            str(self.cpus),
            "-nographic",
            "-kernel",
            str(image / "vmlinuz"),
            "-initrd",
            str(image / "initrd.img"),
            "-append",
            "root=LABEL=root rw console=ttyS0",
            "-drive",
            f"file={image / 'disk.raw'},format=raw,if=virtio,snapshot=on",
            "-drive",
            f"file={seed},format=raw,if=virtio,readonly=on",
            *(
                ["-drive", f"file={self.data_disk},format=raw,if=virtio"]
                if self.data_disk_bytes
                else []
            ),
            "-netdev",
            ",".join(["user", "id=n0", "restrict=on", *forwards]),
            "-device",
            "virtio-net-pci,netdev=n0",
            "-serial",
            f"file:{self.console}",
            "-serial",
            f"file:{self.journal}",
            "-monitor",
            "none",
        ]

    def start(self, image: Path) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.accel = acceleration(image, self.workdir)
        seed = self.seed()
        if self.data_disk_bytes:
            self.data_disk.unlink(missing_ok=True)
            with self.data_disk.open("wb") as disk:
                disk.truncate(self.data_disk_bytes)
        log = (self.workdir / "qemu.log").open("wb")
        self.process = subprocess.Popen(
            self.argv(image, seed), stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
        self.started_at = time.monotonic()

    def console_text(self) -> str:
        try:
            return self.console.read_text(errors="replace")
        except OSError:
            return ""

    def journal_size(self) -> int:
        """Where the journal stands now: ``journal_since`` reads what comes after."""
        try:
            return self.journal.stat().st_size
        except OSError:
            return 0

    def journal_since(self, offset: int = 0) -> str:
        try:
            with self.journal.open("rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


@contextlib.contextmanager
def running_vm(vm: VM, image: Path) -> Iterator[VM]:
    """``vm`` booted from ``image``; powered off (the QEMU process ended) on the way out."""
    vm.start(image)
    try:
        yield vm
    finally:
        vm.stop()
