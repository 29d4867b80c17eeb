"""A worker machine provisioned from what Gardener's own code generates, end to end.

Nothing of Gardener's output is rewritten: gardener-gen renders the provision files (the real
``init.sh``, ``gardener-node-init.service``, the agent's ``config-<version>.yaml``, the bootstrap
token) and the reconcile OSC for an MCM machine name; ``init.sh`` pulls the agent's image under
its name, ``europe-docker.pkg.dev/gardener-project/releases/gardener/node-agent:<version>``.
The bed has no network: a ``hosts.toml`` for ``europe-docker.pkg.dev`` sends containerd to the
bed's registry as a mirror, which holds node-agent's image under the agent's upstream name and
the real kubelet (``real_kubelet``) under the hyperkube's. From there the agent must get its
certificate, apply the reconcile OSC (which replaces the agent by the OSC's own unit and
binary), the kubelet must register its Node and become Ready, and then a Kubernetes patch update
must act on it. An emulated arm64 node gets the hyperkube image as Gardener publishes it, an index
of linux/amd64 and linux/arm64 (``real_kubelet.hyperkube_index``), and runs the arm64 kubelet.

What the bed changes, because its nodes share the host's network (several agents and kubelets
at once): the agent's two ports and the kubelet's health port move to free ports, in the
provision config and in the OSC's copy of it alike (the agent's own ``nodeAgent`` section names
the kubelet's ``/healthz``), through the unit's ``$KUBELET_EXTRA_ARGS`` file, as a machine image
would carry it. ``logrotate`` (which every Gardener node image has and the bed lacks) is a
stand-in. Timings are returned for ``bench/provision.py``; ``tests/integration/
test_gardener_provision.py`` asserts the behaviour.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from tests.testbed import gardener_osc as g
from tests.testbed import real_kubelet as rk
from tests.testbed.agent_harness import (
    node_labels,
    publish_osc,
    unique,
    wait_applied,
    wait_for,
)
from tests.testbed.agent_image import AgentImage, read_layout
from tests.testbed.bootstrap import (
    allow_kubelet_bootstrap,
    create_bootstrap_token,
    grant_node_agent_identity,
)
from tests.testbed.containerd import ContainerdNode
from tests.testbed.controlplane import ControlPlane, free_port
from tests.testbed.csr_approver import CSRApprover
from tests.testbed.gardener_gen import NEWEST, Generated, generate
from tests.testbed.registry import Registry
from tests.testbed.systemd_ns import IsolatedSystemd
from tests.testbed.userdata import hide_python, show

#: the registry every image of Gardener's OSC names
UPSTREAM_REGISTRY = "europe-docker.pkg.dev"
AGENT_REPOSITORY = "gardener-project/releases/gardener/node-agent"
HYPERKUBE_REPOSITORY = "gardener-project/releases/hyperkube"
BASE = "/var/lib/gardener-node-agent"
KUBECONFIG = f"{BASE}/credentials/kubeconfig"
BOOTSTRAP_TOKEN = f"{BASE}/credentials/bootstrap-token"
CLUSTER_CA = f"{BASE}/cluster-ca.crt"
AGENT_UNIT = "gardener-node-agent.service"
INIT_UNIT = "gardener-node-init.service"
AGENT_BINARY = "/opt/bin/gardener-node-agent"
KUBELET = "kubelet.service"
KUBELET_EXTRA_ARGS = "/var/lib/kubelet/extra_args"
#: Gardener's sshd-ensurer.service restarts every 5 s on a machine without sshd (the bed's): its
#: starts are that loop's, not the agent's
LOOPING = ("sshd-ensurer.service",)
VERSION_LABEL = "worker.gardener.cloud/kubernetes-version"
CHECKSUM = "checksum/cloud-config-data"


def mcm_machine_name() -> str:
    """``shoot--<project>--<shoot>-<pool>-z1-<hash>-<hash>``: as long as machine-controller-manager
    makes them (well over 40 characters, so the CSR's CN is over 64), unique in the session."""
    return f"shoot--testproj--{unique('shoot')}-worker-z1-7d9f8b6c5-q4x2z"


@dataclass(frozen=True)
class LocalPorts:
    """Where the bed's shared network moves the agent's and the kubelet's ports."""

    health: int
    metrics: int
    kubelet_healthz: int

    @classmethod
    def free(cls) -> LocalPorts:
        return cls(free_port(), free_port(), free_port())

    def config(self, text: str) -> str:
        """Gardener's rendering of the agent's config with the ports moved."""
        doc = yaml.safe_load(text)
        doc["server"] = {"healthProbes": {"port": self.health}, "metrics": {"port": self.metrics}}
        url = f"http://127.0.0.1:{self.kubelet_healthz}/healthz"
        doc["nodeAgent"] = {"healthCheck": {"kubeletHealthz": url}}
        return yaml.safe_dump(doc)

    def osc_yaml(self, gen: Generated) -> bytes:
        """Gardener's osc.yaml with only its copy of the agent's config localized (the rest
        byte for byte as Gardener encoded it)."""
        (item,) = [f for f in gen.osc["spec"]["files"] if f["path"] == gen.config_path]
        old = item["content"]["inline"]["data"]
        new = base64.b64encode(self.config(base64.b64decode(old).decode()).encode()).decode()
        assert gen.osc_yaml.count(old) == 1
        return gen.osc_yaml.replace(old, new).encode()


def serve_gardener_images(
    registry: Registry,
    cn: ContainerdNode,
    agent: AgentImage,
    gardener_version: str,
    versions: tuple[str, ...],
    *,
    arch: str = "amd64",
) -> None:
    """node-agent's image and the hyperkube images under Gardener's names in the bed's
    registry, and the node's ``certs.d`` sending Gardener's registry to it as a mirror. The
    agent's image is an index of linux/amd64 and linux/arm64, as Gardener's images are: the
    node's ``ctr`` takes its own platform's. The hyperkube images carry the real kubelet: for
    an ``arch`` other than amd64 (the emulated arm64 node) the index of both platforms, as
    Gardener publishes it, else the linux/amd64 image alone (the arm64 kubelet's layer is not
    compressed for nodes that never take it)."""
    registry.push(AGENT_REPOSITORY, gardener_version, read_layout(agent.layout))
    for version in versions:
        image = rk.hyperkube_image(version) if arch == "amd64" else rk.hyperkube_index(version)
        registry.push(HYPERKUBE_REPOSITORY, f"v{version}", image)
    cn.write_hosts_toml(
        UPSTREAM_REGISTRY, f"https://{UPSTREAM_REGISTRY}", (f"https://{registry.host}",)
    )


def prepare_machine(cn: ContainerdNode, machine: str, ports: LocalPorts) -> None:
    """What the machine image brings: its host name, no Python, logrotate, the kubelet's
    extra arguments file."""
    node = cn.node
    node.run(["hostname", machine])
    g.unmask(node, g.SYSCTL)
    hide_python(node)
    logrotate = node.path("/usr/sbin/logrotate")
    logrotate.write_text("#!/bin/sh\nexit 0\n")
    logrotate.chmod(0o755)
    extra = node.path(KUBELET_EXTRA_ARGS)
    extra.parent.mkdir(parents=True, exist_ok=True)
    extra.write_text(f"KUBELET_EXTRA_ARGS=--healthz-port={ports.kubelet_healthz}\n")
    if not node.path("/etc/environment").exists():
        node.path("/etc/environment").write_text("")


def os_release(version: str) -> str:
    """The machine image's ``/etc/os-release`` at ``version``: the bed's Debian stands for the
    pool's Garden Linux, whose version the kubelet reports and an in-place pool's OSC names (a
    machine whose OS differs from it is updated in place)."""
    return f'ID=gardenlinux\nNAME="Garden Linux"\nPRETTY_NAME="Garden Linux {version}"\n'


def image_os_release(node: IsolatedSystemd, gen: Generated) -> None:
    """The node's OS at the version an in-place pool's OSC names, as its machine image is."""
    version = gen.osc["spec"]["inPlaceUpdates"]["operatingSystemVersion"]
    target = node.path("/etc/os-release")
    target.unlink(missing_ok=True)  # Debian's is a link into /usr/lib
    target.write_text(os_release(version))


def play_user_data(node: IsolatedSystemd, gen: Generated, ports: LocalPorts) -> None:
    """The provision OSC as cloud-init runs it: every file with its permissions, every unit
    written and enabled as asked, the ones with ``command: start`` started (not waited for)."""
    for file in gen.provision_files:
        target = node.path(file.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        content = ports.config(file.content) if file.path == gen.config_path else file.content
        target.write_text(content)
        target.chmod(file.permissions if file.permissions is not None else 0o644)
    for unit in gen.provision_units:
        node.path(f"/etc/systemd/system/{unit['name']}").write_text(unit["content"])
    node.run(["systemctl", "daemon-reload"])
    for unit in gen.provision_units:
        if unit.get("enable"):
            node.run(["systemctl", "enable", unit["name"]], check=False)
    for unit in gen.provision_units:
        if unit.get("command") == "start":
            node.run(["systemctl", "restart", "--no-block", unit["name"]])


@dataclass
class ProvisionRun:
    """What happened, for the test to check and the bench to print."""

    machine: str
    first: Generated
    #: the pool's update (None: provisioned without one)
    update: Generated | None
    #: the Kubernetes versions of the pool and of its update (if any)
    versions: tuple[str, ...]
    #: seconds from starting the user data (or publishing the update) to each milestone
    timings: dict[str, float] = field(default_factory=dict)
    common_name: str = ""
    requester: str = ""
    bootstrap_username: str = ""
    #: the first OSC's checksum and the update's (if any)
    checksums: tuple[str, ...] = ()
    #: the units the update started again
    update_restarted: set[str] = field(default_factory=set)
    #: the agent unit's text after the first OSC, and the OSC's text for it
    agent_unit_after: str = ""
    agent_unit_in_osc: str = ""
    agent_pids: tuple[int, int] = (0, 0)
    labels: dict[str, str] = field(default_factory=dict)
    image_pulls: list[str] = field(default_factory=list)
    #: the version label of the first Node version seen with the update's checksum (upstream
    #: writes both in one patch: never the new checksum with the old version)
    label_with_update: str | None = None
    #: with the real kubelet: the user its signed client certificate names, its Node once
    #: Ready, the units Gardener's restart annotation started again, the Node after the update
    kubelet_user: str = ""
    node: client.V1Node | None = None
    restarted: set[str] = field(default_factory=set)
    update_node: client.V1Node | None = None
    #: where the bed moved the machine's ports (the OSCs published carry them)
    ports: LocalPorts | None = None


def print_journals(node: IsolatedSystemd) -> None:
    """The init unit's, the agent's and the kubelet's journal, for the report of a failing
    test."""
    for units in ((INIT_UNIT, AGENT_UNIT), (KUBELET,)):
        argv = ["journalctl", "--no-pager", "-o", "cat"] + [f"-u{unit}" for unit in units]
        out = node.run(argv, check=False).stdout
        print(f"--- journal of {', '.join(units)} ---\n" + out[-8000:])


def main_pid(node: IsolatedSystemd) -> int:
    return int(show(node, AGENT_UNIT).get("MainPID") or 0)


def restarted(node: IsolatedSystemd, before: int) -> bool:
    """The agent's unit runs a new process, and it is ready (Type=notify: READY=1 sent, its
    status socket open); under emulation the new process takes seconds to get there."""
    unit = show(node, AGENT_UNIT)
    pid = int(unit.get("MainPID") or 0)
    return pid not in (0, before) and unit.get("ActiveState") == "active"


async def _applied_label(
    admin: ApiClient, machine: str, checksum: str, timeout: float
) -> str | None:
    """Until the Node carries ``checksum``; the version label of that same Node object (read
    every 50 ms, so a label written a few hundred ms after the checksum is caught)."""
    core = client.CoreV1Api(admin)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        node = await core.read_node(machine)
        if (node.metadata.annotations or {}).get(CHECKSUM) == checksum:
            return (node.metadata.labels or {}).get(VERSION_LABEL)
        await asyncio.sleep(0.05)
    raise AssertionError(f"node annotation checksum {checksum[:12]} not seen in {timeout:.0f} s")


async def _label(admin: ApiClient, machine: str, version: str) -> bool:
    return (await node_labels(admin, machine)).get(VERSION_LABEL) == version


def _agent_unit(osc: dict[str, Any]) -> str:
    (unit,) = [u for u in osc["spec"]["units"] if u["name"] == AGENT_UNIT]
    return str(unit["content"])


async def provision_from_user_data(
    admin: ApiClient,
    control_plane: ControlPlane,
    approver: CSRApprover,
    cn: ContainerdNode,
    registry: Registry,
    agent: AgentImage,
    network: rk.PodNetwork,
    *,
    release: str = NEWEST,
    shapes: tuple[str, ...] = rk.SHAPES,
    in_place: bool = False,
    arch: str = "amd64",
    tick: Callable[[str], None] = lambda _: None,
) -> ProvisionRun:
    """Provision from Gardener ``release``'s user data, first OSC, Kubernetes update;
    ``tick(step)`` after each milestone. The kubelet is the real one (``real_kubelet``) of the
    pool's ``shapes`` (the first's and the update's; one shape: no update), for the node's
    ``arch``, on the pod ``network``: it registers the Node, which must become Ready, and
    Gardener's restart
    annotation acts on it before the update. The pool's machines are of ``arch`` (Gardener
    renders its OSC for it: the kubelet's ``kubernetes.io/arch`` label). ``in_place``: the pool
    updates in place, the update once machine-controller-manager says the node is drained."""
    node = cn.node
    machine = mcm_machine_name()
    token = await create_bootstrap_token(admin)
    args: dict[str, Any] = {
        "machine_name": machine,
        "api_server": control_plane.server,
        "ca_file": control_plane.ca_file,
        "bootstrap_token": token.token,
        "release": release,
        "architecture": arch,
    }
    versions = tuple(rk.SHAPE_VERSIONS[shape] for shape in shapes)
    first, *updates = (generate(shape, **args, in_place=in_place) for shape in shapes)
    update = updates[0] if updates else None
    # a patch update keeps the Secret, and so does any update of an in-place pool
    assert update is None or first.secret_name == update.secret_name
    run = ProvisionRun(machine, first, update, versions, bootstrap_username=token.username)
    serve_gardener_images(registry, cn, agent, first.gardener_version, versions, arch=arch)
    await grant_node_agent_identity(admin, machine, secret_names=[first.secret_name])
    ports = run.ports = LocalPorts.free()
    prepare_machine(cn, machine, ports)
    if in_place:
        image_os_release(node, first)
    await allow_kubelet_bootstrap(admin)
    kubelet_args = rk.prepare_node(node, first, network)
    extra = node.path(KUBELET_EXTRA_ARGS)
    extra.write_text(extra.read_text().rstrip("\n") + f" {kubelet_args}\n")
    # The Secret exists before the machine does, as in a shoot.
    checksum = await publish_osc(admin, first.secret_name, ports.osc_yaml(first))
    run.agent_unit_in_osc = _agent_unit(first.osc)
    core = client.CoreV1Api(admin)

    started = time.monotonic()
    play_user_data(node, first, ports)
    decision = await approver.wait_for_decision(outcome="approved", timeout=180)
    run.common_name, run.requester = decision.common_name, decision.username
    await wait_for(lambda: node.path(KUBECONFIG).exists(), 60, "the agent's kubeconfig")
    run.timings["user data -> certificate"] = time.monotonic() - started
    tick("certificate")
    run.agent_pids = (main_pid(node), 0)
    await wait_for(lambda: rk.node_registered(admin, machine), 240, "the kubelet's Node")
    run.timings["user data -> Node registered"] = time.monotonic() - started
    await wait_applied(admin, machine, checksum, timeout=180)
    run.timings["user data -> reconcile OSC applied"] = time.monotonic() - started
    tick("reconcile OSC applied")
    await wait_for(lambda: rk.node_ready(admin, machine), 120, "the Node Ready")
    run.timings["user data -> Node Ready"] = time.monotonic() - started
    run.kubelet_user = await rk.kubelet_csr_user(admin, machine)
    run.node = await core.read_node(machine)
    await wait_for(lambda: restarted(node, run.agent_pids[0]), 60, "the agent restarted")
    await wait_for(lambda: not node.path(BOOTSTRAP_TOKEN).exists(), 60, "the token dropped")
    run.agent_pids = (run.agent_pids[0], main_pid(node))
    run.agent_unit_after = node.path(f"/etc/systemd/system/{AGENT_UNIT}").read_text()
    clock = time.monotonic()
    run.restarted = await restart_kubelet_by_annotation(admin, node, machine, ports)
    run.timings["restart annotation -> kubelet healthy"] = time.monotonic() - clock
    run.checksums = (checksum,)
    if update is None:
        return run

    units = tuple(u["name"] for u in first.osc["spec"]["units"] if u["name"] not in LOOPING)
    before = g.unit_marks(node, units)
    if in_place:
        await rk.ready_for_update(admin, machine)
    clock = time.monotonic()
    checksum2 = await publish_osc(admin, update.secret_name, ports.osc_yaml(update))
    run.label_with_update = await _applied_label(admin, machine, checksum2, 180)
    run.timings["update published -> applied"] = time.monotonic() - clock
    tick("update applied")
    # The version label comes with the checksum (the version of the config the update wrote).
    await wait_for(lambda: _label(admin, machine, versions[1]), 60, "the update's version label")
    run.timings["update published -> version label"] = time.monotonic() - clock
    # The agent restarts last, on its new config (upstream's before it reports, ours after).
    before_update = run.agent_pids[1]
    await wait_for(lambda: restarted(node, before_update), 120, "the agent restarted on the update")
    run.timings["update published -> agent restarted"] = time.monotonic() - clock
    # the new kubelet from its image posts its version and keeps the Node Ready
    new = f"v{versions[1]}"
    await wait_for(lambda: rk.kubelet_version_reported(admin, machine, new), 120, "the new kubelet")
    run.timings["update published -> new kubelet reported"] = time.monotonic() - clock
    await wait_for(lambda: rk.node_ready(admin, machine), 60, "the Node Ready after it")
    run.update_node = await core.read_node(machine)
    run.update_restarted = g.started_again(before, g.unit_marks(node, units))
    run.labels = await node_labels(admin, machine)
    run.checksums = (checksum, checksum2)
    run.image_pulls = [e.path for e in registry.access_log() if "/manifests/" in e.path]
    return run


async def restart_kubelet_by_annotation(
    admin: ApiClient, node: IsolatedSystemd, machine: str, ports: LocalPorts
) -> set[str]:
    """Gardener's restart annotation for the kubelet on the Node: until the agent acted on it
    and removed it, and the real kubelet is healthy and the Node Ready again; the units that
    started again."""
    core = client.CoreV1Api(admin)
    before = g.unit_marks(node, (KUBELET,))
    patch = {"metadata": {"annotations": {rk.RESTART_ANNOTATION: "kubelet"}}}
    await core.patch_node(machine, patch)

    async def annotation_done() -> bool:
        obj = await core.read_node(machine)
        return rk.RESTART_ANNOTATION not in (obj.metadata.annotations or {})

    await wait_for(annotation_done, 60, "the restart annotation acted on and removed")
    restarted_units = g.started_again(before, g.unit_marks(node, (KUBELET,)))
    await wait_for(lambda: rk.kubelet_healthz(ports.kubelet_healthz), 60, "the kubelet's /healthz")
    await wait_for(lambda: rk.node_ready(admin, machine), 60, "the Node Ready after the restart")
    return restarted_units


async def in_place_ca_rotation(admin: ApiClient, run: ProvisionRun, initiated: str) -> str:
    """Gardener's CA rotation in an in-place pool: the pool's last OSC with
    ``credentialsRotation.certificateAuthorities.lastInitiationTime`` set to ``initiated``,
    published once machine-controller-manager says the node is drained; until the Node
    carries its checksum (returned)."""
    assert run.ports is not None
    assert run.update is not None
    doc = yaml.safe_load(run.ports.osc_yaml(run.update))
    rotation = {"certificateAuthorities": {"lastInitiationTime": initiated}}
    doc["spec"]["inPlaceUpdates"]["credentialsRotation"] = rotation
    await rk.ready_for_update(admin, run.machine)
    checksum = await publish_osc(admin, run.update.secret_name, yaml.safe_dump(doc).encode())
    await wait_applied(admin, run.machine, checksum, timeout=180)
    return checksum
