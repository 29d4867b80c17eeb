"""Health checks with fakes and an injected clock: when they warn, restart and report recovery,
that only units of the applied OSC are touched, the Node's readiness flapping, kubelet's address,
and the wire bytes of the containerd call."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from node_agent.apply.restart_guard import RestartGuard
from node_agent.base.errors import HostError
from node_agent.containerd import ping
from node_agent.context import AgentContext
from node_agent.controllers.healthcheck import (
    CONTAINERD,
    KUBELET,
    HealthCheckController,
    ReadyToggles,
    Tracker,
    Verdict,
    kubelet_healthz_url,
    managed_units,
    node_ready,
)
from node_agent.osc.applied import Applied, AppliedUnit
from node_agent.systemd import UnitState
from tests.unit.fakes import ACTIVE, FakeKube, FakeSystemd, make_ctx

KUBELET_TEXT = "[Service]\nExecStart=/opt/bin/kubelet --config=/var/lib/kubelet/config/kubelet\n"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Source:
    """The applied OSC, as the Applier gives it."""

    def __init__(self, *units: AppliedUnit) -> None:
        self.set(*units)

    def set(self, *units: AppliedUnit) -> None:
        self.applied = Applied(units={u.name: u for u in units})
        self.checksum = str(hash(tuple(sorted(self.applied.units))))

    def applied_checksum(self) -> str:
        return self.checksum

    def last_applied(self) -> Applied:
        return self.applied


class Probe:
    """A probe whose answer the test sets; counts its calls."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.calls = 0

    async def __call__(self) -> str | None:
        self.calls += 1
        return self.error


