"""A worker machine that is a real VM, provisioned from Gardener's provision user data.

The user data is gardener-gen's rendering of the provision OSC (as Gardener's provider-local OS
extension renders it), byte for byte; cloud-init runs it on a VM of the bed's image
(``tests/testbed/vm.py``). The API server URL Gardener writes into it is the one the VM reaches:
``https://GUEST_ALIAS:API_PORT``, which QEMU forwards to the bed's kube-apiserver; nothing of
the user data or of the OSC is localized (the VM has a network and ports of its own). The
platform's part comes as the seed's vendor-data: the machine image's OS release
(``gardener_provision.os_release``: the pool's image version), the registry mirrors for
Gardener's registry and ``registry.k8s.io`` with the bed registry's CA, and the OS extension's
update command with the unit that finishes an update at the next boot (a machine image would
carry all of these).
node-agent comes from its image under Gardener's name, the real kubelet from the hyperkube image
the OSC names (``tests/testbed/real_kubelet.py``), the pod sandbox from the bed's pause program.

The pool updates in place and has a data volume for the kubelet, so one machine goes through:
provision (the data volume formatted and mounted on its own virtio disk) -> Node Ready -> a pod
-> the Kubernetes patch update (in an in-place pool a plain apply: only a minor version, the
kubelet's config, the OS or credentials are in-place parts) -> the OS update, drained, with the
machine's real reboot. The test plays machine-controller-manager (the drain condition) and the
OS extension (its command).
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from tests.testbed import gardener_provision as gp
from tests.testbed import oci, standin
from tests.testbed import real_kubelet as rk
from tests.testbed.agent_harness import publish_osc, wait_applied, wait_for
from tests.testbed.bootstrap import (
    allow_kubelet_bootstrap,
    create_bootstrap_token,
    grant_node_agent_identity,
)
from tests.testbed.controlplane import GUEST_ALIAS, ControlPlane
from tests.testbed.csr_approver import CSRApprover
from tests.testbed.gardener_gen import NEWEST, Generated, gardener_node_agent, generate
from tests.testbed.registry import Registry
from tests.testbed.vm import (
    API_PORT,
    REGISTRY_PORT,
    VM,
    GuestFile,
    image_dir,
    running_vm,
    vendor_data,
)

#: seconds for a milestone under software emulation (a cold run's loaded cores made the VM five
#: times slower than alone: 370 s from power-on to the agent's certificate instead of 74 s)
MILESTONE_TIMEOUT = 1200.0
#: the pool's data volume for the kubelet (a Gardener quantity) and the disk the VM gets for it
DATA_VOLUME, DATA_VOLUME_BYTES = "1Gi", 1 << 30
#: the machine image's versions: the pool's, then the in-place OS update's
IMAGE_VERSIONS = ("1877.5.0", "1877.6.0")
#: the pod sandbox image Gardener's OSC names (``criConfig.containerd.sandboxImage``)
SANDBOX_UPSTREAM, SANDBOX_REPOSITORY, SANDBOX_TAG = "registry.k8s.io", "pause", "3.10"
POD_NAMESPACE = "default"

#: where the OS update stages the new release, and the unit that puts it in place at boot
STAGED_RELEASE = "/var/lib/os-update/os-release"
FINISH_UNIT = "os-update-finish.service"
FINISH_UNIT_TEXT = f"""[Unit]
Description=put the OS release an update staged in place
DefaultDependencies=no
After=local-fs.target
Before=sysinit.target
ConditionPathExists={STAGED_RELEASE}

[Service]
Type=oneshot
ExecStart=/bin/mv -f {STAGED_RELEASE} /etc/os-release

[Install]
WantedBy=sysinit.target
"""
#: The OS extension's update command (the path the OSC's status names): the new version's
#: os-release staged for the next boot, then the machine reboots, a few seconds later so
#: that the command's caller sees it succeed.
UPDATE_SCRIPT = f"""#!/bin/sh
set -eu
if [ "${{1:-}}" != --version ] || [ -z "${{2:-}}" ]; then
  echo "usage: $0 --version VERSION" >&2; exit 2
