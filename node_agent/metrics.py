"""``/metrics``: every metric of the agent, pulled from one :class:`~node_agent.view.AgentView` at
scrape time (the controllers keep their counters anyway and need no metrics code).

One method of :class:`AgentMetrics` per section of the view; adding a section is one more method
named in :meth:`AgentMetrics.sections`. Nothing exported here can carry a secret: only names,
counts, times and checksums.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

from node_agent.view import AgentView, HistogramView

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Sample = tuple[Mapping[str, str], float]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    return "{" + inner + "}"


class MetricsText:
    """Builds one exposition (``text/plain; version=0.0.4``)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_text: str, samples: Iterable[Sample]) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            self.lines.append(f"{name}{_labels(labels)} {_number(value)}")

    def one(self, name: str, kind: str, help_text: str, value: float) -> None:
        self.metric(name, kind, help_text, [({}, value)])

    def histogram(self, name: str, help_text: str, hist: HistogramView) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} histogram")
        for bound, count in zip(hist.buckets, hist.counts, strict=True):
            self.lines.append(f'{name}_bucket{{le="{_number(bound)}"}} {count}')
        self.lines.append(f'{name}_bucket{{le="+Inf"}} {hist.count}')
        self.lines.append(f"{name}_sum {_number(hist.total)}")
        self.lines.append(f"{name}_count {hist.count}")

    def render(self) -> str:
        return "\n".join(self.lines) + "\n"


class AgentMetrics:
    """The agent's metrics, read from ``read()`` (a fresh view) at each scrape."""

    def __init__(self, read: Callable[[], AgentView]) -> None:
        self.read = read

    def sections(self) -> tuple[Callable[[MetricsText, AgentView], None], ...]:
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
        )

    def render(self) -> str:
        view = self.read()
        out = MetricsText()
        for section in self.sections():
            section(out, view)
        return out.render()

    def process(self, out: MetricsText, view: AgentView) -> None:
        out.one("node_agent_up", "gauge", "1 while the agent runs.", 1)
        out.metric(
            "node_agent_build_info",
            "gauge",
            "Version of the agent (always 1).",
            [({"version": view.process.version, "python": view.process.python}, 1)],
        )
        out.one(
            "node_agent_start_time_seconds",
            "gauge",
            "Start of the agent (Unix time).",
            view.process.started_at,
        )

    def osc(self, out: MetricsText, view: AgentView) -> None:
        out.one(
            "node_agent_osc_applies_total",
            "counter",
            "OSCs applied successfully.",
            view.osc.applies,
        )
        out.one(
            "node_agent_osc_apply_failures_total",
            "counter",
            "OSC reconciliations that failed (invalid OSC, API, systemd, secretRef, apply).",
            view.osc.failures,
        )

    def applies(self, out: MetricsText, view: AgentView) -> None:
        applies = view.applies
        out.histogram(
            "node_agent_osc_apply_duration_seconds",
            "Duration of every apply run (full applies, resumes, drift repairs, failed ones).",
            applies.durations,
        )
        if applies.last_finished_at is not None:
            out.one(
                "node_agent_last_apply_timestamp_seconds",
                "gauge",
                "When the last apply finished (Unix time).",
                applies.last_finished_at,
            )
            out.one(
                "node_agent_last_apply_success",
                "gauge",
                "1 if the last apply succeeded, else 0.",
                1 if applies.last_succeeded else 0,
            )
        out.one(
            "node_agent_apply_failed_items",
            "gauge",
            "Items (files, units, unit commands, ...) of the last apply that failed.",
            applies.failed_items,
        )
        out.one(
            "node_agent_osc_up_to_date",
            "gauge",
            "1 if the applied OSC is the one in the Secret, else 0.",
            1 if view.osc.up_to_date else 0,
        )

    def restarts(self, out: MetricsText, view: AgentView) -> None:
        out.metric(
            "node_agent_unit_restarts_total",
            "counter",
            "Units restarted by the agent, by cause.",
            [
                ({"source": "osc"}, view.applies.restarts),
                ({"source": "annotation"}, view.node.annotation_restarts),
            ],
        )

    def lease(self, out: MetricsText, view: AgentView) -> None:
        lease = view.lease
        out.one(
            "node_agent_lease_renewals_total",
            "counter",
            "Heartbeat Lease renewals.",
            lease.renewals if lease is not None else 0,
        )
        out.one(
            "node_agent_lease_renew_failures_total",
            "counter",
            "Heartbeat Lease renewals that failed.",
            lease.failures if lease is not None else 0,
        )

    def watches(self, out: MetricsText, view: AgentView) -> None:
        out.metric(
            "node_agent_watch_reconnects_total",
            "counter",
            "Watches re-opened after an error, by watched kind.",
            [({"resource": w.resource}, w.reconnects) for w in view.watches],
        )
        out.metric(
            "node_agent_watch_relists_total",
            "counter",
            "Re-lists after an expired resourceVersion (410 Gone), by watched kind.",
            [({"resource": w.resource}, w.relists) for w in view.watches],
        )

    def api(self, out: MetricsText, view: AgentView) -> None:
        out.one(
            "node_agent_api_requests_total",
            "counter",
            "Requests sent by the agent's main API client (the Lease has its own, see lease_*).",
            view.api.requests,
        )
        out.one(
            "node_agent_api_request_errors_total",
            "counter",
            "Main API client requests that timed out or lost their connection.",
            view.api.errors,
        )

    def http(self, out: MetricsText, view: AgentView) -> None:
        out.metric(
            "node_agent_http_connections_refused_total",
            "counter",
            "Connections to the probe and metrics ports closed unserved at the connection limit.",
            [({"endpoint": e.name}, e.refused) for e in view.endpoints],
        )
        out.metric(
            "node_agent_http_connections_timed_out_total",
            "counter",
            "Connections to the probe and metrics ports closed at the request deadline.",
            [({"endpoint": e.name}, e.timed_out) for e in view.endpoints],
        )

    def health(self, out: MetricsText, view: AgentView) -> None:
        out.one("node_agent_ready", "gauge", "1 if /readyz passes, else 0.", view.health.ready.ok)
