"""Provision user-data shaped like Gardener's, played on a throwaway node.

What a worker machine gets from Gardener before any agent runs (design notes, section 6): under
``/var/lib/gardener-node-agent`` the cluster CA (0640), the bootstrap token (0640), the machine
name (0640), the init script (0755) and ``config-<gardener version>.yaml`` (0600, the API server
and CA, the OSC Secret's name, no kubeconfig); ``/etc/containerd/config.toml`` seeded from
``containerd config default`` if empty; and the oneshot ``gardener-node-init.service`` that
pulls the agent's image with ``ctr``, mounts it, copies the one file to ``/opt/bin`` and runs
``bootstrap --config-dir``. The script below is this project's own, written from those facts.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

import yaml

from tests.testbed.systemd_ns import IsolatedSystemd

BASE = "/var/lib/gardener-node-agent"
INIT_SCRIPT = f"{BASE}/init.sh"
INIT_UNIT = "gardener-node-init.service"
AGENT_UNIT = "gardener-node-agent.service"
AGENT_BINARY = "/opt/bin/gardener-node-agent"
CA_FILE = f"{BASE}/cluster-ca.crt"

INIT_SH = """\
#!/bin/bash
# Fetch the node agent from its image and hand over to it (run by gardener-node-init.service).
set -o errexit -o nounset -o pipefail

image=%(image)s
echo "> pulling $image"
ctr images pull --hosts-dir /etc/containerd/certs.d "$image"
mnt=$(mktemp -d)
cleanup() { ctr images unmount "$mnt" >/dev/null 2>&1 || true; rmdir "$mnt" || true; }
trap cleanup EXIT
ctr images mount "$image" "$mnt"
mkdir -p /opt/bin
if [ -f "$mnt/gardener-node-agent" ]; then
  cp -f "$mnt/gardener-node-agent" /opt/bin/gardener-node-agent
else
  cp -f "$mnt/ko-app/gardener-node-agent" /opt/bin/gardener-node-agent
fi
chmod 0755 /opt/bin/gardener-node-agent
cleanup
trap - EXIT
echo "> bootstrapping the node agent"
exec /opt/bin/gardener-node-agent bootstrap --config-dir=%(base)s
"""

INIT_UNIT_TEXT = """\
[Unit]
Description=Downloads the gardener-node-agent binary and starts it
Requires=containerd.service
After=containerd.service
After=network-online.target
Wants=network-online.target

[Service]
Type=oneshot
Restart=on-failure
RestartSec=5
StartLimitBurst=0
EnvironmentFile=/etc/environment
ExecStart=%(script)s

[Install]
WantedBy=multi-user.target
"""


@dataclass(frozen=True)
class Provision:
    """The inputs Gardener renders into a machine's user-data."""

    image: str
    server: str
    ca_pem: bytes
    bootstrap_token: str
    machine_name: str
    secret_name: str
    gardener_version: str = "v1.150.0"
    kubernetes_version: str = "1.33.0"
    #: the agent's probe and metrics ports (Gardener leaves them at 2751/2752)
    ports: tuple[int, int] | None = None

    @property
    def config_path(self) -> str:
        return f"{BASE}/config-{self.gardener_version}.yaml"

    def agent_config(self, kubernetes_version: str | None = None) -> str:
        doc: dict[str, object] = {
            "apiVersion": "nodeagent.config.gardener.cloud/v1alpha1",
            "kind": "NodeAgentConfiguration",
            "apiServer": {"server": self.server, "caFile": CA_FILE},
            "controllers": {
                "operatingSystemConfig": {
                    "secretName": self.secret_name,
                    "kubernetesVersion": kubernetes_version or self.kubernetes_version,
                    "syncPeriod": "12h",
                },
            },
        }
        if self.ports is not None:
            health, metrics = self.ports
            doc["server"] = {"healthProbes": {"port": health}, "metrics": {"port": metrics}}
        return yaml.safe_dump(doc, sort_keys=True)


def _write(node: IsolatedSystemd, path: str, data: bytes, mode: int) -> None:
    target = node.path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    target.chmod(mode)


def play(node: IsolatedSystemd, p: Provision) -> subprocess.CompletedProcess[str]:
    """Write what the user-data writes and start the init unit the way it does (no wait)."""
    node.run(["hostname", p.machine_name])
    _write(node, CA_FILE, p.ca_pem, 0o640)
    _write(node, f"{BASE}/credentials/bootstrap-token", p.bootstrap_token.encode(), 0o640)
    _write(node, f"{BASE}/machine-name", p.machine_name.encode(), 0o640)
    _write(node, p.config_path, p.agent_config().encode(), 0o600)
    _write(node, INIT_SCRIPT, (INIT_SH % {"image": p.image, "base": BASE}).encode(), 0o755)
    if not node.path("/etc/environment").exists():
        _write(node, "/etc/environment", b"", 0o644)
    config = node.path("/etc/containerd/config.toml")
    if not config.exists() or not config.read_bytes().strip():
        default = node.run(["containerd", "config", "default"]).stdout
        _write(node, "/etc/containerd/config.toml", default.encode(), 0o644)
    _write(
        node,
        f"/etc/systemd/system/{INIT_UNIT}",
        (INIT_UNIT_TEXT % {"script": INIT_SCRIPT}).encode(),
        0o644,
    )
    node.run(["systemctl", "daemon-reload"])
    node.run(["systemctl", "enable", INIT_UNIT])
    return node.run(["systemctl", "restart", "--no-block", INIT_UNIT], check=False)


def agent_unit_text() -> str:
    """The agent's unit as Gardener's reconcile OSC carries it."""
    return (
        "[Unit]\nDescription=Gardener Node Agent\nAfter=network-online.target\n\n"
        "[Service]\n"
        f"ExecStart={AGENT_BINARY} --config-dir={BASE}\n"
        "Restart=always\nRestartSec=5\n\n"
        "[Install]\nWantedBy=multi-user.target"
    )
