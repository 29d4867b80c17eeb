"""Rollout coordination of a pool on the real test bed: three agents (their OSC controllers, in
this process), each on a throwaway node with real systemd, share one OSC Secret on the real
kube-apiserver, with the least-privilege RBAC Gardener grants node agents for Leases.

``kubelet.service`` is a stand-in: a oneshot that logs ``start <version> <time>``, sleeps, and
logs ``end <version> <time>``; a change to it is disruptive (a kubelet restart). The restart job
ends with the oneshot, so each node's start..end interval is the window in which it applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Self

import pytest
import pytest_asyncio
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from node_agent.controllers.osc import pacing, rollout
from node_agent.kube import report
from node_agent.kube.client import KubeClient
from node_agent.kube.watch import ListWatch, list_watch
from tests.testbed.agent_harness import (
    NS,
    OSCAgent,
    inline_file,
    osc_document,
    publish_osc,
    unique,
    wait_for,
)
from tests.testbed.controlplane import ControlPlane
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

N = 3
LOG = "/var/lib/fleet/kubelet.log"
SERIAL_SECONDS = 6  # the serial Lease's duration here (Gardener: 600 s)
SERIAL = {"reconciliation.osc.node-agent.gardener.cloud/serial": "true"}
NODE_AGENT = {
    "healthGate": {"enabled": False},
    "rollout": {
        "serialLeaseDuration": f"{SERIAL_SECONDS}s",
        # only a fallback: a waiting node is woken by the Lease's watch (a release, a freed
        # slot, a result) or by the time a Lease or a soak runs out
        "recheckMin": "30s",
        "recheckMax": "40s",
    },
}


def kubelet(version: str, seconds: float = 1.5, *, fails: bool = False) -> dict[str, Any]:
    stamp = "$$(date +%%s.%%N)"
    body = f'echo "start {version} {stamp}" >> {LOG}; '
    body += "exit 1" if fails else f'sleep {seconds}; echo "end {version} {stamp}" >> {LOG}'
    text = (
        "[Unit]\nDescription=kubelet stand-in\n\n[Service]\nType=oneshot\nRemainAfterExit=yes\n"
        f"ExecStartPre=/bin/mkdir -p /var/lib/fleet\nExecStart=/bin/sh -c '{body}'\n\n"
        "[Install]\nWantedBy=multi-user.target\n"
    )
    return {"name": "kubelet.service", "content": text, "command": "restart", "enable": True}


def osc(version: str, **kw: Any) -> dict[str, Any]:
    return osc_document([inline_file("/etc/fleet/version", version)], [kubelet(version, **kw)])


class Fleet:
    def __init__(self, admin: ApiClient, control_plane: ControlPlane, agents: list[OSCAgent]):
        self.admin, self.control_plane, self.agents = admin, control_plane, agents
        self.secret = agents[0].secret_name

    async def publish(self, doc: dict[str, Any], annotations: dict[str, str]) -> str:
        """The OSC Secret as Gardener writes it, with the rollout annotations."""
        return await publish_osc(self.admin, self.secret, doc, annotations=annotations)

    async def converge(self, checksum: str, timeout: float = 90.0, only: Any = None) -> None:
        await asyncio.gather(*(a.wait_applied(checksum, timeout) for a in (only or self.agents)))

    async def lease(self) -> dict[str, Any]:
        lease = await client.CoordinationV1Api(self.admin).read_namespaced_lease(self.secret, NS)
        return dict(self.admin.sanitize_for_serialization(lease))

    async def ledger(self) -> pacing.Ledger:
        annotations = (await self.lease())["metadata"].get("annotations") or {}
        return pacing.Ledger.load(annotations.get(pacing.ANNOTATION_LEDGER))

    async def released(self, timeout: float = 15.0) -> pacing.Ledger:
        """The ledger once no node holds a slot: a node lets its slot go just after it
        reports the OSC applied on its Node, so right after ``converge`` the last one may
        still hold it."""

        async def no_slots() -> bool:
            return not (await self.ledger()).slots

        await wait_for(no_slots, timeout, "every rollout slot released")
        return await self.ledger()

    async def reported(self, reason: str, timeout: float = 15.0) -> None:
        """Wait until every node's OSCRollout condition carries ``reason``: a node writes the
        condition after it lets its slot go, which is after the checksum annotation that
        ``converge`` waits for."""

        async def all_report() -> bool:
            conditions = [await self.condition(a) for a in self.agents]
            return all(c is not None and c["reason"] == reason for c in conditions)

        await wait_for(all_report, timeout, f"every node's OSCRollout condition {reason}")

    async def condition(self, agent: OSCAgent) -> dict[str, Any] | None:
        node = await client.CoreV1Api(self.admin).read_node(agent.node_name)
        for c in node.status.conditions or []:
            if c.type == "OSCRollout":
                return {"status": c.status, "reason": c.reason, "message": c.message}
        return None


def runs(agent: OSCAgent, version: str) -> list[tuple[float, float]]:
    """The (start, end) times of ``version``'s kubelet runs on the agent's node (end = inf
    while running or when it failed)."""
    path = agent.node.path(LOG)
    lines = path.read_text().splitlines() if path.exists() else []
    out: list[tuple[float, float]] = []
    for line in lines:
        what, ver, at = line.split()
        if ver != version:
            continue
        if what == "start":
            out.append((float(at), float("inf")))
        elif out:
            out[-1] = (out[-1][0], float(at))
    return out


def overlapping(intervals: list[tuple[float, float]]) -> int:
    """The most intervals that overlap at one moment."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    most = level = 0
    for _, step in edges:
        level += step
        most = max(most, level)
    return most


