"""What the agent costs a node all the time: memory, start-up, a no-op event, loop stalls.

Boots the test bed (kube-apiserver + etcd, a throwaway node with its own systemd), installs the
agent **from its artifact** the way the standalone install does (the onedir tarball unpacked to
``/opt/node-agent/<version>``; with ``--single-file`` the image's single file as
``/opt/bin/gardener-node-agent`` instead) and runs it as a ``Type=notify`` service with
least-privilege credentials and a small OSC. Prints:

- the daemon's imports in the repo's venv, RSS growth per top-level package (``footprint_imports``);
- whole-service idle PSS after 20 s idle (``Pss`` of ``smaps_rollup`` over every process of the
  service's cgroup) with each process's PSS and RSS;
- exec → READY (systemd's ``ExecMainStartTimestampMonotonic`` → ``ActiveEnterTimestampMonotonic``)
  over restarts, and exec → first small apply done (the Node's ``checksum/cloud-config-data``
  equals the published checksum, polled every 20 ms; CLOCK_MONOTONIC is shared with the node);
- CPU of a no-op Secret event (annotations changed, osc.yaml not): the service cgroup's
  ``cpu.stat`` ``usage_usec`` over 2 s after the change, minus idle 2 s windows;
- the event loop during a 500-file apply, seen from outside: strace on the main thread only (the
  loop's thread), the busy stretches between two ``epoll_wait`` calls and the file syscalls inside
  them. Also whatever loop-lag metric ``/metrics`` exposes.

    .venv/bin/python -m bench.footprint [--single-file | --artifact TARBALL] [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client

from tests.conftest import api_client_from
from tests.testbed.agent_harness import (
    NS,
    create_node,
    inline_file,
    node_annotations,
    osc_document,
    publish_osc,
    service,
    unique,
    wait_for,
)
from tests.testbed.agent_image import agent_image_layout
from tests.testbed.controlplane import ControlPlane, free_port
from tests.testbed.credentials import node_agent_credentials
from tests.testbed.systemd_ns import IsolatedSystemd
from tests.testbed.userdata import build_artifact

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("NODE_AGENT_TEST_CACHE") or Path.home() / ".cache/node-agent-test")
UNIT = "gardener-node-agent.service"
CONFIG = "/etc/node-agent-bench/config.yaml"
MIB = 1 << 20
ANNOTATION = "checksum/cloud-config-data"
#: Syscalls that name a path (file I/O whatever the fd).
PATH_CALLS = frozenset(
    [
        "open",
        "openat",
        "openat2",
        "stat",
        "lstat",
        "newfstatat",
        "statx",
        "access",
        "faccessat",
        "faccessat2",
        "readlink",
        "readlinkat",
        "rename",
        "renameat",
        "renameat2",
        "unlink",
        "unlinkat",
        "mkdir",
        "mkdirat",
        "rmdir",
        "chmod",
        "fchmodat",
        "chown",
        "fchownat",
        "lchown",
        "symlink",
        "symlinkat",
        "link",
        "linkat",
        "utimensat",
        "truncate",
    ]
)
#: Syscalls on an fd: file I/O when strace -y shows the fd as a path.
FD_CALLS = frozenset(
    [
        "read",
        "write",
        "pread64",
        "pwrite64",
        "readv",
        "writev",
        "fsync",
        "fdatasync",
        "fstat",
        "lseek",
        "close",
        "getdents64",
        "fchmod",
        "fchown",
        "ftruncate",
        "fallocate",
        "syncfs",
        "flock",
        "fcntl",
    ]
)
LINE = re.compile(r"^(\d+\.\d+) (\w+)\((.*)\) += (.*?)(?: <(\d+\.\d+)>)?$")


# -- the node ---------------------------------------------------------------------------------
def show(node: IsolatedSystemd, *props: str) -> dict[str, str]:
    out = node.run(["systemctl", "show", "-p", ",".join(props), UNIT]).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def systemctl(node: IsolatedSystemd, action: str) -> None:
    done = node.run(["systemctl", action, UNIT], timeout=120, check=False)
    if done.returncode != 0:
        journal = node.run(["journalctl", "-u", UNIT, "--no-pager", "-n", "40"], check=False)
        raise SystemExit(f"systemctl {action} {UNIT} failed:\n{journal.stdout}")


def ready_seconds(node: IsolatedSystemd) -> float:
    props = show(node, "ExecMainStartTimestampMonotonic", "ActiveEnterTimestampMonotonic")
    started = int(props["ExecMainStartTimestampMonotonic"])
    return (int(props["ActiveEnterTimestampMonotonic"]) - started) / 1e6


def exec_started(node: IsolatedSystemd) -> float:
    """When systemd exec'd the main process, on this process's monotonic clock."""
    return (
        int(show(node, "ExecMainStartTimestampMonotonic")["ExecMainStartTimestampMonotonic"]) / 1e6
    )


def timeline(node: IsolatedSystemd, since_exec: float, until: float) -> list[str]:
    """The service's journal lines from exec to ``until`` (both on CLOCK_MONOTONIC, which the
    node shares), each with the milliseconds since exec: where a start's time goes."""
    out = node.run(["journalctl", "-u", UNIT, "-o", "json", "--no-pager", "-n", "400"]).stdout
    lines: list[str] = []
    for raw in out.splitlines():
        entry = json.loads(raw)
        at = int(entry.get("__MONOTONIC_TIMESTAMP", 0)) / 1e6
        if not since_exec <= at <= until + 0.05:
            continue
        message = entry.get("MESSAGE", "")
        if isinstance(message, list):  # journald's form of a line that is not valid UTF-8
            message = bytes(message).decode(errors="replace")
        try:
            event = json.loads(message.split(" ", 1)[-1] if message[:1] == "<" else message)
            text = str(event.get("event", message))
        except (ValueError, AttributeError):
            text = message
        lines.append(f"  {(at - since_exec) * 1000:7.0f} ms  {text[:100]}")
    return lines


