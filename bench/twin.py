"""node-agent next to upstream gardener-node-agent v1.150.0, measured the same way in one run.

Boots the test bed (kube-apiserver + etcd with an audit log, kube-controller-manager signing the
agents' CSRs, Gardener's CSR approver) and two twin throwaway nodes (real systemd, real
containerd, a stand-in kubelet serving ``/healthz``). Both nodes get Gardener's own provision
files for a machine of their own (``gardener_gen``: bootstrap token, ``config-v1.150.0.yaml``,
the cluster CA), both agents get a client certificate through the CSR flow and run as Gardener's
own ``gardener-node-agent.service`` from ``/opt/bin/gardener-node-agent``: upstream's binary on
one node, node-agent's single file (the one its image carries) on the other. Each reads a
Secret of its own; both Secrets always carry the same ``osc.yaml`` bytes. Prints, per figure,
node-agent, upstream, the ratio node-agent / upstream and the goal:

1. Secret update → the changed unit restarted (one inline file named by the unit's
   ``filePaths`` changes): from the update's API response to the unit's new
   ``ActiveEnterTimestampMonotonic`` (systemd's own clock; CLOCK_MONOTONIC is the host's),
   p50/p90 over ``--rounds``, node-agent's health gate on (its default) and then off;
2. agent started → small OSC applied: ``ExecMainStartTimestampMonotonic`` → the Node's
   ``checksum/cloud-config-data`` seen (a Node watch) and → the changed file's mtime;
3. idle CPU: the service cgroup's ``cpu.stat`` ``usage_usec`` over ``--idle`` seconds;
4. first apply of a 300-file / 60-unit OSC: Secret created → Node annotated, and → the last of
   the 60 units active (systemd's timestamp);
5. whole-service PSS (``smaps_rollup`` of every process of the service's cgroup) and API
   requests per minute while idle (kube-apiserver's audit events by the agent's identity).

    .venv/bin/python -m bench.twin [--rounds 20] [--starts 5] [--idle 120] [--settle 30s]
        [--no-gate-off] [--onedir]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client import ApiClient

from bench.api_load import parse_time, read_audit
from bench.footprint import cgroup, cpu_usec, install_onedir, service_procs, show
from node_agent.base.layout import KUBECONFIG_FILE
from tests.conftest import api_client_from
from tests.integration.test_gardener_generated import (
    UPSTREAM_UNIT,
    allow_upstream_caches,
    subject_cn,
)
from tests.integration.test_twin import Twin, install_agent, journal, provision_twin
from tests.testbed import standin
from tests.testbed.agent_harness import (
    NS,
    create_node,
    host,
    inline_file,
    osc_document,
    publish_osc,
    service,
    wait_for,
)
from tests.testbed.agent_image import agent_image_layout
from tests.testbed.bootstrap import allow_bootstrappers, node_agent_user
from tests.testbed.containerd import ContainerdNode, containerd_node
from tests.testbed.controlplane import ControlPlane
from tests.testbed.csr_approver import CSRApprover
from tests.testbed.gardener_gen import NEWEST, gardener_node_agent
from tests.testbed.systemd_ns import HarnessError, IsolatedSystemd

CACHE = Path(os.environ.get("NODE_AGENT_TEST_CACHE") or Path.home() / ".cache/node-agent-test")
CHECKSUM = "checksum/cloud-config-data"
MIB = 1 << 20
#: the arguments of Gardener's unit for the agent
GARDENER_ARGS = "--config-dir=/var/lib/gardener-node-agent"
#: the targets: node-agent / upstream at most
GOAL_HOT, GOAL_START, GOAL_IDLE = 0.5, 0.7, 0.35
#: update published -> Node annotated, health gate on: upstream's contract (within 1.2x)
GOAL_REPORTED = 1.2
#: the OSC's unit that a hot-path round restarts, and the file (in its filePaths) that changes
HOT_UNIT = "twinbench-hot.service"
HOT_FILE = "/etc/twinbench/hot.conf"
#: a file no unit names: changing it restarts nothing (the start rounds change it)
FREE_FILE = "/etc/twinbench/free.conf"
IDLE_UNIT = "twinbench-idle.service"
BIG_FILES, BIG_UNITS = 300, 60
#: everything but the bench's own admin identity (and the API server's loopback) is audited
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: None
  users: ["test-admin", "system:apiserver"]
- level: Metadata
"""
#: a kubelet for the agents' kubelet health checks: the stand-in answers ``/healthz`` on
#: 127.0.0.1:10248 unless ``$KUBELET_EXTRA_ARGS`` (written by ``provision_twin`` on
#: node-agent's twin: the nodes share the host's network) moves it
KUBELET_UNIT = """[Unit]
Description=stand-in kubelet (serves /healthz only)

[Service]
EnvironmentFile=-/var/lib/kubelet/extra_args
ExecStart=/opt/bin/kubelet $KUBELET_EXTRA_ARGS
Restart=always
RestartSec=5

[Install]
WantedBy=multi-user.target
"""


