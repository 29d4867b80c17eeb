"""The agent's own credentials by Gardener's certificate flow, on the real test bed.

kube-apiserver with bootstrap-token authentication, kube-controller-manager signing
kube-apiserver-client certificates with the test CA, and an approver that decides like Gardener's.
The agent starts with nothing but ``credentials/bootstrap-token``, ``cluster-ca.crt``,
``machine-name`` and its config (as Gardener's user-data leaves them), and must end up with a
certificate of its own, apply its OSC with it, and drop the bootstrap token afterwards; it must
renew the certificate without restarting, and fall back to the token when its certificate expired.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from node_agent.base.layout import BASE_DIR, BOOTSTRAP_TOKEN_FILE, KUBECONFIG_FILE
from node_agent.commands import status
from node_agent.config import AgentSettings, parse_config
from node_agent.kube import certificates
from node_agent.observe import status_document
from tests.conftest import SigningDurationSetter
from tests.testbed.agent_harness import (
    AgentSetup,
    create_node,
    host,
    osc_document,
    publish_osc,
    read_lease,
    running_agent,
    service,
    unique,
    wait_applied,
    wait_for,
)
from tests.testbed.bootstrap import create_bootstrap_token, grant_node_agent_identity
from tests.testbed.controlplane import ControlPlane
from tests.testbed.csr_approver import CSRApprover
from tests.testbed.hostile_signer import HostileSigner, Issue, Kind
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

CA_FILE = f"{BASE_DIR}/cluster-ca.crt"


async def gardener_layout(
    root: Path, control_plane: ControlPlane, admin: ApiClient, machine: str, osc_secret: str
) -> AgentSetup:
    """What Gardener's user-data leaves for the agent: no kubeconfig, a bootstrap token."""
    token = await create_bootstrap_token(admin)
    await grant_node_agent_identity(admin, machine, secret_names=[osc_secret])
    base = host(root, BASE_DIR)
    (base / "credentials").mkdir(parents=True, exist_ok=True)
    for name, data in (
        ("cluster-ca.crt", control_plane.ca_file.read_bytes()),
        ("credentials/bootstrap-token", token.token.encode()),
        ("machine-name", machine.encode()),
    ):
        (base / name).write_bytes(data)
        (base / name).chmod(0o640)
    doc = {
        "apiVersion": "nodeagent.config.gardener.cloud/v1alpha1",
        "kind": "NodeAgentConfiguration",
        "logFormat": "text",
        "apiServer": {"server": control_plane.server, "caFile": CA_FILE},
        "controllers": {
            "operatingSystemConfig": {"secretName": osc_secret, "kubernetesVersion": "1.33.4"}
        },
    }
    config_file = base / "config-v1.150.0.yaml"
    config_file.write_text(yaml.safe_dump(doc))
    config_file.chmod(0o600)
    settings = AgentSettings(root=root, config_file=f"{BASE_DIR}/config-v1.150.0.yaml")
    config = parse_config(config_file.read_bytes())
    return AgentSetup(root, config_file, host(root, "/nonexistent"), settings, config)


def kubeconfig_certificate(root: Path) -> x509.Certificate:
    raw = host(root, KUBECONFIG_FILE).read_bytes()
    pem = certificates.kubeconfig_certificate(raw)
    assert pem is not None, raw
    return x509.load_pem_x509_certificate(pem)


def subject_of(cert: x509.Certificate) -> tuple[str, list[str]]:
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    orgs = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    return str(cn), [str(o) for o in orgs]


