"""The pure pieces of the certificate flow: key and request, name, validity, kubeconfig."""

from __future__ import annotations

import base64
import hashlib
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from node_agent.base.errors import CertificateError
from node_agent.kube import certificates
from node_agent.kube.client import parse_kubeconfig


def _issue(csr_pem: bytes, *, not_before: datetime, lifetime: timedelta) -> bytes:
    """Sign a request with a throwaway CA, as kube-controller-manager would."""
    csr = x509.load_pem_x509_csr(csr_pem)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test-ca")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(csr.subject)
        .issuer_name(ca_name)
        .public_key(csr.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_before + lifetime)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def test_request_names_the_machine_and_group_with_a_p256_key() -> None:
    req = certificates.make_request("shoot--dev--pool-a-7f9c4-xk2lp")
    csr = x509.load_pem_x509_csr(req.csr_pem)
    assert csr.is_signature_valid
    cn = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    org = [a.value for a in csr.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    assert cn == "gardener.cloud:node-agent:machine:shoot--dev--pool-a-7f9c4-xk2lp"
    assert org == ["gardener.cloud:node-agents"]
    key = serialization.load_pem_private_key(req.key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert key.curve.name == "secp256r1"
    assert req.key_pem.startswith(b"-----BEGIN EC PRIVATE KEY-----")
    assert csr.public_key() == key.public_key()
    assert req.name.startswith("node-agent-csr-")


@pytest.mark.filterwarnings("ignore:Attribute.s length")
def test_request_for_a_machine_controller_manager_length_name_keeps_the_whole_name() -> None:
    """machine-controller-manager names machines
    ``shoot--<project>--<shoot>-<pool>-z<n>-<hash>-<hash>``; the CN then exceeds X.509's
    64-character upper bound, which Go (upstream, the API server and kube-controller-manager)
    does not enforce, so neither may we."""
    machine = "shoot--testproj--testshoot-worker-z1-7d9f8b6c5-q4x2z"
    req = certificates.make_request(machine)
    csr = x509.load_pem_x509_csr(req.csr_pem)
    assert csr.is_signature_valid
    cn = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    assert cn == req.common_name == f"gardener.cloud:node-agent:machine:{machine}"
    assert len(cn) > 64


def test_request_name_is_upstreams_digest() -> None:
    """sha512/256 over base64url(part) + '|' for the key, CN, O and usages; base64url, no pad."""
    public = b"\x30\x59 not really a key"
    cn = "gardener.cloud:node-agent:machine:m1"

    def enc(data: bytes) -> bytes:
        return base64.urlsafe_b64encode(data).rstrip(b"=")

    parts = [public, cn.encode(), b"gardener.cloud:node-agents"]
    parts += [b"digital signature", b"key encipherment", b"client auth"]
    digest = hashlib.new("sha512_256", b"".join(enc(p) + b"|" for p in parts)).digest()
    expected = "node-agent-csr-" + enc(digest).decode()
    # The same inputs through Go's crypto/sha512 + base64.RawURLEncoding, as upstream does it:
    assert expected == "node-agent-csr-tMdgizwUn6-dBByEkXBKKmTsh2DIcpl1DKy--B0NrjU"
    assert certificates.request_name(public, cn, ("gardener.cloud:node-agents",)) == expected
    # a different key gives a different name; the same inputs the same one
    assert certificates.request_name(public + b"x", cn, ("gardener.cloud:node-agents",)) != expected


def test_two_requests_use_two_keys() -> None:
    a, b = certificates.make_request("m1"), certificates.make_request("m1")
    assert a.key_pem != b.key_pem
    assert a.name != b.name


@pytest.mark.parametrize("bad", ["", "a b", "a/b", "x\n"])
def test_request_refuses_a_machine_name_that_cannot_be_a_name(bad: str) -> None:
    with pytest.raises(CertificateError, match="machine name"):
        certificates.make_request(bad)


def test_csr_object_asks_for_720h_client_auth_from_the_apiserver_client_signer() -> None:
    req = certificates.make_request("m1")
    obj = certificates.csr_object(req)
    assert obj["metadata"] == {"name": req.name}
    assert obj["spec"]["signerName"] == "kubernetes.io/kube-apiserver-client"
    assert obj["spec"]["usages"] == ["digital signature", "key encipherment", "client auth"]
    assert obj["spec"]["expirationSeconds"] == 720 * 3600
    assert base64.b64decode(obj["spec"]["request"]) == req.csr_pem


def test_renewal_falls_between_80_and_88_percent_of_the_lifetime() -> None:
    start = datetime(2026, 1, 1, tzinfo=UTC)
    info = certificates.CertificateInfo("CN=x", start, start + timedelta(hours=100))
    assert info.renew_at(0.0) == start + timedelta(hours=80)
    assert info.renew_at(1.0) == start + timedelta(hours=88)
    assert info.renew_at(0.5) == start + timedelta(hours=84)
    assert info.renew_at(7.0) == start + timedelta(hours=88)  # clamped
    # just issued by kube-controller-manager (backdated 5 min): counted from receipt
    short = certificates.CertificateInfo("CN=x", start, start + timedelta(minutes=7))
    received = start + timedelta(minutes=5)
    assert short.renew_at(0.0) == start + timedelta(seconds=336)  # in the past at receipt
    assert short.renew_at(0.0, received=received) == received + timedelta(seconds=96)
    assert short.renew_at(1.0, received=received) < short.not_after
    assert not info.expired(start + timedelta(hours=99))
    assert info.expired(start + timedelta(hours=100))


def test_kubeconfig_round_trip(tmp_path: Path) -> None:
    req = certificates.make_request("m1")
    now = datetime.now(UTC).replace(microsecond=0)
    cert = _issue(req.csr_pem, not_before=now, lifetime=timedelta(hours=720))
    info = certificates.certificate_info(cert)
    raw = certificates.kubeconfig("https://api.example:443", "/etc/ca.crt", cert, req.key_pem, info)
    path = tmp_path / "kubeconfig"
    path.write_bytes(raw)
    settings = parse_kubeconfig(path)
    assert settings.server == "https://api.example:443"
    assert settings.ca_file == Path("/etc/ca.crt")
    assert settings.client_cert_data == cert
    assert settings.client_key_data == req.key_pem
    assert certificates.kubeconfig_certificate(raw) == cert
    assert certificates.kubeconfig_certificate_info(raw) == info  # from the extension
    assert info.subject == "CN=gardener.cloud:node-agent:machine:m1,O=gardener.cloud:node-agents"
    assert info.not_before == now
    assert info.lifetime == timedelta(hours=720)


def test_a_token_kubeconfig_has_no_certificate() -> None:
    raw = (
        b"apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        b"contexts: [{name: c, context: {cluster: c, user: u}}]\n"
        b"clusters: [{name: c, cluster: {server: 'https://x'}}]\n"
        b"users: [{name: u, user: {tokenFile: /var/lib/token}}]\n"
    )
    assert certificates.kubeconfig_certificate(raw) is None
    assert certificates.kubeconfig_certificate(b"{not yaml") is None
    with pytest.raises(CertificateError, match="not a PEM certificate"):
        certificates.certificate_info(b"garbage")


def test_certificate_info_comes_from_the_extension_without_cryptography(tmp_path: Path) -> None:
    """Reading the validity at every start must not load cryptography (memory, start-up)."""
    req = certificates.make_request("m1")
    now = datetime.now(UTC).replace(microsecond=0)
    cert = _issue(req.csr_pem, not_before=now, lifetime=timedelta(hours=720))
    info = certificates.certificate_info(cert)
    path = tmp_path / "kubeconfig"
    path.write_bytes(certificates.kubeconfig("https://x", "/ca", cert, req.key_pem, info))
    probe = (
        "import sys; from pathlib import Path; from node_agent.kube import certificates as c; "
        f"i = c.kubeconfig_certificate_info(Path({str(path)!r}).read_bytes()); "
        "print(i.not_after.isoformat(), any(m.startswith('cryptography') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [info.not_after.isoformat(), "False"]


def test_an_extension_that_does_not_match_the_certificate_is_not_trusted() -> None:
    req = certificates.make_request("m1")
    now = datetime.now(UTC).replace(microsecond=0)
    cert = _issue(req.csr_pem, not_before=now, lifetime=timedelta(hours=720))
    lie = certificates.CertificateInfo("CN=x", now, now + timedelta(days=3650))
    raw = certificates.kubeconfig("https://x", "/ca", cert, req.key_pem, lie)
    other = _issue(req.csr_pem, not_before=now, lifetime=timedelta(hours=1))
    swapped = raw.replace(
        base64.b64encode(cert), base64.b64encode(other)
    )  # the certificate replaced by hand, the extension left
    info = certificates.kubeconfig_certificate_info(swapped)
    assert info is not None
    assert info.lifetime == timedelta(hours=1)


def _issue_with(
    req: certificates.CertificateRequest,
    *,
    subject: x509.Name | None = None,
    usages: list[x509.ObjectIdentifier] | None = None,
    not_before: datetime | None = None,
) -> bytes:
    csr = x509.load_pem_x509_csr(req.csr_pem)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or datetime.now(UTC) - timedelta(minutes=5)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject or csr.subject)
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test-ca")]))
        .public_key(csr.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + timedelta(hours=720))
    )
    if usages is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def test_an_issued_certificate_as_asked_passes_the_checks() -> None:
    req = certificates.make_request("m1")
    info = certificates.verify_issued(req, _issue_with(req, usages=None))  # no EKU: any use
    assert info.subject == "CN=gardener.cloud:node-agent:machine:m1,O=gardener.cloud:node-agents"
    client_auth = [ExtendedKeyUsageOID.CLIENT_AUTH]
    certificates.verify_issued(req, _issue_with(req, usages=client_auth))


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("not PEM", "returned no PEM certificate"),
        ("another organization", "for organization ['system:masters']"),
        ("no common name", "for common name (none)"),
        ("valid from tomorrow", "not valid before"),
        ("server auth only", "not valid for client auth"),
        ("another key", "for another public key"),
    ],
)
def test_a_certificate_not_as_asked_is_refused_naming_the_request(case: str, expected: str) -> None:
    req = certificates.make_request("m1")
    cn = x509.NameAttribute(NameOID.COMMON_NAME, req.common_name)
    makers: dict[str, Callable[[], bytes]] = {
        "not PEM": lambda: b"<html>not a certificate</html>",
        "another organization": lambda: _issue_with(
            req,
            subject=x509.Name(
                [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:masters"), cn]
            ),
        ),
        "no common name": lambda: _issue_with(
            req,
            subject=x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, certificates.GROUP)]),
        ),
        "valid from tomorrow": lambda: _issue_with(
            req, not_before=datetime.now(UTC) + timedelta(days=1)
        ),
        "server auth only": lambda: _issue_with(req, usages=[ExtendedKeyUsageOID.SERVER_AUTH]),
        "another key": lambda: _issue_with(certificates.make_request("m1")),
    }
    pem = makers[case]()
    with pytest.raises(CertificateError, match=re.escape(expected)) as raised:
        certificates.verify_issued(req, pem)
    assert f"CertificateSigningRequest {req.name}" in str(raised.value)


@pytest.mark.filterwarnings("error")
def test_a_machine_controller_manager_length_certificate_is_checked_without_a_warning() -> None:
    """Python's warnings go to stderr as plain text, into a journal that is otherwise JSON:
    reading a CN over 64 characters (every MCM machine) must not warn, from the request to
    the checks of the certificate it comes back with."""
    req = certificates.make_request("shoot--testproj--testshoot-worker-z1-7d9f8b6c5-q4x2z")
    with warnings.catch_warnings():  # the signer's side (the test's) may warn
        warnings.simplefilter("ignore")
        pem = _issue_with(req, usages=[ExtendedKeyUsageOID.CLIENT_AUTH])
    info = certificates.verify_issued(req, pem)
    assert info.subject.startswith(f"CN={req.common_name},")
    assert certificates.certificate_info(pem).subject == info.subject
