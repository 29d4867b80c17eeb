"""The agent's client certificate: Gardener's certificate flow, in pieces that can be tested alone.

A node that Gardener provisions has no kubeconfig for the agent, only a short-lived bootstrap
token. The agent makes an ECDSA P-256 key and a CertificateSigningRequest for the identity
Gardener's approver accepts (CN ``gardener.cloud:node-agent:machine:<machine>``, O
``gardener.cloud:node-agents``, signer ``kubernetes.io/kube-apiserver-client``), waits for the
approval and the certificate, and writes a kubeconfig that holds both. The same request, sent with
the current certificate instead of the token, renews it before it expires.

``cryptography`` is imported only here and only when a key, a request or a certificate is
handled: it costs memory the idle agent should not pay.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import yaml

from node_agent.base.errors import CertificateError, KubeAlreadyExists

if TYPE_CHECKING:
    from node_agent.kube.seam import KubeSeam

USER_PREFIX = "gardener.cloud:node-agent:machine:"
GROUP = "gardener.cloud:node-agents"
SIGNER = "kubernetes.io/kube-apiserver-client"
# In the order upstream sends them (they are part of the request's name digest).
USAGES = ("digital signature", "key encipherment", "client auth")
CSR_PREFIX = "node-agent-csr-"
REQUESTED_LIFETIME = timedelta(hours=720)
#: How long one request may wait for approval and issuance before it is given up (upstream: 15 m).
APPROVAL_TIMEOUT = 15 * 60.0
#: Renewal at this share of the lifetime, plus up to ``RENEWAL_JITTER`` of that (upstream's rule).
RENEWAL_SHARE = 0.8
RENEWAL_JITTER = 0.1
#: The kubeconfig's names for cluster, user and context (upstream's).
KUBECONFIG_NAME = "node-agent"


@dataclass(frozen=True)
class CertificateRequest:
    """A new private key and the PEM request for it, with the object name to create it under."""

    name: str
    common_name: str
    key_pem: bytes
    csr_pem: bytes
    #: the key's public half (DER SubjectPublicKeyInfo): the certificate must carry this one
    public_key_der: bytes = b""


def common_name(machine_name: str) -> str:
    return USER_PREFIX + machine_name


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def request_name(public_key_der: bytes, cn: str, organizations: tuple[str, ...]) -> str:
    """Upstream's deterministic name: a digest over the public key, subject and usages, so that
    the same key asks under the same name again (a retry finds its own request)."""
    digest = hashlib.new("sha512_256")
    for part in (public_key_der, cn.encode(), *(o.encode() for o in organizations)):
        digest.update(_b64url(part).encode() + b"|")
    for usage in USAGES:
        digest.update(_b64url(usage.encode()).encode() + b"|")
    return CSR_PREFIX + _b64url(digest.digest())


@contextmanager
def _long_names_allowed() -> Iterator[None]:
    """Silence cryptography's warning about a name attribute longer than X.509's upper bound:
    the agent's CN is that long on every machine-controller-manager machine (see make_request)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Attribute's length", category=UserWarning)
        yield


def make_request(machine_name: str) -> CertificateRequest:
    """A fresh ECDSA P-256 key and a CSR for the agent's identity on ``machine_name``."""
    if not machine_name or any(c.isspace() for c in machine_name) or "/" in machine_name:
        raise CertificateError(f"machine name {machine_name!r} cannot name a certificate")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    cn = common_name(machine_name)
    with _long_names_allowed():
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, GROUP),
                # Machine names from machine-controller-manager make this CN longer than X.509's
                # 64-character upper bound; Go (upstream, kube-apiserver, kube-controller-manager)
                # does not enforce it, so the request must not either.
                x509.NameAttribute(NameOID.COMMON_NAME, cn, _validate=False),
            ]
        )
    csr = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, hashes.SHA256())
    public_der = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,  # "EC PRIVATE KEY", as upstream writes
        serialization.NoEncryption(),
    )
    return CertificateRequest(
        name=request_name(public_der, cn, (GROUP,)),
        common_name=cn,
        key_pem=key_pem,
        csr_pem=csr.public_bytes(serialization.Encoding.PEM),
        public_key_der=public_der,
    )