fi
mkdir -p "$(dirname {STAGED_RELEASE})"
printf 'ID=gardenlinux\\nNAME="Garden Linux"\\nPRETTY_NAME="Garden Linux %s"\\n' "$2" \\
  > {STAGED_RELEASE}
systemctl enable {FINISH_UNIT}
systemd-run --on-active=5 --unit=os-update-reboot /bin/systemctl reboot
echo "update to $2 staged; the machine reboots"
"""

#: a unit systemd started, as the journal says it
_STARTED = re.compile(r"systemd\[1\]: Started ([\w@.\\-]+\.(?:service|mount|timer|path))")
_QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi)?$")
#: the image's footprint probe: the agent's whole service's PSS, every 30 s
_FOOTPRINT = re.compile(r"gardener-node-agent\.service pss_kib=(\d+)")


@dataclass
class VMRun:
    """What happened, for the test to check and the bench to print."""

    machine: str
    checksum: str = ""
    node: client.V1Node | None = None
    kubelet_user: str = ""
    #: seconds from power-on (or from the step's start) to each milestone
    timings: dict[str, float] = field(default_factory=dict)
    console: str = ""
    journal: str = ""
    pod: client.V1Pod | None = None
    #: the patch update: its checksum, the OSC's units it started, the Node after it
    patch_checksum: str = ""
    patch_started: set[str] = field(default_factory=set)
    patch_node: client.V1Node | None = None
    #: the OS update: its checksum, the Node after it
    os_checksum: str = ""
    os_node: client.V1Node | None = None


def upstream_agent_image(release: str = NEWEST) -> oci.Image:
    """Upstream gardener-node-agent of ``release`` (built from its Go module) as its image:
    the binary where ``init.sh`` copies it from."""
    binary = gardener_node_agent(release).read_bytes()
    return oci.build_image(
        {"/gardener-node-agent": (binary, 0o755)}, entrypoint=["/gardener-node-agent"]
    )


def pause_image() -> oci.Image:
    """The pod sandbox image: the bed's pause program (``standin/pause``) as ``/pause``."""
    binary = standin.build("pause").read_bytes()
    return oci.build_image({"/pause": (binary, 0o755)}, entrypoint=["/pause"])


def quantity_bytes(value: str) -> int:
    """A Node capacity quantity as the kubelet writes storage (plain, Ki, Mi or Gi)."""
    match = _QUANTITY.match(value)
    if match is None:
        raise ValueError(f"unexpected quantity {value!r}")
    scale = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}[match.group(2)]
    return int(match.group(1)) * scale


def started_units(journal: str, units: set[str]) -> set[str]:
    """Which of ``units`` the journal shows systemd starting."""
    return {m.group(1) for m in _STARTED.finditer(journal)} & units


def agent_pss_kib(journal: str) -> list[int]:
    """The agent service's PSS (KiB) as the image's probe logged it, in order; 0 when no
    process of it ran."""
    return [int(m.group(1)) for m in _FOOTPRINT.finditer(journal)]


def watched_units(gen: Generated) -> set[str]:
    """The OSC's units whose starts are the agent's doing: not those a timer of the OSC starts.
    (Gardener's sshd-ensurer.service counts: the machine has sshd, so it does not loop.)"""
    names = {str(u["name"]) for u in gen.osc["spec"]["units"]}
    timed = {n.removesuffix(".timer") + ".service" for n in names if n.endswith(".timer")}
    return names - timed


def pool(shape: str, image_version: str, machine: str, token: str, cp: ControlPlane) -> Generated:
    """Gardener's output for the VM's pool: in place, with a data volume for the kubelet."""
    return generate(
        shape,
        machine_name=machine,
        api_server=f"https://{GUEST_ALIAS}:{API_PORT}",
        ca_file=cp.ca_file,
        bootstrap_token=token,
        in_place=True,
        image_version=image_version,
        kubelet_data_volume=DATA_VOLUME,
    )


