"""A Gardener-shaped reconcile OSC on a throwaway node with real containerd and real registries.

Its kubelet is the real one (1.34.0, then 1.34.2) from the hyperkube image, run standalone; its
``/healthz`` says it runs after each update.

The agent runs in this process with both halves of containerd support: the ``ContainerdExpander``
(config.toml, hosts.toml, containerd's drop-in from ``criConfig``) and ``CtrImages`` running
``ctr`` inside the node, so imageRef pulls read the hosts.toml the agent wrote and go through the
mirror. Restarts are told apart per unit by ``UnitMark`` (InvocationID and the time its start
conditions were last tested), for every unit of the OSC.

What "restarted" means per kind of unit: a long-running service, a oneshot with
``RemainAfterExit=yes`` (the CA update), a timer and a path unit each get a new InvocationID when
(re)started; ``systemd-sysctl.service`` is skipped by its own
condition in the node (``/proc/sys`` is read-only there), so it has no InvocationID and its start
shows only in ``ConditionTimestampMonotonic``; the services a timer or path unit triggers
(logrotate, gardener-user) are started by the agent only when they change, and the timers fire
an hour after they start, never during the test. The health check with ``enable: false`` and
``command: start`` is disabled and stopped, as upstream does (``enable: false`` wins), so it must
never start at all. Any start at all counts as a restart.
"""

from __future__ import annotations

import asyncio
import stat
import tomllib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio import client

from node_agent.containerd.expand import ContainerdExpander, env_drop_in
from node_agent.containerd.images import CtrImages
from tests.integration.conftest import ContainerdAgent
from tests.testbed import gardener_osc as g
from tests.testbed import real_kubelet as rk
from tests.testbed.agent_harness import OSCAgent, wait_for
from tests.testbed.containerd import ContainerdNode
from tests.testbed.registry import Registry

pytestmark = pytest.mark.integration

CONFIG = "/etc/containerd/config.toml"
ENV_DROP_IN = "/etc/systemd/system/containerd.service.d/30-env_config.conf"
OVERRIDE = "/etc/systemd/system/containerd.service.d/override.conf"
CRI_V2 = "io.containerd.grpc.v1.cri"


class Bed:
    def __init__(self, agent: OSCAgent, node: ContainerdNode, pool: g.GardenerPool) -> None:
        self.agent = agent
        self.node = node
        self.pool = pool

    async def apply(self, doc: dict[str, Any]) -> str:
        checksum = await self.agent.publish(doc)
        await self.agent.wait_applied(checksum, timeout=90)
        return checksum

    def marks(self) -> dict[str, g.UnitMark]:
        return g.unit_marks(self.node.node)

    def read(self, path: str) -> bytes:
        return self.node.node.path(path).read_bytes()

    def mode(self, path: str) -> int:
        return stat.S_IMODE(self.node.node.path(path).stat().st_mode)

    def requests(self) -> dict[str, int]:
        """Every manifest and blob request of the pool's repositories, per registry and client."""
        counts: dict[str, int] = {}
        for registry in (self.pool.registry, self.pool.mirror):
            for repository in (self.pool.hyperkube, self.pool.shipper):
                counts[f"{registry.name} {repository}"] = len(registry.served(repository))
        return counts

    async def touch_secret(self) -> None:
        """A new resourceVersion of the OSC Secret with the same osc.yaml: a watch event."""
        patch = {"metadata": {"annotations": {"node-agent-test/touched": uuid.uuid4().hex}}}
        await client.CoreV1Api(self.agent.admin).patch_namespaced_secret(
            self.agent.secret_name, "kube-system", patch
        )

    def pulls(self) -> list[Any]:
        assert self.agent.controller is not None
        outcome = self.agent.controller.last_outcome
        assert outcome is not None
        return list(outcome.report.pulls)

    async def healthy(self) -> bool:
        """The real kubelet answers ``ok`` on its ``/healthz`` (within a minute of a start)."""
        port = self.pool.healthz_port
        await wait_for(lambda: asyncio.to_thread(rk.kubelet_healthz, port), 60, "kubelet /healthz")
        return True


@pytest_asyncio.fixture(loop_scope="session")
async def bed(
    containerd_agent: ContainerdAgent,
    containerd_node: ContainerdNode,
    registry: Registry,
    mirror: Registry,
) -> AsyncIterator[Bed]:
    node = containerd_node.node
    g.unmask(node, g.SYSCTL)
    # the kernel settings the real kubelet sets at start, which the node's read-only /proc/sys
    # would refuse: as a machine's sysctl would have them
    rk.shadow_kernel_tunables(node, rk.KUBELET_KERNEL_VALUES)
    pool = g.GardenerPool.fresh(registry, mirror)
    pool.push_images(("1.34.0", "1.34.2"), kubelet_image=rk.hyperkube_image)
    images = CtrImages(root=node.root, argv_prefix=containerd_node.nsenter_argv)
    try:
        async with containerd_agent(images=images, expander=ContainerdExpander) as harness:
            yield Bed(harness, containerd_node, pool)
    finally:
        rk.remove_kubelet_chains()  # the real kubelet's, in the host's network it shares
        journal = node.run(["journalctl", "--no-pager", "-o", "cat", "-u", g.KUBELET], check=False)
        print("--- journal of the kubelet ---\n" + journal.stdout[-6000:])


