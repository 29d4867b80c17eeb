"""A worker machine that is a real VM, provisioned from Gardener's provision user data.

The user data is gardener-gen's rendering of the provision OSC (as Gardener's provider-local OS
extension renders it), byte for byte; cloud-init runs it on a VM of the bed's image
(``tests/testbed/vm.py``). The API server URL Gardener writes into it is the one the VM reaches:
``https://GUEST_ALIAS:API_PORT``, which QEMU forwards to the bed's kube-apiserver; nothing of
the user data or of the OSC is localized (the VM has a network and ports of its own). The
platform's part, the registry mirror for Gardener's registry and its CA, comes as the seed's
vendor-data. node-agent comes from its image under Gardener's name, the real kubelet from the
hyperkube image the OSC names (``tests/testbed/real_kubelet.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from tests.testbed import gardener_provision as gp
from tests.testbed import real_kubelet as rk
from tests.testbed.agent_harness import publish_osc, wait_applied, wait_for
from tests.testbed.agent_image import AgentImage, read_layout
from tests.testbed.bootstrap import (
    allow_kubelet_bootstrap,
    create_bootstrap_token,
    grant_node_agent_identity,
)
from tests.testbed.controlplane import GUEST_ALIAS, ControlPlane
from tests.testbed.csr_approver import CSRApprover
from tests.testbed.gardener_gen import generate
from tests.testbed.registry import Registry
from tests.testbed.vm import API_PORT, REGISTRY_PORT, VM, image_dir, running_vm, vendor_data

#: seconds for a milestone under software emulation
MILESTONE_TIMEOUT = 600.0


@dataclass
class VMRun:
    """What happened, for the test to check and the bench to print."""

    machine: str
    checksum: str = ""
    node: client.V1Node | None = None
    kubelet_user: str = ""
    #: seconds from power-on to each milestone
    timings: dict[str, float] = field(default_factory=dict)
    console: str = ""


async def provision(
    admin: ApiClient,
    control_plane: ControlPlane,
    approver: CSRApprover,
    registry: Registry,
    registry_ca: bytes,
    agent: AgentImage,
    workdir: Path,
) -> VMRun:
    """Power on a VM with Gardener's user data of a ``k8s-1.34`` pool; until its real kubelet's
    Node is Ready and carries the reconcile OSC's checksum. The VM is off on return."""
    machine = gp.mcm_machine_name()
    run = VMRun(machine)
    token = await create_bootstrap_token(admin)
    first = generate(
        rk.SHAPES[0],
        machine_name=machine,
        api_server=f"https://{GUEST_ALIAS}:{API_PORT}",
        ca_file=control_plane.ca_file,
        bootstrap_token=token.token,
    )
    registry.push(gp.AGENT_REPOSITORY, first.gardener_version, read_layout(agent.layout))
    registry.push(gp.HYPERKUBE_REPOSITORY, f"v{rk.VERSIONS[0]}", rk.hyperkube_image(rk.VERSIONS[0]))
    await grant_node_agent_identity(admin, machine, secret_names=[first.secret_name])
    await allow_kubelet_bootstrap(admin)
    run.checksum = await publish_osc(admin, first.secret_name, first.osc_yaml.encode())
    vm = VM(
        workdir,
        machine,
        first.user_data,
        vendor_data(registry_ca, {gp.UPSTREAM_REGISTRY: f"{GUEST_ALIAS}:{REGISTRY_PORT}"}),
        {API_PORT: control_plane.port, REGISTRY_PORT: registry.port},
    )
    core = client.CoreV1Api(admin)

    image = image_dir()
    try:
        with running_vm(vm, image):
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
    finally:
        run.console = vm.console_text()
    return run
