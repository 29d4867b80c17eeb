"""The OSC controller on the real test bed: first apply, minimal restarts, removals, no-ops."""

from __future__ import annotations

import asyncio
import base64
import copy
import hashlib
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from node_agent.config import ZONE_FILE
from tests.testbed.agent_harness import (
    AGENT_UNIT,
    OSCAgent,
    inline_file,
    osc_document,
    service,
    wait_for,
)
from tests.testbed.controlplane import ControlPlane
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

STATE = "/var/lib/gardener-node-agent"
FOREIGN = "foreign.service"  # a distro unit: the OSC only adds a drop-in to it
FOREIGN_TEXT = "[Unit]\nStartLimitIntervalSec=0\n[Service]\nExecStart=/bin/sleep infinity\n"
MODES = [0o644, 0o600, 0o755, 0o640, 0o444, 0o700, 0o664, 0o4755, 0o1777, None]


def base_osc() -> dict[str, Any]:
    files = [inline_file(f"/etc/demo/f{i:02d}.conf", f"file {i}\n", MODES[i]) for i in range(10)]
    files.append(
        {
            "path": "/var/lib/demo/deep/nested/blob.bin",
            "permissions": 0o600,
            "content": {
                "inline": {"encoding": "b64", "data": base64.b64encode(b"\x00\x01bin").decode()}
            },
        }
    )
    units = [
        service("app-a.service", filePaths=["/etc/demo/f00.conf"], enable=True),
        service(
            "app-b.service",
            filePaths=["/etc/demo/f01.conf"],
            dropIns=[{"name": "10-env.conf", "content": "[Service]\nEnvironment=B=1\n"}],
        ),
        service("app-c.service", enable=False),
        service("app-d.service", command="stop"),
        service("job.service", "/bin/true", extra="Type=oneshot\nRemainAfterExit=yes\n"),
        {
            "name": FOREIGN,
            "dropIns": [{"name": "50-osc.conf", "content": "[Service]\nEnvironment=F=1\n"}],
        },
    ]
    return osc_document(files, units)


def file_mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def expected_mode(mode: int | None) -> int:
    return 0o600 if mode is None else mode


@pytest_asyncio.fixture(loop_scope="session")
async def agent(
    admin_api: ApiClient, control_plane: ControlPlane, node: IsolatedSystemd, tmp_path: Path
) -> AsyncIterator[OSCAgent]:
    node.path(f"/etc/systemd/system/{FOREIGN}").write_text(FOREIGN_TEXT)
    node.run(["systemctl", "daemon-reload"])
    node.run(["systemctl", "start", FOREIGN])
    async with OSCAgent(admin_api, control_plane, node, tmp_path).running() as harness:
        yield harness


async def invocations(agent: OSCAgent, names: list[str]) -> dict[str, str]:
    states = await agent.unit_states(names)
    return {name: state.invocation_id for name, state in states.items()}


ALL_UNITS = [
    "app-a.service",
    "app-b.service",
    "app-c.service",
    "app-d.service",
    "job.service",
    FOREIGN,
]


async def test_first_apply_writes_exact_files_and_units(agent: OSCAgent) -> None:
    osc = base_osc()
    checksum = await agent.publish(osc)
    await agent.wait_applied(checksum)
    node = agent.node

    for i, mode in enumerate(MODES):
        path = node.path(f"/etc/demo/f{i:02d}.conf")
        assert path.read_bytes() == f"file {i}\n".encode()
        assert file_mode(path) == expected_mode(mode), path
    blob = node.path("/var/lib/demo/deep/nested/blob.bin")
    assert blob.read_bytes() == b"\x00\x01bin"
    assert file_mode(blob) == 0o600
    for parent in ("/var/lib/demo", "/var/lib/demo/deep", "/var/lib/demo/deep/nested"):
        assert file_mode(node.path(parent)) == 0o755
    assert node.path("/etc/systemd/system/app-b.service.d/10-env.conf").read_text() == (
        "[Service]\nEnvironment=B=1\n"
    )

    states = await agent.unit_states(ALL_UNITS)
    assert states["app-a.service"].active_state == "active"
    assert states["app-a.service"].unit_file_state == "enabled"
    assert states["app-b.service"].active_state == "active"
    assert (
        node.run(["systemctl", "show", "-P", "Environment", "app-b.service"]).stdout.strip()
        == "B=1"
    )
    assert states["app-c.service"].active_state == "inactive"
    assert states["app-c.service"].unit_file_state == "disabled"
    assert states["app-d.service"].active_state == "inactive"
    assert states["app-d.service"].unit_file_state == "enabled"
    assert states["job.service"].active_state == "active"  # oneshot, RemainAfterExit
    assert states[FOREIGN].active_state == "active"
    assert node.run(["systemctl", "show", "-P", "Environment", FOREIGN]).stdout.strip() == "F=1"

    labels = await agent.node_labels()
    assert labels["worker.gardener.cloud/kubernetes-version"] == "1.33.4"
    assert labels["node-role.kubernetes.io/worker"] == ""
    message = await agent.wait_event("OSCApplied")
    assert checksum[:12] in message
    await agent.wait_event("SystemDUnitRestart", "app-a.service")
    await agent.wait_event("SystemDUnitStop", "app-c.service")