@dataclass(frozen=True)
class CertificateInfo:
    """What the agent needs to know of its certificate: who it is and when it is valid."""

    subject: str
    not_before: datetime
    not_after: datetime

    @property
    def lifetime(self) -> timedelta:
        return self.not_after - self.not_before

    def expired(self, now: datetime | None = None) -> bool:
        return (now or datetime.now(UTC)) >= self.not_after

    def renew_at(self, jitter: float, *, received: datetime | None = None) -> datetime:
        """80 % into the validity, plus ``jitter`` (0..1) times 10 % of that (upstream's rule).

        Counted from ``not_before``, or from ``received`` when the certificate was just issued:
        kube-controller-manager backdates every certificate by 5 minutes, so for a short-lived
        one 80 % from ``not_before`` can lie in the past at once, and upstream's rule would
        renew it again and again. For the usual 720 h the two differ by seconds."""
        start = max(self.not_before, received) if received is not None else self.not_before
        base = (self.not_after - start) * RENEWAL_SHARE
        return start + base + base * (RENEWAL_JITTER * min(max(jitter, 0.0), 1.0))


def certificate_info(cert_pem: bytes) -> CertificateInfo:
    """The subject and validity of the first certificate in ``cert_pem``."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificates(cert_pem)[0]
    except (ValueError, IndexError) as exc:
        raise CertificateError(f"not a PEM certificate: {exc}") from exc
    with _long_names_allowed():
        subject = cert.subject.rfc4514_string()
    return CertificateInfo(
        subject=subject,
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
    )


#: How far the signer's clock may be ahead of ours: a certificate valid from later than this is
#: refused as not yet valid (kube-controller-manager backdates its certificates by 5 minutes).
CLOCK_SKEW = timedelta(minutes=5)


def verify_issued(
    request: CertificateRequest, cert_pem: bytes, now: datetime | None = None
) -> CertificateInfo:
    """The certificate a CSR came back with, checked before anything is written: one PEM
    certificate that carries our public key, names exactly the subject we asked for, is valid
    now (within :data:`CLOCK_SKEW`) and may authenticate a client. Raises
    :class:`CertificateError` naming the CSR and what is wrong: a signer that answers with
    another machine's, another key's or an expired certificate must not become our identity."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    where = f"CertificateSigningRequest {request.name}"
    try:
        cert = x509.load_pem_x509_certificates(cert_pem)[0]
    except (ValueError, IndexError) as exc:
        raise CertificateError(f"{where} returned no PEM certificate: {exc}") from exc
    public = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    if request.public_key_der and public != request.public_key_der:
        raise CertificateError(f"{where} returned a certificate for another public key")
    with _long_names_allowed():  # every attribute of the subject is read (and checked) here
        cns = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
        orgs = [
            str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
        ]
        subject = cert.subject.rfc4514_string()
    if cns != [request.common_name]:
        raise CertificateError(
            f"{where} returned a certificate for common name {', '.join(cns) or '(none)'}, "
            f"not {request.common_name}"
        )
    if orgs != [GROUP]:
        raise CertificateError(
            f"{where} returned a certificate for organization {orgs}, not [{GROUP!r}]"
        )
    now = now or datetime.now(UTC)
    info = CertificateInfo(
        subject=subject,
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
    )
    if info.expired(now):
        raise CertificateError(
            f"{where} returned a certificate that expired at {info.not_after.isoformat()}"
        )
    if info.not_before > now + CLOCK_SKEW:
        raise CertificateError(
            f"{where} returned a certificate not valid before {info.not_before.isoformat()}"
        )
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        usages = None  # no restriction: any usage (RFC 5280)
    allowed = {ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE}
    if usages is not None and not allowed & set(usages):
        raise CertificateError(f"{where} returned a certificate not valid for client auth")
    try:
        key_usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        key_usage = None
    if key_usage is not None and not key_usage.digital_signature:
        raise CertificateError(f"{where} returned a certificate without digital signature use")
    return info