async def test_bootstrap_token_becomes_a_certificate_and_goes_away_after_the_first_apply(
    gardener_controlplane: ControlPlane,
    admin_api: ApiClient,
    csr_approver: CSRApprover,
    node: IsolatedSystemd,
) -> None:
    machine = unique("machine")
    root = node.root
    setup = await gardener_layout(root, gardener_controlplane, admin_api, machine, f"osc-{machine}")
    await csr_approver.set_mode("hold")
    sock = status_document.socket_path(root, setup.settings.status_socket)

    async with running_agent(setup, host_name=machine, systemd=node):
        held = await csr_approver.wait_for_decision(outcome="held", timeout=30)
        assert held.username.startswith("system:bootstrap:")
        assert held.common_name == f"gardener.cloud:node-agent:machine:{machine}"
        assert held.csr.startswith("node-agent-csr-")

        async def status_says_waiting() -> bool:
            doc = await asyncio.to_thread(status.query, sock)
            return "waiting for approval" in str((doc.get("certificate") or {}).get("phase"))

        await wait_for(status_says_waiting, 15, "status shows the CSR waiting for approval")
        assert not host(root, KUBECONFIG_FILE).exists()

        await csr_approver.set_mode("approve")
        await csr_approver.release()
        await wait_for(lambda: host(root, KUBECONFIG_FILE).exists(), 30, "the kubeconfig")
        kubeconfig = host(root, KUBECONFIG_FILE)
        assert oct(kubeconfig.stat().st_mode & 0o777) == "0o600"
        cert = kubeconfig_certificate(root)
        assert subject_of(cert) == (
            f"gardener.cloud:node-agent:machine:{machine}",
            ["gardener.cloud:node-agents"],
        )
        assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
        lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
        assert lifetime <= dt.timedelta(hours=720, minutes=5)
        # 720 h, unless the signer's own certificate (the test CA) ends sooner
        ca = x509.load_pem_x509_certificate(gardener_controlplane.ca_file.read_bytes())
        expected_end = min(ca.not_valid_after_utc, cert.not_valid_before_utc + lifetime)
        assert cert.not_valid_after_utc == expected_end
        assert cert.not_valid_after_utc > dt.datetime.now(dt.UTC) + dt.timedelta(hours=24)
        csr = await client.CertificatesV1Api(admin_api).read_certificate_signing_request(held.csr)
        assert csr.spec.signer_name == "kubernetes.io/kube-apiserver-client"
        assert csr.spec.expiration_seconds == 720 * 3600
        assert sorted(csr.spec.usages) == ["client auth", "digital signature", "key encipherment"]

        # The kubelet registers the Node; the agent (on its certificate) applies the OSC and
        # renews its Lease, then drops the bootstrap token.
        await create_node(admin_api, machine)
        checksum = await publish_osc(
            admin_api,
            f"osc-{machine}",
            osc_document([], [service("cert-flow.service", command="start", enable=True)]),
        )
        await wait_applied(admin_api, machine, checksum, timeout=60)
        await wait_for(lambda: read_lease(admin_api, machine), 20, "the lease")
        await wait_for(
            lambda: not host(root, BOOTSTRAP_TOKEN_FILE).exists(), 20, "the token deleted"
        )
        doc = await asyncio.to_thread(status.query, sock)
        assert doc["certificate"]["phase"] == "valid"
        assert doc["certificate"]["subject"].startswith(
            f"CN=gardener.cloud:node-agent:machine:{machine}"
        )
    assert csr_approver.errors == []


