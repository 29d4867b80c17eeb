"""The real kubelet, from Gardener's own user data: node-agent bootstraps from the generated
provision files, applies the generated reconcile OSC of a Kubernetes 1.34 pool (the kubelet
inside the hyperkube image its ``imageRef`` names, built from Kubernetes' Go module by the bed),
and that kubelet bootstraps its own client certificate from the bootstrap kubeconfig node-agent
left it (approved and signed by kube-controller-manager), registers the Node with the labels of
the OSC's flags and becomes Ready, and node-agent reports on the Node the kubelet made. Then
Gardener's restart annotation and a Kubernetes patch update act on the real kubelet
(tests/testbed/real_kubelet.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes_asyncio.client import ApiClient

from tests.testbed import gardener_provision as gp
from tests.testbed import real_kubelet as rk
from tests.testbed.agent_image import AgentImage, agent_image_layout
from tests.testbed.containerd import ContainerdNode
from tests.testbed.controlplane import ControlPlane
from tests.testbed.csr_approver import CSRApprover
from tests.testbed.registry import Registry

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="session")
def agent_image(workdir: Path) -> AgentImage:
    return agent_image_layout(workdir / "image-dist")


@pytest.fixture
def network() -> Iterator[rk.PodNetwork]:
    network = rk.PodNetwork.unique()
    yield network
    network.remove()


@pytest.fixture
def journal(containerd_node: ContainerdNode) -> Iterator[None]:
    """The agent's, the kubelet's and containerd's journal in the report of a failing test."""
    yield
    for unit in (gp.AGENT_UNIT, gp.KUBELET, "containerd.service"):
        out = containerd_node.node.run(
            ["journalctl", "--no-pager", "-o", "cat", "-u", unit], check=False
        ).stdout
        print(f"--- journal of {unit} ---\n" + out[-6000:])


async def test_the_real_kubelet_registers_its_node_from_gardeners_user_data(
    agent_image: AgentImage,
    admin_api: ApiClient,
    gardener_controlplane: ControlPlane,
    csr_approver: CSRApprover,
    containerd_node: ContainerdNode,
    registry: Registry,
    network: rk.PodNetwork,
    journal: None,
) -> None:
    run = await rk.provision(
        admin_api,
        gardener_controlplane,
        csr_approver,
        containerd_node,
        registry,
        agent_image,
        network,
    )
    print("timings:", {k: round(v, 1) for k, v in run.timings.items()})
    node = run.node
    assert node is not None
    ready = [c for c in node.status.conditions if c.type == "Ready"]
    assert [c.status for c in ready] == ["True"], ready
    labels = node.metadata.labels
    # the Node is the kubelet's own: registered with its certificate, labelled by the OSC's flags
    assert run.kubelet_user == f"system:node:{run.machine}"
    assert labels["kubernetes.io/hostname"] == run.machine
    assert labels["worker.gardener.cloud/pool"] == "worker"
    assert labels[gp.VERSION_LABEL] == rk.VERSIONS[0]
    assert node.status.node_info.kubelet_version == f"v{rk.VERSIONS[0]}"
    # node-agent found it and reported the OSC on it
    assert (node.metadata.annotations or {}).get(gp.CHECKSUM) == run.checksum
    # upstream's rule: the kubelet's bootstrap kubeconfig goes once the Node exists
    assert not containerd_node.node.path("/var/lib/kubelet/kubeconfig-bootstrap").exists()
    assert containerd_node.node.path("/var/lib/kubelet/kubeconfig-real").exists()
    # the restart annotation restarted exactly the kubelet, which came back healthy and Ready
    assert run.restarted == {gp.KUBELET}
    # the patch update: the next kubelet from its image, restarted with the agent (its config
    # changed), nothing else; the Node is Ready on the new kubelet with the new version label
    assert run.update_restarted == {gp.KUBELET, gp.AGENT_UNIT}
    updated = run.update_node
    assert updated is not None
    assert updated.status.node_info.kubelet_version == f"v{rk.VERSIONS[1]}"
    assert updated.metadata.labels[gp.VERSION_LABEL] == rk.VERSIONS[1]
    assert updated.metadata.annotations[gp.CHECKSUM] == run.update_checksum
