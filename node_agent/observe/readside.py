"""Starts and stops the agent's read side: the health probe and metrics ports
(:mod:`node_agent.observe.http_ports`) and the status socket
(:mod:`node_agent.observe.unix_socket`), all reading the agent through one
:class:`~node_agent.observe.view.AgentView` (:mod:`node_agent.observe.view`).

The daemon starts the status socket first and the ports later (``agent.py``): the ports' server,
aiohttp's ``web``, is imported only when they start, off the way to the first apply.

What is where: :mod:`node_agent.observe.view` (the typed, read-only view and what it is read from),
:mod:`node_agent.observe.probes` (liveness and readiness), :mod:`node_agent.observe.observations`
(apply durations, observed as they are persisted), :mod:`node_agent.observe.metrics` (the metrics,
pulled from the view at scrape time), :mod:`node_agent.observe.status_document` (the status
document's shape; its client and text are :mod:`node_agent.commands.status`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from node_agent.base.errors import NodeAgentError
from node_agent.base.log import get_logger
from node_agent.base.loop import cancel_and_wait
from node_agent.observe.observations import ApplyObservations
from node_agent.observe.probes import Probes
from node_agent.observe.view import AgentView, EndpointView, Sources, Verdict, reader

if TYPE_CHECKING:
    from node_agent.config import ServerEndpoint
    from node_agent.context import AgentContext
    from node_agent.observe.http_ports import Handler, HttpEndpoint
    from node_agent.observe.metrics import AgentMetrics
    from node_agent.observe.unix_socket import StatusServer

log = get_logger("node-agent.observability")


class Observability:
    """Starts and stops the health, metrics and status servers of one agent.

    A server that cannot bind (port taken, socket directory not writable) is logged and skipped:
    the agent's job on the node matters more than its reporting.
    """

    def __init__(
        self, ctx: AgentContext, sources: Sources, observations: ApplyObservations
    ) -> None:
        self.ctx = ctx
        self.observations = observations
        observations.failure_count = lambda: sources.osc.failures if sources.osc else 0
        self.probes = Probes(ctx, sources, observations)
        self.read: Callable[[], AgentView] = reader(ctx, sources, observations, self.probes)
        self._metrics_exposition: AgentMetrics | None = None  # built at the first scrape
        self._ticker: asyncio.Task[None] | None = None
        self._status: StatusServer | None = None
        self._started: list[HttpEndpoint] = []
        sources.endpoints = self.endpoint_views

    async def start(self) -> None:
        """The status socket, then the ports."""
        await self.start_status()
        await self.start_ports()

    async def start_status(self) -> None:
        """The status socket (and the loop-lag probe the status and ``/healthz`` show)."""
        from node_agent.observe.unix_socket import StatusServer

        status = StatusServer(self.ctx, self.read)
        try:
            await status.start()
        except (OSError, NodeAgentError) as exc:
            log.error("status socket not started", path=str(status.path), error=str(exc))
        else:
            self._status = status
        self._ticker = asyncio.create_task(self.probes.measure_loop(), name="loop-lag")

    async def start_ports(self) -> None:
        """The health probe and metrics ports."""
        for endpoint, conf in self.endpoints():
            try:
                await endpoint.start(conf.bind_address, conf.port)
            except OSError as exc:
                log.error(
                    "endpoint not started",
                    endpoint=endpoint.name,
                    address=f"{conf.bind_address or '*'}:{conf.port}",
                    error=str(exc),
                )
                continue
            self._started.append(endpoint)
            log.info(
                "endpoint listening",
                endpoint=endpoint.name,
                address=f"{conf.bind_address or '*'}:{endpoint.port}",
            )

    def endpoints(self) -> list[tuple[HttpEndpoint, ServerEndpoint]]:
        """The endpoints to start and where: two, or one serving everything when the probe and
        metrics ports are the same (a fixed port bound twice would fail)."""
        from node_agent.observe.http_ports import HttpEndpoint  # aiohttp.web: see the module

        health_routes: dict[str, Handler] = {
            "/healthz": self._healthz,
            "/readyz": self._readyz,
            "/livez": self._healthz,
        }
        metrics_routes: dict[str, Handler] = {"/metrics": self._metrics}
        server = self.ctx.config.server
        probes, metrics = server.health_probes, server.metrics
        if probes.port != 0 and (probes.port, probes.bind_address) == (
            metrics.port,
            metrics.bind_address,
        ):
            both = HttpEndpoint(
                "health", {**health_routes, **metrics_routes}, serves=("health", "metrics")
            )
            return [(both, probes)]
        return [
            (HttpEndpoint("health", health_routes), probes),
            (HttpEndpoint("metrics", metrics_routes), metrics),
        ]

    def endpoint_views(self) -> tuple[EndpointView, ...]:
        """The started endpoints, for the view."""
        return tuple(endpoint.view() for endpoint in self._started)

    async def close(self) -> None:
        await cancel_and_wait(self._ticker)
        for endpoint in self._started:
            await endpoint.close()
        if self._status is not None:
            await self._status.close()

    async def _healthz(self) -> tuple[int, str, str]:
        return _probe_answer(self.probes.live())

    async def _readyz(self) -> tuple[int, str, str]:
        return _probe_answer(self.probes.ready())

    async def _metrics(self) -> tuple[int, str, str]:
        # prometheus_client is imported at the first scrape, not on the way to READY.
        from node_agent.observe.metrics import CONTENT_TYPE, AgentMetrics

        if self._metrics_exposition is None:
            self._metrics_exposition = AgentMetrics(self.read)
        return 200, CONTENT_TYPE, self._metrics_exposition.render()


def _probe_answer(verdict: Verdict) -> tuple[int, str, str]:
    if verdict.ok:
        return 200, "text/plain", "ok\n"
    return 503, "text/plain", "".join(f"{r}\n" for r in verdict.reasons)