async def test_certificate_rotates_without_a_restart_and_the_lease_never_lapses(
    gardener_controlplane: ControlPlane,
    admin_api: ApiClient,
    csr_approver: CSRApprover,
    kcm_signing_duration: SigningDurationSetter,
    node: IsolatedSystemd,
) -> None:
    """kube-controller-manager signs for 60 s: the agent renews 48-53 s after receipt,
    with a CSR authenticated by the certificate itself, and keeps going on the new one."""
    await kcm_signing_duration("60s")
    machine = unique("machine")
    root = node.root
    setup = await gardener_layout(root, gardener_controlplane, admin_api, machine, f"osc-{machine}")

    async with running_agent(setup, host_name=machine, systemd=node) as agent:
        await wait_for(lambda: host(root, KUBECONFIG_FILE).exists(), 30, "the kubeconfig")
        first = kubeconfig_certificate(root)
        await create_node(admin_api, machine)  # from now on only the agent's identity may ask
        await wait_for(lambda: read_lease(admin_api, machine), 20, "the lease")
        renewals: list[dt.datetime] = []
        # Watch the Lease until the first certificate has been expired for 15 s: a rotation
        # must happen on the way, and renewals must go on across it and after the expiry.
        deadline = first.not_valid_after_utc + dt.timedelta(seconds=15)
        while dt.datetime.now(dt.UTC) < deadline:
            lease = await read_lease(admin_api, machine)
            if lease is not None and (not renewals or lease.spec.renew_time != renewals[-1]):
                renewals.append(lease.spec.renew_time)
            await asyncio.sleep(0.5)
        second = kubeconfig_certificate(root)
        assert second.serial_number != first.serial_number, "no rotation within the lifetime"
        assert second.not_valid_after_utc > first.not_valid_after_utc
        assert subject_of(second) == subject_of(first)
        approved = [d for d in csr_approver.decisions if d.outcome == "approved"]
        assert approved[0].username.startswith("system:bootstrap:")
        # the renewal asked with the certificate itself, not with the bootstrap token
        assert approved[-1].username == f"gardener.cloud:node-agent:machine:{machine}"
        assert any(r > first.not_valid_after_utc for r in renewals), renewals
        assert not agent.done()  # the same agent all along: no restart for the rotation
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(renewals)]
    print(f"lease renewal gaps across the rotation: {[round(g, 2) for g in gaps]}")
    assert len(gaps) >= 5, renewals
    assert max(gaps) <= 10 + 3, gaps  # one renewal period (10 s) plus slack


