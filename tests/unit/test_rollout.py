"""The rollout coordinator's Lease I/O and reporting, against the in-memory API server: several
coordinators (nodes) share one ``FakeKube``."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from node_agent.base import retry
from node_agent.base.errors import KubeConflict, KubeForbidden
from node_agent.base.retry import Backoff
from node_agent.context import AgentContext
from node_agent.controllers.osc import pacing
from node_agent.controllers.osc import rollout as rollout_module
from node_agent.controllers.osc.pacing import Ledger
from node_agent.controllers.osc.rollout import Permit, Rollout
from node_agent.kube import report
from node_agent.osc.plan import ChangeSet, UnitCommand
from tests.unit.fakes import FakeKube, make_ctx, until

pytestmark = pytest.mark.usefixtures("virtual_clock")

SECRET = "gardener-node-agent-pool-a"
NS = "kube-system"
CS = "a" * 64
CS2 = "b" * 64
SERIAL = {"reconciliation.osc.node-agent.gardener.cloud/serial": "true"}
#: one canary: its success is what the ledger keeps (the others' are not recorded)
CANARY = {"node-agent.gardener.cloud/rollout-canaries": "1"}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def secret(annotations: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"name": SECRET, "namespace": NS, "uid": "s-uid", "annotations": annotations}
    }


def paced(k: int = 1, **more: str) -> dict[str, str]:
    return {"node-agent.gardener.cloud/rollout-max-parallel": str(k), **more}


def paced_with(k: int, more: dict[str, str]) -> dict[str, str]:
    return {**paced(k), **more}


def plan_of(*units: str) -> Any:
    change_set = ChangeSet(
        unit_commands=tuple(
            UnitCommand(unit=u, action="restart", reasons=("changed",)) for u in units
        )
    )

    async def plan() -> ChangeSet:
        return change_set

    return plan


KUBELET = plan_of("kubelet.service")


class Pool:
    def __init__(self, tmp_path: Path) -> None:
        self.kube = FakeKube()
        self.clock = Clock()
        self.woken: list[str] = []
        self.woke = asyncio.Event()
        self.nodes: list[Rollout] = []
        self.tmp = tmp_path

    def node(
        self,
        name: str,
        recheck: tuple[str, str] = ("50ms", "100ms"),
        rng: random.Random | None = None,
    ) -> Rollout:
        self.kube.nodes().put(
            {"metadata": {"name": name, "uid": f"{name}-uid", "resourceVersion": "1"}}
        )
        ctx: AgentContext = make_ctx(
            self.tmp,
            config={
                "controllers": {"operatingSystemConfig": {"secretName": SECRET}},
                "nodeAgent": {"rollout": {"recheckMin": recheck[0], "recheckMax": recheck[1]}},
            },
            kube=self.kube,
            state=None,
            host_name=name,
            node_name=name,
            node_uid=f"{name}-uid",
        )

        def wake() -> None:
            self.woken.append(name)
            self.woke.set()

        rollout = Rollout(ctx, wake, clock=self.clock, rng=rng)
        self.nodes.append(rollout)
        return rollout

    def lease(self) -> dict[str, Any]:
        return self.kube.leases(NS).items[SECRET]

    def ledger(self) -> pacing.Ledger:
        return pacing.Ledger.load(
            self.lease()["metadata"]["annotations"].get(pacing.ANNOTATION_LEDGER)
        )

    async def caught_up(self) -> None:
        """Every waiting node's watch has shown the Lease as it is now (a waiting node decides
        from what its watch showed)."""
        rv = self.lease()["metadata"].get("resourceVersion")

        def shown() -> bool:
            return all(n._live_shown() is None or n._watched == rv for n in self.nodes)

        await until(shown)

    def condition(self, node: str) -> dict[str, Any] | None:
        obj = self.kube.nodes().items[node]
        for c in (obj.get("status") or {}).get("conditions") or []:
            if c["type"] == report.CONDITION_ROLLOUT:
                return dict(c)
        return None

    def events(self, node: str, reason: str) -> list[str]:
        return [
            c[1]["message"]
            for c in self.kube.writes("create_event")
            if c[1]["involvedObject"]["name"] == node and c[1]["reason"] == reason
        ]


@pytest_asyncio.fixture
async def pool(tmp_path: Path) -> AsyncIterator[Pool]:
    pool = Pool(tmp_path)
    yield pool
    for node in pool.nodes:
        await node.close()


async def test_no_policy_no_lease(pool: Pool) -> None:
    a = pool.node("a")
    permit = await a.admit(secret({}), CS, retrying=False, plan=KUBELET)
    assert permit == Permit(CS)
    await a.succeeded(permit)
    assert SECRET not in pool.kube.leases(NS).items
    assert pool.condition("a") is None
    assert not a.skips_delay(secret({}))
    assert a.skips_delay(secret(SERIAL))


async def test_serial_lease_as_gardener_writes_it(pool: Pool) -> None:
    a, b = pool.node("a"), pool.node("b")
    permit = await a.admit(secret(SERIAL), CS, retrying=False, plan=KUBELET)
    assert permit is not None
    assert permit.serial
    lease = pool.lease()
    assert lease["spec"]["holderIdentity"] == "a"
    assert lease["spec"]["leaseDurationSeconds"] == 600
    owner = lease["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "Secret",
        SECRET,
        "s-uid",
        True,
    )

    assert await b.admit(secret(SERIAL), CS, retrying=False, plan=KUBELET) is None
    condition = pool.condition("b")
    assert condition is not None
    assert (condition["status"], condition["reason"]) == ("False", pacing.REASON_SERIAL)
    # the holder is in the view; the words stay the same whoever holds it (no rewrite per holder)
    assert "another node holds Lease kube-system/" + SECRET in condition["message"]
    assert b.view().state == "waiting"
    assert b.view().holders == ("a",)
    # the wait wakes the loop again after the (test) recheck time
    await asyncio.sleep(0.2)
    assert "b" in pool.woken
    assert await b.admit(secret(SERIAL), CS, retrying=False, plan=KUBELET) is None
    # waiting in line is the condition's, not an Event per node and state (a write each)
    assert pool.events("b", pacing.REASON_SERIAL) == []

    await a.succeeded(permit)
    spec = pool.lease()["spec"]
    assert "holderIdentity" not in spec
    assert "renewTime" not in spec
    assert "acquireTime" not in spec
    assert pool.condition("a")["reason"] == report.REASON_ROLLOUT_APPLIED  # type: ignore[index]
    await pool.caught_up()
    permit_b = await b.admit(secret(SERIAL), CS, retrying=False, plan=KUBELET)
    assert permit_b is not None
    assert pool.lease()["spec"]["holderIdentity"] == "b"
    assert pool.condition("b")["reason"] == report.REASON_ROLLOUT_APPLYING  # type: ignore[index]
    assert pool.events("b", report.REASON_ROLLOUT_APPLYING) == []


async def test_serial_failure_keeps_the_lease_until_it_expires(pool: Pool) -> None:
    a, b = pool.node("a"), pool.node("b")
    permit = await a.admit(secret(SERIAL), CS, retrying=False, plan=KUBELET)
    await a.failed(permit, "ApplyError: kubelet.service failed")
    assert pool.lease()["spec"]["holderIdentity"] == "a"
    assert await b.admit(secret(SERIAL), CS, retrying=False, plan=KUBELET) is None
    # a's retry renews it
    assert await a.admit(secret(SERIAL), CS, retrying=True, plan=KUBELET) is not None
    await pool.caught_up()  # b decides from what its watch shows
    pool.clock.now += 601
    assert await b.admit(secret(SERIAL), CS, retrying=False, plan=KUBELET) is not None


async def test_non_disruptive_change_is_not_paced(pool: Pool) -> None:
    a, b = pool.node("a"), pool.node("b")
    assert await a.admit(secret(paced()), CS, retrying=False, plan=KUBELET) is not None
    other = plan_of("foo.service")
    permit = await b.admit(secret(paced()), CS, retrying=False, plan=other)
    assert permit is not None
    assert not permit.slot
    assert await pool.node("c").admit(secret(paced()), CS, retrying=False, plan=KUBELET) is None


async def test_slots_canary_breaker_and_reset(pool: Pool) -> None:
    annotations = paced(2, **{"node-agent.gardener.cloud/rollout-canaries": "1"})
    a, b, c = pool.node("a"), pool.node("b"), pool.node("c")
    pa = await a.admit(secret(annotations), CS, retrying=False, plan=KUBELET)
    assert pa is not None
    assert pa.canary
    assert pa.slot
    assert pool.ledger().holders() == ("a",)
    assert await b.admit(secret(annotations), CS, retrying=False, plan=KUBELET) is None
    assert pool.condition("b")["reason"] == pacing.REASON_CANARIES  # type: ignore[index]
    await a.failed(pa, "rolled back: kubelet.service failed")
    assert pool.ledger().failed == {"a": "rolled back: kubelet.service failed"}
    await pool.caught_up()
    for node, name in ((b, "b"), (c, "c")):
        assert await node.admit(secret(annotations), CS, retrying=False, plan=KUBELET) is None
        condition = pool.condition(name)
        assert condition is not None
        assert (condition["status"], condition["reason"]) == ("False", pacing.REASON_BREAKER)
        assert "circuit breaker open" in condition["message"]
        assert node.view().breaker_open
        assert node.view().failures == 1
        warnings = [
            e for e in pool.kube.writes("create_event") if e[1]["reason"] == pacing.REASON_BREAKER
        ]
        assert warnings
        assert all(w[1]["type"] == "Warning" for w in warnings)
    assert pool.condition("a")["reason"] == report.REASON_ROLLOUT_FAILED  # type: ignore[index]
    # a new Secret resets the breaker
    pb = await b.admit(secret(annotations), CS2, retrying=False, plan=KUBELET)
    assert pb is not None
    assert pb.canary
    assert pool.ledger().checksum == CS2
    assert pool.ledger().failed == {}
    await b.succeeded(pb)
    assert pool.ledger().healthy == {"b": pool.clock.now}


async def test_soak_then_the_rest(pool: Pool) -> None:
    annotations = paced(
        2,
        **{
            "node-agent.gardener.cloud/rollout-canaries": "1",
            "node-agent.gardener.cloud/rollout-canary-soak": "30s",
        },
    )
    a, b = pool.node("a"), pool.node("b")
    pa = await a.admit(secret(annotations), CS, retrying=False, plan=KUBELET)
    await a.succeeded(pa)
    assert await b.admit(secret(annotations), CS, retrying=False, plan=KUBELET) is None
    assert "soaking" in pool.condition("b")["message"]  # type: ignore[index]
    pool.clock.now += 31
    assert await b.admit(secret(annotations), CS, retrying=False, plan=KUBELET) is not None


async def test_retry_of_a_failed_update_is_not_paced_again(pool: Pool) -> None:
    a, b = pool.node("a"), pool.node("b")
    pa = await a.admit(secret(paced()), CS, retrying=False, plan=KUBELET)
    await a.failed(pa, "ApplyError")
    writes = len(pool.kube.writes("Lease.replace"))
    again = await a.admit(secret(paced()), CS, retrying=True, plan=KUBELET)
    assert again is not None
    assert not again.slot
    assert len(pool.kube.writes("Lease.replace")) == writes
    assert await b.admit(secret(paced()), CS, retrying=False, plan=KUBELET) is None


async def test_a_release_that_conflicts_is_retried_with_a_fresh_read(pool: Pool) -> None:
    a, b = pool.node("a"), pool.node("b")
    permit = await a.admit(secret(paced(2)), CS, retrying=False, plan=KUBELET)
    assert await b.admit(secret(paced(2)), CS, retrying=False, plan=KUBELET) is not None
    pool.kube.fail("Lease.replace", KubeConflict("conflict", status=409), times=2)
    await a.succeeded(permit)
    assert pool.ledger().holders() == ("b",)
    # each lost race is counted by what the write was for (the metric's ``write`` label)
    assert a.view().conflicts == (("result", 2),)
    assert b.view().conflicts == ()


async def test_conflicts_back_off_on_the_agents_one_backoff(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that must land (a slot's release, its renewal) retries a compare-and-swap
    conflict as ``retry.CONFLICT`` says (growing, jittered), one fresh backoff per write."""
    delays: list[float] = []

    class Recorded(Backoff):
        def next(self) -> float:
            delays.append(super().next())
            return 0.0  # no real waiting in a unit test

    monkeypatch.setattr(rollout_module, "Backoff", Recorded, raising=False)
    a = pool.node("a")
    permit = await a.admit(secret(paced(2)), CS, retrying=False, plan=KUBELET)
    # the first conflict is on the Lease a's watch showed: answered by a read at once, with no
    # wait; the three after it back off
    pool.kube.fail("Lease.replace", KubeConflict("conflict", status=409), times=4)
    await a.succeeded(permit)
    assert pool.ledger().holders() == ()
    base, cap = retry.CONFLICT
    assert len(delays) == 3
    assert base / 2 <= delays[0] <= base
    assert base <= delays[1] <= 2 * base
    assert 2 * base <= delays[2] <= min(cap, 4 * base)


