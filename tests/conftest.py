"""Shared fixtures: the real test bed (kube-apiserver + etcd, systemd in namespaces).

Everything a test run creates lives under one work directory inside the test cache
(``$NODE_AGENT_TEST_CACHE``, default ``~/.cache/node-agent-test``) and is removed at the end;
nothing is written to the host's ``/tmp``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client import ApiClient

from tests.testbed.agent_harness import PreparedAgent, create_node, prepare_agent, unique
from tests.testbed.bootstrap import allow_bootstrappers
from tests.testbed.containerd import ContainerdNode
from tests.testbed.containerd import containerd_node as start_containerd_node
from tests.testbed.controlplane import ControlPlane
from tests.testbed.credentials import NodeAgentCredentials, node_agent_credentials
from tests.testbed.csr_approver import CSRApprover
from tests.testbed.pki import CertificateAuthority
from tests.testbed.registry import Registry
from tests.testbed.systemd_ns import IsolatedSystemd

#: Files whose tests take minutes, longest first. ``make test`` runs the suite's files side by
#: side on a few workers (pytest-xdist, ``--dist loadfile``), which take files in collection
#: order: these go first, so that none is left to run alone at the end.
SLOW_FILES = (
    "tests/integration/test_vm_node.py",
    "tests/integration/test_apply_campaign.py",
    "tests/integration/test_twin.py",
    "tests/integration/test_certificate_flow.py",
    "tests/integration/test_lease_integration.py",
    "tests/integration/test_health_gate.py",
    "tests/integration/test_healthcheck.py",
    "tests/integration/test_gardener_node.py",
    "tests/integration/test_containerd_campaign.py",
    "tests/integration/test_apply_faults.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow files first (``SLOW_FILES``), everything else in its usual order."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    root = config.rootpath

    def key(item: pytest.Item) -> int:
        return rank.get(item.path.relative_to(root).as_posix(), len(rank))

    items.sort(key=key)


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "node-agent-test"
    return Path(os.environ.get("NODE_AGENT_TEST_CACHE", default))


@pytest.fixture(scope="session")
def workdir() -> Iterator[Path]:
    path = cache_dir() / "run" / uuid.uuid4().hex[:12]
    path.mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def control_plane(workdir: Path) -> Iterator[ControlPlane]:
    """One real kube-apiserver + etcd for the whole session."""
    with ControlPlane(workdir / "controlplane") as cp:
        yield cp


async def api_client_from(kubeconfig: Path) -> ApiClient:
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    return ApiClient(configuration=configuration)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def admin_api(control_plane: ControlPlane) -> AsyncIterator[ApiClient]:
    api = await api_client_from(control_plane.admin_kubeconfig)
    async with api:
        yield api


CredentialsFactory = Callable[..., Awaitable[NodeAgentCredentials]]


@pytest.fixture
def make_node_agent_credentials(
    control_plane: ControlPlane, admin_api: ApiClient, tmp_path: Path
) -> CredentialsFactory:
    """Least-privilege credentials for a node agent: ``await factory(node, [secret, ...])``."""

    async def factory(node_name: str, secret_names: list[str]) -> NodeAgentCredentials:
        return await node_agent_credentials(
            admin_api,
            tmp_path / f"credentials-{node_name}",
            server=control_plane.server,
            ca_file=control_plane.ca_file,
            node_name=node_name,
            secret_names=secret_names,
        )

    return factory


PreparedAgentFactory = Callable[..., Awaitable[PreparedAgent]]


@pytest.fixture
def make_prepared_agent(
    control_plane: ControlPlane,
    admin_api: ApiClient,
    make_node_agent_credentials: CredentialsFactory,
) -> PreparedAgentFactory:
    """A Node of its own for a whole agent, its credentials and its files below ``root``:
    ``await factory(root, name=..., extra_secrets=[...], **prepare_agent_options)``.

    The agent may read its OSC Secret (``osc-<node>``) and the ``extra_secrets``, nothing else."""

    async def factory(
        root: Path, *, name: str | None = None, extra_secrets: Sequence[str] = (), **options: Any
    ) -> PreparedAgent:
        name = name or unique("node")
        osc_secret = f"osc-{name}"
        uid = await create_node(admin_api, name)
        creds = await make_node_agent_credentials(name, [osc_secret, *extra_secrets])
        setup = prepare_agent(root, control_plane, creds, osc_secret=osc_secret, **options)
        return PreparedAgent(name, uid, osc_secret, creds, setup)

    return factory


@pytest.fixture
def systemd(workdir: Path) -> Iterator[IsolatedSystemd]:
    """A real systemd as PID 1 of its own namespaces, with private unit directories."""
    with IsolatedSystemd(workdir / "systemd") as instance:
        yield instance


@pytest.fixture
def node(workdir: Path) -> Iterator[IsolatedSystemd]:
    """A throwaway node: real systemd on an overlay of the host's root (tmpfs upper layer)."""
    with IsolatedSystemd(workdir / "nodes", overlay=True) as instance:
        yield instance


