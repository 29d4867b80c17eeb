"""``node-agent fleet`` against the real kube-apiserver.

A pool is written the way its agents and Gardener would have left it — Nodes with their
checksum annotation, ``OSCRollout`` and ``SystemdUnitsReady`` conditions, heartbeat Leases
(fresh and lapsed), the OSC Secret with its rollout annotations, the pool's Lease with a ledger,
the agents' Events — and the command, run as an operator runs it (its own process, the admin
kubeconfig), must report every node's state, the ledger and breaker, the units and the Leases.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from node_agent.commands import fleet
from node_agent.controllers.osc import pacing
from node_agent.kube import report
from node_agent.kube.client import KubeClient
from tests.testbed.agent_harness import NS, REPO
from tests.testbed.controlplane import ControlPlane

pytestmark = pytest.mark.integration

NEW = uuid.uuid4().hex * 2
OLD = uuid.uuid4().hex * 2


def micro(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def seconds(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


async def make_node(
    admin: KubeClient,
    name: str,
    pool: str,
    applied: str | None,
    conditions: list[dict[str, Any]] = (),  # type: ignore[assignment]
) -> None:
    await admin.nodes().create(
        {
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/hostname": name,
                    fleet.LABEL_POOL: pool,
                    report.LABEL_KUBERNETES_VERSION: "1.33.1",
                },
                "annotations": {report.ANNOTATION_APPLIED_CHECKSUM: applied} if applied else {},
            }
        }
    )
    if conditions:
        now = seconds(datetime.now(UTC))
        for cond in conditions:
            cond.setdefault("lastHeartbeatTime", now)
            cond.setdefault("lastTransitionTime", now)
        await admin.patch_node_status(name, {"status": {"conditions": conditions}})


async def make_lease(
    admin: KubeClient,
    name: str,
    renewed: datetime,
    annotations: dict[str, str] | None = None,
    *,
    holder: str | None = None,
) -> None:
    """A Lease renewed at ``renewed`` by ``holder`` (default: its own name, as a heartbeat)."""
    await admin.leases(NS).create(
        {
            "metadata": {"name": name, "namespace": NS, "annotations": annotations or {}},
            "spec": {
                "holderIdentity": holder or name,
                "leaseDurationSeconds": 40,
                "renewTime": micro(renewed),
            },
        },
    )


async def make_event(admin: KubeClient, node: str, reason: str, message: str) -> None:
    now = seconds(datetime.now(UTC))
    await admin.events("default").create(
        {
            "metadata": {"name": f"{node}.{uuid.uuid4().hex[:12]}", "namespace": "default"},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node},
            "reason": reason,
            "message": message,
            "type": "Warning",
            "source": {"component": "gardener-node-agent", "host": node},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        },
    )


async def fleet_cli(kubeconfig: str, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "node_agent",
        "fleet",
        *args,
        cwd=REPO,
        env={**os.environ, "KUBECONFIG": kubeconfig},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_fleet_reports_every_state_of_a_pool(control_plane: ControlPlane) -> None:
    suffix = uuid.uuid4().hex[:6]
    pool = f"fleet-{suffix}"
    secret_name = f"gardener-node-agent-{pool}-{uuid.uuid4().hex[:16]}"
    now = datetime.now(UTC)
    n = {
        state: f"{state}-{suffix}"
        for state in (
            "ok",
            "applying",
            "waiting",
            "rolledback",
            "quarantined",
            "failed",
            "gone",
            "nolease",
            "units",
        )
    }
    admin = KubeClient.from_kubeconfig(control_plane.admin_kubeconfig)
    await admin.secrets(NS).create(
        {
            "metadata": {
                "name": secret_name,
                "namespace": NS,
                "labels": {fleet.LABEL_ROLE: fleet.ROLE_OSC, fleet.LABEL_POOL: pool},
                "annotations": {
                    report.ANNOTATION_SECRET_CHECKSUM: NEW,
                    pacing.ANNOTATION_MAX_PARALLEL: "1",
                    pacing.ANNOTATION_CANARIES: "0",
                    pacing.ANNOTATION_MAX_FAILURES: "2",
                },
            },
            "data": {"osc.yaml": "c2VjcmV0LWNvbnRlbnQtbmV2ZXItc2hvd24="},
        },
    )
    ledger = pacing.Ledger(
        checksum=NEW,
        slots=(pacing.Slot(n["applying"], NEW, now.timestamp(), 600.0),),
        failed={
            n["quarantined"]: "rolled back: kubelet.service: exited (exit-code 1)",
            n["failed"]: "ApplyError: /etc/x: permission denied",
        },
    )
    await make_lease(admin, secret_name, now, {pacing.ANNOTATION_LEDGER: ledger.dump()})
    short = NEW[:12]
    await make_node(admin, n["ok"], pool, NEW)
    await make_node(admin, n["applying"], pool, OLD)
    await make_node(
        admin,
        n["waiting"],
        pool,
        OLD,
        [
            {
                "type": "OSCRollout",
                "status": "False",
                "reason": "WaitingForSlot",
                "message": f"all 1 rollout slot(s) are taken (holders: {n['applying']})",
            }
        ],
    )
    await make_node(admin, n["rolledback"], pool, OLD)
    await make_event(
        admin,
        n["rolledback"],
        "OSCRolledBack",
        f"OSC {short} rolled back to {OLD[:12]}: kubelet.service: exited; restarted kubelet",
    )
    await make_node(admin, n["quarantined"], pool, OLD)
    await make_node(
        admin,
        n["failed"],
        pool,
        OLD,
        [
            {
                "type": "OSCRollout",
                "status": "False",
                "reason": "RolloutFailed",
                "message": f"OSC {short} failed: ApplyError: /etc/x: permission denied",
            }
        ],
    )
    await make_node(admin, n["gone"], pool, NEW)
    await make_node(admin, n["nolease"], pool, None)
    await make_node(
        admin,
        n["units"],
        pool,
        NEW,
        [
            {
                "type": "SystemdUnitsReady",
                "status": "False",
                "reason": "UnhealthyUnits",
                "message": "kubelet.service: failed (exit-code); foo.service: node-agent stopped "
                "restarting it after 5 failed restarts within 10m, until the OSC changes",
            }
        ],
    )
    for key in ("ok", "applying", "waiting", "rolledback", "quarantined", "failed", "units"):
        await make_lease(admin, fleet.LEASE_PREFIX + n[key], now)
    await make_lease(admin, fleet.LEASE_PREFIX + n["gone"], now - timedelta(minutes=5))

    await admin.close()
    kubeconfig = str(control_plane.admin_kubeconfig)
    code, out, err = await fleet_cli(kubeconfig, "--pool", pool, "-o", "json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    (pd,) = doc["pools"]
    states = {line["name"]: line["state"] for line in pd["nodeStates"]}
    assert states == {
        n["ok"]: "up-to-date",
        n["applying"]: "applying",
        n["waiting"]: "waiting",
        n["rolledback"]: "rolled-back",
        n["quarantined"]: "quarantined",
        n["failed"]: "failed",
        n["gone"]: "not-reporting",
        n["nolease"]: "not-reporting",
        n["units"]: "up-to-date",
    }
    assert pd["states"]["up-to-date"] == 2
    assert pd["desired"] == NEW
    assert pd["applied"] == {OLD: 5, NEW: 3, "": 1}
    assert pd["secrets"] == [{"name": secret_name, "checksum": NEW}]
    rollout = pd["rollout"]
    assert rollout["mode"] == "paced"
    assert rollout["maxParallel"] == 1
    assert [s["host"] for s in rollout["ledger"]["slots"]] == [n["applying"]]
    assert rollout["breakerOpen"] is True
    assert rollout["breaker"].startswith("2/2 failures: ")
    assert pd["unitsNotReady"]["units"] == {"kubelet.service": 1, "foo.service": 1}
    assert pd["heldUnits"] == {"foo.service": [n["units"]]}
    assert pd["leases"]["fresh"] == 7
    assert pd["leases"]["stale"] == 1
    assert pd["leases"]["missing"] == 1
    assert pd["versions"]["kubernetes"] == {"1.33.1": 9}
    assert "c2VjcmV0" not in out  # the Secret's data is never read

    code, text, err = await fleet_cli(kubeconfig, "--pool", pool)
    assert (code, err) == (0, "")
    print(text)
    assert f"pool {pool}: OSC Secret {secret_name} ({short})" in text
    assert "2/9 up to date (22%)" in text
    assert "breaker OPEN: 2/2 failures" in text
    assert f"slots 1/1: {n['applying']} " in text
    assert f"restart-storm guard holds foo.service on 1: {n['units']}" in text
    assert "Leases: 7 fresh, 1 lapsed, 1 missing" in text
    for key, label in (
        ("rolledback", "rolled back"),
        ("quarantined", "quarantined"),
        ("failed", "failed"),
        ("waiting", "waiting for a slot"),
        ("gone", "not reporting"),
    ):
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(n[key] + " "))
        assert label in line, line

    # One list per kind, paginated: with pages of 2 the requests are exactly the pages, and
    # each kind took the pages its items need (no request per node at all).
    async with KubeClient.from_kubeconfig(control_plane.admin_kubeconfig) as kube:
        shown = await fleet.collect(kube, [pool], page=2)
    assert len(shown.pools[0].nodes) == 9
    print(f"pages {dict(shown.pages)}, listed {dict(shown.listed)}, {shown.requests} requests")
    assert shown.listed["nodes"] == 9
    assert shown.listed["secrets"] == 1
    assert shown.pages["nodes"] >= 5
    assert shown.pages["secrets"] == 1
    for kind, items in shown.listed.items():
        assert shown.pages[kind] >= max(1, -(-items // 2)), kind
    assert shown.requests == sum(shown.pages.values())


async def test_watch_follows_a_rollout_until_every_node_is_up_to_date(
    control_plane: ControlPlane,
) -> None:
    suffix = uuid.uuid4().hex[:6]
    pool = f"watch-{suffix}"
    names = [f"w{i}-{suffix}" for i in range(3)]
    now = datetime.now(UTC)
    async with KubeClient.from_kubeconfig(control_plane.admin_kubeconfig) as admin:
        await admin.secrets(NS).create(
            {
                "metadata": {
                    "name": f"gardener-node-agent-{pool}",
                    "namespace": NS,
                    "labels": {fleet.LABEL_ROLE: fleet.ROLE_OSC, fleet.LABEL_POOL: pool},
                    "annotations": {report.ANNOTATION_SECRET_CHECKSUM: NEW},
                }
            }
        )
        for name in names:
            await make_node(admin, name, pool, OLD)
            await make_lease(admin, fleet.LEASE_PREFIX + name, now + timedelta(minutes=5))
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "node_agent",
            "fleet",
            "--kubeconfig",
            str(control_plane.admin_kubeconfig),
            "--pool",
            pool,
            "--watch",
            "--interval",
            "0.3",
            "-o",
            "json",
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        first = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
        assert first["pools"][0]["states"]["applying"] == 3
        assert first["done"] is False
        for name in names:  # the rollout: each agent writes its checksum
            await admin.patch_node(
                name, {"metadata": {"annotations": {"checksum/cloud-config-data": NEW}}}
            )
            await asyncio.sleep(1.5)  # several refreshes per step
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    docs = [first, *(json.loads(line) for line in out.decode().splitlines())]
    progress = [d["pools"][0]["states"]["up-to-date"] for d in docs]
    print(f"{len(docs)} refreshes, up to date: {progress}")
    assert progress == sorted(progress)  # never goes back
    assert progress[-1] == 3
    assert docs[-1]["done"] is True
    assert len(set(progress)) >= 3  # it saw the rollout progress, not only its end


#: terminal controls an agent could write into its Node, its Lease, the pool's Lease or an Event
CONTROLS = "\x1b[31m\x9b2J\x1b]0;owned\x07\x1b]8;;http://e\x1b\\\x85\r\u202e"


def raw_controls(text: str) -> set[str]:
    import unicodedata

    return {ch for ch in text if ch != "\n" and unicodedata.category(ch) in ("Cc", "Cf")}


async def test_what_agents_wrote_is_shown_escaped_and_the_policy_as_the_agents_follow_it(
    control_plane: ControlPlane,
) -> None:
    """Strings through the real API server, as any node's agent can write them, reach the
    terminal escaped and JSON exactly; the rollout is shown as the agents cap it."""
    from node_agent.base.text import escape_controls

    suffix = uuid.uuid4().hex[:6]
    pool = f"hostile-{suffix}"
    secret_name = f"gardener-node-agent-{pool}-{uuid.uuid4().hex[:16]}"
    node = f"h-{suffix}"
    now = datetime.now(UTC)
    hostile = {
        key: f"{key}{CONTROLS}end"
        for key in ("applied", "unit_message", "holder", "slot_host", "why", "event")
    }
    async with KubeClient.from_kubeconfig(control_plane.admin_kubeconfig) as admin:
        await admin.secrets(NS).create(
            {
                "metadata": {
                    "name": secret_name,
                    "namespace": NS,
                    "labels": {fleet.LABEL_ROLE: fleet.ROLE_OSC, fleet.LABEL_POOL: pool},
                    "annotations": {
                        report.ANNOTATION_SECRET_CHECKSUM: NEW,
                        report.ANNOTATION_SERIAL: "true",
                        pacing.ANNOTATION_MAX_PARALLEL: "1",
                        pacing.ANNOTATION_MAX_FAILURES: "5",
                        pacing.ANNOTATION_SOAK: "1000h",
                    },
                }
            }
        )
        ledger = pacing.Ledger(
            checksum=NEW,
            slots=(pacing.Slot(hostile["slot_host"], NEW, now.timestamp(), 600.0),),
            failed={node: hostile["why"]},
        )
        await make_lease(
            admin,
            secret_name,
            now,
            {pacing.ANNOTATION_LEDGER: ledger.dump()},
            holder=hostile["holder"],
        )
        units = {
            "type": "SystemdUnitsReady",
            "status": "False",
            "reason": "UnhealthyUnits",
            "message": f"kubelet.service: {hostile['unit_message']}",
        }
        await make_node(admin, node, pool, hostile["applied"], [units])
        await make_lease(admin, fleet.LEASE_PREFIX + node, now)
        await make_event(admin, node, "OSCApplyFailed", hostile["event"])

    kubeconfig = str(control_plane.admin_kubeconfig)
    code, text, err = await fleet_cli(kubeconfig, "--pool", pool)
    assert (code, err) == (0, "")
    print(text)
    assert raw_controls(text) == set()
    for key in ("unit_message", "holder", "slot_host", "why"):
        assert escape_controls(hostile[key]) in text, key
    assert escape_controls(hostile["applied"][:12]) in text
    assert f"(soak {pacing.MAX_SOAK:g}s)" in text
    assert "rollout-canary-soak is above 86400s (capped)" in text

    code, out, err = await fleet_cli(kubeconfig, "--pool", pool, "-o", "json")
    assert (code, err) == (0, "")
    (pd,) = json.loads(out)["pools"]
    assert pd["applied"] == {hostile["applied"]: 1}
    assert pd["rollout"]["serialHolder"] == hostile["holder"]
    assert pd["rollout"]["ledger"]["slots"][0]["host"] == hostile["slot_host"]
    assert pd["rollout"]["ledger"]["failed"] == {node: hostile["why"]}
    assert pd["unitsNotReady"]["nodes"][0]["units"][0]["message"] == hostile["unit_message"]
    assert pd["rollout"]["problems"] == [
        f"{pacing.ANNOTATION_SOAK} is above {pacing.MAX_SOAK:g}s (capped)"
    ]
