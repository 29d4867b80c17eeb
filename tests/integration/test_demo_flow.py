"""The `make demo` flow with assertions: user-data → service → OSC applied → minimal restart."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path

import pytest
import pytest_asyncio
from kubernetes_asyncio import client

from tests.demo import TOKEN_PATH, Demo
from tests.testbed.userdata import UNIT, show

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture(loop_scope="session")
async def demo(workdir: Path) -> AsyncIterator[Demo]:
    tour = Demo(workdir / "demo", say=lambda _line: None)
    try:
        await tour.start()
        await tour.cluster()
        await tour.boot()
        yield tour
    finally:
        await tour.stop()


async def lease_renew_time(demo: Demo) -> datetime | None:
    assert demo.admin is not None
    assert demo.agent is not None
    try:
        lease = await client.CoordinationV1Api(demo.admin).read_namespaced_lease(
            f"gardener-node-agent-{demo.agent.node_name}", "kube-system"
        )
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    renewed: datetime | None = lease.spec.renew_time
    return renewed


async def test_demo_flow(demo: Demo) -> None:
    assert demo.node is not None
    state = show(demo.node, UNIT)
    assert state["ActiveState"] == "active"
    assert state["SubState"] == "running"
    assert int(state["MainPID"]) > 0
    # The agent is a systemd service of the node, not a process of this test.
    exe = demo.node.run(["readlink", f"/proc/{state['MainPID']}/exe"]).stdout.strip()
    assert exe.startswith("/opt/node-agent/")

    await demo.applied()
    assert demo.node.path("/etc/demo-app/app.conf").read_text() == "greeting=hello\nport=8080\n"
    assert demo.node.path("/var/lib/demo/api-key").read_bytes() == b"s3cr3t-api-key\n"
    assert demo.node.path(TOKEN_PATH).read_bytes() == b"monitoring-token-v1"
    for unit in ("demo-app.service", "demo-sidecar.service"):
        assert show(demo.node, unit)["ActiveState"] == "active", unit
    env = demo.node.run(["systemctl", "show", "-P", "Environment", "demo-app.service"])
    assert env.stdout.strip() == "MODE=tour"

    # The Lease is renewed by the service.
    first: datetime | None = None
    deadline = time.monotonic() + 30
    while first is None and time.monotonic() < deadline:
        first = await lease_renew_time(demo)
        await asyncio.sleep(0.5)
    assert first is not None, "no Lease"
    renewed: datetime | None = first
    while renewed == first and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        renewed = await lease_renew_time(demo)
    assert renewed is not None
    assert renewed > first

    # What an on-call engineer sees on the node: `node-agent status --json` from the artifact.
    assert demo.artifact is not None
    assert demo.agent is not None
    doc = json.loads(demo.status("--json"))
    assert doc["agent"]["running"] is True
    assert doc["agent"]["version"] == demo.artifact.version
    assert doc["agent"]["pid"] == int(state["MainPID"])
    assert doc["agent"]["node_name"] == demo.agent.node_name
    assert doc["osc"]["secret_name"] == demo.agent.secret_name
    assert doc["osc"]["applied_checksum"] == demo.checksum
    assert doc["osc"]["desired_checksum"] == demo.checksum
    assert doc["osc"]["up_to_date"] is True
    assert doc["last_apply"]["result"] == "succeeded"
    assert "demo-app.service" in doc["last_apply"]["restarted_units"]
    assert doc["lease"]["last_renew_time"] is not None
    units = {u["name"]: u["active_state"] for u in doc["units"]}
    assert units["demo-app.service"] == "active"
    assert units["demo-report.timer"] == "active"
    assert doc["change_in_progress"] is None
    text = demo.status()
    assert demo.checksum[:12] in text
    assert "s3cr3t" not in text  # never file contents

    before, after = await demo.change_one_file()
    assert {u for u in before if after[u] != before[u]} == {"demo-app.service"}
    assert demo.node.path("/etc/demo-app/app.conf").read_text() == (
        "greeting=hello again\nport=8080\n"
    )
