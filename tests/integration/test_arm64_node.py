"""An arm64 machine comes up from Gardener's own user data, under qemu-user emulation.

The node is an arm64 machine to everything that asks (tests/testbed/arm64_node.py): its
containerd and ``ctr`` are Debian's arm64 builds, run by the kernel through qemu-aarch64. Gardener's
generated ``init.sh``, unchanged, pulls the agent's image index by Gardener's name and ``ctr``
takes the linux/arm64 manifest; the arm64 agent bootstraps, gets its certificate, applies the
reconcile OSC (files, units, its own restart into the OSC's unit). Its kubelet is the real one,
cross-built by the bed for linux/arm64 and taken from the arm64 manifest of the two-platform
hyperkube index: it bootstraps its client certificate, registers the Node as an arm64 machine and
becomes Ready; the agent reports on that Node, acts on Gardener's restart annotation, and
``node-agent status`` answers (tests/testbed/gardener_provision.py runs the flow, as for
test_gardener_provision.py's x86-64 machine, which also takes the Kubernetes patch update: the
update's path is the same on both architectures, and a second arm64 kubelet build would cost a
cold ``make test`` minutes).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes_asyncio.client import ApiClient

from tests.testbed import gardener_provision as gp
from tests.testbed import real_kubelet as rk
from tests.testbed.agent_harness import wait_for
from tests.testbed.agent_image import (
    ELF_MACHINES,
    AgentImage,
    agent_image_layout,
    elf_machine,
    read_layout,
)
from tests.testbed.arm64_node import GO_UNDER_QEMU, arm64_containerd_node
from tests.testbed.containerd import ContainerdNode
from tests.testbed.controlplane import ControlPlane
from tests.testbed.csr_approver import CSRApprover
from tests.testbed.gardener_osc import KUBELET_BINARY
from tests.testbed.pki import CertificateAuthority
from tests.testbed.registry import Registry
from tests.testbed.userdata import show

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

AARCH64 = ELF_MACHINES["arm64"]


@pytest.fixture(scope="module")
def agent_image(workdir: Path) -> AgentImage:
    return agent_image_layout(workdir / "image-dist")


@pytest.fixture
def arm64_node(workdir: Path, registry_ca: CertificateAuthority) -> Iterator[ContainerdNode]:
    with arm64_containerd_node(workdir / "arm64-nodes", registry_ca.cert_path) as instance:
        yield instance


@pytest.fixture
def journal(arm64_node: ContainerdNode) -> Iterator[None]:
    """The init unit's, the agent's and the kubelet's journal in the report of a failing test."""
    yield
    gp.print_journals(arm64_node.node)


def manifests_fetched(registry: Registry, repository: str) -> set[str]:
    """The manifest digests (not tags) of ``repository`` that containerd fetched."""
    prefix = f"/v2/{repository}/manifests/"
    return {
        entry.path.removeprefix(prefix)
        for entry in registry.served(repository, user_agent="containerd/")
        if entry.path.startswith(prefix + "sha256:")
    }


def test_the_node_is_arm64_to_ctr(arm64_node: ContainerdNode) -> None:
    """What makes the node arm64: its ctr and containerd are arm64 programs, and ctr's default
    platform (what init.sh's pull and mount use) is linux/arm64."""
    node = arm64_node.node
    for program in ("/usr/bin/ctr", "/usr/bin/containerd"):
        assert elf_machine(node.path(program).read_bytes()) == AARCH64, program
    help_text = arm64_node.ctr("images", "mount", "--help").stdout
    assert '(default: "linux/arm64")' in help_text, help_text
    # Go under qemu-user runs without async preemption (it hangs now and then otherwise)
    pid = int(show(node, "containerd.service")["MainPID"])
    environ = node.path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert GO_UNDER_QEMU.encode() in environ, environ


