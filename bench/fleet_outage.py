"""The ``outage`` scenario of ``bench.fleet``: kube-apiserver stopped under an idle pool.

A shoot's API server goes away (a crash, a rolling update of the control plane) and every agent
of every pool loses its watches and its heartbeat at the same moment; when it comes back they all
reconnect. That return must not be a storm, the agents must not exit, nothing on the nodes may
restart, and an OSC that Gardener published just before must still arrive everywhere.

The sequence, measured from outside the agents:

1. an idle window (``--outage-idle`` s): the agents' requests by identity (audit log), the
   busiest second, kube-apiserver's CPU;
2. an OSC change that restarts nothing (one more file, ``NOTE``) is published and kube-apiserver
   is stopped at once (SIGTERM; etcd stays up). How many nodes had the file on disk, and how many
   reported the checksum on their Node, at that moment is recorded;
3. ``--outage-seconds`` later kube-apiserver is started again: same port, certificates, etcd;
4. from the start of the new process (the *return*): each agent's first heartbeat renewal
   (``renewTime`` of ``kube-system/gardener-node-agent-<node>`` after the return; max and p50),
   the time until every Node reports the pending OSC, the agents' requests in the first
   ``--outage-idle`` s against the idle window (per node per minute; lists and watches apart;
   the busiest second; response codes), agents that exited, units restarted (the stand-in
   kubelet's marks, and every OSC unit's ``InvocationID`` before and after), and the agents'
   failed attempts while the server was away (their log lines).

With ``--agent upstream`` (``bench/fleet_upstream.py``) every node runs upstream
gardener-node-agent as Gardener's unit; everything above is measured the same way from outside
(its identity is Gardener's machine user, counted in the same audit log). What differs: an agent
that exits is restarted by systemd (``Restart=always``), and the bench counts the unit's new
invocations as exits; the failed attempts are upstream's error lines in its node's journal (its
client-go reflectors do not log a refused connection at its default verbosity, so only the
controllers' errors count). ``--agent both`` runs node-agent's fleet, then upstream's, and
prints the two side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client

from bench.fleet import (
    NOTE,
    Fleet,
    cpu_seconds,
    fleet_osc,
    parse_time,
    publish,
    read_marks,
    resource_of,
)
from tests.conftest import api_client_from
from tests.testbed.agent_harness import NS
from tests.testbed.systemd_ns import IsolatedSystemd

#: the units of the fleet's OSC (none may restart because of an outage)
OSC_UNITS = ("kubelet.service", "fleet-helper-0.service", "fleet-helper-1.service")
LEASE_PREFIX = "gardener-node-agent-"
#: how long after the return the bench waits for every Lease and every Node at most
RETURN_LIMIT = 300.0


@dataclass
class Requests:
    """The agents' requests received in one window, from the audit log."""

    seconds: float
    total: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)
    codes: Counter[int] = field(default_factory=Counter)
    #: requests per whole second of the window (its busiest second)
    per_second: Counter[int] = field(default_factory=Counter)
    #: seconds after the window's start at which each watch was received
    watch_at: list[float] = field(default_factory=list)
    #: watches that stream an initial list (``sendInitialEvents=true``: client-go's watch-list,
    #: a list without a list request)
    watch_lists: int = 0

    def per_node_minute(self, n: int) -> float:
        return self.total / n / (self.seconds / 60)

    def verb(self, verb: str) -> int:
        return sum(v for k, v in self.by_kind.items() if k.split(" ", 1)[0] == verb)


def audit_requests(
    path: Path, users: set[str], windows: list[tuple[float, float]]
) -> list[Requests]:
    """Per window [start, end): the agents' requests (by ``requestReceivedTimestamp``)."""
    first: dict[str, dict[str, Any]] = {}
    code: dict[str, int] = {}
    with path.open() as lines:
        for line in lines:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if (event.get("user") or {}).get("username") not in users:
                    continue
                first.setdefault(event["auditID"], event)
                if event.get("stage") == "ResponseComplete":
                    code[event["auditID"]] = int((event.get("responseStatus") or {}).get("code", 0))
    out = [Requests(end - start) for start, end in windows]
    for audit_id, event in first.items():
        received = parse_time(event["requestReceivedTimestamp"])
        for (start, end), figures in zip(windows, out, strict=True):
            if not start <= received < end:
                continue
            figures.total += 1
            figures.by_kind[f"{event['verb']} {resource_of(event)}"] += 1
            figures.per_second[int(received - start)] += 1
            if audit_id in code:
                figures.codes[code[audit_id]] += 1
            if event["verb"] == "watch":
                figures.watch_at.append(received - start)
                if "sendInitialEvents=true" in str(event.get("requestURI", "")):
                    figures.watch_lists += 1
    return out