def lease_requests(pool: Pool) -> int:
    return sum(1 for c in pool.kube.reads if c[0] == "get_lease") + len(
        pool.kube.writes("Lease.replace")
    )


async def test_a_lost_race_to_join_waits_for_the_watch_and_widens_the_window(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 409 on taking a place is not answered by a fresh read and another write: the node
    waits (its join window doubled, a random part of it), then decides from the Lease its watch
    showed, and writes on that resourceVersion. Before, every conflict cost a read and a write
    at once, and the pool's join burst raced on the one Lease."""
    monkeypatch.setattr(rollout_module, "JOIN_WINDOW", 0.1)  # a unit test does not wait seconds
    b = pool.node("b", recheck=("60s", "60s"))
    # c's recheck is wider than the join window a's join may teach the pool (up to 4 x 0.1 s):
    # a first look never holds the loop longer than its recheck, and defers a join due later
    a, c = pool.node("a"), pool.node("c", recheck=("60s", "60s"))
    await a.admit(secret(paced(3)), CS, retrying=False, plan=KUBELET)  # creates the Lease
    before = lease_requests(pool)
    pool.kube.fail("Lease.replace", KubeConflict("conflict", status=409), times=1)
    assert await b.admit(secret(paced(3)), CS, retrying=False, plan=KUBELET) is None
    # one read and the lost write (the fake records only writes that land): no retry
    assert lease_requests(pool) == before + 1
    # the window it drew its delay from (the pool's, as a's join taught it), doubled
    assert b._window == 2 * max(rollout_module.JOIN_WINDOW, pool.ledger().window)
    assert b.view().state == "waiting"
    assert b.view().conflicts == (("take", 1),)
    assert await c.admit(secret(paced(3)), CS, retrying=False, plan=KUBELET) is not None
    await until(lambda: "b" in pool.woken)  # within its window, not after the 60 s re-check
    await pool.caught_up()
    before = lease_requests(pool)
    assert await b.admit(secret(paced(3)), CS, retrying=False, plan=KUBELET) is not None
    assert lease_requests(pool) == before + 1  # on the watched Lease: no read
    assert b._window == rollout_module.JOIN_WINDOW  # a write that landed resets it
    assert set(pool.ledger().holders()) == {"a", "b", "c"}


def lease_calls_on_the_wire(pool: Pool) -> list[str]:
    """The Lease's reads and writes take a round trip (so the looks of a pool overlap, as on a
    server); returns the list of write attempts made from now on, landed or not."""
    attempts: list[str] = []
    for call in ("get_lease", "create_lease", "update_lease"):
        real = getattr(pool.kube, call)

        async def on_the_wire(*args: Any, _real: Any = real, _call: str = call) -> Any:
            if _call != "get_lease":
                attempts.append(_call)
            await asyncio.sleep(0.01)
            return await _real(*args)

        setattr(pool.kube, call, on_the_wire)
    return attempts


async def test_a_pools_first_look_writes_once_per_place_not_once_per_node(pool: Pool) -> None:
    """The whole pool looks at the Lease in the same second when the Secret changes (here it
    does not exist yet). A node whose decision would be a join writes only after a random delay
    in its window (at most its recheck), deciding on what its watch shows by then: the first
    writes create the Lease and fill the places and the line, the rest stand down without
    writing. Before, every node wrote at once and all but one lost (N - 1 conflicts, each
    followed by a read)."""
    # seeded: their delays in the 1 s window lie 87 ms or more apart
    nodes = [pool.node(f"n{i}", ("1s", "1s"), random.Random(3496 + i)) for i in range(8)]
    attempts = lease_calls_on_the_wire(pool)
    results = await asyncio.gather(
        *(n.admit(secret(paced(2)), CS, retrying=False, plan=KUBELET) for n in nodes)
    )
    permits = [p for p in results if p is not None]
    assert len(permits) == 2
    ledger = pool.ledger()
    assert len(ledger.holders()) == 2
    assert ledger.waiting() == pacing.JOIN_DEPTH * 2
    # 2 places + 4 tickets: 6 writes, each landed, the Lease created by one node (a pool
    # that wrote at once made 8, 7 of them lost)
    assert len(attempts) == 2 + pacing.JOIN_DEPTH * 2
    assert attempts.count("create_lease") == 1
    # the nodes left out of the line made no write at all
    outside = [n for n, p in zip(nodes, results, strict=True) if p is None]
    assert sum(1 for n in outside if n._ticket_for(CS) is None) == 2


async def test_a_new_secret_while_the_pool_waits_is_first_looked_at_spread_too(
    pool: Pool,
) -> None:
    """Nodes waiting for one update watch the Lease. When the Secret changes again, each node's
    first look at the new checksum is the Lease its watch shows (no read), and a join it would
    make is spread like any first look: the new line is filled by a few writes, not by one
    write per node at once."""
    nodes = [pool.node(f"n{i}", ("1s", "1s"), random.Random(3496 + i)) for i in range(6)]
    permits = []
    for node in nodes:  # K = 1: n0 takes the place, n1 and n2 draw tickets, the rest stay out
        permits.append(await node.admit(secret(paced(1)), CS, retrying=False, plan=KUBELET))
        await pool.caught_up()
    assert permits[0] is not None
    assert pool.ledger().waiting() == 2
    await nodes[0].succeeded(permits[0])
    await pool.caught_up()
    reads = sum(1 for c in pool.kube.reads if c[0] == "get_lease")
    attempts = lease_calls_on_the_wire(pool)
    results = await asyncio.gather(
        *(n.admit(secret(paced(1)), CS2, retrying=False, plan=KUBELET) for n in nodes)
    )
    assert len([p for p in results if p is not None]) == 1
    assert pool.ledger().checksum == CS2
    assert pool.ledger().waiting() == pacing.JOIN_DEPTH
    # 1 place + 2 tickets land; at most one write lost to a near tie (a pool that wrote at
    # once on its watched Lease made 6)
    assert 3 <= len(attempts) <= 4
    # only n0, which had stopped watching once it was done, read the Lease
    assert sum(1 for c in pool.kube.reads if c[0] == "get_lease") == reads + 1


async def test_windows_double_per_lost_race_up_to_their_cap(pool: Pool) -> None:
    node = pool.node("a")
    delays = []
    for _ in range(12):  # 4 s doubled 10 times passes the cap
        node._join_at = None
        delays.append(node._contended(CS))
    assert node._window == rollout_module.JOIN_WINDOW_MAX
    assert all(0.0 <= d <= rollout_module.JOIN_WINDOW_MAX for d in delays)
    node._keep_ticket(CS, 3)  # a node whose turn it was looks again at once
    assert node._contended(CS) == 0.0


async def test_stale_resource_version_is_a_conflict_not_a_lost_write(pool: Pool) -> None:
    a, b = pool.node("a"), pool.node("b")
    await a.admit(secret(paced(2)), CS, retrying=False, plan=KUBELET)
    original = pool.kube.get_lease

    async def racing_get(namespace: str, name: str) -> dict[str, Any]:
        lease: dict[str, Any] = json.loads(json.dumps(await original(namespace, name)))
        # someone else writes between our read and our write
        other = pool.lease()
        other["metadata"] = {**other["metadata"], "resourceVersion": str(pool.kube.revision + 5)}
        pool.kube.revision += 5
        return lease

    pool.kube.get_lease = racing_get  # type: ignore[method-assign]
    # the race is lost: the node waits (never writes blindly) and decides again later
    assert (
        await b.admit(secret(paced(2)), CS, retrying=False, plan=plan_of("containerd.service"))
        is None
    )
    assert pool.ledger().holders() == ("a",)
    assert b._lost_on is not None


async def test_renewer_keeps_the_slot_and_dies_with_its_task(pool: Pool) -> None:
    annotations = paced(1, **{"node-agent.gardener.cloud/rollout-slot-ttl": "600ms"})
    a = pool.node("a")
    holder: list[Permit | None] = []
    admitted = asyncio.Event()

    async def reconcile_loop() -> None:
        holder.append(await a.admit(secret(annotations), CS, retrying=False, plan=KUBELET))
        admitted.set()
        await asyncio.sleep(3600)

    task = asyncio.create_task(reconcile_loop())
    await asyncio.wait_for(admitted.wait(), 5)
    permit = holder[0]
    assert permit is not None
    assert permit.renewer is not None
    first = pool.ledger().slots[0].renewed
    pool.clock.now += 1.0
    await asyncio.sleep(0.5)
    assert pool.ledger().slots[0].renewed > first
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)
    assert permit.renewer.done()


