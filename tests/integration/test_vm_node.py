"""A real machine: a QEMU VM boots the bed's Debian image, cloud-init runs Gardener's provision
user data unchanged, node-agent bootstraps from it (the kubelet's data volume on the VM's own
blank disk) and applies the reconcile OSC, and the real kubelet registers its Node, which becomes
Ready and runs a pod; then, on the same machine, the pool's two in-place updates: the Kubernetes
patch update and the OS update with the machine's real reboot (tests/testbed/vm_node.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes_asyncio.client import ApiClient

from node_agent.osc import inplace as ip
from tests.testbed import gardener_provision as gp
from tests.testbed import real_kubelet as rk
from tests.testbed import vm_node
from tests.testbed.agent_image import AgentImage, agent_image_layout, read_layout
from tests.testbed.controlplane import ControlPlane
from tests.testbed.csr_approver import CSRApprover
from tests.testbed.pki import CertificateAuthority
from tests.testbed.registry import Registry

pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]


@pytest.fixture(scope="session")
def agent_image(workdir: Path) -> AgentImage:
    return agent_image_layout(workdir / "image-dist")


async def test_a_vm_from_gardeners_user_data_runs_a_pod_and_updates_in_place_through_a_reboot(
    agent_image: AgentImage,
    admin_api: ApiClient,
    gardener_controlplane: ControlPlane,
    csr_approver: CSRApprover,
    registry: Registry,
    registry_ca: CertificateAuthority,
    tmp_path: Path,
) -> None:
    async with vm_node.powered_on(
        admin_api,
        gardener_controlplane,
        registry,
        registry_ca.cert_path.read_bytes(),
        read_layout(agent_image.layout),
        tmp_path / "vm",
    ) as (vm, run, (_, patch, os_update)):
        try:
            await vm_node.provision(admin_api, run.machine, vm, csr_approver, run)
            run.pod = await vm_node.run_pod(admin_api, run.machine)
            await vm_node.patch_update(admin_api, vm, run, patch)
            await vm_node.os_update(admin_api, vm, run, os_update)
        finally:
            print("timings:", {k: round(v, 1) for k, v in run.timings.items()})
            print("--- the VM's console (tail) ---\n" + vm.console_text()[-4000:])
            print("--- the VM's journal (tail) ---\n" + vm.journal_since()[-12000:])

    # provisioned: the real kubelet's Node, Ready, on the machine's own kernel
    node = run.node
    assert node is not None
    assert [c.status for c in node.status.conditions if c.type == "Ready"] == ["True"]
    assert run.kubelet_user == f"system:node:{run.machine}"
    assert node.metadata.labels["kubernetes.io/hostname"] == run.machine
    assert node.metadata.labels[gp.VERSION_LABEL] == rk.VERSIONS[0]
    assert node.status.node_info.kubelet_version == f"v{rk.VERSIONS[0]}"
    assert node.metadata.annotations[gp.CHECKSUM] == run.checksum
    assert node.status.node_info.kernel_version.endswith("-cloud-amd64")
    # /var/lib/kubelet is the data volume: the kubelet's file system is the 1 GiB disk's
    storage = vm_node.quantity_bytes(node.status.capacity["ephemeral-storage"])
    assert 0.8 * vm_node.DATA_VOLUME_BYTES < storage <= vm_node.DATA_VOLUME_BYTES, storage
    assert "Mounted var-lib-kubelet.mount" in run.journal

    # a pod by nodeName: the sandbox image pulled through the mirror, an address of the pod network
    pod = run.pod
    assert pod is not None
    assert pod.status.phase == "Running"
    assert pod.status.pod_ip.startswith("10.244.0."), pod.status.pod_ip
    assert [s.ready for s in pod.status.container_statuses] == [True]

    # the patch update: exactly the kubelet and the agent started again
    after = run.patch_node
    assert after is not None
    assert after.metadata.annotations[gp.CHECKSUM] == run.patch_checksum
    assert after.status.node_info.kubelet_version == f"v{rk.VERSIONS[1]}"
    assert after.status.node_info.os_image == f"Garden Linux {vm_node.IMAGE_VERSIONS[0]}"
    assert run.patch_started == {gp.KUBELET, gp.AGENT_UNIT}, run.patch_started

    # the OS update: the machine rebooted (a new boot id) into the new release, and the agent
    # completed the update after it
    rebooted = run.os_node
    assert rebooted is not None
    assert rebooted.metadata.annotations[gp.CHECKSUM] == run.os_checksum
    assert rebooted.status.node_info.boot_id != after.status.node_info.boot_id
    assert rebooted.status.node_info.os_image == f"Garden Linux {vm_node.IMAGE_VERSIONS[1]}"
    assert rebooted.metadata.labels[ip.LABEL_UPDATE_RESULT] == "successful"
    assert ip.ANNOTATION_UPDATING_OS_VERSION not in rebooted.metadata.annotations
    assert [c.status for c in rebooted.status.conditions if c.type == "Ready"] == ["True"]
    assert vm_node.quantity_bytes(rebooted.status.capacity["ephemeral-storage"]) == storage