def cgroup(node: IsolatedSystemd) -> str:
    return "/sys/fs/cgroup" + show(node, "ControlGroup")["ControlGroup"]


@dataclass
class Proc:
    pid: int
    role: str
    pss: int
    rss: int
    cmd: str


PROCS_SCRIPT = r"""
for pid in $(cat "$1/cgroup.procs"); do
  echo "== $pid"
  tr '\0' ' ' < /proc/$pid/cmdline; echo
  grep '^Pss:' /proc/$pid/smaps_rollup
  grep '^VmRSS:' /proc/$pid/status
done
"""


def service_procs(node: IsolatedSystemd) -> list[Proc]:
    main_pid = int(show(node, "MainPID")["MainPID"])
    out = node.run(["sh", "-c", PROCS_SCRIPT, "sh", cgroup(node)]).stdout
    procs: list[Proc] = []
    for block in out.split("== ")[1:]:
        lines = block.splitlines()
        fields = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in lines[2:] if ":" in ln}
        pid, cmd = int(lines[0]), lines[1].strip()
        role = (
            "systemd worker"
            if "node_agent.systemd.worker" in cmd
            else "main"
            if pid == main_pid
            else "other"
        )
        procs.append(Proc(pid, role, fields.get("Pss", 0), fields.get("VmRSS", 0), cmd))
    return procs


def cpu_usec(node: IsolatedSystemd, group: str) -> int:
    for line in node.path(f"{group}/cpu.stat").read_text().splitlines():
        if line.startswith("usage_usec "):
            return int(line.split()[1])
    raise SystemExit(f"no usage_usec in {group}/cpu.stat")


