"""A fleet of real agents against one real kube-apiserver: API load, rollout speed, pacing.

Boots the test bed's kube-apiserver + etcd (with an audit log of the agents' identities only)
and N throwaway nodes, each a real systemd in its own namespaces (overlay root), and runs one
real ``node-agent run`` process per node, for its own Node, with its own least-privilege
identity (ServiceAccount, RBAC on exactly its Node, Lease and the pool's Secrets). All agents
share one OSC Secret, as the nodes of a worker pool do. Prints one table:

- steady state: API requests per node per minute (the audit log, by identity, over an idle
  window) and the watches open per node (audit: started and not ended; the server's own
  ``apiserver_longrunning_requests`` gauge next to it), the agents' memory;
- rollouts: one Secret update (kubelet's unit changed) until every Node's
  ``checksum/cloud-config-data`` names it: unpaced, and paced with K = 1, 5, 10 parallel slots.
  Per scenario: time to the last node, the largest number of disruptive restarts seen at once,
  kube-apiserver's CPU during the rollout (``/proc/<pid>/stat``, mean and busiest second);
  ``serial``: Gardener's serial mode the same way;
- the breaker: a deliberately bad OSC (kubelet exits at once: the health gate rolls each node
  back) with the breaker at F; how many nodes applied it (must be <= F + K - 1).

Concurrency is counted from outside the agents: the stand-in ``kubelet.service`` logs ``down``
(ExecStop), ``pre`` (ExecStartPre, which then sleeps 1 s: a restart is a 1 s outage) and ``up``
(ExecStartPost) with the wall clock into its node's ``/var/log/fleet/kubelet.log``; an outage is
[down, up] and the figure is the largest number of overlapping outages.

One systemd per agent fits this machine: an instance (systemd, dbus-daemon, journald) is ~5 MiB
PSS and 4 inotify instances, an agent ~53 MiB and 1 (the watch on its token file's directory);
the only limit hit is ``fs.inotify.max_user_instances`` (128 on this host), raised for the run
to fit N * 5 and put back afterwards. Nodes share the host's network, so each agent's health
and metrics ports are free ports on 127.0.0.1 and the kubelet health check is off (the
stand-in serves no /healthz).

``--agent upstream`` runs the same fleet with upstream gardener-node-agent (the newest Gardener
release the bed serves) in every node instead, installed and identified as Gardener does it
(``bench/fleet_upstream.py``), measured the same way: the same audit log by identity, the same
Node watch, Leases and marks. ``--agent both`` runs node-agent's fleet and then upstream's, each
on a bed of its own with the same parameters, prints each table and then one table with every
figure side by side (node-agent | upstream); ``--json`` then holds both under ``flavours``.
Upstream runs the ``outage`` scenario only: the rollouts measure node-agent's pacing (upstream
has none), and ``steady`` reads the agents' processes from the host.

    .venv/bin/python -m bench.fleet [--agents 100] [--quick] [--idle-minutes 5]
        [--scenarios steady,unpaced,k10,k5,breaker,k1,serial,crash] [--breaker 3] [--keep]
        [--fleet-view] [--crash-ttl 60] [--agent node-agent|upstream|both]

Run as root from the repository root. ``--quick``: 10 agents, 1 min idle.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import re
import shutil
import signal
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client import ApiClient

from bench.fleet_upstream import Upstream
from node_agent.controllers.osc import pacing
from node_agent.kube.report import ANNOTATION_SERIAL, LABEL_SECRET_NAME
from tests.conftest import api_client_from, cache_dir
from tests.testbed.agent_harness import (
    NS,
    inline_file,
    osc_document,
    prepare_agent,
    publish_osc,
    service,
    spawn_agent,
)
from tests.testbed.controlplane import ControlPlane, free_port
from tests.testbed.credentials import NodeAgentCredentials, node_agent_credentials
from tests.testbed.pki import CertPair
from tests.testbed.systemd_ns import IsolatedSystemd

APPLIED = "checksum/cloud-config-data"
SA_PREFIX = "system:serviceaccount:kube-system:"
INOTIFY_SYSCTL = Path("/proc/sys/fs/inotify/max_user_instances")
#: inotify instances one isolated systemd holds (systemd 3, journald 1; measured)
INOTIFY_PER_NODE = 5  # systemd, dbus-daemon, journald (4); the agent watching its token file (1)
MARK_LOG = "/var/log/fleet/kubelet.log"
MARK = "/opt/fleet/mark"
#: a file only, changed by an update that must restart nothing (the outage scenario's OSC)
NOTE = "/etc/fleet/note"
TOKEN_SECRET = "gardener-valitail"
TOKEN_PATH = "/var/lib/valitail/auth-token"
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  userGroups: ["system:serviceaccounts:kube-system", "gardener.cloud:node-agents"]
- level: None
"""


def pacing_annotations(k: int, *, breaker: int | None) -> dict[str, str]:
    """The Secret annotations asking for K parallel slots, no canaries (and the breaker at F;
    without it the product's default applies)."""
    out = {pacing.ANNOTATION_MAX_PARALLEL: str(k), pacing.ANNOTATION_CANARIES: "0"}
    if breaker is not None:
        out[pacing.ANNOTATION_MAX_FAILURES] = str(breaker)
    return out


# -- the OSC ------------------------------------------------------------------------------------
MARK_SCRIPT = f"""#!/bin/sh
# $1: what happened (down, pre, up), $2: the unit's version
mkdir -p {Path(MARK_LOG).parent}
echo "$1 $2 $(date +%s.%N)" >> {MARK_LOG}
"""