async def test_up_to_date_releases_a_forgotten_permit(pool: Pool) -> None:
    a = pool.node("a")
    await a.admit(secret(paced_with(1, CANARY)), CS, retrying=False, plan=KUBELET)
    await a.up_to_date(CS)
    assert pool.ledger().holders() == ()
    assert "a" in pool.ledger().healthy
    assert a.view().state == "applied"


async def test_a_waiting_node_is_woken_when_the_lease_changes(pool: Pool) -> None:
    a, b = pool.node("a"), pool.node("b", recheck=("60s", "60s"))
    permit = await a.admit(secret(SERIAL), CS, retrying=False, plan=KUBELET)
    assert await b.admit(secret(SERIAL), CS, retrying=False, plan=KUBELET) is None
    await asyncio.sleep(0.2)
    assert pool.woken == []  # the re-check is a minute away
    await a.succeeded(permit)  # released: b's watch sees it
    await asyncio.wait_for(pool.woke.wait(), 5)
    assert pool.woken == ["b"]
    before = len(pool.kube.reads)
    permit_b = await b.admit(secret(SERIAL), CS, retrying=False, plan=KUBELET)
    assert permit_b is not None
    # it releases the Lease when done: its watch stays open until then, so the release is
    # written on the Lease the watch shows, without a read
    assert b._watcher is not None
    await b.succeeded(permit_b)
    assert b._watcher is None
    assert len(pool.kube.reads) == before
    assert "holderIdentity" not in pool.lease()["spec"]