async def test_only_affected_units_restart_and_removals_are_exact(agent: OSCAgent) -> None:
    osc = base_osc()
    await agent.wait_applied(await agent.publish(osc))
    node = agent.node
    before = await invocations(agent, ALL_UNITS)

    # A file in app-a's filePaths changes: app-a restarts, nothing else does.
    osc["spec"]["files"][0]["content"]["inline"]["data"] = "file 0, version 2\n"
    await agent.wait_applied(await agent.publish(osc))
    after = await invocations(agent, ALL_UNITS)
    assert {u for u in ALL_UNITS if after[u] != before[u]} == {"app-a.service"}
    assert node.path("/etc/demo/f00.conf").read_text() == "file 0, version 2\n"

    # A drop-in of app-b changes: only app-b restarts.
    before = after
    osc["spec"]["units"][1]["dropIns"][0]["content"] = "[Service]\nEnvironment=B=2\n"
    await agent.wait_applied(await agent.publish(osc))
    after = await invocations(agent, ALL_UNITS)
    assert {u for u in ALL_UNITS if after[u] != before[u]} == {"app-b.service"}
    assert (
        node.run(["systemctl", "show", "-P", "Environment", "app-b.service"]).stdout.strip()
        == "B=2"
    )

    # app-a leaves the OSC, file f09 too, and the foreign unit's drop-in.
    removed = copy.deepcopy(osc)
    removed["spec"]["units"] = [
        u for u in osc["spec"]["units"] if u["name"] not in ("app-a.service", FOREIGN)
    ]
    removed["spec"]["files"] = [
        f for f in osc["spec"]["files"] if f["path"] != "/etc/demo/f09.conf"
    ]
    before = after
    await agent.wait_applied(await agent.publish(removed))
    states = await agent.unit_states(ALL_UNITS)
    assert states["app-a.service"].active_state == "inactive"
    assert states["app-a.service"].load_state == "not-found"
    assert not node.path("/etc/systemd/system/app-a.service").exists()
    assert not node.path("/etc/systemd/system/multi-user.target.wants/app-a.service").exists()
    assert not node.path("/etc/demo/f09.conf").exists()
    assert node.path("/etc/demo/f08.conf").exists()
    # The unit the agent did not create stays; only the agent's drop-in went.
    assert node.path(f"/etc/systemd/system/{FOREIGN}").read_text() == FOREIGN_TEXT
    assert not node.path(f"/etc/systemd/system/{FOREIGN}.d").exists()
    assert states[FOREIGN].load_state == "loaded"
    assert node.run(["systemctl", "show", "-P", "Environment", FOREIGN]).stdout.strip() == ""
    after = await invocations(agent, ALL_UNITS)
    for unit in ("app-b.service", "job.service"):
        assert after[unit] == before[unit], unit


async def test_same_osc_again_touches_nothing(agent: OSCAgent) -> None:
    osc = base_osc()
    checksum = await agent.publish(osc)
    await agent.wait_applied(checksum)
    assert agent.controller is not None
    applies = agent.controller.applies
    paths = [agent.node.path(f"/etc/demo/f{i:02d}.conf") for i in range(10)]
    paths += [
        agent.node.path("/etc/systemd/system/app-b.service"),
        agent.node.path("/etc/systemd/system/app-b.service.d/10-env.conf"),
    ]
    mtimes = {p: os.stat(p).st_mtime_ns for p in paths}
    before = await invocations(agent, ALL_UNITS)

    # The same bytes again (a new resourceVersion, a new watch event).
    same = await agent.publish(osc)
    assert same == checksum
    # Then a real change to a file no unit refers to, to know the no-op event was processed.
    osc["spec"]["files"][5]["content"]["inline"]["data"] = "changed\n"
    await agent.wait_applied(await agent.publish(osc))

    assert agent.controller.applies == applies + 1
    changed = {p for p in paths if os.stat(p).st_mtime_ns != mtimes[p]}
    assert changed == {agent.node.path("/etc/demo/f05.conf")}
    assert await invocations(agent, ALL_UNITS) == before


