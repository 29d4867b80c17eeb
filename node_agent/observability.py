"""Health probes (``/healthz``, ``/readyz``) and Prometheus metrics (``/metrics``) over plain HTTP.

Why hand-written: two tiny GET-only servers on ``asyncio.start_server`` and the Prometheus text
format cost a few hundred lines, while an HTTP framework or ``prometheus_client`` would be one
more runtime dependency (and more RSS) on every node. Both bind where Gardener's config says
(``server.healthProbes`` / ``server.metrics``: ``bindAddress`` '' = every address, like upstream's
``net.JoinHostPort("", port)``; port 0 picks a free port, see :attr:`HttpEndpoint.port`).

Metrics are *pulled*: at scrape time the counters the controllers keep anyway are read, so the
controllers need no metrics code. The one thing that must be observed as it happens is every
apply's duration (a histogram); :class:`ObservedStateStore` sees each ``ApplyRecord`` the applier
persists. Nothing exported here can carry a secret: only names, counts, times and checksums.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import platform
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from node_agent import __version__
from node_agent.controllers.lifecycle import watchdog_ok
from node_agent.host.state import ApplyRecord, StateStore
from node_agent.log import get_logger

if TYPE_CHECKING:
    from node_agent.context import AgentContext
    from node_agent.host.fs import HostFS

log = get_logger("node-agent.observability")

#: Apply durations (seconds): a no-op-ish apply takes tens of ms, a kubelet restart seconds, an
#: image pull or a stuck unit up to the job timeout.
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: The OSC controller failing this many times in a row, while the node is not converged, makes the
#: agent not ready (a single transient failure is retried within seconds and must not flap).
FAILURE_STREAK = 3
#: A Lease not renewed for this long has expired for Gardener: the agent is not ready.
LEASE_STALE = 40.0
#: Event loop lag beyond this makes /healthz fail (the watchdog uses its own interval).
MAX_LOOP_LAG = 5.0
#: Progress marks that mean "a request to the API server succeeded just now".
API_SUCCESS_MARKS = ("lease", "osc-watch", "node-watch")
REQUEST_TIMEOUT = 5.0
MAX_HEADER_BYTES = 16 * 1024


# --- observations ------------------------------------------------------------------------------


@dataclass
class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    buckets: tuple[float, ...] = DURATION_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1


@dataclass
class ApplyObservations:
    """What the applier's records tell, as they are written (see :class:`ObservedStateStore`)."""

    durations: Histogram = field(default_factory=Histogram)
    results: dict[str, int] = field(default_factory=dict)
    restarts: int = 0  # units restarted by applies (OSC changes and drift repairs)
    last: ApplyRecord | None = None
    #: ``osc.failures`` when the last apply succeeded: the failure streak starts there.
    failures_at_success: int = 0
    #: Reads the OSC controller's failure counter (set once the controller exists).
    failure_count: Callable[[], int] = field(default=lambda: 0, repr=False)

    def observe(self, record: ApplyRecord) -> None:
        self.durations.observe(record.duration_seconds)
        self.results[record.result] = self.results.get(record.result, 0) + 1
        self.restarts += len(record.restarted_units)
        self.last = record
        if record.result == "succeeded":
            self.failures_at_success = self.failure_count()


class ObservedStateStore(StateStore):
    """A StateStore that also hands every saved ApplyRecord to ``on_status`` (for metrics)."""

    def __init__(self, fs: HostFS, on_status: Callable[[ApplyRecord], None]) -> None:
        super().__init__(fs)
        self._on_status = on_status

    def save_status(self, record: ApplyRecord) -> None:
        super().save_status(record)
        try:
            self._on_status(record)
        except Exception as exc:  # metrics must never fail an apply
            log.warning("apply not observed", error=str(exc))


# --- health ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reasons: tuple[str, ...]


def _controller(ctx: AgentContext, name: str) -> Any:
    return ctx.health.info.get(name)


def _mono_to_wall(mark: float | None) -> float | None:
    if mark is None:
        return None
    return time.time() - (time.monotonic() - mark)


