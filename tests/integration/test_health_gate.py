"""The health-gated apply on the real test bed: an update that breaks a running unit is rolled back.

The agent (its OSC controller, in this process) acts on a throwaway node with real systemd and
reads its OSC from the real kube-apiserver. ``web.service`` runs only while its config file
says ``good``; with ``bad`` it exits 1 and ``Restart=always`` brings it back every second, a
restart loop that never shows as ``failed``: the case an apply most often causes in the field.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from kubernetes_asyncio.client import ApiClient

from tests.testbed.agent_harness import (
    REPO,
    OSCAgent,
    counted_service,
    inline_file,
    osc_document,
    starts,
    wait_for,
)
from tests.testbed.controlplane import ControlPlane
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

ANNOTATION = "checksum/cloud-config-data"
CONF = "/etc/web/web.conf"
EXTRA = "/etc/web/extra"
WINDOW = 10  # seconds: the settle window these tests configure


def web() -> dict[str, Any]:
    """Runs while its config's first line starts with ``good``; else exits 1, and systemd
    restarts it every second."""
    check = f"/bin/sh -c 'head -n1 {CONF} | grep -q ^good && exec sleep infinity'"
    return counted_service(
        "web.service", "web", check, extra="Restart=always\nRestartSec=1\n", filePaths=[CONF]
    )


def osc(conf: str, extra: str) -> dict[str, Any]:
    return osc_document([inline_file(CONF, conf), inline_file(EXTRA, extra)], [web()])


def active(node: IsolatedSystemd, unit: str) -> str:
    return node.run(["systemctl", "is-active", unit], check=False).stdout.strip()


async def history_output(root: Path, *flags: str) -> str:
    """What ``node-agent status --history`` prints, run as an operator would."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "node_agent",
        "status",
        "--history",
        *flags,
        "--root",
        str(root),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0, out
    return out.decode()


async def history(root: Path) -> list[dict[str, Any]]:
    """``node-agent status --history --json``, newest first."""
    entries: list[dict[str, Any]] = json.loads(await history_output(root, "--json"))["history"]
    return entries


@pytest_asyncio.fixture(loop_scope="session")
async def agent(
    admin_api: ApiClient, control_plane: ControlPlane, node: IsolatedSystemd, tmp_path: Path
) -> AsyncIterator[OSCAgent]:
    gate = {"healthGate": {"enabled": True, "settleWindow": f"{WINDOW}s"}}
    async with OSCAgent(
        admin_api, control_plane, node, tmp_path, node_agent=gate
    ).running() as harness:
        yield harness


async def annotations_seen(agent: OSCAgent, seen: set[str], stop: asyncio.Event) -> None:
    while not stop.is_set():
        seen.add((await agent.node_annotations()).get(ANNOTATION, ""))
        await asyncio.sleep(0.2)


