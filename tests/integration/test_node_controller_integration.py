"""Node requests acted on by the whole agent: real kube-apiserver, real (isolated) systemd.

The agent's own unit is a dummy unit in the isolated systemd (its name set as
``settings.agent_unit``) while the agent runs in the test process; it counts its starts, so
"restarted exactly once" is observed rather than inferred. A requested restart changes a unit's
InvocationID and MainPID (NRestarts counts only systemd's automatic restarts).
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from node_agent.config import parse_config
from tests.conftest import CredentialsFactory
from tests.testbed.controlplane import ControlPlane
from tests.testbed.full_agent import (
    create_node,
    node_annotations,
    prepare_agent,
    running_agent,
    start_unit,
    unit_props,
    wait_for,
)
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration
ANNOTATION = "worker.gardener.cloud/restart-systemd-services"
SECRET_NAME_LABEL = "worker.gardener.cloud/gardener-node-agent-secret-name"

SLEEPER = "[Unit]\nStartLimitIntervalSec=0\n[Service]\nExecStart=/bin/sleep infinity\n"
COUNTING = (
    "[Unit]\nStartLimitIntervalSec=0\n[Service]\n"
    "ExecStartPre=/bin/sh -c 'echo started >> /run/{name}.starts'\n"
    "ExecStart=/bin/sleep infinity\n"
)


def _uid() -> str:
    return uuid.uuid4().hex[:8]


async def _events(admin: ApiClient, node: str, reason: str) -> list[str]:
    listed = await client.CoreV1Api(admin).list_namespaced_event(
        "default", field_selector=f"involvedObject.name={node}"
    )
    return [e.message or "" for e in listed.items if e.reason == reason]


async def test_restart_annotation_with_the_agents_own_unit(
    admin_api: ApiClient,
    control_plane: ControlPlane,
    make_node_agent_credentials: CredentialsFactory,
    systemd: IsolatedSystemd,
    tmp_path: Path,
) -> None:
    node = f"node-{_uid()}"
    osc = f"osc-{node}"
    await create_node(admin_api, node)
    creds = await make_node_agent_credentials(node, [osc])
    a, b, own = f"a-{_uid()}", f"b-{_uid()}", f"agent-{_uid()}"
    start_unit(systemd, f"{a}.service", SLEEPER)
    start_unit(systemd, f"{b}.service", SLEEPER)
    start_unit(systemd, f"{own}.service", COUNTING.format(name=own))
    starts = systemd.path(f"/run/{own}.starts")
    assert starts.read_text().count("started") == 1
    before = {u: unit_props(systemd, f"{u}.service") for u in (a, b, own)}
    setup = prepare_agent(
        tmp_path / "root", control_plane, creds, osc_secret=osc, agent_unit=f"{own}.service"
    )

    async with running_agent(setup, host_name=node, systemd=systemd):
        await client.CoreV1Api(admin_api).patch_node(
            node,
            # own unit in the middle, one name without the .service suffix
            {"metadata": {"annotations": {ANNOTATION: f"{a}.service,{own},{b}"}}},
        )

        async def done() -> bool:
            restarted = all(
                unit_props(systemd, f"{u}.service")["InvocationID"] != before[u]["InvocationID"]
                for u in (a, b, own)
            )
            return restarted and ANNOTATION not in await node_annotations(admin_api, node)

        await wait_for(done, 30, "all three units restarted and the annotation removed")
        await asyncio.sleep(3)  # a loop would restart the own unit again by now
        assert starts.read_text().count("started") == 2  # the own unit: exactly once
        for u in (a, b, own):
            after = unit_props(systemd, f"{u}.service")
            assert after["ActiveState"] == "active"
            assert after["MainPID"] != before[u]["MainPID"]
        assert ANNOTATION not in await node_annotations(admin_api, node)
        messages = await _events(admin_api, node, "SystemDUnitRestart")
        for u in (a, b, own):
            assert any(f"{u}.service" in m for m in messages), (u, messages)


async def test_secret_name_label_rewrites_config_and_restarts_agent(
    admin_api: ApiClient,
    control_plane: ControlPlane,
    make_node_agent_credentials: CredentialsFactory,
    systemd: IsolatedSystemd,
    tmp_path: Path,
) -> None:
    node = f"node-{_uid()}"
    osc, new_osc = f"osc-{node}", f"osc-{node}-new"
    await create_node(admin_api, node)
    creds = await make_node_agent_credentials(node, [osc, new_osc])
    own = f"agent-{_uid()}"
    start_unit(systemd, f"{own}.service", COUNTING.format(name=own))
    starts = systemd.path(f"/run/{own}.starts")
    setup = prepare_agent(
        tmp_path / "root", control_plane, creds, osc_secret=osc, agent_unit=f"{own}.service"
    )

    async with running_agent(setup, host_name=node, systemd=systemd):
        await client.CoreV1Api(admin_api).patch_node(
            node, {"metadata": {"labels": {SECRET_NAME_LABEL: new_osc}}}
        )
        await wait_for(
            lambda: starts.read_text().count("started") == 2, 30, "the agent unit restarted"
        )
        config = parse_config(setup.config_file.read_bytes())
        assert config.controllers.operating_system_config.secret_name == new_osc
        assert config.controllers.operating_system_config.kubernetes_version == "1.31.4"
        assert config.log_format == "text"
        await asyncio.sleep(3)
        assert starts.read_text().count("started") == 2  # restarted once, no loop
