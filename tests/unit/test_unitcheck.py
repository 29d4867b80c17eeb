"""The systemd unit check: the verdict rules (pure) and when the controller writes the Node."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from node_agent.apply.restart_guard import RestartGuard
from node_agent.base.errors import KubeConflict, KubeForbidden, SystemdCallError
from node_agent.context import AgentContext
from node_agent.controllers.unitcheck import (
    RELEASE_AFTER,
    ExpectedUnit,
    UnitCheckController,
    came_up,
    check_units,
    expected_unit,
    expected_units,
    go_seconds,
    is_template,
)
from node_agent.kube import report
from node_agent.osc.applied import Applied, AppliedUnit
from node_agent.systemd import UnitState
from tests.unit.fakes import FakeKube, FakeSystemd, make_ctx

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
STUCK = timedelta(minutes=5)
OWN = "gardener-node-agent.service"


def state(
    name: str,
    active: str = "active",
    sub: str = "running",
    *,
    load: str = "loaded",
    changed: datetime | None = None,
    service_type: str = "simple",
    triggered_by: tuple[str, ...] = (),
    result: str | None = None,
    n_restarts: int | None = None,
) -> UnitState:
    usec = int(changed.timestamp() * 1_000_000) if changed is not None else 0
    return UnitState(
        name=name,
        id=name,
        load_state=load,
        active_state=active,
        sub_state=sub,
        unit_file_state="enabled",
        invocation_id="",
        fragment_path="",
        drop_in_paths=(),
        state_change_timestamp=usec,
        service_type=service_type,
        triggered_by=triggered_by,
        result=result,
        n_restarts=n_restarts,
    )


def run(
    u: ExpectedUnit | str, s: UnitState, *, restart_loops: bool = False
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    unit = ExpectedUnit(u, "running") if isinstance(u, str) else u
    verdict = check_units([unit], {unit.name: s}, NOW, STUCK, restart_loops=restart_loops)
    return verdict.unhealthy, verdict.progressing


# -- the rules, one case each ------------------------------------------------------------------


def test_active_running_unit_is_healthy() -> None:
    assert run("a.service", state("a.service")) == ((), ())


def test_failed_enabled_unit() -> None:
    assert run("a.service", state("a.service", "failed", "failed")) == (("a.service: failed",), ())


def test_failed_disabled_unit_is_not_unhealthy() -> None:
    unit = ExpectedUnit("a.service", "stopped", "disabled")
    assert run(unit, state("a.service", "failed", "failed")) == ((), ())


def test_activating_within_threshold_is_progressing() -> None:
    s = state("a.service", "activating", "start-pre", changed=NOW - timedelta(seconds=30.7))
    assert run("a.service", s) == ((), ("a.service: activating for 30s",))


def test_stuck_activating_beyond_threshold() -> None:
    s = state("a.service", "activating", "start", changed=NOW - timedelta(minutes=10))
    assert run("a.service", s) == (("a.service: stuck in activating for 10m0s",), ())


def test_stuck_exactly_at_threshold_and_deactivating() -> None:
    s = state("a.service", "deactivating", "stop-sigterm", changed=NOW - STUCK)
    assert run("a.service", s) == (("a.service: stuck in deactivating for 5m0s",), ())


def test_auto_restart_is_normal_operation() -> None:
    s = state("a.service", "activating", "auto-restart", changed=NOW - timedelta(hours=1))
    assert run("a.service", s) == ((), ())


def _loop(result: str, restarts: int) -> UnitState:
    return state("a.service", "activating", "auto-restart", result=result, n_restarts=restarts)


def test_auto_restart_after_failed_runs_is_healthy_by_default() -> None:
    """Upstream's verdict, which Gardener's shoot care reads: a service in a Restart= loop is
    healthy in the condition. The crash loop is node-agent's own diagnosis, beside it."""
    verdict = check_units(
        [ExpectedUnit("a.service", "running")], {"a.service": _loop("exit-code", 3)}, NOW, STUCK
    )
    assert verdict.unhealthy == ()
    assert verdict.condition.status == "True"
    assert verdict.condition.reason == report.REASON_UNITS_HEALTHY
    assert verdict.looping == ("a.service: failed (exit-code), restarting",)


