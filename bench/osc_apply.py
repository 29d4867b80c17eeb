"""OSC apply figures on the real test bed (kube-apiserver + etcd, systemd on a throwaway node).

Prints:
- Secret update → the changed unit active again (p50/p95/max over --runs updates);
- first apply of --files files and --units units (wall time, API requests, loop lag p99);
- CPU time of handling an event whose OSC is unchanged (no host action);
- event-loop lag during the big apply (a 5 ms ticker).

Run as root from the repository root:  .venv/bin/python -m bench.osc_apply [--runs 20]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import time
import uuid
from typing import Any

from node_agent.systemd import Systemd
from tests.conftest import api_client_from, cache_dir
from tests.testbed.agent_harness import OSCAgent, inline_file, osc_document, service
from tests.testbed.controlplane import ControlPlane
from tests.testbed.systemd_ns import IsolatedSystemd


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


class LagMeter:
    """How late a 5 ms sleep wakes up: the agent's responsiveness while it works."""

    def __init__(self, period: float = 0.005) -> None:
        self.period = period
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.period)
            self.lags.append(time.perf_counter() - start - self.period)

    def __enter__(self) -> LagMeter:
        self._task = asyncio.get_running_loop().create_task(self._tick())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


def big_osc(files: int, units: int) -> dict[str, Any]:
    file_list = [
        inline_file(f"/etc/bench/d{i % 20}/f{i}.conf", f"file {i}\n" * 20) for i in range(files)
    ]
    unit_list = [
        service(f"bench-{i}.service", filePaths=[f"/etc/bench/d{i % 20}/f{i}.conf"])
        for i in range(units)
    ]
    return osc_document(file_list, unit_list)


async def main(args: argparse.Namespace) -> None:
    work = cache_dir() / "bench" / uuid.uuid4().hex[:8]
    work.mkdir(parents=True)
    cp = ControlPlane(work / "cp")
    cp.start()
    node = IsolatedSystemd(work / "nodes", overlay=True)
    node.start()
    try:
        async with await api_client_from(cp.admin_kubeconfig) as admin:
            agent = OSCAgent(admin, cp, node, work)
            await agent.setup()
            await agent.start()
            assert agent.ctx is not None
            assert agent.controller is not None
            kube = agent.ctx.kube

            # 1. first apply of a big OSC
            osc = big_osc(args.files, args.units)
            requests_before = kube.stats.requests
            with LagMeter() as lag:
                t0 = time.perf_counter()
                checksum = await agent.publish(osc)
                await agent.wait_applied(checksum, timeout=600)
                first = time.perf_counter() - t0
            outcome = agent.controller.last_outcome
            print(
                f"first apply: {args.files} files, {args.units} units: {first:.2f} s wall "
                f"(apply itself {outcome.report.duration if outcome else float('nan'):.2f} s), "
                f"{kube.stats.requests - requests_before} API requests by the agent"
            )
            print(
                f"  loop lag during it: p50 {pct(lag.lags, 0.5) * 1e3:.2f} ms, "
                f"p99 {pct(lag.lags, 0.99) * 1e3:.2f} ms, max {max(lag.lags) * 1e3:.2f} ms "
                f"({len(lag.lags)} ticks)"
            )

            # 2. Secret update -> changed unit active again
            probe = Systemd(node.bus_address)
            await probe.start()
            latencies: list[float] = []
            with LagMeter() as lag2:
                for run in range(args.runs):
                    i = run % args.units
                    unit = f"bench-{i}.service"
                    old = (await probe.unit_states([unit]))[unit].invocation_id
                    osc["spec"]["files"][i]["content"]["inline"]["data"] = f"run {run}\n"
                    t0 = time.perf_counter()
                    await agent.publish(osc)
                    while True:
                        state = (await probe.unit_states([unit]))[unit]
                        if state.invocation_id != old and state.active_state == "active":
                            break
                        if time.perf_counter() - t0 > 60:
                            raise RuntimeError(f"{unit} did not restart")
                    latencies.append(time.perf_counter() - t0)
                    await agent.wait_applied(await agent.publish(osc))
            await probe.close()
            ms = [v * 1e3 for v in latencies]
            print(
                f"Secret update -> changed unit active again ({args.runs} runs): "
                f"p50 {pct(ms, 0.5):.0f} ms, p95 {pct(ms, 0.95):.0f} ms, max {max(ms):.0f} ms"
            )
            print(f"  loop lag meanwhile: p99 {pct(lag2.lags, 0.99) * 1e3:.2f} ms")

            # 3. unchanged OSC: CPU per event
            secret = await kube.get_secret("kube-system", agent.secret_name)
            cpu: list[float] = []
            for _ in range(50):
                c0 = time.process_time()
                result = await agent.controller.reconcile(secret)
                cpu.append(time.process_time() - c0)
                assert result is None
            print(
                f"unchanged OSC ({args.files} files): CPU per event median "
                f"{statistics.median(cpu) * 1e3:.2f} ms, p95 {pct(cpu, 0.95) * 1e3:.2f} ms "
                "(decode + checksum verify + compare; no host action)"
            )
            await agent.stop()
    finally:
        node.stop()
        cp.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--files", type=int, default=500)
    parser.add_argument("--units", type=int, default=100)
    asyncio.run(main(parser.parse_args()))