# -- the OSCs -----------------------------------------------------------------------------------
def small_osc(hot: str, free: str) -> dict[str, Any]:
    """Two files and two units; ``hot`` is in the hot unit's filePaths, ``free`` in none."""
    return osc_document(
        [inline_file(HOT_FILE, f"hot {hot}\n"), inline_file(FREE_FILE, f"free {free}\n")],
        [
            service(HOT_UNIT, command="start", enable=True, filePaths=[HOT_FILE]),
            service(IDLE_UNIT, command="start", enable=True),
        ],
    )


def big_osc(hot: str, free: str) -> dict[str, Any]:
    """The small OSC unchanged plus 300 files and 60 units, each naming 5 of the files."""
    doc = small_osc(hot, free)
    per_unit = BIG_FILES // BIG_UNITS
    doc["spec"]["files"] += [
        inline_file(f"/etc/twinbench/big/f{i:03}.conf", f"file {i}\n" * 8) for i in range(BIG_FILES)
    ]
    doc["spec"]["units"] += [
        service(
            big_unit(j),
            command="start",
            enable=True,
            filePaths=[
                f"/etc/twinbench/big/f{i:03}.conf" for i in range(j * per_unit, (j + 1) * per_unit)
            ],
        )
        for j in range(BIG_UNITS)
    ]
    return doc


def big_unit(j: int) -> str:
    return f"twinbench-big-{j:02}.service"