async def test_gardener_osc_applies_and_a_patch_update_restarts_exactly_kubelet(bed: Bed) -> None:
    pool = bed.pool
    checksum = await bed.apply(pool.osc("1.34.0"))
    annotations = await bed.agent.node_annotations()
    assert annotations["checksum/cloud-config-data"] == checksum

    # the real kubelet from the hyperkube image, byte-exact, running and healthy.
    assert bed.read(g.KUBELET_BINARY) == rk.kubelet_binary("1.34.0")
    assert bed.mode(g.KUBELET_BINARY) == 0o755
    assert bed.read(g.SHIPPER_BINARY) == pool.shipper_binary()
    assert bed.mode(g.SHIPPER_BINARY) == 0o700
    assert await bed.healthy()
    marks = bed.marks()
    for unit in (g.KUBELET, g.CONTAINERD, g.SSH_ENSURER, g.SHIPPER, g.CA_UPDATE):
        assert marks[unit].active == "active", unit
    for unit in (g.LOGROTATE_TIMER, g.SHIPPER_HEALTH_TIMER, g.USER_PATH):
        assert (marks[unit].active, marks[unit].sub) == ("active", "waiting"), unit
    # enable: false wins over command: start (as upstream: such a unit is disabled and stopped);
    # its timer starts it when due.
    assert (marks[g.SHIPPER_HEALTH].active, marks[g.SHIPPER_HEALTH].invocation) == ("inactive", "")
    assert marks[g.SHIPPER_HEALTH].enabled == "disabled"
    assert marks[g.SYSCTL].tested not in ("", "0")  # started; its condition skips it here
    # Inline files with their modes (plain and b64, 0400 to 0755).
    assert bed.mode(g.USER_KEYS) == 0o400
    assert bed.mode(g.AGENT_CONFIG) == 0o600
    assert bed.mode(g.USER_SCRIPT) == 0o755
    assert bed.read(g.AGENT_CONFIG).decode() == pool.agent_config("1.34.0")

    # containerd's configuration from criConfig, and both drop-ins.
    config = tomllib.loads(bed.read(CONFIG).decode())
    cri = config["plugins"][CRI_V2]
    assert cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is True
    assert cri["sandbox_image"] == g.SANDBOX_IMAGE
    assert cri["registry"]["config_path"] == "/etc/containerd/certs.d"
    assert config["imports"] == ["/etc/containerd/conf.d/*.toml"]
    assert bed.read(ENV_DROP_IN) == env_drop_in().encode()
    assert bed.read(OVERRIDE).decode() == pool.containerd_extension()["dropIns"][0]["content"]
    shown = bed.node.systemctl("show", "-p", "DropInPaths,Environment", g.CONTAINERD).stdout
    assert OVERRIDE in shown
    assert ENV_DROP_IN in shown
    assert "PATH=/var/bin/containerruntimes:" in shown

    # Both images came through the mirror's hosts.toml; containerd never asked the registry.
    for repository in (pool.hyperkube, pool.shipper):
        assert pool.mirror.served(repository, user_agent="containerd/") != []
        assert pool.registry.served(repository, user_agent="containerd/") == []
    expected = {
        (
            pool.hyperkube_ref("1.34.0"),
            pool.digests[pool.hyperkube_ref("1.34.0")],
            g.KUBELET_BINARY,
        ),
        (pool.shipper_ref(), pool.digests[pool.shipper_ref()], g.SHIPPER_BINARY),
    }
    # the last apply's pulls: both, or the one its retry still had to make (the mirror may
    # refuse a large image's first fetch under load; the agent retries what failed)
    pulled = {(p.image, p.digest, p.target) for p in bed.pulls()}
    assert pulled
    assert pulled <= expected
    for image, digest, _ in expected:
        assert bed.node.images()[image] == digest

    # The same OSC again: a Secret update with identical osc.yaml (only its metadata changed; the
    # API server drops a byte-identical replace), then the periodic resync.
    assert bed.agent.controller is not None
    before, requests = bed.marks(), bed.requests()
    reconciles = bed.agent.controller.reconciles
    await bed.touch_secret()
    await wait_for(lambda: bed.agent.controller.reconciles > reconciles, 30, "the Secret update")
    assert bed.agent.ctx is not None
    secret = await bed.agent.ctx.kube.get_secret("kube-system", bed.agent.secret_name)
    assert await bed.agent.controller.reconcile(secret, resync=True) is None
    assert bed.requests() == requests
    assert g.started_again(before, bed.marks()) == set()

    # The patch update: exactly kubelet restarts, on the new binary's image.
    before, requests = bed.marks(), bed.requests()
    await bed.apply(pool.osc("1.34.2"))
    after = bed.marks()
    assert g.started_again(before, after) == {g.KUBELET}
    assert after[g.KUBELET].active == "active"
    assert bed.read(g.KUBELET_BINARY) == rk.kubelet_binary("1.34.2")
    assert await bed.healthy()
    [pull] = bed.pulls()
    assert (pull.image, pull.digest) == (
        pool.hyperkube_ref("1.34.2"),
        pool.digests[pool.hyperkube_ref("1.34.2")],
    )
    assert bed.node.images()[pool.hyperkube_ref("1.34.2")] == pull.digest
    assert bed.read(g.KUBELET_CONFIG).decode() == pool.kubelet_config("1.34.2")
    assert bed.read(g.AGENT_CONFIG).decode() == pool.agent_config("1.34.2")
    assert bed.read("/etc/systemd/system/kubelet.service").decode() == pool.kubelet_unit_text(
        "1.34.2"
    )
    # Only the new hyperkube image was fetched, again only through the mirror.
    assert pool.registry.served(pool.hyperkube, user_agent="containerd/") == []
    fetched = bed.requests()
    assert fetched[f"mirror {pool.shipper}"] == requests[f"mirror {pool.shipper}"]
    assert fetched[f"mirror {pool.hyperkube}"] > requests[f"mirror {pool.hyperkube}"]


