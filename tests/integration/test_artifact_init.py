"""From user-data to a running service, on a throwaway node without any Python.

The real artifact (``packaging/build.sh``) is served over HTTP from this process; the real init
script installs it inside a node whose every Python is hidden, ``node-agent bootstrap`` installs
the unit, and the node's systemd runs the agent, which reaches the test API server with
least-privilege credentials. Re-runs, a bad checksum and an unreachable source must leave that
running agent exactly as it was.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from tests.testbed.agent_harness import NS, OSCAgent
from tests.testbed.controlplane import ControlPlane
from tests.testbed.systemd_ns import IsolatedSystemd
from tests.testbed.userdata import (
    BASE,
    INIT_PATH,
    INIT_SCRIPT,
    INIT_UNIT,
    PYTHON_DIRS,
    REPO,
    UNIT,
    Artifact,
    hide_python,
    install_credentials,
    play_user_data,
    sh,
    show,
)

pytestmark = pytest.mark.integration


def snapshot(node: IsolatedSystemd, *roots: str) -> dict[str, tuple[int, int, int]]:
    """(mtime, ctime, inode) of every entry below the given node paths, symlinks not followed."""
    found: dict[str, tuple[int, int, int]] = {}
    for root in roots:
        top = node.path(root)
        for entry in [top, *top.rglob("*")]:
            st = entry.lstat()
            found[str(entry.relative_to(node.root))] = (st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    return found


@dataclass
class Installed:
    node: IsolatedSystemd
    agent: OSCAgent
    artifact: Artifact
    url: str
    first: subprocess.CompletedProcess[str]
    seconds_to_ready: float


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def installed(
    workdir: Path,
    control_plane: ControlPlane,
    admin_api: ApiClient,
    artifact: Artifact,
    server: str,
) -> AsyncIterator[Installed]:
    """A Python-less node where the init script ran once, the way upstream runs it: user-data
    wrote the files and the enabled ``gardener-node-init.service``, which runs the script."""
    with IsolatedSystemd(workdir / "artifact-nodes", overlay=True) as node:
        agent = OSCAgent(admin_api, control_plane, node, workdir)
        await agent.setup()
        node.run(["hostname", agent.node_name])  # the agent finds its Node by hostname
        hide_python(node)
        install_credentials(agent, control_plane)
        url = f"{server}/{artifact.path.name}"
        first, seconds = play_user_data(node, url, artifact)
        try:
            yield Installed(node, agent, artifact, url, first, seconds)
        finally:
            await agent.stop()


async def test_init_installs_and_the_service_runs(installed: Installed) -> None:
    node, artifact = installed.node, installed.artifact
    top = node.path("/opt/node-agent")
    assert os.readlink(top / "current") == artifact.version
    assert (top / artifact.version / ".sha256").read_text().strip() == artifact.sha256
    assert os.access(top / "current" / "bin" / "node-agent", os.X_OK)
    assert sorted(p.name for p in top.iterdir()) == [artifact.version, "current"]  # no temp left
    assert sorted(p.name for p in node.path(f"{BASE}/tmp").iterdir()) == ["init.lock"]
    assert f"bootstrap: {UNIT} started" in installed.first.stdout

    state = show(node, UNIT)
    assert state["ActiveState"] == "active", state
    assert state["SubState"] == "running"
    assert state["Type"] == "notify"
    assert state["NotifyAccess"] == "main"
    assert state["UnitFileState"] == "enabled"
    assert state["NRestarts"] == "0"
    assert int(state["MainPID"]) > 0
    assert show(node, INIT_UNIT)["UnitFileState"] == "disabled"  # bootstrap disabled it
    unit_file = node.path(f"/etc/systemd/system/{UNIT}").read_bytes()
    assert unit_file == (REPO / "systemd" / "node-agent.service").read_bytes()
    ready = int(state["ActiveEnterTimestampMonotonic"]) - int(
        state["ExecMainStartTimestampMonotonic"]
    )
    print(f"\nagent exec to READY=1: {ready / 1e6:.2f}s", end="")
    print(
        f"\ninit script {INIT_SCRIPT.stat().st_size} bytes; user-data to READY (fetch, verify, "
        f"unpack, bootstrap, agent start) {installed.seconds_to_ready:.2f}s"
    )

    # The agent is really at work: its Lease is there, renewed through its own credentials.
    lease_name = f"gardener-node-agent-{installed.agent.node_name}"
    coordination = client.CoordinationV1Api(installed.agent.admin)
    deadline = time.monotonic() + 30
    while True:
        try:
            lease = await coordination.read_namespaced_lease(lease_name, NS)
            break
        except client.ApiException as exc:
            if exc.status != 404 or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    assert lease.spec.holder_identity == lease_name

    # Upstream's kubelet bootstrap kubeconfig (the node has a bootstrap token).
    kubeconfig_path = node.path("/var/lib/kubelet/kubeconfig-bootstrap")
    assert stat.S_IMODE(kubeconfig_path.stat().st_mode) == 0o600
    kubeconfig = yaml.safe_load(kubeconfig_path.read_text())
    assert kubeconfig["clusters"][0]["cluster"] == {
        "server": installed.agent.control_plane.server,
        "certificate-authority": f"{BASE}/cluster-ca.crt",
    }
    assert kubeconfig["users"][0]["user"] == {"token": "abcdef.0123456789abcdef"}


def test_agent_runs_without_any_python(installed: Installed) -> None:
    node = installed.node
    assert sh(node, "command -v python3 || command -v python || command -v python3.11").returncode
    for directory in PYTHON_DIRS:
        if node.path(directory).is_dir():
            assert not any(node.path(directory).iterdir()), directory
    pid = show(node, UNIT)["MainPID"]
    bundle = f"/opt/node-agent/{installed.artifact.version}/lib/node-agent"
    assert sh(node, f"readlink /proc/{pid}/exe").stdout.strip() == f"{bundle}/node-agent"
    maps = {
        line.split()[-1]
        for line in sh(node, f"cat /proc/{pid}/maps").stdout.splitlines()
        if line.count("/") and len(line.split()) >= 6
    }
    libpython = [m for m in maps if "libpython" in m]
    assert libpython == [f"{bundle}/_internal/libpython3.11.so.1.0"], libpython
    assert not [m for m in maps if "pyenv" in m or "/usr/lib/python" in m]
    # Its systemd worker is the same binary, run as `-m node_agent.systemd.worker`.
    children = sh(node, f"cat /proc/{pid}/task/*/children").stdout.split()
    cmdlines = [sh(node, f"tr '\\0' ' ' < /proc/{c}/cmdline").stdout for c in children]
    assert any("-m node_agent.systemd.worker" in c for c in cmdlines), cmdlines

    timings = []
    for _ in range(5):
        started = time.monotonic()
        out = sh(node, "/opt/node-agent/current/bin/node-agent version")
        timings.append(time.monotonic() - started)
        assert out.stdout.strip() == f"node-agent {installed.artifact.version}", out.stderr
    size = installed.artifact.path.stat().st_size
    print(
        f"\nartifact {size / 1e6:.1f} MB; `node-agent version` in the node: first "
        f"{timings[0] * 1000:.0f} ms, best {min(timings) * 1000:.0f} ms (incl. nsenter)"
    )


def test_rerun_changes_nothing(installed: Installed) -> None:
    """A reboot re-runs user-data: same version, nothing downloaded, written or restarted."""
    node, artifact = installed.node, installed.artifact
    watched = ("/opt/node-agent", "/etc/systemd/system", f"{BASE}/config.yaml", "/var/lib/kubelet")
    before, state = snapshot(node, *watched), show(node, UNIT)
    out = sh(node, f"{INIT_PATH} {installed.url}.gone {artifact.sha256} {artifact.version}")
    assert out.returncode == 0, out.stderr  # the URL is not even fetched: the install is verified
    assert out.stdout.strip() == (
        f"bootstrap: {UNIT} already running (pid {state['MainPID']}); config in place; "
        "kubelet bootstrap kubeconfig unchanged; gardener-node-init.service already disabled"
    )
    assert out.stderr == ""
    after = show(node, UNIT)
    assert after["InvocationID"] == state["InvocationID"]
    assert after["MainPID"] == state["MainPID"]
    assert snapshot(node, *watched) == before


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("bad-checksum", "checksum mismatch for "),
        ("refused", "cannot fetch http://127.0.0.1:"),
        ("not-found", "cannot fetch http://127.0.0.1:"),
        ("missing-file", "cannot read /srv/nothing-here.tar.gz"),
    ],
)
def test_failure_is_one_line_and_keeps_the_running_install(
    installed: Installed, case: str, reason: str
) -> None:
    node, artifact = installed.node, installed.artifact
    url, sha = installed.url, artifact.sha256
    if case == "bad-checksum":
        sha = "0" * 64
    elif case == "refused":
        url = "http://127.0.0.1:9/node-agent.tar.gz"  # discard port: nothing listens
    elif case == "not-found":
        url = f"{installed.url}.missing"
    else:
        url = "file:///srv/nothing-here.tar.gz"
    before, state = snapshot(node, "/opt/node-agent", "/etc/systemd/system"), show(node, UNIT)
    out = sh(node, f"{INIT_PATH} {url} {sha} 9.9.9", NODE_AGENT_RETRIES="0")
    assert out.returncode != 0
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"node-agent-init: {reason}"), out.stderr
    assert out.stdout == ""
    assert snapshot(node, "/opt/node-agent", "/etc/systemd/system") == before
    assert sorted(p.name for p in node.path(f"{BASE}/tmp").iterdir()) == ["init.lock"]
    after = show(node, UNIT)
    assert after["ActiveState"] == "active"
    assert after["InvocationID"] == state["InvocationID"]


def test_changed_unit_file_is_restored_and_restarts_the_agent(installed: Installed) -> None:
    """A unit that differs from the shipped one (an older release's) is rewritten; only then
    does bootstrap restart the agent, which comes back READY."""
    node, artifact = installed.node, installed.artifact
    unit_path = node.path(f"/etc/systemd/system/{UNIT}")
    shipped = unit_path.read_bytes()
    unit_path.write_bytes(shipped.replace(b"RestartSec=5", b"RestartSec=7"))
    node.run(["systemctl", "daemon-reload"])
    state = show(node, UNIT)
    out = sh(node, f"{INIT_PATH} {installed.url} {artifact.sha256} {artifact.version}")
    assert out.returncode == 0, out.stderr
    assert f"bootstrap: {UNIT} restarted" in out.stdout
    assert unit_path.read_bytes() == shipped
    after = show(node, UNIT)
    assert after["ActiveState"] == "active"
    assert after["InvocationID"] != state["InvocationID"]
    assert after["NRestarts"] == "0"  # a requested restart, not a crash