async def test_an_arm64_machine_comes_up_from_gardeners_user_data(
    agent_image: AgentImage,
    admin_api: ApiClient,
    gardener_controlplane: ControlPlane,
    csr_approver: CSRApprover,
    arm64_node: ContainerdNode,
    registry: Registry,
    network: rk.PodNetwork,
    journal: None,
) -> None:
    run = await gp.provision_from_user_data(
        admin_api,
        gardener_controlplane,
        csr_approver,
        arm64_node,
        registry,
        agent_image,
        network,
        shapes=rk.SHAPES[:1],
        arch="arm64",
    )
    node = arm64_node.node
    print("timings (emulated arm64):", {k: round(v, 1) for k, v in run.timings.items()})

    # init.sh pulled the index by Gardener's name and took the arm64 manifest, not the amd64 one
    index = read_layout(agent_image.layout)
    image = f"{gp.UPSTREAM_REGISTRY}/{gp.AGENT_REPOSITORY}:{run.first.gardener_version}"
    assert image in run.first.init_script
    assert "--platform" not in run.first.init_script
    assert arm64_node.images()[image] == index.digest
    fetched = manifests_fetched(registry, gp.AGENT_REPOSITORY)
    assert index.image("arm64").digest in fetched
    assert index.image("amd64").digest not in fetched
    # and the agent the OSC keeps at /opt/bin is the arm64 single file
    binary = node.path(gp.AGENT_BINARY).read_bytes()
    assert elf_machine(binary) == AARCH64
    assert binary == agent_image.single_file("arm64").read_bytes()

    # the running agent is that arm64 program, run by the kernel through qemu-aarch64
    pid = int(show(node, gp.AGENT_UNIT)["MainPID"])
    exe = node.run(["readlink", f"/proc/{pid}/exe"]).stdout.strip()
    assert exe.endswith("qemu-aarch64-static"), exe
    argv = node.path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert argv[1].startswith(b"/var/cache/node-agent/"), argv  # the unpacked bootloader
    assert elf_machine(node.path(argv[1].decode()).read_bytes()) == AARCH64

    # the certificate, requested with the bootstrap token, for the machine's full name
    assert run.requester == run.bootstrap_username
    assert run.common_name == f"gardener.cloud:node-agent:machine:{run.machine}"
    # the reconcile OSC replaced the bootstrap's agent by the OSC's own unit; it restarted
    assert run.agent_unit_after == run.agent_unit_in_osc
    assert run.agent_pids[1] not in (0, run.agent_pids[0])
    assert not node.path(gp.BOOTSTRAP_TOKEN).exists()
    # the kubelet the OSC names by imageRef came from the hyperkube index's arm64 manifest: the
    # real arm64 kubelet, run through qemu-aarch64
    [version] = run.versions
    assert node.path(KUBELET_BINARY).read_bytes() == rk.kubelet_binary(version, "arm64")
    hyperkube = manifests_fetched(registry, gp.HYPERKUBE_REPOSITORY)
    assert rk.hyperkube_index(version).image("arm64").digest in hyperkube
    assert rk.hyperkube_index(version).image("amd64").digest not in hyperkube
    kubelet_pid = int(show(node, gp.KUBELET)["MainPID"])
    exe = node.run(["readlink", f"/proc/{kubelet_pid}/exe"]).stdout.strip()
    assert exe.endswith("qemu-aarch64-static"), exe
    # the Node is that kubelet's own: registered with the certificate it bootstrapped, an arm64
    # machine to the API server (and to Gardener, which rendered the OSC of an arm64 pool: its
    # kubelet flags label the Node so), Ready; node-agent reported the OSC on it
    assert run.node is not None
    assert run.kubelet_user == f"system:node:{run.machine}"
    assert run.node.metadata.labels["kubernetes.io/arch"] == "arm64"
    assert run.node.metadata.labels[gp.VERSION_LABEL] == version
    assert run.node.status.node_info.architecture == "arm64"
    assert run.node.status.node_info.kubelet_version == f"v{version}"
    ready = [c.status for c in run.node.status.conditions if c.type == "Ready"]
    assert ready == ["True"], run.node.status.conditions
    assert run.node.metadata.annotations[gp.CHECKSUM] == run.checksums[0]
    # Gardener's restart annotation restarted exactly the kubelet, which came back Ready
    assert run.restarted == {gp.KUBELET}
    assert csr_approver.errors == []

    # on the node: `node-agent status` answers from the running arm64 agent (the agent's unit in
    # Gardener's OSC is not Type=notify: active at exec, the socket a few seconds later under
    # emulation, while "status" says "not running: no socket" with exit code 3)
    answers: list[subprocess.CompletedProcess[str]] = []

    def status_answers() -> bool:
        answers.append(node.run([gp.AGENT_BINARY, "status", "--json"], check=False, timeout=120))
        if answers[-1].returncode != 0:
            return False
        # the restarted agent answers before it has looked its Node up again (slow under
        # emulation on a loaded machine): wait for the answer that names it
        return json.loads(answers[-1].stdout)["agent"].get("node_name") is not None

    await wait_for(status_answers, 120, "node-agent status answering with its Node", poll=1.0)
    out = answers[-1]
    doc = json.loads(out.stdout)
    assert doc["agent"]["running"] is True
    assert doc["agent"]["version"] == agent_image.version
    assert doc["agent"]["node_name"] == run.machine
    assert doc["osc"]["applied_checksum"] == run.checksums[0]
    assert doc["osc"]["up_to_date"] is True
    assert doc["last_apply"]["result"] == "succeeded"
