"""Debian's containerd running as ``containerd.service`` inside a throwaway node.

The node is the usual overlay of the host's root with its own systemd (``systemd_ns``), with
``containerd.service`` left unmasked. containerd's state (``/var/lib/containerd``) is a tmpfs
mounted inside the node: the node's root is itself an overlayfs, and while pulls and read-only
image mounts of the overlayfs snapshotter work there (layers are unpacked into plain
directories, a view mounts them as lower layers only), every writable snapshot needs an
overlayfs upper directory on overlayfs, which the kernel refuses (``ctr images mount --rw``
fails with EINVAL). On tmpfs all of it works, as on a real node's disk.

``/etc/containerd/config.toml`` is seeded from ``containerd config default`` with the CRI
registry's ``config_path`` pointing at ``/etc/containerd/certs.d``, as on a Gardener node; the
test CA is at ``NODE_CA_PATH``.
Nothing of the host's ``/etc/containerd`` or ``/var/lib/containerd`` is used or changed.
"""

from __future__ import annotations

import contextlib
import functools
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from tests.testbed.systemd_ns import HarnessError, IsolatedSystemd

CERTS_D = "/etc/containerd/certs.d"
CONFIG_TOML = "/etc/containerd/config.toml"
STATE_DIR = "/var/lib/containerd"
NODE_CA_PATH = "/etc/node-agent-test/registry-ca.crt"
DEFAULT_NAMESPACE = "default"
START_TIMEOUT = 30.0
_CONFIG_PATH_DEFAULT = '[plugins."io.containerd.grpc.v1.cri".registry]\n      config_path = ""'


@functools.cache
def default_config() -> str:
    """``containerd config default`` with the CRI registry reading ``certs.d``."""
    result = subprocess.run(
        ["containerd", "config", "default"], capture_output=True, text=True, timeout=30, check=False
    )
    if result.returncode != 0:
        raise HarnessError(f"containerd config default failed: {result.stderr.strip()}")
    text = result.stdout
    if text.count(_CONFIG_PATH_DEFAULT) != 1:
        raise HarnessError("containerd config default has no single empty registry config_path")
    return text.replace(_CONFIG_PATH_DEFAULT, _CONFIG_PATH_DEFAULT.replace('""', f'"{CERTS_D}"'), 1)


def config_v1(registry_config_path: str = "") -> str:
    """A version 1 ``config.toml`` (no ``version``; plugins by short ID), as containerd 1.x
    nodes carry, with the CRI registry's ``config_path``."""
    return (
        'root = "/var/lib/containerd"\n'
        'state = "/run/containerd"\n'
        "\n"
        "[plugins]\n"
        "  [plugins.cri]\n"
        '    sandbox_image = "registry.k8s.io/pause:3.6"\n'
        "    [plugins.cri.containerd.runtimes.runc]\n"
        '      runtime_type = "io.containerd.runc.v2"\n'
        "      [plugins.cri.containerd.runtimes.runc.options]\n"
        "        SystemdCgroup = false\n"
        "    [plugins.cri.registry]\n"
        f'      config_path = "{registry_config_path}"\n'
    )


def hosts_toml(server: str, hosts: Sequence[str], *, ca: str | None = NODE_CA_PATH) -> str:
    """A ``hosts.toml``: pulls of ``server`` go to ``hosts`` first (pull and resolve), each
    trusted with ``ca``; the server itself stays the fallback."""
    lines = [f'server = "{server}"']
    if ca is not None:
        lines.append(f'ca = "{ca}"')
    for host in hosts:
        lines += ["", f'[host."{host}"]', '  capabilities = ["pull", "resolve"]']
        if ca is not None:
            lines.append(f'  ca = "{ca}"')
    return "\n".join(lines) + "\n"


