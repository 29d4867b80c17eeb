"""A machine provisioned from Gardener's user data whose kubelet is the real one.

The bed builds kubelet from Kubernetes' Go module (``build-controlplane.sh kubelet-<version>``,
cached like the control plane) at the versions of Gardener's ``k8s-1.33`` and ``k8s-1.34`` pool
shapes and their patch updates, which the bed's kube-apiserver serves under the version-skew
policy (kubelet up to three minors older), and serves it as Gardener does: ``/kubelet`` inside
the hyperkube image the OSC's ``imageRef`` names, under Gardener's name through the mirror. The
``k8s-1.34`` shapes' kubelets are also cross-built for linux/arm64, for the emulated arm64 node,
which gets the two-platform index.
Nothing of the generated user data or OSC is rewritten but what ``gardener_provision``
localizes (ports: the throwaway node shares the host's network); the kubelet's own server port
moves the same way, through ``$KUBELET_EXTRA_ARGS``, and so do the two flags the host's cgroups
need (``NO_QOS_CGROUPS``).

kube-controller-manager approves (``csrapproving``) and signs the kubelet's client CSR, made
with the bootstrap kubeconfig node-agent leaves it, under Gardener's bindings for it
(``bootstrap.allow_kubelet_bootstrap``). The kubelet registers the Node itself: the test makes
none. ``gardener_provision`` runs the flow on a throwaway node, ``vm_node`` on a VM.
"""

from __future__ import annotations

import base64
import functools
import json
import secrets
import subprocess
import urllib.request
from dataclasses import dataclass

from cryptography import x509
from cryptography.x509.oid import NameOID
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from node_agent.osc import inplace as ip
from tests.testbed import gardener_osc as g
from tests.testbed import oci
from tests.testbed.controlplane import binaries_dir, free_port
from tests.testbed.gardener_gen import Generated
from tests.testbed.systemd_ns import IsolatedSystemd

#: the pool's shape and its Kubernetes patch update, and their kubelets' versions (built from
#: tests/testbed/kubelet-<version>/go.mod, or the control plane's module at its own version)
SHAPES = ("k8s-1.34", "k8s-1.34-patch")
VERSIONS = ("1.34.0", "1.34.2")
#: the kubelet the bed builds for each of Gardener's pool shapes (``build-controlplane.sh``):
#: k8s-1.33 for an in-place kubelet minor update to k8s-1.34
SHAPE_VERSIONS = {
    "k8s-1.33": "1.33.0",
    "k8s-1.34": "1.34.0",
    "k8s-1.34-patch": "1.34.2",
}
KUBELET_SIGNER = "kubernetes.io/kube-apiserver-client-kubelet"
RESTART_ANNOTATION = "worker.gardener.cloud/restart-systemd-services"
#: the kernel settings the kubelet checks at start (Gardener's config has
#: ``protectKernelDefaults: true``) and Gardener's sysctl file sets
KERNEL_TUNABLES = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
#: the values the kubelet sets them to (or, protecting kernel defaults, insists on)
KUBELET_KERNEL_VALUES = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
SHADOW_DIR = "/run/node-agent-test/sysctl"
#: the host's cgroup v2 hierarchy has no controllers (they are bound to v1 hierarchies): a kubelet
#: that keeps QoS cgroups cannot set their cpu.weight (the first start logs it, a later one fails
#: on the cgroups the first made), so the throwaway node's kubelet keeps none
NO_QOS_CGROUPS = g.NO_QOS_CGROUPS
#: the iptables chains the kubelet makes at start
KUBELET_CHAINS = ("KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT")
#: where containerd's CRI looks for CNI (its defaults; Gardener's config keeps them) and where
#: Debian's containernetworking-plugins puts the plugins
CNI_CONF_DIR, CNI_BIN_DIR, DEBIAN_CNI_PLUGINS = "/etc/cni/net.d", "/opt/cni/bin", "/usr/lib/cni"


def kubelet_binary(version: str, arch: str = "amd64") -> bytes:
    """The real kubelet of ``version`` for linux/``arch``, as the bed built it."""
    return (binaries_dir(f"kubelet-{version}", arch) / "kubelet").read_bytes()


@functools.cache
def hyperkube_image(version: str, arch: str = "amd64") -> oci.Image:
    """Gardener's hyperkube image of ``version`` for linux/``arch``: the real kubelet (built
    once a session: its layer is tens of MiB to compress)."""
    kubelet = kubelet_binary(version, arch)
    files = {"/kubelet": (kubelet, 0o755), "/version": (f"v{version}".encode(), 0o644)}
    return oci.build_image(files, architecture=arch)


def hyperkube_index(version: str) -> oci.Index:
    """Gardener's hyperkube image of ``version`` as Gardener publishes it: an index of the
    linux/amd64 and linux/arm64 images."""
    return oci.build_index([hyperkube_image(version, arch) for arch in ("amd64", "arm64")])


def sysctl_values(gen: Generated) -> dict[str, str]:
    """``key -> value`` of Gardener's sysctl file in the OSC (keys with ``/``)."""
    (item,) = [f for f in gen.osc["spec"]["files"] if f["path"] == g.SYSCTL_FILE]
    inline = item["content"]["inline"]
    data = inline["data"]
    text = base64.b64decode(data).decode() if inline.get("encoding") == "b64" else data
    values = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.lstrip().startswith(("#", ";")):
            values[key.strip().replace(".", "/")] = value.strip()
    return values