def test_auto_restart_after_failed_runs_is_unhealthy_when_strict() -> None:
    """With the operator's ``restartLoops``: a start job that was done, then a run that failed,
    again and again (a Type=simple service whose binary is missing) is a crash loop."""

    def strict(u: ExpectedUnit | str, s: UnitState) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return run(u, s, restart_loops=True)

    assert strict("a.service", _loop("exit-code", 3)) == (
        ("a.service: failed (exit-code), restarting",),
        (),
    )
    assert strict("a.service", _loop("signal", 1))[0] == ("a.service: failed (signal), restarting",)
    assert strict("a.service", _loop("exit-code", 0)) == ((), ())  # failed once: first restart
    assert strict("a.service", _loop("success", 7)) == ((), ())  # exits 0, restarted: normal
    stopped = ExpectedUnit("a.service", "stopped", "stopped")
    assert strict(stopped, _loop("exit-code", 3)) == ((), ())
    assert strict(ExpectedUnit("a.service", "observed"), _loop("exit-code", 3)) == ((), ())


def test_came_up_means_running_for_a_while_since_it_was_held() -> None:
    held = NOW - timedelta(minutes=1)
    up = state("a.service", changed=NOW - RELEASE_AFTER)
    assert came_up(up, NOW, RELEASE_AFTER, held)
    blink = state("a.service", changed=NOW - timedelta(seconds=1))  # a unit in a restart loop
    assert not came_up(blink, NOW, RELEASE_AFTER, held)
    # running since before it was held: the health checks' restarts did not heal it
    ran = state("a.service", changed=held - timedelta(seconds=1))
    assert not came_up(ran, NOW, RELEASE_AFTER, held)
    waiting = state("a.service", "activating", "auto-restart", changed=NOW - timedelta(hours=1))
    assert not came_up(waiting, NOW, RELEASE_AFTER, NOW - timedelta(days=1))
    assert not came_up(state("a.service"), NOW, RELEASE_AFTER, held)  # no timestamp: not known
    assert not came_up(None, NOW, RELEASE_AFTER, held)


def test_inactive_enabled_unit() -> None:
    s = state("a.service", "inactive", "dead")
    assert run("a.service", s) == (("a.service: inactive but should be enabled",), ())


def test_inactive_oneshot_is_healthy() -> None:
    s = state("a.service", "inactive", "dead", service_type="oneshot")
    assert run("a.service", s) == ((), ())


def test_inactive_triggered_service_is_healthy() -> None:
    s = state("a.service", "inactive", "dead", triggered_by=("a.timer",))
    assert run("a.service", s) == ((), ())


def test_disabled_unit_active() -> None:
    unit = ExpectedUnit("a.service", "stopped", "disabled")
    assert run(unit, state("a.service")) == (("a.service: active but should be disabled",), ())


def test_stopped_unit_active_and_inactive() -> None:
    unit = ExpectedUnit("a.service", "stopped", "stopped")
    assert run(unit, state("a.service")) == (("a.service: active but should be stopped",), ())
    assert run(unit, state("a.service", "inactive", "dead")) == ((), ())


def test_stopped_unit_its_timer_starts_may_run() -> None:
    unit = ExpectedUnit("a.service", "stopped", "disabled")
    assert run(unit, state("a.service", triggered_by=("a.timer",))) == ((), ())


def test_not_loaded() -> None:
    missing = state("a.service", "inactive", "dead", load="not-found")
    assert run("a.service", missing) == (("a.service: not loaded",), ())
    masked = state("a.service", "inactive", "dead", load="masked")
    assert run("a.service", masked) == (("a.service: not loaded",), ())
    assert run(ExpectedUnit("a.service", "stopped", "stopped"), missing) == ((), ())
    assert run(ExpectedUnit("a.service", "observed"), missing) == ((), ())


def test_file_deleted_while_running_is_judged_by_its_state() -> None:
    s = state("a.service", "active", "running", load="not-found")
    assert run("a.service", s) == ((), ())


def test_observed_unit_only_checked_for_being_stuck() -> None:
    unit = ExpectedUnit("a.service", "observed")
    assert run(unit, state("a.service")) == ((), ())
    assert run(unit, state("a.service", "failed", "failed")) == ((), ())
    assert run(unit, state("a.service", "inactive", "dead")) == ((), ())
    stuck = state("a.service", "activating", "start", changed=NOW - timedelta(hours=2))
    assert run(unit, stuck) == (("a.service: stuck in activating for 2h0m0s",), ())


