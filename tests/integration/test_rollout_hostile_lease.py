"""A hostile rollout Lease on the real kube-apiserver does not hold a waiting node.

The pool's Lease ``kube-system/<secretName>`` is written by every node of the pool, so its
numbers come from other nodes' clocks and code. Here the test writes it as a node that then died
would have left it: a serial holder that "renewed" in year 9999 for 68 years, a rollout ledger
that is not JSON, or a slot renewed in year 9999 with a ttl of NaN. One agent (its OSC
controller, in this process) on a throwaway node with real systemd must still apply its update
within the bound its own settings give (serial Lease 5 s, slot ttl 5 s), without a tight loop of
requests, and say on its Node that it repaired the ledger.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from node_agent.controllers.osc import pacing
from tests.testbed.agent_harness import NS, OSCAgent, inline_file, osc_document, unique, wait_for
from tests.testbed.controlplane import ControlPlane
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

SECONDS = 5  # the serial Lease's duration and the slots' ttl here
NODE_AGENT = {
    "healthGate": {"enabled": False},
    "rollout": {
        "serialLeaseDuration": f"{SECONDS}s",
        "recheckMin": "30s",  # only a fallback: expiry by time wakes the node sooner
        "recheckMax": "40s",
    },
}
SERIAL = {"reconciliation.osc.node-agent.gardener.cloud/serial": "true"}
PACED = {pacing.ANNOTATION_MAX_PARALLEL: "1", pacing.ANNOTATION_SLOT_TTL: f"{SECONDS}s"}
YEAR_9999 = "9999-12-31T23:59:59.000000Z"
#: applied within: the bound (5 s from the first sight), the wake-up jitter, the apply itself
DEADLINE = 25.0
#: requests the agent may make from the publish of the update until it is applied
MAX_REQUESTS = 60


def kubelet(version: str) -> dict[str, Any]:
    """A disruptive change: a kubelet stand-in (a oneshot) whose text names the version."""
    text = (
        "[Unit]\nDescription=kubelet stand-in\n\n[Service]\nType=oneshot\nRemainAfterExit=yes\n"
        f"ExecStart=/bin/echo kubelet {version}\n\n[Install]\nWantedBy=multi-user.target\n"
    )
    return {"name": "kubelet.service", "content": text, "command": "restart", "enable": True}


def osc(version: str) -> dict[str, Any]:
    return osc_document([inline_file("/etc/hostile/version", version)], [kubelet(version)])


@pytest_asyncio.fixture(loop_scope="session")
async def agent(
    admin_api: ApiClient, control_plane: ControlPlane, node: IsolatedSystemd, tmp_path: Path
) -> AsyncIterator[OSCAgent]:
    """One agent that applied v1 (a first apply: never paced)."""
    one = OSCAgent(
        admin_api,
        control_plane,
        node,
        tmp_path,
        secret_name=unique("osc-hostile"),
        node_agent=NODE_AGENT,
    )
    async with one.running():
        await one.wait_applied(await one.publish(osc("v1")))
        yield one


async def hostile_lease(
    admin: ApiClient, name: str, spec: dict[str, Any], ledger: str | None
) -> None:
    annotations = {pacing.ANNOTATION_LEDGER: ledger} if ledger is not None else None
    body: Any = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name, "namespace": NS, "annotations": annotations},
        "spec": spec,
    }
    await client.CoordinationV1Api(admin).create_namespaced_lease(NS, body)


async def update_is_applied_in_time(agent: OSCAgent, annotations: dict[str, str]) -> None:
    assert agent.ctx is not None
    assert agent.controller is not None
    stats = agent.ctx.kube.stats
    before = stats.requests
    started = time.monotonic()
    checksum = await agent.publish(osc("v2"), annotations=annotations)
    rollout = agent.controller.rollout
    await wait_for(lambda: rollout.view().state == "waiting", 15, "the node waiting")
    print(f"waiting: {rollout.view().reason}: {rollout.view().message}")
    await agent.wait_applied(checksum, timeout=60)
    took = time.monotonic() - started
    requests = stats.requests - before
    print(f"held by the hostile Lease for {took:.1f}s with {requests} requests")
    assert took < DEADLINE, took
    assert requests <= MAX_REQUESTS, requests


async def test_a_serial_holder_of_year_9999_and_a_garbage_ledger_hold_nobody(
    agent: OSCAgent, admin_api: ApiClient
) -> None:
    await hostile_lease(
        admin_api,
        agent.secret_name,
        {
            "holderIdentity": "ghost",
            "leaseDurationSeconds": 2**31 - 1,
            "acquireTime": YEAR_9999,
            "renewTime": YEAR_9999,
        },
        "{not json",
    )
    await update_is_applied_in_time(agent, {**SERIAL, **PACED})
    repaired = await agent.wait_event("RolloutLedgerRepaired", "not JSON", timeout=10)
    print(f"Event: {repaired}")
    assert agent.secret_name in repaired


async def test_a_slot_of_year_9999_with_a_nan_ttl_holds_nobody(
    agent: OSCAgent, admin_api: ApiClient
) -> None:
    ledger = {
        "checksum": "0" * 64,
        "slots": [
            {"host": "ghost", "checksum": "0" * 64, "renewed": 253402300799.0, "ttl": math.nan}
        ],
    }
    await hostile_lease(admin_api, agent.secret_name, {}, json.dumps(ledger))
    await update_is_applied_in_time(agent, PACED)
    repaired = await agent.wait_event("RolloutLedgerRepaired", "ttl=nan", timeout=10)
    print(f"Event: {repaired}")
