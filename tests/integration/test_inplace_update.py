"""An in-place OS update on the real bed: the drain gate, the OS extension's command (a stand-in
that stages the new os-release and asks for a reboot), the reboot (the agent started again on
the node whose os-release now names the new version), completion and the Node's outcome.

The test plays machine-controller-manager (it sets the Node's ``InPlaceUpdate`` condition to
``ReadyForUpdate`` after "draining") and the OS extension (``status.inPlaceUpdates.osUpdate``).
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from node_agent.osc import inplace as ip
from tests.testbed.agent_harness import OSCAgent, inline_file, wait_for
from tests.testbed.controlplane import ControlPlane
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

UPDATE_SCRIPT = "/opt/gardener/bin/inplace-update.sh"
# The OS extension's command, standing in: a non-retriable failure when asked for version 0,
# else the new os-release staged for the next boot and a reboot asked for.
SCRIPT = """#!/bin/sh
set -eu
version="$2"
if [ "$version" = "0" ]; then echo "error: invalid arguments"; exit 2; fi
echo "PRETTY_NAME=\\"Test Linux $version\\"" > /etc/os-release.next
echo "runs" >> /var/lib/inplace-update.runs
echo "update to $version staged; reboot required"
"""


def in_place_osc(os_version: str, text: str) -> dict[str, Any]:
    kubelet = yaml.safe_dump({"kind": "KubeletConfiguration", "cpuManagerPolicy": "none"})
    files = [
        {"path": ip.KUBELET_CONFIG, "permissions": 0o644,
         "content": {"inline": {"encoding": "b64",
                                "data": base64.b64encode(kubelet.encode()).decode()}}},
        inline_file("/etc/demo/inplace.conf", text),
    ]  # fmt: skip
    return {
        "apiVersion": "extensions.gardener.cloud/v1alpha1",
        "kind": "OperatingSystemConfig",
        "spec": {"type": "test", "purpose": "reconcile", "files": files, "units": [],
                 "inPlaceUpdates": {"operatingSystemVersion": os_version, "kubelet": "1.33.0"}},
        "status": {"inPlaceUpdates": {"osUpdate": {"command": UPDATE_SCRIPT,
                                                   "args": ["--version", os_version]}}},
    }  # fmt: skip


def set_os(node: IsolatedSystemd, version: str) -> None:
    path = node.path("/etc/os-release")
    if path.is_symlink() or path.exists():
        path.unlink()
    path.write_text(f'ID=test\nPRETTY_NAME="Test Linux {version}"\n')


def reboot(node: IsolatedSystemd) -> None:
    """What the reboot does to the disk here: the staged os-release becomes the OS's."""
    staged = node.path("/etc/os-release.next")
    set_os(node, "")
    node.path("/etc/os-release").write_text(staged.read_text())
    staged.unlink()


@pytest_asyncio.fixture(loop_scope="session")
async def agent(
    admin_api: ApiClient, control_plane: ControlPlane, node: IsolatedSystemd, tmp_path: Path
) -> AsyncIterator[OSCAgent]:
    set_os(node, "1877.4")
    script = node.path(UPDATE_SCRIPT)
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(SCRIPT)
    script.chmod(0o755)
    async with OSCAgent(admin_api, control_plane, node, tmp_path).running() as harness:
        yield harness


async def set_ready_for_update(agent: OSCAgent) -> None:
    """machine-controller-manager, after draining the node."""
    condition = {"type": "InPlaceUpdate", "status": "True", "reason": "ReadyForUpdate",
                 "message": "node drained"}  # fmt: skip
    await client.CoreV1Api(agent.admin).patch_node_status(
        agent.node_name, {"status": {"conditions": [condition]}}
    )


def runs(node: IsolatedSystemd) -> int:
    path = node.path("/var/lib/inplace-update.runs")
    return len(path.read_text().splitlines()) if path.exists() else 0


async def test_os_update_end_to_end(agent: OSCAgent, node: IsolatedSystemd) -> None:
    first = await agent.publish(in_place_osc("1877.4", "one\n"))
    await agent.wait_applied(first)

    update = await agent.publish(in_place_osc("1877.5", "two\n"))
    await agent.wait_event("InPlaceUpdateWaitingForDrain", "operating_system")
    assert runs(node) == 0
    assert node.path("/etc/demo/inplace.conf").read_text() == "one\n"  # nothing applied yet

    await set_ready_for_update(agent)
    assert agent.controller is not None
    agent.controller.retry_now()  # the Node's watch does this in the agent (not run here)
    await agent.wait_event("InPlaceUpdateRebooting", "1877.5", timeout=60)
    assert runs(node) == 1
    assert node.path("/etc/demo/inplace.conf").read_text() == "two\n"
    annotations = await agent.node_annotations()
    assert annotations[ip.ANNOTATION_UPDATING_OS_VERSION] == "1877.5"
    assert annotations["checksum/cloud-config-data"] == first  # not before the reboot

    await agent.stop()
    reboot(node)
    await agent.start()
    await agent.wait_applied(update, timeout=60)
    labels, annotations = await agent.node_labels(), await agent.node_annotations()
    assert labels[ip.LABEL_UPDATE_RESULT] == "successful"
    assert ip.ANNOTATION_UPDATING_OS_VERSION not in annotations
    assert runs(node) == 1  # the command ran once
    await agent.wait_event("InPlaceUpdateSuccessful", "operating_system")


async def test_a_non_retriable_os_update_failure(agent: OSCAgent, node: IsolatedSystemd) -> None:
    first = await agent.publish(in_place_osc("1877.4", "one\n"))
    await agent.wait_applied(first)
    await set_ready_for_update(agent)
    await agent.publish(in_place_osc("0", "two\n"))

    async def failed() -> bool:
        return (await agent.node_labels()).get(ip.LABEL_UPDATE_RESULT) == "failed"

    await wait_for(failed, 60, "the Node marked failed")
    reason = (await agent.node_annotations())[ip.ANNOTATION_UPDATE_FAILED_REASON]
    assert "non-retriable error detected" in reason
    assert "invalid arguments" in reason
    await agent.wait_event("InPlaceUpdateFailed", "invalid arguments")
    # the rest of the OSC is applied; the node keeps its OS and the old checksum
    assert node.path("/etc/demo/inplace.conf").read_text() == "two\n"
    assert (await agent.node_annotations())["checksum/cloud-config-data"] == first