class InvocationSystemd(FakeSystemd):
    """FakeSystemd with InvocationIDs: a restart (ours or anyone's) gives a unit a new one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.invocations: dict[str, int] = {}

    def restarted_elsewhere(self, unit: str) -> None:
        self.invocations[unit] = self.invocations.get(unit, 0) + 1

    async def restart_unit(self, unit: str, *, job_timeout: float = 10.0) -> Any:
        result = await super().restart_unit(unit, job_timeout=job_timeout)
        self.restarted_elsewhere(unit)
        return result

    async def unit_states(
        self, names: Sequence[str], *, brief: bool = False
    ) -> dict[str, UnitState]:
        states = await super().unit_states(names)
        return {
            name: UnitState(
                name=s.name,
                id=s.id,
                load_state=s.load_state,
                active_state=s.active_state,
                sub_state=s.sub_state,
                unit_file_state=s.unit_file_state,
                invocation_id=f"{self.invocations.get(name, 0):032x}",
                fragment_path="",
                drop_in_paths=(),
            )
            for name, s in states.items()
        }


class Bed:
    def __init__(
        self,
        tmp_path: Path,
        *units: AppliedUnit,
        health: dict[str, Any] | None = None,
        failing: Sequence[str] = (),
        guard_limit: int | None = None,
        guard_hold: bool = False,
    ) -> None:
        self.kube = FakeKube()
        self.systemd = InvocationSystemd(
            {"kubelet.service": ACTIVE, "containerd.service": ACTIVE},
            failing=failing,
            calls=self.kube.calls,
        )
        self.ctx: AgentContext = make_ctx(
            tmp_path,
            config={
                "controllers": {"operatingSystemConfig": {"secretName": "osc-a"}},
                "nodeAgent": {"healthCheck": health or {}},
            },
            kube=self.kube,
            systemd=self.systemd,
        )
        self.clock = Clock()
        self.kubelet, self.containerd = Probe(), Probe()
        self.source = Source(*units)
        self.applying = False
        self.guard = (
            RestartGuard(
                max_restarts=guard_limit,
                window=600.0,
                clock=self.clock,
                hold=lambda: guard_hold,
            )
            if guard_limit is not None
            else None
        )
        self.controller = HealthCheckController(
            self.ctx,
            self.source,
            probes={"kubelet": self.kubelet, "containerd": self.containerd},
            applying=lambda: self.applying,
            guard=self.guard,
            clock=self.clock,
            wall=lambda: 1_800_000_000.0 + self.clock.now,
        )

    async def at(self, seconds: float) -> list[tuple[str, str, str]]:
        """Run one check at ``seconds`` after the start; the Events it recorded."""
        before = len(self.events())
        self.clock.now = 1000.0 + seconds
        await self.controller.check_once()
        return self.events()[before:]

    def events(self) -> list[tuple[str, str, str]]:
        return [
            (c[1]["type"], c[1]["reason"], c[1]["message"])
            for c in self.kube.calls
            if c[0] == "create_event"
        ]

    def restarts(self) -> list[str]:
        return [c[1] for c in self.kube.calls if c[0] == "restart"]


def kubelet_unit(text: str = KUBELET_TEXT, **fields: Any) -> AppliedUnit:
    return AppliedUnit(name="kubelet.service", content=text, **fields)


def containerd_unit() -> AppliedUnit:
    # as in Gardener's OSC: no content, a drop-in of the OS extension
    return AppliedUnit(name="containerd.service", drop_ins={"override.conf": "[Service]\n"})


# --- the failure history of one component ------------------------------------------------------


def test_tracker_warns_once_restarts_after_the_period_and_again_a_period_later() -> None:
    t = Tracker(restart_after=60)
    assert t.observe(0, None) is Verdict.HEALTHY
    assert t.observe(10, "down") is Verdict.FIRST_FAILURE
    assert t.observe(30, "down") is Verdict.FAILING
    assert t.observe(69.9, "down") is Verdict.FAILING
    assert t.observe(70, "down") is Verdict.RESTART_DUE
    t.restarted(70)
    assert t.observe(71, "down", "new-invocation") is Verdict.FAILING  # ours: not someone else's
    assert t.observe(129, "down", "new-invocation") is Verdict.FAILING
    assert t.observe(130, "down", "new-invocation") is Verdict.RESTART_DUE
    assert (t.restarts, t.failing_since, t.last_error) == (1, 10, "down")
    assert t.observe(131, None) is Verdict.RECOVERED
    assert t.observe(132, None) is Verdict.HEALTHY
    assert (t.healthy, t.failing_since, t.last_error) == (True, None, None)


def test_tracker_restarts_the_countdown_when_someone_else_restarted_the_unit() -> None:
    t = Tracker(restart_after=60)
    assert t.observe(0, None, "a") is Verdict.HEALTHY
    assert t.observe(1, "down", "a") is Verdict.FIRST_FAILURE
    assert t.observe(50, "down", "b") is Verdict.FAILING  # an apply restarted it at ~50 s
    assert t.observe(61, "down", "b") is Verdict.FAILING
    assert t.observe(110, "down", "b") is Verdict.RESTART_DUE
    assert t.failing_since == 1  # the failure is still the one that began at 1 s


# --- the controller, with the 1 min default -----------------------------------------------------


async def test_kubelet_failing_for_a_minute_is_restarted_once_with_the_events(
    tmp_path: Path,
) -> None:
    bed = Bed(tmp_path, kubelet_unit(), containerd_unit())
    assert await bed.at(0) == []
    bed.kubelet.error = "GET http://127.0.0.1:10248/healthz: HTTP 500"
    assert await bed.at(20) == [
        ("Warning", "kubelet", "Kubelet is unhealthy: GET http://127.0.0.1:10248/healthz: HTTP 500")
    ]
    assert await bed.at(40) == []
    assert await bed.at(79.5) == []
    assert bed.restarts() == []
    assert await bed.at(80) == [
        (
            "Warning",
            "kubelet",
            "Kubelet is unhealthy for more than 1m, restarting it: "
            "GET http://127.0.0.1:10248/healthz: HTTP 500",
        ),
        ("Normal", "SystemDUnitRestart", "restart kubelet.service: done"),
    ]
    assert bed.restarts() == ["kubelet.service"]
    assert await bed.at(100) == []  # still failing, but it was just restarted
    bed.kubelet.error = None
    assert await bed.at(120) == [("Normal", "kubelet", "Kubelet is healthy")]
    assert await bed.at(200) == []
    assert bed.restarts() == ["kubelet.service"]
    assert bed.containerd.calls == 8  # checked each time, always healthy: no Event
    view = bed.controller.view()
    kubelet = view.components[0]
    assert (kubelet.name, kubelet.unit, kubelet.managed, kubelet.healthy) == (
        "kubelet",
        "kubelet.service",
        True,
        True,
    )
    assert kubelet.restarts == 1
    assert kubelet.last_restart is not None
    assert kubelet.last_restart.timestamp() == 1_800_000_000.0 + 1080.0


async def test_a_unit_that_stays_unhealthy_is_restarted_every_period_not_every_check(
    tmp_path: Path,
) -> None:
    bed = Bed(tmp_path, kubelet_unit(), containerd_unit())
    bed.containerd.error = "no answer from /run/containerd/containerd.sock within 10s"
    for second in range(0, 200, 20):
        await bed.at(second)
    assert bed.restarts() == ["containerd.service"] * 3  # at 60, 120, 180
    reasons = [(kind, reason) for kind, reason, _ in bed.events()]
    assert reasons.count(("Warning", "containerd")) == 4  # first failure + one per restart
    assert reasons.count(("Normal", "SystemDUnitRestart")) == 3
    view = bed.controller.view().components[1]
    assert (view.healthy, view.restarts, view.last_error) == (
        False,
        3,
        "no answer from /run/containerd/containerd.sock within 10s",
    )
    assert view.failing_since is not None
    assert view.failing_since.timestamp() == 1_800_000_000.0 + 1000.0


async def test_restarts_that_do_not_heal_are_spaced_out_not_stopped_by_default(
    tmp_path: Path,
) -> None:
    bed = Bed(tmp_path, kubelet_unit(), containerd_unit(), guard_limit=2)
    bed.containerd.error = "no answer"
    for second in range(0, 620, 20):
        await bed.at(second)
    suspended = [m for _, reason, m in bed.events() if reason == "UnitRestartsSuspended"]
    assert len(suspended) == 1, bed.events()
    assert "restarted again in 5s at the earliest" in suspended[0]
    assert len(bed.restarts()) > 2  # still restarted, with growing pauses
    bed.containerd.error = None
    await bed.at(700)
    await bed.at(720)
    assert bed.guard is not None


async def test_restarts_that_do_not_heal_are_held_with_the_operators_strictness(
    tmp_path: Path,
) -> None:
    bed = Bed(tmp_path, kubelet_unit(), containerd_unit(), guard_limit=2, guard_hold=True)
    bed.containerd.error = "no answer"
    for second in range(0, 320, 20):
        await bed.at(second)
    # Restarted at 60 and 120; at 180 the second restart had not healed it either: held.
    assert bed.restarts() == ["containerd.service"] * 2
    suspended = [m for _, reason, m in bed.events() if reason == "UnitRestartsSuspended"]
    assert len(suspended) == 1, bed.events()
    assert suspended[0].startswith("containerd.service: failed after 2 restarts by node-agent")
    assert bed.guard is not None
    assert [h.unit for h in bed.guard.view()] == ["containerd.service"]
    # Healthy again (e.g. fixed by hand): the count is cleared, the hold stays until a new OSC.
    bed.containerd.error = None
    await bed.at(340)
    assert bed.guard.held("containerd.service") is not None
    assert bed.guard.osc("another") == ["containerd.service"]


async def test_only_units_of_the_applied_osc_are_checked_or_restarted(tmp_path: Path) -> None:
    bed = Bed(tmp_path, kubelet_unit())  # containerd.service is not in the OSC
    bed.containerd.error = "down"
    for second in range(0, 200, 20):
        await bed.at(second)
    assert bed.containerd.calls == 0
    assert bed.restarts() == []
    assert bed.events() == []
    assert bed.controller.view().components[1].managed is False
    assert await bed.controller.restart(CONTAINERD, "down") is None  # refused: not managed
    assert bed.restarts() == []

    # An OSC that asks kubelet to be stopped: it is meant to be down.
    bed.source.set(kubelet_unit(command="stop"), containerd_unit())
    bed.kubelet.error = "connection refused"
    for second in range(200, 400, 20):
        await bed.at(second)
    assert bed.kubelet.calls == 10  # checked while the first OSC was applied, not after
    assert "kubelet.service" not in bed.restarts()


async def test_a_unit_leaving_the_osc_ends_its_failure(tmp_path: Path) -> None:
    bed = Bed(tmp_path, kubelet_unit(), containerd_unit())
    bed.kubelet.error = "down"
    await bed.at(0)
    bed.source.set(containerd_unit())
    await bed.at(70)
    assert bed.restarts() == []
    state = bed.controller.view().components[0]
    assert (state.managed, state.healthy, state.failing_since) == (False, None, None)


async def test_a_due_restart_waits_for_a_running_apply(tmp_path: Path) -> None:
    bed = Bed(tmp_path, kubelet_unit())
    bed.kubelet.error = "down"
    await bed.at(0)
    bed.applying = True
    await bed.at(60)
    await bed.at(80)
    assert bed.restarts() == []
    bed.applying = False
    await bed.at(100)
    assert bed.restarts() == ["kubelet.service"]


async def test_a_restart_by_the_apply_gives_the_unit_a_full_period(tmp_path: Path) -> None:
    bed = Bed(tmp_path, kubelet_unit())
    bed.kubelet.error = "down"
    await bed.at(0)
    bed.systemd.restarted_elsewhere("kubelet.service")  # e.g. the OSC apply restarted it
    await bed.at(40)
    await bed.at(80)
    assert bed.restarts() == []
    await bed.at(100)
    assert bed.restarts() == ["kubelet.service"]


async def test_a_failed_restart_is_a_warning_and_is_not_retried_at_once(tmp_path: Path) -> None:
    bed = Bed(tmp_path, kubelet_unit(), failing=["kubelet.service"])
    bed.kubelet.error = "down"
    await bed.at(0)
    events = await bed.at(60)
    assert events[-1] == ("Warning", "SystemDUnitRestart", "restart kubelet.service: failed")
    await bed.at(80)
    await bed.at(100)
    assert bed.restarts() == ["kubelet.service"]
    await bed.at(120)
    assert bed.restarts() == ["kubelet.service"] * 2


async def test_short_settings_and_a_probe_that_raises(tmp_path: Path) -> None:
    bed = Bed(tmp_path, kubelet_unit(), health={"restartAfter": "5s", "syncPeriod": "1s"})

    async def broken() -> str | None:
        raise RuntimeError("boom")

    bed.controller.probes["kubelet"] = broken
    assert await bed.at(0) == [
        ("Warning", "kubelet", "Kubelet is unhealthy: check failed: RuntimeError: boom")
    ]
    await bed.at(4)
    assert bed.restarts() == []
    events = await bed.at(5)
    assert events[0][2].startswith("Kubelet is unhealthy for more than 5s, restarting it")
    assert bed.restarts() == ["kubelet.service"]


async def test_a_unit_systemd_does_not_know_is_not_checked(tmp_path: Path) -> None:
    bed = Bed(tmp_path, kubelet_unit(), containerd_unit())
    del bed.systemd.units["containerd.service"]  # the OSC names it; it is not installed
    bed.containerd.error = "cannot connect"
    for second in range(0, 200, 20):
        await bed.at(second)
    assert bed.containerd.calls == 0
    assert bed.restarts() == []
    assert bed.events() == []


async def test_disabled_checks_do_nothing(tmp_path: Path) -> None:
    bed = Bed(tmp_path, kubelet_unit(), health={"enabled": False})
    bed.kubelet.error = "down"
    await bed.controller.run()  # returns at once
    bed.controller.node_seen(_node("False"))
    assert bed.kubelet.calls == 0
    assert bed.events() == []
    assert bed.controller.view().enabled is False


async def test_an_unreadable_applied_osc_does_not_end_the_checks(tmp_path: Path) -> None:
    bed = Bed(tmp_path, kubelet_unit(), health={"syncPeriod": "10ms"})
    reads = 0

    def unreadable() -> Applied:
        nonlocal reads
        reads += 1
        bed.source.checksum += "+"  # read again next time
        if reads < 3:
            raise HostError("disk on fire")
        return Applied(units={"kubelet.service": kubelet_unit()})

    bed.source.last_applied = unreadable  # type: ignore[method-assign]
    task = asyncio.create_task(bed.controller.run())
    try:
        for _ in range(500):
            if bed.kubelet.calls:
                break
            await asyncio.sleep(0.01)
        assert not task.done()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert bed.kubelet.calls >= 1  # checked once the OSC could be read
    errors = [e for e in bed.ctx.health.errors if e["source"] == "health-check"]
    assert [e["error"] for e in errors] == ["disk on fire", "disk on fire"]


# --- the Node's readiness flapping ---------------------------------------------------------------


def _node(ready: str | None) -> dict[str, Any]:
    conditions = [{"type": "MemoryPressure", "status": "False"}]
    if ready is not None:
        conditions.append({"type": "Ready", "status": ready})
    return {"metadata": {"name": "n1"}, "status": {"conditions": conditions}}


def test_node_ready_reads_the_ready_condition() -> None:
    assert node_ready(_node("True")) is True
    assert node_ready(_node("False")) is False
    assert node_ready(_node("Unknown")) is False
    assert node_ready(_node(None)) is None
    assert node_ready({"metadata": {}}) is None


def test_ready_toggles_count_only_transitions_seen_and_warn_once_per_episode() -> None:
    toggles = ReadyToggles(window=600, threshold=5)
    assert toggles.observe(0, True) is False  # the first Ready seen is no transition
    due = []
    for i in range(6):
        toggles.observe(10 + 20 * i, False)
        due.append(toggles.observe(20 + 20 * i, True))
    assert due == [False, False, False, False, True, False]  # once, at the fifth
    # Later, the window holds fewer than five: re-armed, and five new ones warn again.
    assert toggles.due(20 + 20 * 5 + 601) is False
    assert toggles.warned is False
    due = []
    for i in range(5):
        toggles.observe(2000 + 20 * i, False)
        due.append(toggles.observe(2010 + 20 * i, True))
    assert due == [False, False, False, False, True]


def test_ready_toggles_spread_over_more_than_the_window_do_not_warn() -> None:
    toggles = ReadyToggles(window=600, threshold=5)
    toggles.observe(0, False)
    assert not any(
        toggles.observe(t, ready)
        for t, ready in ((k * 160.0 + 80 * (not r), r) for k in range(8) for r in (True, False))
    )


async def test_flapping_node_gets_one_reboot_suggestion(tmp_path: Path) -> None:
    bed = Bed(tmp_path, kubelet_unit())
    await bed.at(0)
    for i in range(7):
        bed.clock.now = 1000.0 + 10 * i
        bed.controller.node_seen(_node("Unknown"))
        bed.clock.now += 5
        bed.controller.node_seen(_node("True"))
        await bed.controller.report_toggles()
    assert bed.events() == [
        (
            "Warning",
            "kubelet",
            "Kubelet toggled between NotReady and Ready at least 5 times in a 10m time window. "
            "Rebooting the node might help",
        )
    ]
    view = bed.controller.view()
    assert (view.ready_toggles, view.reboot_suggested) == (7, True)


async def test_flapping_wakes_the_loop_for_the_suggestion_without_a_round(
    tmp_path: Path,
) -> None:
    bed = Bed(tmp_path, kubelet_unit(), health={"syncPeriod": "1h"})
    task = asyncio.create_task(bed.controller.run())
    try:
        for _ in range(500):
            if bed.controller.checks:
                break
            await asyncio.sleep(0.01)
        for i in range(6):
            bed.clock.now = 1000.0 + 10 * i
            bed.controller.node_seen(_node("False"))
            bed.clock.now += 5
            bed.controller.node_seen(_node("True"))
        for _ in range(500):
            if bed.events():
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert [e[1] for e in bed.events()] == ["kubelet"]  # the suggestion, at once
    assert bed.controller.checks == 1  # the next round stays an hour away


async def test_no_reboot_suggestion_when_kubelet_is_not_in_the_osc(tmp_path: Path) -> None:
    bed = Bed(tmp_path, containerd_unit())
    await bed.at(0)
    for _ in range(6):
        bed.controller.node_seen(_node("False"))
        bed.controller.node_seen(_node("True"))
    await bed.controller.report_toggles()
    assert bed.events() == []


# --- what the OSC manages; where kubelet answers ------------------------------------------------


def test_managed_units_are_every_unit_of_the_osc_but_those_to_stop() -> None:
    applied = Applied(
        units={
            "kubelet.service": kubelet_unit(),
            "containerd.service": containerd_unit(),
            "systemd-sysctl.service": AppliedUnit(name="systemd-sysctl.service"),
            "old.service": AppliedUnit(name="old.service", command="stop"),
        }
    )
    assert managed_units(applied) == {
        "kubelet.service",
        "containerd.service",
        "systemd-sysctl.service",
    }


@pytest.mark.parametrize(
    ("unit_text", "config", "url"),
    [
        (KUBELET_TEXT, None, "http://127.0.0.1:10248/healthz"),
        (
            KUBELET_TEXT,
            b"healthzPort: 10300\nhealthzBindAddress: 127.0.0.2\n",
            "http://127.0.0.2:10300/healthz",
        ),
        (KUBELET_TEXT, b'{"healthzPort": 0}', None),
        (KUBELET_TEXT, b"healthzBindAddress: 0.0.0.0\n", "http://127.0.0.1:10248/healthz"),
        (KUBELET_TEXT, b"healthzBindAddress: '::'\n", "http://[::1]:10248/healthz"),
        (KUBELET_TEXT, b"healthzBindAddress: fd00::1\n", "http://[fd00::1]:10248/healthz"),
        (KUBELET_TEXT, b": not yaml [", "http://127.0.0.1:10248/healthz"),
        (
            KUBELET_TEXT.replace("\n", " --healthz-port 10301 --healthz-bind-address=127.0.0.3\n"),
            b"healthzPort: 10300\n",
            "http://127.0.0.3:10301/healthz",
        ),
        # a port in another script's digits is not kubelet's port: the default is asked
        (
            KUBELET_TEXT.replace("\n", " --healthz-port=\u0661\u0660\u0663\u0660\u0660\n"),
            None,
            "http://127.0.0.1:10248/healthz",
        ),
    ],
)
def test_kubelet_healthz_url(unit_text: str, config: bytes | None, url: str | None) -> None:
    assert kubelet_healthz_url(kubelet_unit(unit_text), config) == url


async def test_kubelet_url_from_the_config_file_the_unit_names(tmp_path: Path) -> None:
    text = "[Service]\nExecStart=/opt/bin/kubelet --config /etc/kubelet.yaml --v=2\n"
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/kubelet.yaml").write_text("healthzPort: 12345\n")
    bed = Bed(tmp_path, kubelet_unit(text))
    await bed.at(0)
    assert bed.controller.kubelet_url == "http://127.0.0.1:12345/healthz"
    assert bed.controller.kubelet_probe.url == "http://127.0.0.1:12345/healthz"

    (tmp_path / "etc/kubelet.yaml").write_text("healthzPort: 0\n")
    bed.source.set(kubelet_unit(text + "# changed\n"))
    bed.source.checksum += "-2"
    bed.kubelet.error = "down"
    await bed.at(20)
    assert bed.controller.kubelet_url is None
    await bed.at(100)
    assert bed.kubelet.calls == 1  # switched off: not checked
    assert bed.restarts() == []

    configured = Bed(tmp_path, kubelet_unit(text), health={"kubeletHealthz": "http://[::1]:9/h"})
    await configured.at(0)
    assert configured.controller.kubelet_probe.url == "http://[::1]:9/h"


# --- the containerd call on the wire --------------------------------------------------------


def test_hpack_integers_as_in_rfc_7541() -> None:
    assert ping._hpack_int(10, 5, 0) == bytes([0x0A])  # C.1.1
    assert ping._hpack_int(1337, 5, 0) == bytes([0x1F, 0x9A, 0x0A])  # C.1.2
    assert ping._hpack_int(42, 8, 0) == bytes([0x2A])  # C.1.3


def test_request_frames() -> None:
    data = ping.request()
    assert data.startswith(ping.PREFACE)
    rest = data[len(ping.PREFACE) :]
    frames = []
    while rest:
        size = int.from_bytes(rest[:3], "big")
        frames.append((rest[3], rest[4], int.from_bytes(rest[5:9], "big"), rest[9 : 9 + size]))
        rest = rest[9 + size :]
    assert [(kind, flags, stream) for kind, flags, stream, _ in frames] == [
        (ping.SETTINGS, 0, 0),
        (ping.HEADERS, ping.END_HEADERS, 1),
        (ping.DATA, ping.END_STREAM, 1),
    ]
    headers = frames[1][3]
    assert headers.startswith(b"\x83\x86\x04")  # POST, http, :path literal
    assert ping.PATH.encode() in headers
    assert b"application/grpc" in headers
    assert frames[2][3] == b"\x00\x00\x00\x00\x00"


def test_version_answer_parsing() -> None:
    message = b"\x0a\x061.7.24\x12\x07abc1234"
    body = b"\x00" + struct.pack(">I", len(message)) + message
    assert ping.parse_version(ping.grpc_message(body)) == ping.Version("1.7.24", "abc1234")
    with pytest.raises(ping.PingError, match="without a response message"):
        ping.grpc_message(b"")
    with pytest.raises(ping.PingError, match="truncated"):
        ping.grpc_message(body[:-1])
    with pytest.raises(ping.PingError, match="without a version"):
        ping.parse_version(b"\x12\x01x")


def test_components_are_named_as_upstream() -> None:
    assert (KUBELET.name, KUBELET.unit) == ("kubelet", "kubelet.service")
    assert (CONTAINERD.name, CONTAINERD.unit) == ("containerd", "containerd.service")
