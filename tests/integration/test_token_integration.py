"""Token sync against the real kube-apiserver: file contents and modes, deletion, rotation.

The rotation test is the end-to-end proof: the agent's own token is rotated through the Secret
the token controller syncs into the file its kubeconfig names; the old token is invalidated on
the server (its binding Secret deleted), and the agent keeps renewing its Lease — which now can
only succeed with the new token — without a restart.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from node_agent.errors import KubeUnauthorized
from node_agent.kube.client import KubeClient
from tests.conftest import CredentialsFactory
from tests.testbed.controlplane import ControlPlane
from tests.testbed.credentials import NAMESPACE, issue_token
from tests.testbed.full_agent import (
    create_node,
    now,
    prepare_agent,
    put_secret,
    running_agent,
    wait_for,
    wait_lease_renewed_after,
)
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration


def _uid() -> str:
    return uuid.uuid4().hex[:8]


async def test_token_file_written_exactly_and_rewritten_after_deletion(
    admin_api: ApiClient,
    control_plane: ControlPlane,
    make_node_agent_credentials: CredentialsFactory,
    systemd: IsolatedSystemd,
    tmp_path: Path,
) -> None:
    node = f"node-{_uid()}"
    osc, tok = f"osc-{node}", f"kubelet-token-{node}"
    await create_node(admin_api, node)
    await put_secret(admin_api, tok, {"token": b"first-token\n"})
    creds = await make_node_agent_credentials(node, [osc, tok])
    root = tmp_path / "root"
    setup = prepare_agent(root, control_plane, creds, osc_secret=osc)
    target = "/opt/node/a/b/token"
    doc = setup.config.model_dump(by_alias=True)
    doc["controllers"]["token"]["syncConfigs"] = [{"secretName": tok, "path": target}]
    from node_agent.config import NodeAgentConfiguration

    setup = setup.__class__(
        setup.root,
        setup.config_file,
        setup.token_file,
        setup.settings,
        NodeAgentConfiguration.model_validate(doc),
    )
    path = root / target.lstrip("/")

    async with running_agent(setup, host_name=node, systemd=systemd):
        await wait_for(path.exists, 20, "the token file")
        assert path.read_bytes() == b"first-token\n"
        assert path.stat().st_mode & 0o7777 == 0o640
        for parent in ("opt/node", "opt/node/a", "opt/node/a/b"):
            assert (root / parent).stat().st_mode & 0o7777 == 0o755, parent

        # Deleted (e.g. by an OSC apply that removed it): written again at once.
        path.unlink()
        started = time.monotonic()
        await wait_for(path.exists, 10, "the token file rewritten", poll=0.05)
        print(f"token file rewritten {time.monotonic() - started:.2f}s after deletion")
        assert path.read_bytes() == b"first-token\n"

        # Secret changed: the watch writes the new bytes.
        await put_secret(admin_api, tok, {"token": b"second"})
        await wait_for(lambda: path.read_bytes() == b"second", 20, "the updated token")
        assert path.stat().st_mode & 0o7777 == 0o640


async def _wait_rejected(control_plane: ControlPlane, token: str, tmp_path: Path) -> float:
    """Until the server rejects ``token`` alone (401); returns how long that took."""
    token_file = tmp_path / f"old-token-{_uid()}"
    token_file.write_text(token)
    started = time.monotonic()
    async with KubeClient.from_token_file(
        control_plane.server, control_plane.ca_file, token_file
    ) as old:
        while True:
            try:
                await old.request("GET", "/api", old.nodes().ref("discover"))
            except KubeUnauthorized:
                return time.monotonic() - started
            assert time.monotonic() - started < 60, "old token still accepted after 60 s"
            await asyncio.sleep(0.5)


async def test_own_token_rotation_without_restart(
    admin_api: ApiClient,
    control_plane: ControlPlane,
    make_node_agent_credentials: CredentialsFactory,
    systemd: IsolatedSystemd,
    tmp_path: Path,
) -> None:
    node = f"node-{_uid()}"
    osc, tok = f"osc-{node}", f"gardener-node-agent-token-{node}"
    await create_node(admin_api, node)
    creds = await make_node_agent_credentials(node, [osc, tok])
    await put_secret(admin_api, tok, {"token": creds.token.encode()})
    setup = prepare_agent(tmp_path / "root", control_plane, creds, osc_secret=osc, token_secret=tok)

    async with running_agent(setup, host_name=node, systemd=systemd) as agent:
        await wait_lease_renewed_after(admin_api, node, now(), 25)

        # Rotate: a new token bound to a new Secret goes into the synced Secret ...
        core = client.CoreV1Api(admin_api)
        binding = f"{creds.service_account}-binding-{_uid()}"
        await core.create_namespaced_secret(
            NAMESPACE, client.V1Secret(metadata=client.V1ObjectMeta(name=binding))
        )
        new_token = await issue_token(admin_api, creds.service_account, binding_secret=binding)
        assert new_token != creds.token
        rotated = time.monotonic()
        await put_secret(admin_api, tok, {"token": new_token.encode()})
        await wait_for(
            lambda: setup.token_file.read_text() == new_token, 20, "the new token in the file"
        )
        print(f"rotated token in the agent's token file after {time.monotonic() - rotated:.2f}s")
        assert setup.token_file.stat().st_mode & 0o7777 == 0o640

        # ... and the old one is invalidated on the server.
        assert creds.binding_secret is not None
        await core.delete_namespaced_secret(creds.binding_secret, NAMESPACE)
        took = await _wait_rejected(control_plane, creds.token, tmp_path)
        print(f"old token rejected {took:.1f}s after its binding Secret was deleted")

        # Renewals after that can only be made with the new token.
        rejected_at = now()
        await wait_lease_renewed_after(admin_api, node, rejected_at, 15)
        await wait_lease_renewed_after(admin_api, node, now(), 15)
        assert not agent.done()  # no restart
