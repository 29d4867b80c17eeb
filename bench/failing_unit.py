"""A failing unit among changed healthy units, on the real test bed: who restarts how often.

One OSC changes --units healthy units and adds one unit that can never start (a oneshot whose
ExecStart exits 1). The agent retries with its backoff for --seconds; then the failing unit is
dropped and the OSC converges. Every unit logs each start on the node, so the counts are exact.

Prints: restarts of each healthy unit for its change (1 each is right: a retry redoes only what
failed), the failing unit's start attempts and the Warning Events naming it, and the time from
the fixed OSC to the checksum on the Node.

Run as root from the repository root:  .venv/bin/python -m bench.failing_unit [--seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import time
import uuid
from collections import Counter
from typing import Any

from tests.conftest import api_client_from, cache_dir
from tests.testbed.agent_harness import (
    OSCAgent,
    counted_service,
    osc_document,
    starts,
    wait_for,
)
from tests.testbed.controlplane import ControlPlane
from tests.testbed.systemd_ns import IsolatedSystemd

FAILING = "bench-failing.service"
ANNOTATION = "checksum/cloud-config-data"


def healthy(count: int, tag: str) -> list[dict[str, Any]]:
    return [counted_service(f"bench-ok-{i:02d}.service", tag) for i in range(count)]


def failing() -> dict[str, Any]:
    return counted_service(FAILING, "attempt", "/bin/false", extra="Type=oneshot\n")


async def main(args: argparse.Namespace) -> None:
    work = cache_dir() / "bench" / uuid.uuid4().hex[:8]
    work.mkdir(parents=True)
    cp = ControlPlane(work / "cp")
    cp.start()
    node = IsolatedSystemd(work / "nodes", overlay=True)
    node.start()
    names = [f"bench-ok-{i:02d}.service" for i in range(args.units)]
    try:
        async with await api_client_from(cp.admin_kubeconfig) as admin:
            agent = OSCAgent(admin, cp, node, work)
            await agent.setup()
            await agent.start()

            first = await agent.publish(osc_document([], healthy(args.units, "v1")))
            await agent.wait_applied(first)

            broken = osc_document([], [*healthy(args.units, "v2"), failing()])
            await agent.publish(broken)
            await wait_for(lambda: starts(node, FAILING), 30, "the failing unit's first attempt")
            print(f"{args.units} changed healthy units + 1 failing unit; retrying {args.seconds} s")
            await asyncio.sleep(args.seconds)

            per_unit = {name: starts(node, name).count("v2") for name in names}
            attempts = len(starts(node, FAILING))
            warnings = await agent.warnings(FAILING)
            annotation = (await agent.node_annotations()).get(ANNOTATION)
            spread = Counter(per_unit.values())
            print(
                "restarts of each healthy unit for its change: "
                + ", ".join(f"{n} unit(s) restarted {k}x" for k, n in sorted(spread.items()))
            )
            for name, count in per_unit.items():
                if count != 1:
                    print(f"  {name}: {count} restarts (starts log {starts(node, name)})")
            print(
                f"failing unit: {attempts} start attempts, {len(warnings)} Warning Events naming "
                f"it; Node checksum still the previous OSC: {annotation == first}"
            )

            fixed = await agent.publish(osc_document([], healthy(args.units, "v2")))
            t0 = time.perf_counter()
            await agent.wait_applied(fixed, timeout=120)
            took = time.perf_counter() - t0
            again = sum(starts(node, name).count("v2") for name in names) - sum(per_unit.values())
            print(
                f"fixed OSC (failing unit dropped): on the Node after {took:.2f} s; "
                f"healthy units restarted again: {again}"
            )
            await agent.stop()
    finally:
        node.stop()
        cp.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=60.0)
    asyncio.run(main(parser.parse_args()))
