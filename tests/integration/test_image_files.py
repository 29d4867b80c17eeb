"""imageRef files on a throwaway node with real containerd and real TLS registries.

The file is the real kubelet (1.34.0, 1.34.2) from a hyperkube image, run standalone by its unit
as the OSC gives it (its config inline, its server port free, no QoS cgroups); its ``/healthz``
says the binary the agent wrote runs.

The agent runs in this process against the node (its root at ``/proc/<pid>/root``); ``ctr``
runs inside the node (``CtrImages(argv_prefix=nsenter ...)``), so pulls read the node's
``hosts.toml`` and go through the mirror, and image mounts happen in the node's namespace.
"""

from __future__ import annotations

import asyncio
import stat
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import yaml

from node_agent.containerd.images import CtrImages
from tests.integration.conftest import ContainerdAgent
from tests.testbed import gardener_osc as g
from tests.testbed import oci
from tests.testbed import real_kubelet as rk
from tests.testbed.agent_harness import OSCAgent, inline_file, osc_document, service, wait_for
from tests.testbed.containerd import ContainerdNode
from tests.testbed.controlplane import free_port
from tests.testbed.pki import CertificateAuthority
from tests.testbed.registry import Registry, StallingRegistry

pytestmark = pytest.mark.integration

#: the kubelet's config: standalone (no API server to ask for authentication)
STANDALONE_CONFIG = yaml.safe_dump(
    {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "authentication": {"webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "healthzBindAddress": "127.0.0.1",
    }
)

KUBELET = "/opt/bin/kubelet"
KUBELET_CONFIG = "/var/lib/kubelet/config/kubelet"


class Bed:
    """The agent on a containerd node, and a hyperkube repository of its own in the registry."""

    def __init__(
        self,
        agent: OSCAgent,
        node: ContainerdNode,
        registry: Registry,
        mirror: Registry,
        images: CtrImages,
    ) -> None:
        self.agent = agent
        self.images = images
        self.node = node
        self.registry = registry
        self.mirror = mirror
        self.repository = f"test/hyperkube-{uuid.uuid4().hex[:8]}"
        self.port, self.server_port = free_port(), free_port()
        self.digests = {
            f"v{version}": registry.push(
                self.repository, f"v{version}", rk.hyperkube_image(version)
            )
            for version in ("1.34.0", "1.34.2")
        }

    def ref(self, tag: str) -> str:
        return self.registry.ref(self.repository, tag)

    def osc(
        self, image: str, path_in_image: str = "/kubelet", *, other: str = "one\n"
    ) -> dict[str, Any]:
        kubelet = service(
            "kubelet.service",
            f"{KUBELET} --config={KUBELET_CONFIG} --healthz-port={self.port} "
            f"--port={self.server_port} --read-only-port=0 {g.NO_QOS_CGROUPS}",
            extra="Restart=always\nRestartSec=1\n",
            enable=True,
            command="start",
            filePaths=[KUBELET],
        )
        other_unit = service(
            "other.service", enable=True, command="start", filePaths=["/etc/other.conf"]
        )
        image_file = {
            "path": KUBELET,
            "permissions": 0o755,
            "content": {"imageRef": {"image": image, "filePathInImage": path_in_image}},
        }
        files = [image_file, inline_file(KUBELET_CONFIG, STANDALONE_CONFIG)]
        return osc_document([*files, inline_file("/etc/other.conf", other)], [kubelet, other_unit])

    def fetches(self) -> tuple[int, int]:
        """Manifest and blob requests containerd made for the repository: (mirror, registry)."""
        return (
            len(self.mirror.served(self.repository, user_agent="containerd/")),
            len(self.registry.served(self.repository, user_agent="containerd/")),
        )

    async def invocations(self) -> dict[str, str]:
        names = ["kubelet.service", "other.service", "containerd.service"]
        states = await self.agent.unit_states(names)
        return {name: state.invocation_id for name, state in states.items()}

    def on_disk(self, path: str) -> tuple[bytes, int]:
        host = self.node.node.path(path)
        return host.read_bytes(), stat.S_IMODE(host.stat().st_mode)

    async def healthy(self) -> bool:
        """The kubelet answers ``ok`` on its ``/healthz`` (within a minute of a start)."""
        port = self.port
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
    rk.shadow_kernel_tunables(node, rk.KUBELET_KERNEL_VALUES)  # what the kubelet sets at start
    images = CtrImages(root=node.root, argv_prefix=containerd_node.nsenter_argv)
    containerd_node.write_hosts_toml(registry.host, registry.url, [mirror.url])
    try:
        async with containerd_agent(images=images) as harness:
            yield Bed(harness, containerd_node, registry, mirror, images)
    finally:
        rk.remove_kubelet_chains()  # the real kubelet's, in the host's network it shares


async def test_kubelet_from_image_runs_and_updates_restart_exactly_kubelet(bed: Bed) -> None:
    agent = bed.agent
    await agent.wait_applied(await agent.publish(bed.osc(bed.ref("v1.34.0"))))

    binary = rk.kubelet_binary("1.34.0")
    assert bed.on_disk(KUBELET) == (binary, 0o755)
    assert await bed.healthy()
    states = await agent.unit_states(["kubelet.service"])
    assert states["kubelet.service"].active_state == "active"
    assert bed.node.images()[bed.ref("v1.34.0")] == bed.digests["v1.34.0"]
    # Pulled through the mirror's hosts.toml: containerd never asked the registry itself.
    mirror_fetches, registry_fetches = bed.fetches()
    assert mirror_fetches > 0
    assert registry_fetches == 0
    # The image's read-only mount and its view snapshot are gone again.
    assert not any(bed.node.node.path("/run/node-agent/image-mounts").iterdir())
    assert "image-mounts" not in bed.node.node.run(["findmnt", "-rn", "-o", "TARGET"]).stdout
    assert "image-mounts" not in bed.node.ctr("snapshots", "ls").stdout
    assert agent.controller is not None
    last = agent.controller.last_outcome
    assert last is not None
    [pull] = last.report.pulls
    assert (pull.digest, pull.size) == (bed.digests["v1.34.0"], len(binary))

    # A new tag: exactly kubelet restarts.
    before = await bed.invocations()
    await agent.wait_applied(await agent.publish(bed.osc(bed.ref("v1.34.2"))))
    after = await bed.invocations()
    assert {u for u in before if after[u] != before[u]} == {"kubelet.service"}
    assert bed.node.images()[bed.ref("v1.34.2")] == bed.digests["v1.34.2"]
    assert await bed.healthy()

    # The same image reference again, with another change: no pull, kubelet untouched.
    fetched = bed.fetches()
    before = after
    await agent.wait_applied(await agent.publish(bed.osc(bed.ref("v1.34.2"), other="two\n")))
    after = await bed.invocations()
    assert {u for u in before if after[u] != before[u]} == {"other.service"}
    assert bed.fetches() == fetched
    last = agent.controller.last_outcome
    assert last is not None
    assert last.report.pulls == []
    assert bed.on_disk("/etc/other.conf") == (b"two\n", 0o644)


@pytest.mark.parametrize("case", ["missing image", "unreachable registry", "bad path"])
async def test_failed_image_is_one_warning_naming_it_and_the_rest_applies(
    bed: Bed, case: str
) -> None:
    agent = bed.agent
    await agent.wait_applied(await agent.publish(bed.osc(bed.ref("v1.34.0"))))
    binary = bed.on_disk(KUBELET)
    before = await bed.invocations()

    image, path = {
        "missing image": (bed.ref("v9.9.9"), "/kubelet"),
        "unreachable registry": (f"127.0.0.1:{free_port()}/test/hyperkube:v1.34.2", "/kubelet"),
        "bad path": (bed.ref("v1.34.2"), "/usr/bin/no-kubelet"),
    }[case]
    await agent.publish(bed.osc(image, path, other="changed alongside\n"))

    message = await agent.wait_warning(f"{KUBELET}: image {image}: ", timeout=60)
    assert "\n" not in message
    why = message.split(f"image {image}: ", 1)[1]
    if case == "bad path":
        assert why == f"{path} is not in the image"
    else:
        assert why.startswith("pull failed: ")

    async def rest_applied() -> bool:
        return bed.on_disk("/etc/other.conf")[0] == b"changed alongside\n"

    await wait_for(rest_applied, 30, "the rest of the OSC applied")
    blocked = await agent.wait_warning("kubelet.service: not attempted", KUBELET)
    assert "was not written" in blocked
    # The previous binary is intact and kubelet kept running it; other.service restarted.
    assert bed.on_disk(KUBELET) == binary
    after = await bed.invocations()
    assert after["kubelet.service"] == before["kubelet.service"]
    assert after["other.service"] != before["other.service"]
    assert await bed.healthy()


async def test_a_registry_hanging_mid_blob_holds_only_the_units_of_its_file(
    bed: Bed, registry_ca: CertificateAuthority
) -> None:
    """An image whose registry stops sending in the middle of a layer: the rest of the OSC
    does not wait for it (an unrelated unit restarts within seconds), the image's file fails
    after the pull timeout with a Warning naming the image, the unit that uses the file keeps
    running the old binary; once the registry is healthy, the next OSC converges."""
    agent = bed.agent
    await agent.wait_applied(await agent.publish(bed.osc(bed.ref("v1.34.0"))))
    binary = bed.on_disk(KUBELET)
    before = await bed.invocations()
    bed.images.pull_timeout = 20.0
    # a kubelet of its own (trailing bytes do not keep an ELF binary from running)
    new_kubelet = rk.kubelet_binary("1.34.2") + b"\nstalling v1.34.3\n"
    image = oci.build_image({"/kubelet": (new_kubelet, 0o755)})
    with StallingRegistry(registry_ca, "test/stalling", "v1.34.3", image) as stalling:
        bed.node.trust(stalling.host)
        ref = stalling.ref()
        started = time.monotonic()
        await agent.publish(bed.osc(ref, other="changed alongside\n"))

        async def other_restarted() -> bool:
            return (await bed.invocations())["other.service"] != before["other.service"]

        await wait_for(other_restarted, 60, "other.service restarted")
        took = time.monotonic() - started
        print(f"other.service restarted {took:.1f}s after the OSC was published")
        assert took < 10.0, f"an unrelated unit waited {took:.1f}s for a hanging image"
        assert bed.on_disk("/etc/other.conf")[0] == b"changed alongside\n"
        assert await agent.warnings(f"{KUBELET}: image {ref}") == []  # still being pulled
        await wait_for(lambda: stalling.stalled >= 1, 20, "the pull cut off mid-blob")

        message = await agent.wait_warning(f"{KUBELET}: image {ref}: ", timeout=90)
        assert message.endswith("pull: ctr did not finish within 20s"), message
        assert time.monotonic() - started >= 20.0
        blocked = await agent.wait_warning("kubelet.service: not attempted", KUBELET)
        assert "was not written" in blocked
        after = await bed.invocations()
        assert after["kubelet.service"] == before["kubelet.service"]
        assert bed.on_disk(KUBELET) == binary
        assert await bed.healthy()

        # The registry recovers: the next OSC converges (kubelet from the image, restarted).
        stalling.recover()
        await agent.wait_applied(
            await agent.publish(bed.osc(ref, other="after recovery\n")), timeout=120
        )
        assert bed.on_disk(KUBELET) == (new_kubelet, 0o755)
        final = await bed.invocations()
        assert final["kubelet.service"] != after["kubelet.service"]
        assert await bed.healthy()