#: The kubeconfig extension that carries the certificate's subject and validity, so that reading
#: them at every start needs no X.509 parser (``cryptography`` costs ~15 MiB and ~75 ms to load).
INFO_EXTENSION = "node-agent.gardener.cloud/certificate"


def cluster_ca(ca_file: str, ca_data: bytes | None) -> dict[str, str]:
    """A kubeconfig cluster's CA as the config's release gives it: ``ca_data`` is the bundle of
    a release up to v1.146 (``apiServer.caBundle``), written inline (b"": none, the system's
    roots are trusted); None: a later release's ``ca_file``, by path."""
    if ca_data is None:
        return {"certificate-authority": ca_file}
    return {"certificate-authority-data": base64.b64encode(ca_data).decode()} if ca_data else {}


def kubeconfig(
    server: str,
    ca_file: str,
    cert_pem: bytes,
    key_pem: bytes,
    info: CertificateInfo,
    *,
    ca_data: bytes | None = None,
) -> bytes:
    """The agent's kubeconfig: the cluster CA by path (so a CA rotation through the OSC is
    followed) or, for a release that gives the bundle itself, inline (:func:`cluster_ca`), the
    client certificate and key inline (one file, swapped atomically), and ``info`` about the
    certificate as an extension, tied to it by its sha256."""
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": KUBECONFIG_NAME,
                "cluster": {"server": server, **cluster_ca(ca_file, ca_data)},
            }
        ],
        "users": [
            {
                "name": KUBECONFIG_NAME,
                "user": {
                    "client-certificate-data": base64.b64encode(cert_pem).decode(),
                    "client-key-data": base64.b64encode(key_pem).decode(),
                },
            }
        ],
        "contexts": [
            {
                "name": KUBECONFIG_NAME,
                "context": {"cluster": KUBECONFIG_NAME, "user": KUBECONFIG_NAME},
            }
        ],
        "current-context": KUBECONFIG_NAME,
        "extensions": [
            {
                "name": INFO_EXTENSION,
                "extension": {
                    "certificateSHA256": hashlib.sha256(cert_pem).hexdigest(),
                    "subject": info.subject,
                    "notBefore": info.not_before.isoformat(),
                    "notAfter": info.not_after.isoformat(),
                },
            }
        ],
    }
    return yaml.safe_dump(doc, sort_keys=False).encode()


def _current_user(doc: dict[str, Any]) -> dict[str, Any] | None:
    contexts = {c.get("name"): c.get("context") or {} for c in doc.get("contexts") or []}
    wanted = (contexts.get(doc.get("current-context")) or {}).get("user")
    for entry in doc.get("users") or []:
        if wanted is None or entry.get("name") == wanted:
            return dict(entry.get("user") or {})
    return None


def kubeconfig_certificate(raw: bytes) -> bytes | None:
    """The inline client certificate of a kubeconfig written by :func:`kubeconfig` (None when
    it has none, e.g. a token kubeconfig of a standalone install)."""
    try:
        user = _current_user(yaml.safe_load(raw))
        data = (user or {}).get("client-certificate-data")
        return base64.b64decode(data, validate=True) if data else None
    except (yaml.YAMLError, AttributeError, TypeError, ValueError):
        return None


def kubeconfig_certificate_info(raw: bytes) -> CertificateInfo | None:
    """Subject and validity of the kubeconfig's inline certificate: from its extension when that
    matches the certificate byte for byte, else parsed from the certificate (a kubeconfig not
    written by this agent). None without an inline certificate."""
    cert = kubeconfig_certificate(raw)
    if cert is None:
        return None
    try:
        doc = yaml.safe_load(raw)
        for ext in doc.get("extensions") or []:
            if ext.get("name") != INFO_EXTENSION:
                continue
            meta = ext.get("extension") or {}
            if meta.get("certificateSHA256") == hashlib.sha256(cert).hexdigest():
                return CertificateInfo(
                    subject=str(meta["subject"]),
                    not_before=datetime.fromisoformat(meta["notBefore"]),
                    not_after=datetime.fromisoformat(meta["notAfter"]),
                )
    except (yaml.YAMLError, AttributeError, TypeError, ValueError, KeyError):
        pass
    return certificate_info(cert)


