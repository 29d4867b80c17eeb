"""End to end from Gardener's own user data, for each tested Gardener release (the oldest and the
newest; ``make compat``: every one): the generated ``init.sh`` pulls the agent's image
under its upstream name through a mirror, the agent gets a certificate for an MCM-length machine
name, applies the generated reconcile OSC of a Kubernetes 1.34 pool (and with it becomes the
OSC's own unit and binary). That OSC starts the real kubelet from the hyperkube image its
``imageRef`` names (built from Kubernetes' Go module by the bed): it bootstraps its own client
certificate from the bootstrap kubeconfig node-agent left it (approved and signed by
kube-controller-manager), registers the Node with the labels of the OSC's flags and becomes
Ready, and node-agent reports on the Node the kubelet made. Then Gardener's restart annotation
and a Kubernetes patch update act on the real kubelet (tests/testbed/gardener_provision.py,
tests/testbed/real_kubelet.py; the timings of the same run are printed by bench/provision.py).
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from kubernetes_asyncio.client import ApiClient

from node_agent.osc import inplace as ip
from tests.testbed import gardener_provision as gp
from tests.testbed import real_kubelet as rk
from tests.testbed.agent_harness import node_annotations, node_events, node_labels, wait_for
from tests.testbed.agent_image import AgentImage, agent_image_layout
from tests.testbed.containerd import ContainerdNode
from tests.testbed.controlplane import ControlPlane
from tests.testbed.csr_approver import CSRApprover
from tests.testbed.gardener_gen import TESTED_RELEASES
from tests.testbed.registry import Registry
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="session")
def agent_image(workdir: Path) -> AgentImage:
    return agent_image_layout(workdir / "image-dist")


def agent_journal(node: IsolatedSystemd) -> list[str]:
    """What the agent's processes wrote (stdout and stderr), one entry a line: journald's
    ``_SYSTEMD_UNIT`` field, so systemd's own lines about the unit are not counted."""
    out = node.run(
        ["journalctl", "--no-pager", "-o", "cat", f"_SYSTEMD_UNIT={gp.AGENT_UNIT}"], check=False
    ).stdout
    return [line for line in out.splitlines() if line.strip()]


@pytest.fixture
def journal(containerd_node: ContainerdNode) -> Iterator[None]:
    """The init unit's, the agent's and the kubelet's journal in the report of a failing test."""
    yield
    gp.print_journals(containerd_node.node)


Provision = Callable[..., Awaitable[gp.ProvisionRun]]


@pytest.fixture
def provision(
    agent_image: AgentImage,
    admin_api: ApiClient,
    gardener_controlplane: ControlPlane,
    csr_approver: CSRApprover,
    containerd_node: ContainerdNode,
    registry: Registry,
    network: rk.PodNetwork,
    journal: None,
) -> Provision:
    """``provision(**options)``: the machine from Gardener's user data on the bed's node, with
    the real kubelet (``gardener_provision.provision_from_user_data``)."""

    async def run(**options: Any) -> gp.ProvisionRun:
        return await gp.provision_from_user_data(
            admin_api,
            gardener_controlplane,
            csr_approver,
            containerd_node,
            registry,
            agent_image,
            network=network,
            **options,
        )

    return run


@pytest.mark.parametrize("release", TESTED_RELEASES)
async def test_a_machine_comes_up_from_gardeners_generated_user_data_and_updates(
    release: str,
    provision: Provision,
    agent_image: AgentImage,
    gardener_controlplane: ControlPlane,
    csr_approver: CSRApprover,
    containerd_node: ContainerdNode,
) -> None:
    run = await provision(release=release)
    node = containerd_node.node
    assert run.first.gardener_version == release
    print("timings:", {k: round(v, 1) for k, v in run.timings.items()})
    assert len(run.machine) >= 40
    # the init script pulled the image by Gardener's name, through the mirror
    image = f"{gp.UPSTREAM_REGISTRY}/{gp.AGENT_REPOSITORY}:{run.first.gardener_version}"
    assert image in run.first.init_script
    assert image in containerd_node.images()
    assert f"/v2/{gp.AGENT_REPOSITORY}/manifests/{run.first.gardener_version}" in run.image_pulls
    # the certificate, requested with the bootstrap token, for the machine's full name
    assert run.requester == run.bootstrap_username
    assert run.common_name == f"gardener.cloud:node-agent:machine:{run.machine}"
    assert len(run.common_name) > 64
    # the reconcile OSC replaced the bootstrap's agent by the OSC's own unit and binary
    assert run.agent_unit_after == run.agent_unit_in_osc
    assert run.agent_pids[1] not in (0, run.agent_pids[0])
    assert node.path(gp.AGENT_BINARY).read_bytes() == agent_image.executable.read_bytes()
    assert not node.path(gp.BOOTSTRAP_TOKEN).exists()
    # the cluster CA as the release gives it: the file kubeconfigs name (from v1.147 on) or the
    # bundle itself, inline (up to v1.146: no cluster-ca.crt)
    kubeconfig = yaml.safe_load(node.path(gp.KUBECONFIG).read_text())
    cluster = kubeconfig["clusters"][0]["cluster"]
    ca = gardener_controlplane.ca_file.read_bytes()
    if "caBundle" in run.first.config:
        assert not node.path(gp.CLUSTER_CA).exists()
        assert base64.b64decode(cluster["certificate-authority-data"]) == ca
    else:
        assert node.path(cluster["certificate-authority"]).read_bytes() == ca
    # the Node is the real kubelet's own: registered with its certificate, labelled by the OSC's
    # flags, Ready; node-agent found it by its hostname label and reported the OSC on it
    first, patch = run.versions
    assert run.node is not None
    ready = [c.status for c in run.node.status.conditions if c.type == "Ready"]
    assert ready == ["True"], run.node.status.conditions
    assert run.kubelet_user == f"system:node:{run.machine}"
    labels = run.node.metadata.labels
    assert labels["kubernetes.io/hostname"] == run.machine
    assert labels["worker.gardener.cloud/pool"] == "worker"
    assert labels[gp.VERSION_LABEL] == first
    assert run.node.status.node_info.kubelet_version == f"v{first}"
    assert (run.node.metadata.annotations or {}).get(gp.CHECKSUM) == run.checksums[0]
    # upstream's rule: the kubelet's bootstrap kubeconfig goes once the Node exists; the
    # kubelet's own kubeconfig stays
    assert not node.path("/var/lib/kubelet/kubeconfig-bootstrap").exists()
    assert node.path("/var/lib/kubelet/kubeconfig-real").exists()
    # the restart annotation restarted exactly the kubelet, which came back healthy and Ready
    assert run.restarted == {gp.KUBELET}
    # the patch update: the new kubelet, restarted with the agent (its config changed), nothing
    # else; the Node's version label follows, and the Node is Ready on the new kubelet
    assert run.update_restarted == {gp.KUBELET, gp.AGENT_UNIT}
    assert run.labels[gp.VERSION_LABEL] == patch
    # in the same Node object as the update's checksum, as upstream writes both in one patch
    assert run.label_with_update == patch
    assert f"/v2/{gp.HYPERKUBE_REPOSITORY}/manifests/v{patch}" in run.image_pulls
    assert run.update_node is not None
    assert run.update_node.status.node_info.kubelet_version == f"v{patch}"
    assert run.update_node.metadata.annotations[gp.CHECKSUM] == run.checksums[1]
    assert csr_approver.errors == []
    # The agent's journal, from the bootstrap to the update, is JSON and has no error: a first
    # boot that logs "OSC partly applied" or a plain-text warning is not upstream's first boot.
    lines = agent_journal(node)
    assert lines
    not_json, errors = [], []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            not_json.append(line)
            continue
        if event.get("level") in ("error", "critical"):
            errors.append(line)
    assert not_json == [], not_json
    assert errors == [], errors


