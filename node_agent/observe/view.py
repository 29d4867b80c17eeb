"""The running agent, read: one typed, read-only view for ``node-agent status``, the health probes
and the metrics.

Two halves:

* :class:`Sources` is what the agent wires in as its parts are built (the OSC, Lease, Node and
  certificate controllers, the apply observations, the HTTP endpoints). Each source is named by a
  small :class:`~typing.Protocol` of what is read from it, so a test can hand in a fake and mypy
  proves the real controllers fit.
* :func:`read_view` turns them into an :class:`AgentView`: immutable typed records
  (``NamedTuple``: a sixth of a frozen dataclass's class-creation cost, and this module is on the
  way to READY), one per section, taken in one go on the event loop (no I/O, no awaits), so every
  reader sees one consistent moment. The status socket turns it into JSON
  (:mod:`node_agent.observe.unix_socket`), the metrics collector into samples
  (:mod:`node_agent.observe.metrics`).

Nothing here may hold a secret: names, counts, times and checksums only. Importing this module is
cheap (the CLI's ``status`` client may read its types): no pydantic, no kube client.

Adding a section: a record type and a field of :class:`AgentView` (filled in
:func:`read_view` from a source on :class:`Sources`), an entry in the status document
(``unix_socket.SECTIONS`` and ``status_document.skeleton()``) and its text in
``status.RENDERERS``, a method of the metrics collector.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import platform
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, MutableSet, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from node_agent import __version__
from node_agent.base.digest import sha256_hex

if TYPE_CHECKING:
    from node_agent.apply.restart_guard import HeldUnit
    from node_agent.context import AgentContext
    from node_agent.controllers.certificate import CertificateView
    from node_agent.controllers.healthcheck import HealthCheckView
    from node_agent.controllers.lease import LeaseStats
    from node_agent.controllers.node import NodeStats
    from node_agent.controllers.osc.health_gate import GateView
    from node_agent.controllers.osc.inplace import InPlaceView
    from node_agent.controllers.osc.rollout import RolloutView
    from node_agent.controllers.unitcheck import UnitCheckView
    from node_agent.kube.watch import WatchStats
    from node_agent.observe.observations import ApplyObservations

#: Progress marks that mean "a request to the API server succeeded just now".
API_SUCCESS_MARKS = ("lease", "osc-watch", "node-watch")


# --- what the agent wires in -------------------------------------------------------------------


class OSCSource(Protocol):
    """The OSC controller (``node_agent.controllers.osc.controller.OSCController``)."""

    @property
    def applies(self) -> int: ...

    @property
    def failures(self) -> int: ...

    @property
    def desired_checksum(self) -> str | None: ...

    @property
    def latest_secret(self) -> Mapping[str, Any] | None: ...


class LeaseSource(Protocol):
    """The Lease controller (``node_agent.controllers.lease.LeaseController``)."""

    @property
    def name(self) -> str | None: ...

    @property
    def stats(self) -> LeaseStats: ...


class NodeSource(Protocol):
    """The Node controller (``node_agent.controllers.node.NodeController``)."""

    @property
    def stats(self) -> NodeStats: ...

    @property
    def missing(self) -> str | None: ...


class CertificateSource(Protocol):
    """The certificate controller: it already hands out a frozen view of itself."""

    def view(self) -> CertificateView: ...


class UnitCheckSource(Protocol):
    """The unit check (``SystemdUnitsReady``): a frozen view of its last check."""

    def view(self) -> UnitCheckView: ...


class HealthCheckSource(Protocol):
    """The kubelet and containerd health checks."""

    def view(self) -> HealthCheckView: ...


class GateSource(Protocol):
    """The health gate of updates (watching, quarantine, last rollback)."""

    def view(self) -> GateView: ...


class RolloutSource(Protocol):
    """Serial mode and the paced rollout of the pool."""

    def view(self) -> RolloutView: ...


class InPlaceSource(Protocol):
    """The in-place update of the node (OS, kubelet, credentials) and its phase."""

    def view(self) -> InPlaceView: ...


class GuardSource(Protocol):
    """The restart-storm guard: the units it holds."""

    def view(self) -> tuple[HeldUnit, ...]: ...


class ProbeSource(Protocol):
    """The liveness and readiness probes (``node_agent.observe.probes.Probes``)."""

    def live(self) -> Verdict: ...

    def ready(self) -> Verdict: ...


class WatchSource(Protocol):
    """A list+watch (``node_agent.kube.watch.ListWatch``): its kind and counters."""

    @property
    def kind(self) -> str: ...

    @property
    def stats(self) -> WatchStats: ...


class EndpointView(NamedTuple):
    """One HTTP endpoint: where it listens and what it closed unserved."""

    name: str  # the ``endpoint`` label of its metrics
    address: str | None  # host:port
    refused: int = 0
    timed_out: int = 0
    #: What it serves: "health" (/healthz, /readyz), "metrics"; both when the ports are the same.
    serves: tuple[str, ...] = ()


@dataclass
class Sources:
    """The agent's parts the read side looks at; None until the agent has built them.

    Set once by the wiring (``node_agent.agent``); read by :func:`read_view` only."""

    osc: OSCSource | None = None
    lease: LeaseSource | None = None
    node: NodeSource | None = None
    certificate: CertificateSource | None = None
    unitcheck: UnitCheckSource | None = None
    healthcheck: HealthCheckSource | None = None
    gate: GateSource | None = None
    guard: GuardSource | None = None
    rollout: RolloutSource | None = None
    in_place: InPlaceSource | None = None
    #: The agent's live list+watches (their counters are summed by kind); the controllers hand
    #: it to ``list_watch(registry=...)``, and a watch that is gone drops out (weak references).
    watches: MutableSet[Any] = field(default_factory=weakref.WeakSet, repr=False)
    #: The HTTP endpoints (set when they are started).
    endpoints: Callable[[], Sequence[EndpointView]] = field(default=tuple, repr=False)


# --- the view ----------------------------------------------------------------------------------


class Verdict(NamedTuple):
    ok: bool
    reasons: tuple[str, ...]


class ErrorView(NamedTuple):
    """One entry of the recent errors (the message as recorded; scrubbed where it is shown)."""

    at: str | None
    source: str | None
    error: str


class ProcessView(NamedTuple):
    version: str
    python: str
    pid: int
    started_at: float  # Unix time
    host_name: str
    node_name: str | None


class ApiView(NamedTuple):
    """The main API client (the Lease has its own, see :class:`LeaseView`)."""

    server: str | None
    requests: int
    errors: int  # timed out or lost their connection
    last_success_at: float | None  # Unix time of the latest mark that needed an answer
    last_error: ErrorView | None


class LeaseView(NamedTuple):
    name: str | None  # kube-system/<name>
    last_renew_time: str | None
    renewals: int
    failures: int


class OSCView(NamedTuple):
    secret_name: str
    applied_checksum: str | None
    desired_checksum: str | None
    applies: int
    failures: int

    @property
    def up_to_date(self) -> bool | None:
        """None while either checksum is unknown."""
        if not self.applied_checksum or not self.desired_checksum:
            return None
        return self.applied_checksum == self.desired_checksum


class HistogramView(NamedTuple):
    buckets: tuple[float, ...]
    counts: tuple[int, ...]  # cumulative, one per bucket
    total: float  # sum of the observed values
    observed: int  # how many


class AppliesView(NamedTuple):
    """What the applier's records told since the start (see ``node_agent.observe.observations``)."""

    durations: HistogramView
    restarts: int  # units restarted by applies
    last_finished_at: float | None  # Unix time
    last_succeeded: bool | None
    failed_items: int  # of the last apply


