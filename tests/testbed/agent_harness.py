"""The agent under test against the real test bed: one harness for every way a test runs it.

- ``OSCAgent`` runs only the OSC controller, in this process, so a test can look at the
  controller's own counters and state; ``AgentProcess`` runs ``node-agent run`` as a process
  for that node (crash and signal tests).
- ``prepare_agent`` lays out what a whole agent needs under its ``--root`` the way a real node
  has them (config file, a kubeconfig whose ``tokenFile`` is the file the token controller keeps
  in sync, and that token; paths from ``node_agent.config``), with the token file's absolute host
  path in the kubeconfig so the agent works from the test process; ``running_agent`` runs the
  whole agent (``run_agent``) in-process, ``spawn_agent`` as a subprocess, as systemd would.

The agent acts on an isolated systemd (its files under ``/proc/<pid>/root``, its units over the
namespace's D-Bus) and talks to the test kube-apiserver with least-privilege credentials. The
API, waiting and systemd helpers below are shared by all of them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from node_agent.agent import build_agent
from node_agent.base.errors import KubeUnauthorized
from node_agent.commands import status
from node_agent.config import (
    CONFIG_FILE,
    KUBECONFIG_FILE,
    TOKEN_FILE,
    AgentSettings,
    NodeAgentConfiguration,
    parse_config,
)
from node_agent.containerd.expand import ContainerdExpander
from node_agent.containerd.images import ImageStore
from node_agent.context import AgentContext
from node_agent.controllers.healthcheck import HealthCheckController, KubeletProbe
from node_agent.controllers.osc.controller import OSCController
from node_agent.host.fs import HostFS
from node_agent.host.state import StateStore
from node_agent.kube.client import ClientStats, KubeClient
from node_agent.systemd import Systemd, UnitState
from tests.testbed.controlplane import ControlPlane, free_port, write_kubeconfig
from tests.testbed.credentials import NAMESPACE, NodeAgentCredentials, node_agent_credentials
from tests.testbed.systemd_ns import IsolatedSystemd

NS = NAMESPACE
AGENT_UNIT = "node-agent-under-test.service"
REPO = Path(__file__).resolve().parents[2]
KUBERNETES_VERSION = "1.33.4"


#: The ``nodeAgent`` config section of test agents: the health gate is off, so that an update
#: that restarts a running unit is reported at once rather than after the settle window; the
#: tests of the gate turn it on.
TEST_NODE_AGENT: dict[str, Any] = {"healthGate": {"enabled": False}}


def unique(prefix: str) -> str:
    """A name no other test of the session uses: they all share one API server."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# --- OSC documents ----------------------------------------------------------------------------


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


# --- API helpers ------------------------------------------------------------------------------


async def create_node(admin: ApiClient, name: str) -> str:
    """Register a Node the way the kubelet labels it; returns its uid."""
    node = await client.CoreV1Api(admin).create_node(
        client.V1Node(
            metadata=client.V1ObjectMeta(name=name, labels={"kubernetes.io/hostname": name})
        )
    )
    return str(node.metadata.uid)


async def _create_or_replace_secret(admin: ApiClient, body: client.V1Secret) -> None:
    core = client.CoreV1Api(admin)
    try:
        await core.create_namespaced_secret(NS, body)
    except client.ApiException as exc:
        if exc.status != 409:
            raise
        await core.replace_namespaced_secret(body.metadata.name, NS, body)


async def put_secret(admin: ApiClient, name: str, data: dict[str, bytes]) -> None:
    """Create or replace a Secret in kube-system."""
    await _create_or_replace_secret(
        admin,
        client.V1Secret(
            metadata=client.V1ObjectMeta(name=name),
            data={k: base64.b64encode(v).decode() for k, v in data.items()},
        ),
    )


def dump_osc(osc: dict[str, Any]) -> bytes:
    """The OSC document as the bytes of ``osc.yaml`` (libyaml's dumper when PyYAML has it)."""
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    return yaml.dump(osc, Dumper=dumper).encode()