async def run_pod(
    admin: ApiClient, machine: str, timeout: float = MILESTONE_TIMEOUT
) -> client.V1Pod:
    """A pod bound to the machine by ``nodeName`` (no scheduler in the bed), on the pod network,
    its container the sandbox image; returned once it runs."""
    core = client.CoreV1Api(admin)
    account = client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="default"))
    try:  # the bed runs no service account controller
        await core.create_namespaced_service_account(POD_NAMESPACE, account)
    except ApiException as exc:
        if exc.status != 409:
            raise
    name = f"pause-{uuid.uuid4().hex[:8]}"
    image = f"{SANDBOX_UPSTREAM}/{SANDBOX_REPOSITORY}:{SANDBOX_TAG}"
    body = client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(
            node_name=machine,
            automount_service_account_token=False,
            tolerations=[client.V1Toleration(operator="Exists")],
            containers=[client.V1Container(name="pause", image=image)],
        ),
    )
    await core.create_namespaced_pod(POD_NAMESPACE, body)

    async def running() -> bool:
        pod = await core.read_namespaced_pod(name, POD_NAMESPACE)
        return bool(pod.status and pod.status.phase == "Running")

    await wait_for(running, timeout, f"pod {name} running", poll=1.0)
    pod: client.V1Pod = await core.read_namespaced_pod(name, POD_NAMESPACE)
    return pod


async def _reports(admin: ApiClient, machine: str, **info: str) -> bool:
    node = await client.CoreV1Api(admin).read_node(machine)
    node_info = node.status.node_info if node.status else None
    return node_info is not None and all(getattr(node_info, k) == v for k, v in info.items())


@contextlib.asynccontextmanager
async def powered_on(
    admin: ApiClient,
    control_plane: ControlPlane,
    registry: Registry,
    registry_ca: bytes,
    agent: oci.Image | oci.Index,
    workdir: Path,
) -> AsyncIterator[tuple[VM, VMRun, list[Generated]]]:
    """The VM powered on with the first OSC published, ``agent`` served as Gardener's
    node-agent image: the pool's three OSCs (provision, patch update, OS update) for the steps.
    Off on the way out, its console and journal kept."""
    machine = gp.mcm_machine_name()
    run = VMRun(machine)
    token = await create_bootstrap_token(admin)
    gens = [
        pool("k8s-1.34", IMAGE_VERSIONS[0], machine, token.token, control_plane),
        pool("k8s-1.34-patch", IMAGE_VERSIONS[0], machine, token.token, control_plane),
        pool("k8s-1.34-patch", IMAGE_VERSIONS[1], machine, token.token, control_plane),
    ]
    assert len({g.secret_name for g in gens}) == 1  # in place: one Secret throughout
    first = gens[0]
    registry.push(gp.AGENT_REPOSITORY, first.gardener_version, agent)
    for version in rk.VERSIONS:
        registry.push(gp.HYPERKUBE_REPOSITORY, f"v{version}", rk.hyperkube_image(version))
    registry.push(SANDBOX_REPOSITORY, SANDBOX_TAG, pause_image())
    await grant_node_agent_identity(admin, machine, secret_names=[first.secret_name])
    await allow_kubelet_bootstrap(admin)
    run.checksum = await publish_osc(admin, first.secret_name, first.osc_yaml.encode())
    command = str(first.reconcile_osc["status"]["inPlaceUpdates"]["osUpdate"]["command"])
    mirror = f"{GUEST_ALIAS}:{REGISTRY_PORT}"
    platform = vendor_data(
        registry_ca,
        {gp.UPSTREAM_REGISTRY: mirror, SANDBOX_UPSTREAM: mirror},
        [
            GuestFile("/etc/os-release", gp.os_release(IMAGE_VERSIONS[0])),
            GuestFile(command, UPDATE_SCRIPT, 0o755),
            GuestFile(f"/etc/systemd/system/{FINISH_UNIT}", FINISH_UNIT_TEXT),
        ],
    )
    vm = VM(
        workdir,
        machine,
        first.user_data,
        platform,
        {API_PORT: control_plane.port, REGISTRY_PORT: registry.port},
        data_disk_bytes=DATA_VOLUME_BYTES,
    )
    image = image_dir()
    try:
        with running_vm(vm, image):
            yield vm, run, gens
    finally:
        run.console = vm.console_text()
        run.journal = vm.journal_since()


