"""OSC apply figures of the whole agent (``node-agent run`` as a process) on the real test bed.

For each OSC size (files/units) and with the health gate on and off, on a fresh throwaway node
(kube-apiserver + etcd, its own systemd), the agent in its own cgroup prints:
- the first apply: wall time until the Node carries the checksum, and the apply itself (the
  agent's own ``OSC applied`` log line);
- a one-file change (one unit's file, so one unit restarted): Secret update → that unit active
  again, p50/p90/max over --rounds updates. The end is systemd's own ``ActiveEnterTimestamp``
  of the new invocation (CLOCK_MONOTONIC, the bench's clock too), so the bench's polling does
  not count; the next round starts once the Node carries the checksum;
- the CPU of a Secret event whose osc.yaml is unchanged (an annotation changed): the cgroup's
  ``usage_usec`` over the events minus the idle rate over the same time;
- idle CPU: the cgroup's ``usage_usec`` over --idle seconds after the last update settled,
  per minute (the agent and its systemd worker; the OSC has no kubelet or containerd; one
  token Secret is synced to a file, as on every Gardener node).

Run as root from the repository root:
  .venv/bin/python -m bench.osc_apply [--sizes 10:2,300:60,1200:240] [--rounds 20] [--idle 60]
                                      [--gate on,off] [--settle 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from node_agent.systemd import Systemd
from tests.conftest import api_client_from, cache_dir
from tests.testbed.agent_harness import (
    create_node,
    dump_osc,
    inline_file,
    osc_document,
    prepare_agent,
    publish_osc,
    put_secret,
    service,
    spawn_agent,
    wait_applied,
)
from tests.testbed.controlplane import ControlPlane
from tests.testbed.credentials import node_agent_credentials
from tests.testbed.systemd_ns import IsolatedSystemd, _cgroup2_root

#: a token synced to a file, as every Gardener node has (valitail's)
TOKEN_SECRET = "gardener-valitail"
TOKEN_PATH = "/var/lib/valitail/auth-token"
APPLIED = re.compile(r"OSC applied.*?seconds=([0-9.]+)")


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def big_osc(files: int, units: int) -> dict[str, Any]:
    """``files`` files in 20 directories; unit i uses file i (so changing file i restarts it)."""
    file_list = [
        inline_file(f"/etc/bench/d{i % 20}/f{i}.conf", f"file {i}\n" * 20) for i in range(files)
    ]
    unit_list = [
        service(f"bench-{i}.service", filePaths=[f"/etc/bench/d{i % 20}/f{i}.conf"])
        for i in range(units)
    ]
    return osc_document(file_list, unit_list)


class CPU:
    """CPU time of everything in one cgroup2 group (the agent and its systemd worker)."""

    def __init__(self, name: str) -> None:
        self.path = _cgroup2_root() / name
        self.path.mkdir()

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(f"{pid}\n")

    def usec(self) -> int:
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, value = line.split()
            if key == "usage_usec":
                return int(value)
        raise RuntimeError("no usage_usec in cpu.stat")

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def active_since(node: IsolatedSystemd, unit: str) -> tuple[str, float]:
    """The unit's invocation and when it entered ``active`` (CLOCK_MONOTONIC seconds)."""
    out = node.run(
        ["systemctl", "show", "-p", "InvocationID,ActiveEnterTimestampMonotonic", unit]
    ).stdout
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return props["InvocationID"], int(props["ActiveEnterTimestampMonotonic"]) / 1e6


