"""The ``upstream`` flavour of ``bench.fleet``: upstream gardener-node-agent in every node.

The same fleet (one real systemd per node, one Node, one pool Secret, the same OSCs, the same
audit log) with Gardener's own agent instead of node-agent, installed as Gardener installs it and
as ``bench.twin`` / ``tests/integration/test_twin.py`` run it on one node:

- Gardener's provision files of the newest release the bed serves (``gardener_gen``: the
  cluster CA, ``machine-name``, ``config-<version>.yaml``), the config changed only where the
  fleet's node-agent config differs from Gardener's: the pool's Secret, the token sync of the
  fleet's token Secret, log level ``info`` as the fleet's node-agent, and free health / metrics
  ports (the nodes share the host's network);
- Gardener's own unit ``gardener-node-agent.service`` (from Gardener's OSC, ``Restart=always``,
  ``--config-dir=/var/lib/gardener-node-agent``), ``/opt/bin/gardener-node-agent`` a symlink to
  the one cached binary (the nodes' overlay root sees the host's files: one copy in memory);
- the identity a bootstrapped agent has: the user
  ``gardener.cloud:node-agent:machine:<node>`` of the group ``gardener.cloud:node-agents``, a
  client certificate of the cluster CA in its kubeconfig (what the CSR flow would hand it,
  without the flow: the fleet measures the outage, not the bootstrap), with the fleet's
  least-privilege rule set for that node (``grant_node_agent_identity``: its Node, its Lease, the
  pool's Secrets, Events) and the list/watch of Nodes, Pods and Leases its caches need
  (``allow_upstream_caches``, as the twin);
- the node's hostname is the Node's name (upstream finds its Node by hostname label).

Upstream's health check has no switch: it probes kubelet on ``127.0.0.1:10248`` and restarts
``kubelet.service`` after a minute without an answer, and asks containerd for its version (and
restarts ``containerd.service`` after a minute without one); its OSC controller restarts
``containerd.service`` when it applies an OSC. The fleet's kubelet is a stand-in that serves
nothing, so the bench answers ``/healthz`` on ``127.0.0.1:10248`` itself (or uses what already
answers 200 there) and the Nodes get an InternalIP (upstream's check wants one); one containerd
for the whole fleet (its state in the work directory, no CRI) answers the version call through
each node's ``/run/containerd/containerd.sock``, a socket the bench listens on from outside and
forwards (a socket on the overlay's lower layer refuses connections from inside the node), and
each node's ``containerd.service`` is a stand-in (``sleep``) that upstream may restart.

An agent that exits is restarted by systemd (``Restart=always``, 5 s): the bench reads the
unit's ``NRestarts`` and ``InvocationID`` every few seconds and counts each restart as an exit.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.server
import json
import subprocess
import threading
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from kubernetes_asyncio import client

from node_agent.base.layout import BASE_DIR, KUBECONFIG_FILE
from tests.integration.test_gardener_generated import (
    UPSTREAM_BINARY,
    UPSTREAM_UNIT,
    allow_upstream_caches,
)
from tests.testbed.agent_harness import host
from tests.testbed.bootstrap import (
    NODE_AGENTS_GROUP,
    grant_node_agent_identity,
    node_agent_user,
)
from tests.testbed.controlplane import ControlPlane, free_port, write_kubeconfig
from tests.testbed.gardener_gen import NEWEST, Generated, gardener_node_agent, generate
from tests.testbed.systemd_ns import HarnessError

if TYPE_CHECKING:
    from bench.fleet import Fleet, Member

#: the kubelet health endpoint upstream probes (its only one)
KUBELET_HEALTHZ = ("127.0.0.1", 10248)
CLUSTER_CA = f"{BASE_DIR}/cluster-ca.crt"
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
CONTAINERD_UNIT = """[Unit]
Description=stand-in containerd (the fleet's one containerd answers on its socket)

[Service]
ExecStart=/bin/sleep infinity
"""
#: how often the bench reads each node's agent unit (exits, restarts)
POLL_SECONDS = 5.0


@dataclass
class UnitState:
    active: str = ""
    restarts: int = 0
    invocation: str = ""


class _Healthz(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"ok"
        self.send_response(200 if self.path.startswith("/healthz") else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


def answers_healthz() -> bool:
    url = f"http://{KUBELET_HEALTHZ[0]}:{KUBELET_HEALTHZ[1]}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return int(reply.status) == 200
    except OSError:
        return False


class Upstream:
    """What the upstream flavour shares across the fleet: Gardener's generated files, the
    kubelet health endpoint, the containerd, and the agents' unit states."""

    def __init__(self, cp: ControlPlane, work: Path) -> None:
        self.cp = cp
        self.work = work
        self.binary = gardener_node_agent()
        self.gen: Generated = generate(
            "k8s-1.33", api_server=cp.server, ca_file=cp.ca_file, release=NEWEST
        )
        self.states: dict[str, UnitState] = {}
        self._server: http.server.ThreadingHTTPServer | None = None
        self._containerd: subprocess.Popen[bytes] | None = None
        self.socket = work / "containerd" / "containerd.sock"
        self._forwarders: list[asyncio.Server] = []

    # -- shared pieces ---------------------------------------------------------------------
    def start(self) -> None:
        try:
            self._server = http.server.ThreadingHTTPServer(KUBELET_HEALTHZ, _Healthz)
        except OSError:
            if not answers_healthz():
                raise HarnessError(
                    f"{KUBELET_HEALTHZ[0]}:{KUBELET_HEALTHZ[1]} is taken and does not answer "
                    "/healthz: upstream's kubelet health check would restart every kubelet"
                ) from None
            print("upstream: 127.0.0.1:10248 already answers /healthz; using it", flush=True)
        else:
            threading.Thread(target=self._server.serve_forever, daemon=True).start()
        top = self.socket.parent
        top.mkdir(parents=True, exist_ok=True)
        config = top / "config.toml"
        config.write_text(
            "version = 2\n"
            f'root = "{top / "root"}"\n'
            f'state = "{top / "state"}"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\n  address = "{self.socket}"\n'
        )
        with (top / "containerd.log").open("ab") as log:
            self._containerd = subprocess.Popen(
                ["containerd", "--config", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    async def stop(self) -> None:
        for server in self._forwarders:
            server.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._containerd is not None:
            self._containerd.terminate()
            try:
                self._containerd.wait(10)
            except subprocess.TimeoutExpired:
                self._containerd.kill()
                self._containerd.wait()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection of an agent to its node's containerd socket, to the fleet's one."""
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(str(self.socket))
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(OSError):
                dst.close()

        with contextlib.suppress(asyncio.CancelledError):  # the bench is shutting down
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    # -- one node --------------------------------------------------------------------------
    async def spawn(self, fleet: Fleet, member: Member, token_secret: str, token_path: str) -> None:
        """The node's containerd socket forwarded, then the agent installed and started."""
        sock = member.node.path(CONTAINERD_SOCKET)
        sock.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        self._forwarders.append(await asyncio.start_unix_server(self._forward, path=str(sock)))
        token_dir = member.node.path(token_path).parent
        token_dir.mkdir(parents=True, exist_ok=True)  # the valitail unit's directory
        config = self.fleet_config(fleet, token_secret, token_path)
        await asyncio.to_thread(self.install, member, config)

    async def register(self, fleet: Fleet, member: Member, secret_names: list[str]) -> None:
        """The agent's identity: Gardener's user for the machine, with the fleet's rule set for
        its node and the list/watch upstream's caches need; a client certificate for it."""
        admin = fleet.admin
        await grant_node_agent_identity(
            admin, member.name, secret_names=secret_names, node_name=member.name
        )
        await allow_upstream_caches(admin, member.name)
        member.identity = node_agent_user(member.name)
        member.certificate = self.cp.ca.issue(
            f"upstream-{member.name}",
            common_name=member.identity,
            organizations=(NODE_AGENTS_GROUP,),
            client=True,
        )
        # the kubelet reports the node's address; upstream's kubelet health check wants one
        await client.CoreV1Api(admin).patch_node_status(
            member.name,
            {"status": {"addresses": [{"type": "InternalIP", "address": "127.0.0.1"}]}},
        )

    def install(self, member: Member, config: dict[str, Any]) -> None:
        """Gardener's provision files, the kubeconfig, the config with ``config``'s changes,
        the binary and Gardener's unit, started."""
        node, root = member.node, member.node.root
        assert member.certificate is not None
        node.run(["hostname", member.name])
        for file in self.gen.provision_files:
            if not file.path.startswith(f"{BASE_DIR}/") or file.path.endswith(
                ("/init.sh", "/bootstrap-token")
            ):
                continue
            target = host(root, file.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            content = member.name + "\n" if file.path.endswith("/machine-name") else file.content
            target.write_text(content)
            target.chmod(file.permissions if file.permissions is not None else 0o600)
        kubeconfig = host(root, KUBECONFIG_FILE)
        kubeconfig.parent.mkdir(parents=True, exist_ok=True)
        write_kubeconfig(
            kubeconfig,
            server=self.cp.server,
            ca_file=Path(CLUSTER_CA),
            user={
                "client-certificate-data": base64.b64encode(
                    member.certificate.cert.read_bytes()
                ).decode(),
                "client-key-data": base64.b64encode(member.certificate.key.read_bytes()).decode(),
            },
            name=member.identity,
        )
        config_file = host(root, self.gen.config_path)
        doc = yaml.safe_load(config_file.read_text())
        for key, value in config.items():
            if isinstance(value, dict) and isinstance(doc.get(key), dict):
                doc[key].update(value)
            else:
                doc[key] = value
        config_file.write_text(yaml.safe_dump(doc))
        member.metrics_port = int(doc["server"]["metrics"]["port"])
        containerd = node.path("/etc/systemd/system/containerd.service")
        with contextlib.suppress(FileNotFoundError):
            containerd.unlink()  # the bed's mask
        containerd.write_text(CONTAINERD_UNIT)
        binary = node.path(UPSTREAM_BINARY)
        binary.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            binary.unlink()
        binary.symlink_to(self.binary)
        (unit,) = [u for u in self.gen.osc["spec"]["units"] if u["name"] == UPSTREAM_UNIT]
        node.path(f"/etc/systemd/system/{UPSTREAM_UNIT}").write_text(unit["content"])
        node.run(["systemctl", "daemon-reload"])
        node.run(["systemctl", "start", UPSTREAM_UNIT])

    def fleet_config(self, fleet: Fleet, token_secret: str, token_path: str) -> dict[str, Any]:
        """The changes to Gardener's config for one node of the fleet."""
        controllers = yaml.safe_load(self.gen.config)["controllers"]
        controllers["operatingSystemConfig"]["secretName"] = fleet.secret
        controllers["token"]["syncConfigs"] = [{"secretName": token_secret, "path": token_path}]
        return {
            "logLevel": "info",
            "controllers": controllers,
            "server": {
                "healthProbes": {"bindAddress": "127.0.0.1", "port": free_port()},
                "metrics": {"bindAddress": "127.0.0.1", "port": free_port()},
            },
        }

    # -- watching the agents ---------------------------------------------------------------
    def unit_state(self, member: Member) -> UnitState:
        out = member.node.run(
            ["systemctl", "show", "-p", "ActiveState,NRestarts,InvocationID", UPSTREAM_UNIT],
            check=False,
        ).stdout
        props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        return UnitState(
            props.get("ActiveState", ""),
            int(props.get("NRestarts") or 0),
            props.get("InvocationID", ""),
        )

    async def poll(self, fleet: Fleet) -> None:
        """Each node's agent unit every ``POLL_SECONDS``: a new invocation (systemd restarted
        the agent after it exited) is counted in ``fleet.restarts`` and printed."""
        while True:
            states = await asyncio.gather(
                *(asyncio.to_thread(self.unit_state, m) for m in fleet.members)
            )
            for member, state in zip(fleet.members, states, strict=True):
                old = self.states.get(member.name)
                self.states[member.name] = state
                if old is None or not old.invocation:
                    continue
                grown = state.restarts - old.restarts
                if state.invocation != old.invocation or grown > 0:
                    fleet.restarts[member.name] = fleet.restarts.get(member.name, 0) + max(grown, 1)
                    print(
                        f"  upstream agent of {member.name} exited; systemd restarted it "
                        f"(NRestarts {state.restarts}, {state.active})",
                        flush=True,
                    )
            await asyncio.sleep(POLL_SECONDS)

    def alive(self, fleet: Fleet) -> int:
        return sum(
            1
            for m in fleet.members
            if (s := self.states.get(m.name)) is not None and s.active == "active"
        )

    def journal(self, member: Member) -> list[tuple[float, dict[str, Any]]]:
        """The agent's log lines from its node's journal: (wall clock, the line's JSON)."""
        out = member.node.run(
            ["journalctl", "--no-pager", "-o", "json", "-u", UPSTREAM_UNIT],
            check=False,
            timeout=120,
        ).stdout
        lines = []
        for raw in out.splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                record = json.loads(raw)
                at = int(record["__REALTIME_TIMESTAMP"]) / 1e6
                message = record.get("MESSAGE")
                if not isinstance(message, str):
                    continue
                try:
                    entry = json.loads(message)
                except ValueError:
                    entry = {"msg": message}
                if isinstance(entry, dict):
                    lines.append((at, entry))
        return lines

    def failed_attempts(self, fleet: Fleet, since: float, until: float) -> Counter[str]:
        """The agents' log lines between two wall-clock times that say a request failed:
        client-go's reflectors (``watch/list``), the lease controller's errors (``lease``),
        other controllers' errors (``other``)."""
        found: Counter[str] = Counter()
        for member in fleet.members:
            for at, entry in self.journal(member):
                kind = attempt_kind(entry) if since <= at < until else ""
                if kind:
                    found[kind] += 1
        return found

    def log_levels(self, fleet: Fleet) -> Counter[str]:
        """The agents' error and warning lines by message and controller (for the table)."""
        found: Counter[str] = Counter()
        for member in fleet.members:
            for _, entry in self.journal(member):
                level = entry.get("level")
                if level in ("error", "warn", "warning"):
                    where = entry.get("controller") or entry.get("logger") or ""
                    found[f"{level}: {entry.get('msg', '')} ({where})"] += 1
        return found


def attempt_kind(entry: dict[str, Any]) -> str:
    """What a line of upstream's log says failed, or ``""``."""
    text = f"{entry.get('msg', '')} {entry.get('error', '')} {entry.get('err', '')}"
    if "Failed to watch" in text or "failed to list" in text or "watch of" in text:
        return "watch/list"
    if entry.get("level") != "error":
        return ""
    return "lease" if entry.get("controller") == "lease" else "other"
