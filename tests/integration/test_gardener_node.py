"""End to end: a Gardener worker node comes up on node-agent's image, updates it, and resets.

A throwaway node with a real systemd, real containerd and no Python at all; a real registry (and
its pull-through mirror) holding two versions of the agent's image; kube-apiserver with
bootstrap-token authentication, kube-controller-manager signing client certificates, and an
approver deciding like Gardener's. The node gets Gardener-shaped provision user-data
(``tests/testbed/gardener_userdata.py``): its init unit pulls the image with ``ctr``, copies the
one file to ``/opt/bin/gardener-node-agent`` and runs ``bootstrap --config-dir``. From there the
agent must get its own certificate, apply the reconcile OSC of a containerd pool (which carries
the agent's own unit, config file and binary), drop the bootstrap token, update itself to the
second image and the next ``config-<version>.yaml`` without restarting anything else, and leave
nothing of itself behind after ``reset``.
"""

from __future__ import annotations

import datetime as dt
import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID
from kubernetes_asyncio.client import ApiClient

from node_agent.kube import certificates
from tests.testbed import gardener_osc as g
from tests.testbed import gardener_userdata as gu
from tests.testbed import oci
from tests.testbed import real_kubelet as rk
from tests.testbed.agent_harness import (
    create_node,
    node_events,
    publish_osc,
    read_lease,
    unique,
    wait_applied,
    wait_for,
)
from tests.testbed.agent_image import AgentImage, agent_image_layout, read_layout
from tests.testbed.bootstrap import (
    BootstrapToken,
    create_bootstrap_token,
    grant_node_agent_identity,
)
from tests.testbed.containerd import ContainerdNode
from tests.testbed.controlplane import ControlPlane, free_port
from tests.testbed.csr_approver import CSRApprover
from tests.testbed.registry import Registry
from tests.testbed.systemd_ns import IsolatedSystemd
from tests.testbed.userdata import hide_python, show

pytestmark = pytest.mark.integration

KUBECONFIG = f"{gu.BASE}/credentials/kubeconfig"
BOOTSTRAP_TOKEN = f"{gu.BASE}/credentials/bootstrap-token"
PREVIOUS = f"{gu.AGENT_BINARY}.previous"
UNPACK_ROOT = "/var/cache/node-agent"


@pytest.fixture(scope="session")
def agent_images(workdir: Path) -> tuple[AgentImage, AgentImage]:
    """The image as ``make image`` builds it, and the same sources built as a newer version
    (linux/amd64 alone: the nodes here are amd64, and an arm64 build of new sources takes
    minutes under emulation)."""
    first = agent_image_layout(workdir / "image-dist")
    second = agent_image_layout(
        workdir / "image-dist-next", version=f"{first.version}-next", arches=("amd64",)
    )
    return first, second


def agent_osc(
    pool: g.GardenerPool, provision: gu.Provision, image: str, gardener_version: str
) -> dict[str, Any]:
    """The pool's reconcile OSC with what Gardener adds for the agent: its config file (named
    after the Gardener version), the cluster CA, its binary from its image, its unit."""
    osc = pool.osc("1.33.0")
    config = f"{gu.BASE}/config-{gardener_version}.yaml"
    files = [f for f in osc["spec"]["files"] if f["path"] != g.AGENT_CONFIG]
    files += [
        {
            "path": config,
            "permissions": 0o600,
            "content": {"inline": {"encoding": "", "data": provision.agent_config()}},
        },
        {
            "path": gu.CA_FILE,
            "permissions": 0o644,
            "content": {"inline": {"encoding": "", "data": provision.ca_pem.decode()}},
        },
        {
            "path": gu.AGENT_BINARY,
            "permissions": 0o755,
            "content": {"imageRef": {"image": image, "filePathInImage": "/gardener-node-agent"}},
        },
    ]
    osc["spec"]["files"] = files
    osc["spec"]["units"].append(
        {
            "name": gu.AGENT_UNIT,
            "content": gu.agent_unit_text(),
            "command": "start",
            "enable": True,
            "filePaths": [config, gu.CA_FILE, gu.AGENT_BINARY],
        }
    )
    return osc


