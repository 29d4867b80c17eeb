"""The bed a machine bench boots: what Gardener's certificate flow and images need.

kube-apiserver with kube-controller-manager signing CSRs and Gardener's binding that lets
bootstrap tokens ask for them, and a TLS registry under a CA of its own (for Gardener's images).
``bench.provision`` and ``bench.vm_node`` run their machines on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from kubernetes_asyncio.client import ApiClient

from tests.conftest import api_client_from
from tests.testbed.bootstrap import allow_bootstrappers
from tests.testbed.controlplane import ControlPlane
from tests.testbed.pki import CertificateAuthority
from tests.testbed.registry import Registry


@dataclass
class MachineBed:
    control_plane: ControlPlane
    registry: Registry
    registry_ca: CertificateAuthority
    admin: ApiClient


@contextlib.asynccontextmanager
async def machine_bed(work: Path) -> AsyncIterator[MachineBed]:
    """The bed, its state under ``work``; stopped on the way out."""
    ca = CertificateAuthority(work / "registry-pki", name="node-agent-bench-registry-ca")
    cp = ControlPlane(work / "cp")
    registry = Registry(work / "registry", ca)
    try:
        cp.start()
        cp.start_controller_manager()
        registry.start()
        async with await api_client_from(cp.admin_kubeconfig) as admin:
            await allow_bootstrappers(admin)
            yield MachineBed(cp, registry, ca, admin)
    finally:
        registry.stop()
        cp.stop()
