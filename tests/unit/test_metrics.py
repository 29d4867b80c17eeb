"""Metrics in the Prometheus text format (pulled from the agent's view), the health/readiness
rules, and the probe and metrics HTTP server."""

from __future__ import annotations

import asyncio
import gc
import socket
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from node_agent.config import ServerConfiguration
from node_agent.host.documents import ApplyRecord, ItemFailure
from node_agent.host.fs import HostFS
from node_agent.kube.watch import list_watch
from node_agent.observe import unix_socket
from node_agent.observe.http_ports import MAX_HEADER_BYTES, HttpEndpoint
from node_agent.observe.metrics import AgentMetrics
from node_agent.observe.observations import ApplyObservations, ObservedStateStore
from node_agent.observe.probes import FAILURE_STREAK, Probes
from node_agent.observe.readside import Observability
from node_agent.observe.view import EndpointView
from tests.unit.fakes import until
from tests.unit.test_status import FakeLease, FakeNode, FakeOSC, ReadCtx, make_ctx, osc_yaml, read


def render_metrics(
    ctx: ReadCtx,
    observations: ApplyObservations | None = None,
    endpoints: tuple[EndpointView, ...] = (),
) -> str:
    """One scrape of the agent behind ``ctx``."""
    if endpoints:
        ctx.sources.endpoints = lambda: endpoints
    return AgentMetrics(read(ctx, observations)).render()


def _osc(ctx: ReadCtx) -> FakeOSC:
    osc = ctx.sources.osc
    assert isinstance(osc, FakeOSC)
    return osc


def _record(result: str = "succeeded", seconds: float = 0.3, restarted: int = 2) -> ApplyRecord:
    now = datetime.now(UTC)
    return ApplyRecord(
        osc_checksum="a" * 64,
        started_at=now - timedelta(seconds=seconds),
        finished_at=now,
        duration_seconds=seconds,
        result=result,  # type: ignore[arg-type]
        restarted_units=tuple(f"u{i}.service" for i in range(restarted)),
        error="boom" if result == "failed" else None,
    )


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_every_saved_apply_record_is_observed(tmp_path: Path) -> None:
    obs = ApplyObservations()
    store = ObservedStateStore(HostFS(tmp_path), obs.observe)
    store.save_status(_record(seconds=0.3))
    store.save_status(_record("failed", seconds=7.0, restarted=0))
    assert store.load_status() is not None  # still persisted
    assert obs.durations.count == 2
    assert obs.durations.total == pytest.approx(7.3)
    assert obs.results == {"succeeded": 1, "failed": 1}
    assert obs.restarts == 2
    assert obs.last is not None
    assert obs.last.result == "failed"


def test_render_metrics_text_format(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path)
    osc = _osc(ctx)
    osc.applies, osc.failures = 3, 1
    lease, node = ctx.sources.lease, ctx.sources.node
    assert isinstance(lease, FakeLease)
    assert isinstance(node, FakeNode)
    lease.stats.renewals = 12
    lease.stats.failures = 2
    node.stats.restarts.extend(["x.service"])
    obs = ApplyObservations()
    obs.observe(_record(seconds=0.3))
    obs.observe(_record(seconds=45.0, restarted=1))
    text = render_metrics(ctx, obs)
    samples = _samples(text)
    assert text.endswith("\n")
    assert "# TYPE node_agent_osc_apply_duration_seconds histogram" in text
    assert samples["node_agent_up"] == 1
    assert samples["node_agent_osc_applies_total"] == 3
    assert samples["node_agent_osc_apply_failures_total"] == 1
    assert samples['node_agent_osc_apply_duration_seconds_bucket{le="0.25"}'] == 0
    assert samples['node_agent_osc_apply_duration_seconds_bucket{le="0.5"}'] == 1
    assert samples['node_agent_osc_apply_duration_seconds_bucket{le="60"}'] == 2
    assert samples['node_agent_osc_apply_duration_seconds_bucket{le="+Inf"}'] == 2
    assert samples["node_agent_osc_apply_duration_seconds_count"] == 2
    assert samples["node_agent_osc_apply_duration_seconds_sum"] == pytest.approx(45.3)
    assert samples['node_agent_unit_restarts_total{source="osc"}'] == 3
    assert samples['node_agent_unit_restarts_total{source="annotation"}'] == 1
    assert samples["node_agent_lease_renewals_total"] == 12
    assert samples["node_agent_lease_renew_failures_total"] == 2
    assert samples["node_agent_api_requests_total"] == 7
    assert samples["node_agent_api_request_errors_total"] == 1
    assert samples["node_agent_last_apply_success"] == 1
    assert samples["node_agent_last_apply_timestamp_seconds"] == pytest.approx(time.time(), abs=5)
    assert samples["node_agent_ready"] == 0  # node not found yet
    (build,) = (k for k in samples if k.startswith("node_agent_build_info{"))
    assert 'version="' in build
    assert 'python="' in build
    # every sample belongs to a declared family
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    for key in samples:
        name = key.split("{")[0]
        base = name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
        assert name in families or base in families, key