class Probes:
    """The agent's liveness and readiness, also shown by ``node-agent status``."""

    def __init__(self, ctx: AgentContext, observations: ApplyObservations) -> None:
        self.ctx = ctx
        self.observations = observations
        self.started = time.monotonic()
        self.loop_lag = 0.0

    async def measure_loop(self, interval: float = 1.0) -> None:
        """Keep :attr:`loop_lag` current: how late a 1 s sleep wakes up."""
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
        osc = _controller(self.ctx, "osc")
        failures = int(getattr(osc, "failures", 0))
        return max(0, failures - self.observations.failures_at_success)

    def converged(self) -> bool:
        applied, desired = applied_and_desired(self.ctx)
        return bool(applied) and applied == desired and self.ctx.state.pending() is None

    def ready(self) -> Verdict:
        """Node found, OSC watch synced once, lease fresh, no persistent OSC failure."""
        reasons: list[str] = []
        now = time.monotonic()
        marks = self.ctx.health.last_progress
        if not self.ctx.node_known.is_set():
            reasons.append(f"node {self.ctx.host_name.lower()} not found yet")
        elif now - marks.get("lease", self.started) > LEASE_STALE:
            reasons.append(f"lease not renewed for {now - marks.get('lease', self.started):.0f}s")
        if "osc-watch" not in marks:
            reasons.append(f"secret {self.ctx.secret_name} not listed yet")
        streak = self.failure_streak()
        if streak >= FAILURE_STREAK and not self.converged():
            reasons.append(f"OSC apply failed {streak} times in a row")
        return Verdict(not reasons, tuple(reasons))


def applied_and_desired(ctx: AgentContext) -> tuple[str, str | None]:
    """The applied checksum ('' if none) and the checksum of the Secret's ``osc.yaml`` as last
    seen by the watch (None if not seen)."""
    import base64
    import binascii
    import hashlib

    last = ctx.state.load_last_applied()
    applied = last.checksum if last is not None else ""
    osc = _controller(ctx, "osc")
    secret = getattr(osc, "latest_secret", None)
    desired: str | None = None
    if isinstance(secret, Mapping):
        data = (secret.get("data") or {}).get("osc.yaml")
        if isinstance(data, str):
            with contextlib.suppress(binascii.Error, ValueError):
                desired = hashlib.sha256(base64.b64decode(data, validate=True)).hexdigest()
    if desired is None and osc is not None:
        desired = getattr(osc, "desired_checksum", None)
    return applied, desired


def api_last_success(ctx: AgentContext) -> float | None:
    """Wall time of the latest progress mark that needs an answer from the API server."""
    marks = [
        ctx.health.last_progress[m] for m in API_SUCCESS_MARKS if m in ctx.health.last_progress
    ]
    return _mono_to_wall(max(marks)) if marks else None


# --- Prometheus text format --------------------------------------------------------------------


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


Sample = tuple[Mapping[str, str], float]


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

    def histogram(self, name: str, help_text: str, hist: Histogram) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} histogram")
        for bound, count in zip(hist.buckets, hist.counts, strict=True):
            self.lines.append(f'{name}_bucket{{le="{_number(bound)}"}} {count}')
        self.lines.append(f'{name}_bucket{{le="+Inf"}} {hist.count}')
        self.lines.append(f"{name}_sum {_number(hist.total)}")
        self.lines.append(f"{name}_count {hist.count}")

    def render(self) -> str:
        return "\n".join(self.lines) + "\n"


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    return "{" + inner + "}"