def kubelet_unit(tag: str, *, bad: bool = False) -> dict[str, Any]:
    """The stand-in kubelet: a 1 s start (ExecStartPre), marks in the log; ``bad`` exits."""
    extra = (
        f"ExecStartPre={MARK} pre {tag}\nExecStartPre=/bin/sleep 1\n"
        f"ExecStartPost={MARK} up {tag}\nExecStop={MARK} down {tag}\n"
        f"Environment=KUBELET_VERSION={tag}\n"
    )
    return service(
        "kubelet.service",
        "/bin/false" if bad else "/bin/sleep infinity",
        extra=extra,
        filePaths=["/var/lib/kubelet/config/kubelet"],
    )


def fleet_osc(tag: str, *, bad: bool = False, note: str | None = None) -> dict[str, Any]:
    """A small pool OSC: the stand-in kubelet and its config, 3 other services, a oneshot,
    8 files. ``tag`` changes kubelet's unit and config only: an update restarts kubelet.
    ``note``: one more file (``NOTE``) with this text, a change that restarts nothing."""
    files = [
        inline_file(MARK, MARK_SCRIPT, 0o755),
        inline_file("/var/lib/kubelet/config/kubelet", f"kind: KubeletConfiguration\n# {tag}\n"),
    ]
    files += [inline_file(f"/etc/fleet/conf-{i}.conf", f"value={i}\n") for i in range(6)]
    if note is not None:
        files.append(inline_file(NOTE, note + "\n"))
    units = [kubelet_unit(tag, bad=bad)]
    units += [service(f"fleet-helper-{i}.service") for i in range(3)]
    units.append(service("fleet-once.service", "/bin/true", extra="Type=oneshot\n"))
    return osc_document(files, units)


#: the pool of the fleet (the OSC Secret is labelled with it by the test bed's publish_osc)
POOL = "pool-a"


async def publish(
    admin: ApiClient, name: str, osc: dict[str, Any], annotations: dict[str, str]
) -> str:
    """Replace the pool's OSC Secret (create it the first time); returns the checksum."""
    return await publish_osc(admin, name, osc, annotations=annotations)


# -- measuring from outside ---------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sum_cpu(pids: Iterable[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


def tree_pids(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                text = Path(f"/proc/{current}/task/{task}/children").read_text()
                todo += [int(p) for p in text.split()]
    return pids


def rss_mib(pid: int) -> float:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def pss_kib(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


class CpuSampler:
    """kube-apiserver's CPU once a second while a rollout runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[float] = []
        self.total = 0.0
        self.wall = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last_cpu, last = cpu_seconds(self.pid), time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            cpu, now = cpu_seconds(self.pid), time.monotonic()
            self.samples.append((cpu - last_cpu) / (now - last))
            last_cpu, last = cpu, now

    def __enter__(self) -> CpuSampler:
        self._start_cpu, self._start = cpu_seconds(self.pid), time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        self.total = cpu_seconds(self.pid) - self._start_cpu
        self.wall = time.monotonic() - self._start


async def pool_ledger(admin: ApiClient, lease: str) -> pacing.Ledger:
    """The pool's ledger as its Lease carries it now (read as admin; API errors raise)."""
    read = await client.CoordinationV1Api(admin).read_namespaced_lease(lease, NS)
    return pacing.Ledger.load((read.metadata.annotations or {}).get(pacing.ANNOTATION_LEDGER))


class LineSampler:
    """The pool's ledger once a second while a paced rollout runs (as admin, outside the
    agents' audited identities): how often places stood free with nobody in line (the line ran
    dry: nodes outside it must join before the rollout goes on), the join window the pool's
    nodes draw in (``pacing.join_window``: sized by the pool's count, else learned), and that
    count."""

    def __init__(self, admin: ApiClient, lease: str, k: int) -> None:
        self.admin, self.lease, self.k = admin, lease, k
        self.samples: list[tuple[int, int, float]] = []  # (waiting, free places, window)
        self._task: asyncio.Task[None] | None = None
        self.last = pacing.Ledger()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            with contextlib.suppress(Exception):
                ledger = await pool_ledger(self.admin, self.lease)
                free = self.k - len(ledger.slots)
                self.samples.append((ledger.waiting(), free, pacing.join_window(ledger)))
                self.last = ledger

    def __enter__(self) -> LineSampler:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    def note(self) -> str:
        if not self.samples:
            return "no samples"
        dry = sum(1 for waiting, free, _ in self.samples if waiting == 0 and free > 0)
        windows = sorted(w for _, _, w in self.samples)
        return (
            f"{dry} of {len(self.samples)} s with a free place and nobody in line; line "
            f"p50 {statistics.median(w for w, _, _ in self.samples):.0f} tickets; join window "
            f"p50 {statistics.median(windows):.1f} s, max {windows[-1]:.1f} s; pool "
            f"{self.last.pool or 'not counted'}, {self.last.joined} joined"
        )


class NodeWatch:
    """Every Node's applied checksum, and when each first showed a given one (wall clock)."""

    def __init__(self, admin: ApiClient) -> None:
        self.core = client.CoreV1Api(admin)
        self.applied: dict[str, str] = {}
        self.seen: dict[tuple[str, str], float] = {}
        self._task: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()

    def _record(self, node: client.V1Node) -> None:
        checksum = (node.metadata.annotations or {}).get(APPLIED, "")
        name = node.metadata.name
        self.applied[name] = checksum
        self.seen.setdefault((name, checksum), time.time())
        self.changed.set()

    async def _run(self) -> None:
        while True:
            try:
                listed = await self.core.list_node()
                for node in listed.items:
                    self._record(node)
                w = watch.Watch()
                async with w.stream(
                    self.core.list_node,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=300,
                ) as stream:
                    async for event in stream:
                        if event["type"] in ("ADDED", "MODIFIED"):
                            self._record(event["object"])
            except asyncio.CancelledError:
                raise
            except Exception:  # a watch that broke is listed and watched again
                await asyncio.sleep(0.5)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def count(self, nodes: Iterable[str], checksum: str) -> int:
        return sum(1 for n in nodes if self.applied.get(n) == checksum)

    async def wait_all(
        self, nodes: list[str], checksum: str, within: float, progress: str = ""
    ) -> bool:
        deadline = time.monotonic() + within
        last_print = 0.0
        while self.count(nodes, checksum) < len(nodes):
            if time.monotonic() > deadline:
                return False
            if progress and time.monotonic() - last_print > 30:
                last_print = time.monotonic()
                print(f"  {progress}: {self.count(nodes, checksum)}/{len(nodes)}", flush=True)
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), 1.0)
        return True