async def test_an_in_place_pool_takes_the_real_kubelet_to_its_next_minor(
    provision: Provision,
) -> None:
    """An in-place pool of Kubernetes 1.33 updated to 1.34: the same Secret, the update held
    until machine-controller-manager says the node is drained, then kubelet 1.34.0 from its
    image, its health awaited, the outcome on the Node."""
    run = await provision(shapes=("k8s-1.33", "k8s-1.34"), in_place=True)
    print("timings:", {k: round(v, 1) for k, v in run.timings.items()})
    first, minor = run.versions
    assert (first, minor) == ("1.33.0", "1.34.0")
    assert run.node is not None
    assert run.node.status.node_info.kubelet_version == f"v{first}"
    assert run.restarted == {gp.KUBELET}
    # the minor update, in place: the new kubelet and the agent (its config) restarted, nothing
    # else; the Node is Ready on kubelet 1.34.0 and says the update succeeded
    assert run.update_restarted == {gp.KUBELET, gp.AGENT_UNIT}
    assert run.update_node is not None
    assert run.update_node.status.node_info.kubelet_version == f"v{minor}"
    assert run.labels[gp.VERSION_LABEL] == minor
    assert run.labels[ip.LABEL_UPDATE_RESULT] == "successful"
    assert run.update_node.metadata.annotations[gp.CHECKSUM] == run.checksums[1]
    assert f"/v2/{gp.HYPERKUBE_REPOSITORY}/manifests/v{minor}" in run.image_pulls


def kubelet_client_serial(node: IsolatedSystemd) -> int:
    """The serial of the kubelet's current client certificate (0 while it has none)."""
    path = node.path(ip.KUBELET_CLIENT_CERT)
    if path.is_symlink():  # the kubelet's link names the dated file by its path on the node
        path = node.path(os.readlink(path))
    if not path.exists():
        return 0
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


async def test_an_in_place_ca_rotation_rebootstraps_the_real_kubelet(
    provision: Provision,
    admin_api: ApiClient,
    csr_approver: CSRApprover,
    containerd_node: ContainerdNode,
) -> None:
    """An in-place pool's CA rotation: the agent renews its own certificate, and the real
    kubelet, its credentials removed and its current certificate left as its bootstrap
    credential, requests a new client certificate itself and keeps the Node Ready."""
    run = await provision(in_place=True)
    node = containerd_node.node
    before = kubelet_client_serial(node)
    assert before
    checksum = await gp.in_place_ca_rotation(admin_api, run, "2026-11-29T10:00:00Z")
    await wait_for(
        lambda: kubelet_client_serial(node) not in (0, before), 120, "the kubelet's new certificate"
    )
    await wait_for(lambda: rk.node_ready(admin_api, run.machine), 120, "the Node Ready")
    labels = await node_labels(admin_api, run.machine)
    assert labels[ip.LABEL_UPDATE_RESULT] == "successful"
    assert (await node_annotations(admin_api, run.machine))[gp.CHECKSUM] == checksum
    messages = [
        e.message
        for e in await node_events(admin_api, run.machine)
        if e.reason == "InPlaceUpdateSuccessful"
    ]
    assert "in-place update (ca_rotation_kubelet, ca_rotation_node_agent) successful" in messages
    # the kubelet's new certificate names the same Node, signed by kube-controller-manager
    assert await rk.kubelet_csr_user(admin_api, run.machine) == f"system:node:{run.machine}"
    assert csr_approver.errors == []
