"""The health gate's rules, its record, and the restart-storm guard (pure logic and fakes).

The real-bed behaviour (a restart loop rolled back, the quarantine, a kill in the window) is in
tests/integration/test_health_gate.py and test_apply_faults.py (finding 4).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node_agent.apply.executor import ApplyReport
from node_agent.apply.restart_guard import SPACING_BASE, SPACING_CAP, RestartGuard
from node_agent.base.layout import HEALTH_GATE, HEALTH_GATE_PREVIOUS
from node_agent.config import HealthGateConfig
from node_agent.controllers.osc.breakage import (
    RESTART_LOOP,
    first_evidence,
    ran_before,
    restarts_since,
    unit_evidence,
    watched_units,
)
from node_agent.controllers.osc.health_gate import GateRecord, HealthGate
from node_agent.controllers.unitcheck import ExpectedUnit, check_units
from node_agent.host.documents import LastApplied
from node_agent.host.fs import HostFS
from node_agent.host.state import StateStore
from node_agent.systemd.types import JobResult, UnitState
from tests.unit.fakes import FakeSystemd

pytestmark = pytest.mark.usefixtures("virtual_clock")

AGENT = "gardener-node-agent.service"


def state(name: str, active: str = "active", **kw: object) -> UnitState:
    fields: dict[str, object] = {
        "name": name,
        "id": name,
        "load_state": "loaded",
        "active_state": active,
        "sub_state": "running" if active == "active" else "dead",
        "unit_file_state": "enabled",
        "invocation_id": "a1",
        "fragment_path": f"/etc/systemd/system/{name}",
        "drop_in_paths": (),
        "n_restarts": 0,
    }
    fields.update(kw)
    return UnitState(**fields)  # type: ignore[arg-type]


def job(unit: str, action: str = "restart", result: str = "done") -> JobResult:
    return JobResult(unit, action, result)  # type: ignore[arg-type]


# -- the evidence rules --------------------------------------------------------------------------


def test_only_a_loaded_running_unit_ran_before() -> None:
    assert ran_before(state("a.service"))
    assert ran_before(state("a.service", "reloading"))
    assert not ran_before(state("a.service", "failed"))
    assert not ran_before(state("a.service", "inactive"))
    assert not ran_before(state("a.service", "activating"))
    assert not ran_before(state("a.service", load_state="not-found"))
    assert not ran_before(None)


def test_restarts_count_from_zero_when_systemd_reset_the_counter() -> None:
    assert restarts_since(3, 5) == 2
    assert restarts_since(3, 1) == 1  # a job started the unit: the counter began again
    assert restarts_since(None, 2) == 2


def test_watched_units_are_the_restarted_ones_that_ran_before() -> None:
    before = {
        "web.service": state("web.service"),
        "stopped.service": state("stopped.service"),
        AGENT: state(AGENT),
    }
    jobs = {
        "web.service": job("web.service"),
        "stopped.service": job("stopped.service", "stop"),  # the OSC asked to stop it
        "new.service": job("new.service", "start"),  # did not run before
        AGENT: job(AGENT),
    }
    assert list(watched_units(before, jobs, agent_unit=AGENT)) == ["web.service"]


def test_evidence_failed_job_failed_unit_restart_loop() -> None:
    before = state("web.service", n_restarts=4)
    failed_job = unit_evidence("web.service", before, job("web.service", result="failed"), None)
    assert failed_job is not None
    assert "restart job after the apply ended failed" in failed_job.what
    failed = unit_evidence(
        "web.service", before, job("web.service"), state("web.service", "failed", result="signal")
    )
    assert failed is not None
    assert failed.what == "failed after the apply (result signal)"
    looping = unit_evidence(
        "web.service", before, None, state("web.service", "activating", n_restarts=RESTART_LOOP)
    )
    assert looping is not None
    assert "restart loop" in looping.what
    once = state("web.service", "activating", n_restarts=RESTART_LOOP - 1)
    assert unit_evidence("web.service", before, None, once) is None
    healthy = state("web.service", invocation_id="b2")
    assert unit_evidence("web.service", before, job("web.service"), healthy) is None
    gone = state("web.service", "inactive", load_state="not-found")
    assert unit_evidence("web.service", before, job("web.service"), gone) is None


def test_first_evidence_is_by_unit_name() -> None:
    before = {"a.service": state("a.service"), "b.service": state("b.service")}
    jobs = {"b.service": job("b.service", result="failed"), "a.service": job("a.service")}
    now = {"a.service": state("a.service", "failed"), "b.service": state("b.service")}
    found = first_evidence(before, jobs, now)
    assert found is not None
    assert found.unit == "a.service"


# -- the gate's record and watch -----------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


def gate(tmp_path: Path, systemd: FakeSystemd, clock: Clock, window: float = 30.0) -> HealthGate:
    config = HealthGateConfig(settleWindow=timedelta(seconds=window))
    return HealthGate(
        systemd,
        StateStore(HostFS(tmp_path)),
        config,
        agent_unit=AGENT,
        clock=clock,
        sleep=clock.sleep,
    )


PREVIOUS = LastApplied(raw=b"old", checksum="0" * 64, applied_at=None, resolved={"/f": b"s"})


async def test_no_gate_when_nothing_ran_before(tmp_path: Path) -> None:
    systemd = FakeSystemd({"web.service": ("failed", "failed")})
    g = gate(tmp_path, systemd, Clock())
    assert await g.begin("1" * 64, PREVIOUS, ["web.service", "gone.service", AGENT]) is None
    assert not (tmp_path / "var/lib/gardener-node-agent" / HEALTH_GATE).exists()


async def test_a_failed_restart_is_evidence_at_once(tmp_path: Path) -> None:
    systemd = FakeSystemd({"web.service": ("active", "running")}, failing={"web.service"})
    clock = Clock()
    g = gate(tmp_path, systemd, clock)
    record = await g.begin("1" * 64, PREVIOUS, ["web.service"])
    assert record is not None
    assert set(record.before) == {"web.service"}
    results = await systemd.run_jobs([("web.service", "restart")])
    found = await g.watch(record, ApplyReport(results=results))
    assert found is not None
    assert found.unit == "web.service"
    assert clock.now == 0.0  # no waiting for the window


async def test_a_healthy_unit_is_watched_for_the_whole_window(tmp_path: Path) -> None:
    systemd = FakeSystemd({"web.service": ("active", "running")})
    clock = Clock()
    g = gate(tmp_path, systemd, clock, window=12.0)
    record = await g.begin("1" * 64, PREVIOUS, ["web.service"])
    assert record is not None
    results = await systemd.run_jobs([("web.service", "restart")])
    assert await g.watch(record, ApplyReport(results=results)) is None
    assert clock.now >= 12.0
    assert g.view().watching == "1" * 64
    assert g.view().watched_units == ("web.service",)


async def test_record_survives_a_restart_and_the_quarantine_drops_the_secrets(
    tmp_path: Path,
) -> None:
    systemd = FakeSystemd({"web.service": ("active", "running")})
    g = gate(tmp_path, systemd, Clock())
    record = await g.begin("1" * 64, PREVIOUS, ["web.service"])
    assert record is not None
    again = gate(tmp_path, systemd, Clock())  # a restarted agent
    loaded = await again.record()
    assert loaded == record
    assert loaded is not None
    assert loaded.previous_resolved == {"/f": b"s"}
    path = tmp_path / "var/lib/gardener-node-agent" / HEALTH_GATE
    assert path.stat().st_mode & 0o777 == 0o600
    systemd.units["web.service"] = ("failed", "failed")
    found = await again.watch(loaded, None, window=5)  # outcome lost: systemd shows it
    assert found is not None
    rolling = await again.rolling_back(loaded, found)
    rollback = await again.quarantine(rolling)
    assert rollback.unit == "web.service"
    kept = GateRecord.model_validate_json(path.read_bytes())
    assert kept.phase == "quarantined"
    assert kept.previous_resolved is None
    assert again.view().quarantined == "1" * 64
    await again.clear()
    assert not path.exists()


# -- the restart-storm guard ---------------------------------------------------------------------


def test_guard_spaces_retries_out_and_never_stops_them_by_default() -> None:
    """Upstream retries a failing restart for ever with backoff, and Gardener reads the
    checksum once a retry worked: the guard only spaces the retries, doubling the pause."""
    now = [0.0]
    guard = RestartGuard(max_restarts=3, window=600.0, clock=lambda: now[0])
    guard.osc("c1")
    for _ in range(2):
        assert guard.record("x.service", ok=False) is None
        assert guard.allows("x.service")
    spaced = guard.record("x.service", ok=False, error="restart x.service: failed")
    assert spaced is not None
    assert spaced.spaced
    assert spaced.cooldown == SPACING_BASE
    assert "restarted again in 5s at the earliest" in spaced.describe()
    assert not guard.allows("x.service")
    assert guard.wait("x.service") == SPACING_BASE
    now[0] = SPACING_BASE
    assert guard.allows("x.service")  # the cooldown is over: tried again
    assert guard.record("x.service", ok=False) is None  # still spaced, twice as long
    assert guard.wait("x.service") == 2 * SPACING_BASE
    now[0] += 2 * SPACING_BASE
    assert guard.allows("x.service")
    for _ in range(20):
        now[0] += guard.wait("x.service")
        guard.record("x.service", ok=False)
    assert guard.wait("x.service") == SPACING_CAP  # never longer, never for good
    now[0] += SPACING_CAP
    assert guard.allows("x.service")
    assert guard.record("x.service", ok=True) is None  # a restart that works ends it
    assert guard.view() == ()


def test_guard_holds_after_max_failed_restarts_within_the_window_when_strict() -> None:
    now = [0.0]
    guard = RestartGuard(max_restarts=3, window=60.0, clock=lambda: now[0], hold=lambda: True)
    guard.osc("c1")
    assert guard.record("x.service", ok=False) is None
    now[0] = 30.0
    assert guard.record("x.service", ok=False) is None
    now[0] = 61.0  # the first failure left the window
    assert guard.record("x.service", ok=False) is None
    now[0] = 62.0
    held = guard.record("x.service", ok=False, error="restart x.service: failed")
    assert held is not None
    assert held.failures == 3
    assert "not restarted again until the OSC changes" in held.describe()
    assert not guard.allows("x.service")
    assert guard.refused == 1
    assert guard.allows("y.service")
    assert guard.osc("c1") == []
    assert not guard.allows("x.service")
    assert guard.osc("c2") == ["x.service"]  # a new OSC may be the fix
    assert guard.allows("x.service")


def test_a_unit_that_came_up_by_itself_is_released() -> None:
    guard = RestartGuard(max_restarts=2, window=600.0, clock=lambda: 1.0, hold=lambda: True)
    guard.osc("c1")
    guard.record("x.service", ok=False)
    assert guard.record("x.service", ok=False) is not None
    assert not guard.release("y.service")  # not held: nothing to release
    assert guard.release("x.service")
    assert guard.allows("x.service")
    assert guard.view() == ()
    assert guard.record("x.service", ok=False) is None  # counted afresh
    assert not guard.release("x.service")


def test_a_restart_that_works_clears_the_count() -> None:
    guard = RestartGuard(max_restarts=2, window=600.0, clock=lambda: 1.0)
    guard.record("x.service", ok=False)
    guard.record("x.service", ok=True)
    assert guard.record("x.service", ok=False) is None
    assert guard.view() == ()


@given(
    st.lists(st.tuples(st.sampled_from(["a", "b"]), st.booleans(), st.floats(0, 100)), max_size=60),
    st.integers(1, 5),
)
def test_guard_never_holds_a_unit_before_max_failures_in_the_window(
    events: list[tuple[str, bool, float]], limit: int
) -> None:
    now = [0.0]
    guard = RestartGuard(max_restarts=limit, window=120.0, clock=lambda: now[0])
    history: dict[str, list[tuple[float, bool]]] = {"a": [], "b": []}
    for unit, ok, step in events:
        if not guard.allows(unit):
            continue  # a held unit is not restarted, so nothing is recorded for it
        now[0] += step
        history[unit].append((now[0], ok))
        held = guard.record(unit, ok=ok)
        if held is None:
            continue
        # Held only on a failure that completes ``limit`` failures in a row within the window.
        assert not ok
        tail = history[unit][-limit:]
        assert len(tail) == limit
        assert all(not good for _, good in tail)
        assert tail[-1][0] - tail[0][0] < 120.0


def test_a_held_unit_is_reported_degraded_in_the_condition_message() -> None:
    now = [0.0]
    guard = RestartGuard(max_restarts=2, window=600.0, clock=lambda: now[0], hold=lambda: True)
    guard.record("x.service", ok=False)
    guard.record("x.service", ok=False)
    held = {h.unit: h.reason() for h in guard.view()}
    expected = [ExpectedUnit("x.service", "running"), ExpectedUnit("y.service", "running")]
    states = {"x.service": state("x.service", "failed"), "y.service": state("y.service", "failed")}
    verdict = check_units(expected, states, datetime.now(UTC), timedelta(minutes=5), held)
    assert verdict.unhealthy == (
        "x.service: failed (degraded: node-agent stopped restarting it after 2 failed restarts "
        "within 10m, until the OSC changes or it comes up by itself)",
        "y.service: failed",
    )
    assert verdict.condition.status == "False"


async def test_the_last_known_good_osc_is_kept_by_a_link_not_written_into_the_record(
    tmp_path: Path,
) -> None:
    """The record names the last applied osc.yaml, kept as a hard link when the update
    begins: the update's completion replaces the last applied file, the kept one still holds
    the old bytes; a kept file changed by hand is not taken for them; ``clear`` drops it."""
    store = StateStore(HostFS(tmp_path))
    last = store.save_last_applied(b"good osc", {"/f": b"s"})
    systemd = FakeSystemd({"web.service": ("active", "running")})
    g = gate(tmp_path, systemd, Clock())
    record = await g.begin("1" * 64, last, ["web.service"])
    assert record is not None
    assert record.previous_raw is None
    store.save_last_applied(b"the update")  # the update completed
    again = gate(tmp_path, systemd, Clock())  # a restarted agent
    loaded = await again.record()
    assert loaded is not None
    assert await again.previous_raw(loaded) == b"good osc"
    kept = tmp_path / "var/lib/gardener-node-agent" / HEALTH_GATE_PREVIOUS
    assert kept.stat().st_mode & 0o777 == 0o600
    kept.write_bytes(b"good osc, edited")
    assert await again.previous_raw(loaded) is None
    await again.clear()
    assert not kept.exists()
