"""What Gardener v1.150.0's own code writes to a node, on the real test bed: node-agent comes up
on it, and so does upstream gardener-node-agent of the same release (the reference twin).

gardener-gen renders the provision files (``tests/testbed/gardener_gen.py``) with the bed's
API server, CA, a real bootstrap token and a machine name as long as machine-controller-manager
makes them; the files are written as cloud-init writes them. Both agents must get a certificate
from the real kube-controller-manager through the approver and apply an OSC from the Secret that
Gardener's config names.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from node_agent.base.layout import BASE_DIR, KUBECONFIG_FILE
from node_agent.config import AgentSettings, load_config
from node_agent.kube import certificates
from tests.testbed.agent_harness import (
    AgentSetup,
    create_node,
    host,
    inline_file,
    node_annotations,
    node_labels,
    osc_document,
    publish_osc,
    read_lease,
    running_agent,
    service,
    unique,
    wait_applied,
    wait_for,
)
from tests.testbed.bootstrap import create_bootstrap_token, grant_node_agent_identity
from tests.testbed.containerd import ContainerdNode
from tests.testbed.controlplane import ControlPlane, free_port
from tests.testbed.csr_approver import CSRApprover
from tests.testbed.gardener_gen import Generated, gardener_node_agent, generate
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:Attribute.s length")]

UPSTREAM_BINARY = "/opt/bin/gardener-node-agent"
UPSTREAM_UNIT = "gardener-node-agent.service"


def mcm_machine_name() -> str:
    """``shoot--<project>--<shoot>-<pool>-z1-<hash>-<hash>``, unique in the session."""
    return f"shoot--testproj--{unique('shoot')}-worker-z1-7d9f8b6c5-q4x2z"


async def provision(
    root: Path, control_plane: ControlPlane, admin: ApiClient, machine: str
) -> Generated:
    """Gardener's provision files for ``machine`` under ``root``, as cloud-init writes them
    (without running init.sh: the agent is started directly)."""
    token = await create_bootstrap_token(admin)
    gen = generate(
        "k8s-1.33",
        machine_name=machine,
        api_server=control_plane.server,
        ca_file=control_plane.ca_file,
        bootstrap_token=token.token,
    )
    await grant_node_agent_identity(admin, machine, secret_names=[gen.secret_name])
    # The Secret's name follows the pool's shape, and the control plane is the session's: an
    # earlier test's OSC under the same name would be applied first. Start without one.
    with contextlib.suppress(ApiException):
        await client.CoreV1Api(admin).delete_namespaced_secret(gen.secret_name, "kube-system")
    for file in gen.provision_files:
        if not file.path.startswith(f"{BASE_DIR}/") or file.path.endswith("/init.sh"):
            continue
        target = host(root, file.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(file.content)
        target.chmod(file.permissions if file.permissions is not None else 0o600)
    return gen


def subject_cn(kubeconfig: Path) -> str:
    pem = certificates.kubeconfig_certificate(kubeconfig.read_bytes())
    assert pem is not None
    cert = x509.load_pem_x509_certificate(pem)
    return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


async def test_node_agent_comes_up_on_gardeners_own_provision_files(
    gardener_controlplane: ControlPlane,
    admin_api: ApiClient,
    csr_approver: CSRApprover,
    node: IsolatedSystemd,
) -> None:
    """Gardener's config file as Gardener encodes it (``kubeconfig: ""``, ``qps: 0``, empty
    log settings) and an MCM machine name: certificate, Node, OSC, Lease."""
    machine = mcm_machine_name()
    root = node.root
    gen = await provision(root, gardener_controlplane, admin_api, machine)
    config_file = host(root, gen.config_path)
    assert 'kubeconfig: ""' in config_file.read_text()
    config = load_config(config_file)
    settings = AgentSettings(root=root, config_file=gen.config_path)
    setup = AgentSetup(root, config_file, host(root, "/nonexistent"), settings, config)

    async with running_agent(setup, host_name=machine, systemd=node):
        await wait_for(lambda: host(root, KUBECONFIG_FILE).exists(), 60, "the kubeconfig")
        assert subject_cn(host(root, KUBECONFIG_FILE)) == (
            f"gardener.cloud:node-agent:machine:{machine}"
        )
        await create_node(admin_api, machine)
        checksum = await publish_osc(
            admin_api,
            gen.secret_name,
            osc_document([], [service("generated.service", command="start", enable=True)]),
        )
        await wait_applied(admin_api, machine, checksum, timeout=60)
        await wait_for(lambda: read_lease(admin_api, machine), 20, "the lease")
    assert csr_approver.errors == []


# --- the reference twin: upstream gardener-node-agent -----------------------------------------


@pytest.fixture
def upstream_journal(containerd_node: ContainerdNode) -> Iterator[None]:
    """Upstream's journal in the report of a failing test."""
    yield
    out = containerd_node.node.run(
        ["journalctl", "--no-pager", "-o", "cat", "-u", UPSTREAM_UNIT], check=False
    )
    # without the health checks of kubelet and containerd, which the bed's node does not run
    lines = [line for line in out.stdout.splitlines() if '"health-check"' not in line]
    print("--- journal of upstream gardener-node-agent ---\n" + "\n".join(lines)[-12000:])