async def publish_osc(
    admin: ApiClient,
    secret_name: str,
    osc: dict[str, Any] | bytes,
    *,
    checksum: str | None = None,
    annotations: Mapping[str, str] | None = None,
) -> str:
    """Create or replace the OSC Secret the way Gardener does; return the checksum.

    ``checksum`` overrides the annotation (a mismatch the agent must refuse); ``annotations``
    are added to the Secret's (e.g. serial mode, the paced rollout)."""
    raw = osc if isinstance(osc, bytes) else dump_osc(osc)
    digest = hashlib.sha256(raw).hexdigest() if checksum is None else checksum
    await _create_or_replace_secret(
        admin,
        client.V1Secret(
            metadata=client.V1ObjectMeta(
                name=secret_name,
                namespace=NS,
                labels={
                    "gardener.cloud/role": "operating-system-config",
                    "worker.gardener.cloud/pool": "pool-a",
                },
                annotations={"checksum/data-script": digest, **(annotations or {})},
            ),
            data={"osc.yaml": base64.b64encode(raw).decode()},
        ),
    )
    return digest


async def node_annotations(admin: ApiClient, node: str) -> dict[str, str]:
    obj = await client.CoreV1Api(admin).read_node(node)
    return dict(obj.metadata.annotations or {})


async def node_labels(admin: ApiClient, node: str) -> dict[str, str]:
    obj = await client.CoreV1Api(admin).read_node(node)
    return dict(obj.metadata.labels or {})


async def node_events(admin: ApiClient, node: str) -> list[client.CoreV1Event]:
    """The Events about a Node (they live in "default")."""
    listed = await client.CoreV1Api(admin).list_namespaced_event(
        "default", field_selector=f"involvedObject.name={node}"
    )
    return list(listed.items)


async def read_lease(admin: ApiClient, node: str) -> client.V1Lease | None:
    try:
        return await client.CoordinationV1Api(admin).read_namespaced_lease(
            f"gardener-node-agent-{node}", NS
        )
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def now() -> datetime:
    return datetime.now(UTC)


# --- waiting ----------------------------------------------------------------------------------


async def wait_for(predicate: object, timeout: float, what: str, poll: float = 0.2) -> None:
    """Poll an (async or plain) predicate until it is truthy."""
    assert callable(predicate)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(poll)


async def wait_applied(admin: ApiClient, node: str, checksum: str, timeout: float = 60.0) -> None:
    """Until the agent reports on its Node that it applied the OSC with this checksum."""

    async def applied() -> bool:
        annotations = await node_annotations(admin, node)
        return annotations.get("checksum/cloud-config-data") == checksum

    await wait_for(applied, timeout, f"node annotation checksum {checksum[:12]}", poll=0.1)


