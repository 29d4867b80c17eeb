"""The certificate controller's decisions: when to bootstrap, when to renew, when to fall back.

The Kubernetes side is a fake that signs every request at once with a throwaway CA (the real
flow against kube-controller-manager is in tests/integration/test_certificate_flow.py).
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import random
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from node_agent.base.errors import ConfigError
from node_agent.base.layout import BOOTSTRAP_TOKEN_FILE, KUBECONFIG_FILE
from node_agent.config import AgentSettings, NodeAgentConfiguration
from node_agent.controllers.certificate import CertificateController
from node_agent.host.fs import HostFS
from node_agent.kube import certificates
from tests.unit.fakes import FakeKube, issue_certificates, until

pytestmark = pytest.mark.usefixtures("virtual_clock")

CA_KEY = ec.generate_private_key(ec.SECP256R1())
CA_NAME = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ca")])


def sign(csr_pem: bytes, lifetime: dt.timedelta, *, start: dt.datetime | None = None) -> bytes:
    csr = x509.load_pem_x509_csr(csr_pem)
    now = start or dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(csr.subject)
        .issuer_name(CA_NAME)
        .public_key(csr.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + lifetime)
        .sign(CA_KEY, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def api() -> FakeKube:
    """An API server that approves and issues every CertificateSigningRequest at once."""
    return FakeKube(on_create=issue_certificates(lambda pem: sign(pem, dt.timedelta(hours=720))))


def requested(kube: FakeKube) -> list[str]:
    """Names of the CertificateSigningRequests created through ``kube``."""
    return [call[2] for call in kube.writes("CertificateSigningRequest.create")]


def controller(root: Path, token_client: FakeKube | None = None) -> CertificateController:
    config = NodeAgentConfiguration.model_validate({"apiServer": {"server": "https://api:443"}})
    clients = [token_client] if token_client is not None else []
    return CertificateController(
        AgentSettings(root=root),
        config,
        HostFS(root),
        client_for_token=lambda *_: clients.pop(),  # type: ignore[arg-type]
        rng=random.Random(7),
        poll=0.0,
        check_period=0.01,
    )


def node(root: Path, *, token: bool = True, machine: str = "m1") -> HostFS:
    fs = HostFS(root)
    fs.write_atomic("/var/lib/gardener-node-agent/machine-name", machine.encode(), 0o640)
    if token:
        fs.write_atomic(BOOTSTRAP_TOKEN_FILE, b"abcdef.0123456789abcdef", 0o640)
    return fs


def write_kubeconfig(fs: HostFS, lifetime: dt.timedelta, *, start: dt.datetime) -> None:
    req = certificates.make_request("m1")
    cert = sign(req.csr_pem, lifetime, start=start)
    fs.write_atomic(
        KUBECONFIG_FILE,
        certificates.kubeconfig(
            "https://api:443", "/ca", cert, req.key_pem, certificates.certificate_info(cert)
        ),
        0o600,
    )


def current_serial(root: Path) -> int:
    pem = certificates.kubeconfig_certificate((root / KUBECONFIG_FILE.lstrip("/")).read_bytes())
    assert pem is not None
    return x509.load_pem_x509_certificate(pem).serial_number


def test_nothing_to_authenticate_with_is_a_clear_error(tmp_path: Path) -> None:
    node(tmp_path, token=False)
    with pytest.raises(ConfigError, match=r"neither the kubeconfig .* nor the bootstrap token"):
        controller(tmp_path).needs_bootstrap()


async def test_bootstrap_writes_a_0600_kubeconfig_for_the_machine(tmp_path: Path) -> None:
    node(tmp_path)
    certs = controller(tmp_path)
    assert certs.needs_bootstrap()
    kube = api()
    await certs.bootstrap(kube)
    path = tmp_path / KUBECONFIG_FILE.lstrip("/")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert certs.view().phase == "valid"
    assert certs.view().subject == (
        "CN=gardener.cloud:node-agent:machine:m1,O=gardener.cloud:node-agents"
    )
    assert requested(kube)[0].startswith("node-agent-csr-")
    assert not controller(tmp_path).needs_bootstrap()


async def test_renewal_uses_the_current_identity_and_counts(tmp_path: Path) -> None:
    fs = node(tmp_path)
    start = dt.datetime.now(dt.UTC) - dt.timedelta(hours=700)
    write_kubeconfig(fs, dt.timedelta(hours=720), start=start)  # due: past 80-88 %
    certs = controller(tmp_path)
    assert not certs.needs_bootstrap()
    certs.settle()
    before = current_serial(tmp_path)
    kube = api()
    task = asyncio.create_task(certs.run(kube))
    await until(lambda: certs.rotations > 0)
    task.cancel()
    assert requested(kube)  # asked with the running client, not the token
    assert current_serial(tmp_path) != before
    assert certs.renew_at is not None
    assert certs.renew_at > dt.datetime.now(dt.UTC) + dt.timedelta(hours=500)


async def test_a_refused_certificate_falls_back_to_the_bootstrap_token(tmp_path: Path) -> None:
    fs = node(tmp_path)
    write_kubeconfig(fs, dt.timedelta(hours=720), start=dt.datetime.now(dt.UTC))
    token_client = api()
    certs = controller(tmp_path, token_client)
    certs.settle()
    running = api()
    running.stats.last_ok, running.stats.last_unauthorized = 1.0, 2.0  # the server says 401
    before = current_serial(tmp_path)
    task = asyncio.create_task(certs.run(running))
    await until(lambda: token_client.closed)
    await asyncio.sleep(0.05)
    assert not task.done()  # still watching, not crashed on a second fallback
    task.cancel()
    assert len(requested(token_client)) == 1  # once, not in a loop
    assert requested(running) == []
    assert not running.stats.rejected()
    assert current_serial(tmp_path) != before


async def test_without_a_token_a_refused_certificate_is_reported(tmp_path: Path) -> None:
    fs = node(tmp_path, token=False)
    write_kubeconfig(fs, dt.timedelta(hours=720), start=dt.datetime.now(dt.UTC))
    certs = controller(tmp_path)
    certs.settle()
    running = api()
    running.stats.last_unauthorized = 1.0
    task = asyncio.create_task(certs.run(running))
    await asyncio.sleep(0.05)
    task.cancel()
    assert certs.view().phase.startswith("refused by the server")
    assert requested(running) == []


async def test_an_answer_that_is_no_certificate_is_retried_with_a_new_request(
    tmp_path: Path,
) -> None:
    """Upstream's API server checks the PEM, but the agent must not trust that: an answer that
    is no certificate (or not base64) ends that request, nothing is written, and a new request
    (a new key, a new name) follows after a backoff."""
    node(tmp_path)
    certs = controller(tmp_path)
    answers = [b"not base64 at all!", b"-----BEGIN CERTIFICATE-----\nAAAA\n"]
    refused: list[str] = []

    async def on_refused(message: str) -> None:
        refused.append(message)

    certs.on_refused = on_refused

    def on_create(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        name = obj["metadata"]["name"]
        if answers:
            raw = answers.pop(0)
            cert = raw.decode() if b"!" in raw else base64.b64encode(raw).decode()
        else:
            pem = sign(base64.b64decode(obj["spec"]["request"]), dt.timedelta(hours=720))
            cert = base64.b64encode(pem).decode()
        status = {"conditions": [{"type": "Approved"}], "certificate": cert}
        return {**obj, "metadata": {**obj["metadata"], "uid": name}, "status": status}

    kube = FakeKube(on_create=on_create)
    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    async def no_sleep(delay: float) -> None:
        sleeps.append(delay)
        await real_sleep(0)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(asyncio, "sleep", no_sleep)
        await certs.bootstrap(kube)
    names = requested(kube)
    assert len(set(names)) == 3, names
    assert [m.split(" returned")[0] for m in refused] == [
        f"CertificateSigningRequest {n}" for n in names[:2]
    ]
    assert all("no PEM certificate" in m for m in refused), refused
    assert len([s for s in sleeps if s >= 1.0]) == 2  # a backoff after each refusal
    assert certs.view().phase == "valid"
    assert certs.last_error is None
