"""Node requests acted on by the whole agent: real kube-apiserver, real (isolated) systemd; and
a deleted Node, which must show in ``/readyz`` and ``node-agent status`` until it is back.

The agent's own unit is a dummy unit in the isolated systemd (its name set as
``settings.agent_unit``) while the agent runs in the test process; it counts its starts, so
"restarted exactly once" is observed rather than inferred. A requested restart changes a unit's
InvocationID and MainPID (NRestarts counts only systemd's automatic restarts).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient
from structlog.testing import capture_logs

from node_agent.commands import status
from node_agent.config import parse_config
from node_agent.kube.report import ANNOTATION_APPLIED_CHECKSUM
from node_agent.observe import status_document
from tests.conftest import PreparedAgentFactory
from tests.testbed.agent_harness import (
    create_node,
    http_get,
    loopback_servers,
    node_annotations,
    node_events,
    osc_document,
    publish_osc,
    read_lease,
    running_agent,
    start_unit,
    unique,
    unit_props,
    wait_for,
    wait_ready_endpoints,
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


async def test_restart_annotation_with_the_agents_own_unit(
    admin_api: ApiClient,
    make_prepared_agent: PreparedAgentFactory,
    systemd: IsolatedSystemd,
    tmp_path: Path,
) -> None:
    a, b, own = unique("a"), unique("b"), unique("agent")
    start_unit(systemd, f"{a}.service", SLEEPER)
    start_unit(systemd, f"{b}.service", SLEEPER)
    start_unit(systemd, f"{own}.service", COUNTING.format(name=own))
    starts = systemd.path(f"/run/{own}.starts")
    assert starts.read_text().count("started") == 1
    before = {u: unit_props(systemd, f"{u}.service") for u in (a, b, own)}
    prepared = await make_prepared_agent(tmp_path / "root", agent_unit=f"{own}.service")
    node = prepared.name

    async with running_agent(prepared.setup, host_name=node, systemd=systemd):
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
        messages = [
            e.message or ""
            for e in await node_events(admin_api, node)
            if e.reason == "SystemDUnitRestart"
        ]
        for u in (a, b, own):
            assert any(f"{u}.service" in m for m in messages), (u, messages)


async def test_secret_name_label_rewrites_config_and_restarts_agent(
    admin_api: ApiClient,
    make_prepared_agent: PreparedAgentFactory,
    systemd: IsolatedSystemd,
    tmp_path: Path,
) -> None:
    node = unique("node")
    new_osc = f"osc-{node}-new"
    own = unique("agent")
    prepared = await make_prepared_agent(
        tmp_path / "root", name=node, extra_secrets=[new_osc], agent_unit=f"{own}.service"
    )
    setup = prepared.setup
    start_unit(systemd, f"{own}.service", COUNTING.format(name=own))
    starts = systemd.path(f"/run/{own}.starts")

    async with running_agent(setup, host_name=node, systemd=systemd):
        await client.CoreV1Api(admin_api).patch_node(
            node, {"metadata": {"labels": {SECRET_NAME_LABEL: new_osc}}}
        )
        await wait_for(
            lambda: starts.read_text().count("started") == 2, 30, "the agent unit restarted"
        )
        config = parse_config(setup.config_file.read_bytes())
        assert config.controllers.operating_system_config.secret_name == new_osc
        assert config.controllers.operating_system_config.kubernetes_version == "1.33.4"
        assert config.log_format == "text"
        await asyncio.sleep(3)
        assert starts.read_text().count("started") == 2  # restarted once, no loop


async def test_deleted_node_fails_readiness_and_shows_until_recreated(
    admin_api: ApiClient,
    make_prepared_agent: PreparedAgentFactory,
    systemd: IsolatedSystemd,
    tmp_path: Path,
) -> None:
    prepared = await make_prepared_agent(tmp_path / "root")
    node = prepared.name
    doc = yaml.safe_load(prepared.setup.config_file.read_text())
    doc["server"] = loopback_servers()
    setup = prepared.setup.with_config(doc)
    sock = status_document.socket_path(setup.root)
    core = client.CoreV1Api(admin_api)
    checksum = await publish_osc(admin_api, prepared.osc_secret, osc_document([], []))

    async with running_agent(setup, host_name=node, systemd=systemd):
        endpoints = await wait_ready_endpoints(sock, "the agent ready")
        health = endpoints["health"]
        assert await asyncio.to_thread(http_get, health, "/readyz") == (200, "ok\n")

        with capture_logs() as logs:
            await core.delete_node(node)
            answers: list[tuple[int, str]] = []

            async def not_ready() -> bool:
                answers.append(await asyncio.to_thread(http_get, health, "/readyz"))
                return answers[-1][0] == 503

            await wait_for(not_ready, 30, "/readyz failing after the Node was deleted")
            assert f"node {node} not found" in answers[-1][1]
            await asyncio.sleep(2)  # a retry loop would have said it again by now
            shown = await asyncio.to_thread(status.query, sock)
            assert shown["health"]["ready"] is False
            assert any(f"node {node} not found" in r for r in shown["health"]["reasons"])
            recorded = [e for e in shown["errors"] if f"node {node} not found" in e["error"]]
            assert len(recorded) == 1  # recorded once, not per retry
            text = status.render(shown)
            assert f"NOT READY (node {node} not found" in text

            new_uid = await create_node(admin_api, node)  # registered again (a new object)

            async def ready_again() -> bool:
                return (await asyncio.to_thread(http_get, health, "/readyz"))[0] == 200

            await wait_for(ready_again, 30, "/readyz passing after the Node was re-created")
            assert await asyncio.to_thread(http_get, health, "/readyz") == (200, "ok\n")
        gone = [e for e in logs if e["event"] == "own node is gone"]
        assert len(gone) == 1, gone
        assert gone[0]["node"] == node
        assert any(e["event"] == "own node exists again" for e in logs)
        shown = await asyncio.to_thread(status.query, sock)
        assert shown["health"] == {"live": True, "ready": True, "reasons": []}

        async def lease_owned_by_new_node() -> bool:
            lease = await read_lease(admin_api, node)
            owners = (lease.metadata.owner_references or []) if lease is not None else []
            return any(o.uid == new_uid for o in owners)

        # The Lease's next renewal names the new object as its owner.
        await wait_for(lease_owned_by_new_node, 30, "the Lease owned by the re-created Node")

        async def checksum_reported() -> bool:
            annotations = await node_annotations(admin_api, node)
            return annotations.get(ANNOTATION_APPLIED_CHECKSUM) == checksum

        # The re-created Node lost its annotations: the applied checksum is reported again.
        await wait_for(checksum_reported, 30, "the applied checksum on the re-created Node")
