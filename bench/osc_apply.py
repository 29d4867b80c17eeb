"""OSC apply figures of the whole agent (``node-agent run`` as a process) on the real test bed.

For each OSC size (files/units) and with the health gate on and off, on a fresh throwaway node
(kube-apiserver + etcd, its own systemd), the agent in its own cgroup prints:
- the first apply: wall time until the Node carries the checksum, and the apply itself (the
  agent's own ``OSC applied`` log line);
- a one-file change (one unit's file, so one unit restarted): Secret update → that unit active
  again, p50/p90/max over --rounds updates. The end is systemd's own ``ActiveEnterTimestamp``
  of the new invocation (CLOCK_MONOTONIC, the bench's clock too), so the bench's polling does
  not count; the next round starts once the Node carries the checksum. The update is one PUT
  of a body built before the clock starts. Split in two: the PUT sent → the watch event
  received whole by a bare watcher (a thread reading the raw watch stream, no client library:
  what any agent waits for, the API server's and etcd's share, which grows with the Secret),
  and that event → the unit active again (the agent's share);
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
import base64
import contextlib
import hashlib
import http.client
import json
import os
import re
import shutil
import socket
import threading
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client

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


def spread(seconds: list[float]) -> str:
    ms = [v * 1e3 for v in seconds]
    return f"{pct(ms, 0.5):.0f} / {pct(ms, 0.9):.0f} / {max(ms):.0f} ms"


class BareWatcher:
    """When each version of one Secret reached a plain watcher: monotonic time by resourceVersion.

    A thread reads the API server's raw watch stream (one JSON event per line) with the standard
    library, so neither the agent's client nor the bench's event loop is in the figure."""

    def __init__(self, cp: ControlPlane, name: str) -> None:
        query = urllib.parse.urlencode({"watch": "1", "fieldSelector": f"metadata.name={name}"})
        host = urllib.parse.urlsplit(cp.server)
        self._conn = http.client.HTTPSConnection(
            host.hostname or "", host.port, context=cp.admin_ssl_context()
        )
        self._conn.request("GET", f"/api/v1/namespaces/kube-system/secrets?{query}")
        self._resp = self._conn.getresponse()
        self.seen: dict[str, float] = {}
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # the stream shut down by close()
            while line := self._resp.readline():
                at = time.monotonic()
                version = json.loads(line)["object"]["metadata"]["resourceVersion"]
                with self._cond:
                    self.seen[version] = at
                    self._cond.notify_all()

    def arrival(self, version: str, timeout: float = 60) -> float:
        with self._cond:
            if not self._cond.wait_for(lambda: version in self.seen, timeout):
                raise RuntimeError(f"the bare watcher never saw resourceVersion {version}")
            return self.seen[version]

    def close(self) -> None:
        # shutting the socket down ends the thread's read (closing the response would wait for
        # the reader's lock)
        if self._conn.sock is not None:
            self._conn.sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(10)
        self._conn.close()


async def replace_osc(admin: Any, secret: str, body: bytes) -> str:
    """One PUT of an already serialized Secret; its new resourceVersion."""
    resp: Any = await client.CoreV1Api(admin).replace_namespaced_secret(
        secret, "kube-system", json.loads(body), _preload_content=False
    )  # the raw response: the bench does not build a model of the Secret it gets back
    answer = json.loads(await resp.read())
    return str(answer["metadata"]["resourceVersion"])


def secret_body(secret: str, raw: bytes) -> bytes:
    """The Secret as Gardener writes it, JSON-encoded once (outside the timed part)."""
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": secret,
                "namespace": "kube-system",
                "labels": {
                    "gardener.cloud/role": "operating-system-config",
                    "worker.gardener.cloud/pool": "pool-a",
                },
                "annotations": {"checksum/data-script": hashlib.sha256(raw).hexdigest()},
            },
            "data": {"osc.yaml": base64.b64encode(raw).decode()},
        }
    ).encode()


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
        delivered: list[float] = []
        agent_share: list[float] = []
        watcher = BareWatcher(cp, secret)
        try:
            for run in range(args.rounds):
                i = run % units
                unit = f"bench-{i}.service"
                old = (await probe.unit_states([unit]))[unit].invocation_id
                osc["spec"]["files"][i]["content"]["inline"]["data"] = f"run {run}\n"
                # serialized before the clock starts: what the bench spends making the document
                # (~80 ms of Python at 1,200 files) is not the agent's
                raw = dump_osc(osc)
                body = secret_body(secret, raw)
                t0 = time.monotonic()
                version = await replace_osc(admin, secret, body)
                deadline = t0 + 120
                while True:
                    state = (await probe.unit_states([unit]))[unit]
                    if state.invocation_id != old and state.active_state == "active":
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{unit} did not restart; see {log}")
                    await asyncio.sleep(0.01)
                _, since = active_since(node, unit)
                arrived = watcher.arrival(version)
                latencies.append(since - t0)
                delivered.append(arrived - t0)
                agent_share.append(since - arrived)
                await wait_applied(admin, name, hashlib.sha256(raw).hexdigest(), timeout=120)
        finally:
            watcher.close()

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
        return {
            "first": f"{first:.2f} s (apply {itself:.2f} s)",
            "change": spread(latencies),
            "delivered": f"{pct(delivered, 0.5) * 1e3:.0f} ms",
            "agent": spread(agent_share),
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
        "| of which delivery to a bare watcher, p50 | event → unit active, p50 / p90 / max "
        f"| no-op event CPU | idle CPU ({args.idle:.0f} s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, row in rows:
        print(
            f"| {label} | {row['first']} | {row['change']} | {row['delivered']} "
            f"| {row['agent']} | {row['noop']} | {row['idle']} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10:2,300:60,1200:240")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--idle", type=float, default=60.0)
    parser.add_argument("--gate", default="on,off")
    parser.add_argument("--settle", type=float, default=2.0, help="health gate settle window, s")
    asyncio.run(main(parser.parse_args()))
