"""A real machine: a QEMU VM boots the bed's Debian image, cloud-init runs Gardener's provision
user data unchanged, node-agent bootstraps from it and applies the reconcile OSC, and the real
kubelet registers its Node, which becomes Ready (tests/testbed/vm_node.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes_asyncio.client import ApiClient

from tests.testbed import gardener_provision as gp
from tests.testbed import real_kubelet as rk
from tests.testbed import vm_node
from tests.testbed.agent_image import AgentImage, agent_image_layout
from tests.testbed.controlplane import ControlPlane
from tests.testbed.csr_approver import CSRApprover
from tests.testbed.pki import CertificateAuthority
from tests.testbed.registry import Registry

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]


@pytest.fixture(scope="session")
def agent_image(workdir: Path) -> AgentImage:
    return agent_image_layout(workdir / "image-dist")


async def test_a_vm_boots_from_gardeners_user_data_and_its_real_kubelet_node_becomes_ready(
    agent_image: AgentImage,
    admin_api: ApiClient,
    gardener_controlplane: ControlPlane,
    csr_approver: CSRApprover,
    registry: Registry,
    registry_ca: CertificateAuthority,
    tmp_path: Path,
) -> None:
    run = await vm_node.provision(
        admin_api,
        gardener_controlplane,
        csr_approver,
        registry,
        registry_ca.cert_path.read_bytes(),
        agent_image,
        tmp_path / "vm",
    )
    print("timings:", {k: round(v, 1) for k, v in run.timings.items()})
    print("--- the VM's console (tail) ---\n" + run.console[-6000:])
    node = run.node
    assert node is not None
    ready = [c for c in node.status.conditions if c.type == "Ready"]
    assert [c.status for c in ready] == ["True"], ready
    assert run.kubelet_user == f"system:node:{run.machine}"
    assert node.metadata.labels["kubernetes.io/hostname"] == run.machine
    assert node.metadata.labels[gp.VERSION_LABEL] == rk.VERSIONS[0]
    assert node.status.node_info.kubelet_version == f"v{rk.VERSIONS[0]}"
    assert node.metadata.annotations[gp.CHECKSUM] == run.checksum
    # the machine's own kernel: Debian's cloud kernel of the image, not the host's
    assert node.status.node_info.kernel_version.endswith("-cloud-amd64")