def agent_status(node: IsolatedSystemd) -> dict[str, Any]:
    out = node.run([gu.AGENT_BINARY, "status", "--json"], check=False)
    return dict(json.loads(out.stdout)) if out.stdout.strip().startswith("{") else {}


def main_pid(node: IsolatedSystemd) -> int:
    return int(show(node, gu.AGENT_UNIT).get("MainPID") or 0)


def load_state(node: IsolatedSystemd, unit: str) -> str:
    return node.run(["systemctl", "show", "-p", "LoadState", "--value", unit]).stdout.strip()


def process_env(node: IsolatedSystemd, pid: int) -> dict[str, str]:
    raw = node.path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def build_info_version(port: int) -> str | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("node_agent_build_info{"):
                return str(line.split('version="', 1)[1].split('"', 1)[0])
    return None


@pytest.fixture(autouse=True)
def kubelet_chains() -> Iterator[None]:
    """The pool's kubelet is the real one (standalone: the test makes the Node); its iptables
    chains go with the test, from the host's network the node shares."""
    yield
    rk.remove_kubelet_chains()


def push_agent_images(
    containerd_node: ContainerdNode,
    registry: Registry,
    mirror: Registry,
    images: tuple[AgentImage, AgentImage],
) -> tuple[g.GardenerPool, str, dict[str, str]]:
    """A Python-free node, a pool's images and the agent's two images in a repository of its
    own: ``(pool, repository, {version: ref})``."""
    node = containerd_node.node
    g.unmask(node, g.SYSCTL)
    hide_python(node)
    rk.shadow_kernel_tunables(node, rk.KUBELET_KERNEL_VALUES)  # what the real kubelet sets
    pool = g.GardenerPool.fresh(registry, mirror)
    pool.push_images(("1.33.0",), kubelet_image=rk.hyperkube_image)
    repository = f"gardener/node-agent-{uuid.uuid4().hex[:8]}"
    refs = {}
    for image in images:
        registry.push(repository, image.version, read_layout(image.layout))
        refs[image.version] = registry.ref(repository, image.version)
    return pool, repository, refs


async def provision_machine(
    admin_api: ApiClient, controlplane: ControlPlane, image: str
) -> tuple[str, str, BootstrapToken, gu.Provision]:
    """A machine allowed its OSC Secret, a bootstrap token and its provision user-data for
    ``image``: ``(machine, secret, token, provision)``."""
    machine = unique("machine")
    secret = f"osc-{machine}"
    token = await create_bootstrap_token(admin_api)
    await grant_node_agent_identity(admin_api, machine, secret_names=[secret])
    provision = gu.Provision(
        image=image,
        server=controlplane.server,
        ca_pem=controlplane.ca_file.read_bytes(),
        bootstrap_token=token.token,
        machine_name=machine,
        secret_name=secret,
        ports=(free_port(), free_port()),
    )
    return machine, secret, token, provision


@pytest.fixture
def journal(containerd_node: ContainerdNode) -> Iterator[None]:
    """The agent's journal in the report of a failing test."""
    yield
    out = containerd_node.node.run(
        ["journalctl", "--no-pager", "-o", "cat", "-u", gu.INIT_UNIT, "-u", gu.AGENT_UNIT],
        check=False,
    ).stdout
    print("--- journal of the init unit and the agent ---\n" + out[-6000:])