class NodeView(NamedTuple):
    annotation_restarts: int  # units restarted for the Node's restart annotation
    missing: str | None  # why the Node is gone, or None


class WatchView(NamedTuple):
    resource: str
    reconnects: int
    relists: int


class HealthView(NamedTuple):
    live: Verdict
    ready: Verdict


class AgentView(NamedTuple):
    """The agent at one moment. Every field is an immutable section; None where a part is not
    built."""

    process: ProcessView
    api: ApiView
    lease: LeaseView | None
    certificate: CertificateView | None
    osc: OSCView
    applies: AppliesView
    node: NodeView
    watches: tuple[WatchView, ...]
    endpoints: tuple[EndpointView, ...]
    health: HealthView
    errors: tuple[ErrorView, ...]
    #: the SystemdUnitsReady check, the kubelet/containerd checks, the health gate, and the
    #: units the restart-storm guard holds (None / empty until those parts are built)
    units_check: UnitCheckView | None = None
    health_checks: HealthCheckView | None = None
    gate: GateView | None = None
    held_units: tuple[HeldUnit, ...] = ()
    rollout: RolloutView | None = None
    in_place: InPlaceView | None = None


def reader(
    ctx: AgentContext, sources: Sources, observations: ApplyObservations, probes: ProbeSource
) -> Callable[[], AgentView]:
    """``read_view`` bound to one agent: what the servers call per request."""
    return lambda: read_view(ctx, sources, observations, probes)


