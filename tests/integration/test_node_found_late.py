"""The Node registered while the agent waits for it (the kubelet comes with the first OSC).

An OSC applied once the Node exists is reported on it completely: the checksum annotation and
the apply's Events (``OSCApplied``, one ``SystemDUnitRestart`` per job), as upstream's Node
informer sees a new Node at once; the agent's lookup every 10 s must not lose those Events.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from kubernetes_asyncio.client import ApiClient

from tests.conftest import CredentialsFactory
from tests.testbed.agent_harness import (
    create_node,
    node_events,
    osc_document,
    prepare_agent,
    publish_osc,
    running_agent,
    service,
    unique,
    wait_applied,
    wait_for,
)
from tests.testbed.controlplane import ControlPlane
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration


async def test_osc_applied_after_the_node_registered_is_reported_with_its_events(
    admin_api: ApiClient,
    control_plane: ControlPlane,
    make_node_agent_credentials: CredentialsFactory,
    node: IsolatedSystemd,
    tmp_path: Path,
) -> None:
    name = unique("late")
    secret = f"osc-{name}"
    creds = await make_node_agent_credentials(name, [secret])
    setup = prepare_agent(node.root, control_plane, creds, osc_secret=secret)
    async with running_agent(setup, host_name=name, systemd=node):
        # the agent is up and has looked for its Node once (not there yet)
        await wait_for(lambda: node.path("/var/lib/gardener-node-agent").exists(), 30, "start")
        await asyncio.sleep(2)
        await create_node(admin_api, name)
        osc = osc_document([], [service("late.service", command="start", enable=True)])
        checksum = await publish_osc(admin_api, secret, osc)
        await wait_applied(admin_api, name, checksum, timeout=60)
        await wait_for(
            lambda: _reasons(admin_api, name, {"OSCApplied", "SystemDUnitRestart"}),
            5,
            "the apply's Events on the Node",
        )


async def _reasons(admin: ApiClient, node: str, wanted: set[str]) -> bool:
    return wanted <= {str(e.reason) for e in await node_events(admin, node)}