async def test_bad_update_is_rolled_back_quarantined_and_a_good_one_applies(
    agent: OSCAgent,
) -> None:
    node = agent.node
    good = await agent.publish(osc("good 1\n", "1\n"))
    await agent.wait_applied(good)
    assert active(node, "web.service") == "active"
    assert starts(node, "web.service") == ["web"]

    # The update breaks web.service (its config) and changes another file.
    seen: set[str] = set()
    stop = asyncio.Event()
    watcher = asyncio.create_task(annotations_seen(agent, seen, stop))
    published = time.monotonic()
    bad = await agent.publish(osc("bad\n", "2\n"))
    message = await agent.wait_event("OSCRolledBack", "web.service", timeout=WINDOW + 60)
    rolled_back_after = time.monotonic() - published
    print(f"OSCRolledBack after {rolled_back_after:.1f} s: {message}")
    assert "restart loop" in message or "failed" in message, message
    assert bad[:12] in message, message
    assert good[:12] in message, message
    assert rolled_back_after < WINDOW + 30

    # web.service runs on its previous config again, and stays up; the other file is back too.
    assert node.path(CONF).read_text() == "good 1\n"
    assert node.path(EXTRA).read_text() == "1\n"
    await wait_for(lambda: active(node, "web.service") == "active", 10, "web.service active")
    restarts_then = (await agent.unit_states(["web.service"]))["web.service"].n_restarts
    await asyncio.sleep(3)
    state = (await agent.unit_states(["web.service"]))["web.service"]
    assert state.active_state == "active", state
    assert state.n_restarts == restarts_then, state

    # Upstream's contract: the Node carried the bad checksum as soon as it was applied (as
    # upstream reports it), and carries the good one again since the rollback.
    stop.set()
    await watcher
    assert bad in seen, seen
    assert (await agent.node_annotations()).get(ANNOTATION) == good

    # The bad checksum is not retried: not on a full resync, not after an agent restart.
    count = len(starts(node, "web.service"))
    assert agent.controller is not None
    agent.controller.request_resync()
    await asyncio.sleep(3)
    await agent.stop()
    await agent.start()
    await asyncio.sleep(3)
    assert len(starts(node, "web.service")) == count
    assert node.path(CONF).read_text() == "good 1\n"
    assert (await agent.node_annotations()).get(ANNOTATION) == good

    # The history shows the update and its rollback.
    entries = await history(node.root)
    rollback = next(e for e in entries if e["trigger"] == "rollback")
    assert rollback["result"] == "succeeded", rollback
    assert rollback["rollback"]["unit"] == "web.service", rollback
    assert rollback["checksum_from"] == bad, rollback
    assert rollback["checksum_to"] == good, rollback
    update = next(e for e in entries if e["trigger"] == "secret" and e["checksum_to"] == bad)
    assert update["result"] == "rolled-back", update
    assert "web.service" in update["restarted_units"], update

    # A following good update is applied: web.service is restarted on it and the Node says
    # applied at once, as upstream's would; the settle window runs after the report.
    published = time.monotonic()
    fixed = await agent.publish(osc("good 3\n", "3\n"))
    await agent.wait_applied(fixed, timeout=WINDOW + 60)
    took = time.monotonic() - published
    print(f"good update applied and reported after {took:.1f} s (settle window {WINDOW} s)")
    assert took < WINDOW - 1
    await wait_for(
        lambda: agent.controller is not None and agent.controller.gate.view().watching is None,
        WINDOW + 30,
        "the settle window over",
    )
    assert node.path(CONF).read_text() == "good 3\n"
    assert active(node, "web.service") == "active"
    assert [e.reason for e in await agent.events()].count("OSCRolledBack") == 1

    # Someone edits the config on the host: the periodic check repairs it (trigger drift).
    node.path(CONF).write_text("good by hand\n")
    agent.controller.request_resync()
    await agent.wait_event("OSCDriftRepaired", CONF, timeout=30)
    await wait_for(lambda: node.path(CONF).read_text() == "good 3\n", 10, "config repaired")
    entries = await history(node.root)
    assert [(e["trigger"], e["result"]) for e in entries[:5]] == [
        ("drift", "succeeded"),
        ("secret", "succeeded"),
        ("rollback", "succeeded"),
        ("secret", "rolled-back"),
        ("secret", "succeeded"),
    ], entries
    print(await history_output(node.root))


