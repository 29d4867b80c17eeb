"""The whole agent (``run_agent``) against the test bed: on-disk layout, in-process runs.

An agent needs, under its ``--root``: a config file, a kubeconfig whose ``tokenFile`` is the file
the token controller keeps in sync, and that token. ``prepare_agent`` lays these out the way a
real node has them (paths from ``node_agent.config``), with the token file's absolute host path
in the kubeconfig so the agent works from the test process, in-process or as a subprocess.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from node_agent.config import (
    CONFIG_FILE,
    KUBECONFIG_FILE,
    TOKEN_FILE,
    AgentSettings,
    NodeAgentConfiguration,
    parse_config,
)
from tests.testbed.controlplane import ControlPlane, write_kubeconfig
from tests.testbed.credentials import NAMESPACE, NodeAgentCredentials
from tests.testbed.systemd_ns import IsolatedSystemd


@dataclass(frozen=True)
class AgentSetup:
    root: Path
    config_file: Path  # host path of the config (under root)
    token_file: Path  # host path of the agent's token file (under root)
    settings: AgentSettings
    config: NodeAgentConfiguration


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
) -> AgentSetup:
    """Write config, kubeconfig and token below ``root`` (a node's root, seen from the host)."""
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
            "operatingSystemConfig": {"secretName": osc_secret, "kubernetesVersion": "1.31.4"},
            "token": {
                "syncConfigs": (
                    [{"secretName": token_secret, "path": TOKEN_FILE}] if token_secret else []
                ),
            },
        },
    }
    config_file = host(root, CONFIG_FILE)
    config_file.write_text(yaml.safe_dump(doc))
    config_file.chmod(0o600)
    config = parse_config(config_file.read_bytes())
    settings = AgentSettings(root=root, agent_unit=agent_unit, systemd_job_timeout=job_timeout)
    return AgentSetup(root, config_file, token_file, settings, config)


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
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 15)


# --- API helpers ------------------------------------------------------------------------------


async def create_node(admin: ApiClient, name: str) -> str:
    node = await client.CoreV1Api(admin).create_node(
        client.V1Node(
            metadata=client.V1ObjectMeta(name=name, labels={"kubernetes.io/hostname": name})
        )
    )
    return str(node.metadata.uid)


async def put_secret(admin: ApiClient, name: str, data: dict[str, bytes]) -> None:
    """Create or replace a Secret in kube-system."""
    core = client.CoreV1Api(admin)
    body = client.V1Secret(
        metadata=client.V1ObjectMeta(name=name),
        data={k: base64.b64encode(v).decode() for k, v in data.items()},
    )
    try:
        await core.create_namespaced_secret(NAMESPACE, body)
    except client.ApiException as exc:
        if exc.status != 409:
            raise
        await core.replace_namespaced_secret(name, NAMESPACE, body)


async def put_osc_secret(admin: ApiClient, name: str, osc_yaml: bytes) -> str:
    """The OSC Secret as Gardener writes it; returns the checksum."""
    checksum = hashlib.sha256(osc_yaml).hexdigest()
    core = client.CoreV1Api(admin)
    body = client.V1Secret(
        metadata=client.V1ObjectMeta(
            name=name,
            annotations={"checksum/data-script": checksum},
            labels={"gardener.cloud/role": "operating-system-config"},
        ),
        data={"osc.yaml": base64.b64encode(osc_yaml).decode()},
    )
    try:
        await core.create_namespaced_secret(NAMESPACE, body)
    except client.ApiException as exc:
        if exc.status != 409:
            raise
        await core.replace_namespaced_secret(name, NAMESPACE, body)
    return checksum


async def read_lease(admin: ApiClient, node: str) -> client.V1Lease | None:
    try:
        return await client.CoordinationV1Api(admin).read_namespaced_lease(
            f"gardener-node-agent-{node}", NAMESPACE
        )
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


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
            return renew  # type: ignore[no-any-return]
        if loop.time() > deadline:
            raise AssertionError(f"lease of {node} not renewed after {after} within {timeout}s")
        await asyncio.sleep(0.25)


async def node_annotations(admin: ApiClient, node: str) -> dict[str, str]:
    obj = await client.CoreV1Api(admin).read_node(node)
    return dict(obj.metadata.annotations or {})


def now() -> datetime:
    return datetime.now(UTC)


def unit_props(systemd: IsolatedSystemd, unit: str) -> dict[str, str]:
    out = systemd.run(
        ["systemctl", "show", "-p", "InvocationID,MainPID,ActiveState,SubState", unit]
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def start_unit(systemd: IsolatedSystemd, name: str, text: str) -> None:
    systemd.path(f"/etc/systemd/system/{name}").write_text(text)
    systemd.run(["systemctl", "daemon-reload"])
    systemd.run(["systemctl", "start", name])


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