async def woken_after_waiting(pool: Pool) -> Rollout:
    """Node b waited for node a's slot (K = 1) and is woken by its release, its watch caught
    up with the Lease."""
    a, b = pool.node("a"), pool.node("b", recheck=("60s", "60s"))
    first = await a.admit(secret(paced(1)), CS, retrying=False, plan=KUBELET)
    assert await b.admit(secret(paced(1)), CS, retrying=False, plan=KUBELET) is None
    await a.succeeded(first)
    await until(lambda: "b" in pool.woken)
    await pool.caught_up()
    return b


async def test_a_waiting_node_costs_no_list_and_no_read_to_finish(pool: Pool) -> None:
    """The watch of a waiting node starts from the Lease its decision read or wrote (no list),
    and stays open while it holds the slot it waited for: its result is written on the Lease
    the watch shows. Per waiting node of a pool that is one list and one read fewer."""
    b = await woken_after_waiting(pool)
    reads = len(pool.kube.reads)
    permit = await b.admit(secret(paced(1)), CS, retrying=False, plan=KUBELET)
    assert permit is not None
    assert permit.slot
    await b.failed(permit, "ApplyError: kubelet.service failed")
    assert pool.kube.reads[reads:] == []
    # one list only: a's first look found no Lease, so its watch had no version to start from
    assert len([r for r in pool.kube.reads if r[0] == "Lease.list"]) == 1
    assert pool.ledger().holders() == ()
    assert "b" in pool.ledger().failed
    assert b._watcher is None


@pytest.mark.parametrize("ok", [True, False])
async def test_a_result_is_not_lost_to_a_stale_watch(pool: Pool, ok: bool) -> None:
    """The watch may show a version older than this node's own last write (events still on
    their way): a Lease without our slot is then no proof that there is nothing to record. A
    result is written whenever the shown Lease says so (the compare-and-swap checks it), and
    "nothing to write" is believed only from a fresh read."""
    b = await woken_after_waiting(pool)
    before_b = json.loads(json.dumps(pool.lease()))  # b's slot not in it yet
    permit = await b.admit(secret(paced(1)), CS, retrying=False, plan=KUBELET)
    assert permit is not None
    assert pool.ledger().holders() == ("b",)
    await pool.caught_up()
    assert b._live_shown() is not None
    b._shown = before_b  # the watch delivers an old version late
    if ok:
        await b.succeeded(permit)
    else:
        await b.failed(permit, "RolledBack: kubelet.service unhealthy")
    assert pool.ledger().holders() == ()
    assert ("b" in pool.ledger().failed) is not ok


