"""The agent's image, installed the way Gardener's provision user-data installs it.

``make image`` builds an OCI image layout of an image index (linux/amd64 and linux/arm64); it is
pushed to the test registry, pulled by the node's real containerd with ``ctr images pull
--hosts-dir``, mounted with ``ctr images mount``, and ``/gardener-node-agent`` (or
``/ko-app/gardener-node-agent``) is copied to ``/opt/bin`` exactly as upstream's init script
does. The copied single file then runs on a node whose every Python is hidden, under its
upstream name. ``ctr`` pulls each platform of the index and gets that platform's file; the arm64
agent's run on an arm64 node is test_arm64_node.py's.
"""

from __future__ import annotations

import json
import stat
import tarfile
import time
import uuid
from pathlib import Path

import pytest

from tests.testbed.agent_image import (
    ARCHES,
    ELF_MACHINES,
    AgentImage,
    agent_image_layout,
    elf_machine,
    layer_members,
    read_layout,
)
from tests.testbed.containerd import CERTS_D, ContainerdNode
from tests.testbed.registry import Registry
from tests.testbed.userdata import hide_python, sh

pytestmark = pytest.mark.integration

UNPACK_ROOT = "/var/cache/node-agent"
# The lines of Gardener's nodeinit script (templates/scripts/init.tpl.sh) that fetch the binary.
INIT_LINES = """\
set -e
tmp_dir="$(mktemp -d)"
ctr images pull --hosts-dir "/etc/containerd/certs.d" "$image"
ctr images mount "$image" "$tmp_dir"
mkdir -p "/opt/bin"
cp -f "$tmp_dir/gardener-node-agent" "/opt/bin" || \
  cp -f "$tmp_dir/ko-app/gardener-node-agent" "/opt/bin"
chmod +x "/opt/bin/gardener-node-agent"
mkdir -p /opt/ko/bin
cp -f "$tmp_dir/ko-app/gardener-node-agent" /opt/ko/bin
ctr images unmount "$tmp_dir"
"""


@pytest.fixture(scope="session")
def agent_image(workdir: Path) -> AgentImage:
    """The image, built by the script ``make image`` runs (cached by its key)."""
    return agent_image_layout(workdir / "image-dist")


def test_layout_is_an_index_of_one_layer_per_platform(agent_image: AgentImage) -> None:
    index = read_layout(agent_image.layout)
    assert index.platforms() == [("linux", "amd64"), ("linux", "arm64")]
    for arch in ARCHES:
        image = index.image(arch)
        config = json.loads(image.config.data)
        assert (config["architecture"], config["os"]) == (arch, "linux")
        assert config["config"]["Entrypoint"] == ["/gardener-node-agent"]
        members = layer_members(image)
        assert sorted(members) == ["gardener-node-agent", "ko-app", "ko-app/gardener-node-agent"]
        top, ko = members["gardener-node-agent"], members["ko-app/gardener-node-agent"]
        assert (top.type, top.mode, top.uid, top.gid) == (tarfile.REGTYPE, 0o755, 0, 0)
        assert (ko.type, ko.linkname) == (tarfile.LNKTYPE, "gardener-node-agent")
        single = agent_image.single_file(arch).read_bytes()
        assert top.size == len(single)
        assert elf_machine(single) == ELF_MACHINES[arch], arch


def test_ctr_pulls_each_platform_of_the_index(
    agent_image: AgentImage, registry: Registry, containerd_node: ContainerdNode
) -> None:
    """``ctr images pull --platform`` of the pushed index, per platform (each from a repository
    of its own, so the registry's log tells the pulls apart): each fetches its own manifest and
    not the other's, and the mounted image's file is that platform's program (its ELF
    machine)."""
    index = read_layout(agent_image.layout)
    containerd_node.trust(registry.host)
    name = f"gardener/node-agent-{uuid.uuid4().hex[:8]}"
    for arch in ARCHES:
        platform, repository = f"linux/{arch}", f"{name}-{arch}"
        digest = registry.push(repository, agent_image.version, index)
        assert digest == index.digest
        ref = registry.ref(repository, agent_image.version)
        containerd_node.ctr("images", "pull", "--platform", platform, "--hosts-dir", CERTS_D, ref)
        assert containerd_node.images()[ref] == index.digest
        manifests = {f"/v2/{repository}/manifests/{index.image(a).digest}": a for a in ARCHES}
        fetched: set[str] = set()
        deadline = time.monotonic() + 10  # the registry logs a request once it answered it
        while f"/v2/{repository}/manifests/{index.image(arch).digest}" not in fetched:
            assert time.monotonic() < deadline, (arch, fetched)
            time.sleep(0.1)
            fetched = {entry.path for entry in registry.served(repository)}
        assert {manifests[path] for path in fetched if path in manifests} == {arch}
        target = f"/run/node-agent-test/image-{arch}"
        containerd_node.node.run(["mkdir", "-p", target])
        containerd_node.ctr("images", "mount", "--platform", platform, ref, target)
        try:
            data = containerd_node.node.path(f"{target}/gardener-node-agent").read_bytes()
            ko = containerd_node.node.path(f"{target}/ko-app/gardener-node-agent").read_bytes()
        finally:
            containerd_node.unmount(target)
        assert elf_machine(data) == ELF_MACHINES[arch], arch
        assert data == ko == agent_image.single_file(arch).read_bytes(), arch


def test_user_data_installs_and_runs_the_single_file(
    agent_image: AgentImage, registry: Registry, containerd_node: ContainerdNode
) -> None:
    image = read_layout(agent_image.layout)
    repository = f"gardener/node-agent-{uuid.uuid4().hex[:8]}"
    digest = registry.push(repository, f"v{agent_image.version}", image)
    ref = registry.ref(repository, f"v{agent_image.version}")
    containerd_node.trust(registry.host)
    node = containerd_node.node

    out = sh(node, INIT_LINES, image=ref)
    assert out.returncode == 0, out.stderr
    assert containerd_node.images()[ref] == digest

    executable = agent_image.executable.read_bytes()
    for path in ("/opt/bin/gardener-node-agent", "/opt/ko/bin/gardener-node-agent"):
        st = node.path(path).lstat()
        assert stat.S_ISREG(st.st_mode), path  # one regular file, not a link or a directory
        assert stat.S_IMODE(st.st_mode) & 0o111 == 0o111, path
        content = node.path(path).read_bytes()
        assert content[:4] == b"\x7fELF", path  # a program, not a script
        assert content == executable, path

    hide_python(node)
    assert sh(node, "command -v python3 || command -v python3.11 || command -v python").stdout == ""
    for path in ("/opt/bin/gardener-node-agent", "/opt/ko/bin/gardener-node-agent"):
        out = sh(node, f"{path} version")
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"node-agent {agent_image.version}"
    # argv[0] reaches the agent: it names itself as upstream's binary does.
    out = sh(node, "cd /opt/bin && PATH=/opt/bin:$PATH gardener-node-agent --help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: gardener-node-agent "), out.stdout
    # The agent knows the single file it was started from (for self-update).
    out = sh(node, "/opt/bin/gardener-node-agent -m node_agent.base.selfexe")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "/opt/bin/gardener-node-agent"

    # Both copies are the same content: one unpacked bundle, root's, not writable by others.
    root = node.path(UNPACK_ROOT)
    st = root.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o755)
    copies = [p.name for p in root.iterdir() if not p.name.startswith(".")]
    assert [len(name) for name in copies] == [64], copies
    assert (root / copies[0] / ".complete").is_file()
    assert (root / copies[0] / "node-agent").is_file()