def test_messages_in_given_order_and_condition() -> None:
    expected = [ExpectedUnit(n, "running") for n in ("a.service", "b.service", "c.service")]
    states = {
        "a.service": state("a.service", "failed", "failed"),
        "b.service": state("b.service", "activating", "start", changed=NOW),
        "c.service": state("c.service", "inactive", "dead"),
    }
    verdict = check_units(expected, states, NOW, STUCK)
    condition = verdict.condition
    assert condition == report.Condition(
        "False", "UnhealthyUnits", "a.service: failed; c.service: inactive but should be enabled"
    )
    only_progressing = check_units(expected[1:2], states, NOW, STUCK).condition
    assert only_progressing == report.Condition(
        "True", "ProgressingUnits", "b.service: activating for 0s"
    )
    healthy = check_units([], states, NOW, STUCK).condition
    assert healthy == report.Condition(
        "True",
        "AllUnitsHealthy",
        "All systemd units from the operating system config are running as expected.",
    )


def test_unit_without_a_state_is_skipped() -> None:
    assert check_units([ExpectedUnit("a.service", "running")], {}, NOW, STUCK).condition.reason == (
        "AllUnitsHealthy"
    )


# -- expected state from the applied OSC -------------------------------------------------------


def unit(name: str, **fields: Any) -> AppliedUnit:
    return AppliedUnit(name=name, **fields)


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({"enable": True}, ("running", "")),
        ({"content": "[Service]\n"}, ("running", "")),
        ({"drop_ins": {"a.conf": "x"}}, ("running", "")),
        ({"command": "restart"}, ("running", "")),
        ({"command": "start"}, ("running", "")),
        ({}, ("observed", "")),
        ({"file_paths": ("/etc/x",)}, ("observed", "")),
        ({"enable": False, "content": "x"}, ("stopped", "disabled")),
        ({"enable": False, "command": "start"}, ("stopped", "disabled")),
        ({"command": "stop", "content": "x"}, ("stopped", "stopped")),
        ({"command": "stop", "enable": True}, ("stopped", "stopped")),
    ],
)
def test_expected_unit(fields: dict[str, Any], want: tuple[str, str]) -> None:
    got = expected_unit(unit("a.service", **fields), OWN)
    assert (got.want, got.stopped_by) == want


def test_own_unit_is_always_expected_running() -> None:
    assert expected_unit(unit(OWN, command="stop", enable=False), OWN).want == "running"
    assert expected_unit(unit(OWN), OWN).want == "running"


def test_expected_units_sorted_without_templates() -> None:
    applied = Applied(
        units={
            n: unit(n, enable=True) for n in ("b.service", "a.service", "t@.service", "t@1.service")
        }
    )
    assert [u.name for u in expected_units(applied, OWN)] == [
        "a.service",
        "b.service",
        "t@1.service",
    ]
    assert is_template("x@.timer")
    assert not is_template("x@y.timer")
    assert not is_template("x")


# -- duration wording --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.9, "0s"),
        (59.99, "59s"),
        (60, "1m0s"),
        (61, "1m1s"),
        (300, "5m0s"),
        (3600, "1h0m0s"),
        (3605, "1h0m5s"),
        (90061, "25h1m1s"),
        (-3, "0s"),
    ],
)
def test_go_seconds(seconds: float, text: str) -> None:
    assert go_seconds(timedelta(seconds=seconds)) == text


