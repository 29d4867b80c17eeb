"""Lease body and tick schedule: wire names and a heartbeat that never drifts."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any, ClassVar

import pytest

from node_agent.context import AgentContext
from node_agent.controllers.lease import (
    LEASE_DURATION_SECONDS,
    LeaseController,
    desired_lease,
    lease_name,
    micro_time,
    next_tick,
)
from tests.unit.fakes import make_ctx

pytestmark = pytest.mark.usefixtures("virtual_clock")


def test_micro_time_is_utc_with_microseconds_and_z() -> None:
    moment = datetime(2026, 8, 1, 14, 3, 4, 56, tzinfo=timezone(timedelta(hours=2)))
    assert micro_time(moment) == "2026-08-01T12:03:04.000056Z"


def test_new_lease_has_the_wire_fields() -> None:
    at = datetime(2026, 8, 1, 12, 0, 0, tzinfo=UTC)
    body = desired_lease("n1", "uid-1", at)
    assert body["apiVersion"] == "coordination.k8s.io/v1"
    assert body["kind"] == "Lease"
    assert body["metadata"]["name"] == lease_name("n1") == "gardener-node-agent-n1"
    assert body["metadata"]["namespace"] == "kube-system"
    assert body["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "uid-1"}
    ]
    assert body["spec"] == {
        "holderIdentity": "gardener-node-agent-n1",
        "leaseDurationSeconds": LEASE_DURATION_SECONDS,
        "renewTime": "2026-08-01T12:00:00.000000Z",
    }


def test_update_keeps_resource_version_and_foreign_fields_and_repairs_ours() -> None:
    current: dict[str, Any] = {
        "metadata": {
            "name": "gardener-node-agent-n1",
            "namespace": "kube-system",
            "resourceVersion": "42",
            "labels": {"x": "y"},
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "old"},
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "c", "uid": "c1"},
            ],
        },
        "spec": {"holderIdentity": "someone", "leaseDurationSeconds": 5, "acquireTime": "t"},
    }
    body = desired_lease("n1", "uid-2", datetime(2026, 1, 1, tzinfo=UTC), current)
    assert body["metadata"]["resourceVersion"] == "42"
    assert body["metadata"]["labels"] == {"x": "y"}
    kinds = [(r["kind"], r["uid"]) for r in body["metadata"]["ownerReferences"]]
    assert kinds == [("ConfigMap", "c1"), ("Node", "uid-2")]
    assert body["spec"]["holderIdentity"] == "gardener-node-agent-n1"
    assert body["spec"]["leaseDurationSeconds"] == 40
    assert body["spec"]["acquireTime"] == "t"
    assert current["spec"]["holderIdentity"] == "someone"  # input not mutated


@pytest.mark.parametrize(
    ("previous", "now", "expected"),
    [
        (100.0, 100.5, 110.0),  # the call took 0.5 s: next slot stays on the schedule
        (100.0, 109.9, 110.0),
        (100.0, 110.0, 120.0),  # exactly at the slot: the slot is taken as missed
        (100.0, 125.0, 130.0),  # two slots missed: skipped, not bunched
    ],
)
def test_ticks_follow_a_fixed_schedule(previous: float, now: float, expected: float) -> None:
    assert next_tick(previous, now, 10.0) == pytest.approx(expected)


class _HangingThenWorking:
    """A fake client: the first instance hangs on every call, later ones answer."""

    instances = 0

    def __init__(self) -> None:
        type(self).instances += 1
        self.hang = type(self).instances == 1
        self.closed = False
        self.store: dict[str, dict[str, object]] = {}

    async def get_lease(self, namespace: str, name: str) -> dict[str, object]:
        if self.hang:
            await asyncio.sleep(3600)
        from node_agent.base.errors import KubeNotFound

        raise KubeNotFound("missing", status=404)

    async def create_lease(self, namespace: str, body: dict[str, object]) -> dict[str, object]:
        return body

    async def close(self) -> None:
        self.closed = True


async def test_a_hung_connection_is_abandoned_and_the_next_tick_uses_a_fresh_client(
    tmp_path: Path,
) -> None:
    ctx: AgentContext = make_ctx(tmp_path)
    _HangingThenWorking.instances = 0
    made: list[_HangingThenWorking] = []

    def factory() -> _HangingThenWorking:
        made.append(_HangingThenWorking())
        return made[-1]

    controller = LeaseController(ctx, client_factory=factory, period=0.2)  # type: ignore[arg-type]
    assert not await controller.renew_once(deadline=0.05)
    assert made[0].closed
    assert await controller.renew_once(deadline=0.05)
    assert len(made) == 2
    assert controller.stats.creates == 1
    assert controller.stats.failures == 1


class _Unreachable:
    """A fake client for an API server that is away: every call fails at once; ``up`` brings it
    back. Counts the attempts."""

    up = False
    attempts: ClassVar[list[float]] = []

    def __init__(self) -> None:
        self.store: dict[str, dict[str, object]] = {}

    async def _call(self) -> None:
        from node_agent.base.errors import KubeNotFound, KubeTransportError

        type(self).attempts.append(asyncio.get_running_loop().time())
        if not type(self).up:
            raise KubeTransportError("connection refused")
        raise KubeNotFound("missing", status=404)

    async def get_lease(self, namespace: str, name: str) -> dict[str, object]:
        await self._call()
        return {}

    async def create_lease(self, namespace: str, body: dict[str, object]) -> dict[str, object]:
        return body

    async def close(self) -> None:
        return None


@pytest.mark.usefixtures("virtual_clock")
async def test_an_outage_costs_at_most_two_attempts_per_period(tmp_path: Path) -> None:
    """While the API server is away: each failed tick gets one extra attempt 2.5 s later, no
    more; once it is back, the next attempt renews (within a period of the return)."""
    ctx: AgentContext = make_ctx(tmp_path)
    ctx.node_known.set()
    _Unreachable.up, _Unreachable.attempts = False, []
    controller = LeaseController(ctx, client_factory=_Unreachable)  # type: ignore[arg-type]
    task = asyncio.create_task(controller.run())
    loop = asyncio.get_running_loop()
    start = loop.time()
    await asyncio.sleep(60.5)  # six periods away
    away = [round(t - start, 1) for t in _Unreachable.attempts]
    assert away == [0.0, 2.5, 10.0, 12.5, 20.0, 22.5, 30.0, 32.5, 40.0, 42.5, 50.0, 52.5, 60.0]
    _Unreachable.up = True
    back = loop.time()
    while controller.stats.renewals == 0:  # noqa: ASYNC110 - polling the controller's counter
        await asyncio.sleep(0.5)
    assert loop.time() - back <= controller.period
    assert controller.stats.creates == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
