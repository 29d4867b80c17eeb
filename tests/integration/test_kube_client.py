"""KubeClient against the real kube-apiserver with a node agent's least-privilege credentials.

Covers the typed calls and their typed errors, token rotation picked up from the token file
(proven by invalidating the old token on the server), the 401 retry, CA-file rebuilds and the
per-request timeout against a frozen (SIGSTOPped) apiserver.
"""

from __future__ import annotations

import base64
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from node_agent.base.errors import (
    KubeAlreadyExists,
    KubeConfigError,
    KubeConflict,
    KubeForbidden,
    KubeNotFound,
    KubeTimeout,
    KubeTransportError,
    KubeUnauthorized,
)
from node_agent.kube.client import KubeClient, Timeouts, file_signature
from node_agent.kube.report import node_event
from tests.conftest import CredentialsFactory
from tests.testbed.agent_harness import create_node, unique, wait_token_rejected
from tests.testbed.controlplane import ControlPlane, write_kubeconfig
from tests.testbed.credentials import (
    NAMESPACE,
    NodeAgentCredentials,
    issue_token_bound_to_new_secret,
)
from tests.testbed.pki import CertificateAuthority

pytestmark = pytest.mark.integration
NS = NAMESPACE


async def _make_secret(admin: ApiClient, name: str, value: bytes = b"x") -> None:
    await client.CoreV1Api(admin).create_namespaced_secret(
        NS,
        client.V1Secret(
            metadata=client.V1ObjectMeta(name=name), data={"v": base64.b64encode(value).decode()}
        ),
    )


@dataclass(frozen=True)
class Reader:
    """A node agent (its Node not registered) whose credentials may read just one Secret."""

    node: str
    osc: str
    creds: NodeAgentCredentials


@pytest_asyncio.fixture(loop_scope="session")
async def reader(admin_api: ApiClient, make_node_agent_credentials: CredentialsFactory) -> Reader:
    node, osc = unique("node"), unique("osc")
    await _make_secret(admin_api, osc)
    return Reader(node, osc, await make_node_agent_credentials(node, [osc]))


async def _rotate(admin: ApiClient, creds: NodeAgentCredentials) -> tuple[str, str]:
    """Mint a token bound to a new Secret, then delete the old binding Secret.

    Returns (old token, new token); the old one is invalid on the server afterwards.
    """
    new_token = await issue_token_bound_to_new_secret(admin, creds.service_account)
    old_token = creds.token_file.read_text().strip()
    assert creds.binding_secret is not None
    await client.CoreV1Api(admin).delete_namespaced_secret(creds.binding_secret, NS)
    return old_token, new_token


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def _wait_rejected(control_plane: ControlPlane, token: str, tmp_path: Path) -> None:
    _, stats = await wait_token_rejected(control_plane, token, tmp_path, 30)
    assert stats.unauthorized_retries == 1  # re-read once, still rejected