async def test_a_retry_after_an_unreported_error_keeps_its_slot(pool: Pool) -> None:
    a, b = pool.node("a"), pool.node("b")
    first = await a.admit(secret(paced_with(1, CANARY)), CS, retrying=False, plan=KUBELET)
    assert first is not None
    assert first.renewer is not None
    # the reconcile ended by an error before the apply's verdict; the loop retries
    again = await a.admit(secret(paced_with(1, CANARY)), CS, retrying=True, plan=KUBELET)
    assert again is not None
    assert again.slot
    assert again.renewer is first.renewer
    assert not first.renewer.done()
    assert pool.ledger().holders() == ("a",)
    assert await b.admit(secret(paced_with(1, CANARY)), CS, retrying=False, plan=KUBELET) is None
    await a.succeeded(again)
    assert pool.ledger().healthy == {"a": pool.clock.now}
    assert again.renewer is None


async def test_an_agent_restarted_mid_apply_takes_its_slot_up_again(pool: Pool) -> None:
    a = pool.node("a")
    first = await a.admit(secret(paced_with(1, CANARY)), CS, retrying=False, plan=KUBELET)
    assert first is not None
    await a.close()  # killed: the renewer is gone, the slot is still in the ledger
    restarted = pool.node("a")
    pool.clock.now += 5
    resumed = await restarted.admit(secret(paced_with(1, CANARY)), CS, retrying=True, plan=KUBELET)
    assert resumed is not None
    assert resumed.slot
    assert resumed.renewer is not None
    assert pool.ledger().slots[0].renewed == pool.clock.now
    await restarted.succeeded(resumed)
    assert pool.ledger().failed == {}
    assert set(pool.ledger().healthy) == {"a"}
    # too late: the slot lapsed and another node took the place (b counts as lost); the
    # resume goes on without a slot (it is not paced again)
    b = pool.node("b")
    pb = await b.admit(secret(paced()), CS2, retrying=False, plan=KUBELET)
    assert pb is not None
    await b.close()
    pool.clock.now += 601
    other = pool.node("c")
    pc = await other.admit(
        secret(paced_with(1, {"node-agent.gardener.cloud/rollout-max-failures": "2"})),
        CS2,
        retrying=False,
        plan=KUBELET,
    )
    assert pc is not None
    assert pool.ledger().failed == {"b": pacing.LOST}
    again = await pool.node("b").admit(secret(paced()), CS2, retrying=True, plan=KUBELET)
    assert again is not None
    assert not again.slot
    assert pool.ledger().holders() == ("c",)


async def test_a_release_before_the_watch_started_is_not_missed(pool: Pool) -> None:
    a, b = pool.node("a"), pool.node("b", recheck=("60s", "60s"))
    permit = await a.admit(secret(SERIAL), CS, retrying=False, plan=KUBELET)
    assert await b.admit(secret(SERIAL), CS, retrying=False, plan=KUBELET) is None
    # released before b's watch made its first list (the fake answers without yielding)
    await a.succeeded(permit)
    await asyncio.wait_for(pool.woke.wait(), 5)
    assert pool.woken == ["b"]