# -- install ------------------------------------------------------------------------------------
def install_onedir(node: IsolatedSystemd, work: Path, given: Path | None) -> tuple[str, str]:
    """The tarball ``make artifact`` builds from this tree (or ``given``), as the install does."""
    path = build_artifact(work / "dist").path if given is None else given
    version = path.name.removeprefix("node-agent-").removesuffix("-linux-amd64.tar.gz")
    prefix = f"/opt/node-agent/{version}"
    node.path(prefix).mkdir(parents=True, exist_ok=True)
    with tarfile.open(path) as tar:
        tar.extractall(node.path(prefix), filter="tar")
    node.run(["ln", "-sfn", prefix, "/opt/node-agent/current"])
    size = path.stat().st_size / 1e6
    return f"{prefix}/bin/node-agent", f"onedir artifact {path} ({size:.1f} MB)"


def install_single_file(node: IsolatedSystemd, work: Path, given: Path | None) -> tuple[str, str]:
    image = agent_image_layout(work / "dist")
    binary = node.path("/opt/bin/gardener-node-agent")
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.write_bytes(image.executable.read_bytes())
    binary.chmod(0o755)
    node.run(["rm", "-rf", "/var/cache/node-agent"])  # the first start unpacks
    size = image.executable.stat().st_size / 1e6
    return "/opt/bin/gardener-node-agent", f"single file {image.version} ({size:.1f} MB)"


# -- import breakdown ---------------------------------------------------------------------------
def import_breakdown() -> None:
    out = subprocess.run(
        [str(REPO / ".venv/bin/python"), str(REPO / "bench/footprint_imports.py")],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        timeout=120,
    ).stdout
    data = json.loads(out)
    print(
        f"imports (venv python, what `run` imports): bare interpreter {data['base_rss'] / MIB:.1f} "
        f"MiB / {data['base_modules']} modules -> {data['rss'] / MIB:.1f} MiB / "
        f"{data['modules']} modules, {data['cpu_s'] * 1000:.0f} ms CPU"
    )
    print("  own RSS growth per top-level package (top 12; a module's own = growth while it loads")
    print("  minus its nested imports; pydantic model building counts to the module defining it):")
    ranked = sorted(data["own"].items(), key=lambda kv: -kv[1])
    for name, grown in ranked[:12]:
        count = data["module_count"].get(name, 0)
        print(f"    {name:<22} {grown / MIB:6.2f} MiB  ({count} modules)")
    rest = sum(v for _, v in ranked[12:])
    print(f"    {'(the other ' + str(len(ranked) - 12) + ')':<22} {rest / MIB:6.2f} MiB")
    agent = sorted(data["agent_modules"].items(), key=lambda kv: -kv[1])[:5]
    print("  node_agent's heaviest own modules: " + ", ".join(
        f"{n} {v / MIB:.2f}" for n, v in agent) + " MiB")  # fmt: skip


# -- strace of the loop thread ------------------------------------------------------------------
@dataclass
class Stretch:
    start: float
    end: float
    file_time: float = 0.0
    file_calls: int = 0
    worst_call: str = ""
    worst_call_time: float = 0.0

    @property
    def length(self) -> float:
        return self.end - self.start


def is_file_call(name: str, args: str) -> bool:
    if name in PATH_CALLS:
        return True
    if name in FD_CALLS:
        fd = re.match(r"\d+<(.*?)>", args)
        return bool(fd and fd.group(1).startswith("/") and not fd.group(1).startswith("/dev/"))
    return False


def loop_stretches(
    trace: str, since: float, until: float, kinds: dict[str, list[float]]
) -> tuple[list[Stretch], int]:
    """Busy stretches of the loop thread (epoll_wait return -> next epoll_wait call); ``kinds``
    collects the loop thread's file syscalls by name (count, seconds)."""
    stretches: list[Stretch] = []
    current: Stretch | None = None
    syscalls = 0
    for line in trace.splitlines():
        match = LINE.match(line)
        if not match:
            continue
        ts, name, args = float(match.group(1)), match.group(2), match.group(3)
        took = float(match.group(5) or 0.0)
        if ts < since or ts > until:
            continue
        syscalls += 1
        if name in ("epoll_wait", "epoll_pwait", "epoll_pwait2"):
            if current is not None:
                current.end = ts
                stretches.append(current)
            current = Stretch(ts + took, ts + took)
        elif current is not None and is_file_call(name, args):
            current.file_time += took
            current.file_calls += 1
            tally = kinds.setdefault(name, [0, 0.0])
            tally[0] += 1
            tally[1] += took
            if took > current.worst_call_time:
                current.worst_call_time, current.worst_call = took, f"{name}({args[:60]})"
    return stretches, syscalls