class ContainerdNode:
    """A throwaway node with containerd running; ``ctr`` helpers run inside it."""

    def __init__(self, node: IsolatedSystemd, ca_cert: Path | None) -> None:
        self.node = node
        self.ca_cert = ca_cert

    # -- life cycle -------------------------------------------------------------------
    def prepare(self) -> None:
        """State on a tmpfs, the seeded config, certs.d and the test CA (before the start)."""
        self.node.run(["mkdir", "-p", STATE_DIR, CERTS_D])
        self.node.run(["mount", "-t", "tmpfs", "-o", "mode=0711", "containerd-state", STATE_DIR])
        self.node.path(CONFIG_TOML).write_text(default_config())
        if self.ca_cert is not None:
            target = self.node.path(NODE_CA_PATH)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(self.ca_cert.read_bytes())

    def start(self, timeout: float = START_TIMEOUT) -> None:
        self.systemctl("enable", "--now", "containerd.service")  # as on a real node
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while self.ctr("version", check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"containerd in {self.node.name} not ready within {timeout:.0f}s:\n"
                    + self.journal("containerd.service")
                )
            time.sleep(0.05)

    # -- inside the node ----------------------------------------------------------------
    @property
    def nsenter_argv(self) -> list[str]:
        """The prefix that runs a command inside the node (as ``IsolatedSystemd.run`` does).

        ``ctr`` must run there, not on the host against the node's socket: it reads
        ``hosts.toml`` and the CA files it names, and mounts snapshots, in its own file system.
        """
        return ["nsenter", "-t", str(self.node.pid), "-m", "-p", "-u", "-i", "-C", "-r", "-w"]

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._run(["systemctl", *args], check=check)

    def journal(self, unit: str, lines: int = 40) -> str:
        result = self.node.run(
            ["journalctl", "--no-pager", "-n", str(lines), "-u", unit], check=False
        )
        return result.stdout

    def ctr(
        self,
        *args: str,
        namespace: str = DEFAULT_NAMESPACE,
        check: bool = True,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        return self._run(["ctr", "-n", namespace, *args], check=check, timeout=timeout)

    def pull(
        self, ref: str, *, namespace: str = DEFAULT_NAMESPACE, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """``ctr images pull --hosts-dir /etc/containerd/certs.d <ref>`` (unpacked)."""
        return self.ctr(
            "images", "pull", "--hosts-dir", CERTS_D, ref, namespace=namespace, check=check
        )

    def images(self, *, namespace: str = DEFAULT_NAMESPACE) -> dict[str, str]:
        """``{reference: manifest digest}`` of the images containerd holds."""
        out = self.ctr("images", "ls", namespace=namespace).stdout.splitlines()
        images: dict[str, str] = {}
        for line in out[1:]:
            fields = line.split()
            if len(fields) >= 3:
                images[fields[0]] = fields[2]
        return images

    def mount(self, ref: str, target: str, *, namespace: str = DEFAULT_NAMESPACE) -> None:
        """Mount the image's root file system read-only on ``target`` (inside the node)."""
        self.node.run(["mkdir", "-p", target])
        self.ctr("images", "mount", ref, target, namespace=namespace)

    def unmount(self, target: str, *, namespace: str = DEFAULT_NAMESPACE) -> None:
        self.ctr("images", "unmount", "--rm", target, namespace=namespace)

    @contextlib.contextmanager
    def mounted(
        self,
        ref: str,
        target: str = "/run/node-agent-test/image",
        *,
        namespace: str = DEFAULT_NAMESPACE,
    ) -> Iterator[Path]:
        """The image mounted read-only; yields the mount point as seen from the host."""
        self.mount(ref, target, namespace=namespace)
        try:
            yield self.node.path(target)
        finally:
            self.unmount(target, namespace=namespace)

    def write_hosts_toml(
        self, upstream: str, server: str, hosts: Sequence[str], *, ca: str | None = NODE_CA_PATH
    ) -> Path:
        """``certs.d/<upstream>/hosts.toml`` (``upstream`` as in image refs, e.g. ``host:port``)."""
        path = self.node.path(f"{CERTS_D}/{upstream}/hosts.toml")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(hosts_toml(server, hosts, ca=ca))
        return path

    def trust(self, upstream: str) -> Path:
        """Direct pulls of ``upstream`` over HTTPS, trusting the test CA: a ``hosts.toml``
        whose only host is the registry itself. (A bare ``certs.d/<host>/ca.crt`` is not
        enough for a loopback registry: without ``hosts.toml`` containerd 1.6 speaks plain
        HTTP to 127.0.0.1 and localhost; and 1.6.20 rejects a ``hosts.toml`` without any
        ``[host]`` table: "invalid `host` tree".)"""
        url = f"https://{upstream}"
        return self.write_hosts_toml(upstream, url, (url,))

    def _run(
        self, argv: Sequence[str], *, check: bool, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        result = self.node.run(argv, check=False, timeout=timeout)
        if check and result.returncode != 0:
            raise HarnessError(
                f"{' '.join(argv)} failed in {self.node.name} ({result.returncode}): "
                f"{(result.stderr or result.stdout).strip()}"
            )
        return result


@contextlib.contextmanager
def containerd_node(workdir: Path, ca_cert: Path | None = None) -> Iterator[ContainerdNode]:
    """A throwaway node with ``containerd.service`` running (and the test CA inside)."""
    node = IsolatedSystemd(workdir, overlay=True, unmask=("containerd.service",))
    node.start()
    try:
        instance = ContainerdNode(node, ca_cert)
        instance.prepare()
        instance.start()
        yield instance
    finally:
        node.stop()
