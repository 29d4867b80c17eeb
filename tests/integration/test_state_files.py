"""Unusable state files on a real node (``node-agent run``, its systemd, the API server): a
directory, a FIFO or a symlink where the apply history or ``status.json`` should be never stops
an apply from being reported nor kills or hangs the agent; each is set aside and said once on
the Node."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.testbed.agent_harness import AgentProcess, OSCAgent, inline_file, osc_document, service

pytestmark = pytest.mark.integration

STATE = "/var/lib/gardener-node-agent"


def osc(text: str) -> dict[str, object]:
    return osc_document(
        [inline_file("/etc/st/a.conf", text)],
        [service("st.service", filePaths=["/etc/st/a.conf"], enable=True)],
    )


async def test_unusable_history_and_status_never_stop_the_agent(
    harness: OSCAgent, tmp_path: Path
) -> None:
    node = harness.node
    history = node.path(f"{STATE}/apply-history.json")
    status = node.path(f"{STATE}/status.json")
    history.parent.mkdir(parents=True, exist_ok=True)
    history.mkdir()
    (history / "x").write_text("x")
    os.mkfifo(status)

    agent = AgentProcess(harness, tmp_path / "agent.log")
    try:
        checksum = await harness.publish(osc("1\n"))
        await agent.start()
        await harness.wait_applied(checksum)
        assert node.path("/etc/st/a.conf").read_text() == "1\n"
        message = await harness.wait_warning("apply-history.json", "directory")
        assert "apply-history.json.corrupt" in message
        assert history.is_file()  # a good history again, with this apply in it
        assert agent.proc is not None
        assert agent.proc.returncode is None, agent.log_tail()

        # Planted while it runs: a symlink to /dev/zero, then the next OSC.
        history.unlink()
        history.symlink_to("/dev/zero")
        checksum = await harness.publish(osc("2\n"))
        await harness.wait_applied(checksum)
        assert node.path("/etc/st/a.conf").read_text() == "2\n"
        assert history.is_file()
        assert not history.is_symlink()
        assert agent.proc.returncode is None, agent.log_tail()
        assert await agent.terminate() == 0, agent.log_tail()
    finally:
        await agent.kill()