def read_marks(node: IsolatedSystemd) -> list[tuple[str, str, float]]:
    try:
        text = node.path(MARK_LOG).read_text()
    except OSError:
        return []
    marks = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3:
            marks.append((parts[0], parts[1], float(parts[2])))
    return marks


def outages(marks: list[tuple[str, str, float]], since: float) -> list[tuple[float, float]]:
    """[down, up] of each restart after ``since`` (a start with no down before it, e.g. after
    a failed start, counts from its ``pre``)."""
    spans: list[tuple[float, float]] = []
    began: float | None = None
    for what, _tag, at in marks:
        if at < since:
            continue
        if what == "down" or (what == "pre" and began is None):
            began = at
        elif what == "up" and began is not None:
            spans.append((began, at))
            began = None
    return spans


def max_overlap(spans: list[tuple[float, float]]) -> int:
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    current = peak = 0
    for _, step in edges:
        current += step
        peak = max(peak, current)
    return peak


# -- the audit log ------------------------------------------------------------------------------
def parse_time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def resource_of(event: dict[str, Any]) -> str:
    ref = event.get("objectRef") or {}
    name = str(ref.get("resource") or event.get("requestURI", "?").split("?")[0])
    if ref.get("subresource"):
        name += "/" + ref["subresource"]
    return name


@dataclass
class AuditFigures:
    requests: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)
    users: set[str] = field(default_factory=set)
    watches_open: Counter[str] = field(default_factory=Counter)
    watch_users: set[str] = field(default_factory=set)
    codes: Counter[int] = field(default_factory=Counter)
    #: requests on Leases by Lease name (the pool's Lease, each node's heartbeat Lease)
    leases: Counter[str] = field(default_factory=Counter)
    #: [received, ended] of every watch that was open at some time in the window
    watch_spans: list[tuple[float, float]] = field(default_factory=list)


def audit_window(path: Path, users: set[str], start: float, end: float) -> AuditFigures:
    """Requests of the agents' identities received in [start, end); watches open at ``end``."""
    stages: dict[str, list[dict[str, Any]]] = {}
    with path.open() as lines:
        for line in lines:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if (event.get("user") or {}).get("username") in users:
                    stages.setdefault(event["auditID"], []).append(event)
    figures = AuditFigures()
    for events in stages.values():
        first = events[0]
        user = first["user"]["username"]
        received = parse_time(first["requestReceivedTimestamp"])
        done = [e for e in events if e["stage"] == "ResponseComplete"]
        if first["verb"] == "watch" and received < end:
            ended = parse_time(done[0]["stageTimestamp"]) if done else None
            if ended is None or ended >= start:
                figures.watch_spans.append((max(received, start), min(ended or end, end)))
            if ended is None or ended > end:
                figures.watches_open[resource_of(first)] += 1
                figures.watch_users.add(user)
        if start <= received < end:
            figures.requests += 1
            figures.users.add(user)
            figures.by_kind[f"{first['verb']} {resource_of(first)}"] += 1
            ref = first.get("objectRef") or {}
            if ref.get("resource") == "leases":
                figures.leases[str(ref.get("name") or "")] += 1
            if done:
                figures.codes[int((done[0].get("responseStatus") or {}).get("code", 0))] += 1
    return figures


def scrape(cp: ControlPlane, metric: str) -> dict[str, float]:
    """One metric family from kube-apiserver's /metrics: labels → value."""
    status, body = cp.get("/metrics", timeout=20)
    out: dict[str, float] = {}
    if status != 200:
        return out
    pattern = re.compile(rf"^{metric}(\{{.*\}})? (\S+)$")
    for line in body.decode().splitlines():
        found = pattern.match(line)
        if found:
            out[found.group(1) or ""] = float(found.group(2))
    return out


def watch_gauge(cp: ControlPlane) -> float:
    """Watches kube-apiserver is serving (``apiserver_longrunning_requests``, verb WATCH)."""
    return sum(v for k, v in scrape(cp, "apiserver_longrunning_requests").items() if "WATCH" in k)


# -- the fleet ----------------------------------------------------------------------------------
@dataclass
class Member:
    name: str
    node: IsolatedSystemd
    creds: NodeAgentCredentials | None = None
    proc: asyncio.subprocess.Process | None = None
    log: Path | None = None
    metrics_port: int = 0
    #: the upstream flavour's identity (a user of a client certificate) and its certificate
    identity: str = ""
    certificate: CertPair | None = None

    @property
    def user(self) -> str:
        if self.identity:
            return self.identity
        assert self.creds is not None
        return SA_PREFIX + self.creds.service_account


@dataclass
class Row:
    figure: str
    value: str
    note: str = ""