def read_view(
    ctx: AgentContext, sources: Sources, observations: ApplyObservations, probes: ProbeSource
) -> AgentView:
    """The view of the agent behind ``ctx`` now (cheap: memory only, called per request)."""
    errors = tuple(_error(e) for e in ctx.health.errors)
    api_errors = [e for e in errors if _is_api_error(e)]
    stats = ctx.kube.stats
    applied, desired = applied_and_desired(ctx, sources)
    osc, lease, node = sources.osc, sources.lease, sources.node
    last = observations.last
    hist = observations.durations
    return AgentView(
        process=ProcessView(
            version=__version__,
            python=platform.python_version(),
            pid=os.getpid(),
            started_at=ctx.health.started,
            host_name=ctx.host_name,
            node_name=ctx.node_name,
        ),
        api=ApiView(
            server=str(ctx.kube.server) or None,
            requests=stats.requests,
            errors=stats.timeouts + stats.transport_errors,
            last_success_at=api_last_success(ctx),
            last_error=api_errors[-1] if api_errors else None,
        ),
        lease=None
        if lease is None
        else LeaseView(
            name=f"kube-system/{lease.name}" if lease.name else None,
            last_renew_time=lease.stats.last_renew_time,
            renewals=lease.stats.renewals,
            failures=lease.stats.failures,
        ),
        certificate=sources.certificate.view() if sources.certificate is not None else None,
        osc=OSCView(
            secret_name=ctx.secret_name,
            applied_checksum=applied or None,
            desired_checksum=desired,
            applies=osc.applies if osc is not None else 0,
            failures=osc.failures if osc is not None else 0,
        ),
        applies=AppliesView(
            durations=HistogramView(hist.buckets, tuple(hist.counts), hist.total, hist.count),
            restarts=observations.restarts,
            last_finished_at=last.finished_at.timestamp() if last is not None else None,
            last_succeeded=(last.result == "succeeded") if last is not None else None,
            failed_items=observations.failed_items,
        ),
        node=NodeView(
            annotation_restarts=len(node.stats.restarts) if node is not None else 0,
            missing=node.missing if node is not None else None,
        ),
        watches=_watches(tuple(sources.watches)),
        endpoints=tuple(sources.endpoints()),
        health=HealthView(live=probes.live(), ready=probes.ready()),
        errors=errors,
        units_check=sources.unitcheck.view() if sources.unitcheck is not None else None,
        health_checks=sources.healthcheck.view() if sources.healthcheck is not None else None,
        gate=sources.gate.view() if sources.gate is not None else None,
        held_units=sources.guard.view() if sources.guard is not None else (),
        rollout=sources.rollout.view() if sources.rollout is not None else None,
        in_place=sources.in_place.view() if sources.in_place is not None else None,
    )


def _watches(watches: Iterable[WatchSource]) -> tuple[WatchView, ...]:
    reconnects: dict[str, int] = {}
    relists: dict[str, int] = {}
    for watch in watches:
        reconnects[watch.kind] = reconnects.get(watch.kind, 0) + watch.stats.reconnects
        relists[watch.kind] = relists.get(watch.kind, 0) + watch.stats.relists
    return tuple(WatchView(kind, reconnects[kind], relists[kind]) for kind in sorted(reconnects))


def _error(entry: Mapping[str, Any]) -> ErrorView:
    at, source = entry.get("at"), entry.get("source")
    return ErrorView(
        at=str(at) if at is not None else None,
        source=str(source) if source is not None else None,
        error=str(entry.get("error", "")),
    )


def _is_api_error(entry: ErrorView) -> bool:
    return entry.source in ("lease", "node", "token") or entry.error.startswith("Kube")


def _mono_to_wall(mark: float | None) -> float | None:
    if mark is None:
        return None
    return time.time() - (time.monotonic() - mark)


def applied_and_desired(ctx: AgentContext, sources: Sources) -> tuple[str, str | None]:
    """The applied checksum ('' if none) and the checksum of the Secret's ``osc.yaml`` as last
    seen by the watch (None if not seen)."""
    applied = ctx.state.applied_checksum()  # in memory: no read, no hashing per request
    osc = sources.osc
    if osc is None:
        return applied, None
    desired: str | None = None
    secret = osc.latest_secret
    if secret is not None:
        data = (secret.get("data") or {}).get("osc.yaml")
        if isinstance(data, str):
            with contextlib.suppress(binascii.Error, ValueError):
                desired = sha256_hex(base64.b64decode(data, validate=True))
    if desired is None:
        desired = osc.desired_checksum
    return applied, desired


def api_last_success(ctx: AgentContext) -> float | None:
    """Wall time of the latest progress mark that needs an answer from the API server."""
    marks = ctx.health.last_progress
    seen = [marks[m] for m in API_SUCCESS_MARKS if m in marks]
    return _mono_to_wall(max(seen)) if seen else None