def loop_metrics(port: int) -> list[str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError as exc:
        return [f"(metrics unreachable: {exc})"]
    return [ln for ln in text.splitlines() if "loop" in ln and not ln.startswith("#")]


# -- the run ------------------------------------------------------------------------------------
def small_osc(tag: str) -> dict[str, Any]:
    return osc_document(
        [inline_file("/etc/footprint/small.conf", f"small {tag}\n")],
        [service("footprint-probe.service", command="start")],
    )


def big_osc(files: int) -> dict[str, Any]:
    return osc_document(
        [inline_file(f"/etc/footprint/many/f{i:03}.conf", f"file {i}\n" * 8) for i in range(files)],
        [service("footprint-probe.service", command="start")],
    )


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def p50(samples: list[float]) -> str:
    ordered = sorted(samples)
    return (
        f"p50 {ms(statistics.median(ordered))}  min {ms(ordered[0])}  max {ms(ordered[-1])} "
        f"(n={len(ordered)})"
    )


async def run(opts: argparse.Namespace) -> None:
    import_breakdown()
    (CACHE / "tmp").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE / "tmp", prefix="bench-footprint.") as work:
        tmp = Path(work)
        with (
            ControlPlane(tmp / "cp") as control_plane,
            IsolatedSystemd(tmp / "node", overlay=True) as node,
        ):
            admin = await api_client_from(control_plane.admin_kubeconfig)
            async with admin:
                await measure(opts, tmp, control_plane, node, admin)