# -- figures ------------------------------------------------------------------------------------
def percentile(samples: list[float], q: float) -> float:
    """Nearest rank: the smallest sample with at least ``q`` of them at or below it."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


@dataclass
class Row:
    figure: str
    ours: float
    upstream: float
    unit: str
    goal: float | None = None
    note: str = ""

    def cells(self) -> tuple[str, str, str, str, str]:
        ratio = self.ours / self.upstream if self.upstream else math.inf
        goal = ""
        if self.goal is not None:
            goal = f"<= {self.goal:.2f}x " + ("met" if ratio <= self.goal else "NOT met")
        return (self.figure, self.fmt(self.ours), self.fmt(self.upstream), f"{ratio:.2f}x", goal)

    def fmt(self, value: float) -> str:
        if self.unit == "ms":
            return f"{value * 1000:.0f} ms"
        if self.unit == "MiB":
            return f"{value / MIB:.1f} MiB"
        return f"{value:.1f} {self.unit}"


def print_table(rows: list[Row]) -> None:
    header = ("figure", "node-agent", "upstream", "ratio", "goal")
    cells = [header, *(r.cells() for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    for i, line in enumerate(cells):
        print(
            "  ".join(
                c.ljust(w) if j == 0 else c.rjust(w)
                for j, (c, w) in enumerate(zip(line, widths, strict=True))
            ).rstrip()
        )
        if i == 0:
            print("  ".join("-" * w for w in widths))
    notes = [f"  {r.figure}: {r.note}" for r in rows if r.note]
    if notes:
        print("notes:")
        print("\n".join(notes))


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


# -- one twin -----------------------------------------------------------------------------------
@dataclass
class Agent:
    """One twin, its agent and the tags of the OSC its Secret carries now."""

    name: str  # "node-agent" or "upstream"
    twin: Twin
    admin: ApiClient
    hot: str = "init"
    free: str = "init"
    samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def node(self) -> IsolatedSystemd:
        return self.twin.cn.node

    @property
    def machine(self) -> str:
        return self.twin.machine

    @property
    def user(self) -> str:
        return node_agent_user(self.machine)

    def record(self, key: str, value: float) -> None:
        self.samples.setdefault(key, []).append(value)

    def config(self) -> dict[str, Any]:
        doc: dict[str, Any] = yaml.safe_load(
            host(self.node.root, self.twin.gen.config_path).read_text()
        )
        return doc

    def write_config(self, doc: dict[str, Any]) -> None:
        host(self.node.root, self.twin.gen.config_path).write_text(yaml.safe_dump(doc))

    async def publish(self, osc: dict[str, Any]) -> tuple[str, float]:
        """The Secret created or replaced; its checksum and when the API server answered."""
        checksum = await publish_osc(self.admin, self.twin.secret, osc)
        return checksum, time.monotonic()

    async def publish_small(self) -> tuple[str, float]:
        return await self.publish(small_osc(self.hot, self.free))

    async def seen(self, checksum: str, limit: float) -> float:
        """Until the Node carries ``checksum``; when the bench learnt it. A watch on the Node
        (no polling: a poll would cost the API server and this machine's two cores CPU while
        the agents are measured, and add its period to the figure)."""
        core = client.CoreV1Api(self.admin)
        found = await core.read_node(self.machine)
        if (found.metadata.annotations or {}).get(CHECKSUM) == checksum:
            return time.monotonic()
        version = found.metadata.resource_version
        try:
            async with asyncio.timeout(limit):
                while True:
                    stream = watch.Watch()
                    async with stream:
                        async for event in stream.stream(
                            core.list_node,
                            field_selector=f"metadata.name={self.machine}",
                            resource_version=version,
                            timeout_seconds=300,
                        ):
                            obj = event["object"]
                            version = obj.metadata.resource_version
                            if (obj.metadata.annotations or {}).get(CHECKSUM) == checksum:
                                return time.monotonic()
        except TimeoutError:
            raise HarnessError(
                f"{self.name} did not report {checksum[:12]} within {limit:.0f} s\n"
                f"{journal(self.twin)}"
            ) from None

    def unit(self, name: str, *props: str) -> dict[str, str]:
        out = self.node.run(["systemctl", "show", "-p", ",".join(props), name]).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def systemctl(self, action: str) -> None:
        done = self.node.run(["systemctl", action, UPSTREAM_UNIT], timeout=120, check=False)
        if done.returncode != 0:
            raise HarnessError(
                f"systemctl {action} on {self.name}'s twin failed\n{journal(self.twin)}"
            )

    async def wait_ready(self) -> None:
        """Until the agent's ``/readyz`` answers 200 (both serve controller-runtime's probe
        paths on ``server.healthProbes.port``)."""
        port = int(self.config()["server"]["healthProbes"]["port"])

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as reply:
                    return int(reply.status) == 200
            except OSError:
                return False

        try:
            await wait_for(ready, 120, f"{self.name} ready", poll=0.1)
        except AssertionError as exc:
            raise HarnessError(f"{exc}\n{journal(self.twin)}") from None


def configure(agent: Agent, *, gate: bool, settle: str) -> None:
    """Gardener's generated config with the test bed's changes (``provision_twin``), but the
    unit check at Gardener's default (1m) again, and node-agent's health gate as asked."""
    doc = agent.config()
    doc["controllers"]["systemdUnitCheck"] = {}
    if agent.name == "node-agent":
        gate_doc: dict[str, Any] = {"enabled": gate}
        if settle:
            gate_doc["settleWindow"] = settle
        doc.setdefault("nodeAgent", {})["healthGate"] = gate_doc
    agent.write_config(doc)


def install_kubelet(agent: Agent) -> None:
    binary = agent.node.path("/opt/bin/kubelet")
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.write_bytes(standin.kubelet_binary())
    binary.chmod(0o755)
    agent.node.path("/etc/systemd/system/kubelet.service").write_text(KUBELET_UNIT)
    agent.node.run(["systemctl", "daemon-reload"])
    agent.node.run(["systemctl", "start", "kubelet.service"])


# -- the cases ----------------------------------------------------------------------------------
async def hot_round(agent: Agent, series: str, i: int) -> None:
    """One inline file of the hot unit changes: Secret update → the unit active again, and
    → the Node annotated (node-agent reports when the apply is done, as upstream; its health
    gate's settle window runs after the report)."""
    before = agent.unit(HOT_UNIT, "InvocationID")["InvocationID"]
    agent.hot = f"{series}-{i}"
    checksum, answered = await agent.publish_small()

    def restarted() -> bool:
        return agent.unit(HOT_UNIT, "InvocationID")["InvocationID"] not in ("", before)

    try:
        await wait_for(restarted, 120, f"{agent.name} restarting {HOT_UNIT}", poll=0.25)
    except AssertionError as exc:
        raise HarnessError(f"{exc}\n{journal(agent.twin)}") from None
    active = int(
        agent.unit(HOT_UNIT, "ActiveEnterTimestampMonotonic")["ActiveEnterTimestampMonotonic"]
    )
    agent.record(f"hot {series}", active / 1e6 - answered)
    reported = await agent.seen(checksum, 180)
    agent.record(f"hot {series} reported", reported - answered)


async def hot_path(agents: list[Agent], series: str, rounds: int) -> None:
    for i in range(rounds):
        for agent in agents:
            await hot_round(agent, series, i)
        last = {a.name: ms(a.samples[f"hot {series}"][-1]) for a in agents}
        print(f"  hot path ({series}) round {i + 1}/{rounds}: {last}", flush=True)


def first_log(agent: Agent, invocation: str) -> float:
    """When journald received the invocation's first line (its monotonic timestamp; the
    node's journald runs on the host's CLOCK_MONOTONIC): exec → the process's first log line
    is the runtime's start-up (for node-agent: the launcher, the interpreter, the imports)."""
    out = agent.node.run(
        ["journalctl", "--no-pager", "-o", "json", f"_SYSTEMD_INVOCATION_ID={invocation}"]
    ).stdout
    stamps = [int(json.loads(line)["__MONOTONIC_TIMESTAMP"]) for line in out.splitlines() if line]
    if not stamps:
        raise HarnessError(f"no journal lines of {agent.name}'s invocation {invocation}")
    return min(stamps) / 1e6


async def start_round(agent: Agent, i: int) -> None:
    """Stopped, a changed small OSC published (only the free file), started: exec → applied."""
    agent.systemctl("stop")
    agent.free = f"start-{i}"
    checksum, _ = await agent.publish_small()
    agent.systemctl("start")
    reported = await agent.seen(checksum, 120)
    props = show(agent.node, "ExecMainStartTimestampMonotonic", "InvocationID")
    exec_at = int(props["ExecMainStartTimestampMonotonic"]) / 1e6
    written = agent.node.path(FREE_FILE).stat().st_mtime - (time.time() - time.monotonic())
    agent.record("start reported", reported - exec_at)
    agent.record("start written", written - exec_at)
    agent.record("start first log", first_log(agent, props["InvocationID"]) - exec_at)
    await agent.wait_ready()


async def idle(agents: list[Agent], seconds: float, audit_log: Path) -> dict[str, dict[str, float]]:
    """Both agents idle at once: CPU of each service cgroup, API requests by each identity."""
    groups = {a.name: cgroup(a.node) for a in agents}
    before = {a.name: cpu_usec(a.node, groups[a.name]) for a in agents}
    start = time.time()
    await asyncio.sleep(seconds)
    end = time.time()
    used = {a.name: cpu_usec(a.node, groups[a.name]) - before[a.name] for a in agents}
    await asyncio.sleep(2.0)  # the audit log is written when a request completes
    out: dict[str, dict[str, float]] = {}
    for agent in agents:
        events = read_audit(audit_log, agent.user)
        verbs: Counter[str] = Counter()
        for stages in events.values():
            first = stages[0]
            if start <= parse_time(first["requestReceivedTimestamp"]) < end:
                verbs[str(first["verb"])] += 1
        minutes = (end - start) / 60
        out[agent.name] = {
            "cpu_per_min": used[agent.name] / 1e6 / minutes,
            "requests_per_min": sum(verbs.values()) / minutes,
        }
        by_verb = ", ".join(f"{v} {n / minutes:.2f}" for v, n in verbs.most_common())
        print(f"  idle {agent.name}: requests/min by verb: {by_verb or 'none'}", flush=True)
    return out


def pss(agent: Agent) -> float:
    procs = service_procs(agent.node)
    parts = ", ".join(f"{p.role} {p.pss / MIB:.1f}" for p in procs)
    print(f"  PSS {agent.name}: {sum(p.pss for p in procs) / MIB:.1f} MiB ({parts})", flush=True)
    return float(sum(p.pss for p in procs))


async def big_apply(agent: Agent) -> None:
    """The Secret created with the big OSC (deleted before): → Node annotated, → last unit
    active."""
    checksum, answered = await agent.publish(big_osc(agent.hot, agent.free))
    reported = await agent.seen(checksum, 900)
    names = [big_unit(j) for j in range(BIG_UNITS)]
    out = agent.node.run(
        ["systemctl", "show", "-p", "ActiveState,ActiveEnterTimestampMonotonic", *names]
    ).stdout
    blocks = [
        dict(ln.split("=", 1) for ln in b.splitlines() if "=" in ln)
        for b in out.strip().split("\n\n")
    ]
    inactive = [n for n, b in zip(names, blocks, strict=True) if b.get("ActiveState") != "active"]
    if inactive:
        raise HarnessError(
            f"{agent.name}: not active after the big apply: {inactive}\n{journal(agent.twin)}"
        )
    last = max(int(b["ActiveEnterTimestampMonotonic"]) for b in blocks) / 1e6
    agent.record("big reported", reported - answered)
    agent.record("big units", last - answered)
    missing = [
        i
        for i in range(BIG_FILES)
        if not agent.node.path(f"/etc/twinbench/big/f{i:03}.conf").exists()
    ]
    if missing:
        raise HarnessError(f"{agent.name}: {len(missing)} of the big OSC's files missing")
    print(
        f"  big apply {agent.name}: annotated {ms(reported - answered)}, "
        f"last unit active {ms(last - answered)}",
        flush=True,
    )


# -- the run ------------------------------------------------------------------------------------
@contextlib.contextmanager
def twin_nodes(work: Path) -> Iterator[tuple[ContainerdNode, ContainerdNode]]:
    with containerd_node(work / "twin-upstream") as up, containerd_node(work / "twin-ours") as ours:
        yield up, ours


@contextlib.asynccontextmanager
async def test_bed(work: Path) -> AsyncIterator[tuple[ControlPlane, ApiClient, Path]]:
    """The control plane with an audit log and kube-controller-manager, the admin client and
    Gardener's CSR approver."""
    audit_log = work / "audit.log"
    policy = work / "audit-policy.yaml"
    policy.write_text(AUDIT_POLICY)
    cp = ControlPlane(work / "cp")
    cp.apiserver.argv += [
        f"--audit-policy-file={policy}",
        f"--audit-log-path={audit_log}",
        "--audit-log-format=json",
        "--audit-log-mode=blocking",
    ]
    with cp:
        await asyncio.to_thread(cp.start_controller_manager)
        admin = await api_client_from(cp.admin_kubeconfig)
        async with admin:
            await allow_bootstrappers(admin)
            async with CSRApprover(admin):
                yield cp, admin, audit_log


async def bring_up(
    agents: list[Agent], binaries: dict[str, bytes], work: Path, opts: argparse.Namespace
) -> None:
    """Agents installed and started, certificates fetched, Nodes registered, the first small
    OSC applied on both."""
    for agent in agents:
        configure(agent, gate=True, settle=opts.settle)
        install_kubelet(agent)
    await allow_upstream_caches(agents[1].admin, agents[1].machine)
    if opts.onedir:
        ours = next(a for a in agents if a.name == "node-agent")
        binary, what = install_onedir(ours.node, work, None)
        drop_in = ours.node.path(f"/etc/systemd/system/{UPSTREAM_UNIT}.d/onedir.conf")
        drop_in.parent.mkdir(parents=True, exist_ok=True)
        drop_in.write_text(f"[Service]\nExecStart=\nExecStart={binary} {GARDENER_ARGS}\n")
        print(f"node-agent: {what}, ExecStart={binary} {GARDENER_ARGS}", flush=True)
    for agent in agents:
        install_agent(agent.twin, binaries[agent.name])
    for agent in agents:
        kubeconfig = host(agent.node.root, KUBECONFIG_FILE)
        try:
            await wait_for(kubeconfig.exists, 120, f"{agent.name}'s kubeconfig")
        except AssertionError as exc:
            raise HarnessError(f"{exc}\n{journal(agent.twin)}") from None
        if not subject_cn(kubeconfig).endswith(agent.machine):
            raise HarnessError(f"{agent.name}'s certificate is not for {agent.machine}")
        await create_node(agent.admin, agent.machine)
        # the kubelet reports the node's address (upstream's health check wants one)
        await client.CoreV1Api(agent.admin).patch_node_status(
            agent.machine,
            {"status": {"addresses": [{"type": "InternalIP", "address": "127.0.0.1"}]}},
        )
    for agent in agents:
        checksum, _ = await agent.publish_small()
        await agent.seen(checksum, 180)
    for agent in agents:
        await agent.wait_ready()


async def run(opts: argparse.Namespace) -> None:
    print(f"load average at start: {loadavg()}", flush=True)
    try:
        binaries = {
            "upstream": gardener_node_agent().read_bytes(),
        }
    except HarnessError as exc:
        sys.exit(f"upstream gardener-node-agent is missing and could not be built: {exc}")
    tmp_root = Path(os.environ["TMPDIR"]) if os.environ.get("TMPDIR") else CACHE / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=tmp_root, prefix="bench-twin.") as tmp:
        work = Path(tmp)
        binaries["node-agent"] = agent_image_layout(work / "dist").executable.read_bytes()
        async with test_bed(work) as (cp, admin, audit_log):
            with twin_nodes(work) as (up_node, our_node):
                agents: list[Agent] = []
                for label, name, cn in (
                    ("ours", "node-agent", our_node),
                    ("upstream", "upstream", up_node),
                ):
                    twin = await provision_twin(label, cn, cp, admin, NEWEST, own_secret=True)
                    agents.append(Agent(name, twin, admin))
                try:
                    await measure(agents, binaries, work, audit_log, opts)
                finally:
                    for agent in agents:
                        agent.node.run(["systemctl", "stop", UPSTREAM_UNIT], check=False)


