"""The heartbeat Lease ``kube-system/gardener-node-agent-<node>``, renewed every 10 s.

Gardener reads this Lease to decide whether the agent on a node is alive, so renewal must not
depend on anything else the agent does. Upstream shares one client with every controller and a
single hung connection stalled renewal for hours (gardener#15471). Here the Lease has its own
``KubeClient`` (its own connection pool) with short timeouts; each tick is bounded to less than
one period, and after a transport failure the client is thrown away so the next tick starts on a
fresh connection. Ticks follow a fixed schedule (``next = previous + period``), so a slow call
never makes the heartbeat drift; after a failed tick one extra attempt follows 2.5 s later, so a
briefly unavailable API server sees a renewal within seconds. Only one: if it fails too, the
next attempt is the next tick, so an agent makes at most two attempts per period however long
the API server is away (with an attempt every 2.5 s, a 5 minute outage cost 24 attempts a minute
per agent, measured by ``bench.fleet --scenarios outage``), and on the return the renewals come
at each agent's own tick, spread over the period instead of all within 2.5 s. This is
deliberately not the agent's backoff policy (``node_agent.base.retry``): a heartbeat must keep
its pace whatever happened before, and the schedule already bounds the load.

Normally one request per tick: a compare-and-swap PUT of the last Lease written. A 409 re-reads
and retries; a missing Lease is created (409 on create → read, then update).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node_agent.base.errors import (
    KubeAlreadyExists,
    KubeConflict,
    KubeError,
    KubeNotFound,
    KubeTransportError,
)
from node_agent.base.log import get_logger
from node_agent.context import AgentContext
from node_agent.kube.report import NAMESPACE

if TYPE_CHECKING:
    from node_agent.kube.client import KubeClient, Timeouts

log = get_logger("node-agent.lease")

LEASE_PREFIX = "gardener-node-agent-"
RENEW_PERIOD = 10.0
LEASE_DURATION_SECONDS = 40
#: Health marks: ``lease-tick`` on every tick (the loop is alive), ``lease`` on every renewal.
TICK_MARK = "lease-tick"
RENEW_MARK = "lease"
MAX_CONFLICT_RETRIES = 3
#: After a failed renewal, try again this soon instead of waiting for the next tick.
RETRY_AFTER_FAILURE = 2.5

JSON = dict[str, Any]


def lease_name(node_name: str) -> str:
    return f"{LEASE_PREFIX}{node_name}"


def micro_time(moment: datetime) -> str:
    """``metav1.MicroTime`` on the wire: RFC 3339 in UTC with microseconds and ``Z``."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_timeouts() -> Timeouts:
    from node_agent.kube.client import Timeouts

    return Timeouts(connect=3.0, read=5.0, total=8.0)


def desired_lease(
    node_name: str,
    node_uid: str | None,
    renew_time: datetime,
    current: Mapping[str, Any] | None = None,
) -> JSON:
    """The Lease to write: ``current`` (keeping its resourceVersion and foreign fields) with our
    holder, duration, renew time and owner reference set."""
    name = lease_name(node_name)
    body: JSON = dict(current or {})
    meta: JSON = dict(body.get("metadata") or {})
    meta["name"] = name
    meta["namespace"] = NAMESPACE
    owner = {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid or ""}
    others = [
        ref
        for ref in meta.get("ownerReferences") or []
        if not (isinstance(ref, Mapping) and ref.get("kind") == "Node")
    ]
    meta["ownerReferences"] = [*others, owner] if node_uid else others
    if not meta["ownerReferences"]:
        del meta["ownerReferences"]
    spec: JSON = dict(body.get("spec") or {})
    spec["holderIdentity"] = name
    spec["leaseDurationSeconds"] = LEASE_DURATION_SECONDS
    spec["renewTime"] = micro_time(renew_time)
    body.update(
        {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}
    )
    body.pop("status", None)
    return body