@dataclass
class Fleet:
    args: argparse.Namespace
    work: Path
    cp: ControlPlane
    admin: ApiClient
    secret: str
    members: list[Member] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    watcher: NodeWatch | None = None
    version: int = 0
    #: the kubelet version of the last good OSC published (an update that keeps it restarts
    #: nothing)
    kubelet_tag: str = ""
    audit_log: Path = Path()
    restarts: dict[str, int] = field(default_factory=dict)
    #: per rollout scenario: its figures, for ``--json`` (bench/fleet_fit.py reads them)
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: the upstream flavour's shared pieces (None: node-agent in every node)
    upstream: Upstream | None = None
    load_at_end: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.members]

    def row(self, figure: str, value: str, note: str = "") -> None:
        self.rows.append(Row(figure, value, note))
        print(f"  {figure}: {value}  {note}", flush=True)

    async def register(self, member: Member) -> None:
        await client.CoreV1Api(self.admin).create_node(
            client.V1Node(
                metadata=client.V1ObjectMeta(
                    name=member.name,
                    # as machine-controller-manager labels a worker's Node: its host, its pool
                    # and the pool's OSC Secret
                    labels={
                        "kubernetes.io/hostname": member.name,
                        "worker.gardener.cloud/pool": POOL,
                        LABEL_SECRET_NAME: self.secret,
                    },
                )
            )
        )
        if self.upstream is not None:
            await self.upstream.register(self, member, [self.secret, TOKEN_SECRET])
            return
        member.creds = await node_agent_credentials(
            self.admin,
            self.work / "creds" / member.name,
            server=self.cp.server,
            ca_file=self.cp.ca_file,
            node_name=member.name,
            secret_names=[self.secret, TOKEN_SECRET],
        )

    async def spawn(self, member: Member) -> None:
        if self.upstream is not None:
            await self.upstream.spawn(self, member, TOKEN_SECRET, TOKEN_PATH)
            return
        assert member.creds is not None
        setup = prepare_agent(
            member.node.root,
            self.cp,
            member.creds,
            osc_secret=self.secret,
            token_secret=None,
            node_agent={
                "healthGate": {"enabled": True, "settleWindow": f"{self.args.settle}s"},
                "healthCheck": {"enabled": False},
            },
        )
        doc = yaml.safe_load(setup.config_file.read_text())
        doc["logLevel"] = "info"
        member.metrics_port = free_port()
        doc["server"] = {
            "healthProbes": {"bindAddress": "127.0.0.1", "port": free_port()},
            "metrics": {"bindAddress": "127.0.0.1", "port": member.metrics_port},
        }
        doc["controllers"]["token"]["syncConfigs"] = [
            {"secretName": TOKEN_SECRET, "path": TOKEN_PATH}
        ]
        setup.config_file.write_text(yaml.safe_dump(doc))
        member.log = self.work / "logs" / f"{member.name}.log"
        member.proc = await spawn_agent(
            setup, member.node, member.name, member.log, env=dict(os.environ)
        )

    async def supervise(self) -> None:
        """Restart an agent that exited, as its unit's ``Restart=always`` (``RestartSec=5``)
        does on a node; each restart is counted and shown. Upstream's agents run as their unit
        (``Restart=always``): systemd restarts them, the bench counts it."""
        if self.upstream is not None:
            await self.upstream.poll(self)
            return
        while True:
            await asyncio.sleep(1.0)
            for member in self.members:
                if member.proc is None or member.proc.returncode is None:
                    continue
                self.restarts[member.name] = self.restarts.get(member.name, 0) + 1
                print(
                    f"  agent of {member.name} exited ({member.proc.returncode}); restarting",
                    flush=True,
                )
                member.proc = None
                await asyncio.sleep(5.0)
                await self.spawn(member)

    def next_tag(self) -> str:
        self.version += 1
        return f"v{self.version}"

    def alive(self) -> int:
        if self.upstream is not None:
            return self.upstream.alive(self)
        return sum(1 for m in self.members if m.proc is not None and m.proc.returncode is None)


async def gather_limited(n: int, jobs: Iterable[Callable[[], Any]]) -> None:
    gate = asyncio.Semaphore(n)

    async def one(job: Callable[[], Any]) -> None:
        async with gate:
            await job()

    await asyncio.gather(*(one(j) for j in jobs))


def raise_inotify(nodes: int) -> int | None:
    """Raise fs.inotify.max_user_instances to fit the nodes; returns the old value if raised."""
    old = int(INOTIFY_SYSCTL.read_text())
    needed = 256 + nodes * INOTIFY_PER_NODE
    if old >= needed:
        return None
    INOTIFY_SYSCTL.write_text(str(needed))
    print(f"fs.inotify.max_user_instances {old} -> {needed} for the run", flush=True)
    return old


async def steady(fleet: Fleet, audit_log: Path) -> None:
    minutes = fleet.args.idle_minutes
    print(f"steady state: idle for {minutes:g} min ...", flush=True)
    users = {m.user for m in fleet.members}
    gauge_before = watch_gauge(fleet.cp)
    api_cpu0 = cpu_seconds(fleet.cp.apiserver.popen.pid)  # type: ignore[union-attr]
    agents = [p for m in fleet.members if m.proc for p in tree_pids(m.proc.pid)]
    agents_cpu0 = sum_cpu(agents)
    start = time.time()
    await asyncio.sleep(minutes * 60)
    end = time.time()
    api_cpu = cpu_seconds(fleet.cp.apiserver.popen.pid) - api_cpu0  # type: ignore[union-attr]
    agents_cpu = sum_cpu(agents) - agents_cpu0
    gauge_after = watch_gauge(fleet.cp)
    await asyncio.sleep(2)  # the audit backend has written the window's events
    figures = audit_window(audit_log, users, start, end)
    n = len(fleet.members)
    per_node_min = figures.requests / n / ((end - start) / 60)
    fleet.row(
        "steady: API requests / node / min",
        f"{per_node_min:.2f}",
        f"{figures.requests} requests by {len(figures.users)} identities in {minutes:g} min",
    )
    top = ", ".join(
        f"{k} {v / n / ((end - start) / 60):.2f}" for k, v in figures.by_kind.most_common(6)
    )
    fleet.row("steady: per node / min by verb", top)
    open_total = sum(figures.watches_open.values())
    fleet.row(
        "steady: open watches / node",
        f"{open_total / n:.2f}",
        f"{open_total} open ({dict(figures.watches_open)}); "
        f"apiserver_longrunning_requests WATCH {gauge_before:.0f} -> {gauge_after:.0f} "
        f"(all clients)",
    )
    fleet.row(
        "steady: kube-apiserver CPU",
        f"{api_cpu / (end - start) * 100:.1f} % of a core",
        "idle fleet, incl. the bench's Node watch",
    )
    fleet.row(
        "steady: kube-apiserver RSS",
        f"{rss_mib(fleet.cp.apiserver.popen.pid):.0f} MiB",  # type: ignore[union-attr]
        f"etcd {rss_mib(fleet.cp.etcd.popen.pid):.0f} MiB",  # type: ignore[union-attr]
    )
    fleet.row(
        "steady: CPU per agent",
        f"{agents_cpu / len(fleet.members) / (end - start) * 100:.2f} % of a core",
        f"main process + systemd worker; fleet total {agents_cpu / (end - start) * 100:.1f} %",
    )
    agent_pss = [sum(pss_kib(p) for p in tree_pids(m.proc.pid)) for m in fleet.members if m.proc]
    node_pss = [sum(pss_kib(p) for p in m.node._cgroup_pids()) for m in fleet.members]
    fleet.row(
        "steady: PSS per agent / per node's systemd",
        f"{statistics.median(agent_pss) / 1024:.0f} MiB / "
        f"{statistics.median(node_pss) / 1024:.0f} MiB",
        "median; agent = main process + systemd worker; node = systemd, dbus, journald, units",
    )