def invocations(node: IsolatedSystemd) -> list[str]:
    """The InvocationID of each OSC unit (a changed one: the unit was restarted)."""
    result = node.run(["systemctl", "show", "-p", "InvocationID", *OSC_UNITS], check=False)
    return [line.split("=", 1)[1] for line in result.stdout.splitlines() if "=" in line]


def note_on_disk(node: IsolatedSystemd, note: str) -> bool:
    try:
        return node.path(NOTE).read_text().strip() == note
    except OSError:
        return False


def log_sizes(fleet: Fleet) -> list[int]:
    sizes = []
    for member in fleet.members:
        try:
            sizes.append(member.log.stat().st_size if member.log else 0)
        except OSError:
            sizes.append(0)
    return sizes


def failed_attempts(fleet: Fleet, since: list[int], until: list[int]) -> Counter[str]:
    """The agents' log lines between two sizes of their logs that say an attempt failed."""
    found: Counter[str] = Counter()
    for member, start, end in zip(fleet.members, since, until, strict=True):
        if member.log is None:
            continue
        with contextlib.suppress(OSError), member.log.open("rb") as log:
            log.seek(start)
            for line in log.read(max(0, end - start)).decode(errors="replace").splitlines():
                if "lease not renewed" in line:
                    found["lease"] += 1
                elif "retrying in" in line:
                    found[
                        "watch/list" if "watch for" in line or "list for" in line else "other"
                    ] += 1
    return found


async def first_renewals(fleet: Fleet, back: float, limit: float) -> dict[str, float]:
    """Each node's first heartbeat ``renewTime`` after ``back`` (seconds since the epoch), by
    polling the Leases as admin twice a second (a fresh client: the old one's connections died
    with the server) until every node has one or ``limit`` s passed."""
    wanted = {LEASE_PREFIX + name: name for name in fleet.names}
    found: dict[str, float] = {}
    deadline = time.monotonic() + limit
    async with await api_client_from(fleet.cp.admin_kubeconfig) as admin:
        leases = client.CoordinationV1Api(admin)
        while len(found) < len(wanted) and time.monotonic() < deadline:
            with contextlib.suppress(Exception):  # not ready yet: poll again
                for lease in (await leases.list_namespaced_lease(NS)).items:
                    node = wanted.get(lease.metadata.name)
                    renew = lease.spec.renew_time
                    if node and node not in found and renew and renew.timestamp() > back:
                        found[node] = renew.timestamp()
            await asyncio.sleep(0.5)
    return found


def spread(values: list[float]) -> str:
    if not values:
        return "none"
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"p50 {statistics.median(ordered):.1f} s, p90 {p90:.1f} s, max {ordered[-1]:.1f} s"


