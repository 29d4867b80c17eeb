"""``node-agent status`` and the HTTP endpoints of a real agent process on a throwaway node.

The agent runs as systemd runs it (``python -m node_agent run``) against the real kube-apiserver;
``node-agent status`` runs as its own process, as an operator would. After the agent stops, the
same command says so and still shows the persisted checksum and last apply.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio.client import ApiClient
from structlog.testing import capture_logs

from tests.conftest import PreparedAgentFactory
from tests.testbed.agent_harness import (
    AgentSetup,
    http_get,
    inline_file,
    loopback_servers,
    now,
    osc_document,
    publish_osc,
    run_status,
    running_agent,
    service,
    spawn_agent,
    unique,
    unit_props,
    wait_applied,
    wait_for,
    wait_lease_renewed_after,
)
from tests.testbed.controlplane import ControlPlane
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration
SOCKET = "/run/gardener-node-agent/status.sock"
MARKER = "do-not-print-this-content-7f3a"


async def _status(root: Path, *extra: str) -> tuple[int, str]:
    returncode, out, err = await run_status(root, *extra)
    assert not err, err.decode()
    assert returncode is not None
    return returncode, out.decode()


async def _status_json(root: Path) -> tuple[int, dict[str, Any]]:
    code, out = await _status(root, "--json")
    return code, json.loads(out)


def _metric(text: str, name: str) -> float:
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == name or key.startswith(name + "{"):
            total += float(value)
            found = True
    assert found, f"metric {name} not exported"
    return total


def _with_loopback_servers(setup: AgentSetup) -> None:
    """Bind both HTTP servers on loopback, port 0 (the status document tells the ports)."""
    doc = yaml.safe_load(setup.config_file.read_text())
    doc["server"] = loopback_servers()
    setup.config_file.write_text(yaml.safe_dump(doc))


async def test_status_and_endpoints_of_a_running_agent_and_after_it_stopped(
    admin_api: ApiClient,
    control_plane: ControlPlane,
    make_prepared_agent: PreparedAgentFactory,
    node: IsolatedSystemd,
    tmp_path: Path,
) -> None:
    prepared = await make_prepared_agent(node.root)
    name, osc_secret, creds, setup = (
        prepared.name,
        prepared.osc_secret,
        prepared.creds,
        prepared.setup,
    )
    _with_loopback_servers(setup)
    unit = unique("status") + ".service"
    conf = f"/etc/node-agent-test/{name}.conf"

    def osc(generation: int) -> bytes:
        doc = osc_document(
            [inline_file(conf, f"{MARKER}\ngeneration={generation}\n")],
            [service(unit, command="start", enable=True, filePaths=[conf])],
        )
        return yaml.safe_dump(doc).encode()

    checksum = await publish_osc(admin_api, osc_secret, osc(1))
    log = tmp_path / "agent.log"
    # Not under systemd: no notify socket, no watchdog.
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
    proc = await spawn_agent(setup, node, name, log, env=env)
    try:
        await wait_applied(admin_api, name, checksum, 60)  # the first apply

        async def lease_renewed() -> bool:
            _, doc = await _status_json(node.root)
            return bool(doc["lease"]["last_renew_time"])

        await wait_for(lease_renewed, 30, "a lease renewal shown by status", poll=0.5)

        # --- node-agent status --json, against the running agent
        code, doc = await _status_json(node.root)
        assert code == 0
        assert doc["schema_version"] == 1
        agent = doc["agent"]
        assert agent["running"] is True
        assert agent["version"] == "0.1.0"
        assert agent["node_name"] == name
        assert agent["uptime_seconds"] > 0
        assert doc["osc"]["secret_name"] == osc_secret
        assert doc["osc"]["applied_checksum"] == checksum
        assert doc["osc"]["desired_checksum"] == checksum
        assert doc["osc"]["up_to_date"] is True
        last = doc["last_apply"]
        assert last["result"] == "succeeded"
        assert last["osc_checksum"] == checksum
        assert unit in last["restarted_units"]
        assert last["failures"] == []
        assert doc["change_in_progress"] is None
        states = {u["name"]: u for u in doc["units"]}
        assert states[unit]["active_state"] == "active"
        assert states[unit]["sub_state"] == "running"
        assert doc["lease"]["name"] == f"kube-system/gardener-node-agent-{name}"
        assert doc["lease"]["renewals"] >= 1
        assert doc["api_server"]["server"] == control_plane.server
        assert doc["api_server"]["last_success_at"]
        assert doc["inventory"]["files"] >= 1
        assert doc["inventory"]["units"] >= 1
        assert doc["health"] == {"live": True, "ready": True, "reasons": []}

        sock = node.path(SOCKET)
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700

        timings = []
        for _ in range(5):
            started = time.perf_counter()
            code, text = await _status(node.root)
            timings.append(time.perf_counter() - started)
        rss = Path(f"/proc/{proc.pid}/status").read_text().split("VmRSS:")[1].split("\n")[0]
        print(
            f"status (running agent): best {min(timings) * 1000:.0f} ms; agent VmRSS {rss.strip()}"
        )
        assert code == 0
        print(text)
        assert "running (pid" in text
        assert f"kube-system/{osc_secret}" in text
        assert f"applied {checksum[:12]}, desired {checksum[:12]} (up to date)" in text
        assert f"{unit}" in text
        assert "active/running" in text
        for out in (text, json.dumps(doc)):
            assert MARKER not in out  # file contents never shown
            assert creds.token not in out

        # --- health probes and metrics over HTTP on loopback
        health, metrics = doc["endpoints"]["health"], doc["endpoints"]["metrics"]
        assert health.startswith("127.0.0.1:")
        assert metrics.startswith("127.0.0.1:")
        assert await asyncio.to_thread(http_get, health, "/healthz") == (200, "ok\n")
        assert await asyncio.to_thread(http_get, health, "/readyz") == (200, "ok\n")
        assert (await asyncio.to_thread(http_get, health, "/nothing"))[0] == 404
        status, before = await asyncio.to_thread(http_get, metrics, "/metrics")
        assert status == 200
        assert _metric(before, "node_agent_up") == 1
        (build,) = (ln for ln in before.splitlines() if ln.startswith("node_agent_build_info{"))
        assert 'version="0.1.0"' in build
        assert _metric(before, "node_agent_osc_applies_total") == 1
        assert _metric(before, "node_agent_osc_apply_duration_seconds_count") == 1
        assert _metric(before, "node_agent_lease_renewals_total") >= 1
        assert _metric(before, "node_agent_api_requests_total") > 0
        assert _metric(before, "node_agent_osc_up_to_date") == 1
        assert _metric(before, "node_agent_apply_failed_items") == 0
        assert _metric(before, 'node_agent_http_connections_refused_total{endpoint="health"}') == 0
        assert MARKER not in before

        # An update restarts the unit (its file changed): the counters move.
        started = time.time()
        checksum2 = await publish_osc(admin_api, osc_secret, osc(2))
        await wait_applied(admin_api, name, checksum2, 60)  # the second apply
        _, after = await asyncio.to_thread(http_get, metrics, "/metrics")
        assert _metric(after, "node_agent_osc_applies_total") == 2
        assert _metric(after, "node_agent_osc_apply_duration_seconds_count") == 2
        assert (
            _metric(after, "node_agent_unit_restarts_total")
            >= _metric(before, "node_agent_unit_restarts_total") + 1
        )
        assert _metric(after, "node_agent_last_apply_timestamp_seconds") >= started - 1
        assert _metric(after, "node_agent_last_apply_success") == 1
        assert unit_props(node, unit)["ActiveState"] == "active"
    except BaseException:
        proc.kill()
        await proc.wait()
        print(log.read_text()[-4000:])
        raise
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 15) == 0

    # --- the agent is gone: status says so and shows what is on disk
    assert not node.path(SOCKET).exists()
    code, text = await _status(node.root)
    print(text)
    assert code == 3
    assert "NOT RUNNING" in text
    assert f"applied {checksum2[:12]}" in text
    assert "succeeded" in text
    code, doc = await _status_json(node.root)
    assert code == 3
    assert doc["agent"]["running"] is False
    assert "no socket" in doc["agent"]["not_running_reason"]
    assert doc["osc"]["applied_checksum"] == checksum2
    assert doc["osc"]["secret_name"] == osc_secret
    assert doc["last_apply"]["result"] == "succeeded"
    assert doc["last_apply"]["osc_checksum"] == checksum2
    assert unit in doc["last_apply"]["restarted_units"]
    assert doc["units"] is None
    assert doc["health"] is None
    assert doc["inventory"]["units"] >= 1


async def test_a_planted_symlink_as_the_socket_directory_is_refused_and_the_agent_runs_on(
    admin_api: ApiClient,
    make_prepared_agent: PreparedAgentFactory,
    systemd: IsolatedSystemd,
    tmp_path: Path,
) -> None:
    prepared = await make_prepared_agent(tmp_path / "root")
    _with_loopback_servers(prepared.setup)
    setup = prepared.setup.with_config(yaml.safe_load(prepared.setup.config_file.read_text()))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    elsewhere.chmod(0o755)
    planted = setup.root / SOCKET.lstrip("/")
    planted.parent.parent.mkdir(parents=True, exist_ok=True)
    planted.parent.symlink_to(elsewhere)
    started = now()
    with capture_logs() as logs:
        async with running_agent(setup, host_name=prepared.name, systemd=systemd):
            # The agent does its job without the socket: the Lease is renewed.
            await wait_lease_renewed_after(admin_api, prepared.name, started, 30)
    refused = [e for e in logs if e["event"] == "status socket not started"]
    assert len(refused) == 1
    assert "is a symlink" in refused[0]["error"]
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o755  # the link's target: not chmodded
    assert list(elsewhere.iterdir()) == []  # nothing bound there
    assert planted.parent.is_symlink()
    code, text = await _status(setup.root)
    assert code == 3  # the status command says the agent does not answer there
    assert "NOT RUNNING" in text