@given(st.integers(min_value=0, max_value=10**7))
def test_go_seconds_round_trips(total: int) -> None:
    from node_agent.base.durations import parse_duration

    assert parse_duration(go_seconds(timedelta(seconds=total))) == timedelta(seconds=total)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["running", "stopped", "observed"]),
            st.sampled_from(["active", "failed", "inactive", "activating", "reloading"]),
            st.sampled_from(["running", "dead", "failed", "start", "auto-restart"]),
            st.sampled_from(["loaded", "not-found"]),
            st.integers(min_value=0, max_value=1000),
        ),
        max_size=8,
    )
)
def test_verdict_properties(rows: list[tuple[str, str, str, str, int]]) -> None:
    """One message at most per unit, each naming it, in order; the condition's status is False
    exactly when something is unhealthy."""
    expected = []
    states = {}
    for i, (want, active, sub, load, age) in enumerate(rows):
        name = f"u{i:02d}.service"
        expected.append(ExpectedUnit(name, want, "disabled" if want == "stopped" else ""))  # type: ignore[arg-type]
        states[name] = state(name, active, sub, load=load, changed=NOW - timedelta(seconds=age))
    verdict = check_units(expected, states, NOW, STUCK)
    messages = [*verdict.unhealthy, *verdict.progressing]
    named = [m.split(":", 1)[0] for m in messages]
    assert len(set(named)) == len(named)
    assert named[: len(verdict.unhealthy)] == sorted(named[: len(verdict.unhealthy)])
    assert (verdict.condition.status == "False") == bool(verdict.unhealthy)
    for i, (want, active, *_rest) in enumerate(rows):
        if want == "observed" and active != "activating":
            assert f"u{i:02d}.service" not in named


# -- the controller: when the Node is written --------------------------------------------------


class _State:
    def __init__(self) -> None:
        self.checksum = "c1"

    async def applied_checksum_async(self) -> str:
        return self.checksum


class _Applier:
    def __init__(self, applied: Applied) -> None:
        self.applied = applied
        self.reads = 0

    def last_applied(self) -> Applied:
        self.reads += 1
        return self.applied


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> datetime:
        return self.now


def _controller(
    tmp_path: Path, units: dict[str, tuple[str, str]], applied: Applied, node: dict[str, Any]
) -> tuple[UnitCheckController, FakeKube, FakeSystemd, Clock, _State]:
    kube = FakeKube()
    kube.nodes().put(node)
    systemd = FakeSystemd(units)
    state_store = _State()
    ctx: AgentContext = make_ctx(
        tmp_path, kube=kube, systemd=systemd, state=state_store, agent_unit=OWN
    )
    clock = Clock()
    controller = UnitCheckController(ctx, _Applier(applied), clock=clock)  # type: ignore[arg-type]
    return controller, kube, systemd, clock, state_store


def _node(conditions: list[dict[str, Any]] | None = None, uid: str = "u1") -> dict[str, Any]:
    return {
        "metadata": {"name": "n1", "uid": uid, "resourceVersion": "7"},
        "status": {"conditions": conditions or []},
    }


KUBELET_READY = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "ok"}
APPLIED = Applied(units={"a.service": unit("a.service", enable=True)})


def _ours(kube: FakeKube) -> dict[str, Any]:
    conditions = kube.nodes().items["n1"]["status"]["conditions"]
    [entry] = [c for c in conditions if c["type"] == "SystemdUnitsReady"]
    return entry  # type: ignore[no-any-return]


async def test_writes_only_when_the_condition_changes(tmp_path: Path) -> None:
    c, kube, systemd, clock, _ = _controller(
        tmp_path, {"a.service": ("active", "running")}, APPLIED, _node([KUBELET_READY])
    )
    await c.check_once()
    [(_, name, patch)] = kube.writes("patch_node_status")
    assert name == "n1"
    assert patch["metadata"] == {"resourceVersion": "7"}
    conditions = kube.nodes().items["n1"]["status"]["conditions"]
    assert conditions[0] == KUBELET_READY  # the kubelet's conditions are kept
    assert _ours(kube)["reason"] == "AllUnitsHealthy"
    reads = len(kube.reads)
    for _ in range(3):
        clock.now += timedelta(minutes=1)
        await c.check_once()
    assert len(kube.writes("patch_node_status")) == 1
    assert len(kube.reads) == reads  # idle: no request at all
    view = c.view()
    assert view.reported
    assert view.checks == 4
    assert view.writes == 1
    assert view.units == 1

    systemd.units["a.service"] = ("failed", "failed")
    clock.now += timedelta(minutes=1)
    await c.check_once()
    assert len(kube.writes("patch_node_status")) == 2
    ours = _ours(kube)
    assert (ours["status"], ours["message"]) == ("False", "a.service: failed")
    assert ours["lastTransitionTime"] == "2026-01-01T12:04:00Z"
    assert c.view().unhealthy == ("a.service: failed",)