async def measure(
    agents: list[Agent],
    binaries: dict[str, bytes],
    work: Path,
    audit_log: Path,
    opts: argparse.Namespace,
) -> None:
    ours, upstream = agents
    await bring_up(agents, binaries, work, opts)
    print(
        f"up: node-agent {ours.machine}, upstream {upstream.machine} (same osc.yaml bytes)",
        flush=True,
    )

    await hot_path(agents, "gate on", opts.rounds)
    if opts.gate_off:
        configure(ours, gate=False, settle=opts.settle)
        ours.systemctl("restart")
        await ours.wait_ready()
        await hot_path([ours], "gate off", opts.rounds)
        configure(ours, gate=True, settle=opts.settle)
        ours.systemctl("restart")
        await ours.wait_ready()

    for i in range(opts.starts):
        for agent in agents:
            await start_round(agent, i)
        last = {a.name: ms(a.samples["start reported"][-1]) for a in agents}
        print(f"  start round {i + 1}/{opts.starts}: exec -> reported {last}", flush=True)

    await asyncio.sleep(opts.idle_settle)
    idle_figures = await idle(agents, opts.idle, audit_log)
    memory = {a.name: pss(a) for a in agents}

    core = client.CoreV1Api(ours.admin)
    for agent in agents:
        await core.delete_namespaced_secret(agent.twin.secret, NS)
    await asyncio.sleep(3.0)
    for agent in (upstream, ours):
        await big_apply(agent)
    memory_big = {a.name: pss(a) for a in agents}

    def row(figure: str, key: str, q: float, goal: float | None = None, note: str = "") -> Row:
        ours_key = key.replace("gate on", "gate off") if "gate off" in figure else key
        return Row(
            figure,
            percentile(ours.samples[ours_key], q),
            percentile(upstream.samples[key], q),
            "ms",
            goal,
            note,
        )

    settle = opts.settle or "30s (default)"
    rows = [
        row(
            "hot path p50, gate on",
            "hot gate on",
            0.5,
            GOAL_HOT,
            f"Secret update answered -> {HOT_UNIT} active again (systemd's timestamp), "
            f"n={opts.rounds}",
        ),
        row("hot path p90, gate on", "hot gate on", 0.9, GOAL_HOT),
        row(
            "hot path: Node annotated p50, gate on",
            "hot gate on reported",
            0.5,
            GOAL_REPORTED,
            f"node-agent reports as upstream does, its settle window ({settle}) after it",
        ),
        row("hot path: Node annotated p90, gate on", "hot gate on reported", 0.9, GOAL_REPORTED),
    ]
    if opts.gate_off:
        rows += [
            row(
                "hot path p50, gate off",
                "hot gate on",
                0.5,
                GOAL_HOT,
                "node-agent's gate off; upstream (no gate) the same samples as above",
            ),
            row("hot path p90, gate off", "hot gate on", 0.9, GOAL_HOT),
            row("hot path: Node annotated p50, gate off", "hot gate on reported", 0.5),
        ]
    rows += [
        row(
            "start: exec -> Node annotated p50",
            "start reported",
            0.5,
            GOAL_START,
            f"ExecMainStartTimestampMonotonic -> checksum seen (Node watch), n={opts.starts}",
        ),
        row("start: exec -> file written p50", "start written", 0.5, GOAL_START, "-> its mtime"),
        row(
            "start: exec -> first log line p50",
            "start first log",
            0.5,
            note="journald's monotonic timestamp of the invocation's first line: the runtime's "
            "own start-up (launcher, interpreter, imports for node-agent)",
        ),
        Row(
            "idle CPU per minute",
            idle_figures["node-agent"]["cpu_per_min"],
            idle_figures["upstream"]["cpu_per_min"],
            "ms",
            GOAL_IDLE,
            f"cgroup cpu.stat usage_usec over {opts.idle:.0f} s, both idle at the same time",
        ),
        Row(
            "idle API requests per minute",
            idle_figures["node-agent"]["requests_per_min"],
            idle_figures["upstream"]["requests_per_min"],
            "req/min",
            note="kube-apiserver audit events of each agent's identity in the same window",
        ),
        row(
            "first apply 300 files / 60 units: annotated",
            "big reported",
            0.5,
            note="Secret created -> checksum seen (Node watch); one run each",
        ),
        row(
            "first apply 300 files / 60 units: last unit active",
            "big units",
            0.5,
            note="Secret created -> the latest ActiveEnterTimestamp of the 60",
        ),
        Row(
            "PSS idle, whole service",
            memory["node-agent"],
            memory["upstream"],
            "MiB",
            note="smaps_rollup of every process in the service's cgroup",
        ),
        Row(
            "PSS after the 300-file apply", memory_big["node-agent"], memory_big["upstream"], "MiB"
        ),
    ]
    print()
    install = (
        "onedir artifact, Gardener's unit + ExecStart drop-in"
        if opts.onedir
        else ("the image's single file, Gardener's unit")
    )
    print(f"node-agent ({install}) vs upstream gardener-node-agent v1.150.0; "
          "ratio = node-agent / upstream")  # fmt: skip
    print_table(rows)
    print(f"load average at end: {loadavg()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="hot-path rounds per series (>= 20)")
    parser.add_argument("--starts", type=int, default=5, help="starts with a change pending")
    parser.add_argument("--idle", type=float, default=120.0, help="idle window in seconds (>= 60)")
    parser.add_argument("--idle-settle", type=float, default=15.0, help="seconds before it")
    parser.add_argument(
        "--settle",
        default="",
        help="node-agent's health gate settle window (default: its own, 30s)",
    )
    parser.add_argument(
        "--no-gate-off", dest="gate_off", action="store_false", help="skip the gate-off series"
    )
    parser.add_argument(
        "--onedir",
        action="store_true",
        help="node-agent from its onedir artifact instead of the single file (no launcher)",
    )
    opts = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (the test bed's systemd runs in namespaces)")
    if opts.rounds < 1 or opts.starts < 1 or opts.idle <= 0:
        parser.error("--rounds, --starts and --idle must be positive")
    try:
        asyncio.run(run(opts))
    except (RuntimeError, AssertionError, OSError) as exc:  # the bed's errors, a missing piece
        sys.exit(f"bench.twin failed: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