async def one_case(
    admin: Any, cp: ControlPlane, work: Path, files: int, units: int, gate: bool, args: Any
) -> dict[str, str]:
    node = IsolatedSystemd(work / "nodes", overlay=True)
    node.start()
    name = f"node-{uuid.uuid4().hex[:6]}"
    secret = f"gardener-node-agent-{name}-osc"
    cpu = CPU(f"na-bench-{uuid.uuid4().hex[:8]}")
    proc = None
    probe = Systemd(node.bus_address)
    try:
        await create_node(admin, name)
        creds = await node_agent_credentials(
            admin,
            work / f"creds-{name}",
            server=cp.server,
            ca_file=cp.ca_file,
            node_name=name,
            secret_names=[secret, TOKEN_SECRET],
        )
        gate_cfg = {"enabled": gate, "settleWindow": f"{args.settle}s"}
        setup = prepare_agent(
            node.root, cp, creds, osc_secret=secret, node_agent={"healthGate": gate_cfg}
        )
        doc = yaml.safe_load(setup.config_file.read_text())
        doc["logLevel"] = "info"
        doc["server"] = {"healthProbes": {"port": 0}, "metrics": {"port": 0}}
        doc["controllers"]["token"]["syncConfigs"] = [
            {"secretName": TOKEN_SECRET, "path": TOKEN_PATH}
        ]
        setup.config_file.write_text(yaml.safe_dump(doc))
        log = work / f"{name}.log"
        proc = await spawn_agent(setup, node, name, log, env=dict(os.environ))
        cpu.add(proc.pid)
        await probe.start()

        osc = big_osc(files, units)
        t0 = time.perf_counter()
        checksum = await publish_osc(admin, secret, osc)
        await wait_applied(admin, name, checksum, timeout=900)
        first = time.perf_counter() - t0
        found = APPLIED.search(log.read_text(errors="replace"))
        itself = float(found.group(1)) if found else float("nan")

        latencies: list[float] = []
        for run in range(args.rounds):
            i = run % units
            unit = f"bench-{i}.service"
            old = (await probe.unit_states([unit]))[unit].invocation_id
            osc["spec"]["files"][i]["content"]["inline"]["data"] = f"run {run}\n"
            # serialized before the clock starts: what the bench spends making the document
            # (~80 ms of Python at 1,200 files) is not the agent's
            raw = dump_osc(osc)
            t0 = time.monotonic()
            checksum = await publish_osc(admin, secret, raw)
            deadline = t0 + 120
            while True:
                state = (await probe.unit_states([unit]))[unit]
                if state.invocation_id != old and state.active_state == "active":
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{unit} did not restart; see {log}")
                await asyncio.sleep(0.01)
            _, since = active_since(node, unit)
            latencies.append(since - t0)
            await wait_applied(admin, name, checksum, timeout=120)

        await asyncio.sleep(3)  # the last Events, the unit check after an apply
        c0, w0 = cpu.usec(), time.monotonic()
        await asyncio.sleep(args.idle)
        idle_rate = (cpu.usec() - c0) / (time.monotonic() - w0)  # usec per second

        events = 20
        c0, w0 = cpu.usec(), time.monotonic()
        for n in range(events):
            await publish_osc(admin, secret, osc, annotations={"bench/noop": str(n)})
            await asyncio.sleep(0.5)
        spent = cpu.usec() - c0 - idle_rate * (time.monotonic() - w0)
        ms = [v * 1e3 for v in latencies]
        return {
            "first": f"{first:.2f} s (apply {itself:.2f} s)",
            "change": f"{pct(ms, 0.5):.0f} / {pct(ms, 0.9):.0f} / {max(ms):.0f} ms",
            "noop": f"{spent / events / 1e3:.1f} ms",
            "idle": f"{idle_rate * 60 / 1e3:.0f} ms/min",
        }
    finally:
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        await probe.close()
        node.stop()
        cpu.remove()


async def main(args: argparse.Namespace) -> None:
    sizes = [tuple(int(x) for x in s.split(":")) for s in args.sizes.split(",")]
    gates = [g == "on" for g in args.gate.split(",")]
    work = cache_dir() / "bench" / uuid.uuid4().hex[:8]
    work.mkdir(parents=True)
    cp = ControlPlane(work / "cp")
    cp.start()
    async with await api_client_from(cp.admin_kubeconfig) as admin:
        await put_secret(admin, TOKEN_SECRET, {"token": b"bench-token"})
    print(f"load average at start: {Path('/proc/loadavg').read_text().strip()}", flush=True)
    rows: list[tuple[str, dict[str, str]]] = []
    try:
        async with await api_client_from(cp.admin_kubeconfig) as admin:
            for gate in gates:
                for files, units in sizes:
                    label = f"{files} files/{units} units, gate {'on' if gate else 'off'}"
                    row = await one_case(admin, cp, work, files, units, gate, args)
                    print(f"{label}: {row}", flush=True)
                    rows.append((label, row))
    finally:
        cp.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"load average at end: {Path('/proc/loadavg').read_text().strip()}")
    print()
    print(
        f"| OSC | first apply | one-file change p50 / p90 / max ({args.rounds} rounds) "
        f"| no-op event CPU | idle CPU ({args.idle:.0f} s) |"
    )
    print("|---|---|---|---|---|")
    for label, row in rows:
        print(f"| {label} | {row['first']} | {row['change']} | {row['noop']} | {row['idle']} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10:2,300:60,1200:240")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--idle", type=float, default=60.0)
    parser.add_argument("--gate", default="on,off")
    parser.add_argument("--settle", type=float, default=2.0, help="health gate settle window, s")
    asyncio.run(main(parser.parse_args()))