async def test_transition_time_kept_when_only_the_message_changes(tmp_path: Path) -> None:
    applied = Applied(units={n: unit(n, enable=True) for n in ("a.service", "b.service")})
    c, kube, systemd, clock, _ = _controller(
        tmp_path, {"a.service": ("failed", "failed"), "b.service": ACTIVE}, applied, _node()
    )
    await c.check_once()
    first = dict(_ours(kube))
    systemd.units["b.service"] = ("failed", "failed")
    clock.now += timedelta(minutes=1)
    await c.check_once()
    second = _ours(kube)
    assert second["message"] == "a.service: failed; b.service: failed"
    assert second["lastTransitionTime"] == first["lastTransitionTime"]
    assert second["lastHeartbeatTime"] == "2026-01-01T12:01:00Z"


ACTIVE = ("active", "running")


async def test_restart_with_identical_condition_writes_nothing(tmp_path: Path) -> None:
    entry = report.condition_entry(report.units_condition([], []), None, NOW - timedelta(hours=1))
    c, kube, *_ = _controller(tmp_path, {"a.service": ACTIVE}, APPLIED, _node([entry]))
    await c.check_once()
    assert kube.writes("patch_node_status") == []
    assert [r[0] for r in kube.reads] == ["get_node"]
    assert c.view().reported


async def test_recreated_node_is_read_again(tmp_path: Path) -> None:
    c, kube, _, clock, _ = _controller(tmp_path, {"a.service": ACTIVE}, APPLIED, _node())
    await c.check_once()
    kube.nodes().put(_node(uid="u2"))  # deleted and registered again: no condition
    c.ctx.node_uid = "u2"
    clock.now += timedelta(minutes=1)
    await c.check_once()
    assert len(kube.writes("patch_node_status")) == 2
    assert _ours(kube)["reason"] == "AllUnitsHealthy"


async def test_conflict_reads_again_and_retries(tmp_path: Path) -> None:
    c, kube, *_ = _controller(tmp_path, {"a.service": ACTIVE}, APPLIED, _node())
    kube.fail("patch_node_status", KubeConflict("changed", status=409))
    await c.check_once()
    assert [r[0] for r in kube.reads] == ["get_node", "get_node"]
    assert c.view().reported
    assert c.view().error is None


async def test_api_error_is_retried_next_period_and_recorded_once(tmp_path: Path) -> None:
    c, kube, _, clock, _ = _controller(tmp_path, {"a.service": ACTIVE}, APPLIED, _node())
    kube.fail("patch_node_status", KubeForbidden("forbidden", status=403), times=2)
    with capture_logs() as logs:
        await c.check_once()
        await c.check_once()
    assert not c.view().reported
    assert "forbidden" in (c.view().error or "")
    assert len([e for e in logs if e["log_level"] == "warning"]) == 1
    assert len([e for e in c.ctx.health.errors if e["source"] == "unitcheck"]) == 1
    clock.now += timedelta(minutes=1)
    await c.check_once()
    assert c.view().reported
    assert c.view().error is None
    assert _ours(kube)["reason"] == "AllUnitsHealthy"


async def test_nothing_applied_no_condition(tmp_path: Path) -> None:
    c, kube, _, _, state_store = _controller(tmp_path, {}, APPLIED, _node())
    state_store.checksum = ""
    await c.check_once()
    assert kube.writes("patch_node_status") == []
    assert kube.reads == []
    assert c.view().condition is None


async def test_expected_units_cached_by_checksum_and_poke(tmp_path: Path) -> None:
    c, _kube, _, _, state_store = _controller(tmp_path, {"a.service": ACTIVE}, APPLIED, _node())
    applier = c.applier
    assert isinstance(applier, _Applier)
    await c.check_once()
    await c.check_once()
    assert applier.reads == 1
    state_store.checksum = "c2"
    await c.check_once()
    assert applier.reads == 2
    c.poke()
    await c.check_once()
    assert applier.reads == 3


