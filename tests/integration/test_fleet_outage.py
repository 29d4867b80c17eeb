"""An API server outage under a small pool: real ``node-agent run`` processes, each on its own
throwaway node with real systemd, share one OSC Secret on a real kube-apiserver; the OSC is
changed and kube-apiserver stopped at once, then started again on the same port, certificates
and etcd. The suite's size of ``bench.fleet --scenarios outage`` (see bench/README.md).

What must hold (issue 37, part 2): no agent exits, no unit restarts, every heartbeat Lease is
renewed within 30 s of the return, and the OSC published just before the outage is applied on
every node. The control plane is the test's own: stopping the session's would cut every other
client of the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from kubernetes_asyncio.client import ApiClient

from tests.conftest import api_client_from
from tests.testbed.agent_harness import (
    OSCAgent,
    counted_service,
    inline_file,
    osc_document,
    prepare_agent,
    publish_osc,
    read_lease,
    spawn_agent,
    starts,
    unique,
    unit_props,
    wait_applied,
)
from tests.testbed.controlplane import ControlPlane, free_port
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

N = 3
OUTAGE_SECONDS = 15.0
#: the acceptance of issue 37: every Lease renewed within this long of the return
LEASE_BOUND = 30.0
UNIT = "outage-probe.service"
NOTE = "/etc/outage/note"


def osc(version: str) -> dict[str, Any]:
    """A counted service (it logs each of its starts) and a file; only the file carries the
    version, so an update restarts nothing."""
    return osc_document(
        [inline_file(NOTE, f"{version}\n")],
        [counted_service(UNIT, "probe", command="start", enable=True)],
    )


@pytest.fixture
def control_plane_of_test(tmp_path: Path) -> Iterator[ControlPlane]:
    with ControlPlane(tmp_path / "cp") as cp:
        yield cp


@pytest.fixture
def nodes(workdir: Path) -> Iterator[list[IsolatedSystemd]]:
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(IsolatedSystemd(workdir / "outage-nodes", overlay=True))
            for _ in range(N)
        ]


class Pool:
    """The agents as processes; their Nodes, credentials and logs."""

    def __init__(self, admin: ApiClient, cp: ControlPlane, secret: str) -> None:
        self.admin, self.cp, self.secret = admin, cp, secret
        self.members: list[tuple[OSCAgent, asyncio.subprocess.Process, Path]] = []

    async def add(self, node: IsolatedSystemd, workdir: Path) -> None:
        """Register the node and spawn its agent (health gate and kubelet checks off: there is
        no kubelet; probe and metrics ports free ones, the nodes share the host's network)."""
        harness = OSCAgent(self.admin, self.cp, node, workdir, secret_name=self.secret)
        await harness.setup()
        assert harness.creds is not None
        setup = prepare_agent(
            node.root,
            self.cp,
            harness.creds,
            osc_secret=self.secret,
            node_agent={"healthGate": {"enabled": False}, "healthCheck": {"enabled": False}},
        )
        doc = yaml.safe_load(setup.config_file.read_text())
        doc["server"] = {
            "healthProbes": {"bindAddress": "127.0.0.1", "port": free_port()},
            "metrics": {"bindAddress": "127.0.0.1", "port": free_port()},
        }
        setup.config_file.write_text(yaml.safe_dump(doc))
        log = workdir / f"{harness.node_name}.log"
        proc = await spawn_agent(setup, node, harness.node_name, log, env=dict(os.environ))
        self.members.append((harness, proc, log))

    def exited(self) -> list[str]:
        return [
            f"{h.node_name} ({p.returncode}):\n{log.read_text(errors='replace')[-3000:]}"
            for h, p, log in self.members
            if p.returncode is not None
        ]

    async def stop(self) -> None:
        for _h, proc, _log in self.members:
            if proc.returncode is None:
                proc.terminate()
        for _h, proc, _log in self.members:
            try:
                async with asyncio.timeout(20):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()


@pytest_asyncio.fixture(loop_scope="session")
async def pool(
    control_plane_of_test: ControlPlane, nodes: list[IsolatedSystemd], tmp_path: Path
) -> AsyncIterator[Pool]:
    """N agents on one OSC Secret; every node has applied v1 and renewed its Lease."""
    async with await api_client_from(control_plane_of_test.admin_kubeconfig) as admin:
        pool = Pool(admin, control_plane_of_test, unique("gardener-node-agent-outage"))
        v1 = await publish_osc(admin, pool.secret, osc("v1"))
        try:
            for node in nodes:
                await pool.add(node, tmp_path)
            await asyncio.gather(
                *(wait_applied(admin, h.node_name, v1, timeout=90) for h, _p, _l in pool.members)
            )
            yield pool
        finally:
            await pool.stop()


async def first_renewals(cp: ControlPlane, names: list[str], after: datetime) -> dict[str, float]:
    """Each node's first Lease renewTime after ``after``, as seconds after it (polled with a
    fresh admin client until all renewed or twice the bound passed)."""
    found: dict[str, float] = {}
    deadline = time.monotonic() + 2 * LEASE_BOUND
    async with await api_client_from(cp.admin_kubeconfig) as admin:
        while len(found) < len(names) and time.monotonic() < deadline:
            for name in names:
                if name in found:
                    continue
                with contextlib.suppress(Exception):  # not serving yet
                    lease = await read_lease(admin, name)
                    renew = lease.spec.renew_time if lease is not None else None
                    if renew is not None and renew > after:
                        found[name] = (renew - after).total_seconds()
            await asyncio.sleep(0.25)
    return found


async def test_outage_return_leases_renewed_osc_applied_nothing_restarted(pool: Pool) -> None:
    names = [h.node_name for h, _p, _l in pool.members]
    nodes = [h.node for h, _p, _l in pool.members]
    before = {n.root: (starts(n, UNIT), unit_props(n, UNIT)["InvocationID"]) for n in nodes}
    assert all(len(s) == 1 for s, _ in before.values()), before

    v2 = await publish_osc(pool.admin, pool.secret, osc("v2"))
    stopped = time.monotonic()
    await asyncio.to_thread(pool.cp.stop_apiserver)
    on_disk = sum(n.path(NOTE).read_text() == "v2\n" for n in nodes)
    await asyncio.sleep(max(0.0, stopped + OUTAGE_SECONDS - time.monotonic()))
    assert not pool.exited(), pool.exited()
    back = datetime.now(UTC)
    back_monotonic = time.monotonic()
    renewals = asyncio.create_task(first_renewals(pool.cp, names, back))
    await asyncio.to_thread(pool.cp.start_apiserver)
    ready = time.monotonic() - back_monotonic
    renewed = await renewals
    print(
        f"outage {OUTAGE_SECONDS:g} s (v2 on disk on {on_disk}/{N} at the stop); ready after "
        f"{ready:.1f} s; Leases renewed after the return: {sorted(renewed.values())}"
    )
    assert sorted(renewed) == sorted(names), renewed
    assert max(renewed.values()) <= LEASE_BOUND, renewed

    async with await api_client_from(pool.cp.admin_kubeconfig) as admin:
        await asyncio.gather(*(wait_applied(admin, name, v2, timeout=90) for name in names))
    applied = time.monotonic() - back_monotonic
    print(f"v2 reported on every Node {applied:.1f} s after the return")
    assert all(n.path(NOTE).read_text() == "v2\n" for n in nodes)
    assert not pool.exited(), pool.exited()
    after = {n.root: (starts(n, UNIT), unit_props(n, UNIT)["InvocationID"]) for n in nodes}
    assert after == before, (before, after)  # not one unit restarted
