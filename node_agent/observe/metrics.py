"""``/metrics``: every metric of the agent, pulled from one
:class:`~node_agent.observe.view.AgentView` at scrape time (the controllers keep their counters
anyway and need no metrics code).

:class:`AgentCollector` is a ``prometheus_client`` custom collector in a private registry (not
the library's global one, and without its process and platform collectors): one method per
section of the view, each yielding that section's metric families. Adding a section is one more
method named in :meth:`AgentCollector.sections`. Nothing exported here can carry a secret: only
names, counts, times and checksums.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from datetime import datetime

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from node_agent.observe.view import AgentView, HistogramView

#: The text format the agent has always served (Prometheus reads it; so does everything else).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

Metrics = Iterable[Metric]


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=value)


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, help_text, value=value)


def _bound(value: float) -> str:
    """A bucket bound as ``le`` shows it: ``0.25``, ``1``, ``60``."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _histogram(name: str, help_text: str, hist: HistogramView) -> HistogramMetricFamily:
    buckets = [(_bound(b), c) for b, c in zip(hist.buckets, hist.counts, strict=True)]
    buckets.append(("+Inf", hist.observed))
    return HistogramMetricFamily(name, help_text, buckets=buckets, sum_value=hist.total)


class AgentCollector(Collector):
    """The agent's metrics, read from ``read()`` (a fresh view) at each scrape."""

    def __init__(self, read: Callable[[], AgentView]) -> None:
        self.read = read

    def sections(self) -> tuple[Callable[[AgentView], Metrics], ...]:
        return (
            self.process,
            self.osc,
            self.applies,
            self.restarts,
            self.lease,
            self.watches,
            self.api,
            self.http,
            self.health,
            self.units_check,
            self.health_checks,
            self.safety,
            self.rollout,
            self.in_place,
            self.certificate,
        )

    def collect(self) -> Iterator[Metric]:
        view = self.read()  # one view per scrape: every section sees the same moment
        for section in self.sections():
            yield from section(view)

    def process(self, view: AgentView) -> Metrics:
        process = view.process
        yield _gauge("node_agent_up", "1 while the agent runs.", 1)
        info = GaugeMetricFamily(
            "node_agent_build_info",
            "Version of the agent (always 1).",
            labels=("version", "python"),
        )
        info.add_metric((process.version, process.python), 1)
        yield info
        yield _gauge(
            "node_agent_start_time_seconds", "Start of the agent (Unix time).", process.started_at
        )

    def osc(self, view: AgentView) -> Metrics:
        yield _counter("node_agent_osc_applies", "OSCs applied successfully.", view.osc.applies)
        yield _counter(
            "node_agent_osc_apply_failures",
            "OSC reconciliations that failed (invalid OSC, API, systemd, secretRef, apply).",
            view.osc.failures,
        )

    def applies(self, view: AgentView) -> Metrics:
        applies = view.applies
        yield _histogram(
            "node_agent_osc_apply_duration_seconds",
            "Duration of every apply run (full applies, resumes, drift repairs, failed ones).",
            applies.durations,
        )
        if applies.last_finished_at is not None:
            yield _gauge(
                "node_agent_last_apply_timestamp_seconds",
                "When the last apply finished (Unix time).",
                applies.last_finished_at,
            )
            yield _gauge(
                "node_agent_last_apply_success",
                "1 if the last apply succeeded, else 0.",
                1 if applies.last_succeeded else 0,
            )
        yield _gauge(
            "node_agent_apply_failed_items",
            "Items (files, units, unit commands, ...) of the last apply that failed.",
            applies.failed_items,
        )
        yield _gauge(
            "node_agent_osc_up_to_date",
            "1 if the applied OSC is the one in the Secret, else 0.",
            1 if view.osc.up_to_date else 0,
        )

    def restarts(self, view: AgentView) -> Metrics:
        restarts = CounterMetricFamily(
            "node_agent_unit_restarts",
            "Units restarted by the agent, by cause.",
            labels=("source",),
        )
        restarts.add_metric(("osc",), view.applies.restarts)
        restarts.add_metric(("annotation",), view.node.annotation_restarts)
        yield restarts

    def lease(self, view: AgentView) -> Metrics:
        lease = view.lease
        renewed = _epoch(lease.last_renew_time) if lease is not None else None
        if renewed is not None:
            yield _gauge(
                "node_agent_lease_last_renew_timestamp_seconds",
                "renewTime of the heartbeat Lease as last written by the agent (Unix time).",
                renewed,
            )
        yield _counter(
            "node_agent_lease_renewals",
            "Heartbeat Lease renewals.",
            lease.renewals if lease is not None else 0,
        )
        yield _counter(
            "node_agent_lease_renew_failures",
            "Heartbeat Lease renewals that failed.",
            lease.failures if lease is not None else 0,
        )

    def watches(self, view: AgentView) -> Metrics:
        reconnects = CounterMetricFamily(
            "node_agent_watch_reconnects",
            "Watches re-opened after an error, by watched kind.",
            labels=("resource",),
        )
        relists = CounterMetricFamily(
            "node_agent_watch_relists",
            "Re-lists after an expired resourceVersion (410 Gone), by watched kind.",
            labels=("resource",),
        )
        for watch in view.watches:
            reconnects.add_metric((watch.resource,), watch.reconnects)
            relists.add_metric((watch.resource,), watch.relists)
        yield reconnects
        yield relists

    def api(self, view: AgentView) -> Metrics:
        yield _counter(
            "node_agent_api_requests",
            "Requests sent by the agent's main API client (the Lease has its own, see lease_*).",
            view.api.requests,
        )
        yield _counter(
            "node_agent_api_request_errors",
            "Main API client requests that timed out or lost their connection.",
            view.api.errors,
        )

    def http(self, view: AgentView) -> Metrics:
        refused = CounterMetricFamily(
            "node_agent_http_connections_refused",
            "Connections to the probe and metrics ports closed unserved at the connection limit.",
            labels=("endpoint",),
        )
        timed_out = CounterMetricFamily(
            "node_agent_http_connections_timed_out",
            "Connections to the probe and metrics ports closed at the request deadline.",
            labels=("endpoint",),
        )
        for endpoint in view.endpoints:
            refused.add_metric((endpoint.name,), endpoint.refused)
            timed_out.add_metric((endpoint.name,), endpoint.timed_out)
        yield refused
        yield timed_out

    def health(self, view: AgentView) -> Metrics:
        yield _gauge("node_agent_ready", "1 if /readyz passes, else 0.", view.health.ready.ok)

    def units_check(self, view: AgentView) -> Metrics:
        check = view.units_check
        condition = check.condition if check is not None else None
        if check is None or condition is None:
            return
        yield _gauge(
            "node_agent_systemd_units_ready",
            "1 if the SystemdUnitsReady condition is True, else 0.",
            condition.status == "True",
        )
        yield _gauge(
            "node_agent_systemd_units_unhealthy",
            "Units of the applied OSC the last check found unhealthy.",
            len(check.unhealthy),
        )
        yield _gauge(
            "node_agent_systemd_units_restart_looping",
            "Units of the applied OSC in a Restart= crash loop (upstream's condition counts "
            "them healthy; in it only with the operator's restartLoops strictness).",
            len(check.looping),
        )

    def health_checks(self, view: AgentView) -> Metrics:
        checks = view.health_checks
        if checks is None or not checks.enabled:
            return
        healthy = GaugeMetricFamily(
            "node_agent_component_healthy",
            "1 if the component (kubelet, containerd) passed its last health check, else 0.",
            labels=("component",),
        )
        restarts = CounterMetricFamily(
            "node_agent_component_restarts",
            "Restarts of the component's unit by its health check.",
            labels=("component",),
        )
        for comp in checks.components:
            if comp.managed and comp.healthy is not None:
                healthy.add_metric((comp.name,), comp.healthy)
            restarts.add_metric((comp.name,), comp.restarts)
        yield healthy
        yield restarts

    def safety(self, view: AgentView) -> Metrics:
        gate = view.gate
        if gate is not None:
            yield _counter(
                "node_agent_osc_rollbacks",
                "Updates the health gate rolled back to the last-known-good OSC.",
                gate.rollbacks,
            )
            yield _gauge(
                "node_agent_osc_quarantined",
                "1 while an OSC checksum is quarantined after a rollback, else 0.",
                gate.quarantined is not None,
            )
        yield _gauge(
            "node_agent_units_restarts_suspended",
            "Units the restart-storm guard no longer lets the agent restart.",
            len(view.held_units),
        )

    def rollout(self, view: AgentView) -> Metrics:
        rollout = view.rollout
        if rollout is None:
            return
        yield _gauge(
            "node_agent_rollout_waiting",
            "1 while this node waits for its turn in the pool's rollout (serial Lease, slot, "
            "canaries), else 0.",
            rollout.state == "waiting",
        )
        yield _gauge(
            "node_agent_rollout_breaker_open",
            "1 while the pool's circuit breaker holds the rollout of the current OSC, else 0.",
            rollout.breaker_open,
        )
        yield _counter(
            "node_agent_rollout_waits",
            "Times this node had to wait for its turn in a rollout.",
            rollout.waits,
        )
        conflicts = CounterMetricFamily(
            "node_agent_rollout_lease_conflicts",
            "Writes of the pool's rollout Lease that lost their compare-and-swap race (409), "
            "by what the write was for.",
            labels=("write",),
        )
        for write, count in rollout.conflicts:
            conflicts.add_metric((write,), count)
        yield conflicts

    def in_place(self, view: AgentView) -> Metrics:
        in_place = view.in_place
        if in_place is None:
            return
        from node_agent.controllers.osc.inplace import PHASES

        phase = GaugeMetricFamily(
            "node_agent_inplace_update_phase",
            "1 for the phase the node's in-place update is in (done and failed: its last "
            "outcome), 0 for the others.",
            labels=("phase",),
        )
        for name in PHASES:
            phase.add_metric((name,), float(in_place.phase == name))
        yield phase
        outcomes = CounterMetricFamily(
            "node_agent_inplace_updates",
            "In-place updates this process finished, by result.",
            labels=("result",),
        )
        outcomes.add_metric(("succeeded",), in_place.succeeded)
        outcomes.add_metric(("failed",), in_place.failed)
        yield outcomes
        yield _counter(
            "node_agent_inplace_os_update_command_runs",
            "Runs of the OS extension's update command (retries included).",
            in_place.command_runs,
        )

    def certificate(self, view: AgentView) -> Metrics:
        cert = view.certificate
        expires = _epoch(cert.not_after) if cert is not None else None
        if expires is not None:
            yield _gauge(
                "node_agent_certificate_expiry_timestamp_seconds",
                "When the agent's client certificate expires (Unix time).",
                expires,
            )


def _epoch(moment: str | None) -> float | None:
    """An RFC 3339 time of the view (``...Z`` or with an offset) as Unix time."""
    if not moment:
        return None
    try:
        parsed = datetime.fromisoformat(moment.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed.timestamp() if parsed.tzinfo is not None else None


class AgentMetrics:
    """The exposition of one agent: its collector in a registry of its own."""

    def __init__(self, read: Callable[[], AgentView]) -> None:
        self.collector = AgentCollector(read)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)

    def render(self) -> str:
        """One scrape, in the text format (``CONTENT_TYPE``)."""
        return generate_latest(self.registry).decode()