async def test_one_unreadable_unit_does_not_block_the_others(tmp_path: Path) -> None:
    applied = Applied(units={n: unit(n, enable=True) for n in ("a.service", "b.service")})
    c, kube, systemd, *_ = _controller(
        tmp_path, {"a.service": ("failed", "failed"), "b.service": ACTIVE}, applied, _node()
    )
    real = systemd.unit_states

    async def picky(names: Any, **kw: Any) -> dict[str, UnitState]:
        if "b.service" in names:
            raise SystemdCallError("bad name", op="unit_states", name="x", errno=22, units=())
        return await real(names, **kw)

    systemd.unit_states = picky  # type: ignore[method-assign]
    await c.check_once()
    assert _ours(kube)["message"] == "a.service: failed"


async def test_loop_checks_each_period_on_poke_and_after_a_new_apply(tmp_path: Path) -> None:
    c, kube, systemd, _, state_store = _controller(
        tmp_path, {"a.service": ACTIVE}, APPLIED, _node()
    )
    c.period = 3600.0  # only a poke or a new applied OSC may cause another check
    c.apply_poll = 0.01
    c.ctx.node_known.set()
    task = asyncio.create_task(c.run())
    try:
        await _until(lambda: c.view().checks == 1)
        systemd.units["a.service"] = ("failed", "failed")
        await asyncio.sleep(0.1)
        assert c.view().checks == 1  # not before the period
        c.poke()
        await _until(lambda: c.view().checks == 2)
        assert _ours(kube)["message"] == "a.service: failed"
        state_store.checksum = "c2"  # an apply finished
        await _until(lambda: c.view().checks == 3)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.005)):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("not reached in time")


def _warnings(kube: FakeKube) -> list[str]:
    return [e["message"] for e in kube.events("default").items.values() if e["type"] == "Warning"]


async def test_one_warning_event_when_a_unit_turns_unhealthy(tmp_path: Path) -> None:
    applied = Applied(units={n: unit(n, enable=True) for n in ("a.service", "b.service")})
    c, kube, systemd, *_ = _controller(
        tmp_path, {"a.service": ("failed", "failed"), "b.service": ACTIVE}, applied, _node()
    )
    await c.check_once()
    await c.check_once()
    assert _warnings(kube) == ["a.service: failed"]
    systemd.units["b.service"] = ("failed", "failed")
    await c.check_once()
    assert _warnings(kube) == ["a.service: failed", "b.service: failed"]
    systemd.units["a.service"] = ACTIVE  # recovered, then failed again: a new Warning
    await c.check_once()
    systemd.units["a.service"] = ("failed", "failed")
    await c.check_once()
    assert _warnings(kube) == ["a.service: failed", "b.service: failed", "a.service: failed"]


async def test_held_unit_released_once_it_runs_by_itself(tmp_path: Path) -> None:
    """The restart-storm guard holds a unit whose start jobs failed; systemd's Restart= brings
    it up later: the guard lets go (the apply's retry may start it again) and says so."""
    c, _, systemd, clock, _ = _controller(
        tmp_path, {"a.service": ("activating", "auto-restart")}, APPLIED, _node()
    )
    guard = RestartGuard(max_restarts=1, clock=lambda: 0.0, wall=lambda: 0.0)
    guard.record("a.service", ok=False, error="start a.service: failed")
    released: list[bool] = []
    c.guard, c.on_release = guard, lambda: released.append(True)
    await c.check_once()
    assert [h.unit for h in guard.view()] == ["a.service"]

    systemd.units["a.service"] = ACTIVE  # came up a second ago: maybe a blink of a loop
    systemd.props["a.service"] = {"state_change_timestamp": int(clock.now.timestamp() * 1e6)}
    await c.check_once()
    assert guard.held("a.service") is not None
    assert not released

    clock.now += RELEASE_AFTER
    await c.check_once()
    assert guard.view() == ()
    assert guard.allows("a.service")
    assert released == [True]
    await c.check_once()
    assert released == [True]  # once


