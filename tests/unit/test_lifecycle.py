"""Hostname change → exit for a restart; the watchdog rule (progress, not mere existence)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from node_agent.controllers.lifecycle import (
    EXIT_HOSTNAME_CHANGED,
    HostnameChanged,
    current_hostname,
    watch_hostname,
    watchdog_ok,
    watchdog_pings,
)


def test_current_hostname_is_the_kernels() -> None:
    import socket

    assert current_hostname() == socket.gethostname()


async def test_hostname_change_raises_with_exit_code() -> None:
    names = iter(["a", "a", "b"])
    with pytest.raises(HostnameChanged) as info:
        await asyncio.wait_for(watch_hostname(poll=0.001, read=lambda: next(names)), 5)
    assert (info.value.old, info.value.new) == ("a", "b")
    assert info.value.exit_code == EXIT_HOSTNAME_CHANGED != 0


def test_watchdog_requires_recent_progress_and_a_responsive_loop() -> None:
    required = {"lease-tick": 35.0}
    ok = watchdog_ok({"lease-tick": 95.0}, now=100.0, started=0.0, loop_lag=0.1, max_lag=5.0)
    assert ok == (True, "")
    stale, why = watchdog_ok(
        {"lease-tick": 50.0}, now=100.0, started=0.0, loop_lag=0.1, max_lag=5.0, required=required
    )
    assert not stale
    assert "lease-tick" in why
    lagging, why = watchdog_ok(
        {"lease-tick": 99.0}, now=100.0, started=0.0, loop_lag=9.0, max_lag=5.0
    )
    assert not lagging
    assert "lagging" in why
    # A loop that never ticked gets one grace period from the start.
    assert watchdog_ok({}, now=100.0, started=80.0, loop_lag=0.0, max_lag=5.0)[0]
    assert not watchdog_ok({}, now=100.0, started=10.0, loop_lag=0.0, max_lag=5.0)[0]


async def test_pings_stop_when_the_lease_loop_stops_ticking() -> None:
    loop = asyncio.get_running_loop()
    progress = {"lease-tick": loop.time()}
    pings: list[float] = []
    task = asyncio.create_task(
        watchdog_pings(0.01, lambda: pings.append(1), progress, required={"lease-tick": 0.1})
    )
    try:
        for _ in range(20):
            progress["lease-tick"] = loop.time()
            await asyncio.sleep(0.01)
        assert pings
        # Stop ticking: pings stop.
        await asyncio.sleep(0.2)
        count = len(pings)
        await asyncio.sleep(0.1)
        assert len(pings) == count
    finally:
        task.cancel()


async def test_a_worker_stopped_with_the_own_unit_is_the_restart_under_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemd stops the agent's whole unit, its systemd worker with it, often before the agent
    gets its SIGTERM: the worker's death is the restart under way (info, then wait for the
    SIGTERM), not an error line; past the grace, with no SIGTERM, it is raised after all."""
    from structlog.testing import capture_logs

    from node_agent.base.errors import SystemdWorkerDied
    from node_agent.context import AgentContext
    from node_agent.controllers import lifecycle
    from tests.unit.fakes import FakeSystemd, make_ctx

    systemd = FakeSystemd()

    async def stopped_with_the_unit(unit: str, **_job: object) -> None:
        raise SystemdWorkerDied(f"systemd jobs of {unit}: systemd worker 214 exited with -15")

    monkeypatch.setattr(systemd, "restart_unit", stopped_with_the_unit)
    ctx: AgentContext = make_ctx(tmp_path, systemd=systemd)
    with capture_logs() as logs:
        waiting = asyncio.create_task(lifecycle.restart_own_unit(ctx))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # until the SIGTERM cancels it
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
    assert [e["log_level"] for e in logs] == ["info"]
    assert logs[0]["event"] == "own restart under way: the systemd worker stopped with the unit"

    monkeypatch.setattr(lifecycle, "SELF_RESTART_GRACE", 0.05)
    with pytest.raises(SystemdWorkerDied):
        await lifecycle.restart_own_unit(ctx)
