"""``node-agent fleet`` against a synthetic cluster of 5,000 Nodes: run time and requests.

Boots the test bed's kube-apiserver + etcd and writes, as an admin and without any agent, what
the agents of ``--pools`` worker pools would have published: the Nodes (checksum annotation,
pool and version labels, an ``OSCRollout`` or ``SystemdUnitsReady`` condition on some), one
heartbeat Lease per Node (some lapsed, some missing), one OSC Secret per pool (paced, with a
rollout Lease and its ledger) and a few Events. Creation runs ``--parallel`` requests at a time
and is bounded by ``--create-timeout`` (the figures then say how many objects exist).

Then, ``--rounds`` times each: the fleet view in this process (``collect`` + ``render``: wall
time, API requests, pages and items per kind) and the command as an operator runs it (its own
process, ``node-agent fleet -o json`` and the text screen: wall time including the start, peak
RSS). Prints one table.

    .venv/bin/python -m bench.fleet_view [--nodes 5000] [--pools 5] [--rounds 3] [--keep]

Run as root from the repository root.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

# The whole kubernetes_asyncio first: the test bed's helpers use it, and the fleet view's lean
# loader leaves an already imported package alone.
import kubernetes_asyncio.client  # noqa: F401

from node_agent.commands import fleet
from node_agent.controllers.osc import pacing
from node_agent.kube import report
from node_agent.kube.client import KubeClient
from tests.conftest import cache_dir
from tests.testbed.controlplane import ControlPlane

NS = "kube-system"
REPO = Path(__file__).resolve().parents[1]


def micro(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def seconds(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


async def bounded(parallel: int, jobs: list[Callable[[], Awaitable[Any]]], deadline: float) -> int:
    """Run ``jobs`` ``parallel`` at a time until ``deadline`` (monotonic); how many ran."""
    done = 0
    queue = iter(jobs)

    async def worker() -> None:
        nonlocal done
        for job in queue:
            if time.monotonic() > deadline:
                return
            await job()
            done += 1

    await asyncio.gather(*(worker() for _ in range(parallel)))
    return done


async def populate(kube: KubeClient, args: argparse.Namespace) -> dict[str, Any]:
    """The synthetic cluster; returns what was created and how long it took."""
    rng = random.Random(7)
    now = datetime.now(UTC)
    started = time.monotonic()
    deadline = started + args.create_timeout
    pools = [f"bench-{i}" for i in range(args.pools)]
    desired = {p: uuid.uuid4().hex * 2 for p in pools}
    old = uuid.uuid4().hex * 2
    jobs: list[Callable[[], Awaitable[Any]]] = []
    for pool in pools:
        secret = f"gardener-node-agent-{pool}-{uuid.uuid4().hex[:16]}"
        annotations = {
            report.ANNOTATION_SECRET_CHECKSUM: desired[pool],
            pacing.ANNOTATION_MAX_PARALLEL: "10",
            pacing.ANNOTATION_CANARIES: "2",
            pacing.ANNOTATION_MAX_FAILURES: "5",
        }
        body = {
            "metadata": {
                "name": secret,
                "namespace": NS,
                "labels": {fleet.LABEL_ROLE: fleet.ROLE_OSC, fleet.LABEL_POOL: pool},
                "annotations": annotations,
            },
            # a realistic size (Gardener's OSC is ~100 KiB): the fleet view must not read it
            "data": {"osc.yaml": "QUJD" * 25_000},
        }
        await kube.secrets(NS).create(body)
        ledger = pacing.Ledger(
            checksum=desired[pool],
            slots=tuple(
                pacing.Slot(f"{pool}-n{i:05d}", desired[pool], now.timestamp(), 600.0)
                for i in range(10)
            ),
            canaries=(f"{pool}-n00000", f"{pool}-n00001"),
            healthy={f"{pool}-n{i:05d}": now.timestamp() for i in range(10, 400)},
        )
        await kube.leases(NS).create(
            {
                "metadata": {
                    "name": secret,
                    "namespace": NS,
                    "annotations": {pacing.ANNOTATION_LEDGER: ledger.dump()},
                },
                "spec": {},
            }
        )
    per_pool = args.nodes // args.pools
    for pool in pools:
        for i in range(per_pool):
            name = f"{pool}-n{i:05d}"
            roll = rng.random()
            applied = desired[pool] if roll < 0.8 else old
            jobs.append(functools.partial(node, kube, name, pool, applied, roll, now))
    created = await bounded(args.parallel, jobs, deadline)
    return {
        "pools": len(pools),
        "nodes": created,
        "asked": per_pool * len(pools),
        "seconds": time.monotonic() - started,
        "complete": created == per_pool * len(pools),
    }


async def node(
    kube: KubeClient, name: str, pool: str, applied: str, roll: float, now: datetime
) -> None:
    """One Node as its agent left it, and its heartbeat Lease."""
    await kube.nodes().create(
        {
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/hostname": name,
                    fleet.LABEL_POOL: pool,
                    report.LABEL_KUBERNETES_VERSION: "1.33.1",
                },
                "annotations": {report.ANNOTATION_APPLIED_CHECKSUM: applied},
            }
        }
    )
    conditions = []
    stamp = seconds(now)
    if 0.8 <= roll < 0.9:
        conditions.append(
            {
                "type": "OSCRollout",
                "status": "False",
                "reason": "WaitingForSlot",
                "message": "all 10 rollout slot(s) are taken",
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": stamp,
            }
        )
    if roll < 0.01:
        conditions.append(
            {
                "type": "SystemdUnitsReady",
                "status": "False",
                "reason": "UnhealthyUnits",
                "message": "kubelet.service: failed (exit-code)",
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": stamp,
            }
        )
    if conditions:
        await kube.patch_node_status(name, {"status": {"conditions": conditions}})
    if roll > 0.99:
        return  # no Lease: an agent that never started
    # No agent renews these Leases during the bench: a fresh one lasts an hour (an agent's is
    # 40 s, renewed every 10 s), a lapsed one was last renewed two hours ago.
    renewed = now - timedelta(hours=2) if roll > 0.97 else now
    await kube.leases(NS).create(
        {
            "metadata": {"name": fleet.LEASE_PREFIX + name, "namespace": NS},
            "spec": {
                "holderIdentity": fleet.LEASE_PREFIX + name,
                "leaseDurationSeconds": 3600,
                "renewTime": micro(renewed),
            },
        }
    )


#: runs ``node-agent`` as its console script does, then reports the process's own peak RSS
#: (VmHWM: ``ru_maxrss`` would carry the forking bench's high-water mark across the exec)
CLI = (
    "import runpy, sys\n"
    "sys.argv = ['node-agent', *sys.argv[1:]]\n"
    "try:\n"
    "    runpy.run_module('node_agent', run_name='__main__')\n"
    "finally:\n"
    "    hwm = open('/proc/self/status').read().split('VmHWM:')[1].split()[0]\n"
    "    print('maxrss', hwm, file=sys.stderr)\n"
)


def run_cli(kubeconfig: Path, *args: str) -> tuple[float, int, str]:
    """The command in its own process: wall seconds, its peak RSS (KiB), stdout."""
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", CLI, "fleet", "--kubeconfig", str(kubeconfig), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"node-agent fleet failed: {proc.stderr[-2000:]}")
    rss = int(proc.stderr.rsplit("maxrss", 1)[1].split()[0])
    return wall, rss, proc.stdout


async def run(args: argparse.Namespace) -> None:
    work = cache_dir() / "bench" / f"fleet-view-{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True)
    cp = ControlPlane(work / "cp")
    try:
        cp.start()
        async with KubeClient.from_kubeconfig(cp.admin_kubeconfig) as kube:
            made = await populate(kube, args)
            print(
                f"created {made['nodes']}/{made['asked']} Nodes (+ Leases) in {made['pools']} "
                f"pools in {made['seconds']:.1f} s"
                + (
                    ""
                    if made["complete"]
                    else f" (stopped at --create-timeout {args.create_timeout:g} s)"
                ),
                flush=True,
            )
        inproc: list[tuple[float, float, int]] = []
        report = None
        for _ in range(args.rounds):
            async with KubeClient.from_kubeconfig(cp.admin_kubeconfig) as kube:
                started = time.monotonic()
                report = await fleet.collect(kube)
                listed = time.monotonic() - started
                fleet.render(report)
                total = time.monotonic() - started
            inproc.append((listed, total, report.requests))
        assert report is not None
        states: dict[str, int] = {}
        for pool in report.pools:
            for state, count in pool.states.items():
                states[state] = states.get(state, 0) + count
        cli_json = [run_cli(cp.admin_kubeconfig, "-o", "json") for _ in range(args.rounds)]
        cli_text = [run_cli(cp.admin_kubeconfig) for _ in range(args.rounds)]
        doc = json.loads(cli_json[-1][2])
        one_pool = [run_cli(cp.admin_kubeconfig, "--pool", "bench-0") for _ in range(args.rounds)]

        def med(values: list[float]) -> float:
            return statistics.median(values)

        rows = [
            (
                "nodes in the report",
                f"{sum(len(p.nodes) for p in report.pools)} in {len(report.pools)} pools",
            ),
            ("states", ", ".join(f"{k} {v}" for k, v in states.items() if v)),
            ("items listed", ", ".join(f"{k} {v}" for k, v in sorted(report.listed.items()))),
            ("pages (limit 500)", ", ".join(f"{k} {v}" for k, v in sorted(report.pages.items()))),
            ("API requests per view", f"{report.requests} (CLI: {doc['requests']})"),
            ("in-process: lists (median)", f"{med([r[0] for r in inproc]):.2f} s"),
            ("in-process: lists + text (median)", f"{med([r[1] for r in inproc]):.2f} s"),
            ("CLI -o json, all pools (median wall)", f"{med([r[0] for r in cli_json]):.2f} s"),
            ("CLI text, all pools (median wall)", f"{med([r[0] for r in cli_text]):.2f} s"),
            ("CLI text, --pool bench-0 (median wall)", f"{med([r[0] for r in one_pool]):.2f} s"),
            ("CLI peak RSS", f"{max(r[1] for r in cli_json + cli_text) / 1024:.0f} MiB"),
            ("CLI -o json output", f"{len(cli_json[-1][2]) / 1024:.0f} KiB"),
        ]
        width = max(len(r[0]) for r in rows)
        print()
        for key, value in rows:
            print(f"{key:<{width}}  {value}")
        print()
        print(cli_text[-1][2][:1500])
    finally:
        cp.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--pools", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parallel", type=int, default=16, help="creation requests at once")
    parser.add_argument("--create-timeout", type=float, default=900.0)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (the test bed's control plane)")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