async def test_version_label_follows_the_config_after_a_restart(agent: OSCAgent) -> None:
    """A Kubernetes update changes the agent's config file (an OSC file) and restarts the agent:
    the old process labelled the Node from its old config, and the new one finds the checksum
    already reported. It must still bring the version label to its own config's version."""
    label = "worker.gardener.cloud/kubernetes-version"
    await agent.stop()
    agent.kubernetes_version = "1.33.3"  # the old process's config
    await agent.start()
    checksum = await agent.publish(base_osc())
    await agent.wait_applied(checksum)
    assert (await agent.node_labels())[label] == "1.33.3"

    await agent.stop()
    agent.kubernetes_version = "1.33.4"  # the new process's config; the Node is up to date
    await agent.start()

    async def relabelled() -> bool:
        return (await agent.node_labels()).get(label) == "1.33.4"

    await wait_for(relabelled, 20, "the version label of the new config")
    assert agent.controller is not None
    assert agent.controller.applies == 0  # nothing was applied again
    assert (await agent.node_annotations())["checksum/cloud-config-data"] == checksum


async def test_drift_on_disk_is_repaired_by_the_periodic_check(agent: OSCAgent) -> None:
    osc = base_osc()
    await agent.wait_applied(await agent.publish(osc))
    assert agent.controller is not None
    node = agent.node
    before = await invocations(agent, ALL_UNITS)

    node.path("/etc/demo/f00.conf").write_text("edited by hand\n")  # app-a's filePaths
    os.chmod(node.path("/etc/demo/f03.conf"), 0o666)  # no unit refers to it
    node.path("/etc/systemd/system/app-b.service.d/10-env.conf").unlink()
    agent.controller.request_resync()
    message = await agent.wait_event("OSCDriftRepaired")

    assert "/etc/demo/f00.conf" in message
    assert node.path("/etc/demo/f00.conf").read_text() == "file 0\n"
    assert file_mode(node.path("/etc/demo/f03.conf")) == 0o640
    assert node.path("/etc/systemd/system/app-b.service.d/10-env.conf").read_text() == (
        "[Service]\nEnvironment=B=1\n"
    )
    after = await invocations(agent, ALL_UNITS)
    assert {u for u in ALL_UNITS if after[u] != before[u]} == {"app-a.service", "app-b.service"}
    # A second check finds nothing more to do.
    repaired = [e for e in await agent.events() if e.reason == "OSCDriftRepaired"]
    agent.controller.request_resync()
    await agent.publish(osc)  # an event after the resync, to know it was processed
    await asyncio.sleep(1.0)
    assert [e for e in await agent.events() if e.reason == "OSCDriftRepaired"] == repaired


async def test_agent_unit_restarts_last_after_state_is_persisted(agent: OSCAgent) -> None:
    agent_unit = AGENT_UNIT
    osc = base_osc()
    osc["spec"]["units"].append(service(agent_unit, filePaths=["/etc/demo/f00.conf"]))
    agent.node.path(ZONE_FILE).parent.mkdir(parents=True, exist_ok=True)
    agent.node.path(ZONE_FILE).write_text("zone-b\n")
    await agent.wait_applied(await agent.publish(osc))
    assert (await agent.node_labels())["topology.kubernetes.io/zone"] == "zone-b"
    before = await agent.unit_states([agent_unit, "app-a.service"])

    osc["spec"]["files"][0]["content"]["inline"]["data"] = "both restart\n"
    checksum = await agent.publish(osc)
    await agent.wait_applied(checksum)

    async def agent_restarted() -> bool:
        now = await agent.unit_states([agent_unit])
        return now[agent_unit].invocation_id != before[agent_unit].invocation_id

    await wait_for(agent_restarted, 30, "the agent's own unit to restart", poll=0.1)
    after = await agent.unit_states([agent_unit, "app-a.service"])
    assert after["app-a.service"].invocation_id != before["app-a.service"].invocation_id
    persisted = os.stat(agent.node.path(f"{STATE}/last-applied-osc.yaml")).st_mtime
    agent_start = after[agent_unit].exec_main_start
    other_start = after["app-a.service"].exec_main_start
    assert agent_start is not None
    assert other_start is not None
    assert other_start < agent_start  # everything else first
    assert persisted <= agent_start.timestamp()  # state persisted before it
    last_applied = agent.node.path(f"{STATE}/last-applied-osc.yaml").read_bytes()
    assert hashlib.sha256(last_applied).hexdigest() == checksum


async def test_reconciliation_delay_applies_to_updates_only(agent: OSCAgent) -> None:
    await client.CoreV1Api(agent.admin).patch_node(
        agent.node_name,
        {"metadata": {"annotations": {"node-agent.gardener.cloud/reconciliation-delay": "4s"}}},
    )
    osc = base_osc()
    await agent.wait_applied(await agent.publish(osc), timeout=3.5)  # first apply: no delay

    osc["spec"]["files"][0]["content"]["inline"]["data"] = "delayed\n"
    checksum = await agent.publish(osc)
    await asyncio.sleep(2.0)
    assert agent.node.path("/etc/demo/f00.conf").read_text() == "file 0\n"  # still waiting
    await agent.wait_applied(checksum)
    assert agent.node.path("/etc/demo/f00.conf").read_text() == "delayed\n"
