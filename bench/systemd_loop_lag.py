"""Event-loop lag while the systemd adapter applies 50 units, with wall time per phase.

Why: pystemd holds the GIL during D-Bus calls; the adapter runs it in a worker process so the
agent's loop (and its Lease heartbeat) keeps ticking. This boots a real, isolated systemd (the
test bed), writes 50 units, then reloads, enables and restarts them through ``Systemd`` while a
ticker measures how late a 5 ms sleep wakes up. Run as root from the repository root:

    .venv/bin/python -m bench.systemd_loop_lag [--units 50] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from node_agent.systemd import Systemd
from tests.testbed.systemd_ns import IsolatedSystemd

UNIT = """\
[Unit]
Description=bench unit {i}
StartLimitIntervalSec=0

[Service]
ExecStart=/bin/sleep infinity

[Install]
WantedBy=multi-user.target
"""


def percentile(ordered: list[float], p: float) -> float:
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


CURRENT_PHASE = ["idle"]


async def ticker(lags: list[float], worst: dict[str, float], period: float = 0.005) -> None:
    loop = asyncio.get_running_loop()
    while True:
        before = loop.time()
        await asyncio.sleep(period)
        lag = loop.time() - before - period
        lags.append(lag)
        worst[CURRENT_PHASE[0]] = max(worst.get(CURRENT_PHASE[0], 0.0), lag)


async def bench(systemd: IsolatedSystemd, units: int, rounds: int) -> None:
    names = [f"bench-{i:03d}.service" for i in range(units)]
    lags: list[float] = []
    worst: dict[str, float] = {}
    phases: list[tuple[str, float]] = []

    async def phase(name: str, action: Callable[[], Awaitable[Any]]) -> Any:
        CURRENT_PHASE[0] = name
        started = time.perf_counter()
        result = await action()
        phases.append((name, time.perf_counter() - started))
        await asyncio.sleep(0.01)  # let the ticker attribute the tail of this phase
        CURRENT_PHASE[0] = "idle"
        return result

    adapter = Systemd(systemd.bus_address)
    tick = asyncio.create_task(ticker(lags, worst))
    try:
        await phase("start worker", adapter.start)

        async def write_units() -> None:
            for i, name in enumerate(names):
                systemd.path(f"/etc/systemd/system/{name}").write_text(UNIT.format(i=i))

        await phase(f"write {units} unit files", write_units)
        await phase("daemon-reload", adapter.daemon_reload)
        await phase(f"enable {units}", lambda: adapter.enable(names))
        started = await phase(
            f"start {units}", lambda: adapter.run_jobs([(n, "start") for n in names])
        )
        assert all(r.ok for r in started.values()), [r.describe() for r in started.values()]
        for round_ in range(rounds):
            restarted = await phase(
                f"restart {units} (round {round_ + 1})",
                lambda: adapter.run_jobs([(n, "restart") for n in names], job_timeout=30),
            )
            assert all(r.ok for r in restarted.values())
        states = await phase(f"unit_states {units}", lambda: adapter.unit_states(names))
        assert all(s.active_state == "active" for s in states.values())
        await phase(f"stop {units}", lambda: adapter.run_jobs([(n, "stop") for n in names]))
    finally:
        tick.cancel()
        await adapter.close()

    print(f"systemd {adapter.systemd_version}, {units} units, worker process, 5 ms ticker")
    print(f"  {'phase':<28} {'wall':>11} {'worst lag':>12}")
    for name, seconds in phases:
        print(f"  {name:<28} {seconds * 1000:8.1f} ms {worst.get(name, 0.0) * 1000:9.2f} ms")
    ordered = sorted(lags)
    print(
        f"loop lag over {len(ordered)} ticks: "
        f"p50 {percentile(ordered, 0.50) * 1000:.2f} ms, "
        f"p95 {percentile(ordered, 0.95) * 1000:.2f} ms, "
        f"p99 {percentile(ordered, 0.99) * 1000:.2f} ms, "
        f"max {ordered[-1] * 1000:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    cache = Path(os.environ.get("NODE_AGENT_TEST_CACHE", Path.home() / ".cache/node-agent-test"))
    workdir = cache / "run" / f"bench-{uuid.uuid4().hex[:8]}"
    workdir.mkdir(parents=True)
    try:
        with IsolatedSystemd(workdir) as systemd:
            asyncio.run(bench(systemd, opts.units, opts.rounds))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
