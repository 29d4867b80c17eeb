"""The probe and metrics ports of a whole agent under a flood of idle connections.

The agent runs in this process (``run_agent`` against the real kube-apiserver and an isolated
systemd), so ``/proc/self/fd`` counts its descriptors; the flood comes from a child process,
whose sockets are not counted. Before the limits, every idle connection pinned one of the
agent's descriptors until the process ran out of them.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio.client import ApiClient

from node_agent.observe import status_document
from node_agent.observe.http_ports import HEAD_TIMEOUT, MAX_CONNECTIONS
from tests.conftest import PreparedAgentFactory
from tests.testbed.agent_harness import (
    http_get,
    loopback_servers,
    running_agent,
    wait_for,
    wait_ready_endpoints,
)
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration
IDLE_PER_ENDPOINT = 200

#: Opens N idle connections to each port, says so, then reports when the server closed them.
FLOOD = r"""
import json, select, socket, sys, time
ports, count = [int(p) for p in sys.argv[1].split(",")], int(sys.argv[2])
socks = []
for port in ports:
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        socks.append(s)
print("connected", flush=True)
started, open_ = time.monotonic(), set(socks)
while open_ and time.monotonic() - started < 60:
    ready, _, _ = select.select(list(open_)[:1000], [], [], 1.0)
    for s in ready:
        try:
            data = s.recv(1)
        except OSError:
            data = b""
        if not data:
            open_.discard(s)
print(json.dumps({"opened": len(socks), "closed_by_server": len(socks) - len(open_),
                  "last_closed_after": round(time.monotonic() - started, 2)}), flush=True)
"""


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _metric(text: str, key: str) -> float:
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == key:
            return float(value)
    raise AssertionError(f"{key} not in the metrics")


async def test_idle_connection_flood_neither_pins_descriptors_nor_starves_probes(
    admin_api: ApiClient,
    make_prepared_agent: PreparedAgentFactory,
    systemd: IsolatedSystemd,
    tmp_path: Path,
) -> None:
    prepared = await make_prepared_agent(tmp_path / "root")
    doc = yaml.safe_load(prepared.setup.config_file.read_text())
    doc["server"] = loopback_servers()
    setup = prepared.setup.with_config(doc)
    sock = status_document.socket_path(setup.root)

    async with running_agent(setup, host_name=prepared.name, systemd=systemd):
        endpoints = await wait_ready_endpoints(sock, "the agent ready, its endpoints known")
        health, metrics = endpoints["health"], endpoints["metrics"]
        ports = ",".join(address.rsplit(":", 1)[1] for address in (health, metrics))
        before = _fds()

        flood = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            FLOOD,
            ports,
            str(IDLE_PER_ENDPOINT),
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert flood.stdout is not None
            line = await asyncio.wait_for(flood.stdout.readline(), 60)
            assert line.strip() == b"connected"
            # The agent closes what it will not hold as it accepts it; a loop slowed by other
            # work may take a moment over a burst of 400. Well within the head deadline, while
            # the connections it holds are still open, each endpoint holds at most its limit.
            await wait_for(
                lambda: _fds() - before <= 2 * MAX_CONNECTIONS + 4,
                HEAD_TIMEOUT / 2,
                "the connections over the limit closed",
                poll=0.05,
            )
            during = _fds()
            assert during - before >= MAX_CONNECTIONS  # before the deadline: the limit's are held
            # While the last idle connections are still held, the probes answer.
            assert await asyncio.to_thread(http_get, health, "/healthz") == (200, "ok\n")
            assert await asyncio.to_thread(http_get, health, "/readyz") == (200, "ok\n")
            code, text = await asyncio.to_thread(http_get, metrics, "/metrics")
            assert code == 200
            report = json.loads(await asyncio.wait_for(flood.stdout.readline(), 90))
        finally:
            if flood.returncode is None:
                flood.kill()
            await flood.wait()

        await wait_for(lambda: _fds() <= before + 2, 30, "the agent's descriptors released")
        after = _fds()
        _, text = await asyncio.to_thread(http_get, metrics, "/metrics")
        refused = {
            name: _metric(text, f'node_agent_http_connections_refused_total{{endpoint="{name}"}}')
            for name in ("health", "metrics")
        }
        timed_out = {
            name: _metric(text, f'node_agent_http_connections_timed_out_total{{endpoint="{name}"}}')
            for name in ("health", "metrics")
        }
        print(
            f"idle connections: {IDLE_PER_ENDPOINT} per endpoint, limit {MAX_CONNECTIONS}, head "
            f"deadline {HEAD_TIMEOUT:g}s; agent fds before {before}, during {during}, after "
            f"{after}; closed at the limit {refused}, at the deadline {timed_out}; flood {report}"
        )
        # Each endpoint holds at most its limit; the rest were closed at once.
        assert during - before <= 2 * MAX_CONNECTIONS + 4
        assert report["opened"] == 2 * IDLE_PER_ENDPOINT
        assert report["closed_by_server"] == report["opened"]  # none left hanging
        for name in ("health", "metrics"):
            assert refused[name] >= IDLE_PER_ENDPOINT - MAX_CONNECTIONS
            assert timed_out[name] >= 1  # the ones still held went at the head deadline
