"""Token sync against the real kube-apiserver: file contents and modes, deletion, rotation.

The rotation test is the end-to-end proof: the agent's own token is rotated through the Secret
the token controller syncs into the file its kubeconfig names; the old token is invalidated on
the server (its binding Secret deleted), and the agent keeps renewing its Lease — which now can
only succeed with the new token — without a restart.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from tests.conftest import PreparedAgentFactory
from tests.testbed.agent_harness import (
    now,
    put_secret,
    running_agent,
    unique,
    wait_for,
    wait_lease_renewed_after,
    wait_token_rejected,
)
from tests.testbed.controlplane import ControlPlane
from tests.testbed.credentials import NAMESPACE, issue_token_bound_to_new_secret
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration


async def test_token_file_written_exactly_and_rewritten_after_deletion(
    admin_api: ApiClient,
    make_prepared_agent: PreparedAgentFactory,
    systemd: IsolatedSystemd,
    tmp_path: Path,
) -> None:
    node = unique("node")
    tok = f"kubelet-token-{node}"
    root = tmp_path / "root"
    prepared = await make_prepared_agent(root, name=node, extra_secrets=[tok])
    await put_secret(admin_api, tok, {"token": b"first-token\n"})
    target = "/opt/node/a/b/token"
    doc = prepared.setup.config.model_dump(by_alias=True)
    doc["controllers"]["token"]["syncConfigs"] = [{"secretName": tok, "path": target}]
    setup = prepared.setup.with_config(doc)
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


async def test_own_token_rotation_without_restart(
    admin_api: ApiClient,
    control_plane: ControlPlane,
    make_prepared_agent: PreparedAgentFactory,
    systemd: IsolatedSystemd,
    tmp_path: Path,
) -> None:
    node = unique("node")
    tok = f"gardener-node-agent-token-{node}"
    prepared = await make_prepared_agent(
        tmp_path / "root", name=node, extra_secrets=[tok], token_secret=tok
    )
    creds, setup = prepared.creds, prepared.setup
    await put_secret(admin_api, tok, {"token": creds.token.encode()})

    async with running_agent(setup, host_name=node, systemd=systemd) as agent:
        await wait_lease_renewed_after(admin_api, node, now(), 25)

        # Rotate: a new token bound to a new Secret goes into the synced Secret ...
        new_token = await issue_token_bound_to_new_secret(admin_api, creds.service_account)
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
        await client.CoreV1Api(admin_api).delete_namespaced_secret(creds.binding_secret, NAMESPACE)
        took, _ = await wait_token_rejected(control_plane, creds.token, tmp_path, 60)
        print(f"old token rejected {took:.1f}s after its binding Secret was deleted")

        # Renewals after that can only be made with the new token.
        rejected_at = now()
        await wait_lease_renewed_after(admin_api, node, rejected_at, 15)
        await wait_lease_renewed_after(admin_api, node, now(), 15)
        assert not agent.done()  # no restart