async def measure(
    opts: argparse.Namespace,
    tmp: Path,
    control_plane: ControlPlane,
    node: IsolatedSystemd,
    admin: client.ApiClient,
) -> None:
    name = unique("footprint")
    secret = f"osc-{name}"
    await create_node(admin, name)
    creds = await node_agent_credentials(
        admin,
        tmp / "creds",
        server=control_plane.server,
        ca_file=control_plane.ca_file,
        node_name=name,
        secret_names=[secret],
    )
    node.run(["hostname", name])
    install = install_single_file if opts.single_file else install_onedir
    binary, what = install(node, tmp, opts.artifact)
    metrics_port = free_port()
    config = {
        "apiVersion": "nodeagent.config.gardener.cloud/v1alpha1",
        "kind": "NodeAgentConfiguration",
        "clientConnection": {"kubeconfig": str(creds.kubeconfig)},
        "server": {
            "healthProbes": {"bindAddress": "127.0.0.1", "port": free_port()},
            "metrics": {"bindAddress": "127.0.0.1", "port": metrics_port},
        },
        "controllers": {
            "operatingSystemConfig": {"secretName": secret, "kubernetesVersion": "1.33.4"}
        },
    }
    node.path(CONFIG).parent.mkdir(parents=True, exist_ok=True)
    node.path(CONFIG).write_text(yaml.safe_dump(config))
    node.path(f"/etc/systemd/system/{UNIT}").write_text(
        "[Unit]\nStartLimitIntervalSec=0\n[Service]\nType=notify\nNotifyAccess=main\n"
        f"ExecStart={binary} run --config {CONFIG}\n"
    )
    node.run(["systemctl", "daemon-reload"])
    print(f"installed: {what}, ExecStart={binary} run --config ...")

    async def applied(checksum: str) -> None:
        async def done() -> bool:
            return (await node_annotations(admin, name)).get(ANNOTATION) == checksum

        await wait_for(done, 120, "the apply", poll=0.02)

    # First start: a fresh node, a small OSC.
    checksum = await publish_osc(admin, secret, small_osc("first"))
    systemctl(node, "start")
    first_ready = ready_seconds(node)
    await applied(checksum)
    first_cpu = cpu_usec(node, cgroup(node)) / 1e6
    exec_at = exec_started(node)
    first_apply = time.monotonic() - exec_at
    print(f"first start: exec -> READY {ms(first_ready)}, exec -> first small apply done "
          f"{ms(first_apply)} (20 ms poll); the service's CPU until then {ms(first_cpu)} "
          f"(launcher, agent, systemd worker: cgroup usage_usec)")  # fmt: skip
    print("first start, the service's journal (ms since exec; journald's receive time):")
    print("\n".join(timeline(node, exec_at, exec_at + first_apply)) or "  (no lines)")

    # Idle memory.
    await asyncio.sleep(opts.idle)
    procs = service_procs(node)
    total_pss = sum(p.pss for p in procs)
    print(f"idle PSS, whole service ({opts.idle:.0f} s idle, small OSC applied): "
          f"{total_pss / MIB:.1f} MiB over {len(procs)} processes")  # fmt: skip
    for proc in procs:
        print(f"  {proc.role:<15} pid {proc.pid:<6} PSS {proc.pss / MIB:6.1f} MiB  "
              f"RSS {proc.rss / MIB:6.1f} MiB  {proc.cmd[:70]}")  # fmt: skip

    # A no-op Secret event: CPU over 2 s after it, minus idle 2 s windows.
    group = cgroup(node)
    core = client.CoreV1Api(admin)
    idle: list[float] = []
    event: list[float] = []
    for i in range(opts.noop_rounds):
        before = cpu_usec(node, group)
        await asyncio.sleep(2.0)
        idle.append((cpu_usec(node, group) - before) / 1000)
        before = cpu_usec(node, group)
        await core.patch_namespaced_secret(
            secret, NS, {"metadata": {"annotations": {"bench.node-agent/noop": str(i)}}}
        )
        await asyncio.sleep(2.0)
        event.append((cpu_usec(node, group) - before) / 1000)
    still = (await node_annotations(admin, name)).get(ANNOTATION) == checksum
    idle_ms = statistics.median(idle)
    extra = [e - idle_ms for e in event]
    windows = ", ".join(f"{e:.1f}" for e in event)
    print(f"no-op Secret event (annotations changed, osc.yaml not; cgroup cpu.stat usage_usec, "
          f"2 s windows): p50 {statistics.median(extra):.1f} ms CPU above idle "
          f"(max {max(extra):.1f}; windows with the event {windows} ms; idle windows p50 "
          f"{idle_ms:.1f} ms; n={len(event)}; checksum unchanged: {still})")  # fmt: skip

    # exec -> READY over restarts without a change.
    ready: list[float] = []
    for _ in range(opts.rounds):
        systemctl(node, "restart")
        ready.append(ready_seconds(node))
    print(f"restart: exec -> READY {p50(ready)}")

    # exec -> first small apply: the agent stopped, a changed small OSC published, started.
    first: list[float] = []
    start_cpu: list[float] = []  # the service's CPU from exec to the apply seen on the Node
    ready_with_change: list[float] = []
    for i in range(opts.apply_rounds):
        systemctl(node, "stop")
        checksum = await publish_osc(admin, secret, small_osc(f"round {i}"))
        systemctl(node, "start")
        await applied(checksum)
        start_cpu.append(cpu_usec(node, cgroup(node)) / 1e6)
        exec_at = exec_started(node)
        first.append(time.monotonic() - exec_at)
        ready_with_change.append(ready_seconds(node))
        if i == opts.apply_rounds - 1:
            print("the last start with a change pending, the service's journal:")
            print("\n".join(timeline(node, exec_at, exec_at + first[-1])) or "  (no lines)")
    print(f"start with a changed small OSC pending: exec -> READY {p50(ready_with_change)}")
    print(f"start with a changed small OSC pending: exec -> apply done on the Node {p50(first)}")
    print(f"start with a changed small OSC pending: the service's CPU until then {p50(start_cpu)} "
          f"(load average {os.getloadavg()[0]:.2f})")  # fmt: skip

    # The loop during a 500-file apply: strace on the main thread (the loop's thread).
    main_pid = int(show(node, "MainPID")["MainPID"])
    trace_path = "/tmp/footprint.strace"
    pid_path = "/tmp/footprint.strace.pid"
    tracer = await asyncio.create_subprocess_exec(
        "nsenter", "-t", str(node.pid), "-m", "-p", "-r", "-w", "sh", "-c",
        f"echo $$ > {pid_path}; exec strace -p {main_pid} -ttt -T -y -s 0 -o {trace_path}",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    await asyncio.sleep(1.0)
    since = time.time()
    checksum = await publish_osc(admin, secret, big_osc(opts.files))
    await applied(checksum)
    until = time.time()
    await asyncio.sleep(0.3)
    node.run(["kill", "-INT", node.path(pid_path).read_text().strip()])
    _, tracer_err = await asyncio.wait_for(tracer.communicate(), 30)
    trace = node.path(trace_path).read_text()
    kinds: dict[str, list[float]] = {}
    stretches, syscalls = loop_stretches(trace, since, until, kinds)
    if not stretches:
        raise SystemExit(f"strace saw no epoll_wait on the main thread: {tracer_err.decode()}")
    longest = max(stretches, key=lambda s: s.length)
    most_io = max(stretches, key=lambda s: s.file_time)
    file_calls = sum(s.file_calls for s in stretches)
    print(f"{opts.files}-file apply, event loop thread under strace (publish -> checksum on the "
          f"Node {ms(until - since)} traced; {syscalls} syscalls on the loop thread, "
          f"{file_calls} of them file I/O, in {len(stretches)} loop iterations):")  # fmt: skip
    print(f"  longest loop iteration (epoll_wait return -> next epoll_wait), any cause: "
          f"{longest.length * 1000:.1f} ms, of which file syscalls "
          f"{longest.file_time * 1000:.1f} ms ({longest.file_calls} calls)")  # fmt: skip
    print(f"  most file I/O inside one loop iteration: {most_io.file_time * 1000:.1f} ms in "
          f"{most_io.file_calls} calls (iteration {most_io.length * 1000:.1f} ms; slowest call "
          f"{most_io.worst_call_time * 1000:.2f} ms: {most_io.worst_call})")  # fmt: skip
    by_kind = sorted(kinds.items(), key=lambda kv: -kv[1][1])
    print("  file syscalls on the loop thread by kind: " + (", ".join(
        f"{k} {int(n)} ({t * 1000:.1f} ms)" for k, (n, t) in by_kind) or "none"))  # fmt: skip
    print(
        "  (strace stops the thread at every syscall: times are inflated, the longest iteration "
        "the most; file syscall times are strace's -T, kernel time plus tracing overhead)"
    )
    lag = loop_metrics(metrics_port)
    print("  /metrics loop-lag lines: " + ("; ".join(lag) if lag else "none exposed"))

    final = service_procs(node)
    print(f"after the {opts.files}-file apply: PSS {sum(p.pss for p in final) / MIB:.1f} MiB "
          f"(" + ", ".join(f"{p.role} {p.pss / MIB:.1f}" for p in final) + ")")  # fmt: skip
    systemctl(node, "stop")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--single-file", action="store_true", help="install the image's file")
    parser.add_argument(
        "--artifact", type=Path, help="measure this onedir tarball instead of building one"
    )
    parser.add_argument("--rounds", type=int, default=10, help="restarts for exec -> READY")
    parser.add_argument("--apply-rounds", type=int, default=5, help="starts with a change pending")
    parser.add_argument("--noop-rounds", type=int, default=5)
    parser.add_argument("--idle", type=float, default=20.0, help="seconds idle before PSS")
    parser.add_argument("--files", type=int, default=500)
    opts = parser.parse_args()
    if opts.artifact is not None and opts.single_file:
        parser.error("--artifact is a onedir tarball; --single-file builds the image")
    if os.geteuid() != 0:
        sys.exit("needs root (the test bed's systemd runs in namespaces)")
    asyncio.run(run(opts))


if __name__ == "__main__":
    main()