async def test_gardener_node_bootstraps_updates_itself_and_resets(
    agent_images: tuple[AgentImage, AgentImage],
    admin_api: ApiClient,
    gardener_controlplane: ControlPlane,
    csr_approver: CSRApprover,
    containerd_node: ContainerdNode,
    registry: Registry,
    mirror: Registry,
    journal: None,
) -> None:
    first, second = agent_images
    node = containerd_node.node
    pool, _, refs = push_agent_images(containerd_node, registry, mirror, agent_images)
    containerd_node.trust(registry.host)  # before any OSC: the user-data pulls directly

    machine, secret, token, provision = await provision_machine(
        admin_api, gardener_controlplane, refs[first.version]
    )
    started = dt.datetime.now(dt.UTC)
    clock = time.monotonic()

    # 1. Provision: init unit -> image -> /opt/bin -> bootstrap -> the agent's unit.
    gu.play(node, provision)
    decision = await csr_approver.wait_for_decision(outcome="approved", timeout=120)
    assert decision.username == token.username
    assert decision.common_name == f"gardener.cloud:node-agent:machine:{machine}"
    await wait_for(lambda: node.path(KUBECONFIG).exists(), 60, "the agent's kubeconfig")
    print(f"user-data -> agent's certificate: {time.monotonic() - clock:.1f}s")
    assert oct(node.path(KUBECONFIG).stat().st_mode & 0o777) == "0o600"
    pem = certificates.kubeconfig_certificate(node.path(KUBECONFIG).read_bytes())
    assert pem is not None
    cert = x509.load_pem_x509_certificate(pem)
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    assert cn == f"gardener.cloud:node-agent:machine:{machine}"
    ca = x509.load_pem_x509_certificate(provision.ca_pem)
    assert cert.issuer == ca.subject  # signed by kube-controller-manager with the cluster CA
    assert node.path(gu.AGENT_BINARY).read_bytes() == first.executable.read_bytes()
    await wait_for(
        lambda: show(node, gu.INIT_UNIT).get("UnitFileState") == "disabled",
        30,
        "bootstrap disabling the init unit once the agent is up",
    )

    # The kubelet registers the Node; the reconcile OSC (with the agent itself) is applied.
    await create_node(admin_api, machine)
    osc1 = agent_osc(pool, provision, refs[first.version], "v1.150.0")
    checksum = await publish_osc(admin_api, secret, yaml.safe_dump(osc1).encode())
    clock = time.monotonic()
    await wait_applied(admin_api, machine, checksum, timeout=180)
    print(f"reconcile OSC published -> applied: {time.monotonic() - clock:.1f}s")
    await wait_for(lambda: not node.path(BOOTSTRAP_TOKEN).exists(), 30, "the token deleted")
    await wait_for(lambda: main_pid(node) > 0, 30, "the agent running")
    # The reconcile OSC carries the agent's own unit: the agent may still be restarting itself
    # when the old process last answered, so wait for the unit to settle before looking at it.
    await wait_for(
        lambda: (
            show(node, gu.AGENT_UNIT).get("ActiveState") == "active"
            and bool(agent_status(node).get("osc", {}).get("up_to_date"))
        ),
        60,
        "converged with the agent's unit active",
    )
    pid = main_pid(node)
    env = process_env(node, pid)
    assert env["NODE_AGENT_EXECUTABLE"] == gu.AGENT_BINARY  # the single file, unpacked once
    assert env["NODE_AGENT_BUNDLE"].startswith(f"{UNPACK_ROOT}/")
    status = agent_status(node)
    assert status["agent"]["version"] == first.version
    assert status["certificate"]["phase"] == "valid"
    assert status["certificate"]["subject"].startswith(f"CN={cn}")
    lease = await read_lease(admin_api, machine)
    assert lease is not None
    assert lease.spec.renew_time > started
    assert node.path(gu.CA_FILE).read_bytes() == provision.ca_pem
    assert g.unit_marks(node)[g.KUBELET].active == "active"
    await wait_for(lambda: rk.kubelet_healthz(pool.healthz_port), 60, "the real kubelet healthy")

    # 2. Self-update: the next Gardener version's image and config file.
    before = g.unit_marks(node)
    osc2 = agent_osc(pool, provision, refs[second.version], "v1.151.0")
    checksum2 = await publish_osc(admin_api, secret, yaml.safe_dump(osc2).encode())
    clock = time.monotonic()
    await wait_applied(admin_api, machine, checksum2, timeout=180)
    await wait_for(
        lambda: agent_status(node).get("agent", {}).get("version") == second.version,
        60,
        "the agent running the new version",
    )
    print(f"update OSC published -> new version answering: {time.monotonic() - clock:.1f}s")
    assert main_pid(node) != pid
    assert g.started_again(before, g.unit_marks(node)) == set()  # only the agent restarted
    assert node.path(gu.AGENT_BINARY).read_bytes() == second.executable.read_bytes()
    assert node.path(PREVIOUS).read_bytes() == first.executable.read_bytes()  # for a rollback
    assert node.path(f"{gu.BASE}/config-v1.151.0.yaml").exists()
    started_log = node.run(
        ["journalctl", "--no-pager", "-o", "cat", "-u", gu.AGENT_UNIT], check=False
    ).stdout
    last_start = [line for line in started_log.splitlines() if "node-agent starting" in line][-1]
    assert second.version in last_start
    assert "config-v1.151.0.yaml" in last_start
    assert provision.ports is not None
    assert build_info_version(provision.ports[1]) == second.version
    lease_before = await read_lease(admin_api, machine)
    assert lease_before is not None
    await wait_for(
        lambda: _renewed_after(admin_api, machine, lease_before.spec.renew_time),
        30,
        "the new agent renewing the Lease",
    )

    # A rollback by hand (docs/operations.md): the kept binary back in place, the unit restarted.
    clock = time.monotonic()
    node.run(["cp", "-p", PREVIOUS, gu.AGENT_BINARY])
    node.run(["systemctl", "restart", gu.AGENT_UNIT])
    print(f"rollback restart: {time.monotonic() - clock:.1f}s")
    await wait_for(
        lambda: agent_status(node).get("agent", {}).get("version") == first.version,
        60,
        "the previous version running again",
    )
    assert agent_status(node)["osc"]["applied_checksum"] == checksum2  # nothing re-applied
    print(f"rollback -> previous version answering: {time.monotonic() - clock:.1f}s")

    # 3. Reset: nothing of the agent is left; a second reset finds nothing to do.
    clock = time.monotonic()
    out = node.run([gu.AGENT_BINARY, "reset"], check=False)
    print(f"reset: {time.monotonic() - clock:.1f}s")
    assert out.returncode == 0, out.stderr
    print("reset:\n" + out.stdout)
    assert f"stopped {gu.AGENT_UNIT}" in out.stdout
    assert load_state(node, gu.AGENT_UNIT) == "not-found"
    assert load_state(node, g.KUBELET) == "not-found"
    for path in (gu.AGENT_BINARY, PREVIOUS, UNPACK_ROOT, KUBECONFIG, g.KUBELET_BINARY):
        assert not node.path(path).exists(), path
    for name in ("last-applied-osc.yaml", "inventory.json"):
        assert not node.path(f"{gu.BASE}/{name}").exists(), name
    # The second reset runs from a copy of the single file unpacked elsewhere.
    node.path("/root/gna").write_bytes(second.executable.read_bytes())
    node.path("/root/gna").chmod(0o755)
    again = node.run(
        ["env", "NODE_AGENT_UNPACK_DIR=/root/unpack", "/root/gna", "reset"], check=False
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == (
        "nothing to do: no units, files or state of the agent on this node"
    )


async def _renewed_after(admin: ApiClient, machine: str, when: dt.datetime) -> bool:
    lease = await read_lease(admin, machine)
    return lease is not None and lease.spec.renew_time > when


GUARD_DROP_IN = f"/etc/systemd/system/{gu.AGENT_UNIT}.d/50-node-agent-self-update-guard.conf"
FALLBACK_RECORD = f"{gu.BASE}/self-update-fallback"
#: from the update's restart to the previous agent answering again: three starts 5 s apart
#: (RestartSec=5), the fallback, the previous agent's start
FALLBACK_BOUND = 60.0


async def test_a_self_update_to_a_binary_that_cannot_start_falls_back_to_the_previous_one(
    agent_images: tuple[AgentImage, AgentImage],
    admin_api: ApiClient,
    gardener_controlplane: ControlPlane,
    csr_approver: CSRApprover,
    containerd_node: ContainerdNode,
    registry: Registry,
    mirror: Registry,
    journal: None,
) -> None:
    """The OSC updates the agent to a file that exits 1 at once (no Python runs at all): the
    unit's Restart=always would start it every 5 s for ever. Within a bounded time the previous
    binary runs again, says so on the Node (a Warning Event) and in ``status``; the next OSC with
    a good binary is installed as usual."""
    first, second = agent_images
    node = containerd_node.node
    pool, repository, refs = push_agent_images(containerd_node, registry, mirror, agent_images)
    broken = b"#!/bin/sh\necho 'broken agent build' >&2\nexit 1\n"
    registry.push(repository, "broken", oci.build_image({"/gardener-node-agent": (broken, 0o755)}))
    containerd_node.trust(registry.host)

    machine, secret, _, provision = await provision_machine(
        admin_api, gardener_controlplane, refs[first.version]
    )
    gu.play(node, provision)
    await wait_for(lambda: node.path(KUBECONFIG).exists(), 120, "the agent's kubeconfig")
    await create_node(admin_api, machine)
    osc1 = agent_osc(pool, provision, refs[first.version], "v1.150.0")
    checksum1 = await publish_osc(admin_api, secret, yaml.safe_dump(osc1).encode())
    await wait_applied(admin_api, machine, checksum1, timeout=180)
    await wait_for(lambda: agent_status(node).get("osc", {}).get("up_to_date"), 60, "converged")

    # The update to the broken file: applied (the old agent writes it, keeps .previous, and
    # restarts itself last), then the unit starts the broken file.
    osc2 = agent_osc(pool, provision, registry.ref(repository, "broken"), "v1.150.0")
    checksum2 = await publish_osc(admin_api, secret, yaml.safe_dump(osc2).encode())
    await wait_applied(admin_api, machine, checksum2, timeout=180)
    clock = time.monotonic()
    await wait_for(
        lambda: node.path(gu.AGENT_BINARY).read_bytes() == broken, 30, "the broken file in place"
    )
    assert node.path(PREVIOUS).read_bytes() == first.executable.read_bytes()
    await wait_for(
        lambda: agent_status(node).get("agent", {}).get("version") == first.version,
        FALLBACK_BOUND,
        "the previous agent running again",
    )
    took = time.monotonic() - clock
    print(f"broken self-update -> previous agent answering: {took:.1f}s")
    assert node.path(gu.AGENT_BINARY).read_bytes() == first.executable.read_bytes()
    status = agent_status(node)
    fallback = status["agent"]["self_update_fallback"]
    print(f"status: {fallback['message']}")
    assert fallback["starts"] == 3
    assert fallback["binary"] == gu.AGENT_BINARY
    await wait_for(
        lambda: _has_event(admin_api, machine, "SelfUpdateFellBack"), 30, "the Event on the Node"
    )
    fell_back = [
        e for e in await node_events(admin_api, machine) if e.reason == "SelfUpdateFellBack"
    ]
    assert fell_back[0].type == "Warning"
    print(f"Event: {fell_back[0].message}")
    assert "was not ready after 3 starts" in (fell_back[0].message or "")
    assert status["osc"]["applied_checksum"] == checksum2  # nothing re-applied, nothing undone
    starts = node.run(
        ["journalctl", "--no-pager", "-o", "cat", "-u", gu.AGENT_UNIT], check=False
    ).stdout
    assert starts.count("broken agent build") == 3, starts[-3000:]
    text = node.run(["systemctl", "cat", gu.AGENT_UNIT]).stdout
    assert "Restart=always" in text
    assert "RestartSec=5" in text
    assert node.path(GUARD_DROP_IN).exists()

    # The next OSC with a good binary is installed as every update is.
    osc3 = agent_osc(pool, provision, refs[second.version], "v1.151.0")
    checksum3 = await publish_osc(admin_api, secret, yaml.safe_dump(osc3).encode())
    await wait_applied(admin_api, machine, checksum3, timeout=180)
    await wait_for(
        lambda: agent_status(node).get("agent", {}).get("version") == second.version,
        60,
        "the new version running",
    )
    assert node.path(gu.AGENT_BINARY).read_bytes() == second.executable.read_bytes()
    assert node.path(PREVIOUS).read_bytes() == first.executable.read_bytes()
    await wait_for(
        lambda: agent_status(node).get("agent", {}).get("self_update_fallback") is None,
        30,
        "the fallback record cleared once a new binary got ready",
    )
    assert not node.path(FALLBACK_RECORD).exists()


async def _has_event(admin: ApiClient, node: str, reason: str) -> bool:
    return any(e.reason == reason for e in await node_events(admin, node))
