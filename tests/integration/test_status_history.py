"""``node-agent status --history``, run as an operator runs it (its own process, ``--root``).

Without an agent: the history written through the StateStore is shown newest first, as text and
JSON; an unreadable file is reported and left as it is; another version's entries are counted.
With a whole agent (real kube-apiserver, isolated systemd): the Node's restart annotation leaves
an ``annotation`` entry naming the restarted unit and the one that failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from node_agent.host.documents import ItemFailure
from node_agent.host.fs import HostFS
from node_agent.host.history import HISTORY, HistoryRollback, history_entry
from node_agent.host.state import STATE_DIR, StateStore
from tests.conftest import PreparedAgentFactory
from tests.testbed.agent_harness import (
    REPO,
    node_annotations,
    running_agent,
    start_unit,
    unique,
    unit_props,
    wait_for,
)
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration
ANNOTATION = "worker.gardener.cloud/restart-systemd-services"
SLEEPER = "[Unit]\nStartLimitIntervalSec=0\n[Service]\nExecStart=/bin/sleep infinity\n"
OLD, NEW = "1" * 64, "2" * 64


def status_history(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "node_agent", "status", "--history", "--root", str(root), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "TZ": "UTC"},
    )


def history_json(root: Path) -> list[dict[str, Any]]:
    done = status_history(root, "--json")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    doc = json.loads(done.stdout)
    assert list(doc) == ["history"]
    entries: list[dict[str, Any]] = doc["history"]
    return entries


def _seed(root: Path) -> StateStore:
    root.mkdir(exist_ok=True)
    store = StateStore(HostFS(root))
    start = datetime.now(UTC) - timedelta(hours=2)
    store.append_history(
        history_entry(
            trigger="secret",
            result="succeeded",
            started_at=start,
            finished_at=start + timedelta(seconds=7),
            checksum_to=OLD,
            items_changed=["/etc/demo.conf", "demo.service"],
            restarted_units=["demo.service"],
        )
    )
    start += timedelta(hours=1)
    store.append_history(
        history_entry(
            trigger="secret",
            result="rolled-back",
            started_at=start,
            finished_at=start + timedelta(seconds=65),
            checksum_from=OLD,
            checksum_to=NEW,
            items_changed=["/var/lib/kubelet/config/kubelet"],
            restarted_units=["kubelet.service"],
            failures=[ItemFailure(kind="command", item="kubelet.service", error="exit-code")],
            rollback=HistoryRollback(
                unit="kubelet.service",
                evidence="kubelet.service: Main process exited, status=1/FAILURE",
                from_checksum=NEW,
                to_checksum=OLD,
            ),
        )
    )
    return store


def test_history_is_shown_without_an_agent(tmp_path: Path) -> None:
    root = tmp_path / "root"
    empty = status_history(root)
    assert (empty.returncode, empty.stdout, empty.stderr) == (0, "No applies recorded yet.\n", "")

    _seed(root)
    entries = history_json(root)
    assert [(e["trigger"], e["result"], e["checksum_to"]) for e in entries] == [
        ("secret", "rolled-back", NEW),
        ("secret", "succeeded", OLD),
    ]
    assert entries[0]["rollback"]["unit"] == "kubelet.service"
    assert entries[0]["failures"] == [
        {"kind": "command", "item": "kubelet.service", "error": "exit-code"}
    ]
    assert entries[1]["duration_seconds"] == 7
    assert entries[1]["items_changed"] == ["/etc/demo.conf", "demo.service"]

    text = status_history(root)
    assert text.returncode == 0
    assert text.stderr == ""
    lines = text.stdout.splitlines()
    print(text.stdout)
    assert lines[0] == "Apply history (2 of the last 50, newest first):"
    assert lines[1].endswith(
        "(1h00m ago)  secret     111111111111 -> 222222222222  rolled-back in 1m05s"
    )
    assert "  failed command kubelet.service: exit-code" in lines
    assert "  rolled back because of kubelet.service: 222222222222 -> 111111111111" in lines
    assert "    kubelet.service: Main process exited, status=1/FAILURE" in lines
    assert any(
        line.endswith("(2h00m ago)  secret     none -> 111111111111  succeeded in 7.0s")
        for line in lines
    )
    assert "  changed (2): /etc/demo.conf, demo.service" in lines


def test_unreadable_and_newer_files(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _seed(root)
    path = root / STATE_DIR.lstrip("/") / HISTORY
    doc = json.loads(path.read_bytes())
    newer = dict(doc["entries"][0], trigger="scheduled", fleet="x")  # from a newer agent
    doc["entries"].append(newer)
    path.write_text(json.dumps(doc))
    entries = history_json(root)
    assert len(entries) == 2
    text = status_history(root).stdout
    assert text.endswith("(1 entries written by another agent version not shown)\n")

    path.write_bytes(b'{"entries": [')  # torn by hand: the agent never leaves one
    done = status_history(root)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.startswith(f"apply history unreadable: {path}: not an apply history")
    assert path.read_bytes() == b'{"entries": ['  # the command writes nothing


def test_the_command_loads_no_api_client(tmp_path: Path) -> None:
    command = ["-X", "importtime", "-m", "node_agent", "status", "--history", "--root"]
    done = subprocess.run(
        [sys.executable, *command, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    modules = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()]
    assert "node_agent.commands.show_history" in modules
    assert not [m for m in modules if m.startswith(("kubernetes_asyncio", "aiohttp"))]


async def test_restart_annotation_is_recorded(
    admin_api: ApiClient,
    make_prepared_agent: PreparedAgentFactory,
    systemd: IsolatedSystemd,
    tmp_path: Path,
) -> None:
    unit, missing = unique("hist") + ".service", unique("missing") + ".service"
    start_unit(systemd, unit, SLEEPER)
    before = unit_props(systemd, unit)["InvocationID"]
    root = tmp_path / "root"
    prepared = await make_prepared_agent(root)
    node = prepared.name

    async with running_agent(prepared.setup, host_name=node, systemd=systemd):
        await client.CoreV1Api(admin_api).patch_node(
            node, {"metadata": {"annotations": {ANNOTATION: f"{unit},{missing}"}}}
        )

        async def handled() -> bool:
            return ANNOTATION not in await node_annotations(admin_api, node)

        await wait_for(handled, 60, "the restart annotation handled and removed")
        assert unit_props(systemd, unit)["InvocationID"] != before

        entries = [e for e in history_json(root) if e["trigger"] == "annotation"]
        assert len(entries) == 1, entries
        entry = entries[0]
        assert entry["result"] == "failed"
        assert entry["restarted_units"] == [unit]
        assert [(f["kind"], f["item"]) for f in entry["failures"]] == [("command", missing)]
        assert missing in entry["failures"][0]["error"]
        assert entry["error"] == "1 of 2 restarts failed"
        started = datetime.fromisoformat(entry["started_at"])
        finished = datetime.fromisoformat(entry["finished_at"])
        assert started <= finished <= datetime.now(UTC)

        text = status_history(root).stdout
        assert "  annotation " in text
        assert f"  restarted (1): {unit}" in text
        assert f"  failed command {missing}: " in text
