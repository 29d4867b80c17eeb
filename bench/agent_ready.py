"""exec → READY of the single-file agent as a systemd service, first start and warm restarts.

Boots the test bed (kube-apiserver + etcd, a throwaway node with its own systemd), installs the
single file of the agent's image as ``/opt/bin/gardener-node-agent`` in the node, with
least-privilege credentials and a small OSC, and runs it as a ``Type=notify`` service. The
figures come from systemd's own timestamps (``ExecMainStartTimestampMonotonic`` →
``ActiveEnterTimestampMonotonic``, i.e. exec → ``READY=1``), so nothing of this script is
counted. The first start unpacks the bundle (``/var/cache/node-agent`` emptied before it); warm
restarts reuse it. Also printed: exec → the first OSC applied (the Node annotation), first start.

    .venv/bin/python -m bench.agent_ready [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from tests.conftest import api_client_from
from tests.testbed.agent_harness import (
    create_node,
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

CACHE = Path(os.environ.get("NODE_AGENT_TEST_CACHE") or Path.home() / ".cache/node-agent-test")
UNIT = "gardener-node-agent.service"
BINARY = "/opt/bin/gardener-node-agent"
CONFIG = "/var/lib/gardener-node-agent/config.yaml"


def timestamps(node: IsolatedSystemd) -> tuple[int, int, str]:
    out = node.run(
        [
            "systemctl",
            "show",
            "-p",
            "ExecMainStartTimestampMonotonic,ActiveEnterTimestampMonotonic,ActiveState",
            UNIT,
        ]
    ).stdout
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return (
        int(props["ExecMainStartTimestampMonotonic"]),
        int(props["ActiveEnterTimestampMonotonic"]),
        props["ActiveState"],
    )


def ready_seconds(node: IsolatedSystemd, action: str) -> float:
    done = node.run(["systemctl", action, UNIT], timeout=120, check=False)
    if done.returncode != 0:
        journal = node.run(["journalctl", "-u", UNIT, "--no-pager", "-n", "30"], check=False)
        raise SystemExit(f"systemctl {action} {UNIT} failed:\n{journal.stdout}")
    started, active, state = timestamps(node)
    if state != "active":
        raise SystemExit(f"{UNIT} is {state} after {action}")
    return (active - started) / 1e6


def summary(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return (
        f"p50 {statistics.median(ordered) * 1000:5.0f} ms  p90 {p90 * 1000:5.0f} ms  "
        f"max {ordered[-1] * 1000:5.0f} ms  (n={len(ordered)})"
    )


async def run(rounds: int) -> None:
    (CACHE / "tmp").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE / "tmp", prefix="bench-ready.") as work:
        tmp = Path(work)
        image = agent_image_layout(tmp / "dist")
        with (
            ControlPlane(tmp / "cp") as control_plane,
            IsolatedSystemd(tmp / "node", overlay=True) as node,
        ):
            admin = await api_client_from(control_plane.admin_kubeconfig)
            async with admin:
                name = unique("ready")
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
                binary = node.path(BINARY)
                binary.parent.mkdir(parents=True, exist_ok=True)
                binary.write_bytes(image.executable.read_bytes())
                binary.chmod(0o755)
                config = {
                    "apiVersion": "nodeagent.config.gardener.cloud/v1alpha1",
                    "kind": "NodeAgentConfiguration",
                    "clientConnection": {"kubeconfig": str(creds.kubeconfig)},
                    "server": {
                        "healthProbes": {"bindAddress": "127.0.0.1", "port": free_port()},
                        "metrics": {"bindAddress": "127.0.0.1", "port": free_port()},
                    },
                    "controllers": {"operatingSystemConfig": {"secretName": secret}},
                }
                node.path(CONFIG).parent.mkdir(parents=True, exist_ok=True)
                node.path(CONFIG).write_text(yaml.safe_dump(config))
                node.path(f"/etc/systemd/system/{UNIT}").write_text(
                    "[Unit]\nStartLimitIntervalSec=0\n[Service]\nType=notify\nNotifyAccess=main\n"
                    f"ExecStart={BINARY} run --config {CONFIG}\n"
                )
                node.run(["systemctl", "daemon-reload"])
                osc = osc_document([], [service("ready-probe.service", command="start")])
                checksum = await publish_osc(admin, secret, yaml.safe_dump(osc).encode())

                node.run(["rm", "-rf", "/var/cache/node-agent"])
                clock = time.monotonic()
                first = ready_seconds(node, "start")

                async def applied_on_node() -> bool:
                    annotations = await node_annotations(admin, name)
                    return annotations.get("checksum/cloud-config-data") == checksum

                await wait_for(applied_on_node, 60, "the first apply", poll=0.02)
                applied = time.monotonic() - clock
                warm = [ready_seconds(node, "restart") for _ in range(rounds)]
                print(f"single file {image.executable.stat().st_size / 1e6:.1f} MB, "
                      f"version {image.version}")  # fmt: skip
                print(f"first start (unpack):  exec -> READY {first * 1000:.0f} ms; "
                      f"start -> first OSC applied on the Node {applied * 1000:.0f} ms "
                      f"(incl. this script's 20 ms poll)")  # fmt: skip
                print(f"warm restarts:         exec -> READY {summary(warm)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    asyncio.run(run(args.rounds))


if __name__ == "__main__":
    main()
