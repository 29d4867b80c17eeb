"""`make demo`: node-agent's real job, end to end, as a guided tour.

A real kube-apiserver and etcd, a throwaway node (an overlay of this machine's root with its own
systemd as PID 1, and no Python at all), the real artifact served over HTTP, and user-data played
by the real init script. Then an OperatingSystemConfig is applied, inspected with
`node-agent status`, changed, and only the affected unit restarts. Everything is torn down at the
end; nothing on this machine is changed. `tests/integration/test_demo_flow.py` runs the same
steps with assertions.
"""

from __future__ import annotations

import asyncio
import base64
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from tests.conftest import api_client_from, cache_dir
from tests.testbed.agent_harness import NS, OSCAgent, inline_file, osc_document, service
from tests.testbed.controlplane import ControlPlane
from tests.testbed.systemd_ns import IsolatedSystemd
from tests.testbed.userdata import (
    AGENT_BIN,
    UNIT,
    Artifact,
    build_artifact,
    hide_python,
    install_credentials,
    play_user_data,
    serve_directory,
    sh,
    show,
)

REFS_SECRET = "demo-app-credentials"
TOKEN_SECRET = "demo-monitoring-token"
TOKEN_PATH = "/var/lib/demo/monitoring/token"
WATCHED_UNITS = ["demo-app.service", "demo-sidecar.service", "demo-report.timer", UNIT]

REPORT_SCRIPT = """#!/bin/sh
echo "report $(date -u +%FT%TZ)" >> /var/log/demo-report.log
"""


def demo_osc(greeting: str) -> dict[str, Any]:
    """An OSC shaped like the ones Gardener ships: config files, a script, a secretRef file,
    a unit with a drop-in and filePaths, a timer with its service, an unrelated sidecar."""
    files = [
        inline_file("/etc/demo-app/app.conf", f"greeting={greeting}\nport=8080\n"),
        inline_file("/etc/sysctl.d/99-demo.conf", "vm.max_map_count = 262144\n"),
        inline_file("/opt/demo/bin/report.sh", REPORT_SCRIPT, 0o755),
        {
            "path": "/etc/motd.d/demo",
            "permissions": 0o644,
            "content": {
                "inline": {
                    "encoding": "b64",
                    "data": base64.b64encode(b"Managed by node-agent.\n").decode(),
                }
            },
        },
        {
            "path": "/var/lib/demo/api-key",
            "permissions": 0o600,
            "content": {"secretRef": {"name": REFS_SECRET, "dataKey": "api-key"}},
        },
    ]
    units = [
        service(
            "demo-app.service",
            extra="EnvironmentFile=/etc/demo-app/app.conf\n",
            filePaths=["/etc/demo-app/app.conf"],
            dropIns=[{"name": "10-mode.conf", "content": "[Service]\nEnvironment=MODE=tour\n"}],
        ),
        service("demo-sidecar.service"),
        service(
            "demo-report.service",
            "/opt/demo/bin/report.sh",
            extra="Type=oneshot\n",
            install=False,
            filePaths=["/opt/demo/bin/report.sh"],
        ),
        {
            "name": "demo-report.timer",
            "command": "start",
            "enable": True,
            "content": "[Timer]\nOnActiveSec=1s\nOnUnitActiveSec=30s\n\n"
            "[Install]\nWantedBy=timers.target\n",
        },
    ]
    return osc_document(files, units)