def csr_object(request: CertificateRequest) -> dict[str, Any]:
    return {
        "apiVersion": "certificates.k8s.io/v1",
        "kind": "CertificateSigningRequest",
        "metadata": {"name": request.name},
        "spec": {
            "request": base64.b64encode(request.csr_pem).decode(),
            "signerName": SIGNER,
            "usages": list(USAGES),
            "expirationSeconds": int(REQUESTED_LIFETIME.total_seconds()),
        },
    }


@dataclass(frozen=True)
class Issued:
    """A certificate handed out for a request."""

    name: str
    cert_pem: bytes
    waited: float
    #: what :func:`verify_issued` read of it
    info: CertificateInfo


def _verdict(obj: dict[str, Any]) -> tuple[str | None, str]:
    """('Denied' | 'Failed' | 'Approved' | None, message) from a CSR's status conditions."""
    state: str | None = None
    message = ""
    for cond in (obj.get("status") or {}).get("conditions") or []:
        kind = cond.get("type")
        if kind in ("Denied", "Failed"):
            reason = cond.get("reason") or ""
            return kind, f"{reason}: {cond.get('message') or ''}".strip(": ")
        if kind == "Approved":
            state = "Approved"
    return state, message


async def request_certificate(
    kube: KubeSeam,
    request: CertificateRequest,
    *,
    give_up_after: float = APPROVAL_TIMEOUT,
    poll: float = 2.0,
    on_wait: Callable[[str], None] | None = None,
) -> Issued:
    """Create the CSR (or find our own under its name) and wait until it carries a certificate.

    Raises :class:`CertificateError` when it is denied, fails, is replaced by another object
    of the same name, is not issued within ``give_up_after`` seconds, or its certificate does
    not pass :func:`verify_issued` (then a new request is due: this one's answer is final); API
    errors propagate
    (the caller retries with backoff). ``on_wait`` gets a line of progress on every poll.
    """
    csrs = kube.certificate_signing_requests()
    started = time.monotonic()
    try:
        created = await csrs.create(csr_object(request))
    except KubeAlreadyExists:
        created = await csrs.get(request.name)
    uid = (created.get("metadata") or {}).get("uid")
    while True:
        obj = await csrs.get(request.name)
        if (obj.get("metadata") or {}).get("uid") != uid:
            raise CertificateError(f"CertificateSigningRequest {request.name} was replaced")
        verdict, message = _verdict(obj)
        if verdict in ("Denied", "Failed"):
            raise CertificateError(
                f"CertificateSigningRequest {request.name} {verdict.lower()}: {message}"
            )
        cert = (obj.get("status") or {}).get("certificate")
        if verdict == "Approved" and cert:
            try:
                pem = base64.b64decode(cert, validate=True)
            except (ValueError, TypeError) as exc:
                raise CertificateError(
                    f"CertificateSigningRequest {request.name} returned no PEM certificate: {exc}"
                ) from exc
            info = verify_issued(request, pem)
            return Issued(request.name, pem, time.monotonic() - started, info)
        line = (
            f"CertificateSigningRequest {request.name} approved, waiting to be issued"
            if verdict == "Approved"
            else f"waiting for approval of CertificateSigningRequest {request.name}"
        )
        if on_wait is not None:
            on_wait(line)  # on every poll: the daemon keeps systemd's timeouts at bay with it
        if time.monotonic() - started > give_up_after:
            raise CertificateError(
                f"CertificateSigningRequest {request.name} not issued within {give_up_after:.0f}s"
                f" ({line})"
            )
        await asyncio.sleep(poll)
