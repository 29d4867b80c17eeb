"""Hostname change → exit for a restart; the watchdog rule (progress, not mere existence)."""

from __future__ import annotations

import asyncio

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
