"""Playing user-data on a throwaway node: the artifact, a server for it, credentials, init.

Shared by the end-to-end tests and ``make demo``, so the demo shows exactly what is tested.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.testbed.agent_harness import OSCAgent
from tests.testbed.controlplane import ControlPlane
from tests.testbed.systemd_ns import IsolatedSystemd

REPO = Path(__file__).resolve().parents[2]
INIT_SCRIPT = REPO / "init" / "node-agent-init.sh"
UNIT = "gardener-node-agent.service"
INIT_UNIT = "gardener-node-init.service"
BASE = "/var/lib/gardener-node-agent"
INIT_PATH = f"{BASE}/init.sh"
AGENT_BIN = "/opt/node-agent/current/bin/node-agent"
# Every place a Python could come from on this machine; hidden inside the node.
PYTHON_DIRS = ("/root/.pyenv", "/usr/lib/python3", "/usr/lib/python3.11", "/usr/local/lib")
PYTHON_GLOBS = "/usr/bin/python* /usr/local/bin/python* /usr/lib/x86_64-linux-gnu/libpython*"


@dataclass(frozen=True)
class Artifact:
    path: Path
    sha256: str
    version: str


def build_artifact(out: Path) -> Artifact:
    """The artifact, built by the same script CI and the Containerfile use (cached by its key)."""
    env = {**os.environ, "PYTHON": sys.executable}
    built = subprocess.run(
        ["sh", str(REPO / "packaging" / "build.sh"), str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env=env,
    )
    if built.returncode != 0:
        raise RuntimeError(f"artifact build failed:\n{built.stderr[-3000:]}")
    path = Path(built.stdout.strip().splitlines()[-1])
    sha = Path(f"{path}.sha256").read_text().split()[0]
    if hashlib.sha256(path.read_bytes()).hexdigest() != sha:
        raise RuntimeError(f"{path} does not match its .sha256")
    version = path.name.removeprefix("node-agent-").removesuffix("-linux-amd64.tar.gz")
    return Artifact(path, sha, version)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def serve_directory(directory: Path) -> Iterator[str]:
    """A loopback HTTP server for one directory; nodes share this network namespace."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def sh(
    node: IsolatedSystemd, script: str, timeout: float = 180, **env: str
) -> subprocess.CompletedProcess[str]:
    """A shell command inside the node, with a PATH like a real node's and nothing inherited."""
    argv = [
        "env",
        "-i",
        "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
        *(f"{k}={v}" for k, v in env.items()),
    ]
    return node.run([*argv, "sh", "-c", script], check=False, timeout=timeout)


def show(node: IsolatedSystemd, unit: str) -> dict[str, str]:
    props = (
        "ActiveState,SubState,MainPID,InvocationID,NRestarts,UnitFileState,Type,NotifyAccess,"
        "ExecMainStartTimestampMonotonic,ActiveEnterTimestampMonotonic"
    )
    out = node.run(["systemctl", "show", "-p", props, unit]).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def hide_python(node: IsolatedSystemd) -> None:
    """The node's mount namespace is private and its root an overlay: nothing reaches the host."""
    for directory in PYTHON_DIRS:
        if node.path(directory).is_dir():
            node.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "no-python", directory])
    sh(node, f"rm -f {PYTHON_GLOBS}")


def install_credentials(
    agent: OSCAgent, control_plane: ControlPlane, controllers: dict[str, Any] | None = None
) -> None:
    """Config, kubeconfig, token and CA where user-data puts them, all valid inside the node."""
    assert agent.creds is not None
    node = agent.node
    creds = node.path(f"{BASE}/credentials")
    creds.mkdir(parents=True, exist_ok=True)
    (creds / "token").write_text(agent.creds.token)
    (creds / "token").chmod(0o600)
    (creds / "bootstrap-token").write_text("abcdef.0123456789abcdef\n")
    node.path(f"{BASE}/cluster-ca.crt").write_bytes(control_plane.ca_file.read_bytes())
    name = "node-agent"
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": name,
                "cluster": {
                    "server": control_plane.server,
                    "certificate-authority": f"{BASE}/cluster-ca.crt",
                },
            }
        ],
        "users": [{"name": name, "user": {"tokenFile": f"{BASE}/credentials/token"}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
    }
    (creds / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
    (creds / "kubeconfig").chmod(0o600)
    config = {
        "apiVersion": "nodeagent.config.gardener.cloud/v1alpha1",
        "kind": "NodeAgentConfiguration",
        "apiServer": {"server": control_plane.server, "caFile": f"{BASE}/cluster-ca.crt"},
        "clientConnection": {"kubeconfig": f"{BASE}/credentials/kubeconfig"},
        "controllers": {
            "operatingSystemConfig": {
                "secretName": agent.secret_name,
                "kubernetesVersion": "1.33.4",
            },
            **(controllers or {}),
        },
    }
    path = node.path(f"{BASE}/config.yaml")
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)


def play_user_data(
    node: IsolatedSystemd,
    url: str,
    artifact: Artifact,
    *,
    check: bool = True,
    env: Mapping[str, str] | None = None,
) -> tuple[subprocess.CompletedProcess[str], float]:
    """What the cloud's user-data does: the init script and an enabled init unit that runs it.

    Returns the init run (stdout = its journal and the agent's, returncode that of starting the
    init unit) and the seconds it took; a failed init raises unless ``check`` is false.
    ``env``: more environment for the init script (and the bootstrap it runs)."""
    script = node.path(INIT_PATH)
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_bytes(INIT_SCRIPT.read_bytes())
    script.chmod(0o755)
    node.path(f"/etc/systemd/system/{INIT_UNIT}").write_text(
        "[Unit]\nDescription=user-data: install and bootstrap node-agent\n"
        "[Service]\nType=oneshot\n"
        f"Environment=NODE_AGENT_URL={url} NODE_AGENT_SHA256={artifact.sha256} "
        f"NODE_AGENT_VERSION={artifact.version}"
        + "".join(f" {k}={v}" for k, v in (env or {}).items())
        + "\n"
        f"ExecStart={INIT_PATH}\n"
        "[Install]\nWantedBy=multi-user.target\n"
    )
    node.run(["systemctl", "daemon-reload"])
    node.run(["systemctl", "enable", INIT_UNIT])
    started = time.monotonic()
    first = node.run(["systemctl", "start", INIT_UNIT], check=False, timeout=180)
    seconds = time.monotonic() - started
    journal = node.run(
        ["journalctl", "--no-pager", "-o", "cat", "-u", INIT_UNIT, "-u", UNIT], check=False
    ).stdout
    if check and first.returncode != 0:
        raise RuntimeError(f"init failed: {first.stderr}\njournal:\n{journal[-4000:]}")
    return subprocess.CompletedProcess(first.args, first.returncode, journal, first.stderr), seconds
