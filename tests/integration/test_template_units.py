"""Template units (``foo@.service``) on the real test bed: written, changed and removed like any
unit file, never started, stopped, enabled or disabled by their bare name (systemd refuses jobs
for a name without an instance), and every OSC with or without them is reported."""

from __future__ import annotations

import copy
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient

from tests.testbed.agent_harness import OSCAgent, inline_file, osc_document, service
from tests.testbed.controlplane import ControlPlane
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

TEMPLATE = "tpl@.service"
UNITS = "/etc/systemd/system"


def keep_osc() -> dict[str, Any]:
    return osc_document(
        [inline_file("/etc/keep/k.conf", "k\n")],
        [service("keep.service", filePaths=["/etc/keep/k.conf"], enable=True)],
    )


def with_template(text: str, **fields: Any) -> dict[str, Any]:
    osc = keep_osc()
    unit = service(TEMPLATE, "/bin/sleep infinity", extra=f"Environment=T={text}\n", **fields)
    unit["dropIns"] = [{"name": "10-x.conf", "content": "[Service]\nEnvironment=D=1\n"}]
    osc["spec"]["units"].append(unit)
    return osc


@pytest.mark.parametrize("fields", [{"install": False}, {"enable": True, "command": "start"}])
async def test_template_unit_is_added_changed_and_removed(
    agent: OSCAgent, fields: dict[str, Any]
) -> None:
    node = agent.node
    await agent.wait_applied(await agent.publish(keep_osc()))

    # Added (bare, or with the fields an extension might set): its files are written, it is
    # reported.
    added = with_template("1", **fields)
    await agent.wait_applied(await agent.publish(added))
    unit_file = node.path(f"{UNITS}/{TEMPLATE}")
    assert "T=1" in unit_file.read_text()
    assert stat.S_IMODE(os.stat(unit_file).st_mode) == 0o600
    assert node.path(f"{UNITS}/{TEMPLATE}.d/10-x.conf").read_text().endswith("D=1\n")
    # systemd loaded it: an instance can be started from it, with the drop-in applied.
    node.run(["systemctl", "start", "tpl@one.service"])
    env = node.run(["systemctl", "show", "-P", "Environment", "tpl@one.service"]).stdout
    assert env.split() == ["T=1", "D=1"]

    # Changed: written again and reported; the running instance is left alone.
    changed = with_template("2", **fields)
    await agent.wait_applied(await agent.publish(changed))
    assert "T=2" in unit_file.read_text()
    show = ["systemctl", "show", "-P", "Environment", "tpl@two.service"]
    assert node.run(show).stdout.split() == ["T=2", "D=1"]

    # Removed: the unit file and its drop-ins go, systemd forgets it, the OSC is reported.
    checksum = await agent.publish(copy.deepcopy(keep_osc()))
    await agent.wait_applied(checksum, timeout=30)
    assert not unit_file.exists()
    assert not node.path(f"{UNITS}/{TEMPLATE}.d").exists()
    load = node.run(["systemctl", "show", "-P", "LoadState", "tpl@three.service"]).stdout
    assert load.strip() == "not-found"
    states = await agent.unit_states(["keep.service"])
    assert states["keep.service"].active_state == "active"


async def test_template_unit_comes_and_goes_under_the_health_gate(
    admin_api: ApiClient, control_plane: ControlPlane, node: IsolatedSystemd, tmp_path: Path
) -> None:
    """With the health gate on (Gardener's config leaves it on), an update after an OSC with a
    template still applies: the gate notes the running units of the last applied OSC before
    the update, and must not ask systemd about the bare template name, which it refuses."""
    gate = {"healthGate": {"enabled": True, "settleWindow": "1s"}}
    async with OSCAgent(
        admin_api, control_plane, node, tmp_path, node_agent=gate
    ).running() as harness:
        await harness.wait_applied(await harness.publish(keep_osc()))
        await harness.wait_applied(await harness.publish(with_template("1")))
        # the update that removes the template (gated: the last applied OSC names it)
        await harness.wait_applied(await harness.publish(keep_osc()), timeout=30)
        assert not node.path(f"{UNITS}/{TEMPLATE}").exists()