def expired_certificate(control_plane: ControlPlane, machine: str) -> tuple[bytes, bytes]:
    """A certificate for the agent's identity from the cluster CA that expired an hour ago."""
    ca_cert = x509.load_pem_x509_certificate(control_plane.ca_file.read_bytes())
    ca_key = serialization.load_pem_private_key(control_plane.ca.key_path.read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gardener.cloud:node-agents"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"gardener.cloud:node-agent:machine:{machine}"),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=3))
        .not_valid_after(now - dt.timedelta(hours=1))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


async def test_an_expired_certificate_falls_back_to_the_bootstrap_token(
    gardener_controlplane: ControlPlane,
    admin_api: ApiClient,
    csr_approver: CSRApprover,
    node: IsolatedSystemd,
) -> None:
    machine = unique("machine")
    root = node.root
    setup = await gardener_layout(root, gardener_controlplane, admin_api, machine, f"osc-{machine}")
    cert, key = expired_certificate(gardener_controlplane, machine)
    kubeconfig = host(root, KUBECONFIG_FILE)
    kubeconfig.write_bytes(
        certificates.kubeconfig(
            gardener_controlplane.server,
            str(host(root, CA_FILE)),
            cert,
            key,
            certificates.certificate_info(cert),
        )
    )
    kubeconfig.chmod(0o600)
    old_serial = x509.load_pem_x509_certificate(cert).serial_number

    async with running_agent(setup, host_name=machine, systemd=node):
        decision = await csr_approver.wait_for_decision(outcome="approved", timeout=30)
        assert decision.username.startswith("system:bootstrap:")
        await wait_for(
            lambda: kubeconfig_certificate(root).serial_number != old_serial,
            30,
            "a new certificate",
        )
        fresh = kubeconfig_certificate(root)
        assert fresh.not_valid_after_utc > dt.datetime.now(dt.UTC) + dt.timedelta(hours=24)
        # and it works: the agent finds its Node once it is registered
        await create_node(admin_api, machine)
        await wait_for(lambda: read_lease(admin_api, machine), 30, "the lease")


@pytest.fixture
def kcm_stopped(gardener_controlplane: ControlPlane) -> Iterator[ControlPlane]:
    """kube-controller-manager stopped for the test (a test-side signer takes its place) and
    started again after it."""
    gardener_controlplane.stop_controller_manager()
    try:
        yield gardener_controlplane
    finally:
        gardener_controlplane.start_controller_manager()


async def test_a_wrong_certificate_from_the_csr_is_never_written_and_a_new_csr_follows(
    kcm_stopped: ControlPlane,
    admin_api: ApiClient,
    csr_approver: CSRApprover,
    node: IsolatedSystemd,
) -> None:
    """The CSR comes back approved with a certificate for another machine, then for another
    key, then an expired one: each is refused (named with its CSR, in the log and in status),
    nothing is written, and a new CSR is asked after a backoff; the fourth, good one is used."""
    machine = unique("machine")
    root = node.root
    setup = await gardener_layout(root, kcm_stopped, admin_api, machine, f"osc-{machine}")
    sock = status_document.socket_path(root, setup.settings.status_socket)
    kubeconfig = host(root, KUBECONFIG_FILE)
    script: list[Kind] = ["other-machine", "other-key", "expired"]
    errors: list[str] = []
    async with (
        HostileSigner(admin_api, kcm_stopped, script) as signer,
        running_agent(setup, host_name=machine, systemd=node),
    ):
        started = asyncio.get_running_loop().time()
        for n in range(1, 4):
            await wait_for(lambda n=n: len(signer.issued) >= n, 60, f"hostile issue {n}")
            bad = signer.issued[n - 1]

            async def refused(bad: Issue = bad) -> bool:
                assert not kubeconfig.exists(), (
                    f"the {bad.kind} certificate of {bad.csr} was written as the kubeconfig"
                )
                doc = await asyncio.to_thread(status.query, sock)
                error = str((doc.get("certificate") or {}).get("last_error") or "")
                if bad.csr in error:
                    errors.append(error)
                    return True
                return False

            await wait_for(refused, 30, f"the {bad.kind} certificate refused")
        await wait_for(lambda: kubeconfig.exists(), 60, "the kubeconfig from the good certificate")
        took = asyncio.get_running_loop().time() - started
        good = signer.issued[3]
        assert good.kind == "good"
        assert kubeconfig_certificate(root).serial_number == good.serial
        assert len({i.csr for i in signer.issued}) == 4  # a new CSR (new key) each time
        doc = await asyncio.to_thread(status.query, sock)
        assert doc["certificate"]["phase"] == "valid"
        assert doc["certificate"]["last_error"] is None
    print(f"three wrong certificates refused, the fourth used after {took:.1f}s:")
    for line in errors:
        print("  ", line)
    assert "gardener.cloud:node-agent:machine:someone-else" in errors[0]
    assert "public key" in errors[1]
    assert "expired" in errors[2]
    assert signer.errors == []


@pytest.mark.filterwarnings("ignore:Attribute.s length")
async def test_a_machine_controller_manager_machine_name_gets_its_certificate(
    gardener_controlplane: ControlPlane,
    admin_api: ApiClient,
    csr_approver: CSRApprover,
    node: IsolatedSystemd,
) -> None:
    """machine-controller-manager names machines ``shoot--<project>--<shoot>-<pool>-z1-<hash>-
    <hash>``: the CN is then longer than X.509's 64 characters. kube-controller-manager (Go)
    signs it; the agent must ask for it, store it and work with it."""
    machine = f"shoot--testproj--{unique('shoot')}-worker-z1-7d9f8b6c5-q4x2z"
    cn = f"gardener.cloud:node-agent:machine:{machine}"
    assert len(cn) > 64
    root = node.root
    setup = await gardener_layout(root, gardener_controlplane, admin_api, machine, f"osc-{machine}")

    async with running_agent(setup, host_name=machine, systemd=node):
        decision = await csr_approver.wait_for_decision(outcome="approved", timeout=30)
        assert decision.common_name == cn
        await wait_for(lambda: host(root, KUBECONFIG_FILE).exists(), 30, "the kubeconfig")
        assert subject_of(kubeconfig_certificate(root)) == (cn, ["gardener.cloud:node-agents"])
        # and the agent works on it: the Node is found, the OSC applied, the Lease renewed
        await create_node(admin_api, machine)
        checksum = await publish_osc(
            admin_api,
            f"osc-{machine}",
            osc_document([], [service("long-name.service", command="start", enable=True)]),
        )
        await wait_applied(admin_api, machine, checksum, timeout=60)
        await wait_for(lambda: read_lease(admin_api, machine), 20, "the lease")
    assert csr_approver.errors == []
