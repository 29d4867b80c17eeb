"""The heartbeat Lease of the whole agent against the real kube-apiserver (least-privilege RBAC).

Renewed every 10 s with the wire fields Gardener reads; renewed again right after a 60 s freeze of
the API server (its own connection pool and short timeouts: a hung connection fails fast) without
any unit restart or re-apply; and the agent recovers by itself from an API server restart.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from tests.conftest import PreparedAgentFactory
from tests.testbed.agent_harness import (
    now,
    osc_document,
    publish_osc,
    read_lease,
    running_agent,
    service,
    unique,
    unit_props,
    wait_applied,
    wait_for,
    wait_lease_renewed_after,
)
from tests.testbed.controlplane import ControlPlane
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration


async def test_lease_created_and_renewed_every_10s(
    admin_api: ApiClient,
    make_prepared_agent: PreparedAgentFactory,
    systemd: IsolatedSystemd,
    tmp_path: Path,
) -> None:
    prepared = await make_prepared_agent(tmp_path / "root")
    node, uid = prepared.name, prepared.uid

    async with running_agent(prepared.setup, host_name=node, systemd=systemd):
        await wait_for(lambda: read_lease(admin_api, node), 20, "the lease")
        lease = await read_lease(admin_api, node)
        assert lease is not None
        name = f"gardener-node-agent-{node}"
        assert lease.metadata.name == name
        assert lease.spec.holder_identity == name
        assert lease.spec.lease_duration_seconds == 40
        owner = lease.metadata.owner_references
        assert [(o.api_version, o.kind, o.name, o.uid) for o in owner] == [
            ("v1", "Node", node, uid)
        ]
        renewals = [lease.spec.renew_time]
        while len(renewals) < 4:
            renewals.append(await wait_lease_renewed_after(admin_api, node, renewals[-1], 20))
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(renewals)]
    print(f"lease renewal gaps: {[round(g, 3) for g in gaps]}")
    assert all(8.0 <= g <= 12.0 for g in gaps), gaps  # the contract: every 10 s


async def test_lease_renewed_right_after_a_frozen_apiserver_without_restarts(
    admin_api: ApiClient,
    control_plane: ControlPlane,
    make_prepared_agent: PreparedAgentFactory,
    node: IsolatedSystemd,
) -> None:
    prepared = await make_prepared_agent(node.root)
    name, setup = prepared.name, prepared.setup
    probe = unique("probe") + ".service"
    osc = yaml.safe_dump(osc_document([], [service(probe, command="start", enable=True)]))
    checksum = await publish_osc(admin_api, prepared.osc_secret, osc.encode())

    async with running_agent(setup, host_name=name, systemd=node) as agent:
        await wait_applied(admin_api, name, checksum, 60)
        before = unit_props(node, probe)
        assert before["ActiveState"] == "active"
        last_applied = setup.root / "var/lib/gardener-node-agent/last-applied-osc.yaml"
        applied_mtime = last_applied.stat().st_mtime_ns if last_applied.exists() else None
        await wait_lease_renewed_after(admin_api, name, now(), 15)

        control_plane.freeze_apiserver()
        try:
            await asyncio.sleep(60)
        finally:
            control_plane.thaw_apiserver()
        thawed = now()
        renewed = await wait_lease_renewed_after(admin_api, name, thawed, 15)
        print(f"lease renewed {(renewed - thawed).total_seconds():.2f}s after the thaw")
        assert not agent.done()

        # No unit restarted, nothing re-applied.
        assert unit_props(node, probe) == before
        if applied_mtime is not None:
            assert last_applied.stat().st_mtime_ns == applied_mtime

        # The watches resumed: a restart request through the Node is acted on.
        await client.CoreV1Api(admin_api).patch_node(
            name,
            {
                "metadata": {
                    "annotations": {"worker.gardener.cloud/restart-systemd-services": probe}
                }
            },
        )
        await wait_for(
            lambda: unit_props(node, probe)["InvocationID"] != before["InvocationID"],
            30,
            "the probe unit restarted through the annotation",
        )


async def test_agent_recovers_from_an_apiserver_restart(
    admin_api: ApiClient,
    control_plane: ControlPlane,
    make_prepared_agent: PreparedAgentFactory,
    systemd: IsolatedSystemd,
    tmp_path: Path,
) -> None:
    prepared = await make_prepared_agent(tmp_path / "root")
    node = prepared.name

    async with running_agent(prepared.setup, host_name=node, systemd=systemd) as agent:
        await wait_lease_renewed_after(admin_api, node, now(), 25)
        control_plane.kill_apiserver()
        try:
            await asyncio.sleep(12)  # at least one tick fails against a closed port
        finally:
            await asyncio.to_thread(control_plane.start_apiserver)
        started = now()
        renewed = await wait_lease_renewed_after(admin_api, node, started, 30)
        print(f"lease renewed {(renewed - started).total_seconds():.2f}s after the restart")
        assert not agent.done()
