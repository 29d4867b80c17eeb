"""kill -9 of the agent after each kind of apply step: the next start converges, no temp files.

The agent runs as a real process (``node-agent run``) on a throwaway node. The fault hook
``NODE_AGENT_TEST_CRASH_AFTER=<step kind>`` makes it SIGKILL itself right after journaling the
first step of that kind, exactly like an OOM kill or a power cut between two steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from node_agent.apply.executor import CRASH_HOOK_ENV
from tests.testbed.agent_harness import AgentProcess, OSCAgent, inline_file, osc_document, service
from tests.testbed.state_shapes import plant_unusable
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

STATE = "/var/lib/gardener-node-agent"
# Every kind of step a change set can have, in execution order.
CRASH_POINTS = [
    "file",
    "unit",
    "dropin",
    "enable",
    "disable",
    "reload",
    "cmd",
    "reload-after-enable",  # after crash-b's enablement, re-asserted after its restart
    "delete-unit",
    "reload-after-delete",
    "delete-file",
]


def variant(k: int) -> dict[str, Any]:
    """Round ``k`` changes every file, unit and drop-in, adds a unit and a file, drops the
    previous round's, so its change set has a step of every kind."""
    files = [inline_file(f"/etc/crash/f{i}", f"round {k} file {i}\n") for i in range(4)]
    files.append(inline_file(f"/etc/crash/only-{k}", f"only {k}\n"))
    units = [
        service(
            "crash-a.service",
            extra=f"Environment=ROUND={k}\n",
            filePaths=["/etc/crash/f0"],
            dropIns=[{"name": "10-r.conf", "content": f"[Service]\nEnvironment=DROPIN={k}\n"}],
        ),
        service("crash-b.service", filePaths=["/etc/crash/f1"]),  # only its file changes
        service(f"crash-new-{k}.service"),
        service("crash-off.service", enable=False),
    ]
    return osc_document(files, units)


def assert_converged(node: IsolatedSystemd, k: int) -> None:
    for i in range(4):
        assert node.path(f"/etc/crash/f{i}").read_text() == f"round {k} file {i}\n"
    assert node.path(f"/etc/crash/only-{k}").exists()
    assert not node.path(f"/etc/crash/only-{k - 1}").exists()
    env = node.run(["systemctl", "show", "-P", "Environment", "crash-a.service"]).stdout.split()
    assert sorted(env) == sorted([f"ROUND={k}", f"DROPIN={k}"])
    assert node.run(["systemctl", "is-active", "crash-a.service"]).stdout.strip() == "active"
    for unit in ("crash-b.service", f"crash-new-{k}.service"):
        assert node.run(["systemctl", "is-active", unit]).stdout.strip() == "active"
    assert node.run(["systemctl", "is-enabled", "crash-b.service"]).stdout.strip() == "enabled"
    assert (
        node.run(["systemctl", "is-enabled", f"crash-new-{k}.service"]).stdout.strip() == "enabled"
    )
    assert not node.path(f"/etc/systemd/system/crash-new-{k - 1}.service").exists()
    gone = node.run(["systemctl", "is-active", f"crash-new-{k - 1}.service"], check=False)
    assert gone.stdout.strip() == "inactive"
    assert node.run(
        ["systemctl", "is-enabled", "crash-off.service"], check=False
    ).stdout.strip() == ("disabled")
    leftovers = node.run(
        ["find", "/etc/crash", "/etc/systemd/system", STATE, "-name", ".node-agent-tmp-*"]
    ).stdout
    assert leftovers == ""
    assert not node.path(f"{STATE}/last-computed-osc-changes.yaml").exists()


async def test_kill_after_each_step_kind_converges(harness: OSCAgent, tmp_path: Path) -> None:
    node = harness.node
    agent = AgentProcess(harness, tmp_path / "agent.log")
    try:
        checksum = await harness.publish(variant(0))
        await agent.start()
        await harness.wait_applied(checksum)
        assert await agent.terminate() == 0
        assert_converged(node, 0)

        for k, point in enumerate(CRASH_POINTS, start=1):
            checksum = await harness.publish(variant(k))
            await agent.start(**{CRASH_HOOK_ENV: point})
            code = await agent.wait()
            assert code == -9, f"crash point {point}: agent exited with {code}\n{agent.log_tail()}"
            assert node.path(f"{STATE}/last-computed-osc-changes.yaml").exists(), point
            assert (await harness.node_annotations()).get("checksum/cloud-config-data") != checksum

            await agent.start()
            await harness.wait_applied(checksum)
            assert await agent.terminate() == 0, agent.log_tail()
            assert_converged(node, k)
    finally:
        await agent.kill()


async def test_drop_in_of_an_apply_whose_journal_was_lost_is_not_left_in_force(
    harness: OSCAgent, tmp_path: Path
) -> None:
    """An apply adds a unit with a drop-in and is killed after writing them, before the
    restart; its journal is then lost (something unusable planted there, set aside). The next
    OSC has the unit without the drop-in: the unit must run without it. Planned only from the
    last applied OSC, the drop-in was swept as a leftover after the unit had been started with
    it still in force (found by the fault campaign, seed 4151794189)."""
    node = harness.node
    agent = AgentProcess(harness, tmp_path / "agent.log")
    dropin = {"name": "10-lost.conf", "content": "[Service]\nEnvironment=LOST=yes\n"}
    try:
        checksum = await harness.publish(osc_document([inline_file("/etc/lost/f", "0\n")], []))
        await agent.start()
        await harness.wait_applied(checksum)
        assert await agent.terminate() == 0

        with_dropin = osc_document([], [service("lost-a.service", dropIns=[dropin])])
        await harness.publish(with_dropin)
        await agent.start(**{CRASH_HOOK_ENV: "cmd"})
        assert await agent.wait() == -9, agent.log_tail()
        assert node.path("/etc/systemd/system/lost-a.service.d/10-lost.conf").exists()
        plant_unusable(node.path(f"{STATE}/last-computed-osc-changes.yaml"), "fifo")

        checksum = await harness.publish(osc_document([], [service("lost-a.service")]))
        await agent.start()
        await harness.wait_applied(checksum)
        assert await agent.terminate() == 0, agent.log_tail()
        assert not node.path("/etc/systemd/system/lost-a.service.d/10-lost.conf").exists()
        env = node.run(["systemctl", "show", "-P", "Environment", "lost-a.service"]).stdout
        assert "LOST=yes" not in env.split(), env
        assert node.run(["systemctl", "is-active", "lost-a.service"]).stdout.strip() == "active"
        # What runs, not only what systemd would start next time: the process's environment.
        pid = node.run(["systemctl", "show", "-P", "MainPID", "lost-a.service"]).stdout.strip()
        environ = node.run(["cat", f"/proc/{pid}/environ"]).stdout
        assert "LOST=yes" not in environ.split("\0"), environ
    finally:
        await agent.kill()