async def test_agent_killed_during_the_settle_window_still_rolls_back(agent: OSCAgent) -> None:
    node = agent.node
    good = await agent.publish(osc("good 1\n", "1\n"))
    await agent.wait_applied(good)

    bad = await agent.publish(osc("bad\n", "2\n"))
    gate_file = node.path("/var/lib/gardener-node-agent/health-gate.json")

    def watching() -> bool:
        try:
            record = json.loads(gate_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return False
        return bool(record.get("phase") == "watching" and record.get("watched"))

    await wait_for(watching, 30, "the gate watching web.service")
    await agent.stop()  # the agent dies inside the window (its task is cancelled)
    assert node.path(CONF).read_text() == "bad\n"
    await agent.start()
    message = await agent.wait_event("OSCRolledBack", "web.service", timeout=WINDOW + 60)
    assert bad[:12] in message, message
    assert node.path(CONF).read_text() == "good 1\n"
    await wait_for(lambda: active(node, "web.service") == "active", 10, "web.service active")
    assert (await agent.node_annotations()).get(ANNOTATION) == good
    assert json.loads(gate_file.read_text())["phase"] == "quarantined"


async def test_with_the_operators_strictness_a_bad_checksum_never_reaches_the_node(
    agent: OSCAgent,
) -> None:
    """``reportAfterSettle``, in the file an OSC-mutating extension adds to the pool's OSC:
    the checksum of an update that restarted running units comes only after its settle window,
    so a rolled-back update is never seen on the Node."""
    strict = inline_file(
        "/var/lib/gardener-node-agent/node-agent-strict.yaml",
        "apiVersion: node-agent.gardener.cloud/v1alpha1\nkind: Strictness\n"
        "reportAfterSettle: true\n",
    )

    def strict_osc(conf: str, extra: str) -> dict[str, Any]:
        doc = osc(conf, extra)
        doc["spec"]["files"].append(strict)
        return doc

    good = await agent.publish(strict_osc("good 1\n", "1\n"))
    await agent.wait_applied(good)
    seen: set[str] = set()
    stop = asyncio.Event()
    watcher = asyncio.create_task(annotations_seen(agent, seen, stop))
    bad = await agent.publish(strict_osc("bad\n", "2\n"))
    await agent.wait_event("OSCRolledBack", "web.service", timeout=WINDOW + 60)
    stop.set()
    await watcher
    assert bad not in seen, seen
    assert (await agent.node_annotations()).get(ANNOTATION) == good

    published = time.monotonic()
    fixed = await agent.publish(strict_osc("good 3\n", "3\n"))
    await agent.wait_applied(fixed, timeout=WINDOW + 60)
    took = time.monotonic() - published
    assert took >= WINDOW - 1, took


FLAKY_CONF = "/etc/flaky/flaky.conf"
#: the flaky unit's restart job fails this many times in a row before one works
FLAKY_FAILURES = 4


def flaky() -> dict[str, Any]:
    """Starts while its config says ``good``; with ``flaky`` its start job fails (its
    ExecStartPre exits 1) ``FLAKY_FAILURES`` times, then works: a restart that fails most of
    the time. No ``Restart=``: only the agent's retries bring it back."""
    pre = (
        f"/bin/sh -c 'head -n1 {FLAKY_CONF} | grep -q ^good && exit 0; "
        "n=$(cat /var/lib/flaky/n 2>/dev/null || echo 0); n=$((n+1)); "
        f"mkdir -p /var/lib/flaky; echo $n > /var/lib/flaky/n; [ $n -gt {FLAKY_FAILURES} ]'"
    )
    return counted_service(
        "flaky.service", "flaky", extra=f"ExecStartPre={pre}\n", filePaths=[FLAKY_CONF]
    )


async def test_a_flaky_restart_gets_the_osc_reported_once_a_retry_works(agent: OSCAgent) -> None:
    """Upstream retries a failing restart with backoff until one works, then reports the OSC.
    node-agent's restart guard spaces the retries out after 3 failures but never stops them,
    and the health gate does not roll back an update it never reported: the OSC is reported
    once the fifth restart job works."""
    node = agent.node
    good = await agent.publish(osc_document([inline_file(FLAKY_CONF, "good\n")], [flaky()]))
    await agent.wait_applied(good)
    assert active(node, "flaky.service") == "active"

    published = time.monotonic()
    update = await agent.publish(osc_document([inline_file(FLAKY_CONF, "flaky\n")], [flaky()]))
    await agent.wait_applied(update, timeout=180)
    took = time.monotonic() - published
    jobs = int(node.path("/var/lib/flaky/n").read_text())
    print(f"flaky update reported after {took:.1f} s, on restart job {jobs}")
    assert jobs == FLAKY_FAILURES + 1
    assert active(node, "flaky.service") == "active"
    reasons = [e.reason for e in await agent.events()]
    assert "OSCRolledBack" not in reasons
    assert "UnitRestartsSuspended" in reasons  # the guard spaced the retries out, and said so
    assert agent.controller is not None
    await wait_for(
        lambda: agent.controller is not None and agent.controller.gate.view().watching is None,
        WINDOW + 30,
        "the settle window over",
    )
    assert (await agent.node_annotations()).get(ANNOTATION) == update