class Demo:
    """The tour's steps; ``say`` narrates (the test passes a no-op)."""

    def __init__(self, workdir: Path, say: Callable[[str], None] = print) -> None:
        self.workdir = workdir
        self.say = say
        self.cp: ControlPlane | None = None
        self.node: IsolatedSystemd | None = None
        self.admin: ApiClient | None = None
        self.agent: OSCAgent | None = None
        self.artifact: Artifact | None = None
        self.checksum = ""

    # -- set-up ---------------------------------------------------------------------------
    async def start(self) -> None:
        self.say("1. Building what the tour needs (cached after the first run)")
        started = time.monotonic()
        self.artifact = build_artifact(self.workdir / "dist")
        size = self.artifact.path.stat().st_size / 1e6
        self.say(
            f"   artifact {self.artifact.path.name}: {size:.1f} MB, sha256 "
            f"{self.artifact.sha256[:16]}… ({time.monotonic() - started:.1f}s)"
        )
        self.cp = ControlPlane(self.workdir / "controlplane")
        self.cp.start()
        self.say(f"   kube-apiserver + etcd on {self.cp.server} (RBAC on)")
        self.node = IsolatedSystemd(self.workdir / "nodes", overlay=True)
        self.node.start()
        self.say(
            f"   throwaway node {self.node.name}: its own systemd as PID 1 on an overlay "
            "of this machine's root"
        )
        self.admin = await api_client_from(self.cp.admin_kubeconfig)

    async def stop(self) -> None:
        if self.agent is not None:
            await self.agent.stop()
        if self.admin is not None:
            await self.admin.close()
        if self.node is not None:
            self.node.stop()
        if self.cp is not None:
            self.cp.stop()

    # -- the cluster side -------------------------------------------------------------------
    async def cluster(self) -> None:
        assert self.admin
        assert self.cp
        assert self.node
        self.say("\n2. The cluster side: a Node, least-privilege credentials, the OSC Secret")
        self.agent = OSCAgent(
            self.admin,
            self.cp,
            self.node,
            self.workdir,
            node_name=f"worker-{uuid.uuid4().hex[:5]}",
            extra_secrets=[REFS_SECRET, TOKEN_SECRET],
        )
        await self.agent.setup()
        core = client.CoreV1Api(self.admin)
        for name, data in (
            (REFS_SECRET, {"api-key": b"s3cr3t-api-key\n"}),
            (TOKEN_SECRET, {"token": b"monitoring-token-v1"}),
        ):
            await core.create_namespaced_secret(
                NS,
                client.V1Secret(
                    metadata=client.V1ObjectMeta(name=name),
                    data={k: base64.b64encode(v).decode() for k, v in data.items()},
                ),
            )
        self.checksum = await self.agent.publish(demo_osc("hello"))
        self.say(
            f"   Node {self.agent.node_name}; Secret {NS}/{self.agent.secret_name} "
            f"(5 files, 4 units, checksum {self.checksum[:12]}…)"
        )
        self.say(
            f"   the agent may read only its Node, its Lease and Secrets {self.agent.secret_name}, "
            f"{REFS_SECRET}, {TOKEN_SECRET}"
        )

    # -- the node side ----------------------------------------------------------------------
    async def boot(self) -> float:
        assert self.agent
        assert self.cp
        assert self.node
        assert self.artifact
        node = self.node
        self.say("\n3. The VM boots: user-data runs the init script (no Python on this node)")
        node.run(["hostname", self.agent.node_name])
        hide_python(node)
        gone = sh(node, "command -v python3 || echo 'python3: not found'").stdout.strip()
        self.say(f"   {gone}")
        install_credentials(
            self.agent,
            self.cp,
            {"token": {"syncConfigs": [{"secretName": TOKEN_SECRET, "path": TOKEN_PATH}]}},
        )
        with serve_directory(self.artifact.path.parent) as base:
            run, seconds = play_user_data(node, f"{base}/{self.artifact.path.name}", self.artifact)
        for line in run.stdout.splitlines():
            if line.startswith(("bootstrap:", "node-agent-init:")):
                self.say(f"   {line}")
        state = show(node, UNIT)
        self.say(
            f"   {UNIT}: {state['ActiveState']}/{state['SubState']}, MainPID "
            f"{state['MainPID']} (user-data to running: {seconds:.1f}s)"
        )
        return seconds

    async def applied(self) -> None:
        assert self.agent
        assert self.node
        self.say("\n4. The agent applies the OSC and reports on the Node")
        started = time.monotonic()
        await self.agent.wait_applied(self.checksum, timeout=120)
        self.say(
            f"   Node annotation checksum/cloud-config-data = {self.checksum[:12]}… after "
            f"{time.monotonic() - started:.1f}s"
        )
        for unit in WATCHED_UNITS[:-1]:
            state = show(self.node, unit)
            self.say(f"   {unit:22} {state['ActiveState']}/{state['SubState']}")
        mode = oct(self.node.path("/var/lib/demo/api-key").stat().st_mode & 0o7777)
        self.say(f"   /var/lib/demo/api-key from Secret {REFS_SECRET}: mode {mode}")
        token = self.node.path(TOKEN_PATH)
        await _until(token.exists, 30)
        self.say(
            f"   {TOKEN_PATH} synced from Secret {TOKEN_SECRET}: mode "
            f"{oct(token.stat().st_mode & 0o7777)}"
        )

    def status(self, *flags: str) -> str:
        assert self.node
        result = sh(self.node, f"{AGENT_BIN} status {' '.join(flags)}")
        return result.stdout if result.returncode == 0 else result.stdout + result.stderr

    def invocations(self) -> dict[str, str]:
        assert self.node
        return {u: show(self.node, u)["InvocationID"] for u in WATCHED_UNITS}

    async def change_one_file(self) -> tuple[dict[str, str], dict[str, str]]:
        assert self.agent
        self.say(
            "\n6. One file changes in the OSC: /etc/demo-app/app.conf (in demo-app's filePaths)"
        )
        before = self.invocations()
        self.checksum = await self.agent.publish(demo_osc("hello again"))
        await self.agent.wait_applied(self.checksum, timeout=60)
        after = self.invocations()
        for unit in WATCHED_UNITS:
            verdict = "restarted" if after[unit] != before[unit] else "untouched"
            self.say(f"   {unit:28} {verdict}")
        return before, after


async def _until(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.2)


async def main() -> int:
    workdir = cache_dir() / "demo" / uuid.uuid4().hex[:8]
    workdir.mkdir(parents=True)
    demo = Demo(workdir)
    print(__doc__.split("\n\n")[1].replace("\n", " ") + "\n")
    try:
        await demo.start()
        await demo.cluster()
        await demo.boot()
        await demo.applied()
        print("\n5. On the node, an on-call engineer asks the agent: node-agent status")
        print("\n".join("   " + line for line in demo.status().splitlines()))
        await demo.change_one_file()
        print("\nDone: only the unit whose file changed was restarted. Cleaning up.")
        return 0
    finally:
        await demo.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
