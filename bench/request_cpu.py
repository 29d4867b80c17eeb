"""CPU the agent's Kubernetes client spends per API request, on the test bed's kube-apiserver.

The heartbeat Lease's renewal (a compare-and-swap PUT every 10 s) is the idle agent's most
frequent request, and every request on the hot path goes through the same client, so its CPU per
request is a figure of both. Measured in this process (user and system CPU of ``getrusage``;
on loopback the kernel's TCP work for both ends is part of the system share) over ``--requests``
renewals after a warm-up, three times.

Run as root from the repository root:  .venv/bin/python -m bench.request_cpu [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from node_agent.controllers.lease import desired_lease, lease_name, lease_timeouts
from node_agent.kube.client import KubeClient
from tests.testbed.controlplane import ControlPlane

NODE = "bench-request-cpu"
NS = "kube-system"


def cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


async def renewals(kube: KubeClient, current: dict[str, Any], count: int) -> dict[str, Any]:
    for _ in range(count):
        body = desired_lease(NODE, None, datetime.now(UTC), current)
        current = await kube.update_lease(NS, lease_name(NODE), body)
    return current


async def measure(control_plane: ControlPlane, requests: int, runs: int) -> None:
    kube = KubeClient.from_kubeconfig(control_plane.admin_kubeconfig, timeouts=lease_timeouts())
    try:
        current = await kube.create_lease(NS, desired_lease(NODE, None, datetime.now(UTC)))
        current = await renewals(kube, current, 20)  # connection and caches warm
        per_request: list[tuple[float, float]] = []
        for _ in range(runs):
            (user0, sys0) = cpu()
            current = await renewals(kube, current, requests)
            (user1, sys1) = cpu()
            per_request.append(((user1 - user0) / requests, (sys1 - sys0) / requests))
    finally:
        await kube.close()
    for user, system in per_request:
        print(
            f"{requests} renewals: {(user + system) * 1000:.2f} ms CPU per request "
            f"(user {user * 1000:.2f}, system {system * 1000:.2f})"
        )
    total = [(u + s) * 1000 for u, s in per_request]
    print(f"median {statistics.median(total):.2f} ms CPU per request")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir, ControlPlane(Path(workdir)) as control_plane:
        asyncio.run(measure(control_plane, args.requests, args.runs))


if __name__ == "__main__":
    main()