@pytest.fixture(scope="session")
def registry_ca(workdir: Path) -> CertificateAuthority:
    """The CA both test registries serve TLS with (and that nodes are told to trust)."""
    return CertificateAuthority(workdir / "registry-pki", name="node-agent-test-registry-ca")


@pytest.fixture(scope="session")
def registry(workdir: Path, registry_ca: CertificateAuthority) -> Iterator[Registry]:
    """A real OCI registry (docker-registry, TLS) on loopback for the whole session."""
    with Registry(workdir / "registry", registry_ca) as instance:
        yield instance


@pytest.fixture(scope="session")
def mirror(
    workdir: Path, registry_ca: CertificateAuthority, registry: Registry
) -> Iterator[Registry]:
    """A second registry, a pull-through cache of ``registry``: the registry mirror."""
    with Registry(workdir / "mirror", registry_ca, name="mirror", upstream=registry) as instance:
        yield instance


@pytest.fixture
def containerd_node(workdir: Path, registry_ca: CertificateAuthority) -> Iterator[ContainerdNode]:
    """A throwaway node running Debian's containerd as ``containerd.service``; the registries'
    CA is inside at ``tests.testbed.containerd.NODE_CA_PATH``."""
    with start_containerd_node(workdir / "containerd-nodes", registry_ca.cert_path) as instance:
        yield instance


# --- Gardener's certificate flow: kube-controller-manager, bootstrap tokens, CSR approver ----


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def gardener_controlplane(
    control_plane: ControlPlane, admin_api: ApiClient
) -> AsyncIterator[ControlPlane]:
    """The session's control plane with kube-controller-manager running (it signs
    kube-apiserver-client CSRs with the test CA for up to 720h and removes expired bootstrap
    tokens) and Gardener's binding that lets bootstrap tokens create CSRs."""
    manager = control_plane.controller_manager
    if manager is None or not manager.running():
        await asyncio.to_thread(control_plane.start_controller_manager)
    await allow_bootstrappers(admin_api)
    yield control_plane


SigningDurationSetter = Callable[[str], Awaitable[None]]


@pytest_asyncio.fixture(loop_scope="session")
async def kcm_signing_duration(
    gardener_controlplane: ControlPlane,
) -> AsyncIterator[SigningDurationSetter]:
    """``await set_duration("90s")`` restarts kube-controller-manager so that it signs
    certificates for at most that long; 720h again after the test."""
    changed = False

    async def set_duration(duration: str) -> None:
        nonlocal changed
        changed = True
        await asyncio.to_thread(
            gardener_controlplane.restart_controller_manager, signing_duration=duration
        )

    yield set_duration
    if changed:
        await asyncio.to_thread(gardener_controlplane.restart_controller_manager)


@pytest_asyncio.fixture(loop_scope="session")
async def csr_approver(
    gardener_controlplane: ControlPlane, admin_api: ApiClient
) -> AsyncIterator[CSRApprover]:
    """Gardener's node-agent CSR approver, running until the end of the test (mode
    ``"approve"``; ``await csr_approver.set_mode("hold" | "deny")``, ``release()``)."""
    async with CSRApprover(admin_api) as approver:
        yield approver
