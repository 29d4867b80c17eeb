"""Run the real OSC controller against the real test bed, in-process, and publish OSC Secrets.

The agent acts on an isolated systemd (its files under ``/proc/<pid>/root``, its units over
the namespace's D-Bus) and talks to the test kube-apiserver with least-privilege credentials.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from node_agent.applier import Applier
from node_agent.config import AgentSettings, NodeAgentConfiguration
from node_agent.context import AgentContext
from node_agent.controllers.osc import OSCController
from node_agent.host.fs import HostFS
from node_agent.host.state import StateStore
from node_agent.kube.client import KubeClient
from node_agent.systemd import Systemd, UnitState
from tests.testbed.controlplane import ControlPlane
from tests.testbed.credentials import NodeAgentCredentials, node_agent_credentials
from tests.testbed.systemd_ns import IsolatedSystemd

NS = "kube-system"
AGENT_UNIT = "node-agent-under-test.service"


def osc_document(files: list[dict[str, Any]], units: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "extensions.gardener.cloud/v1alpha1",
        "kind": "OperatingSystemConfig",
        "metadata": {"name": "pool-a", "namespace": NS},
        "spec": {"type": "debian", "purpose": "reconcile", "files": files, "units": units},
    }


def inline_file(path: str, text: str, mode: int | None = 0o644) -> dict[str, Any]:
    entry: dict[str, Any] = {"path": path, "content": {"inline": {"data": text}}}
    if mode is not None:
        entry["permissions"] = mode
    return entry


def service(
    name: str,
    exec_start: str = "/bin/sleep infinity",
    *,
    extra: str = "",
    install: bool = True,
    **fields: Any,
) -> dict[str, Any]:
    text = f"[Unit]\nStartLimitIntervalSec=0\n\n[Service]\nExecStart={exec_start}\n{extra}"
    if install:
        text += "\n[Install]\nWantedBy=multi-user.target\n"
    return {"name": name, "content": text, **fields}


async def publish_osc(
    admin: ApiClient, secret_name: str, osc: dict[str, Any] | bytes, *, checksum: str | None = None
) -> str:
    """Create or replace the OSC Secret the way Gardener does; return the checksum."""
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    raw = osc if isinstance(osc, bytes) else yaml.dump(osc, Dumper=dumper).encode()
    digest = hashlib.sha256(raw).hexdigest() if checksum is None else checksum
    body = client.V1Secret(
        metadata=client.V1ObjectMeta(
            name=secret_name,
            namespace=NS,
            labels={
                "gardener.cloud/role": "operating-system-config",
                "worker.gardener.cloud/pool": "pool-a",
            },
            annotations={"checksum/data-script": digest},
        ),
        data={"osc.yaml": base64.b64encode(raw).decode()},
    )
    core = client.CoreV1Api(admin)
    try:
        await core.replace_namespaced_secret(secret_name, NS, body)
    except client.ApiException as exc:
        if exc.status != 404:
            raise
        await core.create_namespaced_secret(NS, body)
    return digest


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], what: str, timeout: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.1)


@dataclass
class OSCAgent:
    """The OSC controller of one node, running in this process."""

    admin: ApiClient
    control_plane: ControlPlane
    node: IsolatedSystemd
    workdir: Path
    node_name: str = field(default_factory=lambda: f"node-{uuid.uuid4().hex[:6]}")
    extra_secrets: list[str] = field(default_factory=list)
    secret_name: str = ""
    creds: NodeAgentCredentials | None = None
    ctx: AgentContext | None = None
    controller: OSCController | None = None
    _task: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        # The agent writes anywhere (/etc, /var/lib): only a throwaway node keeps the host clean.
        if not self.node.overlay:
            raise ValueError("the agent under test needs a throwaway node (overlay=True)")
        self.secret_name = self.secret_name or f"gardener-node-agent-{self.node_name}-osc"

    async def setup(self) -> None:
        await client.CoreV1Api(self.admin).create_node(
            client.V1Node(
                metadata=client.V1ObjectMeta(
                    name=self.node_name, labels={"kubernetes.io/hostname": self.node_name}
                )
            )
        )
        self.creds = await node_agent_credentials(
            self.admin,
            self.workdir / f"creds-{self.node_name}",
            server=self.control_plane.server,
            ca_file=self.control_plane.ca_file,
            node_name=self.node_name,
            secret_names=[self.secret_name, *self.extra_secrets],
        )

    async def start(self) -> None:
        assert self.creds is not None
        settings = AgentSettings(root=self.node.root, agent_unit=AGENT_UNIT)
        config = NodeAgentConfiguration.model_validate(
            {
                "controllers": {
                    "operatingSystemConfig": {
                        "secretName": self.secret_name,
                        "kubernetesVersion": "1.31.4",
                    }
                }
            }
        )
        fs = HostFS(self.node.root, follow_system_symlinks=True)
        state = StateStore(fs)
        systemd = Systemd(self.node.bus_address)
        await systemd.start()
        kube = KubeClient.from_kubeconfig(self.creds.kubeconfig)
        self.ctx = AgentContext(
            settings=settings,
            config=config,
            fs=fs,
            state=state,
            systemd=systemd,
            kube=kube,
            host_name=self.node_name,
            node_name=self.node_name,
        )
        node = await kube.get_node(self.node_name)
        self.ctx.node_uid = node["metadata"]["uid"]
        applier = Applier(fs, state, systemd, host_name=self.node_name, agent_unit=AGENT_UNIT)
        self.controller = OSCController(self.ctx, applier)
        self._task = asyncio.create_task(self.controller.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.ctx is not None:
            await self.ctx.kube.close()
            await self.ctx.systemd.close()

    async def publish(self, osc: dict[str, Any] | bytes, **kw: Any) -> str:
        return await publish_osc(self.admin, self.secret_name, osc, **kw)

    async def node_annotations(self) -> dict[str, str]:
        node = await client.CoreV1Api(self.admin).read_node(self.node_name)
        return dict(node.metadata.annotations or {})

    async def node_labels(self) -> dict[str, str]:
        node = await client.CoreV1Api(self.admin).read_node(self.node_name)
        return dict(node.metadata.labels or {})

    async def wait_applied(self, checksum: str, timeout: float = 60.0) -> None:
        async def applied() -> bool:
            annotations = await self.node_annotations()
            return annotations.get("checksum/cloud-config-data") == checksum

        await wait_until(applied, f"node annotation checksum {checksum[:12]}", timeout)

    async def events(self) -> list[client.CoreV1Event]:
        listed = await client.CoreV1Api(self.admin).list_namespaced_event(
            "default", field_selector=f"involvedObject.name={self.node_name}"
        )
        return list(listed.items)

    async def wait_event(self, reason: str, contains: str = "", timeout: float = 30.0) -> str:
        found: list[str] = []

        async def seen() -> bool:
            for event in await self.events():
                if event.reason == reason and contains in (event.message or ""):
                    found.append(event.message)
                    return True
            return False

        await wait_until(seen, f"event {reason} containing {contains!r}", timeout)
        return found[0]

    async def unit_states(self, names: list[str]) -> dict[str, UnitState]:
        assert self.ctx is not None
        return await self.ctx.systemd.unit_states(names)


@dataclass
class AgentProcess:
    """``node-agent run`` as a real process acting on a throwaway node (crash and signal tests)."""

    harness: OSCAgent
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: asyncio.subprocess.Process | None = None

    def install_config(self) -> Path:
        """Write the agent's config and kubeconfig where a real node has them (under its root)."""
        assert self.harness.creds is not None
        node = self.harness.node
        base = "/var/lib/gardener-node-agent"
        kubeconfig = node.path(f"{base}/credentials/kubeconfig")
        kubeconfig.parent.mkdir(parents=True, exist_ok=True)
        kubeconfig.write_bytes(self.harness.creds.kubeconfig.read_bytes())
        config = node.path(f"{base}/config.yaml")
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "nodeagent.config.gardener.cloud/v1alpha1",
                    "kind": "NodeAgentConfiguration",
                    "clientConnection": {"kubeconfig": f"{base}/credentials/kubeconfig"},
                    "controllers": {
                        "operatingSystemConfig": {
                            "secretName": self.harness.secret_name,
                            "kubernetesVersion": "1.31.4",
                        }
                    },
                }
            )
        )
        return config

    async def start(self, **env: str) -> None:
        import os
        import sys

        config = self.install_config()
        node = self.harness.node
        with self.log_path.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "node_agent",
                "run",
                "--root",
                str(node.root),
                "--config",
                str(config),
                "--hostname",
                self.harness.node_name,
                "--systemd-bus",
                node.bus_address.decode(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **self.env, **env},
            )

    async def wait(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        try:
            return await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            raise AssertionError(
                f"agent did not exit within {timeout:.0f}s; log tail:\n{self.log_tail()}"
            ) from None

    async def terminate(self, timeout: float = 10.0) -> int:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.terminate()
        return await self.wait(timeout)

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