async def test_watch_counters_are_summed_by_kind(tmp_path: Path) -> None:
    class Res:
        def ref(self, verb: str, name: str | None = None) -> object:
            from node_agent.kube.api_errors import ObjectRef

            return ObjectRef(verb, "Secret", "kube-system", name)

    ctx = make_ctx(tmp_path)
    registry = ctx.sources.watches
    watches = [
        list_watch(Res(), field_selector=f"metadata.name=s{i}", registry=registry)  # type: ignore[arg-type]
        for i in range(2)
    ]
    list_watch(Res(), field_selector="metadata.name=other")  # type: ignore[arg-type]  # not the agent's
    watches[0].stats.reconnects, watches[1].stats.reconnects = 2, 3
    watches[1].stats.relists = 1
    samples = _samples(render_metrics(ctx))
    assert samples['node_agent_watch_reconnects_total{resource="Secret"}'] == 5
    assert samples['node_agent_watch_relists_total{resource="Secret"}'] == 1
    del watches
    gc.collect()
    samples = _samples(render_metrics(ctx))
    assert 'node_agent_watch_reconnects_total{resource="Secret"}' not in samples


def test_label_values_are_escaped(tmp_path: Path) -> None:
    odd = EndpointView('a"b\\c\nd', "127.0.0.1:1", refused=2, serves=("health",))
    text = render_metrics(make_ctx(tmp_path), endpoints=(odd,))
    assert 'node_agent_http_connections_refused_total{endpoint="a\\"b\\\\c\\nd"} 2.0' in text


def test_readiness_rules(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path)
    obs = ApplyObservations()
    osc = _osc(ctx)
    obs.failure_count = lambda: osc.failures
    probes = Probes(ctx, ctx.sources, obs)
    verdict = probes.ready()
    assert not verdict.ok
    assert verdict.reasons == ("node node-a not found yet", f"secret {_secret()} not listed yet")
    ctx.node_known.set()
    ctx.health.progress("lease")
    ctx.health.progress("osc-watch")
    assert probes.ready().ok
    # failing again and again while the node is not converged: not ready
    osc.failures = FAILURE_STREAK
    assert probes.ready().reasons == (f"OSC apply failed {FAILURE_STREAK} times in a row",)
    # a successful apply ends the streak
    obs.observe(_record())
    assert probes.ready().ok
    # ... and so does being converged (the Secret went back to what is applied)
    osc.failures += FAILURE_STREAK
    raw = osc_yaml(["a.service"])
    last = ctx.state.save_last_applied(raw)
    osc.desired_checksum = last.checksum
    assert probes.ready().ok
    # a lease that was not renewed for longer than its duration
    ctx.health.last_progress["lease"] = time.monotonic() - 41
    assert probes.ready().reasons[0].startswith("lease not renewed for 41s")


def _secret() -> str:
    from tests.unit.test_status import SECRET

    return SECRET


def test_liveness_needs_the_lease_loop_and_a_responsive_event_loop(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path)
    probes = Probes(ctx, ctx.sources, ApplyObservations())
    assert probes.live().ok  # grace period from the start
    ctx.health.last_progress["lease-tick"] = time.monotonic() - 60
    assert not probes.live().ok
    assert "lease-tick" in probes.live().reasons[0]
    ctx.health.progress("lease-tick")
    probes.loop_lag = 6.0
    assert probes.live().reasons == ("event loop lagging 6.0s",)