async def allow_upstream_caches(admin: ApiClient, machine: str) -> None:
    """Upstream's caches list and watch: Nodes by label (before its Node is known), Pods on its
    Node, Leases in kube-system. Gardener's node-agent authorizer allows that; the bed's RBAC
    grants node-agent's rule set (reads by name), so the twin gets list/watch on top."""
    rbac = client.RbacAuthorizationV1Api(admin)
    name = f"upstream-twin-{machine}"
    await rbac.create_cluster_role(
        client.V1ClusterRole(
            metadata=client.V1ObjectMeta(name=name),
            rules=[
                client.V1PolicyRule(
                    api_groups=[""], resources=["nodes", "pods"], verbs=["list", "watch"]
                ),
                client.V1PolicyRule(
                    api_groups=["coordination.k8s.io"],
                    resources=["leases"],
                    verbs=["list", "watch"],
                ),
            ],
        )
    )
    await rbac.create_cluster_role_binding(
        client.V1ClusterRoleBinding(
            metadata=client.V1ObjectMeta(name=name),
            role_ref=client.V1RoleRef(
                api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=name
            ),
            subjects=[
                client.RbacV1Subject(
                    api_group="rbac.authorization.k8s.io",
                    kind="User",
                    name=f"gardener.cloud:node-agent:machine:{machine}",
                )
            ],
        )
    )


def twin_osc() -> dict[str, Any]:
    """A small OSC both agents can apply on a node without kubelet or images."""
    return osc_document(
        [inline_file("/etc/twin/plain.txt", "written by the agent\n")],
        [service("twin.service", command="start", enable=True)],
    )


async def test_upstream_gardener_node_agent_runs_on_the_bed_as_the_reference_twin(
    gardener_controlplane: ControlPlane,
    admin_api: ApiClient,
    csr_approver: CSRApprover,
    containerd_node: ContainerdNode,
    upstream_journal: None,
) -> None:
    """Upstream's binary, Gardener's provision files and Gardener's unit for the agent: it
    gets its certificate (for an MCM machine name), applies the OSC and reports on its Node.
    The node runs containerd: upstream restarts it after writing its configuration."""
    node = containerd_node.node
    machine = mcm_machine_name()
    root = node.root
    node.run(["hostname", machine])  # upstream finds its Node by the host name
    gen = await provision(root, gardener_controlplane, admin_api, machine)
    await allow_upstream_caches(admin_api, machine)
    # The bed's host network is shared: the probe ports move off 2751/2752.
    config_file = host(root, gen.config_path)
    doc = yaml.safe_load(config_file.read_text())
    doc["server"] = {"healthProbes": {"port": free_port()}, "metrics": {"port": free_port()}}
    config_file.write_text(yaml.safe_dump(doc))
    binary = host(root, UPSTREAM_BINARY)
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.write_bytes(gardener_node_agent().read_bytes())
    binary.chmod(0o755)
    (unit,) = [u for u in gen.osc["spec"]["units"] if u["name"] == UPSTREAM_UNIT]
    unit_file = host(root, f"/etc/systemd/system/{UPSTREAM_UNIT}")
    unit_file.write_text(unit["content"])
    node.run(["systemctl", "daemon-reload"])
    node.run(["systemctl", "start", UPSTREAM_UNIT])

    decision = await csr_approver.wait_for_decision(outcome="approved", timeout=60)
    assert decision.common_name == f"gardener.cloud:node-agent:machine:{machine}"
    await wait_for(lambda: host(root, KUBECONFIG_FILE).exists(), 60, "upstream's kubeconfig")
    assert subject_cn(host(root, KUBECONFIG_FILE)) == decision.common_name
    # The kubelet registers the Node (after the CSR: a Node means "already bootstrapped").
    await create_node(admin_api, machine)

    osc = twin_osc()
    checksum = await publish_osc(admin_api, gen.secret_name, osc)
    await wait_applied(admin_api, machine, checksum, timeout=120)

    # What upstream wrote, for comparison with node-agent's own behaviour.
    written = host(root, "/etc/twin/plain.txt")
    unit_path = host(root, "/etc/systemd/system/twin.service")
    record = {
        "file_mode": oct(written.stat().st_mode & 0o777),
        "unit_mode": oct(unit_path.stat().st_mode & 0o777),
        "kubeconfig_mode": oct(host(root, KUBECONFIG_FILE).stat().st_mode & 0o777),
        "unit_active": node.run(["systemctl", "is-active", "twin.service"], check=False).stdout,
        "annotations": await node_annotations(admin_api, machine),
        "labels": await node_labels(admin_api, machine),
        "containerd": sorted(
            str(p.relative_to(root))
            for d in ("/etc/containerd", "/etc/systemd/system/containerd.service.d")
            if host(root, d).is_dir()
            for p in host(root, d).rglob("*")
        ),
        "last_applied": host(root, f"{BASE_DIR}/last-applied-osc.yaml").exists(),
        "bootstrap_token_left": host(root, f"{BASE_DIR}/credentials/bootstrap-token").exists(),
    }
    print("upstream twin:", json.dumps(record, indent=2, default=str))
    assert written.read_text() == "written by the agent\n"
    assert record["file_mode"] == "0o644"
    assert record["unit_mode"] == "0o600"  # upstream writes units 0600
    assert record["kubeconfig_mode"] == "0o600"
    assert str(record["unit_active"]).strip() == "active"
    await wait_for(lambda: read_lease(admin_api, machine), 30, "upstream's lease")
    node.run(["systemctl", "stop", UPSTREAM_UNIT], check=False)
    assert csr_approver.errors == []