def next_tick(previous: float, now: float, period: float) -> float:
    """The next slot on the fixed schedule ``previous + k·period`` that is still ahead of ``now``
    (missed slots are skipped, never bunched up)."""
    tick = previous + period
    if tick <= now:
        missed = int((now - tick) // period) + 1
        tick += missed * period
    return tick


@dataclass
class LeaseStats:
    renewals: int = 0
    failures: int = 0
    creates: int = 0
    conflicts: int = 0
    client_rebuilds: int = 0
    last_renew_time: str | None = None
    last_error: str | None = None
    renew_times: list[float] = field(default_factory=list)  # monotonic, last 20


class LeaseController:
    """Keeps the node's heartbeat Lease fresh; see the module docstring."""

    def __init__(
        self,
        ctx: AgentContext,
        *,
        client_factory: Callable[[], KubeClient] | None = None,
        period: float = RENEW_PERIOD,
        retry_after: float = RETRY_AFTER_FAILURE,
    ) -> None:
        self.ctx = ctx
        self.period = period
        self.retry_after = retry_after
        self._client_factory = client_factory or self._default_client
        self._kube: KubeClient | None = None
        self._last: JSON | None = None  # the Lease as last written (for a one-request renewal)
        self.stats = LeaseStats()

    def _default_client(self) -> KubeClient:
        from node_agent.kube.client import KubeClient

        path = Path(self.ctx.settings.root) / self.ctx.config.client_connection.kubeconfig.lstrip(
            "/"
        )
        return KubeClient.from_kubeconfig(path, timeouts=lease_timeouts())

    @property
    def name(self) -> str | None:
        return lease_name(self.ctx.node_name) if self.ctx.node_name else None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        anchor = loop.time()  # ticks are anchor + k·period
        extra = False  # the coming attempt is the one extra attempt after a failed tick
        try:
            while True:
                self.ctx.health.progress(TICK_MARK)
                if self.ctx.node_known.is_set():
                    # Bounded below one period, so a tick never overlaps the next one.
                    ok = await self.renew_once(deadline=self.period * 0.9)
                    now = loop.time()
                    wake = next_tick(anchor, now, self.period)
                    # After a failed tick, one extra attempt soon (a thawed or restarted API
                    # server is used at once); after a failed extra attempt, the next tick.
                    # The schedule itself stays where it is.
                    extra = not ok and not extra and now + self.retry_after < wake
                    if extra:
                        wake = now + self.retry_after
                    await asyncio.sleep(max(0.0, wake - loop.time()))
                    continue
                # Until the Node is found: keep ticking, and renew as soon as it is known.
                wake = next_tick(anchor, loop.time(), self.period)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(wake):
                        await self.ctx.node_known.wait()
                    anchor = loop.time()
        finally:
            await self._drop_client()

    async def renew_once(self, deadline: float | None = None) -> bool:
        """One renewal attempt within ``deadline`` seconds; API trouble and a missed deadline
        are logged and counted, never raised."""
        try:
            async with asyncio.timeout(deadline):
                lease = await self._renew()
        except (KubeError, TimeoutError) as exc:
            self.stats.failures += 1
            self.stats.last_error = str(exc) or type(exc).__name__
            log.warning("lease not renewed", lease=self.name, error=self.stats.last_error)
            self.ctx.health.error("lease", self.stats.last_error)
            if isinstance(exc, KubeTransportError | TimeoutError):
                # The connection may be hung: the next tick starts with a fresh pool.
                await self._drop_client()
            return False
        self._last = lease
        self.stats.renewals += 1
        self.stats.last_renew_time = str(lease["spec"]["renewTime"])
        self.stats.renew_times = [*self.stats.renew_times[-19:], asyncio.get_running_loop().time()]
        self.ctx.health.progress(RENEW_MARK)
        log.debug("lease renewed", lease=self.name, renew_time=self.stats.last_renew_time)
        return True

    async def _client(self) -> KubeClient:
        if self._kube is None:
            self._kube = self._client_factory()
            self.stats.client_rebuilds += 1
        return self._kube

    async def _drop_client(self) -> None:
        kube, self._kube = self._kube, None
        if kube is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await kube.close()

    async def _renew(self) -> JSON:
        assert self.ctx.node_name is not None
        kube = await self._client()
        node, uid = self.ctx.node_name, self.ctx.node_uid
        name = lease_name(node)
        current = self._last
        for _attempt in range(MAX_CONFLICT_RETRIES):
            if current is None:
                try:
                    current = await kube.get_lease(NAMESPACE, name)
                except KubeNotFound:
                    body = desired_lease(node, uid, datetime.now(UTC))
                    try:
                        created = await kube.create_lease(NAMESPACE, body)
                    except KubeAlreadyExists:
                        continue  # someone created it meanwhile: read it and update
                    self.stats.creates += 1
                    log.info("lease created", lease=name)
                    return created
            body = desired_lease(node, uid, datetime.now(UTC), current)
            try:
                return await kube.update_lease(NAMESPACE, name, body)
            except KubeNotFound:
                current = None  # deleted meanwhile: create it again
            except KubeConflict:
                self.stats.conflicts += 1
                current = None  # stale resourceVersion: re-read
        raise KubeConflict(f"lease {NAMESPACE}/{name}: still conflicting", status=409)