async def provision(
    admin: ApiClient, machine: str, vm: VM, approver: CSRApprover, run: VMRun
) -> None:
    """Power-on until the real kubelet's Node is Ready and carries the reconcile OSC's
    checksum."""
    core = client.CoreV1Api(admin)
    await approver.wait_for_decision(outcome="approved", timeout=MILESTONE_TIMEOUT)
    run.timings["power-on -> agent's certificate"] = time.monotonic() - vm.started_at
    await wait_for(
        lambda: rk.node_registered(admin, machine), MILESTONE_TIMEOUT, "the kubelet's Node"
    )
    run.timings["power-on -> Node registered"] = time.monotonic() - vm.started_at
    await wait_applied(admin, machine, run.checksum, timeout=MILESTONE_TIMEOUT)
    run.timings["power-on -> reconcile OSC applied"] = time.monotonic() - vm.started_at
    await wait_for(lambda: rk.node_ready(admin, machine), MILESTONE_TIMEOUT, "Ready")
    run.timings["power-on -> Node Ready"] = time.monotonic() - vm.started_at
    run.kubelet_user = await rk.kubelet_csr_user(admin, machine)
    run.node = await core.read_node(machine)


async def patch_update(admin: ApiClient, vm: VM, run: VMRun, update: Generated) -> None:
    """The Kubernetes patch update: applied, the new kubelet reported, Ready again."""
    machine = run.machine
    mark, clock = vm.journal_size(), time.monotonic()
    run.patch_checksum = await publish_osc(admin, update.secret_name, update.osc_yaml.encode())
    await wait_applied(admin, machine, run.patch_checksum, timeout=MILESTONE_TIMEOUT)
    run.timings["patch update published -> applied"] = time.monotonic() - clock
    version = f"v{rk.VERSIONS[1]}"
    await wait_for(
        lambda: _reports(admin, machine, kubelet_version=version),
        MILESTONE_TIMEOUT,
        "the Node reporting the new kubelet",
    )
    await wait_for(lambda: rk.node_ready(admin, machine), MILESTONE_TIMEOUT, "Ready again")
    run.timings["patch update published -> new kubelet Ready"] = time.monotonic() - clock
    run.patch_started = started_units(vm.journal_since(mark), watched_units(update))
    run.patch_node = await client.CoreV1Api(admin).read_node(machine)


async def os_update(admin: ApiClient, vm: VM, run: VMRun, update: Generated) -> None:
    """The in-place OS update: drained, the OS extension's command, the machine's reboot, the
    agent completing the update after it."""
    machine = run.machine
    await rk.ready_for_update(admin, machine)
    clock = time.monotonic()
    run.os_checksum = await publish_osc(admin, update.secret_name, update.osc_yaml.encode())
    await wait_applied(admin, machine, run.os_checksum, timeout=MILESTONE_TIMEOUT)
    run.timings["OS update published -> completed after the reboot"] = time.monotonic() - clock
    await wait_for(lambda: rk.node_ready(admin, machine), MILESTONE_TIMEOUT, "Ready again")
    run.timings["OS update published -> Node Ready"] = time.monotonic() - clock
    run.os_node = await client.CoreV1Api(admin).read_node(machine)
