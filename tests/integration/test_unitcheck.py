"""The SystemdUnitsReady condition of the whole agent, on a throwaway node with real units.

One OSC holds a unit for each case; the test then breaks and repairs units with ``systemctl``
and reads the condition on the Node through the API server, the check running every second.
Cases: no condition before anything was applied; all healthy (a running service, a oneshot that
ran, a service its timer triggers, a unit the OSC disables, one it stops (upstream calls that
one unhealthy), one its extension unit disables, a service resting in auto-restart, an
extension unit that is only a drop-in); then failed, inactive but enabled, active but disabled,
not loaded, and the drop-in-only unit stopped, joined in one message whose lastTransitionTime
stays while only the message changes; recovery (a disabled unit that failed counts as healthy);
activating within the threshold (progressing) and beyond it (stuck); and an agent restart that
writes nothing because the Node already carries the same condition.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from tests.conftest import PreparedAgentFactory
from tests.testbed.agent_harness import (
    osc_document,
    publish_osc,
    running_agent,
    service,
    unit_props,
    wait_applied,
    wait_for,
)
from tests.testbed.node_status import units_ready, wait_condition
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

HEALTHY = "All systemd units from the operating system config are running as expected."
SLOW_FLAG = "/run/uc-slow.flag"
STUCK_SECONDS = 8

TIMER = "[Unit]\nDescription=tick\n[Timer]\nOnActiveSec=1h\n[Install]\nWantedBy=timers.target\n"
OS_UNIT = "[Unit]\nStartLimitIntervalSec=0\n[Service]\nExecStart=/bin/sleep infinity\n"


def units() -> list[dict[str, Any]]:
    return [
        service("uc-ok.service"),
        service("uc-kill.service"),
        service(
            "uc-slow.service",
            extra=f"ExecStartPre=/bin/sh -c 'if [ -e {SLOW_FLAG} ]; then exec sleep 3600; fi'\n",
        ),
        service("uc-halt.service"),
        service("uc-once.service", "/bin/true", extra="Type=oneshot\n"),
        service("uc-tick.service", "/bin/true", install=False),
        {"name": "uc-tick.timer", "content": TIMER},
        service("uc-off.service", enable=False),
        service("uc-stop.service", command="stop"),
        service("uc-gone.service"),
        service("uc-base.service", enable=True),  # its extension unit disables it
        service(
            "uc-flap.service",
            "/bin/sh -c 'sleep 1; exit 1'",
            extra="Restart=always\nRestartSec=1h\n",
        ),
    ]


def document() -> dict[str, Any]:
    doc = osc_document([], units())
    doc["status"] = {
        "extensionUnits": [
            {"name": "uc-base.service", "enable": False},
            {
                "name": "uc-os.service",
                "dropIns": [{"name": "10-env.conf", "content": "[Service]\nEnvironment=X=1\n"}],
            },
        ]
    }
    return doc


def config_doc(setup_file: Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(setup_file.read_text())
    doc["controllers"]["systemdUnitCheck"] = {
        "syncPeriod": "1s",
        "stuckThreshold": f"{STUCK_SECONDS}s",
    }
    doc["nodeAgent"] = {"healthGate": {"enabled": False}, "healthCheck": {"enabled": False}}
    return doc


async def add_kubelet_condition(admin: ApiClient, node: str) -> None:
    core = client.CoreV1Api(admin)
    obj = await core.read_node_status(node)
    obj.status.conditions.append(
        client.V1NodeCondition(
            type="Ready", status="True", reason="KubeletReady", message="kubelet is posting"
        )
    )
    await core.replace_node_status(node, obj)


async def condition_types(admin: ApiClient, node: str) -> list[str]:
    obj = await client.CoreV1Api(admin).read_node_status(node)
    return [c.type for c in obj.status.conditions or []]


def is_(status: str, reason: str, message: str) -> Callable[[dict[str, Any]], bool]:
    return lambda c: (c["status"], c["reason"], c["message"]) == (status, reason, message)


async def test_systemd_units_ready_condition_on_a_real_node(
    admin_api: ApiClient,
    make_prepared_agent: PreparedAgentFactory,
    node: IsolatedSystemd,
) -> None:
    prepared = await make_prepared_agent(node.root)
    name = prepared.name
    setup = prepared.setup.with_config(config_doc(prepared.setup.config_file))
    # the distribution's unit that the OS extension only adds a drop-in to
    node.path("/etc/systemd/system/uc-os.service").write_text(OS_UNIT)
    systemctl = node.run  # inside the node's namespaces

    async with running_agent(setup, host_name=name, systemd=node):
        await asyncio.sleep(3)
        assert await units_ready(admin_api, name) is None  # nothing applied: no condition
        checksum = await publish_osc(admin_api, prepared.osc_secret, document())
        await wait_applied(admin_api, name, checksum)
        # -- all healthy ------------------------------------------------------------------------
        await wait_for(
            lambda: unit_props(node, "uc-flap.service")["SubState"] == "auto-restart",
            20,
            "uc-flap.service resting in auto-restart",
        )
        healthy = await wait_condition(
            admin_api, name, is_("True", "AllUnitsHealthy", HEALTHY), "all units healthy"
        )
        states = {
            unit: unit_props(node, unit)
            for unit in (
                "uc-once.service",
                "uc-tick.service",
                "uc-off.service",
                "uc-stop.service",
                "uc-base.service",
            )
        }
        for unit, props in states.items():  # healthy although inactive: each for its reason
            assert (props["ActiveState"], props["SubState"]) == ("inactive", "dead"), unit
        assert unit_props(node, "uc-os.service")["ActiveState"] == "active"
        assert (
            "uc-tick.timer"
            in systemctl(["systemctl", "show", "-p", "TriggeredBy", "uc-tick.service"]).stdout
        )

        # -- unhealthy, several joined ----------------------------------------------------------
        # The kubelet writes its own conditions meanwhile: the agent's next write (the whole
        # list, compare-and-swap on the resourceVersion) must keep it.
        await add_kubelet_condition(admin_api, name)
        systemctl(["systemctl", "kill", "--signal=KILL", "uc-kill.service"])
        first = await wait_condition(
            admin_api,
            name,
            is_("False", "UnhealthyUnits", "uc-kill.service: failed"),
            "uc-kill.service failed",
        )
        assert first["lastTransitionTime"] >= healthy["lastTransitionTime"]
        assert await condition_types(admin_api, name) == ["SystemdUnitsReady", "Ready"]
        systemctl(["systemctl", "stop", "uc-halt.service", "uc-os.service", "uc-gone.service"])
        systemctl(["systemctl", "start", "uc-off.service"])
        node.path("/etc/systemd/system/uc-gone.service").unlink()
        systemctl(["systemctl", "daemon-reload"])
        joined = "; ".join(
            [
                "uc-gone.service: not loaded",
                "uc-halt.service: inactive but should be enabled",
                "uc-kill.service: failed",
                "uc-off.service: active but should be disabled",
                "uc-os.service: inactive but should be enabled",
            ]
        )
        many = await wait_condition(
            admin_api, name, is_("False", "UnhealthyUnits", joined), "five unhealthy units"
        )
        # the status stayed False: only the message changed
        assert many["lastTransitionTime"] == first["lastTransitionTime"]
        assert unit_props(node, "uc-stop.service")["ActiveState"] == "inactive"

        # -- recovered --------------------------------------------------------------------------
        node.path("/etc/systemd/system/uc-gone.service").write_text(OS_UNIT)
        systemctl(["systemctl", "daemon-reload"])
        # a unit the OSC disables may even have failed
        systemctl(["systemctl", "kill", "--signal=KILL", "uc-off.service"])
        systemctl(
            [
                "systemctl",
                "start",
                "uc-kill.service",
                "uc-halt.service",
                "uc-os.service",
                "uc-gone.service",
            ]
        )
        recovered = await wait_condition(
            admin_api, name, is_("True", "AllUnitsHealthy", HEALTHY), "recovered"
        )
        assert unit_props(node, "uc-off.service")["ActiveState"] == "failed"
        assert recovered["lastTransitionTime"] > many["lastTransitionTime"] or (
            recovered["lastTransitionTime"] == many["lastTransitionTime"]  # the same second
            and recovered["status"] != many["status"]
        )

        # -- progressing, then stuck ------------------------------------------------------------
        node.path(SLOW_FLAG).write_text("")
        systemctl(["systemctl", "restart", "--no-block", "uc-slow.service"])
        progressing = await wait_condition(
            admin_api,
            name,
            lambda c: (
                c["reason"] == "ProgressingUnits"
                and re.fullmatch(r"uc-slow\.service: activating for [0-7]s", c["message"])
                is not None
            ),
            "uc-slow.service progressing",
        )
        assert progressing["status"] == "True"
        # still True: the transition time of the healthy condition is kept
        assert progressing["lastTransitionTime"] == recovered["lastTransitionTime"]
        stuck = await wait_condition(
            admin_api,
            name,
            lambda c: (
                c["reason"] == "UnhealthyUnits"
                and re.fullmatch(r"uc-slow\.service: stuck in activating for \d+s", c["message"])
                is not None
            ),
            "uc-slow.service stuck",
        )
        assert stuck["status"] == "False"
        seconds = int(re.findall(r"(\d+)s$", stuck["message"])[0])
        assert seconds >= STUCK_SECONDS
        node.path(SLOW_FLAG).unlink()
        systemctl(["systemctl", "restart", "uc-slow.service"])
        final = await wait_condition(
            admin_api, name, is_("True", "AllUnitsHealthy", HEALTHY), "healthy again"
        )

    # -- a restarted agent finds the same condition on the Node and writes nothing ---------------
    async with running_agent(setup, host_name=name, systemd=node):
        await asyncio.sleep(6)  # the agent is up within a second or two; then a check a second
        assert await units_ready(admin_api, name) == final  # not even lastHeartbeatTime moved
        # ... and the check was running all along: a failed unit shows at once
        systemctl(["systemctl", "kill", "--signal=KILL", "uc-kill.service"])
        await wait_condition(
            admin_api,
            name,
            is_("False", "UnhealthyUnits", "uc-kill.service: failed"),
            "uc-kill.service failed after the restart",
            timeout=20,
        )