async def outage(fleet: Fleet, seconds: float) -> None:
    """Stop kube-apiserver under the idle fleet for ``seconds``, start it again, measure."""
    assert fleet.watcher is not None
    args, cp, n = fleet.args, fleet.cp, len(fleet.members)
    label = f"outage {seconds:g}s"
    window = args.outage_idle
    users = {m.user for m in fleet.members}
    restarts_before = sum(fleet.restarts.values())

    print(f"{label}: idle window of {window:g} s ...", flush=True)
    api_pid = cp.apiserver.popen.pid  # type: ignore[union-attr]
    idle_cpu0, idle_start = cpu_seconds(api_pid), time.time()
    await asyncio.sleep(window)
    idle_end, idle_cpu = time.time(), cpu_seconds(api_pid) - idle_cpu0
    before_units = await asyncio.gather(
        *(asyncio.to_thread(invocations, m.node) for m in fleet.members)
    )
    marks_before = [len(read_marks(m.node)) for m in fleet.members]

    note = f"outage-{fleet.next_tag()}"
    osc = fleet_osc(fleet.kubelet_tag, note=note)
    t_publish = time.time()
    checksum = await publish(fleet.admin, fleet.secret, osc, {})
    stop_began = time.time()
    await asyncio.to_thread(cp.stop_apiserver)
    t_gone = time.time()  # the process exited (its listener closed at the SIGTERM already)
    on_disk_at_stop = sum(note_on_disk(m.node, note) for m in fleet.members)
    reported_at_stop = fleet.watcher.count(fleet.names, checksum)
    logs_down = log_sizes(fleet)
    load_down = os_load()
    print(
        f"{label}: published {checksum[:12]} and stopped kube-apiserver "
        f"({stop_began - t_publish:.2f} s after the publish, stop took "
        f"{t_gone - stop_began:.1f} s; "
        f"on disk {on_disk_at_stop}/{n}, reported {reported_at_stop}/{n}); down for {seconds:g} s",
        flush=True,
    )
    exited_during = 0
    # down from the SIGTERM: kube-apiserver stops listening at once (its log), the process
    # itself may take up to the 15 s the bed gives it before SIGKILL
    while time.time() < stop_began + seconds:
        await asyncio.sleep(min(1.0, max(0.0, stop_began + seconds - time.time())))
        exited_during = max(exited_during, n - fleet.alive())
    on_disk_at_return = sum(note_on_disk(m.node, note) for m in fleet.members)
    logs_back = log_sizes(fleet)
    t_back = time.time()
    renewals = asyncio.get_running_loop().create_task(first_renewals(fleet, t_back, RETURN_LIMIT))
    await asyncio.to_thread(cp.start_apiserver)
    t_ready = time.time()
    new_pid = cp.apiserver.popen.pid  # type: ignore[union-attr]
    cpu0 = cpu_seconds(new_pid)
    print(f"{label}: kube-apiserver back, ready after {t_ready - t_back:.1f} s", flush=True)
    all_applied = await fleet.watcher.wait_all(fleet.names, checksum, RETURN_LIMIT, progress=label)
    renewed = await renewals
    # the first window after the return, and the audit backend's last batch
    await asyncio.sleep(max(0.0, t_back + window - time.time()) + 2.0)
    after_cpu = cpu_seconds(new_pid) - cpu0
    after_wall = time.time() - 2.0 - t_ready
    exited = max(exited_during, n - fleet.alive())
    after_units = await asyncio.gather(
        *(asyncio.to_thread(invocations, m.node) for m in fleet.members)
    )
    idle, after, during = audit_requests(
        fleet.audit_log,
        users,
        [(idle_start, idle_end), (t_back, t_back + window), (stop_began, t_back)],
    )
    attempts = (
        await asyncio.to_thread(fleet.upstream.failed_attempts, fleet, t_gone, t_back)
        if fleet.upstream is not None
        else failed_attempts(fleet, logs_down, logs_back)
    )
    restarted_marks = sum(
        1
        for m, count in zip(fleet.members, marks_before, strict=True)
        for what, _tag, at in read_marks(m.node)[count:]
        if what in ("down", "pre") and at >= t_publish
    )
    changed_units = sum(
        sum(1 for a, b in zip(old, new, strict=False) if a != b)
        for old, new in zip(before_units, after_units, strict=True)
    )

    renew_after = [at - t_back for at in renewed.values()]
    applied_after = [
        fleet.watcher.seen[(name, checksum)] - t_back
        for name in fleet.names
        if (name, checksum) in fleet.watcher.seen
    ]
    idle_rate, after_rate = idle.per_node_minute(n), after.per_node_minute(n)
    ratio = after_rate / idle_rate if idle_rate else float("inf")
    busiest = max(after.per_second.items(), key=lambda kv: kv[1], default=(0, 0))
    idle_busiest = max(idle.per_second.values(), default=0)

    fleet.row(
        f"{label}: kube-apiserver stopped, started again",
        f"down {t_back - stop_began:.1f} s, start to ready {t_ready - t_back:.1f} s",
        f"SIGTERM {stop_began - t_publish:.2f} s after the OSC was published (the process gone "
        f"{t_gone - stop_began:.1f} s later, its listener at once); etcd stayed up; "
        f"load average at the stop {load_down}, at the end {os_load()}",
    )
    fleet.row(f"{label}: load average at the stop / at the end", f"{load_down} / {os_load()}")
    fleet.row(
        f"{label}: OSC published just before",
        f"{on_disk_at_stop}/{n} on disk at the stop",
        f"{reported_at_stop}/{n} reported on their Node at the stop; {on_disk_at_return}/{n} on "
        "disk at the return",
    )
    worst = max(renew_after, default=float("inf"))
    fleet.row(
        f"{label}: heartbeat Leases renewed after the return",
        f"{len(renewed)}/{n}, max {worst:.1f} s, p50 "
        f"{statistics.median(renew_after) if renew_after else float('nan'):.1f} s",
        f"from the new kube-apiserver's start; within 30 s: {'ok' if worst <= 30 else 'NO'}",
    )
    fleet.row(
        f"{label}: pending OSC reported on every Node",
        f"{max(applied_after, default=float('nan')):.1f} s after the return"
        + ("" if all_applied else f" NOT ALL ({len(applied_after)}/{n})"),
        f"p50 {statistics.median(applied_after) if applied_after else float('nan'):.1f} s "
        "(the bench's Node watch re-lists on the return too)",
    )
    fleet.row(
        f"{label}: agent requests / node / min, idle -> first {window:g} s after",
        f"{idle_rate:.2f} -> {after_rate:.2f} ({ratio:.1f}x)",
        f"3x bound: {'ok' if ratio <= 3 else 'ABOVE'}; after, per node: "
        + ", ".join(f"{k} {v / n:.2f}" for k, v in after.by_kind.most_common(8)),
    )
    fleet.row(
        f"{label}: lists / watches per agent, first {window:g} s after",
        f"{after.verb('list') / n:.2f} / {after.verb('watch') / n:.2f}",
        f"idle window {idle.verb('list') / n:.2f} / {idle.verb('watch') / n:.2f}; watches that "
        f"streamed an initial list (sendInitialEvents) {after.watch_lists / n:.2f}; response "
        f"codes after {dict(after.codes)}",
    )
    fleet.row(
        f"{label}: busiest second after the return",
        f"{busiest[1]} requests ({busiest[1] / n:.2f} / node)",
        f"at +{busiest[0]} s; idle window's busiest {idle_busiest}; watches re-opened after the "
        f"return: {spread(after.watch_at)}",
    )
    fleet.row(
        f"{label}: while down, failed attempts / agent / min",
        f"{sum(attempts.values()) / n / (max(t_back - t_gone, 1.0) / 60):.1f}",
        f"by kind {dict(attempts)} (agents' log lines"
        + (", their journal" if fleet.upstream is not None else "")
        + f"); requests the server saw meanwhile "
        f"{during.total}",
    )
    fleet.row(
        f"{label}: agents exited / units restarted",
        f"{exited} / {restarted_marks + changed_units}",
        f"supervisor restarts {sum(fleet.restarts.values()) - restarts_before}; kubelet marks "
        f"after the publish {restarted_marks}; changed InvocationID of {', '.join(OSC_UNITS)}: "
        f"{changed_units}",
    )
    fleet.row(
        f"{label}: kube-apiserver CPU, idle -> first minute after",
        f"{idle_cpu / (idle_end - idle_start) * 100:.1f} % -> "
        f"{after_cpu / max(after_wall, 1.0) * 100:.1f} % of a core",
        f"after = the new process from ready, {after_wall:.0f} s (its start-up excluded)",
    )
    fleet.figures[label] = {
        "outage_s": seconds,
        "window_s": window,
        "agents": n,
        "leases_renewed": len(renewed),
        "lease_max_s": worst,
        "lease_p50_s": statistics.median(renew_after) if renew_after else None,
        "osc_all_s": max(applied_after, default=None),
        "osc_on_disk_at_stop": on_disk_at_stop,
        "idle_per_node_min": idle_rate,
        "after_per_node_min": after_rate,
        "after_by_kind_per_node": {k: v / n for k, v in after.by_kind.most_common()},
        "after_lists_per_node": after.verb("list") / n,
        "after_watches_per_node": after.verb("watch") / n,
        "after_watch_lists_per_node": after.watch_lists / n,
        "after_requests": after.total,
        "conflicts": after.codes.get(409, 0),
        "watch_reopen_max_s": max(after.watch_at, default=None),
        "apiserver_cpu_after_s": after_cpu,
        "busiest_second": busiest[1],
        "idle_busiest_second": idle_busiest,
        "exited": exited,
        "units_restarted": restarted_marks + changed_units,
        "apiserver_cpu_idle": idle_cpu / (idle_end - idle_start),
        "apiserver_cpu_after": after_cpu / max(after_wall, 1.0),
        "start_to_ready_s": t_ready - t_back,
        "load_average": os_load(),
    }


def os_load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())