async def test_typed_calls_and_errors(
    admin_api: ApiClient, make_node_agent_credentials: CredentialsFactory
) -> None:
    node = unique("node")
    osc, missing, foreign = unique("osc"), unique("missing"), unique("foreign")
    await create_node(admin_api, node)
    await _make_secret(admin_api, osc, b"payload")
    await _make_secret(admin_api, foreign)
    creds = await make_node_agent_credentials(node, [osc, missing])

    async with KubeClient.from_kubeconfig(creds.kubeconfig) as kube:
        secret = await kube.get_secret(NS, osc)
        assert base64.b64decode(secret["data"]["v"]) == b"payload"

        with pytest.raises(KubeNotFound, match=f"get Secret {NS}/{missing}: 404 NotFound"):
            await kube.get_secret(NS, missing)
        with pytest.raises(KubeForbidden, match=f"get Secret {NS}/{foreign}: 403 Forbidden"):
            await kube.get_secret(NS, foreign)

        # Node: merge patch adds and (with None) removes keys, leaving the rest alone.
        patched = await kube.patch_node(
            node, {"metadata": {"labels": {"a": "1", "b": "2"}, "annotations": {"c": "3"}}}
        )
        assert patched["metadata"]["labels"]["a"] == "1"
        patched = await kube.patch_node(node, {"metadata": {"labels": {"a": None}}})
        assert "a" not in patched["metadata"]["labels"]
        assert patched["metadata"]["labels"]["b"] == "2"
        assert (await kube.get_node(node))["metadata"]["annotations"]["c"] == "3"

        # Lease: create, read, update with compare-and-swap, conflicts are typed.
        node_obj = await kube.get_node(node)
        lease_name = f"gardener-node-agent-{node}"
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": lease_name,
                "namespace": NS,
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "name": node,
                        "uid": node_obj["metadata"]["uid"],
                    }
                ],
            },
            "spec": {
                "holderIdentity": lease_name,
                "leaseDurationSeconds": 40,
                "renewTime": "2026-01-01T00:00:00.000000Z",
            },
        }
        created = await kube.create_lease(NS, body)
        with pytest.raises(KubeAlreadyExists, match=f"create Lease {NS}/{lease_name}: 409"):
            await kube.create_lease(NS, body)
        got = await kube.get_lease(NS, lease_name)
        assert got["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
        got["spec"]["renewTime"] = "2026-01-01T00:00:10.000000Z"
        updated = await kube.update_lease(NS, lease_name, got)
        assert updated["spec"]["renewTime"].startswith("2026-01-01T00:00:10")
        with pytest.raises(KubeConflict, match=f"update Lease {NS}/{lease_name}: 409 Conflict"):
            await kube.update_lease(NS, lease_name, got)  # stale resourceVersion

        # Event about the Node lands in "default".
        event = await kube.create_event(
            node_event(
                node_name=node,
                node_uid=node_obj["metadata"]["uid"],
                reason="OSCApplied",
                message="applied",
                host=node,
            )
        )
        assert event["metadata"]["namespace"] == "default"
        stored = await client.CoreV1Api(admin_api).read_namespaced_event(
            event["metadata"]["name"], "default"
        )
        assert stored.involved_object.kind == "Node"
        assert stored.involved_object.name == node
        assert stored.reason == "OSCApplied"
        assert kube.stats.unauthorized_retries == 0


async def test_token_rotation_is_picked_up_without_rebuilding(
    admin_api: ApiClient,
    reader: Reader,
    control_plane: ControlPlane,
    tmp_path: Path,
) -> None:
    osc, creds = reader.osc, reader.creds
    async with KubeClient.from_kubeconfig(creds.kubeconfig) as kube:
        await kube.get_secret(NS, osc)
        api_before = kube._gen.api

        old_token, new_token = await _rotate(admin_api, creds)
        _atomic_write(creds.token_file, new_token + "\n")
        await _wait_rejected(control_plane, old_token, tmp_path)

        await kube.get_secret(NS, osc)  # with the new token, no 401 on the way
        assert kube.stats.token_reloads == 1
        assert kube.stats.unauthorized_retries == 0
        assert kube.stats.rebuilds == 0
        assert kube._gen.api is api_before


async def test_unauthorized_rereads_token_and_retries_once(
    admin_api: ApiClient,
    reader: Reader,
    control_plane: ControlPlane,
    tmp_path: Path,
) -> None:
    osc, creds = reader.osc, reader.creds
    async with KubeClient.from_kubeconfig(creds.kubeconfig) as kube:
        await kube.get_secret(NS, osc)
        old_token, new_token = await _rotate(admin_api, creds)
        await _wait_rejected(control_plane, old_token, tmp_path)

        # The file still holds the invalidated token: one re-read, one retry, a typed 401.
        with pytest.raises(KubeUnauthorized, match=f"get Secret {NS}/{osc}: 401"):
            await kube.get_secret(NS, osc)
        assert kube.stats.unauthorized_retries == 1

        # New token written in place, and the cheap stat check made to miss it (as on a file
        # system with coarse timestamps): only the 401 path can recover.
        creds.token_file.write_text(new_token)
        token = kube._gen.token
        assert token is not None
        token._signature = file_signature(creds.token_file)
        await kube.get_secret(NS, osc)
        assert kube.stats.unauthorized_retries == 2
        assert kube.stats.token_reloads == 1
        await kube.get_secret(NS, osc)
        assert kube.stats.unauthorized_retries == 2


async def test_ca_file_change_rebuilds_client(
    reader: Reader,
    control_plane: ControlPlane,
    tmp_path: Path,
) -> None:
    osc, creds = reader.osc, reader.creds
    ca = tmp_path / "ca.crt"
    shutil.copy(control_plane.ca_file, ca)
    other_ca = CertificateAuthority(tmp_path / "other-ca", name="some-other-ca")
    async with KubeClient.from_token_file(control_plane.server, ca, creds.token_file) as kube:
        await kube.get_secret(NS, osc)

        _atomic_write(ca, other_ca.cert_path.read_text())  # a CA that did not sign the server
        with pytest.raises(KubeTransportError, match="CERTIFICATE_VERIFY_FAILED"):
            await kube.get_secret(NS, osc)
        assert kube.stats.rebuilds == 1

        _atomic_write(ca, control_plane.ca_file.read_text())
        await kube.get_secret(NS, osc)
        assert kube.stats.rebuilds == 2
        assert kube._retired == []  # old clients closed once idle


async def test_kubeconfig_with_inline_ca_and_token(
    reader: Reader,
    control_plane: ControlPlane,
    tmp_path: Path,
) -> None:
    osc, creds = reader.osc, reader.creds
    kubeconfig = write_kubeconfig(
        tmp_path / "inline.kubeconfig",
        server=control_plane.server,
        ca_file=control_plane.ca_file,
        user={"token": creds.token},
    )
    text = kubeconfig.read_text().replace(
        f"certificate-authority: {control_plane.ca_file}",
        "certificate-authority-data: "
        + base64.b64encode(control_plane.ca_file.read_bytes()).decode(),
    )
    kubeconfig.write_text(text)
    async with KubeClient.from_kubeconfig(kubeconfig) as kube:
        assert (await kube.get_secret(NS, osc))["metadata"]["name"] == osc


async def test_frozen_apiserver_times_out_within_bound(
    reader: Reader, control_plane: ControlPlane
) -> None:
    node, osc, creds = reader.node, reader.osc, reader.creds
    timeouts = Timeouts(connect=1.0, read=2.0, total=3.0)
    async with KubeClient.from_kubeconfig(creds.kubeconfig, timeouts=timeouts) as kube:
        await kube.get_secret(NS, osc)  # a pooled keep-alive connection now exists
        control_plane.freeze_apiserver()
        try:
            started = time.monotonic()
            with pytest.raises(KubeTimeout, match=f"get Secret {NS}/{osc}: no answer"):
                await kube.get_secret(NS, osc)
            pooled = time.monotonic() - started

            fresh_kube = KubeClient.from_kubeconfig(creds.kubeconfig, timeouts=timeouts)
            async with fresh_kube:  # new connection: TCP accepted by the kernel, TLS hangs
                started = time.monotonic()
                with pytest.raises(KubeTimeout):
                    await fresh_kube.get_node(node)
                fresh = time.monotonic() - started
        finally:
            control_plane.thaw_apiserver()
        print(f"frozen apiserver detected: pooled connection {pooled:.2f}s, new {fresh:.2f}s")
        assert 1.5 <= pooled <= 3.5
        assert 0.5 <= fresh <= 3.5
        assert kube.stats.timeouts == 1
        await kube.get_secret(NS, osc)  # recovers after thaw


async def test_kubeconfig_problems_are_typed_errors(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "ca")
    missing = write_kubeconfig(
        tmp_path / "missing-token.kubeconfig",
        server="https://127.0.0.1:1",
        ca_file=ca.cert_path,
        user={"tokenFile": "no-such-token"},  # relative to the kubeconfig's directory
    )
    with pytest.raises(KubeConfigError, match=f"token file {tmp_path}/no-such-token"):
        KubeClient.from_kubeconfig(missing)
    exec_user = write_kubeconfig(
        tmp_path / "exec.kubeconfig",
        server="https://127.0.0.1:1",
        ca_file=ca.cert_path,
        user={"exec": "x"},
    )
    with pytest.raises(KubeConfigError, match="'exec' is not supported"):
        KubeClient.from_kubeconfig(exec_user)
    with pytest.raises(KubeConfigError, match=r"kubeconfig .*nope"):
        KubeClient.from_kubeconfig(tmp_path / "nope")


async def test_nothing_is_logged_at_debug_by_the_library(
    make_node_agent_credentials: CredentialsFactory, admin_api: ApiClient
) -> None:
    osc = unique("osc")
    await _make_secret(admin_api, osc, b"top secret")
    creds = await make_node_agent_credentials(unique("node"), [osc])
    root = logging.getLogger()
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign,assignment]
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        async with KubeClient.from_kubeconfig(creds.kubeconfig) as kube:
            await kube.get_secret(NS, osc)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    library = [r for r in records if r.name.startswith("kubernetes_asyncio")]
    assert library == []
    assert logging.getLogger("kubernetes_asyncio.client.rest").getEffectiveLevel() >= logging.INFO
    assert not any(base64.b64encode(b"top secret").decode() in r.getMessage() for r in records)
