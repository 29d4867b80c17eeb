"""The agent as systemd runs it (``python -m node_agent run`` as a subprocess) on a throwaway node.

SIGTERM in the middle of an apply (a unit start that takes 30 s) ends the process with 0 well
within 10 s, and the next start finishes the interrupted apply from its journal. sd_notify:
READY=1 after start, WATCHDOG=1 pings while the loops make progress, STOPPING=1 on SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio.client import ApiClient

from node_agent.host.fs import HostFS
from node_agent.host.state import StateStore
from tests.conftest import PreparedAgentFactory
from tests.testbed.agent_harness import (
    AgentSetup,
    inline_file,
    node_annotations,
    osc_document,
    publish_osc,
    service,
    spawn_agent,
    unique,
    unit_props,
    wait_applied,
    wait_for,
)
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration


async def _spawn(
    setup: AgentSetup, node: IsolatedSystemd, name: str, log: Path, notify: str
) -> asyncio.subprocess.Process:
    """The agent with a notify socket and a 1 s watchdog, as its systemd unit configures it."""
    env = {**os.environ, "NOTIFY_SOCKET": notify, "WATCHDOG_USEC": "1000000"}
    env.pop("WATCHDOG_PID", None)
    return await spawn_agent(setup, node, name, log, env=env, args=["--log-format", "text"])


async def _terminate(proc: asyncio.subprocess.Process) -> tuple[int, float]:
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = await asyncio.wait_for(proc.wait(), 15)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return code, time.monotonic() - started


def _messages(sock: socket.socket) -> list[str]:
    out: list[str] = []
    while True:
        try:
            out.extend(sock.recv(4096).decode().splitlines())
        except BlockingIOError:
            return out


async def test_sigterm_during_an_apply_exits_0_and_the_next_start_finishes_it(
    admin_api: ApiClient,
    make_prepared_agent: PreparedAgentFactory,
    node: IsolatedSystemd,
    tmp_path: Path,
) -> None:
    prepared = await make_prepared_agent(node.root)
    name, setup = prepared.name, prepared.setup
    slow = unique("slow") + ".service"
    marker = f"/run/{slow}.fast"
    osc = osc_document(
        [inline_file(f"/etc/node-agent-test/{name}.conf", "x=1\n")],
        [
            service(
                slow,
                f"/bin/sh -c 'test -e {marker} || exec sleep 30'",
                extra="Type=oneshot\nRemainAfterExit=yes\n",
                command="start",
                enable=True,
            )
        ],
    )
    checksum = await publish_osc(admin_api, prepared.osc_secret, yaml.safe_dump(osc).encode())
    notify_name = "@" + unique("node-agent-test")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind("\0" + notify_name[1:])
    notify.setblocking(False)
    log = tmp_path / "agent.log"

    def pending() -> object:  # a fresh store: StateStore caches the journal it read
        return StateStore(HostFS(node.root, follow_system_symlinks=True)).pending()

    try:
        proc = await _spawn(setup, node, name, log, notify_name)
        try:
            await wait_for(
                lambda: unit_props(node, slow).get("ActiveState") == "activating",
                60,
                "the slow unit starting (the apply in progress)",
            )
            await asyncio.sleep(2.5)  # a few watchdog intervals
        except BaseException:
            proc.kill()
            await proc.wait()
            print(log.read_text()[-4000:])
            raise
        code, took = await _terminate(proc)
        print(f"SIGTERM during an apply: exit {code} after {took:.2f}s")
        assert code == 0, log.read_text()[-4000:]
        assert took <= 10.0
        messages = _messages(notify)
        assert "READY=1" in messages
        assert "WATCHDOG=1" in messages
        assert messages[-1] == "STOPPING=1"
        annotations = await node_annotations(admin_api, name)
        assert annotations.get("checksum/cloud-config-data") != checksum  # not finished
        assert pending() is not None  # the journal of the interrupted apply

        node.path(marker).parent.mkdir(parents=True, exist_ok=True)
        node.path(marker).write_text("")
        proc = await _spawn(setup, node, name, log, notify_name)
        try:
            await wait_applied(admin_api, name, checksum, 60)  # the interrupted apply finished
        finally:
            code, took = await _terminate(proc)
        print(f"second run: exit {code} after {took:.2f}s")
        assert code == 0
        assert unit_props(node, slow)["ActiveState"] == "active"
        assert node.path(f"/etc/node-agent-test/{name}.conf").read_text() == "x=1\n"
        assert pending() is None
        assert "continuing an unfinished apply of the same OSC" in log.read_text()
    finally:
        notify.close()
