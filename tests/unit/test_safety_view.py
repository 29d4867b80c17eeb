"""The health sections of the read side: the SystemdUnitsReady check, the kubelet/containerd
checks, the health gate and the restart-storm guard, in ``node-agent status`` (document and text)
and in the metrics."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from node_agent.apply.restart_guard import RestartGuard
from node_agent.commands import status
from node_agent.config import HealthGateConfig
from node_agent.controllers.healthcheck import ComponentHealth, HealthCheckView
from node_agent.controllers.osc.health_gate import GateView, HealthGate, Rollback
from node_agent.controllers.osc.rollout import RolloutView
from node_agent.controllers.unitcheck import UnitCheckView
from node_agent.kube import report
from node_agent.observe import status_document, unix_socket
from node_agent.observe.metrics import AgentMetrics
from tests.unit.fakes import FakeSystemd
from tests.unit.test_metrics import _samples
from tests.unit.test_status import make_ctx, read

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)


class Fixed:
    def __init__(self, view: object) -> None:
        self._view = view

    def view(self) -> object:
        return self._view


def _gate(tmp_path: Path) -> HealthGate:
    gate = HealthGate(
        FakeSystemd(),
        make_ctx(tmp_path).state,
        HealthGateConfig(),
        agent_unit="a",
        strict=lambda: ("holdFailingUnits",),
    )
    gate.rollbacks = 1
    gate.last_rollback = Rollback("b" * 64, "a" * 64, "web.service", "failed after the apply", NOW)
    return gate


def test_health_sections_in_the_document_the_text_and_the_metrics(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path)
    guard = RestartGuard(max_restarts=1, window=600.0, hold=lambda: True)
    guard.record("x.service", ok=False, error="restart x.service: failed")
    sources = ctx.sources
    sources.unitcheck = Fixed(  # type: ignore[assignment]
        UnitCheckView(
            condition=report.units_condition(("x.service: failed",), ()),
            checked_at=NOW,
            unhealthy=("x.service: failed",),
            units=3,
            reported=True,
        )
    )
    sources.healthcheck = Fixed(  # type: ignore[assignment]
        HealthCheckView(
            enabled=True,
            components=(
                ComponentHealth("kubelet", "kubelet.service", True, False, NOW, "500", 1, NOW, NOW),
                ComponentHealth(
                    "containerd", "containerd.service", True, True, None, None, 0, None, NOW
                ),
            ),
            ready_toggles=0,
            reboot_suggested=False,
        )
    )
    sources.gate, sources.guard = _gate(tmp_path), guard

    view = read(ctx)()
    doc = {key: section(view) for key, section in unix_socket.SECTIONS.items()}
    assert doc["units_check"]["condition"] == {
        "status": "False",
        "reason": "UnhealthyUnits",
        "message": "x.service: failed",
    }
    assert doc["units_check"]["checked_at"] == "2026-11-22T12:00:00Z"
    assert doc["health_checks"]["components"][0]["failing_since"] == "2026-11-22T12:00:00Z"
    gate = doc["health_gate"]
    assert gate["enabled"] is True
    assert gate["last_rollback"]["unit"] == "web.service"
    assert gate["held_units"][0]["unit"] == "x.service"
    assert gate["held_units"][0]["describe"].startswith("x.service: failed after 1 restarts")

    full = status_document.skeleton() | doc
    text = status.render(full, now=NOW.timestamp() + 60)
    assert (
        "SystemdUnitsReady     False (UnhealthyUnits)" in text or "False (UnhealthyUnits)" in text
    )
    assert "x.service: failed" in text
    assert "UNHEALTHY since" in text
    assert "restarted 1 times by node-agent" in text
    assert "Health gate" in text
    assert "web.service: failed after the apply" in text
    assert "Held unit:    x.service" in text
    assert "holdFailingUnits (node-agent-strict.yaml)" in text  # the operator's strictness
    assert gate["strict"] == ["holdFailingUnits"]

    samples = _samples(AgentMetrics(read(ctx)).render())
    assert samples["node_agent_systemd_units_ready"] == 0
    assert samples["node_agent_systemd_units_unhealthy"] == 1
    assert samples['node_agent_component_healthy{component="kubelet"}'] == 0
    assert samples['node_agent_component_healthy{component="containerd"}'] == 1
    assert samples['node_agent_component_restarts_total{component="kubelet"}'] == 1
    assert samples["node_agent_osc_rollbacks_total"] == 1
    assert samples["node_agent_osc_quarantined"] == 0
    assert samples["node_agent_units_restarts_suspended"] == 1


def test_health_sections_are_null_before_the_parts_exist(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path)
    view = read(ctx)()
    assert unix_socket.units_check_section(view) is None
    assert unix_socket.health_gate_section(view) is None
    text = status.render(status_document.skeleton())
    assert "Health gate" not in text
    samples = _samples(AgentMetrics(read(ctx)).render())
    assert samples["node_agent_units_restarts_suspended"] == 0
    assert "node_agent_osc_rollbacks_total" not in samples


def test_gate_view_while_watching(tmp_path: Path) -> None:
    view = GateView(True, 30.0, "c" * 64, ("web.service",), None, None, 0)
    doc = status_document.skeleton()
    doc["health_gate"] = {**unix_socket._jsonable(view), "held_units": []}
    text = status.render(doc, now=(NOW + timedelta(seconds=5)).timestamp())
    assert "watching web.service after cccccccccccc" in text


def test_rollout_section_in_the_document_the_text_and_the_metrics(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path)
    ctx.sources.rollout = Fixed(  # type: ignore[assignment]
        RolloutView(
            pacing="at most 2 at once, 1 canary, soak 10m, breaker at 1",
            state="waiting",
            reason="CircuitBreakerOpen",
            message="1 node failed OSC bbbbbbbbbbbb",
            checksum="b" * 64,
            holders=("node-b",),
            failures=1,
            breaker_open=True,
            since=NOW.timestamp(),
            waits=4,
            conflicts=(("join", 2), ("result", 1)),
        )
    )
    view = read(ctx)()
    doc = status_document.skeleton() | {k: s(view) for k, s in unix_socket.SECTIONS.items()}
    assert doc["rollout"]["since"] == "2026-11-22T12:00:00Z"
    assert doc["rollout"]["holders"] == ["node-b"]
    text = status.render(doc, now=NOW.timestamp() + 30)
    assert "Rollout:      at most 2 at once, 1 canary, soak 10m, breaker at 1: waiting" in text
    assert "CircuitBreakerOpen since" in text
    assert "breaker:    OPEN after 1 failed nodes" in text
    samples = _samples(AgentMetrics(read(ctx)).render())
    assert samples["node_agent_rollout_waiting"] == 1
    assert samples["node_agent_rollout_breaker_open"] == 1
    assert samples["node_agent_rollout_waits_total"] == 4
    assert samples['node_agent_rollout_lease_conflicts_total{write="join"}'] == 2
    assert samples['node_agent_rollout_lease_conflicts_total{write="result"}'] == 1