async def test_held_unit_of_an_unfinished_first_apply_is_released(tmp_path: Path) -> None:
    """Nothing applied yet (the first apply keeps failing on the held unit): no condition, but
    the held unit is still looked at, and let go once it runs."""
    c, kube, systemd, clock, state_store = _controller(
        tmp_path, {"x.service": ACTIVE}, APPLIED, _node()
    )
    state_store.checksum = ""
    guard = RestartGuard(max_restarts=1, clock=lambda: 0.0, wall=lambda: 0.0)
    guard.record("x.service", ok=False)
    released: list[bool] = []
    c.guard, c.on_release = guard, lambda: released.append(True)
    usec = int((clock.now - RELEASE_AFTER).timestamp() * 1e6)
    systemd.props["x.service"] = {"state_change_timestamp": usec}
    await c.check_once()
    assert guard.view() == ()
    assert released == [True]
    assert kube.writes("patch_node_status") == []


async def test_unit_held_while_running_is_not_released(tmp_path: Path) -> None:
    """The health checks hold a unit that runs but stays unhealthy after their restarts: it
    keeps running, but it did not come up again, so the hold stays."""
    c, _, systemd, clock, _ = _controller(tmp_path, {"a.service": ACTIVE}, APPLIED, _node())
    usec = int((clock.now - timedelta(hours=1)).timestamp() * 1e6)  # up for an hour
    systemd.props["a.service"] = {"state_change_timestamp": usec}
    guard = RestartGuard(max_restarts=1, clock=lambda: 0.0, wall=clock.now.timestamp)
    guard.record("a.service", ok=False, error="kubelet is unhealthy")
    c.guard = guard
    for _ in range(3):
        clock.now += timedelta(minutes=1)
        await c.check_once()
    assert [h.unit for h in guard.view()] == ["a.service"]


async def test_only_units_not_running_as_expected_are_read_in_full(tmp_path: Path) -> None:
    """Every unit's state in one brief read; each unit's properties only where the verdict
    needs them: a periodic check of a node whose units run costs one systemd call."""
    names = [f"u{i}.service" for i in range(20)]
    applied = Applied(
        units={
            **{n: unit(n, enable=True) for n in names},
            "off.service": unit("off.service", enable=False),
        }
    )
    running = {n: ACTIVE for n in names}
    c, kube, systemd, *_ = _controller(
        tmp_path, {**running, "u3.service": ("failed", "failed"), "off.service": ACTIVE},
        applied, _node(),
    )  # fmt: skip
    real = systemd.unit_states
    full: list[str] = []

    async def counting(names: Any, *, brief: bool = False) -> dict[str, UnitState]:
        if not brief:
            full.extend(names)
        return await real(names, brief=brief)

    systemd.unit_states = counting  # type: ignore[method-assign]
    await c.check_once()
    assert sorted(full) == ["off.service", "u3.service"]
    assert _ours(kube)["message"] == (
        "off.service: active but should be disabled; u3.service: failed"
    )


def _looping(c: UnitCheckController, systemd: FakeSystemd) -> None:
    systemd.units["a.service"] = ("activating", "auto-restart")
    systemd.props["a.service"] = {"result": "exit-code", "n_restarts": 4}


async def test_restart_loop_keeps_upstreams_condition_but_warns(tmp_path: Path) -> None:
    """By default the condition Gardener reads is upstream's (healthy); the crash loop is a
    Warning Event and in the check's view."""
    c, kube, systemd, *_ = _controller(tmp_path, {"a.service": ACTIVE}, APPLIED, _node())
    _looping(c, systemd)
    view = await c.check_once()
    assert _ours(kube)["status"] == "True"
    assert _ours(kube)["reason"] == report.REASON_UNITS_HEALTHY
    assert view.looping == ("a.service: failed (exit-code), restarting",)
    assert _warnings(kube) == ["a.service: failed (exit-code), restarting"]


async def test_restart_loop_in_the_condition_with_the_operators_strictness(
    tmp_path: Path,
) -> None:
    c, kube, systemd, *_ = _controller(tmp_path, {"a.service": ACTIVE}, APPLIED, _node())
    strict = tmp_path / "var/lib/gardener-node-agent/node-agent-strict.yaml"
    strict.parent.mkdir(parents=True, exist_ok=True)
    strict.write_text(
        "apiVersion: node-agent.gardener.cloud/v1alpha1\nkind: Strictness\nrestartLoops: true\n"
    )
    _looping(c, systemd)
    await c.check_once()
    assert _ours(kube)["status"] == "False"
    assert _ours(kube)["message"] == "a.service: failed (exit-code), restarting"