def render_metrics(ctx: AgentContext, probes: Probes) -> str:
    """Every metric of the agent, read from the controllers' own counters right now."""
    from node_agent.kube.watch import live_watches

    obs = probes.observations
    osc = _controller(ctx, "osc")
    lease = _controller(ctx, "lease")
    node = _controller(ctx, "node")
    lease_stats = getattr(lease, "stats", None)
    node_stats = getattr(node, "stats", None)
    out = MetricsText()
    out.one("node_agent_up", "gauge", "1 while the agent runs.", 1)
    out.metric(
        "node_agent_build_info",
        "gauge",
        "Version of the agent (always 1).",
        [({"version": __version__, "python": platform.python_version()}, 1)],
    )
    out.one(
        "node_agent_start_time_seconds",
        "gauge",
        "Start of the agent (Unix time).",
        ctx.health.started,
    )
    out.one(
        "node_agent_osc_applies_total",
        "counter",
        "OSCs applied successfully.",
        int(getattr(osc, "applies", 0)),
    )
    out.one(
        "node_agent_osc_apply_failures_total",
        "counter",
        "OSC reconciliations that failed (invalid OSC, API, systemd, secretRef, apply).",
        int(getattr(osc, "failures", 0)),
    )
    out.histogram(
        "node_agent_osc_apply_duration_seconds",
        "Duration of every apply run (full applies, resumes, drift repairs, failed ones).",
        obs.durations,
    )
    if obs.last is not None:
        out.one(
            "node_agent_last_apply_timestamp_seconds",
            "gauge",
            "When the last apply finished (Unix time).",
            obs.last.finished_at.timestamp(),
        )
        out.one(
            "node_agent_last_apply_success",
            "gauge",
            "1 if the last apply succeeded, else 0.",
            1 if obs.last.result == "succeeded" else 0,
        )
    applied, desired = applied_and_desired(ctx)
    out.one(
        "node_agent_osc_up_to_date",
        "gauge",
        "1 if the applied OSC is the one in the Secret, else 0.",
        1 if applied and applied == desired else 0,
    )
    annotation_restarts = len(getattr(node_stats, "restarts", ()))
    out.metric(
        "node_agent_unit_restarts_total",
        "counter",
        "Units restarted by the agent, by cause.",
        [({"source": "osc"}, obs.restarts), ({"source": "annotation"}, annotation_restarts)],
    )
    out.one(
        "node_agent_lease_renewals_total",
        "counter",
        "Heartbeat Lease renewals.",
        int(getattr(lease_stats, "renewals", 0)),
    )
    out.one(
        "node_agent_lease_renew_failures_total",
        "counter",
        "Heartbeat Lease renewals that failed.",
        int(getattr(lease_stats, "failures", 0)),
    )
    reconnects: dict[str, int] = {}
    relists: dict[str, int] = {}
    for watch in live_watches():
        reconnects[watch.kind] = reconnects.get(watch.kind, 0) + watch.stats.reconnects
        relists[watch.kind] = relists.get(watch.kind, 0) + watch.stats.relists
    out.metric(
        "node_agent_watch_reconnects_total",
        "counter",
        "Watches re-opened after an error, by watched kind.",
        [({"resource": k}, v) for k, v in sorted(reconnects.items())],
    )
    out.metric(
        "node_agent_watch_relists_total",
        "counter",
        "Re-lists after an expired resourceVersion (410 Gone), by watched kind.",
        [({"resource": k}, v) for k, v in sorted(relists.items())],
    )
    stats = getattr(ctx.kube, "stats", None)
    out.one(
        "node_agent_api_requests_total",
        "counter",
        "Requests sent by the agent's main API client (the Lease has its own, see lease_*).",
        int(getattr(stats, "requests", 0)),
    )
    out.one(
        "node_agent_api_request_errors_total",
        "counter",
        "Main API client requests that timed out or lost their connection.",
        int(getattr(stats, "timeouts", 0)) + int(getattr(stats, "transport_errors", 0)),
    )
    out.one("node_agent_ready", "gauge", "1 if /readyz passes, else 0.", probes.ready().ok)
    return out.render()


# --- a minimal HTTP/1.1 server -------------------------------------------------------------------

Handler = Callable[[], Awaitable[tuple[int, str, str]]]
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}
_REASONS[500] = "Internal Server Error"
_REASONS[503] = "Service Unavailable"


