"""The test bed of Gardener's certificate flow: bootstrap tokens authenticate and may create
CSRs, the approver decides like Gardener's, kube-controller-manager signs with the test CA,
the signed certificate is the node agent's least-privilege identity, and expired bootstrap
tokens are cleaned up."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from tests.conftest import SigningDurationSetter, api_client_from
from tests.testbed.agent_harness import create_node, unique
from tests.testbed.bootstrap import (
    NODE_AGENTS_GROUP,
    BootstrapToken,
    certificate_kubeconfig,
    create_bootstrap_token,
    grant_node_agent_identity,
    node_agent_user,
    token_kubeconfig,
)
from tests.testbed.controlplane import ControlPlane
from tests.testbed.credentials import NAMESPACE
from tests.testbed.csr_approver import CSRApprover

pytestmark = pytest.mark.integration
SIGNER = "kubernetes.io/kube-apiserver-client"
USAGES = ["digital signature", "key encipherment", "client auth"]
DAY30 = 720 * 3600


def _csr_pem(key: ec.EllipticCurvePrivateKey, common_name: str, orgs: Sequence[str]) -> bytes:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    attrs += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    request = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name(attrs))
        .sign(key, hashes.SHA256())
    )
    return request.public_bytes(serialization.Encoding.PEM)


async def _submit(
    api: ApiClient,
    machine: str,
    *,
    key: ec.EllipticCurvePrivateKey | None = None,
    common_name: str | None = None,
    orgs: Sequence[str] = (NODE_AGENTS_GROUP,),
    usages: Sequence[str] = USAGES,
    expiration_seconds: int = DAY30,
) -> tuple[str, ec.EllipticCurvePrivateKey]:
    key = key or ec.generate_private_key(ec.SECP256R1())
    pem = _csr_pem(key, common_name or node_agent_user(machine), orgs)
    name = f"node-agent-csr-{uuid.uuid4().hex[:10]}"
    await client.CertificatesV1Api(api).create_certificate_signing_request(
        client.V1CertificateSigningRequest(
            metadata=client.V1ObjectMeta(name=name),
            spec=client.V1CertificateSigningRequestSpec(
                request=base64.b64encode(pem).decode(),
                signer_name=SIGNER,
                usages=list(usages),
                expiration_seconds=expiration_seconds,
            ),
        )
    )
    return name, key


async def _issued(admin: ApiClient, name: str, timeout: float = 30.0) -> x509.Certificate:
    certs = client.CertificatesV1Api(admin)
    deadline = time.monotonic() + timeout
    while True:
        csr = await certs.read_certificate_signing_request(name)
        if csr.status is not None and csr.status.certificate:
            return x509.load_pem_x509_certificate(base64.b64decode(csr.status.certificate))
        failed = [c for c in (csr.status.conditions or []) if c.type == "Failed"]
        assert not failed, f"the signer failed: {failed[0].message}"
        assert time.monotonic() < deadline, f"no certificate for {name} within {timeout}s"
        await asyncio.sleep(0.1)


async def _conditions(admin: ApiClient, name: str) -> list[tuple[str, str, str]]:
    csr = await client.CertificatesV1Api(admin).read_certificate_signing_request(name)
    return [(c.type, c.reason, c.message) for c in (csr.status.conditions or [])]


@asynccontextmanager
async def _client(kubeconfig: Path) -> AsyncIterator[ApiClient]:
    api = await api_client_from(kubeconfig)
    async with api:
        yield api


@asynccontextmanager
async def _bootstrap_client(
    cp: ControlPlane, token: BootstrapToken, tmp_path: Path
) -> AsyncIterator[ApiClient]:
    kubeconfig = token_kubeconfig(
        tmp_path / f"bootstrap-{token.token_id}.kubeconfig",
        server=cp.server,
        ca_file=cp.ca_file,
        token=token.token,
    )
    async with _client(kubeconfig) as api:
        yield api


@asynccontextmanager
async def _certificate_client(
    cp: ControlPlane, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, tmp_path: Path
) -> AsyncIterator[ApiClient]:
    name = uuid.uuid4().hex[:8]
    cert_file, key_file = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    kubeconfig = certificate_kubeconfig(
        tmp_path / f"{name}.kubeconfig",
        server=cp.server,
        ca_file=cp.ca_file,
        cert_file=cert_file,
        key_file=key_file,
    )
    async with _client(kubeconfig) as api:
        yield api


async def _whoami(api: ApiClient) -> tuple[str, list[str]]:
    review = await client.AuthenticationV1Api(api).create_self_subject_review(
        client.V1SelfSubjectReview()
    )
    info = review.status.user_info
    return str(info.username), list(info.groups or [])


async def _status(call: object) -> int:
    assert asyncio.iscoroutine(call)
    try:
        await call
    except client.ApiException as exc:
        return int(exc.status)
    return 200


async def test_bootstrap_token_authenticates_and_may_only_request_certificates(
    gardener_controlplane: ControlPlane, admin_api: ApiClient, tmp_path: Path
) -> None:
    token = await create_bootstrap_token(admin_api)
    async with _bootstrap_client(gardener_controlplane, token, tmp_path) as api:
        user, groups = await _whoami(api)
        assert user == f"system:bootstrap:{token.token_id}"
        assert "system:bootstrappers" in groups

        name, _ = await _submit(api, unique("machine"))
        csr = await client.CertificatesV1Api(api).read_certificate_signing_request(name)
        assert csr.spec.username == user
        assert await _status(client.CoreV1Api(api).list_namespaced_secret(NAMESPACE)) == 403
        assert await _status(client.CoreV1Api(api).list_node()) == 403

    wrong = BootstrapToken(token.token_id, "x" * 16)
    async with _bootstrap_client(gardener_controlplane, wrong, tmp_path) as api:
        assert await _status(_whoami(api)) == 401


async def test_approved_csr_is_signed_by_the_test_ca_and_is_the_agents_identity(
    gardener_controlplane: ControlPlane,
    admin_api: ApiClient,
    csr_approver: CSRApprover,
    tmp_path: Path,
) -> None:
    machine, other = unique("machine"), unique("machine")
    osc_secret = f"osc-{machine}"
    token = await create_bootstrap_token(admin_api)
    async with _bootstrap_client(gardener_controlplane, token, tmp_path) as api:
        name, key = await _submit(api, machine)
    decision = await csr_approver.wait_for_decision(name)
    assert (decision.outcome, decision.reason) == ("approved", "all checks passed")
    assert decision.username == token.username
    assert await _conditions(admin_api, name) == [
        (
            "Approved",
            "RequestApproved",
            "Approving gardener-node-agent certificate CSR (all checks passed)",
        )
    ]
    cert = await _issued(admin_api, name)
    ca = x509.load_pem_x509_certificate(gardener_controlplane.ca_file.read_bytes())
    cert.verify_directly_issued_by(ca)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == (
        node_agent_user(machine)
    )
    orgs = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    assert orgs == [NODE_AGENTS_GROUP]
    lifetime = cert.not_valid_after_utc - dt.datetime.now(dt.UTC)
    # min(720h, the CA's own end (it lives 2 days)): far longer than a rotation test's.
    assert lifetime > dt.timedelta(hours=24)

    await grant_node_agent_identity(admin_api, machine, secret_names=[osc_secret])
    await create_node(admin_api, machine)
    await create_node(admin_api, other)
    core_admin = client.CoreV1Api(admin_api)
    await core_admin.create_namespaced_secret(
        NAMESPACE, client.V1Secret(metadata=client.V1ObjectMeta(name=osc_secret))
    )
    async with _certificate_client(gardener_controlplane, cert, key, tmp_path) as api:
        user, groups = await _whoami(api)
        assert user == node_agent_user(machine)
        assert NODE_AGENTS_GROUP in groups
        core = client.CoreV1Api(api)
        coord = client.CoordinationV1Api(api)
        assert (await core.read_node(machine)).metadata.name == machine
        assert await _status(core.read_node(other)) == 403
        assert (await core.read_namespaced_secret(osc_secret, NAMESPACE)).metadata.name == (
            osc_secret
        )
        assert await _status(core.read_namespaced_secret(f"osc-{other}", NAMESPACE)) == 403
        lease = f"gardener-node-agent-{machine}"
        await coord.create_namespaced_lease(
            NAMESPACE, client.V1Lease(metadata=client.V1ObjectMeta(name=lease))
        )
        assert (await coord.read_namespaced_lease(lease, NAMESPACE)).metadata.name == lease
        other_lease = f"gardener-node-agent-{other}"
        await client.CoordinationV1Api(admin_api).create_namespaced_lease(
            NAMESPACE, client.V1Lease(metadata=client.V1ObjectMeta(name=other_lease))
        )
        assert await _status(coord.read_namespaced_lease(other_lease, NAMESPACE)) == 403

        # Renewal: the identity requests a new certificate for itself, and gets it ...
        renewed, _ = await _submit(api, machine)
        assert (await csr_approver.wait_for_decision(renewed)).outcome == "approved"
        assert (await _issued(admin_api, renewed)).subject == cert.subject
        # ... but not one for another machine.
        foreign, _ = await _submit(api, other)
        decision = await csr_approver.wait_for_decision(foreign)
        assert decision.outcome == "denied"
        assert decision.reason == (
            f"username {node_agent_user(machine)!r} and commonName "
            f"{node_agent_user(other)!r} do not match"
        )

    # The machine's Node exists now: its bootstrap token may not get another certificate.
    async with _bootstrap_client(gardener_controlplane, token, tmp_path) as api:
        again, _ = await _submit(api, machine)
    decision = await csr_approver.wait_for_decision(again)
    assert decision.outcome == "denied"
    assert "already bootstrapped" in decision.reason
    assert [c[:2] for c in await _conditions(admin_api, again)] == [("Denied", "RequestDenied")]


async def test_wrong_requests_are_denied_and_others_left_alone(
    gardener_controlplane: ControlPlane,
    admin_api: ApiClient,
    csr_approver: CSRApprover,
    tmp_path: Path,
) -> None:
    token = await create_bootstrap_token(admin_api)
    async with _bootstrap_client(gardener_controlplane, token, tmp_path) as api:
        wrong_org, _ = await _submit(api, unique("machine"), orgs=["gardener.cloud:shoots"])
        no_org, _ = await _submit(api, unique("machine"), orgs=[])
        extra_usage, _ = await _submit(api, unique("machine"), usages=[*USAGES, "server auth"])
        few_usages, _ = await _submit(api, unique("machine"), usages=["client auth"])
        not_ours, _ = await _submit(api, "x", common_name="someone-else")
    # A user that may create CSRs but is neither a bootstrap token nor a node agent.
    intruder = unique("intruder")
    pair = gardener_controlplane.ca.issue(intruder, common_name=intruder, client=True)
    await client.RbacAuthorizationV1Api(admin_api).create_cluster_role_binding(
        client.V1ClusterRoleBinding(
            metadata=client.V1ObjectMeta(name=intruder),
            role_ref=client.V1RoleRef(
                api_group="rbac.authorization.k8s.io",
                kind="ClusterRole",
                name="system:node-bootstrapper",
            ),
            subjects=[
                client.RbacV1Subject(
                    api_group="rbac.authorization.k8s.io", kind="User", name=intruder
                )
            ],
        )
    )
    kubeconfig = certificate_kubeconfig(
        tmp_path / "intruder.kubeconfig",
        server=gardener_controlplane.server,
        ca_file=gardener_controlplane.ca_file,
        cert_file=pair.cert,
        key_file=pair.key,
    )
    async with _client(kubeconfig) as api:
        by_intruder, _ = await _submit(api, unique("machine"))

    for name, reason in [
        (wrong_org, "organization ['gardener.cloud:shoots']"),
        (no_org, "organization []"),
        (extra_usage, "usages ["),
        (few_usages, "usages ["),
        (by_intruder, f"username {intruder!r} is not allowed"),
    ]:
        decision = await csr_approver.wait_for_decision(name)
        assert decision.outcome == "denied", name
        assert decision.reason.startswith(reason), decision.reason
        assert (await _conditions(admin_api, name))[0][:2] == ("Denied", "RequestDenied")
    await asyncio.sleep(1)
    assert csr_approver.decision(not_ours) is None
    assert await _conditions(admin_api, not_ours) == []
    assert csr_approver.errors == []


async def test_hold_and_deny_modes(
    gardener_controlplane: ControlPlane,
    admin_api: ApiClient,
    csr_approver: CSRApprover,
    tmp_path: Path,
) -> None:
    await csr_approver.set_mode("hold")
    token = await create_bootstrap_token(admin_api)
    async with _bootstrap_client(gardener_controlplane, token, tmp_path) as api:
        held, _ = await _submit(api, unique("machine"))
        assert (await csr_approver.wait_for_decision(held)).outcome == "held"
        await asyncio.sleep(1)
        assert await _conditions(admin_api, held) == [], "a held CSR stays pending"
        await csr_approver.release()
        assert (await csr_approver.wait_for_decision(held, outcome="approved")).outcome
        await _issued(admin_api, held)

        await csr_approver.set_mode("deny")
        refused, _ = await _submit(api, unique("machine"))
    decision = await csr_approver.wait_for_decision(refused)
    assert (decision.outcome, decision.reason) == ("denied", "denied by the test")


async def test_short_signing_duration_gives_short_certificates(
    gardener_controlplane: ControlPlane,
    admin_api: ApiClient,
    csr_approver: CSRApprover,
    kcm_signing_duration: SigningDurationSetter,
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    await kcm_signing_duration("90s")
    restart = time.monotonic() - started
    token = await create_bootstrap_token(admin_api)
    async with _bootstrap_client(gardener_controlplane, token, tmp_path) as api:
        asked = dt.datetime.now(dt.UTC)
        name, _ = await _submit(api, unique("machine"), expiration_seconds=DAY30)
    cert = await _issued(admin_api, name)
    end = cert.not_valid_after_utc
    # Short certificates are not backdated at the end: notAfter = signing time + 90 s.
    assert asked + dt.timedelta(seconds=85) <= end <= asked + dt.timedelta(seconds=120), end - asked
    assert restart < 60, f"kube-controller-manager took {restart:.1f}s to restart"


async def test_token_cleaner_removes_expired_bootstrap_tokens(
    gardener_controlplane: ControlPlane, admin_api: ApiClient, tmp_path: Path
) -> None:
    core = client.CoreV1Api(admin_api)
    expired = await create_bootstrap_token(
        admin_api, expiration=dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)
    )
    soon = await create_bootstrap_token(
        admin_api, expiration=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=4)
    )
    async with _bootstrap_client(gardener_controlplane, soon, tmp_path) as api:
        assert (await _whoami(api))[0] == soon.username
    async with _bootstrap_client(gardener_controlplane, expired, tmp_path) as api:
        assert await _status(_whoami(api)) == 401

    for token in (expired, soon):
        deadline = time.monotonic() + 30
        while await _status(core.read_namespaced_secret(token.secret_name, NAMESPACE)) != 404:
            assert time.monotonic() < deadline, f"{token.secret_name} not removed within 30s"
            await asyncio.sleep(0.2)
