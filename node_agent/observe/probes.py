"""The agent's liveness (``/healthz``) and readiness (``/readyz``), also shown by
``node-agent status``. Both are judged from memory only, per request."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from node_agent.controllers.lifecycle import watchdog_ok
from node_agent.observe.view import Sources, Verdict, applied_and_desired

if TYPE_CHECKING:
    from node_agent.context import AgentContext
    from node_agent.observe.observations import ApplyObservations

#: The OSC controller failing this many times in a row, while the node is not converged, makes the
#: agent not ready (a single transient failure is retried within seconds and must not flap).
FAILURE_STREAK = 3
#: A Lease not renewed for this long has expired for Gardener: the agent is not ready.
LEASE_STALE = 40.0
#: Event loop lag beyond this makes /healthz fail (the watchdog uses its own interval).
MAX_LOOP_LAG = 5.0


class Probes:
    """Liveness and readiness of the agent behind ``ctx``."""

    def __init__(
        self, ctx: AgentContext, sources: Sources, observations: ApplyObservations
    ) -> None:
        self.ctx = ctx
        self.sources = sources
        self.observations = observations
        self.started = time.monotonic()
        self.loop_lag = 0.0

    async def measure_loop(self, interval: float = 5.0) -> None:
        """Keep :attr:`loop_lag` current: how late a 5 s sleep wakes up (a loop held longer
        than ``MAX_LOOP_LAG`` shows when the sleep ends; a shorter period only wakes an idle
        agent more often)."""
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(interval)
            self.loop_lag = max(0.0, loop.time() - before - interval)

    def live(self) -> Verdict:
        """Event loop turning and the lease loop ticking (not: the API server answering)."""
        ok, why = watchdog_ok(
            self.ctx.health.last_progress,
            now=time.monotonic(),
            started=self.started,
            loop_lag=self.loop_lag,
            max_lag=MAX_LOOP_LAG,
        )
        return Verdict(ok, () if ok else (why,))

    def failure_streak(self) -> int:
        osc = self.sources.osc
        failures = osc.failures if osc is not None else 0
        return max(0, failures - self.observations.failures_at_success)

    def converged(self) -> bool:
        applied, desired = applied_and_desired(self.ctx, self.sources)
        return bool(applied) and applied == desired and self.ctx.state.pending() is None

    def ready(self) -> Verdict:
        """Node found (and not deleted since), OSC watch synced once, lease fresh, no persistent
        OSC failure."""
        reasons: list[str] = []
        now = time.monotonic()
        marks = self.ctx.health.last_progress
        node = self.sources.node
        missing = node.missing if node is not None else None
        if not self.ctx.node_known.is_set():
            reasons.append(f"node {self.ctx.host_name.lower()} not found yet")
        elif missing:
            reasons.append(missing)
        elif now - marks.get("lease", self.started) > LEASE_STALE:
            reasons.append(f"lease not renewed for {now - marks.get('lease', self.started):.0f}s")
        if "osc-watch" not in marks:
            reasons.append(f"secret {self.ctx.secret_name} not listed yet")
        streak = self.failure_streak()
        if streak >= FAILURE_STREAK and not self.converged():
            reasons.append(f"OSC apply failed {streak} times in a row")
        return Verdict(not reasons, tuple(reasons))