class HttpEndpoint:
    """GET/HEAD only, one request per connection, bounded reads; enough for probes and scrapes."""

    def __init__(self, name: str, routes: Mapping[str, Handler]) -> None:
        self.name = name
        self.routes = dict(routes)
        self._server: asyncio.Server | None = None

    async def start(self, bind_address: str, port: int) -> None:
        host = bind_address or None  # '' = every address, as upstream
        self._server = await asyncio.start_server(self._handle, host=host, port=port)

    @property
    def port(self) -> int:
        """The bound port (useful after binding port 0)."""
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def address(self) -> str:
        """``host:port`` of the first bound socket (IPv6 hosts in brackets)."""
        assert self._server is not None
        host = str(self._server.sockets[0].getsockname()[0])
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            status, ctype, body, method = await self._answer(head)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            status, ctype, body, method = 400, "text/plain", "bad request\n", "GET"
        except ConnectionError:
            writer.close()
            return
        except Exception as exc:  # a bug in a handler must not kill the server
            log.warning("http handler failed", endpoint=self.name, error=str(exc))
            status, ctype, body, method = 500, "text/plain", "internal error\n", "GET"
        data = body.encode()
        header = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            f"Content-Type: {ctype}\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        try:
            writer.write(header if method == "HEAD" else header + data)
            async with asyncio.timeout(REQUEST_TIMEOUT):
                await writer.drain()
        except (ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()

    async def _answer(self, head: bytes) -> tuple[int, str, str, str]:
        if len(head) > MAX_HEADER_BYTES:
            return 400, "text/plain", "request too large\n", "GET"
        parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
        if len(parts) != 3:
            return 400, "text/plain", "bad request\n", "GET"
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", "method not allowed\n", "GET"
        handler = self.routes.get(target)
        if handler is None:
            return 404, "text/plain", "not found\n", method
        status, ctype, body = await handler()
        return status, ctype, body, method


# --- wiring ------------------------------------------------------------------------------------


class Observability:
    """Starts and stops the health, metrics and status servers of one agent.

    A server that cannot bind (port taken, socket directory not writable) is logged and skipped:
    the agent's job on the node matters more than its reporting.
    """

    def __init__(self, ctx: AgentContext, observations: ApplyObservations) -> None:
        self.ctx = ctx
        self.observations = observations
        osc = _controller(ctx, "osc")
        observations.failure_count = lambda: int(getattr(osc, "failures", 0))
        self.probes = Probes(ctx, observations)
        self.health = HttpEndpoint(
            "health", {"/healthz": self._healthz, "/readyz": self._readyz, "/livez": self._healthz}
        )
        self.metrics = HttpEndpoint("metrics", {"/metrics": self._metrics})
        self._ticker: asyncio.Task[None] | None = None
        self._status: Any = None
        self._started: list[HttpEndpoint] = []

    async def start(self) -> None:
        from node_agent.status import StatusServer

        server = self.ctx.config.server
        for endpoint, conf in ((self.health, server.health_probes), (self.metrics, server.metrics)):
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
        status = StatusServer(self.ctx, self.probes, endpoints=self.endpoints)
        try:
            await status.start()
        except OSError as exc:
            log.error("status socket not started", path=str(status.path), error=str(exc))
        else:
            self._status = status
        self._ticker = asyncio.create_task(self.probes.measure_loop(), name="loop-lag")

    def endpoints(self) -> dict[str, str | None]:
        """Where the servers listen (``host:port``; None if not started), for status and tests."""
        out: dict[str, str | None] = {"health": None, "metrics": None}
        for endpoint in self._started:
            out[endpoint.name] = endpoint.address
        return out

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        for endpoint in self._started:
            await endpoint.close()
        if self._status is not None:
            await self._status.close()

    async def _healthz(self) -> tuple[int, str, str]:
        verdict = self.probes.live()
        return _probe_answer(verdict)

    async def _readyz(self) -> tuple[int, str, str]:
        return _probe_answer(self.probes.ready())

    async def _metrics(self) -> tuple[int, str, str]:
        text = render_metrics(self.ctx, self.probes)
        return 200, "text/plain; version=0.0.4; charset=utf-8", text


def _probe_answer(verdict: Verdict) -> tuple[int, str, str]:
    if verdict.ok:
        return 200, "text/plain", "ok\n"
    return 503, "text/plain", "".join(f"{r}\n" for r in verdict.reasons)