class Recorder:
    """Objects of one kind as their watch delivers them, in order, from ``async with`` on
    (``record`` keeps what a test needs of each)."""

    def __init__(self, control_plane: ControlPlane) -> None:
        self.kube = KubeClient.from_kubeconfig(control_plane.admin_kubeconfig)
        self._task: asyncio.Task[None] | None = None

    def events(self) -> ListWatch:
        raise NotImplementedError

    def record(self, obj: dict[str, Any]) -> None:
        raise NotImplementedError

    async def _run(self) -> None:
        events = self.events()
        async with events:
            async for event in events:
                if event.type in ("SYNC", "ADDED", "MODIFIED"):
                    for obj in event.objects:
                        self.record(obj)

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.kube.close()


class LeaseRecorder(Recorder):
    """Every write of the Lease's ``spec``, and every ledger it carried."""

    def __init__(self, control_plane: ControlPlane, name: str) -> None:
        super().__init__(control_plane)
        self.name = name
        self.specs: list[dict[str, Any]] = []
        self.ledgers: list[pacing.Ledger] = []

    def events(self) -> ListWatch:
        return list_watch(self.kube.leases(NS), field_selector=f"metadata.name={self.name}")

    def record(self, obj: dict[str, Any]) -> None:
        spec = dict(obj.get("spec") or {})
        if not self.specs or self.specs[-1] != spec:
            self.specs.append(spec)
        annotations = (obj.get("metadata") or {}).get("annotations") or {}
        self.ledgers.append(pacing.Ledger.load(annotations.get(pacing.ANNOTATION_LEDGER)))

    def holders(self) -> list[str | None]:
        out: list[str | None] = []
        for spec in self.specs:
            holder = spec.get("holderIdentity")
            if not out or out[-1] != holder:
                out.append(holder)
        return out


class RolloutReasons(Recorder):
    """Every reason each Node's ``OSCRollout`` condition carried: a waiting node says so in
    the condition (no Event), and the condition moves on once it applied."""

    def __init__(self, control_plane: ControlPlane) -> None:
        super().__init__(control_plane)
        self.seen: dict[str, set[str]] = {}

    def events(self) -> ListWatch:
        return list_watch(self.kube.nodes())

    def record(self, obj: dict[str, Any]) -> None:
        name = str(obj["metadata"]["name"])
        for c in (obj.get("status") or {}).get("conditions") or []:
            if c.get("type") == "OSCRollout":
                self.seen.setdefault(name, set()).add(str(c.get("reason")))

    def of(self, agents: list[OSCAgent]) -> set[str]:
        return set().union(*(self.seen.get(a.node_name, set()) for a in agents))


@pytest.fixture
def nodes(workdir: Path) -> Iterator[list[IsolatedSystemd]]:
    """N throwaway nodes (real systemd on an overlay of the host's root each)."""
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(IsolatedSystemd(workdir / "fleet-nodes", overlay=True))
            for _ in range(N)
        ]


@pytest_asyncio.fixture(loop_scope="session")
async def fleet(
    admin_api: ApiClient, control_plane: ControlPlane, nodes: list[IsolatedSystemd], tmp_path: Path
) -> AsyncIterator[Fleet]:
    """N agents sharing one OSC Secret; all have applied version v1 (a first apply: never
    paced) before the test starts. Their Nodes carry the pool's Secret name as Gardener labels
    a worker pool's Nodes (a pool's first paced rollout counts its Nodes by it)."""
    secret = unique("osc-pool")
    agents = [
        OSCAgent(admin_api, control_plane, n, tmp_path, secret_name=secret, node_agent=NODE_AGENT)
        for n in nodes
    ]
    async with contextlib.AsyncExitStack() as stack:
        for agent in agents:
            await agent.setup()
            assert agent.creds is not None
            await client.CoreV1Api(admin_api).patch_node(
                agent.node_name, {"metadata": {"labels": {report.LABEL_SECRET_NAME: secret}}}
            )
            await agent.start()
            stack.push_async_callback(agent.stop)
        pool = Fleet(admin_api, control_plane, agents)
        v1 = await pool.publish(osc("v1", seconds=0), {})
        await pool.converge(v1)
        yield pool