def shadow_kernel_tunables(node: IsolatedSystemd, values: dict[str, str]) -> None:
    """The node's view of the host-global kernel settings the kubelet checks, as the machine's
    sysctl file sets them: a file of the node's bind-mounted over each ``/proc/sys`` entry.
    The throwaway node shares the host's kernel, whose settings are not the node's to change
    (its ``/proc/sys`` is read-only); a VM's kernel is its own."""
    for key in KERNEL_TUNABLES:
        shadow = f"{SHADOW_DIR}/{key.replace('/', '.')}"
        node.path(shadow).parent.mkdir(parents=True, exist_ok=True)
        node.path(shadow).write_text(values[key] + "\n")
        node.run(["mount", "--bind", shadow, f"/proc/sys/{key}"])


@dataclass(frozen=True)
class PodNetwork:
    """The node's pod network: Debian's CNI plugins, a bridge of its own on the host's network
    (the throwaway node shares it) with a /24 of its own, not a gateway (that would turn on the
    host's IP forwarding, which the node's read-only ``/proc/sys`` refuses). A Gardener node
    gets its CNI from the shoot's network extension; the plain bridge stands in for it."""

    bridge: str
    subnet: str

    @classmethod
    def unique(cls) -> PodNetwork:
        n = secrets.randbelow(200) + 20
        return cls(f"nab{secrets.token_hex(4)}", f"10.{n}.{secrets.randbelow(250)}.0/24")

    def install(self, node: IsolatedSystemd) -> None:
        conf = {
            "cniVersion": "1.0.0",
            "name": "bed",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    "isGateway": False,
                    "ipMasq": False,
                    "ipam": {"type": "host-local", "subnet": self.subnet},
                }
            ],
        }
        node.path(CNI_CONF_DIR).mkdir(parents=True, exist_ok=True)
        node.path(f"{CNI_CONF_DIR}/10-bed.conflist").write_text(json.dumps(conf))
        bin_dir = node.path(CNI_BIN_DIR)
        bin_dir.parent.mkdir(parents=True, exist_ok=True)
        bin_dir.symlink_to(DEBIAN_CNI_PLUGINS)

    def remove(self) -> None:
        """What the node added to the host's network: the bridge (made at a pod's first
        sandbox) and the kubelet's iptables chains."""
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
        remove_kubelet_chains()


def remove_kubelet_chains() -> None:
    """The chains the kubelet makes at start (``KUBELET_CHAINS``, IPv4 and IPv6) and the rules
    of the built-in chains that jump to them, from the host's network, which the throwaway
    node shares (the kubelet keeps them on a machine for as long as it runs)."""
    for tool in ("iptables", "ip6tables"):
        for table in ("filter", "mangle", "nat"):
            listed = subprocess.run(
                [tool, "-w", "-t", table, "-S"], capture_output=True, text=True, check=False
            )
            for rule in listed.stdout.splitlines():
                parts = rule.split()
                jumps = parts[-2:-1] == ["-j"] and parts[-1] in KUBELET_CHAINS
                if parts[:1] == ["-A"] and jumps and parts[1] not in KUBELET_CHAINS:
                    delete = [tool, "-w", "-t", table, "-D", *parts[1:]]
                    subprocess.run(delete, capture_output=True, check=False)
            for chain in KUBELET_CHAINS:
                for flag in ("-F", "-X"):
                    argv = [tool, "-w", "-t", table, flag, chain]
                    subprocess.run(argv, capture_output=True, check=False)


def kubelet_healthz(port: int) -> bool:
    """The kubelet's ``/healthz`` answers ``ok`` (on the port the bed moved it to)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
            return bool(resp.status == 200 and resp.read() == b"ok")
    except OSError:
        return False


def prepare_node(node: IsolatedSystemd, gen: Generated, network: PodNetwork) -> str:
    """What a machine image and the network extension give the real kubelet on the throwaway
    node: the kernel settings it checks, the pod network; returns the kubelet arguments the
    host's network and cgroups need (its own server port, ``NO_QOS_CGROUPS``), for the unit's
    ``$KUBELET_EXTRA_ARGS``."""
    shadow_kernel_tunables(node, sysctl_values(gen))
    network.install(node)
    return f"--port={free_port()} {NO_QOS_CGROUPS}"


async def kubelet_version_reported(admin: ApiClient, machine: str, version: str) -> bool:
    """The Node's ``nodeInfo`` names the kubelet of ``version`` (it posts it when it starts)."""
    node = await client.CoreV1Api(admin).read_node(machine)
    info = node.status.node_info if node.status else None
    return info is not None and info.kubelet_version == version


async def node_registered(admin: ApiClient, node_name: str) -> bool:
    """The Node exists (the kubelet registered it)."""
    nodes = await client.CoreV1Api(admin).list_node(field_selector=f"metadata.name={node_name}")
    return bool(nodes.items)


async def node_ready(admin: ApiClient, node_name: str) -> bool:
    node = await client.CoreV1Api(admin).read_node(node_name)
    conditions = (node.status.conditions or []) if node.status else []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


async def kubelet_csr_user(admin: ApiClient, machine: str) -> str:
    """The common name of the kubelet's issued client certificate ("" while none is)."""
    csrs = await client.CertificatesV1Api(admin).list_certificate_signing_request()
    for csr in csrs.items:
        if csr.spec.signer_name == KUBELET_SIGNER and csr.status and csr.status.certificate:
            cert = x509.load_pem_x509_certificate(base64.b64decode(csr.status.certificate))
            (cn,) = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
            if str(cn.value) == f"system:node:{machine}":
                return str(cn.value)
    return ""


async def ready_for_update(admin: ApiClient, machine: str) -> None:
    """machine-controller-manager, once it drained the node for an in-place update."""
    condition = {
        "type": ip.CONDITION_IN_PLACE_UPDATE,
        "status": "True",
        "reason": ip.REASON_READY_FOR_UPDATE,
        "message": "node drained",
    }
    await client.CoreV1Api(admin).patch_node_status(
        machine, {"status": {"conditions": [condition]}}
    )