async def wait_lease_renewed_after(
    admin: ApiClient, node: str, after: datetime, timeout: float
) -> datetime:
    """Until the Lease's renewTime is later than ``after``; returns that renewTime."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        lease = await read_lease(admin, node)
        renew = lease.spec.renew_time if lease is not None else None
        if renew is not None and renew > after:
            return renew
        if loop.time() > deadline:
            raise AssertionError(f"lease of {node} not renewed after {after} within {timeout}s")
        await asyncio.sleep(0.25)


async def wait_token_rejected(
    control_plane: ControlPlane, token: str, directory: Path, timeout: float
) -> tuple[float, ClientStats]:
    """Until the server rejects ``token`` alone (401) — proves a rotation is real, not cosmetic.

    Returns how long that took and the stats of the client that tried it."""
    token_file = directory / unique("old-token")
    token_file.write_text(token)
    started = time.monotonic()
    async with KubeClient.from_token_file(
        control_plane.server, control_plane.ca_file, token_file
    ) as old:
        while True:
            try:
                await old.request("GET", "/api", old.nodes().ref("discover"))
            except KubeUnauthorized:
                return time.monotonic() - started, old.stats
            elapsed = time.monotonic() - started
            assert elapsed < timeout, f"old token still accepted after {timeout:.0f} s"
            await asyncio.sleep(0.5)


# --- systemd of a node, seen from the host ----------------------------------------------------


def unit_props(systemd: IsolatedSystemd, unit: str) -> dict[str, str]:
    out = systemd.run(
        ["systemctl", "show", "-p", "InvocationID,MainPID,ActiveState,SubState", unit]
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def start_unit(systemd: IsolatedSystemd, name: str, text: str) -> None:
    systemd.path(f"/etc/systemd/system/{name}").write_text(text)
    systemd.run(["systemctl", "daemon-reload"])
    systemd.run(["systemctl", "start", name])


# --- the whole agent: on-disk layout, in-process and as a process -----------------------------


@dataclass(frozen=True)
class AgentSetup:
    root: Path
    config_file: Path  # host path of the config (under root)
    token_file: Path  # host path of the agent's token file (under root)
    settings: AgentSettings
    config: NodeAgentConfiguration

    def with_config(self, doc: dict[str, Any]) -> AgentSetup:
        """The same layout run with another configuration (the file on disk is left alone)."""
        return dataclasses.replace(self, config=NodeAgentConfiguration.model_validate(doc))


def host(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def prepare_agent(
    root: Path,
    control_plane: ControlPlane,
    creds: NodeAgentCredentials,
    *,
    osc_secret: str,
    token_secret: str | None = None,
    agent_unit: str = "gardener-node-agent.service",
    job_timeout: float = 60.0,
    node_agent: dict[str, Any] | None = None,
) -> AgentSetup:
    """Write config, kubeconfig and token below ``root`` (a node's root, seen from the host).
    ``node_agent``: the config's ``nodeAgent`` section (default: ``TEST_NODE_AGENT``)."""
    token_file = host(root, TOKEN_FILE)
    token_file.parent.mkdir(parents=True, exist_ok=True)
    token_file.write_text(creds.token)
    token_file.chmod(0o640)
    write_kubeconfig(
        host(root, KUBECONFIG_FILE),
        server=control_plane.server,
        ca_file=control_plane.ca_file,
        user={"tokenFile": str(token_file)},
        name=creds.service_account,
    )
    doc: dict[str, object] = {
        "apiVersion": "nodeagent.config.gardener.cloud/v1alpha1",
        "kind": "NodeAgentConfiguration",
        "logFormat": "text",
        "controllers": {
            "operatingSystemConfig": {
                "secretName": osc_secret,
                "kubernetesVersion": KUBERNETES_VERSION,
            },
            "token": {
                "syncConfigs": (
                    [{"secretName": token_secret, "path": TOKEN_FILE}] if token_secret else []
                ),
            },
        },
        "nodeAgent": TEST_NODE_AGENT if node_agent is None else node_agent,
    }
    config_file = host(root, CONFIG_FILE)
    config_file.write_text(yaml.safe_dump(doc))
    config_file.chmod(0o600)
    config = parse_config(config_file.read_bytes())
    settings = AgentSettings(root=root, agent_unit=agent_unit, systemd_job_timeout=job_timeout)
    return AgentSetup(root, config_file, token_file, settings, config)


@dataclass(frozen=True)
class PreparedAgent:
    """A registered Node, its agent's least-privilege credentials and the agent's layout."""

    name: str
    uid: str
    osc_secret: str
    creds: NodeAgentCredentials
    setup: AgentSetup


@contextlib.asynccontextmanager
async def running_agent(
    setup: AgentSetup, *, host_name: str, systemd: IsolatedSystemd
) -> AsyncIterator[asyncio.Task[int]]:
    """The agent (``run_agent``) as a task of the test's loop; cancelled at the end."""
    from node_agent.agent import run_agent

    task = asyncio.create_task(
        run_agent(
            setup.settings,
            setup.config,
            host_name=host_name,
            systemd_address=systemd.bus_address.decode(),
        ),
        name=f"agent-{host_name}",
    )
    try:
        yield task
        assert not task.done() or task.cancelled() or task.exception() is None, task.exception()
    finally:
        task.cancel()
        # asyncio.wait, not wait_for: a task that does not end on cancel must fail the test
        # here, naming where every task waits, not hang it until pytest-timeout.
        done, _ = await asyncio.wait({task}, timeout=15)
        if not done:
            raise AssertionError(f"the agent did not stop within 15s of cancel:\n{task_stacks()}")
        if not task.cancelled() and task.exception() is not None:
            with contextlib.suppress(asyncio.CancelledError):
                task.result()


def task_stacks() -> str:
    """Where each task of the running loop waits (for a failure message)."""
    out = io.StringIO()
    for each in asyncio.all_tasks():
        each.print_stack(limit=8, file=out)
    return out.getvalue()


async def spawn_agent(
    setup: AgentSetup,
    systemd: IsolatedSystemd,
    host_name: str,
    log: Path,
    *,
    env: Mapping[str, str],
    args: Sequence[str] = (),
) -> asyncio.subprocess.Process:
    """``node-agent run`` as its systemd service runs it, output appended to ``log``."""
    with log.open("ab") as out:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "node_agent",
            "run",
            "--root",
            str(setup.root),
            "--config",
            str(setup.config_file),
            "--hostname",
            host_name,
            "--systemd-bus",
            systemd.bus_address.decode(),
            *args,
            cwd=REPO,
            env=dict(env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
        )


# --- the OSC controller alone, in-process -----------------------------------------------------


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
    #: where imageRef files come from (e.g. ``CtrImages`` running ctr inside the node)
    images: ImageStore | None = None
    #: builds the applier's ``expand`` (with its ``prepare``) on the agent's HostFS, e.g.
    #: ``ContainerdExpander``; None: the OSC as published
    expander: Callable[[HostFS], ContainerdExpander] | None = None
    #: the config's ``nodeAgent`` section (our own settings)
    node_agent: dict[str, Any] = dataclasses.field(default_factory=lambda: TEST_NODE_AGENT)
    #: the config's ``controllers.operatingSystemConfig.kubernetesVersion``
    kubernetes_version: str = KUBERNETES_VERSION
    _task: asyncio.Task[None] | None = None
    _kubelet_probe: KubeletProbe | None = None

    def __post_init__(self) -> None:
        # The agent writes anywhere (/etc, /var/lib): only a throwaway node keeps the host clean.
        if not self.node.overlay:
            raise ValueError("the agent under test needs a throwaway node (overlay=True)")
        self.secret_name = self.secret_name or f"gardener-node-agent-{self.node_name}-osc"

    async def setup(self) -> None:
        await create_node(self.admin, self.node_name)
        self.creds = await node_agent_credentials(
            self.admin,
            self.workdir / f"creds-{self.node_name}",
            server=self.control_plane.server,
            ca_file=self.control_plane.ca_file,
            node_name=self.node_name,
            secret_names=[self.secret_name, *self.extra_secrets],
        )

    def prepare(self) -> AgentSetup:
        """The whole agent's layout for this node, under its root (for ``node-agent`` runs)."""
        assert self.creds is not None
        return prepare_agent(
            self.node.root, self.control_plane, self.creds, osc_secret=self.secret_name
        )

    async def start(self) -> None:
        assert self.creds is not None
        settings = AgentSettings(root=self.node.root, agent_unit=AGENT_UNIT)
        config = NodeAgentConfiguration.model_validate(
            {
                "controllers": {
                    "operatingSystemConfig": {
                        "secretName": self.secret_name,
                        "kubernetesVersion": self.kubernetes_version,
                    }
                },
                "nodeAgent": self.node_agent,
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
        agent = build_agent(self.ctx, images=self.images, expander=self.expander)
        self.controller = agent.osc
        self._kubelet_probe = agent.need(
            HealthCheckController
        ).kubelet_probe  # an in-place update may ask it
        self._task = asyncio.create_task(self.controller.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._kubelet_probe is not None:
            await self._kubelet_probe.close()
        if self.ctx is not None:
            await self.ctx.kube.close()
            await self.ctx.systemd.close()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[OSCAgent]:
        """Set up and started for the ``with`` block, stopped after it."""
        await self.setup()
        await self.start()
        try:
            yield self
        finally:
            await self.stop()

    async def publish(self, osc: dict[str, Any] | bytes, **kw: Any) -> str:
        return await publish_osc(self.admin, self.secret_name, osc, **kw)

    async def node_annotations(self) -> dict[str, str]:
        return await node_annotations(self.admin, self.node_name)

    async def node_labels(self) -> dict[str, str]:
        return await node_labels(self.admin, self.node_name)

    async def wait_applied(self, checksum: str, timeout: float = 60.0) -> None:
        await wait_applied(self.admin, self.node_name, checksum, timeout)

    async def events(self) -> list[client.CoreV1Event]:
        return await node_events(self.admin, self.node_name)

    async def wait_event(self, reason: str, contains: str = "", timeout: float = 30.0) -> str:
        found: list[str] = []

        async def seen() -> bool:
            for event in await self.events():
                if event.reason == reason and contains in (event.message or ""):
                    found.append(event.message)
                    return True
            return False

        await wait_for(seen, timeout, f"event {reason} containing {contains!r}", poll=0.1)
        return found[0]

    async def unit_states(self, names: list[str]) -> dict[str, UnitState]:
        assert self.ctx is not None
        return await self.ctx.systemd.unit_states(names)

    async def warnings(self, *needles: str) -> list[str]:
        """Messages of the Warning Events on the Node that contain every one of ``needles``."""
        return await warning_messages(self.admin, self.node_name, *needles)

    async def wait_warning(self, *needles: str, timeout: float = 30.0) -> str:
        """Until a Warning Event on the Node names all of ``needles``; returns its message."""
        found: list[str] = []

        async def seen() -> bool:
            found[:] = await self.warnings(*needles)
            return bool(found)

        await wait_for(seen, timeout, f"a Warning Event naming {needles!r}", poll=0.2)
        return found[0]


@dataclass
class AgentProcess:
    """``node-agent run`` as a real process acting on a throwaway node (crash and signal tests)."""

    harness: OSCAgent
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: asyncio.subprocess.Process | None = None

    async def start(self, **env: str) -> None:
        self.proc = await spawn_agent(
            self.harness.prepare(),
            self.harness.node,
            self.harness.node_name,
            self.log_path,
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


# --- partial failures: exact start counts, status, warnings ------------------------------------

STARTS_DIR = "/var/log/node-agent-test/starts"


def counted_service(
    name: str,
    tag: str,
    exec_start: str = "/bin/sleep infinity",
    *,
    extra: str = "",
    install: bool = True,
    **fields: Any,
) -> dict[str, Any]:
    """A service that appends ``tag`` to its own starts log each time systemd starts it.

    InvocationID only says that a unit restarted; the log says how often, and with which
    version of the unit (give each version its own tag). A failing unit logs its attempts."""
    log = f"{STARTS_DIR}/{name}"
    pre = f"ExecStartPre=/bin/sh -c 'mkdir -p {STARTS_DIR} && echo {tag} >> {log}'\n"
    return service(name, exec_start, extra=pre + extra, install=install, **fields)


def starts(node: IsolatedSystemd, name: str) -> list[str]:
    """The tags logged by every start of ``name`` (a ``counted_service``), oldest first."""
    try:
        return node.path(f"{STARTS_DIR}/{name}").read_text().split()
    except FileNotFoundError:
        return []


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``node-agent <args>`` as a process of this checkout, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "node_agent", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def run_status(root: Path, *extra: str) -> tuple[int | None, bytes, bytes]:
    """``node-agent status [extra]`` for the node under ``root``, run as an operator would
    (the agent's socket if it runs, else what is on disk): exit code, stdout, stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "node_agent",
        "status",
        *extra,
        "--root",
        str(root),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode, out, err


async def status_json(root: Path) -> dict[str, Any]:
    """``node-agent status --json`` for the node under ``root`` (see ``run_status``)."""
    returncode, out, err = await run_status(root, "--json")
    assert returncode in (0, 3), f"status exited {returncode}: {err.decode()}"
    doc: dict[str, Any] = json.loads(out)
    return doc


def loopback_servers() -> dict[str, Any]:
    """The config's ``server`` section binding both HTTP servers on loopback, each on a free
    port (port 0 is Gardener's zero value: the default port, which every agent on the bed's
    shared host network would want)."""
    return {
        "healthProbes": {"bindAddress": "127.0.0.1", "port": free_port()},
        "metrics": {"bindAddress": "127.0.0.1", "port": free_port()},
    }


async def wait_ready_endpoints(sock: Path, what: str) -> dict[str, str]:
    """Ask the agent's status socket until the agent says it is ready and its HTTP endpoints
    listen (they start after its first reconcile); those endpoints."""
    endpoints: dict[str, str] = {}

    async def ready() -> bool:
        if not sock.exists():
            return False
        answer = await asyncio.to_thread(status.query, sock)
        endpoints.update(answer["endpoints"])
        return bool(answer["health"]["ready"] and endpoints["health"] and endpoints["metrics"])

    await wait_for(ready, 60, what, poll=0.2)
    return endpoints


def http_get(address: str, path: str) -> tuple[int, str]:
    """Status and body of ``GET http://<address><path>``, an HTTP error's as well."""
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def apply_failures(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The per-item failures of the last apply in a status document ([] if none)."""
    last = doc.get("last_apply") or {}
    return list(last.get("failures") or [])


def failed_items(doc: Mapping[str, Any]) -> list[str]:
    """``item`` and ``error`` of each failure of the last apply, one string each."""
    return [f"{f.get('item', '')}: {f.get('error', '')}" for f in apply_failures(doc)]


async def warning_messages(admin: ApiClient, node: str, *needles: str) -> list[str]:
    """Messages of the Warning Events about ``node`` that contain every one of ``needles``."""
    return [
        event.message or ""
        for event in await node_events(admin, node)
        if event.type == "Warning" and all(n in (event.message or "") for n in needles)
    ]


async def eventually(predicate: object, timeout: float, poll: float = 0.2) -> bool:
    """Like ``wait_for``, but says whether the predicate came true instead of failing."""
    try:
        await wait_for(predicate, timeout, "a condition", poll=poll)
    except AssertionError:
        return False
    return True