async def _request(port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return data


def _code(answer: bytes) -> int:
    """The status code of an HTTP answer (aiohttp answers requests it cannot parse in 1.0)."""
    version, code = answer.split(b" ", 2)[:2]
    assert version in (b"HTTP/1.0", b"HTTP/1.1"), answer
    return int(code)


async def test_http_endpoint() -> None:
    async def ok() -> tuple[int, str, str]:
        return 200, "text/plain", "ok\n"

    async def broken() -> tuple[int, str, str]:
        raise RuntimeError("bug")

    endpoint = HttpEndpoint("test", {"/healthz": ok, "/broken": broken})
    await endpoint.start("127.0.0.1", 0)
    try:
        port = endpoint.port
        assert port > 0
        assert endpoint.address == f"127.0.0.1:{port}"
        got = await _request(port, b"GET /healthz?verbose HTTP/1.1\r\nHost: x\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"Content-Length: 3\r\n" in got
        assert got.endswith(b"\r\n\r\nok\n")
        head = await _request(port, b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert head.endswith(b"\r\n\r\n")
        assert (await _request(port, b"POST /healthz HTTP/1.1\r\nHost: x\r\n\r\n")).startswith(
            b"HTTP/1.1 405"
        )
        assert (await _request(port, b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")).startswith(
            b"HTTP/1.1 404"
        )
        assert _code(await _request(port, b"garbage\r\n\r\n")) == 400
        assert (await _request(port, b"GET /broken HTTP/1.1\r\nHost: x\r\n\r\n")).startswith(
            b"HTTP/1.1 500"
        )
        # the server survives all of that
        assert (await _request(port, b"GET /healthz HTTP/1.0\r\n\r\n")).endswith(b"ok\n")
    finally:
        await endpoint.close()


def test_failed_items_of_the_last_apply(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path)
    obs = ApplyObservations()
    assert _samples(render_metrics(ctx, obs))["node_agent_apply_failed_items"] == 0
    failures = (
        ItemFailure(kind="command", item="bad.service", error="start: exit code 1"),
        ItemFailure(
            kind="enable", item="gone.service", error="Unit file gone.service does not exist"
        ),
        ItemFailure(kind="file", item="/srv/ro/new", error="write: Read-only file system"),
    )
    obs.observe(_record("failed", restarted=1).model_copy(update={"failures": failures}))
    assert _samples(render_metrics(ctx, obs))["node_agent_apply_failed_items"] == 3
    obs.observe(_record())  # the next apply succeeded: nothing failed any more
    assert _samples(render_metrics(ctx, obs))["node_agent_apply_failed_items"] == 0


async def _idle(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def test_http_endpoint_bounds_connections_and_deadlines(tmp_path: Path) -> None:
    async def ok() -> tuple[int, str, str]:
        return 200, "text/plain", "ok\n"

    endpoint = HttpEndpoint("health", {"/healthz": ok}, max_connections=3, head_timeout=1.0)
    await endpoint.start("127.0.0.1", 0)
    idle = []
    try:
        with capture_logs() as logs:
            idle = [await _idle(endpoint.port) for _ in range(8)]
            await until(lambda: endpoint.stats.accepted >= 8)
            # idle connections over the limit go once their silence outlasts SILENT_GRACE
            await until(lambda: endpoint.stats.refused >= 5)
        warnings = [e for e in logs if e["log_level"] == "warning"]
        assert len(warnings) == 1  # one rate-limited warning, not one per connection
        assert warnings[0]["endpoint"] == "health"
        assert endpoint.open_connections == 3  # never more than the limit
        assert endpoint.stats.refused == 5  # the oldest idle ones made room
        # A probe still answers: it takes the slot of the oldest idle connection.
        got = await _request(endpoint.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"Connection: close\r\n" in got
        assert endpoint.stats.refused == 6
        # every idle connection is closed: at the limit or at the head deadline
        for reader, _ in idle:
            assert await asyncio.wait_for(reader.read(), 5) == b""
        assert endpoint.stats.timed_out == 2
        assert endpoint.open_connections == 0
        # a head over the cap is answered 431, not buffered without end
        big = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: " + b"a" * MAX_HEADER_BYTES + b"\r\n\r\n"
        assert _code(await _request(endpoint.port, big)) == 431
        samples = _samples(render_metrics(make_ctx(tmp_path), endpoints=(endpoint.view(),)))
        assert samples['node_agent_http_connections_refused_total{endpoint="health"}'] == 6
        assert samples['node_agent_http_connections_timed_out_total{endpoint="health"}'] == 2
    finally:
        for _, writer in idle:
            writer.close()
        await endpoint.close()


def _with_ports(ctx: ReadCtx, health: int, metrics: int) -> ReadCtx:
    server = ServerConfiguration.model_validate(
        {
            "healthProbes": {"bindAddress": "127.0.0.1", "port": health},
            "metrics": {"bindAddress": "127.0.0.1", "port": metrics},
        }
    )
    ctx.config = ctx.config.model_copy(update={"server": server})
    return ctx


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _get(address: str, path: str) -> tuple[int, bytes]:
    port = int(address.rsplit(":", 1)[1])
    answer = await _request(port, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return _code(answer), answer.partition(b"\r\n\r\n")[2]


async def test_the_probe_and_metrics_ports_of_an_agent(tmp_path: Path) -> None:
    ctx = _with_ports(make_ctx(tmp_path), _free_port(), _free_port())
    observability = Observability(ctx, ctx.sources, ApplyObservations())
    await observability.start()
    try:
        doc = await unix_socket.StatusServer(ctx, observability.read).document()
        health, metrics = doc["endpoints"]["health"], doc["endpoints"]["metrics"]
        assert health != metrics
        assert await _get(health, "/healthz") == (200, b"ok\n")
        code, reasons = await _get(health, "/readyz")
        assert (code, reasons) == (
            503,
            f"node node-a not found yet\nsecret {_secret()} not listed yet\n".encode(),
        )
        assert (await _get(health, "/metrics"))[0] == 404
        code, text = await _get(metrics, "/metrics")
        assert code == 200
        samples = _samples(text.decode())
        assert samples['node_agent_http_connections_refused_total{endpoint="health"}'] == 0
        assert samples['node_agent_http_connections_refused_total{endpoint="metrics"}'] == 0
        assert samples["node_agent_ready"] == 0
        assert (await _get(metrics, "/healthz"))[0] == 404
    finally:
        await observability.close()


async def test_the_same_port_for_probes_and_metrics_serves_both(tmp_path: Path) -> None:
    port = _free_port()
    ctx = _with_ports(make_ctx(tmp_path), port, port)
    observability = Observability(ctx, ctx.sources, ApplyObservations())
    await observability.start()
    try:
        doc = await unix_socket.StatusServer(ctx, observability.read).document()
        assert doc["endpoints"]["health"] == doc["endpoints"]["metrics"] == f"127.0.0.1:{port}"
        address = doc["endpoints"]["health"]
        assert await _get(address, "/healthz") == (200, b"ok\n")
        code, text = await _get(address, "/metrics")
        assert code == 200
        samples = _samples(text.decode())
        assert samples['node_agent_http_connections_refused_total{endpoint="health"}'] == 0
        assert not any('endpoint="metrics"' in key for key in samples)  # one endpoint, counted once
    finally:
        await observability.close()
    with socket.socket() as sock:  # closed: the port can be listened on again
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()


def test_lease_renewal_and_certificate_expiry_as_timestamps(tmp_path: Path) -> None:
    """The alerts need the last renewal and the certificate's end as times, not counters."""
    from node_agent.controllers.certificate import CertificateView

    ctx = make_ctx(tmp_path)
    assert "node_agent_certificate_expiry_timestamp_seconds" not in render_metrics(ctx)
    assert "node_agent_lease_last_renew_timestamp_seconds" not in render_metrics(ctx)
    lease = ctx.sources.lease
    assert isinstance(lease, FakeLease)
    lease.stats.last_renew_time = "2026-11-24T06:00:00.123456+00:00"

    class Cert:
        def view(self) -> CertificateView:
            return CertificateView(
                "ready", "CN=x", "2026-12-24T06:00:00Z", "2026-12-18T06:00:00Z", 0, None
            )

    ctx.sources.certificate = Cert()
    samples = _samples(render_metrics(ctx))
    assert samples["node_agent_lease_last_renew_timestamp_seconds"] == pytest.approx(
        datetime(2026, 11, 24, 6, 0, 0, 123456, UTC).timestamp()
    )
    assert samples["node_agent_certificate_expiry_timestamp_seconds"] == (
        datetime(2026, 12, 24, 6, 0, tzinfo=UTC).timestamp()
    )
