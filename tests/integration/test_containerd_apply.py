"""containerd's configuration from criConfig, applied to a throwaway node running real containerd.

The agent runs in this process (``OSCAgent`` with the ``ContainerdExpander`` on the node's root);
``ctr`` runs inside the node, so a pull reads the hosts.toml the agent wrote and goes through the
mirror. Restarts are told apart by containerd's InvocationID.
"""

from __future__ import annotations

import base64
import http.server
import stat
import threading
import tomllib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from node_agent.containerd.expand import ContainerdExpander, env_drop_in
from node_agent.host.fs import HostFS
from node_agent.host.state import UNIT_FILE_MODE
from node_agent.osc.models import OperatingSystemConfig
from tests.integration.conftest import ContainerdAgent
from tests.testbed import oci
from tests.testbed.agent_harness import OSCAgent, inline_file, osc_document, service, wait_for
from tests.testbed.containerd import NODE_CA_PATH, ContainerdNode, config_v1, default_config
from tests.testbed.controlplane import free_port
from tests.testbed.registry import Registry

pytestmark = pytest.mark.integration

CONFIG = "/etc/containerd/config.toml"
DROP_IN = "/etc/systemd/system/containerd.service.d/30-env_config.conf"
CRI_V2 = "io.containerd.grpc.v1.cri"
CONTAINERD = "containerd.service"
OTHER = "other.service"
CONFIG_V1 = config_v1()


class Bed:
    def __init__(
        self, agent: OSCAgent, node: ContainerdNode, registry: Registry, mirror: Registry
    ) -> None:
        self.agent = agent
        self.node = node
        self.registry = registry
        self.mirror = mirror

    def osc(self, *, sandbox: str, other: str = "one\n", mirrored: bool = True) -> dict[str, Any]:
        """A criConfig as Gardener writes it (plus a registry mirror) and an unrelated unit."""
        registries = [
            {
                "upstream": self.registry.host,
                "server": self.registry.url,
                "hosts": [{"url": self.mirror.url, "caCerts": [NODE_CA_PATH]}],
                "readinessProbe": True,
            }
        ]
        doc = osc_document(
            [inline_file("/etc/other.conf", other)],
            [service(OTHER, enable=True, command="start", filePaths=["/etc/other.conf"])],
        )
        doc["spec"]["criConfig"] = {
            "name": "containerd",
            "cgroupDriver": "systemd",
            "containerd": {"sandboxImage": sandbox, "registries": registries if mirrored else []},
        }
        return doc

    async def apply(self, doc: dict[str, Any]) -> None:
        await self.agent.wait_applied(await self.agent.publish(doc))

    async def invocations(self) -> dict[str, str]:
        states = await self.agent.unit_states([CONTAINERD, OTHER])
        return {name: state.invocation_id for name, state in states.items()}

    def read(self, path: str) -> bytes:
        return self.node.node.path(path).read_bytes()

    def mode(self, path: str) -> int:
        return stat.S_IMODE(self.node.node.path(path).stat().st_mode)

    def config(self) -> dict[str, Any]:
        return tomllib.loads(self.read(CONFIG).decode())

    def effective_cri(self) -> dict[str, Any]:
        """The CRI plugin's settings as this containerd reads config.toml (``config dump``
        decodes each plugin the way the daemon does and prints it under its full name)."""
        dump = self.node.node.run(["containerd", "config", "dump"], check=True).stdout
        cri: dict[str, Any] = tomllib.loads(dump)["plugins"][CRI_V2]
        return cri


@pytest_asyncio.fixture(loop_scope="session")
async def bed(
    containerd_agent: ContainerdAgent,
    containerd_node: ContainerdNode,
    registry: Registry,
    mirror: Registry,
) -> AsyncIterator[Bed]:
    async with containerd_agent(expander=ContainerdExpander) as harness:
        yield Bed(harness, containerd_node, registry, mirror)