async def api_note(fleet: Fleet, start: float, end: float, record: str = "") -> str:
    """The agents' requests in a window, per node, with the conflicts (compare-and-swap);
    ``record``: the scenario whose figures also go into ``--json``."""
    await asyncio.sleep(1.5)  # the audit batch of the window's last second is written
    users = {m.user for m in fleet.members}
    figures = audit_window(fleet.audit_log, users, start, end)
    n = len(fleet.members)
    top = ", ".join(f"{k} {v / n:.1f}" for k, v in figures.by_kind.most_common(4))
    if record:
        pool_lease = figures.leases.get(fleet.secret, 0)
        heartbeats = sum(v for k, v in figures.leases.items() if k and k != fleet.secret)
        fleet.figures.setdefault(record, {}).update(
            requests_per_node=figures.requests / n,
            pool_lease_per_node=pool_lease / n,
            heartbeat_per_node=heartbeats / n,
            rollout_requests_per_node=(figures.requests - heartbeats) / n,
            conflicts=figures.codes.get(409, 0),
            by_kind_per_node={k: v / n for k, v in figures.by_kind.most_common()},
        )
    heartbeats = sum(v for k, v in figures.leases.items() if k and k != fleet.secret)
    return (
        f"{figures.requests / n:.1f} agent requests / node ({top}), "
        f"{(figures.requests - heartbeats) / n:.1f} without the heartbeat Lease, "
        f"{figures.leases.get(fleet.secret, 0) / n:.1f} on the pool's Lease; "
        f"409 conflicts {figures.codes.get(409, 0)}; agents' watches open at once: peak "
        f"{max_overlap(figures.watch_spans)}"
    )


async def rollout(
    fleet: Fleet, label: str, k: int | None, within: float, *, serial: bool = False
) -> None:
    """One Secret update (kubelet changed) until every Node reports it. ``k``: paced with K
    slots; ``serial``: Gardener's serial mode (one node at a time on the Lease spec)."""
    assert fleet.watcher is not None
    annotations = pacing_annotations(k, breaker=None) if k is not None else {}
    if serial:
        annotations[ANNOTATION_SERIAL] = "true"
        k = 1
    tag = fleet.next_tag()
    nodes = fleet.names
    pid = fleet.cp.apiserver.popen.pid  # type: ignore[union-attr]
    print(f"{label}: publishing {tag} {annotations or '(no pacing)'}", flush=True)
    conflicts_before = await lease_conflicts(fleet)
    line = LineSampler(fleet.admin, fleet.secret, k or 1)
    with CpuSampler(pid) as cpu, line:
        t0 = time.time()
        checksum = await publish(fleet.admin, fleet.secret, fleet_osc(tag), annotations)
        fleet.kubelet_tag = tag
        views = (
            asyncio.get_running_loop().create_task(fleet_views(fleet, checksum, label))
            if fleet.args.fleet_view and k is not None
            else None
        )
        done = await fleet.watcher.wait_all(nodes, checksum, within, progress=label)
        t1 = time.time()
    if views is not None:
        await asyncio.wait_for(views, 60)
    elapsed = t1 - t0
    converged = sorted(
        fleet.watcher.seen[(n, checksum)] - t0 for n in nodes if (n, checksum) in fleet.watcher.seen
    )
    per_node = [outages(read_marks(m.node), t0) for m in fleet.members]
    spans = [s for node_spans in per_node for s in node_spans]
    peak = max_overlap(spans)
    state = "" if done else f" NOT CONVERGED ({len(converged)}/{len(nodes)} after {within:.0f}s)"
    fleet.row(
        f"{label}: Secret update -> all nodes converged",
        f"{elapsed:.1f} s{state}",
        f"p50 node {statistics.median(converged):.1f} s" if converged else "",
    )
    verdict = "unpaced" if k is None else f"K = {k}: {'ok' if peak <= k else 'ABOVE K'}"
    fleet.row(
        f"{label}: max disruptive restarts at once",
        f"{peak}",
        f"{sum(1 for p in per_node if p)} nodes restarted kubelet ({len(spans)} restarts, "
        f"outage p50 {statistics.median([b - a for a, b in spans]) if spans else 0:.1f} s); "
        f"{verdict}",
    )
    conflicts_after = await lease_conflicts(fleet)
    fleet.row(
        f"{label}: lost Lease writes, as the agents count them",
        f"{sum(conflicts_after.values()) - sum(conflicts_before.values())}",
        f"by write: {conflicts_note(conflicts_before, conflicts_after)}",
    )
    if k is not None and not serial:
        fleet.row(f"{label}: the line, sampled each second", line.note())
    fleet.figures[label] = {
        "k": k,
        "serial": serial,
        "wall_s": elapsed,
        "converged": len(converged),
        "max_down": peak,
        "apiserver_cpu_s": cpu.total,
        "load_average": os.getloadavg()[0],
    }
    fleet.row(
        f"{label}: kube-apiserver CPU",
        f"mean {cpu.total / cpu.wall * 100:.0f} %, busiest second "
        f"{max(cpu.samples, default=0) * 100:.0f} % of a core",
        f"{cpu.total:.1f} CPU s over {cpu.wall:.1f} s; " + await api_note(fleet, t0, t1, label),
    )


