"""A signer that issues wrong certificates, for the agent's checks of what the CSR returns.

kube-controller-manager is the signer of ``kubernetes.io/kube-apiserver-client`` on the test bed;
while it is stopped, this one takes its place: for every approved node-agent CSR without a
certificate it writes the next certificate of its ``script`` into ``status.certificate`` through
the ``certificatesigningrequests/status`` subresource, signed by the cluster CA as the real
signer would, but wrong in the way the script says:

- ``other-machine``: the common name of another machine;
- ``other-key``: the right subject for a public key that is not the request's;
- ``expired``: valid until an hour ago;
- ``good``: what kube-controller-manager would issue.

Every issue is recorded (CSR name, kind, serial) for assertions. After the script the signer
issues ``good`` certificates.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
from dataclasses import dataclass
from typing import Literal

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from tests.testbed.bootstrap import NODE_AGENT_USER_PREFIX
from tests.testbed.controlplane import ControlPlane

Kind = Literal["other-machine", "other-key", "expired", "good"]


@dataclass(frozen=True)
class Issue:
    csr: str
    kind: Kind
    serial: int


class HostileSigner:
    """``async with HostileSigner(admin, control_plane, ["other-key", ...]) as signer:``"""

    def __init__(self, admin: ApiClient, control_plane: ControlPlane, script: list[Kind]) -> None:
        self._certs = client.CertificatesV1Api(admin)
        self._script = list(script)
        self._ca = x509.load_pem_x509_certificate(control_plane.ca_file.read_bytes())
        self._ca_key = serialization.load_pem_private_key(
            control_plane.ca.key_path.read_bytes(), None
        )
        self.issued: list[Issue] = []
        self.errors: list[Exception] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> HostileSigner:
        self._task = asyncio.create_task(self._run(), name="hostile-signer")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        while True:
            try:
                for csr in (await self._certs.list_certificate_signing_request()).items:
                    await self._consider(csr)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # kept for asserts; the signer goes on
                self.errors.append(exc)
            await asyncio.sleep(0.2)

    async def _consider(self, csr: client.V1CertificateSigningRequest) -> None:
        status = csr.status
        if status is None or status.certificate:
            return
        if not any(c.type == "Approved" for c in status.conditions or []):
            return
        request = x509.load_pem_x509_csr(base64.b64decode(csr.spec.request))
        cns = request.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if not cns or not str(cns[0].value).startswith(NODE_AGENT_USER_PREFIX):
            return
        kind: Kind = self._script.pop(0) if self._script else "good"
        cert = self._certificate(request, kind)
        status.certificate = base64.b64encode(
            cert.public_bytes(serialization.Encoding.PEM)
        ).decode()
        await self._certs.replace_certificate_signing_request_status(csr.metadata.name, csr)
        self.issued.append(Issue(csr.metadata.name, kind, cert.serial_number))

    def _certificate(self, request: x509.CertificateSigningRequest, kind: Kind) -> x509.Certificate:
        now = dt.datetime.now(dt.UTC)
        subject = request.subject
        public_key = request.public_key()
        not_before, not_after = now - dt.timedelta(minutes=5), now + dt.timedelta(hours=720)
        if kind == "other-machine":
            subject = x509.Name(
                [
                    *subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME),
                    x509.NameAttribute(
                        NameOID.COMMON_NAME, NODE_AGENT_USER_PREFIX + "someone-else"
                    ),
                ]
            )
        elif kind == "other-key":
            public_key = ec.generate_private_key(ec.SECP256R1()).public_key()
        elif kind == "expired":
            not_before, not_after = now - dt.timedelta(hours=3), now - dt.timedelta(hours=1)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._ca.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(self._ca_key, hashes.SHA256())  # type: ignore[arg-type]
        )