async def test_a_config_toml_change_restarts_containerd_and_nothing_else(bed: Bed) -> None:
    await bed.apply(bed.pool.osc("1.34.0"))
    assert await bed.healthy()  # the kubelet up, not still starting, when containerd restarts
    before, requests = bed.marks(), bed.requests()

    await bed.apply(bed.pool.osc("1.34.0", sandbox_image="registry.k8s.io/pause:3.11"))

    after = bed.marks()
    assert g.started_again(before, after) == {g.CONTAINERD}
    assert after[g.CONTAINERD].active == "active"
    config = tomllib.loads(bed.read(CONFIG).decode())
    assert config["plugins"][CRI_V2]["sandbox_image"] == "registry.k8s.io/pause:3.11"
    assert bed.pulls() == []
    assert bed.requests() == requests
    assert await bed.healthy()


async def test_a_patch_update_to_a_missing_hyperkube_tag_keeps_the_old_kubelet(bed: Bed) -> None:
    pool = bed.pool
    await bed.apply(pool.osc("1.34.0"))
    before = bed.marks()
    missing = pool.registry.ref(pool.hyperkube, "v1.34.9")
    doc = pool.osc("1.34.2")
    [kubelet_file] = [f for f in doc["spec"]["files"] if f["path"] == g.KUBELET_BINARY]
    kubelet_file["content"]["imageRef"]["image"] = missing

    await bed.agent.publish(doc)

    message = await bed.agent.wait_warning(f"{g.KUBELET_BINARY}: image {missing}: ", timeout=60)
    assert "\n" not in message
    # this update's Warning: an earlier apply may have left one of the same kind (a first pull
    # the registry answered 400 under load, retried and then applied)
    blocked = await bed.agent.wait_warning(f"{g.KUBELET}: not attempted", g.KUBELET_BINARY, missing)
    assert missing in blocked
    # The rest of the update is on disk; the old binary stays and kubelet keeps running it.
    assert bed.read(g.KUBELET_CONFIG).decode() == pool.kubelet_config("1.34.2")
    assert bed.read(g.AGENT_CONFIG).decode() == pool.agent_config("1.34.2")
    assert bed.read(g.KUBELET_BINARY) == rk.kubelet_binary("1.34.0")
    assert g.started_again(before, bed.marks()) == set()
    assert await bed.healthy()


async def test_a_replaced_binary_from_an_image_is_repaired_by_the_periodic_check(bed: Bed) -> None:
    """Drift repair covers imageRef files too: the bytes written are known from the inventory,
    so a binary swapped on the host is written again from the image and kubelet restarts."""
    await bed.apply(bed.pool.osc("1.34.0"))
    good = bed.read(g.KUBELET_BINARY)
    before = bed.marks()
    blobs_before = blob_requests(bed)
    target = bed.node.node.path(g.KUBELET_BINARY)
    swap = target.with_name(".swapped-by-test")
    swap.write_bytes(b"#!/bin/sh\nexit 1\n")
    swap.chmod(0o755)
    swap.replace(target)  # in place would fail: the running binary is busy

    controller = bed.agent.controller
    assert controller is not None
    secret = controller.latest_secret
    assert secret is not None
    await controller.reconcile(secret, resync=True)  # the periodic full check, now

    assert bed.read(g.KUBELET_BINARY) == good
    assert bed.mode(g.KUBELET_BINARY) == 0o755
    assert g.started_again(before, bed.marks()) == {g.KUBELET}
    # containerd still had the image: the tag is resolved again, no layer is fetched
    assert blob_requests(bed) == blobs_before
    assert await bed.healthy()


def blob_requests(bed: Bed) -> int:
    pool = bed.pool
    return sum(
        "/blobs/" in entry.path
        for registry in (pool.registry, pool.mirror)
        for entry in registry.served(pool.hyperkube)
    )
