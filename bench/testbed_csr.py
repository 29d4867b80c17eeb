"""Start-up of the certificate-flow test bed and the latency of one CSR round trip.

Boots etcd + kube-apiserver, then kube-controller-manager (csrsigning, tokencleaner,
csrcleaner), starts the Gardener-like approver and, with a bootstrap token, creates node-agent
CSRs and waits for each certificate. Prints the start times, the round trip (create ->
approved -> issued) percentiles, and how long a kube-controller-manager restart takes (what a
test that shortens the certificate duration pays). Run from the repository root:

    .venv/bin/python -m bench.testbed_csr [--csrs 20]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import shutil
import time
import uuid
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client import ApiClient

from tests.testbed.bootstrap import (
    NODE_AGENTS_GROUP,
    allow_bootstrappers,
    create_bootstrap_token,
    node_agent_user,
    token_kubeconfig,
)
from tests.testbed.controlplane import ControlPlane
from tests.testbed.csr_approver import CSRApprover


async def _client(kubeconfig: Path) -> ApiClient:
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    return ApiClient(configuration=configuration)


def _request(machine: str) -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, node_agent_user(machine)),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, NODE_AGENTS_GROUP),
        ]
    )
    csr = x509.CertificateSigningRequestBuilder().subject_name(name).sign(key, hashes.SHA256())
    return base64.b64encode(csr.public_bytes(serialization.Encoding.PEM)).decode()


async def _round_trip(api: ApiClient, admin: ApiClient) -> float:
    name = f"node-agent-csr-{uuid.uuid4().hex[:10]}"
    started = time.monotonic()
    await client.CertificatesV1Api(api).create_certificate_signing_request(
        client.V1CertificateSigningRequest(
            metadata=client.V1ObjectMeta(name=name),
            spec=client.V1CertificateSigningRequestSpec(
                request=_request(uuid.uuid4().hex[:8]),
                signer_name="kubernetes.io/kube-apiserver-client",
                usages=["digital signature", "key encipherment", "client auth"],
                expiration_seconds=720 * 3600,
            ),
        )
    )
    certs = client.CertificatesV1Api(admin)
    while True:
        csr = await certs.read_certificate_signing_request(name)
        if csr.status is not None and csr.status.certificate:
            return time.monotonic() - started
        await asyncio.sleep(0.02)


async def _measure(cp: ControlPlane, workdir: Path, count: int) -> list[float]:
    admin = await _client(cp.admin_kubeconfig)
    async with admin:
        await allow_bootstrappers(admin)
        token = await create_bootstrap_token(admin)
        kubeconfig = token_kubeconfig(
            workdir / "bootstrap.kubeconfig",
            server=cp.server,
            ca_file=cp.ca_file,
            token=token.token,
        )
        api = await _client(kubeconfig)
        async with api, CSRApprover(admin):
            return [await _round_trip(api, admin) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--csrs", type=int, default=20)
    args = parser.parse_args()
    cache = Path(
        os.environ.get("NODE_AGENT_TEST_CACHE", Path.home() / ".cache" / "node-agent-test")
    )
    workdir = cache / "bench" / f"testbed-csr-{uuid.uuid4().hex[:8]}"
    try:
        started = time.monotonic()
        cp = ControlPlane(workdir)
        with cp:
            apiserver = time.monotonic() - started
            started = time.monotonic()
            cp.start_controller_manager()
            kcm = time.monotonic() - started
            started = time.monotonic()
            cp.restart_controller_manager(signing_duration="90s")
            restart = time.monotonic() - started
            trips = sorted(asyncio.run(_measure(cp, workdir, args.csrs)))
        print(f"etcd + kube-apiserver ready:      {apiserver:6.2f} s")
        print(f"kube-controller-manager healthy:  {kcm:6.2f} s")
        print(f"kube-controller-manager restart:  {restart:6.2f} s")
        print(
            f"CSR create -> issued ({len(trips)}x):    "
            f"p50 {trips[len(trips) // 2] * 1000:5.0f} ms  "
            f"p90 {trips[int(len(trips) * 0.9)] * 1000:5.0f} ms  "
            f"max {trips[-1] * 1000:5.0f} ms  min {trips[0] * 1000:5.0f} ms"
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