async def test_cri_config_mirror_and_restarts_only_on_real_changes(bed: Bed) -> None:
    before = await bed.invocations()
    await bed.apply(bed.osc(sandbox="registry.k8s.io/pause:3.10"))

    config = bed.config()
    cri = config["plugins"][CRI_V2]
    assert cri["sandbox_image"] == "registry.k8s.io/pause:3.10"
    assert cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is True
    assert cri["registry"]["config_path"] == "/etc/containerd/certs.d"
    assert config["imports"] == ["/etc/containerd/conf.d/*.toml"]
    # Patched in place, not rewritten: containerd's own lines all there, edited where needed.
    assert len(bed.read(CONFIG).splitlines()) == len(default_config().splitlines())
    assert cri["max_container_log_line_size"] == 16384
    assert bed.mode(CONFIG) == 0o644
    assert bed.read(DROP_IN) == env_drop_in().encode()
    assert bed.mode(DROP_IN) == UNIT_FILE_MODE
    for directory in ("/var/bin/containerruntimes", "/etc/containerd/conf.d"):
        assert bed.mode(directory) == 0o755
    environment = bed.node.systemctl("show", "-p", "Environment", CONTAINERD).stdout
    assert "PATH=/var/bin/containerruntimes:" in environment
    hosts_toml = f"/etc/containerd/certs.d/{bed.registry.host}/hosts.toml"
    hosts = tomllib.loads(bed.read(hosts_toml).decode())
    assert hosts["server"] == bed.registry.url
    assert hosts["host"] == {
        bed.mirror.url: {"capabilities": ["pull", "resolve"], "ca": [NODE_CA_PATH]}
    }
    first = await bed.invocations()
    # The config on disk changed (sandbox image, cgroup driver): containerd restarted, and runs.
    assert first[CONTAINERD] != before[CONTAINERD]
    states = await bed.agent.unit_states([CONTAINERD])
    assert states[CONTAINERD].active_state == "active"

    # A pull reads the hosts.toml the agent wrote: through the mirror, never the registry itself.
    repository = f"test/cri-{uuid.uuid4().hex[:8]}"
    digest = bed.registry.push(repository, "v1", oci.build_image([{"/m": (b"m\n", 0o644)}]))
    bed.node.pull(bed.registry.ref(repository, "v1"))
    fetched = {e.path for e in bed.mirror.served(repository, user_agent="containerd/")}
    assert f"/v2/{repository}/manifests/{digest}" in fetched
    assert bed.registry.served(repository, user_agent="containerd/") == []

    # Only an unrelated file changes: containerd keeps running as it is.
    await bed.apply(bed.osc(sandbox="registry.k8s.io/pause:3.10", other="two\n"))
    second = await bed.invocations()
    assert second[CONTAINERD] == first[CONTAINERD]
    assert second[OTHER] != first[OTHER]

    # A new sandbox image: containerd restarts, nothing else does.
    await bed.apply(bed.osc(sandbox="registry.k8s.io/pause:3.11", other="two\n"))
    third = await bed.invocations()
    assert third[CONTAINERD] != second[CONTAINERD]
    assert third[OTHER] == second[OTHER]
    assert bed.config()["plugins"][CRI_V2]["sandbox_image"] == "registry.k8s.io/pause:3.11"

    # The registry leaves the OSC: its hosts.toml (written by the agent) goes, no restart.
    await bed.apply(bed.osc(sandbox="registry.k8s.io/pause:3.11", other="two\n", mirrored=False))
    assert not bed.node.node.path(hosts_toml).exists()
    assert not bed.node.node.path(hosts_toml).parent.exists()  # its directory too, as upstream
    assert (await bed.invocations()) == third

    # A malformed criConfig: one Warning naming the field, nothing touched.
    config_before = bed.read(CONFIG)
    bad = bed.osc(sandbox="registry.k8s.io/pause:3.12", other="three\n")
    bad["spec"]["criConfig"]["containerd"]["registries"] = [{"upstream": "../escape"}]
    await bed.agent.publish(bad)
    await bed.agent.wait_warning("spec.criConfig.containerd.registries[0].upstream")
    assert bed.read(CONFIG) == config_before
    assert bed.read("/etc/other.conf") == b"two\n"
    assert (await bed.invocations()) == third


