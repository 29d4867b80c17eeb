"""The test bed's containerd, registries and images are the real thing and behave as a node's."""

from __future__ import annotations

import os
import stat
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.testbed import oci, standin
from tests.testbed.containerd import ContainerdNode
from tests.testbed.controlplane import free_port
from tests.testbed.registry import Registry

pytestmark = pytest.mark.integration

KUBELET_UNIT = """\
[Unit]
Description=stand-in kubelet
StartLimitIntervalSec=0

[Service]
ExecStart=/opt/bin/kubelet --config=/var/lib/kubelet/config/kubelet --healthz-port={port}
Restart=always
RestartSec=1
"""


def _repository(name: str) -> str:
    """A repository no earlier test (or run of the session) has pulled through the mirror."""
    return f"test/{name}-{uuid.uuid4().hex[:8]}"


def _healthz(port: int) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as err:
        return int(err.code), bytes(err.read())


def test_pull_through_mirror_and_read_file_back(
    registry: Registry, mirror: Registry, containerd_node: ContainerdNode
) -> None:
    content = os.urandom(4096) + b"\n"
    repository = _repository("payload")
    image = oci.build_image(
        [{"/usr/share/payload.bin": (content, 0o640)}, {"/etc/marker": (b"second layer\n", 0o600)}]
    )
    digest = registry.push(repository, "v1", image)
    ref = registry.ref(repository, "v1")
    containerd_node.write_hosts_toml(registry.host, registry.url, [mirror.url])

    containerd_node.pull(ref)

    assert containerd_node.images() == {ref: digest}
    fetched = {(e.method, e.path) for e in mirror.served(repository, user_agent="containerd/")}
    assert ("GET", f"/v2/{repository}/manifests/{digest}") in fetched
    for blob in (*image.layers, image.config):
        assert ("GET", f"/v2/{repository}/blobs/{blob.digest}") in fetched
        assert mirror.has_blob(blob.digest)
    # containerd never went to the registry itself; the mirror did, on its behalf.
    assert registry.served(repository, user_agent="containerd/") == []
    assert registry.served(repository, user_agent="Go-http-client")

    with containerd_node.mounted(ref) as root:
        payload = root / "usr/share/payload.bin"
        assert payload.read_bytes() == content
        assert stat.S_IMODE(payload.stat().st_mode) == 0o640
        assert stat.S_IMODE((root / "etc/marker").stat().st_mode) == 0o600
        assert (root / "etc/marker").read_bytes() == b"second layer\n"
        with pytest.raises(OSError, match="Read-only file system"):
            (root / "usr/share/new").write_bytes(b"x")
    assert not os.path.ismount(containerd_node.node.path("/run/node-agent-test/image"))


def test_standin_kubelet_from_image_runs_as_unit(
    registry: Registry, mirror: Registry, containerd_node: ContainerdNode
) -> None:
    repository = _repository("hyperkube")
    digest = registry.push(repository, "v1.33.0", oci.build_image(standin.kubelet_image_files()))
    ref = registry.ref(repository, "v1.33.0")
    containerd_node.write_hosts_toml(registry.host, registry.url, [mirror.url])
    containerd_node.pull(ref)
    assert containerd_node.images()[ref] == digest
    node = containerd_node.node
    with containerd_node.mounted(ref, "/run/node-agent-test/hyperkube") as root:
        assert stat.S_IMODE((root / "kubelet").stat().st_mode) == 0o755
        node.run(["install", "-D", "-m", "0755", "/run/node-agent-test/hyperkube/kubelet",
                  "/opt/bin/kubelet"])  # fmt: skip
    assert node.path("/opt/bin/kubelet").read_bytes() == standin.kubelet_binary()

    port = free_port()
    node.path("/etc/systemd/system/kubelet.service").write_text(KUBELET_UNIT.format(port=port))
    node.run(["systemctl", "daemon-reload"])
    node.run(["systemctl", "start", "kubelet.service"])

    deadline = time.monotonic() + 20
    answer: tuple[int, bytes] | None = None
    while answer is None:
        try:
            answer = _healthz(port)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    assert answer == (200, b"ok")
    for unit in ("kubelet.service", "containerd.service"):
        active = node.run(["systemctl", "is-active", unit], check=False).stdout.strip()
        assert active == "active", unit


def test_same_content_gives_same_digest(registry: Registry) -> None:
    files = {"/bin/tool": (b"#!/bin/sh\necho tool\n", 0o755), "/etc/tool.conf": (b"a=1\n", 0o644)}
    first = oci.build_image(files)
    again = oci.build_image(dict(reversed(list(files.items()))))
    other = oci.build_image({**files, "/etc/tool.conf": (b"a=1\n", 0o600)})
    assert again.digest == first.digest
    assert other.digest != first.digest

    repository = _repository("same")
    pushed = registry.push(repository, "one", first)
    assert registry.push(repository, "two", again) == pushed == first.digest
    assert registry.push(_repository("same"), "one", oci.build_image(files)) == pushed


def test_containerd_state_is_its_own_and_survives_restart(
    registry: Registry, containerd_node: ContainerdNode
) -> None:
    config = containerd_node.node.path("/etc/containerd/config.toml").read_text()
    assert 'config_path = "/etc/containerd/certs.d"' in config
    host_config = Path("/etc/containerd/config.toml")
    assert not host_config.exists() or host_config.read_text() != config
    mounts = containerd_node.node.run(["findmnt", "-n", "-o", "FSTYPE", "/var/lib/containerd"])
    assert mounts.stdout.strip() == "tmpfs"

    repository = _repository("state")
    digest = registry.push(repository, "v1", oci.build_image({"/a": (b"a\n", 0o644)}))
    ref = registry.ref(repository, "v1")
    containerd_node.trust(registry.host)
    containerd_node.pull(ref)
    # A writable snapshot needs an overlayfs upper directory: this is what the tmpfs is for.
    containerd_node.node.run(["mkdir", "-p", "/run/rw"])
    containerd_node.ctr("images", "mount", "--rw", ref, "/run/rw")
    containerd_node.node.path("/run/rw/b").write_bytes(b"b\n")
    containerd_node.unmount("/run/rw")

    containerd_node.systemctl("restart", "containerd.service")
    containerd_node.wait_ready()
    assert containerd_node.images() == {ref: digest}
