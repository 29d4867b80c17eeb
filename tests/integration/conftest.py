"""Fixtures shared by the integration tests that drive the OSC controller on a throwaway node.

The session-wide parts (control plane, admin client, registry, systemd nodes) are in
``tests/conftest.py``; here is the agent harness most apply tests start from, and the real
artifact served over HTTP for the tests that install it with user-data.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio.client import ApiClient

from tests.testbed import real_kubelet as rk
from tests.testbed.agent_harness import OSCAgent
from tests.testbed.containerd import ContainerdNode
from tests.testbed.controlplane import ControlPlane
from tests.testbed.systemd_ns import IsolatedSystemd
from tests.testbed.userdata import Artifact, build_artifact, serve_directory


@pytest_asyncio.fixture(loop_scope="session")
async def agent(
    admin_api: ApiClient, control_plane: ControlPlane, node: IsolatedSystemd, tmp_path: Path
) -> AsyncIterator[OSCAgent]:
    """The OSC controller of a throwaway node, running in this process."""
    async with OSCAgent(admin_api, control_plane, node, tmp_path).running() as harness:
        yield harness


@pytest_asyncio.fixture(loop_scope="session")
async def harness(
    admin_api: ApiClient, control_plane: ControlPlane, node: IsolatedSystemd, tmp_path: Path
) -> AsyncIterator[OSCAgent]:
    """A registered Node and credentials, for ``node-agent run`` as a process."""
    agent = OSCAgent(admin_api, control_plane, node, tmp_path)
    await agent.setup()
    yield agent


ContainerdAgent = Callable[..., AbstractAsyncContextManager[OSCAgent]]


@pytest.fixture
def containerd_agent(
    admin_api: ApiClient,
    control_plane: ControlPlane,
    containerd_node: ContainerdNode,
    tmp_path: Path,
) -> ContainerdAgent:
    """``async with containerd_agent(**options) as harness``: the OSC controller of the
    containerd node, running in this process (``options`` go to ``OSCAgent``)."""

    def start(**options: Any) -> AbstractAsyncContextManager[OSCAgent]:
        return OSCAgent(
            admin_api, control_plane, containerd_node.node, tmp_path, **options
        ).running()

    return start


@pytest.fixture(scope="session")
def artifact(workdir: Path) -> Artifact:
    """The artifact, built by the same script CI and the Containerfile use (cached by its key)."""
    return build_artifact(workdir / "dist")


@pytest.fixture(scope="module")
def server(artifact: Artifact) -> Iterator[str]:
    """A loopback HTTP server for the artifact; the node shares this network namespace."""
    with serve_directory(artifact.path.parent) as url:
        yield url


@pytest.fixture
def network() -> Iterator[rk.PodNetwork]:
    """A real kubelet's pod network on the throwaway node, taken off the host's afterwards."""
    network = rk.PodNetwork.unique()
    yield network
    network.remove()