@pytest.mark.parametrize("version", [1, 2])
async def test_each_config_version_is_patched_where_this_containerd_reads_it(
    bed: Bed, version: int
) -> None:
    """containerd 1.x reads a version 1 file by short plugin IDs (``[plugins.cri]``) and a
    version 2 file by full names: the effective settings change, whichever the node has."""
    if version == 1:
        bed.node.node.path(CONFIG).write_text(CONFIG_V1)
        bed.node.systemctl("restart", CONTAINERD)
        bed.node.wait_ready()
    before = bed.effective_cri()
    assert before["sandbox_image"] == "registry.k8s.io/pause:3.6"
    assert before["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is False
    invocation = (await bed.invocations())[CONTAINERD]

    await bed.apply(bed.osc(sandbox="registry.k8s.io/pause:3.10"))

    assert ("version" in bed.config()) == (version == 2)  # the file keeps its version
    effective = bed.effective_cri()
    assert effective["sandbox_image"] == "registry.k8s.io/pause:3.10"
    assert effective["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is True
    assert effective["registry"]["config_path"] == "/etc/containerd/certs.d"
    # containerd restarted on the patched file and runs
    assert (await bed.invocations())[CONTAINERD] != invocation
    assert (await bed.agent.unit_states([CONTAINERD]))[CONTAINERD].active_state == "active"


async def test_first_apply_on_a_node_already_configured_restarts_nothing(bed: Bed) -> None:
    """A node where containerd already runs with exactly this configuration (e.g. written by
    gardener-node-agent before): the agent adopts it, containerd is not restarted."""
    doc = bed.osc(sandbox="registry.k8s.io/pause:3.10")
    node_fs = HostFS(bed.node.node.root, follow_system_symlinks=True)
    desired = ContainerdExpander(node_fs)(OperatingSystemConfig.model_validate(doc))
    for file in desired.spec.files:
        if file.path.startswith("/etc/containerd/"):
            assert file.content.inline is not None  # the derived bytes, as an earlier agent wrote
            data = base64.b64decode(file.content.inline.data)
            path = bed.node.node.path(file.path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            path.chmod(0o644)
    drop_in = bed.node.node.path(DROP_IN)
    drop_in.parent.mkdir(parents=True, exist_ok=True)
    drop_in.write_text(env_drop_in())
    drop_in.chmod(UNIT_FILE_MODE)
    bed.node.systemctl("daemon-reload")
    bed.node.systemctl("restart", CONTAINERD)
    bed.node.wait_ready()
    before = await bed.invocations()

    await bed.apply(doc)

    after = await bed.invocations()
    assert after[CONTAINERD] == before[CONTAINERD]
    assert after[OTHER] != before[OTHER]  # the OSC's own new unit did start


async def test_a_mirror_that_comes_up_later_is_configured_well_before_the_periodic_check(
    bed: Bed,
) -> None:
    """A registry mirror with a readiness probe that is not up at the first apply: no
    hosts.toml yet; once it answers, the agent writes it within the held-back re-check (10 s,
    backing off), not at the next periodic check (10 min here; 12 h on Gardener's nodes)."""
    port = free_port()
    upstream = f"late-{uuid.uuid4().hex[:6]}.example:5000"
    doc = bed.osc(sandbox="registry.k8s.io/pause:3.10")
    doc["spec"]["criConfig"]["containerd"]["registries"] = [
        {
            "upstream": upstream,
            "server": f"https://{upstream}",
            "hosts": [{"url": f"http://127.0.0.1:{port}"}],
            "readinessProbe": True,
        }
    ]
    hosts_toml = bed.node.node.path(f"/etc/containerd/certs.d/{upstream}/hosts.toml")
    await bed.apply(doc)
    assert not hosts_toml.exists()  # held back: its host does not answer

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        await wait_for(lambda: hosts_toml.exists(), 30, "hosts.toml once the mirror answers")
    finally:
        server.shutdown()
        server.server_close()
    hosts = tomllib.loads(hosts_toml.read_text())
    assert list(hosts["host"]) == [f"http://127.0.0.1:{port}"]


@pytest.mark.parametrize("case", ["not TOML", "a directory", "caCerts with .."])
async def test_a_containerd_item_that_cannot_be_derived_fails_alone_and_the_next_osc_converges(
    bed: Bed, case: str
) -> None:
    """config.toml that cannot be patched, or a registry whose hosts.toml cannot be derived, is
    one failed item with a Warning naming it: the rest of the OSC is applied, nothing of it is
    removed or half-written, containerd is not restarted for it; once fixed, the next OSC
    converges."""
    await bed.apply(bed.osc(sandbox="registry.k8s.io/pause:3.10"))
    config = bed.node.node.path(CONFIG)
    good = config.read_bytes()
    before = await bed.invocations()
    hosts_toml = f"/etc/containerd/certs.d/{bed.registry.host}/hosts.toml"
    hosts_before = bed.read(hosts_toml)

    doc = bed.osc(sandbox="registry.k8s.io/pause:3.11", other="two\n")
    if case == "not TOML":
        config.write_bytes(b"[plugins\n")
        item, why = CONFIG, "not valid TOML"
    elif case == "a directory":
        config.unlink()
        config.mkdir()
        item, why = CONFIG, "is not a regular file"
    else:
        registry = doc["spec"]["criConfig"]["containerd"]["registries"][0]
        registry["hosts"][0]["caCerts"] = ["../../../../etc/node-agent-test/registry-ca.crt"]
        item, why = hosts_toml, ".."
    await bed.agent.publish(doc)

    message = await bed.agent.wait_warning(f"{item}: ", why, timeout=60)
    assert "\n" not in message
    await wait_for(lambda: bed.read("/etc/other.conf") == b"two\n", 30, "the rest applied")
    after = await bed.invocations()
    assert after[OTHER] != before[OTHER]
    assert bed.read(hosts_toml) == hosts_before  # never removed or rewritten by the failure
    if case == "caCerts with ..":
        # config.toml is an item of its own: the new sandbox image is in, containerd restarted
        assert b"pause:3.11" in config.read_bytes()
        assert after[CONTAINERD] != before[CONTAINERD]
    else:
        assert after[CONTAINERD] == before[CONTAINERD]
        assert config.read_bytes() == b"[plugins\n" if case == "not TOML" else config.is_dir()

    # Fixed (the file back, or a caCerts inside certs.d): the next OSC converges.
    if case == "a directory":
        config.rmdir()
    if case != "caCerts with ..":
        config.write_bytes(good)
    await bed.apply(bed.osc(sandbox="registry.k8s.io/pause:3.11", other="three\n"))
    assert bed.config()["plugins"][CRI_V2]["sandbox_image"] == "registry.k8s.io/pause:3.11"
    assert bed.read(hosts_toml) == hosts_before
    final = await bed.invocations()
    assert final[CONTAINERD] != after[CONTAINERD] or case == "caCerts with .."
    assert (await bed.agent.unit_states([CONTAINERD]))[CONTAINERD].active_state == "active"


async def test_a_config_toml_repaired_during_the_retries_is_patched_before_the_osc_counts(
    bed: Bed,
) -> None:
    """config.toml cannot be patched, so the OSC's retries go on; someone repairs the file
    meanwhile. The retry of the same OSC must patch it now: the checksum on the Node says
    containerd reads the OSC's settings. (The retry used to find its journal finished, with
    config.toml set aside when the journal began, and reported the OSC applied with the old
    sandbox image; found by the containerd campaign.)"""
    await bed.apply(bed.osc(sandbox="registry.k8s.io/pause:3.10"))
    config = bed.node.node.path(CONFIG)
    good = config.read_bytes()
    config.write_bytes(b"[plugins\n")
    checksum = await bed.agent.publish(bed.osc(sandbox="registry.k8s.io/pause:3.11", other="x\n"))
    await bed.agent.wait_warning(f"{CONFIG}: ", "not valid TOML", timeout=60)
    await wait_for(lambda: bed.read("/etc/other.conf") == b"x\n", 30, "the rest applied")
    assert checksum != (await bed.agent.node_annotations()).get("checksum/cloud-config-data")

    config.write_bytes(good)  # repaired by hand; the OSC stays the same
    await bed.agent.wait_applied(checksum, timeout=120)
    assert bed.config()["plugins"][CRI_V2]["sandbox_image"] == "registry.k8s.io/pause:3.11"
    assert bed.effective_cri()["sandbox_image"] == "registry.k8s.io/pause:3.11"