async def test_a_waiting_condition_is_rewritten_for_a_new_message_at_most_once_a_minute(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = pool.node("a")
    now = [1000.0]
    monkeypatch.setattr("node_agent.controllers.osc.rollout.time.monotonic", lambda: now[0])
    for holder in ("b", "c", "d"):
        await node._condition("False", "WaitingForSlot", f"slots held by {holder}")
    assert len(pool.kube.writes("patch_node_condition")) == 1
    assert pool.condition("a")["message"] == "slots held by b"  # type: ignore[index]
    await node._condition("False", "CircuitBreakerOpen", "open")  # a new reason: at once
    assert len(pool.kube.writes("patch_node_condition")) == 2
    now[0] += 61
    await node._condition("False", "CircuitBreakerOpen", "open, 2 failed")
    assert len(pool.kube.writes("patch_node_condition")) == 3
    assert pool.condition("a")["message"] == "open, 2 failed"  # type: ignore[index]


async def test_the_condition_is_one_patch_without_a_read_and_keeps_the_others(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The condition is merged by type: no GET of the Node before it, the other conditions
    stay, and ``lastTransitionTime`` moves only with the status (also the one the Node
    carried before this agent started, as the Node's watch showed it)."""
    node = pool.node("a")
    other = {"type": "Ready", "status": "True", "reason": "KubeletReady"}
    pool.kube.nodes().items["a"].setdefault("status", {})["conditions"] = [
        other,
        {"type": report.CONDITION_ROLLOUT, "status": "False", "lastTransitionTime": "then"},
    ]
    node.node_seen(pool.kube.nodes().items["a"])
    reads = len(pool.kube.reads)
    await node._condition("False", pacing.REASON_SLOT, "waiting")
    assert pool.condition("a")["lastTransitionTime"] == "then"  # type: ignore[index]
    await node._condition("True", report.REASON_ROLLOUT_APPLYING, "applying")
    applying = pool.condition("a")
    assert applying is not None
    assert applying["lastTransitionTime"] != "then"
    await node._condition("True", report.REASON_ROLLOUT_APPLIED, "applied")
    applied = pool.condition("a")
    assert applied is not None
    assert applied["reason"] == report.REASON_ROLLOUT_APPLIED
    assert applied["lastTransitionTime"] == applying["lastTransitionTime"]
    assert len(pool.kube.reads) == reads
    assert len(pool.kube.writes("patch_node_condition")) == 3
    assert pool.kube.nodes().items["a"]["status"]["conditions"][0] == other


async def test_a_freed_slot_wakes_only_the_next_in_line(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K = 1, five nodes waiting: only 2K of them draw a ticket, the rest watch without a
    request. When the holder finishes, only the first ticket is woken and acts; the others
    judge the change from their watch and make no request at all. When the line shortens, the
    nodes outside it join after a random delay, each only if the line still needs it."""
    monkeypatch.setattr(rollout_module, "JOIN_WINDOW", 0.5)  # a unit test does not wait seconds
    annotations = paced()
    a = pool.node("a")
    waiters = [pool.node(name, recheck=("60s", "60s")) for name in ("b", "c", "d", "e", "f")]
    permit = await a.admit(secret(annotations), CS, retrying=False, plan=KUBELET)
    assert permit is not None
    for node in waiters:
        assert await node.admit(secret(annotations), CS, retrying=False, plan=KUBELET) is None
        await pool.caught_up()
    # b and c drew tickets in the order they came; d, e and f stay out of the line
    assert pool.ledger().waiting() == pacing.JOIN_DEPTH * 1
    assert [n._ticket_for(CS) for n in waiters] == [0, 1, None, None, None]
    await pool.caught_up()
    pool.woken.clear()

    def lease_reads() -> int:
        return sum(1 for c in pool.kube.reads if c[0] == "get_lease")

    reads = lease_reads()
    writes = len(pool.kube.writes("Lease.replace"))
    await a.succeeded(permit)
    await until(lambda: "b" in pool.woken)
    await pool.caught_up()
    assert pool.woken == ["b"]
    # b decides from the Lease its watch showed, and writes on that resourceVersion
    assert await waiters[0].admit(secret(annotations), CS, retrying=False, plan=KUBELET)
    assert pool.ledger().holders() == ("b",)
    # a took its place after its first look, watching: its release went on the watched Lease
    assert lease_reads() == reads
    # a's release handed b its place in the same write: b applies without a write of its own
    assert len(pool.kube.writes("Lease.replace")) == writes + 1
    handed = pool.ledger().slot_of("b")
    assert handed is not None
    assert handed.handed
    # c, woken by its timer anyway, waits again without a request
    assert await waiters[1].admit(secret(annotations), CS, retrying=False, plan=KUBELET) is None
    assert lease_reads() == reads
    assert len(pool.kube.writes("Lease.replace")) == writes + 1
    # the line shortened: d, e and f are woken within their join window (not the re-check);
    # the first to look draws a ticket, the others then find the line full again
    await until(lambda: {"d", "e", "f"} <= set(pool.woken))
    await pool.caught_up()
    for node in waiters[2:]:
        assert await node.admit(secret(annotations), CS, retrying=False, plan=KUBELET) is None
        await pool.caught_up()
    assert pool.ledger().waiting() == 2
    assert len(pool.kube.writes("Lease.replace")) == writes + 2
    assert lease_reads() == reads


async def test_a_node_whose_timer_fired_is_woken_again_when_its_turn_comes(pool: Pool) -> None:
    """The reconcile loop may take a wake-up without deciding (it was busy, or the wake-up was
    merged with another). The timer that fired must not count as still set: before, a later
    "wake me sooner" compared with its past time, set nothing, and the node whose turn had
    come slept until something else happened to wake it."""
    a = pool.node("a")
    b = pool.node("b", recheck=("60s", "60s"))
    permit = await a.admit(secret(paced()), CS, retrying=False, plan=KUBELET)
    assert await b.admit(secret(paced()), CS, retrying=False, plan=KUBELET) is None
    await pool.caught_up()
    await asyncio.sleep(61.0)  # b's re-check fires; nobody decides on it
    assert "b" in pool.woken
    pool.woken.clear()
    await a.succeeded(permit)
    await until(lambda: "b" in pool.woken)
    assert await b.admit(secret(paced()), CS, retrying=False, plan=KUBELET) is not None


async def test_the_serial_lease_holder_takes_its_slot_without_a_join_delay(pool: Pool) -> None:
    """Serial and paced at once: the holder of the serial Lease is the pool's one writer, so its
    join is not spread. Before, it drew a join delay, let the serial Lease go to wait for it,
    and a pool could go round that way without applying."""
    a = pool.node("a", recheck=("60s", "60s"))
    permit = await a.admit(secret({**SERIAL, **paced()}), CS, retrying=False, plan=KUBELET)
    assert permit is not None
    assert permit.serial
    assert permit.slot


async def test_a_node_whose_join_is_not_due_reports_no_ledger_repair(pool: Pool) -> None:
    """A ledger that cannot be read is repaired, and reported, by the node that writes the
    repair. A node woken before its join is due writes nothing, so it reports nothing either:
    a pool waiting outside the line would otherwise send one Warning per node."""
    a, b = pool.node("a"), pool.node("b", recheck=("60s", "60s"))
    permit = await a.admit(secret(paced()), CS, retrying=False, plan=KUBELET)
    assert permit is not None
    await a.succeeded(permit)
    pool.lease()["metadata"]["annotations"][pacing.ANNOTATION_LEDGER] = "{not json"
    b._looked_for = CS  # its first look is behind it: it was woken before its join is due
    b._join_at = asyncio.get_running_loop().time() + 30.0
    assert await b.admit(secret(paced()), CS, retrying=False, plan=KUBELET) is None
    assert pool.events("b", report.REASON_ROLLOUT_LEDGER_REPAIRED) == []
    await asyncio.sleep(31.0)
    assert await b.admit(secret(paced()), CS, retrying=False, plan=KUBELET) is not None
    assert len(pool.events("b", report.REASON_ROLLOUT_LEDGER_REPAIRED)) == 1


async def test_a_serial_release_wakes_only_the_next_in_line(pool: Pool) -> None:
    a = pool.node("a")
    waiters = [pool.node(name, recheck=("60s", "60s")) for name in ("b", "c", "d")]
    permit = await a.admit(secret(SERIAL), CS, retrying=False, plan=KUBELET)
    for node in waiters:
        assert await node.admit(secret(SERIAL), CS, retrying=False, plan=KUBELET) is None
    await pool.caught_up()
    pool.woken.clear()
    await a.succeeded(permit)
    await until(lambda: pool.woken == ["b"])
    await pool.caught_up()
    assert pool.woken == ["b"]
    assert await waiters[0].admit(secret(SERIAL), CS, retrying=False, plan=KUBELET)
    assert pool.lease()["spec"]["holderIdentity"] == "b"  # Gardener's wire form, unchanged
    assert await waiters[1].admit(secret(SERIAL), CS, retrying=False, plan=KUBELET) is None


async def test_a_dead_waiter_handed_a_place_costs_the_pool_the_handoff_ttl(pool: Pool) -> None:
    """The node that leaves hands its place to the first ticket in the same write; when that
    node died in line, the place comes back after HANDOFF_TTL (it never claimed it), and the
    dead node is not counted by the breaker (it never started)."""
    a, b, c = pool.node("a"), pool.node("b"), pool.node("c")
    permit = await a.admit(secret(paced()), CS, retrying=False, plan=KUBELET)
    assert await b.admit(secret(paced()), CS, retrying=False, plan=KUBELET) is None
    assert await c.admit(secret(paced()), CS, retrying=False, plan=KUBELET) is None
    await b.close()  # killed while waiting: its ticket stays first in line
    await a.succeeded(permit)
    await pool.caught_up()
    handed = pool.ledger().slot_of("b")
    assert handed is not None
    assert handed.handed
    assert handed.ttl == pacing.HANDOFF_TTL
    pool.clock.now += pacing.TICKET_GRACE
    assert await c.admit(secret(paced()), CS, retrying=False, plan=KUBELET) is None
    pool.clock.now += pacing.HANDOFF_TTL - pacing.TICKET_GRACE
    assert await c.admit(secret(paced()), CS, retrying=False, plan=KUBELET) is not None
    assert pool.ledger().holders() == ("c",)
    assert pool.ledger().failed == {}


async def test_the_receiver_of_a_handed_place_claims_it_while_applying(pool: Pool) -> None:
    """The receiver applies without a write; its renewer claims the place CLAIM_AFTER later
    (the pool's ttl, no longer handed), or its result comes first and is the only write."""
    a, b, c = pool.node("a"), pool.node("b"), pool.node("c")
    permit = await a.admit(secret(paced()), CS, retrying=False, plan=KUBELET)
    assert await b.admit(secret(paced()), CS, retrying=False, plan=KUBELET) is None
    assert await c.admit(secret(paced()), CS, retrying=False, plan=KUBELET) is None
    await a.succeeded(permit)
    await pool.caught_up()
    writes = len(pool.kube.writes("Lease.replace"))
    got = await b.admit(secret(paced()), CS, retrying=False, plan=KUBELET)
    assert got is not None
    assert got.slot
    assert len(pool.kube.writes("Lease.replace")) == writes
    await asyncio.sleep(pacing.CLAIM_AFTER + 1.0)
    claimed = pool.ledger().slot_of("b")
    assert claimed is not None
    assert not claimed.handed
    assert claimed.ttl == pacing.DEFAULT_SLOT_TTL
    assert len(pool.kube.writes("Lease.replace")) == writes + 1
    # its result hands the place on to c
    await b.succeeded(got)
    handed = pool.ledger().slot_of("c")
    assert handed is not None
    assert handed.handed


async def test_a_crashed_holder_costs_its_ttl_and_a_dead_waiter_one_grace(pool: Pool) -> None:
    """Nobody hands on the place of a holder that crashed: it comes back when its slot expires
    (the ttl every node trusts), counted as lost; a dead first ticket is then passed over after
    one grace (the breaker at 2: the lost holder is one failure)."""
    policy = paced(1, **{pacing.ANNOTATION_MAX_FAILURES: "2"})
    a, b, c = pool.node("a"), pool.node("b"), pool.node("c")
    assert await a.admit(secret(policy), CS, retrying=False, plan=KUBELET) is not None
    assert await b.admit(secret(policy), CS, retrying=False, plan=KUBELET) is None
    assert await c.admit(secret(policy), CS, retrying=False, plan=KUBELET) is None
    await a.close()  # killed while applying: its slot is no longer renewed
    await b.close()  # killed while waiting
    pool.clock.now += pacing.DEFAULT_SLOT_TTL
    assert await c.admit(secret(policy), CS, retrying=False, plan=KUBELET) is None
    pool.clock.now += pacing.TICKET_GRACE
    assert await c.admit(secret(policy), CS, retrying=False, plan=KUBELET) is not None
    assert pool.ledger().waiting() == 0  # b's ticket passed over: it draws a new one
    assert pool.ledger().failed == {"a": pacing.LOST}


async def test_serial_waiters_beyond_two_stay_out_of_the_line(pool: Pool) -> None:
    """Under the serial Lease only two waiting nodes hold a ticket (one place, twice that); the
    others write nothing until the line shortens."""
    a = pool.node("a")
    waiters = [pool.node(name, recheck=("60s", "60s")) for name in ("b", "c", "d", "e")]
    assert await a.admit(secret(SERIAL), CS, retrying=False, plan=KUBELET) is not None
    writes = len(pool.kube.writes("Lease.replace"))
    for node in waiters:
        assert await node.admit(secret(SERIAL), CS, retrying=False, plan=KUBELET) is None
        await pool.caught_up()
    assert pool.ledger().waiting() == pacing.JOIN_DEPTH
    assert len(pool.kube.writes("Lease.replace")) == writes + pacing.JOIN_DEPTH


def label_pool(pool: Pool, *names: str, secret_name: str = SECRET) -> None:
    """Label Nodes as Gardener labels a worker pool's: with the name of the pool's OSC Secret."""
    for name in names:
        if name not in pool.kube.nodes().items:
            pool.kube.nodes().put({"metadata": {"name": name}})
        labels = {report.LABEL_SECRET_NAME: secret_name}
        pool.kube.nodes().items[name]["metadata"]["labels"] = labels


def node_lists(pool: Pool) -> list[tuple[Any, ...]]:
    return [r for r in pool.kube.reads if r[0] == "Node.list"]


async def test_a_pools_first_join_counts_its_nodes_and_the_rest_draw_in_that_window(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool's first paced rollout: the first join counts the pool's Nodes (metadata, in
    pages, by the label naming the pool's Secret) and writes the count; the next nodes read
    it, make no list, and draw their joins in one JOIN_TARGET per node still outside. Without
    the count a large pool's first rollout began with its nodes racing for the places."""
    monkeypatch.setattr(rollout_module, "POOL_PAGE", 4)
    nodes = [pool.node(f"n{i}", rng=random.Random(i)) for i in range(6)]
    label_pool(pool, *(f"n{i}" for i in range(6)))
    label_pool(pool, "elsewhere", secret_name="gardener-node-agent-pool-b")
    assert await nodes[0].admit(secret(paced(1)), CS, retrying=False, plan=KUBELET) is not None
    assert (pool.ledger().pool, pool.ledger().joined) == (6, 1)
    assert len(node_lists(pool)) == 2  # two pages of four
    assert all(r[2] == f"{report.LABEL_SECRET_NAME}={SECRET}" for r in node_lists(pool))
    for node in nodes[1:3]:
        assert await node.admit(secret(paced(1)), CS, retrying=False, plan=KUBELET) is None
        assert node._pool_sized
        assert node._join_window() == 5 * pacing.JOIN_TARGET  # 6 counted, 1 joined
    assert len(node_lists(pool)) == 2  # counted once, by the first join
    # the next rollout sizes its window by this one's joins: no list
    nxt = pacing.for_checksum(pacing.count_join(pool.ledger()), CS2)
    assert (nxt.pool, pacing.join_window(nxt)) == (2, 2 * pacing.JOIN_TARGET)


async def test_an_agent_that_may_not_list_nodes_learns_its_pools_window(pool: Pool) -> None:
    """A pool whose first joiner may not list Nodes (or whose Nodes lack the label) counts
    nothing: its joins are still counted, its window learned as before, and the list is not
    tried again."""
    a, b = pool.node("a"), pool.node("b")
    label_pool(pool, "a", "b")
    pool.kube.fail("Node.list", KubeForbidden("nodes is forbidden", status=403))
    assert await a.admit(secret(paced(1)), CS, retrying=False, plan=KUBELET) is not None
    assert (pool.ledger().pool, pool.ledger().joined) == (0, 1)
    assert a._counted == 0
    await b.admit(secret(paced(1)), CS, retrying=False, plan=KUBELET)
    assert not b._pool_sized
    assert node_lists(pool) == []  # the refused one is not recorded; nobody asked again


async def test_a_lost_race_in_a_pool_of_known_size_keeps_the_pools_window(pool: Pool) -> None:
    """In a pool of known size a lost join is the share of collisions its window leaves:
    the loser draws again in the pool's window (its own doubles from the floor only); before,
    it doubled the pool's and waited out a rollout's length behind everyone."""
    sized, learned = pool.node("a"), pool.node("b")
    sized._saw_ledger(Ledger(CS, pool=100, joined=10), CS)
    assert 0.0 <= sized._contended(CS) <= 90 * pacing.JOIN_TARGET
    assert sized._window == 2 * rollout_module.JOIN_WINDOW
    assert sized._join_window() == 90 * pacing.JOIN_TARGET
    learned._saw_ledger(Ledger(CS, window=40.0), CS)
    learned._contended(CS)
    assert learned._window == 80.0  # unknown size: binary exponential backoff, as before


async def test_a_delay_drawn_before_the_pool_was_counted_is_drawn_again(pool: Pool) -> None:
    node = pool.node("a", rng=random.Random(7))
    node._saw_ledger(Ledger(CS), CS)
    assert node._join_delay() <= rollout_module.JOIN_WINDOW
    node._saw_ledger(Ledger(CS, pool=100, joined=1), CS)
    assert node._join_at is None  # drawn again, in the window of 99 nodes outside
    assert node._join_window() == 99 * pacing.JOIN_TARGET


async def test_a_pool_size_that_leaves_the_lease_standing_is_believed_for_a_grace(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any node of the pool writes the ledger, so a forged size (5,000 in a pool of a few)
    would space the joins up to an hour apart. A size that leaves a node waiting to join
    while nothing changes on the Lease for a grace is not believed for the rest of the
    checksum: the join is drawn again in the learned window. A Lease that keeps changing
    (joins landing) keeps it believed."""
    monkeypatch.setattr(pacing, "TICKET_GRACE", 0.05)
    forged = Ledger(CS, pool=pacing.MAX_POOL)
    node = pool.node("a", rng=random.Random(1))
    node._saw_ledger(forged, CS)
    assert node._join_delay() > 60.0
    await asyncio.sleep(0.06)
    node._saw_ledger(forged, CS)  # the same ledger: nothing changed
    assert node._join_delay() <= rollout_module.JOIN_WINDOW
    assert not node._pool_sized
    node._saw_ledger(forged, CS)
    assert not node._pool_sized  # not believed again for this checksum
    node._saw_ledger(pacing.for_checksum(forged, CS2), CS2)
    assert node._pool_sized  # a new checksum: believed again until it, too, stands
    honest = pool.node("b", rng=random.Random(1))
    ledger = Ledger(CS, pool=200)
    honest._saw_ledger(ledger, CS)
    due = honest._join_delay()
    for _ in range(3):
        await asyncio.sleep(0.03)
        ledger = pacing.count_join(ledger)
        honest._saw_ledger(ledger, CS)  # a join landed meanwhile
        assert honest._join_delay() == pytest.approx(due, abs=0.2)
        due = honest._join_delay()
    assert honest._pool_sized


async def test_a_slot_whose_update_was_superseded_is_freed_at_once(pool: Pool) -> None:
    """A newer OSC while holders' updates settle: the controller ends the settle window and
    admits the new one. The old slot is freed then, without a result. Before, it stayed until
    the node's own join was written, which in a pool of known size may be a minute away
    (measured: K = 5 after K = 10 at 100 nodes ran on 3 places for 30 s and on 4 for 30 more),
    or until the slot's ttl (600 s) for a node that stayed outside the line."""
    a, b = pool.node("a"), pool.node("b")
    for holder in (a, b):
        assert await holder.admit(secret(paced(2)), CS, retrying=False, plan=KUBELET) is not None
    # a pool of 100 as its last rollout counted: a join for CS2 is due up to 100 s away
    annotations = pool.lease()["metadata"]["annotations"]
    counted = replace(pool.ledger(), joined=100)
    annotations[pacing.ANNOTATION_LEDGER] = counted.dump()
    # the Secret changed before the health gate's verdict for a: its next admit is for CS2
    assert await a.admit(secret(paced(2)), CS2, retrying=False, plan=KUBELET) is None
    assert a._join_window() == 100 * pacing.JOIN_TARGET  # its join is not due yet
    ledger = pool.ledger()
    assert [(s.host, s.checksum) for s in ledger.slots] == [("b", CS)]
    assert ledger.failed == {}  # neither lost nor healthy
    # b, still settling CS, keeps its slot until its verdict
    await b.succeeded(b._permit)
    assert pool.ledger().slots == ()
