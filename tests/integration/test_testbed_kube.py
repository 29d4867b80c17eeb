"""The test control plane is a real kube-apiserver with etcd, RBAC and service-account tokens."""

from __future__ import annotations

import asyncio
import base64
import uuid
from pathlib import Path

import pytest
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client import ApiClient

from tests.conftest import CredentialsFactory, api_client_from
from tests.testbed.controlplane import ControlPlane
from tests.testbed.systemd_ns import HarnessError

pytestmark = pytest.mark.integration
NS = "kube-system"


def _secret(name: str, value: bytes) -> client.V1Secret:
    return client.V1Secret(
        metadata=client.V1ObjectMeta(name=name),
        data={"osc.yaml": base64.b64encode(value).decode()},
    )


async def test_secret_create_watch_update(admin_api: ApiClient) -> None:
    core = client.CoreV1Api(admin_api)
    name = f"smoke-{uuid.uuid4().hex[:8]}"
    other = f"{name}-other"
    created = await core.create_namespaced_secret(NS, _secret(name, b"one"))
    await core.create_namespaced_secret(NS, _secret(other, b"noise"))

    seen: list[tuple[str, str, bytes]] = []

    async def observe() -> None:
        w = watch.Watch()
        async with w.stream(
            core.list_namespaced_secret,
            NS,
            field_selector=f"metadata.name={name}",
            resource_version=created.metadata.resource_version,
            timeout_seconds=30,
        ) as stream:
            async for event in stream:
                obj = event["object"]
                data = base64.b64decode(obj.data["osc.yaml"])
                seen.append((event["type"], obj.metadata.name, data))
                if data == b"two":
                    return

    watcher = asyncio.create_task(observe())
    await asyncio.sleep(0.2)
    await core.patch_namespaced_secret(other, NS, _secret(other, b"more noise"))
    await core.patch_namespaced_secret(name, NS, _secret(name, b"two"))
    await asyncio.wait_for(watcher, timeout=20)

    assert seen == [("MODIFIED", name, b"two")], "only the named Secret's update is delivered"
    fetched = await core.read_namespaced_secret(name, NS)
    assert base64.b64decode(fetched.data["osc.yaml"]) == b"two"


async def test_least_privilege_credentials_are_enforced(
    admin_api: ApiClient, make_node_agent_credentials: CredentialsFactory
) -> None:
    core = client.CoreV1Api(admin_api)
    allowed, forbidden = f"osc-{uuid.uuid4().hex[:8]}", f"foreign-{uuid.uuid4().hex[:8]}"
    for secret in (allowed, forbidden):
        await core.create_namespaced_secret(NS, _secret(secret, b"x"))
    for name in ("node-a", "node-b"):
        await core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=name)))

    creds = await make_node_agent_credentials("node-a", [allowed])
    async with await api_client_from(creds.kubeconfig) as agent_api:
        agent_core = client.CoreV1Api(agent_api)
        # Allowed: its own Secret, its own Node.
        own = await agent_core.read_namespaced_secret(allowed, NS)
        assert own.metadata.name == allowed
        listed = await agent_core.list_namespaced_secret(
            NS, field_selector=f"metadata.name={allowed}"
        )
        assert [s.metadata.name for s in listed.items] == [allowed]
        node = await agent_core.read_node("node-a")
        assert node.metadata.name == "node-a"

        # Denied: other Secrets, listing all Secrets, other Nodes.
        denied = [
            agent_core.read_namespaced_secret(forbidden, NS),
            agent_core.list_namespaced_secret(NS),
            agent_core.read_node("node-b"),
            agent_core.patch_node("node-b", {"metadata": {"labels": {"x": "y"}}}),
        ]
        for call in denied:
            with pytest.raises(client.ApiException) as info:
                await call
            assert info.value.status == 403, info.value.reason

        whoami = await client.AuthenticationV1Api(agent_api).create_self_subject_review(
            client.V1SelfSubjectReview()
        )
        assert whoami.status.user_info.username == (
            f"system:serviceaccount:{NS}:{creds.service_account}"
        )


def test_unreachable_etcd_is_a_clear_error_not_a_hang(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    broken = ControlPlane(tmp_path / "broken", bin_dir=control_plane.bin_dir)
    broken.apiserver.argv = [
        a if not a.startswith("--etcd-servers=") else "--etcd-servers=http://127.0.0.1:1"
        for a in broken.apiserver.argv
    ]
    try:
        broken.etcd.start()
        with pytest.raises(HarnessError, match="kube-apiserver not ready within 5s"):
            broken.start_apiserver(timeout=5)
    finally:
        broken.stop()
    assert not broken.apiserver.running()
    assert not broken.etcd.running()