CONFLICTS_METRIC = re.compile(
    r'^node_agent_rollout_lease_conflicts_total\{write="([a-z-]+)"\} ([0-9.e+]+)$', re.M
)


async def lease_conflicts(fleet: Fleet) -> Counter[str]:
    """The agents' own count of lost compare-and-swap writes on the pool's Lease, by what each
    write was for (``node_agent_rollout_lease_conflicts_total{write}``, summed over the pool;
    an agent that does not answer counts nothing)."""
    import aiohttp

    total: Counter[str] = Counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:

        async def one(member: Member) -> None:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                url = f"http://127.0.0.1:{member.metrics_port}/metrics"
                async with session.get(url) as response:
                    text = await response.text()
                for write, value in CONFLICTS_METRIC.findall(text):
                    total[write] += int(float(value))

        await asyncio.gather(*(one(m) for m in fleet.members if m.metrics_port))
    return total


def conflicts_note(before: Counter[str], after: Counter[str]) -> str:
    grown = {w: after[w] - before.get(w, 0) for w in sorted(after) if after[w] > before.get(w, 0)}
    return ", ".join(f"{w} {n}" for w, n in grown.items()) or "none"


async def fleet_views(fleet: Fleet, checksum: str, label: str) -> None:
    """``node-agent fleet`` (its collect and text, in this process, as admin) at three moments
    of a paced rollout: just after the Secret changed, half the pool converged, all of it. Each
    view's time and API requests are rows of the table; the screens are printed."""
    from node_agent.commands import fleet as view
    from node_agent.kube.client import KubeClient

    assert fleet.watcher is not None
    total = len(fleet.names)
    async with KubeClient.from_kubeconfig(fleet.cp.admin_kubeconfig) as kube:
        for moment, target in (("start", 0), ("half", total // 2), ("end", total)):
            if moment == "start":
                await asyncio.sleep(3)  # the first slots taken
            while fleet.watcher.count(fleet.names, checksum) < target:
                fleet.watcher.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(fleet.watcher.changed.wait(), 1.0)
            began = time.monotonic()
            report = await view.collect(kube)
            took = time.monotonic() - began
            print(f"--- {label}: fleet view at {moment} ({took:.2f} s, {report.requests} requests)")
            print(view.render(report), flush=True)
            fleet.row(
                f"{label}: fleet view at {moment}",
                f"{took:.2f} s",
                f"{report.requests} requests; {sum(report.listed.values())} objects listed",
            )


async def ledger(fleet: Fleet) -> pacing.Ledger:
    """The pool's rollout ledger (on the Lease named like the Secret), read as admin."""
    try:
        lease = await client.CoordinationV1Api(fleet.admin).read_namespaced_lease(fleet.secret, NS)
    except client.ApiException:
        return pacing.Ledger()
    return pacing.Ledger.load((lease.metadata.annotations or {}).get(pacing.ANNOTATION_LEDGER))


async def breaker(fleet: Fleet, k: int, f: int, within: float) -> None:
    """A bad OSC with the breaker at F: count the nodes that applied it (started bad kubelet)."""
    assert fleet.watcher is not None
    tag = fleet.next_tag() + "-bad"
    annotations = pacing_annotations(k, breaker=f)
    print(f"breaker: publishing {tag} (kubelet exits at once) {annotations}", flush=True)
    with CpuSampler(fleet.cp.apiserver.popen.pid) as cpu:  # type: ignore[union-attr]
        t0 = time.time()
        checksum = await publish(fleet.admin, fleet.secret, fleet_osc(tag, bad=True), annotations)
        # until no node has started the bad kubelet for a while (the breaker holds the rest)
        quiet_for, last_count, deadline = 0.0, -1, time.monotonic() + within
        while time.monotonic() < deadline and quiet_for < fleet.args.breaker_quiet:
            await asyncio.sleep(2)
            count = sum(
                1
                for m in fleet.members
                if any(w == "pre" and t == tag and at >= t0 for w, t, at in read_marks(m.node))
            )
            # the quiet countdown starts with the first bad start
            quiet_for = 0.0 if count != last_count or count == 0 else quiet_for + 2
            last_count = count
        t1 = time.time()
    applied = max(last_count, 0)
    limit = f + k - 1
    record = await ledger(fleet)
    on_bad = fleet.watcher.count(fleet.names, checksum)
    spans = [s for m in fleet.members for s in outages(read_marks(m.node), t0)]
    peak = max_overlap(spans)
    fleet.row(
        f"breaker F={f}, K={k}: nodes that applied the bad OSC",
        f"{applied}",
        f"bound F + K - 1 = {limit}: {'ok' if applied <= limit else 'ABOVE'}; ledger: "
        f"{len(record.failed)} failed, {len(record.slots)} slots held, breaker "
        f"{'open' if len(record.failed) >= f else 'closed'}; Nodes reporting it {on_bad}",
    )
    fleet.row(
        f"breaker F={f}, K={k}: max disruptive restarts at once",
        f"{peak}",
        f"bad starts and rollbacks, {len(spans)} outages; K = {k}: "
        f"{'ok' if peak <= k else 'ABOVE K'}",
    )
    fleet.row(
        f"breaker F={f}, K={k}: kube-apiserver CPU",
        f"mean {cpu.total / cpu.wall * 100:.0f} %",
        f"{cpu.total:.1f} CPU s over {cpu.wall:.0f} s (incl. {fleet.args.breaker_quiet:g} s "
        f"quiet); " + await api_note(fleet, t0, t1),
    )


#: what runs in every node: ``--agent``
FLAVOURS = ("node-agent", "upstream")


async def run(args: argparse.Namespace) -> None:
    """Each flavour asked for, one after the other on a bed of its own; with more than one, the
    figures side by side."""
    flavours = list(FLAVOURS) if args.agent == "both" else [args.agent]
    done: dict[str, Fleet] = {}
    for flavour in flavours:
        if len(flavours) > 1:
            print(f"=== {flavour}: {args.agents} agents ===", flush=True)
        done[flavour] = await run_flavour(args, flavour)
    if len(done) > 1:
        print_side_by_side(done)
    if args.json is not None:

        def figures(fleet: Fleet) -> dict[str, Any]:
            return {
                "agents": args.agents,
                "settle_s": args.settle,
                "load_average": fleet.load_at_end,
                "scenarios": fleet.figures,
            }

        doc = (
            figures(done[flavours[0]])
            if len(done) == 1
            else {"flavours": {name: figures(fleet) for name, fleet in done.items()}}
        )
        Path(args.json).write_text(json.dumps(doc, indent=1))


def print_side_by_side(done: dict[str, Fleet]) -> None:
    """Every figure of the flavours' tables on one line: its value under each flavour."""
    names = list(done)
    figures: dict[str, dict[str, str]] = {}
    for name, fleet in done.items():
        for r in fleet.rows:
            figures.setdefault(r.figure, {})[name] = r.value
    header = ["figure", *names]
    cells = [header] + [[f, *(v.get(n, "-") for n in names)] for f, v in figures.items()]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    print()
    print(f"side by side, {len(next(iter(done.values())).members)} agents each:")
    for i, line in enumerate(cells):
        print("  " + "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))


async def run_flavour(args: argparse.Namespace, flavour: str) -> Fleet:
    """The whole bench with ``flavour``'s agent in every node; its table printed."""
    work = cache_dir() / "bench" / f"fleet-{uuid.uuid4().hex[:8]}"
    (work / "logs").mkdir(parents=True)
    audit_log, policy = work / "audit.log", work / "audit-policy.yaml"
    policy.write_text(AUDIT_POLICY)
    scenarios = args.scenarios.split(",")
    old_inotify = raise_inotify(args.agents)
    cp = ControlPlane(work / "cp")
    cp.apiserver.argv += [
        f"--audit-policy-file={policy}",
        f"--audit-log-path={audit_log}",
        "--audit-log-format=json",
        "--audit-log-mode=batch",
        "--audit-log-batch-max-wait=1s",
    ]
    members: list[Member] = []
    tasks: list[asyncio.Task[None]] = []  # cancelled before the teardown
    started = time.monotonic()
    upstream = Upstream(cp, work) if flavour == "upstream" else None
    try:
        cp.start()
        if upstream is not None:
            upstream.start()
        for i in range(args.agents):
            name = f"fleet-{i:03d}"
            node = IsolatedSystemd(
                work / "nodes", overlay=True, name=f"na-fleet-{work.name[6:]}-{i}"
            )
            members.append(Member(name, node))
            node.start()
        print(f"{args.agents} nodes booted in {time.monotonic() - started:.1f} s", flush=True)
        async with await api_client_from(cp.admin_kubeconfig) as admin:
            secret = f"gardener-node-agent-pool-a-{uuid.uuid4().hex[:16]}"
            fleet = Fleet(
                args, work, cp, admin, secret, members, audit_log=audit_log, upstream=upstream
            )
            await client.CoreV1Api(admin).create_namespaced_secret(
                NS,
                client.V1Secret(
                    metadata=client.V1ObjectMeta(name=TOKEN_SECRET),
                    string_data={"token": "shipper-token"},
                ),
            )
            fleet.kubelet_tag = fleet.next_tag()
            checksum = await publish(admin, secret, fleet_osc(fleet.kubelet_tag), {})
            await gather_limited(8, [functools.partial(fleet.register, m) for m in members])
            fleet.watcher = NodeWatch(admin)
            fleet.watcher.start()
            supervisor = asyncio.get_running_loop().create_task(fleet.supervise())
            tasks.append(supervisor)
            t0 = time.monotonic()
            for member in members:
                await fleet.spawn(member)
                await asyncio.sleep(args.spawn_gap)
            ok = await fleet.watcher.wait_all(
                fleet.names, checksum, args.timeout, progress="first apply"
            )
            first = time.monotonic() - t0
            if not ok:
                raise SystemExit(f"the fleet did not converge on the first OSC in {first:.0f} s")
            load = os.getloadavg()
            fleet.row(
                "first OSC on fresh agents",
                f"{first:.1f} s",
                f"{args.agents} {flavour} agents spawned {args.spawn_gap:g} s apart, until every "
                f"Node reported it (load average {load[0]:.1f})",
            )
            await asyncio.sleep(args.settle + 10)  # first applies' history, conditions, Events
            for scenario in scenarios:
                if scenario == "steady":
                    await steady(fleet, audit_log)
                elif scenario == "unpaced":
                    await rollout(fleet, "unpaced", None, args.timeout)
                elif scenario == "serial":
                    await rollout(fleet, "serial", None, args.timeout, serial=True)
                elif scenario.startswith("k"):
                    k = int(scenario[1:])
                    await rollout(fleet, f"K={k}", k, args.timeout)
                elif scenario == "breaker":
                    await breaker(fleet, args.breaker_k, args.breaker, args.timeout)
                elif scenario == "crash":
                    from bench.fleet_crash import crash

                    await crash(fleet, args.crash_ttl)
                elif scenario == "outage":
                    from bench.fleet_outage import outage

                    await outage(fleet, args.outage_seconds)
                else:
                    raise SystemExit(f"unknown scenario {scenario!r}")
                if fleet.alive() != len(members):  # an agent that died is a finding
                    print(f"WARNING: {len(members) - fleet.alive()} agents exited", flush=True)
            await fleet.watcher.stop()
            supervisor.cancel()
            await asyncio.gather(supervisor, return_exceptions=True)
        fleet.load_at_end = os.getloadavg()
        print_table(fleet, time.monotonic() - started)
        return fleet
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await teardown(members)
        if upstream is not None:
            await upstream.stop()
        cp.stop()
        if old_inotify is not None:
            INOTIFY_SYSCTL.write_text(str(old_inotify))
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


async def teardown(members: list[Member]) -> None:
    for member in members:
        if member.proc is not None and member.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                member.proc.terminate()
    for member in members:
        if member.proc is not None:
            try:
                await asyncio.wait_for(member.proc.wait(), 20)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    member.proc.kill()
                await member.proc.wait()
    for member in members:
        member.node.stop()


#: a warning or error line of an agent's text log, and its message
LOG_LEVEL = re.compile(r"\[(warning|error|critical)\s*\]\s+(.*?)(?:\s{2,}|\s+\w+=|$)")


def log_message(text: str) -> str:
    """A log line's message without what differs between lines of one kind (the error in
    parentheses, names, numbers), so that lines of one kind are counted together."""
    text = re.sub(r"\s*\(.*", "", text)
    return re.sub(r"\d+(\.\d+)?", "N", text)[:80]


def print_table(fleet: Fleet, wall: float) -> None:
    load = os.getloadavg()
    print()
    flavour = "upstream gardener-node-agent" if fleet.upstream is not None else "node-agent"
    print(
        f"fleet: {len(fleet.members)} {flavour} agents (one real systemd each), one "
        "kube-apiserver; "
        f"2 cores; load average at the end {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}; "
        f"bench wall {wall / 60:.1f} min; health gate settle window {fleet.args.settle:g} s"
    )
    levels: Counter[str] = (
        fleet.upstream.log_levels(fleet) if fleet.upstream is not None else Counter()
    )
    for member in fleet.members:
        if member.log is None:  # upstream's agents log to their node's journal
            continue
        with contextlib.suppress(OSError):
            for line in member.log.read_text(errors="replace").splitlines():
                found = LOG_LEVEL.search(line)
                if found:
                    levels[f"{found.group(1)}: {log_message(found.group(2))}"] += 1
    print(
        f"agents running at the end: {fleet.alive()}/{len(fleet.members)}; restarted after "
        f"exiting: {sum(fleet.restarts.values())} times ({len(fleet.restarts)} agents); "
        "their log lines: "
        f"{dict(levels) or 'no warning or error'}"
    )
    width = max(len(r.figure) for r in fleet.rows)
    vwidth = max(len(r.value) for r in fleet.rows)
    for r in fleet.rows:
        print(f"  {r.figure:<{width}}  {r.value:<{vwidth}}  {r.note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--agents", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="10 agents, 1 min idle")
    parser.add_argument("--idle-minutes", type=float, default=5.0)
    parser.add_argument(
        "--scenarios",
        default="steady,unpaced,k10,k5,breaker,k1",
        help="comma-separated: steady, unpaced, k<K> (K parallel slots), breaker, serial "
        "(Gardener's serial mode), outage (kube-apiserver stopped, see --outage-seconds)",
    )
    parser.add_argument(
        "--agent",
        choices=[*FLAVOURS, "both"],
        default="node-agent",
        help="what runs in every node: node-agent, upstream gardener-node-agent (Gardener's "
        "newest release the bed serves), or both one after the other (a side-by-side table)",
    )
    parser.add_argument("--breaker", type=int, default=3, help="F: failures that stop a rollout")
    parser.add_argument("--breaker-k", type=int, default=5, help="K during the breaker scenario")
    parser.add_argument(
        "--breaker-quiet", type=float, default=60.0, help="s without a new bad start: done"
    )
    parser.add_argument(
        "--outage-seconds", type=float, default=60.0, help="outage: kube-apiserver down this long"
    )
    parser.add_argument(
        "--outage-idle",
        type=float,
        default=60.0,
        help="outage: s of the idle window before it (and of the window after the return)",
    )
    parser.add_argument(
        "--crash-ttl", type=float, default=60.0, help="slot ttl of the crash scenario, s"
    )
    parser.add_argument("--settle", type=float, default=5.0, help="health gate settle window, s")
    parser.add_argument("--spawn-gap", type=float, default=1.0, help="s between agent spawns")
    parser.add_argument("--timeout", type=float, default=1800.0, help="s per rollout")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--json", help="also write each rollout's figures to this file (for bench.fleet_fit)"
    )
    parser.add_argument(
        "--fleet-view",
        action="store_true",
        help="show node-agent fleet at three moments of each paced rollout (timed, counted)",
    )
    args = parser.parse_args()
    if args.agent != "node-agent" and args.scenarios != "outage":
        parser.error("--agent upstream / both: --scenarios outage only")
    if args.quick:
        args.agents, args.idle_minutes = 10, 1.0
    if os.geteuid() != 0:
        raise SystemExit("run as root (the nodes are real systemd instances in namespaces)")

    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
