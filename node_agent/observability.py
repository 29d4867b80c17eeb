"""Health probes (``/healthz``, ``/readyz``) and Prometheus metrics (``/metrics``) over plain HTTP.

Why hand-written: two tiny GET-only servers on ``asyncio.start_server`` and the Prometheus text
format cost a few hundred lines, while an HTTP framework or ``prometheus_client`` would be one
more runtime dependency (and more RSS) on every node. Both bind where Gardener's config says
(``server.healthProbes`` / ``server.metrics``: ``bindAddress`` '' = every address, like upstream's
``net.JoinHostPort("", port)``; port 0 picks a free port, see :attr:`HttpEndpoint.port`).
Listening on every address means anyone who reaches the node may connect, so each endpoint
bounds what a client can hold: :data:`MAX_CONNECTIONS` connections, a request head within
:data:`HEAD_TIMEOUT` and :data:`MAX_HEADER_BYTES`, the exchange within :data:`EXCHANGE_TIMEOUT`,
one request per connection.

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
from node_agent.errors import NodeAgentError
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
#: Connections one endpoint holds at once (the kubelet's probes and a scrape need one or two).
MAX_CONNECTIONS = 16
#: Connections the kernel queues until the agent accepts them (they hold no agent descriptor).
ACCEPT_BACKLOG = 64
#: Deadlines for a request head and for a whole exchange (head, answer, sending it).
HEAD_TIMEOUT = 3.0
EXCHANGE_TIMEOUT = 10.0
#: A request head larger than this is answered 431 (probes and scrapes send a few hundred bytes).
MAX_HEADER_BYTES = 8 * 1024
#: At most one warning about connections closed at the limit per this many seconds.
REFUSED_WARNING_INTERVAL = 60.0


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
    failed_items: int = 0  # items of the last apply that did not reach their state
    #: ``osc.failures`` when the last apply succeeded: the failure streak starts there.
    failures_at_success: int = 0
    #: Reads the OSC controller's failure counter (set once the controller exists).
    failure_count: Callable[[], int] = field(default=lambda: 0, repr=False)

    def observe(self, record: ApplyRecord) -> None:
        self.durations.observe(record.duration_seconds)
        self.results[record.result] = self.results.get(record.result, 0) + 1
        self.restarts += len(record.restarted_units)
        self.last = record
        self.failed_items = len(record.failures)
        if record.result == "succeeded":
            self.failures_at_success = self.failure_count()


class ObservedStateStore(StateStore):
    """A StateStore that also hands every saved ApplyRecord to ``on_status`` (for metrics)."""

    def __init__(self, fs: HostFS, on_status: Callable[[ApplyRecord], None]) -> None:
        super().__init__(fs)
        self._on_status = on_status

    def status_saved(self, record: ApplyRecord) -> None:
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
        """Node found (and not deleted since), OSC watch synced once, lease fresh, no persistent
        OSC failure."""
        reasons: list[str] = []
        now = time.monotonic()
        marks = self.ctx.health.last_progress
        missing = getattr(_controller(self.ctx, "node"), "missing", None)
        if not self.ctx.node_known.is_set():
            reasons.append(f"node {self.ctx.host_name.lower()} not found yet")
        elif missing:
            reasons.append(str(missing))
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

    applied = ctx.state.applied_checksum()  # in memory: no read, no hashing per request
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


def render_metrics(
    ctx: AgentContext, probes: Probes, endpoints: Iterable[HttpEndpoint] = ()
) -> str:
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
    out.one(
        "node_agent_apply_failed_items",
        "gauge",
        "Items (files, units, unit commands, ...) of the last apply that failed.",
        obs.failed_items,
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
    served = list(endpoints)
    out.metric(
        "node_agent_http_connections_refused_total",
        "counter",
        "Connections to the probe and metrics ports closed unserved at the connection limit.",
        [({"endpoint": e.name}, e.stats.refused) for e in served],
    )
    out.metric(
        "node_agent_http_connections_timed_out_total",
        "counter",
        "Connections to the probe and metrics ports closed at the request deadline.",
        [({"endpoint": e.name}, e.stats.timed_out) for e in served],
    )
    out.one("node_agent_ready", "gauge", "1 if /readyz passes, else 0.", probes.ready().ok)
    return out.render()


# --- a minimal HTTP/1.1 server -------------------------------------------------------------------

Handler = Callable[[], Awaitable[tuple[int, str, str]]]
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}
_REASONS[431] = "Request Header Fields Too Large"
_REASONS[500] = "Internal Server Error"
_REASONS[503] = "Service Unavailable"


@dataclass
class EndpointStats:
    """What an endpoint did with its connections (exported as metrics, never logged one by one)."""

    accepted: int = 0
    #: closed unserved at the connection limit: the oldest idle one, or the new one
    refused: int = 0
    #: closed because the request head or the whole exchange missed its deadline
    timed_out: int = 0


class HttpEndpoint:
    """GET/HEAD only, one request per connection, bounded in every way a client could abuse.

    At most ``max_connections`` connections are held at once. When a new one arrives at the
    limit, the oldest connection still sending its request head is closed to make room (an idle
    client gives way to a probe); if every slot is serving a request, the new one is closed. A
    request head must arrive within ``head_timeout`` and be at most :data:`MAX_HEADER_BYTES`; the
    whole exchange ends within ``exchange_timeout``. So an idle or slow flood costs at most
    ``max_connections`` descriptors and never starves the kubelet's probes.
    """

    def __init__(
        self,
        name: str,
        routes: Mapping[str, Handler],
        *,
        max_connections: int = MAX_CONNECTIONS,
        head_timeout: float = HEAD_TIMEOUT,
        exchange_timeout: float = EXCHANGE_TIMEOUT,
    ) -> None:
        self.name = name
        self.routes = dict(routes)
        self.max_connections = max_connections
        self.head_timeout = head_timeout
        self.exchange_timeout = exchange_timeout
        self.stats = EndpointStats()
        self._server: asyncio.Server | None = None
        #: Open connections, oldest first; True while the request head is still being read.
        self._connections: dict[asyncio.StreamWriter, bool] = {}
        self._warned_at: float | None = None
        self._refused_at_warning = 0

    async def start(self, bind_address: str, port: int) -> None:
        host = bind_address or None  # '' = every address, as upstream
        self._server = await asyncio.start_server(
            self._handle, host=host, port=port, limit=MAX_HEADER_BYTES, backlog=ACCEPT_BACKLOG
        )

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

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._connections):
                writer.transport.abort()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await self._server.wait_closed()
            self._server = None

    def _make_room(self) -> bool:
        """At the limit: close the oldest connection still reading its head; False if none."""
        for writer, reading in self._connections.items():
            if reading:
                del self._connections[writer]
                writer.transport.abort()
                self._refused()
                return True
        return False

    def _refused(self) -> None:
        """Count a connection closed at the limit; warn at most once per interval."""
        self.stats.refused += 1
        now = time.monotonic()
        if self._warned_at is None or now - self._warned_at >= REFUSED_WARNING_INTERVAL:
            log.warning(
                "connections closed at the connection limit",
                endpoint=self.name,
                limit=self.max_connections,
                closed=self.stats.refused - self._refused_at_warning,
                next_warning_in_seconds=REFUSED_WARNING_INTERVAL,
            )
            self._warned_at = now
            self._refused_at_warning = self.stats.refused

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.accepted += 1
        if len(self._connections) >= self.max_connections and not self._make_room():
            writer.transport.abort()
            self._refused()
            return
        self._connections[writer] = True
        try:
            async with asyncio.timeout(self.exchange_timeout):
                await self._exchange(reader, writer)
                writer.close()
                await writer.wait_closed()
        except TimeoutError:
            self.stats.timed_out += 1
        except OSError:
            pass  # the client went away
        except Exception as exc:  # never let one connection hurt the agent
            log.warning("http connection failed", endpoint=self.name, error=str(exc))
        finally:
            self._connections.pop(writer, None)
            writer.transport.abort()  # frees the descriptor now (a no-op once closed)

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answer: tuple[int, str, str, str] | None = None
        try:
            async with asyncio.timeout(self.head_timeout):
                head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            head = b""
            answer = (431, "text/plain", "request head too large\n", "GET")
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                return  # closed without a word (or made room for another)
            answer = (400, "text/plain", "bad request\n", "GET")
        if writer not in self._connections:
            return  # closed to make room for another connection
        self._connections[writer] = False  # serving: no longer idle
        if answer is None:
            try:
                answer = await self._answer(head)
            except Exception as exc:  # a bug in a handler must not kill the server
                log.warning("http handler failed", endpoint=self.name, error=str(exc))
                answer = (500, "text/plain", "internal error\n", "GET")
        status, ctype, body, method = answer
        data = body.encode()
        header = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            f"Content-Type: {ctype}\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        writer.write(header if method == "HEAD" else header + data)
        await writer.drain()

    async def _answer(self, head: bytes) -> tuple[int, str, str, str]:
        if len(head) > MAX_HEADER_BYTES:
            return 431, "text/plain", "request head too large\n", "GET"
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
        except (OSError, NodeAgentError) as exc:
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
        text = render_metrics(self.ctx, self.probes, self._started)
        return 200, "text/plain; version=0.0.4; charset=utf-8", text


def _probe_answer(verdict: Verdict) -> tuple[int, str, str]:
    if verdict.ok:
        return 200, "text/plain", "ok\n"
    return 503, "text/plain", "".join(f"{r}\n" for r in verdict.reasons)