async def test_serial_one_holder_at_a_time_released_after_each_apply(fleet: Fleet) -> None:
    async with LeaseRecorder(fleet.control_plane, fleet.secret) as lease:
        started = time.monotonic()
        v2 = await fleet.publish(osc("v2"), SERIAL)
        await fleet.converge(v2)
        took = time.monotonic() - started
        await wait_for(lambda: lease.holders()[-1:] == [None], 15, "the last holder released")
    holders = lease.holders()
    print(f"serial rollout of {N} nodes took {took:.1f} s")
    # each handover is woken by the Lease's watch, not the 30-40 s re-check
    assert took < 30, took
    print("serial Lease holders:", holders)
    names = {a.node_name for a in fleet.agents}
    assert {h for h in holders if h} == names
    # between two holders the Lease was always released: never handed over while held
    for before, after in itertools.pairwise(holders):
        assert before is None or after is None, holders
    taken = [s for s in lease.specs if s.get("holderIdentity")]
    assert all(s["leaseDurationSeconds"] == SERIAL_SECONDS for s in taken)
    assert all(s["holderIdentity"] in names for s in taken)
    intervals = [r for a in fleet.agents for r in runs(a, "v2")]
    assert len(intervals) == N
    assert overlapping(intervals) == 1, intervals
    lease_obj = await fleet.lease()
    owner = lease_obj["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("Secret", fleet.secret, True)
    await fleet.reported("RolloutApplied")


async def test_serial_crashed_holder_lease_expires_and_the_next_proceeds(fleet: Fleet) -> None:
    async with LeaseRecorder(fleet.control_plane, fleet.secret) as lease:
        v2 = await fleet.publish(osc("v2", seconds=4), SERIAL)
        await wait_for(lambda: any(s.get("holderIdentity") for s in lease.specs), 60, "a holder")
        first = next(s for s in lease.specs if s.get("holderIdentity"))
        crashed = next(a for a in fleet.agents if a.node_name == first["holderIdentity"])
        await crashed.stop()  # killed mid-apply: no release
        others = [a for a in fleet.agents if a is not crashed]
        await fleet.converge(v2, timeout=120, only=others)
    holders = lease.holders()
    print("serial Lease holders:", holders)
    assert holders[0] in (None, crashed.node_name)
    after = holders[holders.index(crashed.node_name) + 1]
    assert after is not None, holders  # taken over, never released by the crashed holder
    assert after != crashed.node_name, holders
    taken = next(s for s in lease.specs if s.get("holderIdentity") == after)
    expired_at = pacing.parse_micro_time(first["renewTime"])
    acquired_at = pacing.parse_micro_time(taken["acquireTime"])
    assert expired_at is not None
    assert acquired_at is not None
    assert acquired_at >= expired_at + SERIAL_SECONDS - 0.5, (first, taken)
    assert v2 != (await crashed.node_annotations()).get("checksum/cloud-config-data")


async def test_paced_never_more_than_k(fleet: Fleet) -> None:
    policy = {
        pacing.ANNOTATION_MAX_PARALLEL: "1",
        pacing.ANNOTATION_SLOT_TTL: "30s",
    }
    outlasting = rollout.JOIN_WINDOW + 2
    async with (
        RolloutReasons(fleet.control_plane) as reasons,
        LeaseRecorder(fleet.control_plane, fleet.secret) as lease,
    ):
        # each apply outlasts the join window (JOIN_WINDOW), so the waiters hold tickets by the
        # time a holder leaves: the handoff below is certain, not a matter of timing
        v2 = await fleet.publish(osc("v2", seconds=outlasting), policy)
        await fleet.converge(v2, timeout=120)
    intervals = [r for a in fleet.agents for r in runs(a, "v2")]
    print("v2 applied in", sorted(intervals))
    assert len(intervals) == N
    assert overlapping(intervals) == 1, intervals
    # a node that left its slot handed it to the first ticket in the same write, and that node
    # applied on it (it claims it, or its result frees it)
    assert all(len(ledger.slots) <= 1 for ledger in lease.ledgers)
    handed = {s.host for ledger in lease.ledgers for s in ledger.slots if s.handed}
    assert handed, [ledger.dump() for ledger in lease.ledgers]
    assert handed <= {a.node_name for a in fleet.agents}
    ledger = await fleet.released()
    assert ledger.checksum == v2
    assert ledger.slots == ()
    # the pool's first paced rollout: its first join counted the pool's Nodes (the agent's own
    # identity may list them, as Gardener's authorizer allows) and every node's join was counted
    assert ledger.pool == N, ledger.dump()
    assert ledger.joined >= N, ledger.dump()
    # every node applied (converged above) and none failed; no canaries, so no success is kept
    assert ledger.failed == {}
    assert ledger.healthy == {}
    assert pacing.REASON_SLOT in reasons.of(fleet.agents), "no node ever waited for a slot"
    # waiting in line is the condition's: no Event per node and state
    assert not [e for a in fleet.agents for e in await a.events() if e.reason.startswith("Wait")]

    # a change that restarts no kubelet/containerd is not paced: no slot taken
    v3 = await fleet.publish(
        osc_document([inline_file("/etc/fleet/version", "v3")], [kubelet("v2", outlasting)]),
        policy,
    )
    await fleet.converge(v3)
    ledger = await fleet.ledger()
    assert ledger.checksum == v2  # nobody asked for a slot for v3


async def test_canary_applies_first_and_the_rest_waits_for_the_soak(fleet: Fleet) -> None:
    soak = 5.0
    policy = {
        pacing.ANNOTATION_MAX_PARALLEL: "2",
        pacing.ANNOTATION_CANARIES: "1",
        pacing.ANNOTATION_SOAK: f"{soak:g}s",
        pacing.ANNOTATION_SLOT_TTL: "30s",
    }
    async with RolloutReasons(fleet.control_plane) as reasons:
        v2 = await fleet.publish(osc("v2"), policy)
        await fleet.converge(v2)
    ledger = await fleet.ledger()
    assert len(ledger.canaries) == 1
    assert set(ledger.healthy) == set(ledger.canaries)  # only the canary's success is kept
    canary = next(a for a in fleet.agents if a.node_name == ledger.canaries[0])
    (c_start, c_end) = runs(canary, "v2")[0]
    rest = [r for a in fleet.agents if a is not canary for r in runs(a, "v2")]
    print(f"canary {c_start:.2f}..{c_end:.2f}; the rest: {sorted(rest)}")
    assert len(rest) == N - 1
    assert all(start >= c_end + soak - 0.5 for start, _ in rest), (c_end, rest)
    assert overlapping([*rest, (c_start, c_end)]) <= 2
    # Each of the rest said on its Node that it waited. Which reason depends on the race for
    # the Lease: a node that lost the first write waits in line (WaitingForSlot) until its join
    # delay, which can outlast the canary's soak (the condition's WaitingForCanaries itself is
    # checked in tests/unit/test_rollout.py); the order is asserted by the runs' times above.
    for agent in fleet.agents:
        if agent is not canary:
            waited = reasons.of([agent])
            assert waited & {pacing.REASON_CANARIES, pacing.REASON_SLOT}, (agent.node_name, waited)


async def test_breaker_holds_the_pool_until_the_secret_changes(fleet: Fleet) -> None:
    policy = {
        pacing.ANNOTATION_MAX_PARALLEL: "1",
        pacing.ANNOTATION_MAX_FAILURES: "1",
        pacing.ANNOTATION_SLOT_TTL: "30s",
    }
    bad = await fleet.publish(osc("bad", fails=True), policy)

    async def held() -> bool:
        reasons = [(await fleet.condition(a) or {}).get("reason") for a in fleet.agents]
        return reasons.count(pacing.REASON_BREAKER) == N - 1

    await wait_for(held, 90, "the rest of the pool held by the breaker")
    tried = [a for a in fleet.agents if runs(a, "bad")]
    assert len(tried) == 1, [a.node_name for a in tried]  # F + K - 1 = 1
    failed = tried[0]
    ledger = await fleet.ledger()
    assert list(ledger.failed) == [failed.node_name]
    for agent in fleet.agents:
        if agent is failed:
            continue
        condition = await fleet.condition(agent)
        assert condition is not None
        assert condition["status"] == "False"
        assert "circuit breaker open" in condition["message"]
        assert failed.node_name in condition["message"]
        events = [e for e in await agent.events() if e.reason == pacing.REASON_BREAKER]
        assert len(events) == 1
        assert events[0].type == "Warning"
        assert (await agent.node_annotations()).get("checksum/cloud-config-data") != bad
    # held, not just slow: a few more rechecks later still nobody else tried
    await asyncio.sleep(3)
    assert [a for a in fleet.agents if runs(a, "bad")] == [failed]

    good = await fleet.publish(osc("v3"), policy)
    await fleet.converge(good, timeout=120)
    ledger = await fleet.ledger()
    assert ledger.checksum == good
    assert ledger.failed == {}
    intervals = [r for a in fleet.agents for r in runs(a, "v3")]
    assert overlapping(intervals) == 1, intervals
    await fleet.reported("RolloutApplied")
