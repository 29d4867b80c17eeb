"""The systemd adapter against a real systemd: unit files, jobs, failures, a hung or dead worker.

Tests check behaviour only; the loop-lag test prints its figures but asserts nothing on timing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from node_agent.base.errors import (
    SystemdCallError,
    SystemdTimeout,
    SystemdUnavailable,
    SystemdWorkerDied,
)
from node_agent.systemd import Systemd, SystemdSeam, UnitState
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

UNIT_DIR = "/etc/systemd/system"

SLEEPER = """\
[Unit]
Description=node-agent adapter test {name}
StartLimitIntervalSec=0

[Service]
ExecStart=/bin/sleep infinity

[Install]
WantedBy=multi-user.target
"""
ONESHOT = """\
[Unit]
StartLimitIntervalSec=0

[Service]
Type=oneshot
ExecStart=/bin/true
"""
FAILING = """\
[Unit]
StartLimitIntervalSec=0

[Service]
Type=oneshot
ExecStart=/bin/false
"""
SLOW = """\
[Unit]
StartLimitIntervalSec=0

[Service]
Type=oneshot
ExecStartPre=/bin/sleep 30
ExecStart=/bin/true
"""


def write_unit(systemd: IsolatedSystemd, name: str, text: str) -> Path:
    path = systemd.path(f"{UNIT_DIR}/{name}")
    path.write_text(text.format(name=name))
    return path


@pytest_asyncio.fixture
async def adapter(systemd: IsolatedSystemd) -> AsyncIterator[Systemd]:
    sd = Systemd(systemd.bus_address, call_timeout=15.0)
    await sd.start()
    try:
        yield sd
    finally:
        await sd.close()


class Ticker:
    """Measures event-loop lag: how late a 5 ms sleep wakes up."""

    def __init__(self, period: float = 0.005) -> None:
        self.period = period
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(self.period)
            self.lags.append(loop.time() - before - self.period)

    def __enter__(self) -> Ticker:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    def summary(self) -> str:
        if not self.lags:
            return "no ticks"
        ordered = sorted(self.lags)

        def pct(p: float) -> float:
            return ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000

        return (
            f"{len(ordered)} ticks, lag p50 {statistics.median(ordered) * 1000:.2f} ms, "
            f"p99 {pct(0.99):.2f} ms, max {ordered[-1] * 1000:.2f} ms"
        )


def test_adapter_satisfies_the_seam() -> None:
    assert isinstance(Systemd(), SystemdSeam)


async def test_reload_enable_disable(systemd: IsolatedSystemd, adapter: Systemd) -> None:
    write_unit(systemd, "enable-me.service", SLEEPER)
    await adapter.daemon_reload()
    wants = systemd.path(f"{UNIT_DIR}/multi-user.target.wants/enable-me.service")

    changes = await adapter.enable(["enable-me.service"])
    assert wants.is_symlink()
    assert [c.kind for c in changes] == ["symlink"]
    assert changes[0].path == f"{UNIT_DIR}/multi-user.target.wants/enable-me.service"
    assert (await adapter.unit_states(["enable-me.service"]))[
        "enable-me.service"
    ].unit_file_state == "enabled"
    assert await adapter.enable(["enable-me.service"]) == [] or wants.is_symlink()

    changes = await adapter.disable(["enable-me.service"])
    assert not wants.exists()
    assert not wants.is_symlink()
    assert [c.kind for c in changes] == ["unlink"]
    state = (await adapter.unit_states(["enable-me.service"]))["enable-me.service"]
    assert state.unit_file_state == "disabled"


async def test_enable_and_disable_through_an_alias_symlink(
    systemd: IsolatedSystemd, adapter: Systemd
) -> None:
    """gardener#11026: systemd refuses to enable an alias name; we enable the unit behind it."""
    write_unit(systemd, "real.service", SLEEPER)
    alias = systemd.path(f"{UNIT_DIR}/alias.service")
    os.symlink(f"{UNIT_DIR}/real.service", alias)
    await adapter.daemon_reload()
    wants = systemd.path(f"{UNIT_DIR}/multi-user.target.wants/real.service")

    state = (await adapter.unit_states(["alias.service"]))["alias.service"]
    assert state.id == "real.service"
    changes = await adapter.enable(["alias.service", "real.service"])
    assert wants.is_symlink()
    assert [c.path for c in changes] == [f"{UNIT_DIR}/multi-user.target.wants/real.service"]
    await adapter.disable(["alias.service"])
    assert not wants.is_symlink()
    # systemd's own semantics: disabling removes every symlink to the unit, the alias too.
    assert not alias.is_symlink()


async def test_enable_of_missing_unit_is_a_call_error(adapter: Systemd) -> None:
    with pytest.raises(SystemdCallError) as info:
        await adapter.enable(["no-such-unit.service"])
    assert "no-such-unit.service" in str(info.value)
    assert info.value.op == "enable"


async def test_start_restart_stop(systemd: IsolatedSystemd, adapter: Systemd) -> None:
    unit = "cycle.service"
    write_unit(systemd, unit, SLEEPER)
    await adapter.daemon_reload()
    before = (await adapter.unit_states([unit]))[unit]
    assert before.active_state == "inactive"
    assert before.load_state == "loaded"

    started = await adapter.start_unit(unit)
    assert started.ok
    assert started.result == "done"
    assert started.finished
    first = (await adapter.unit_states([unit]))[unit]
    assert first.active_state == "active"
    assert first.sub_state == "running"
    assert first.invocation_id
    assert first.main_pid
    assert first.main_pid > 0
    assert first.exec_main_start is not None

    restarted = await adapter.restart_unit(unit)
    assert restarted.result == "done"
    second = (await adapter.unit_states([unit]))[unit]
    assert second.active_state == "active"
    assert second.invocation_id != first.invocation_id
    assert second.main_pid != first.main_pid
    assert second.n_restarts == 0, "a requested restart is not an automatic one"

    stopped = await adapter.stop_unit(unit)
    assert stopped.result == "done"
    assert (await adapter.unit_states([unit]))[unit].active_state == "inactive"


async def test_brief_states_are_the_full_ones_without_the_details(
    systemd: IsolatedSystemd, adapter: Systemd
) -> None:
    """One ListUnitsByNames call answers for all units, in the order asked, as the per-unit
    reads do for id, load, active and sub state (a missing unit too)."""
    write_unit(systemd, "brief-a.service", SLEEPER)
    write_unit(systemd, "brief-b.service", SLEEPER)
    await adapter.daemon_reload()
    assert (await adapter.start_unit("brief-b.service")).ok
    names = ["brief-b.service", "brief-missing.service", "brief-a.service"]
    full = await adapter.unit_states(names)
    brief = await adapter.unit_states(names, brief=True)
    assert list(brief) == names

    def core(states: dict[str, UnitState]) -> dict[str, tuple[str, ...]]:
        return {n: (s.id, s.load_state, s.active_state, s.sub_state) for n, s in states.items()}

    assert core(brief) == core(full)
    assert core(brief)["brief-b.service"][2:] == ("active", "running")
    assert core(brief)["brief-missing.service"][1] == "not-found"
    assert brief["brief-b.service"].invocation_id == ""  # details are not read
    assert full["brief-b.service"].service_type == "simple"
    assert full["brief-b.service"].n_restarts == 0


async def test_oneshot_unit(systemd: IsolatedSystemd, adapter: Systemd) -> None:
    marker = "/run/once-marker"
    write_unit(
        systemd, "once.service", ONESHOT.replace("/bin/true", f"/bin/sh -c 'echo ran >> {marker}'")
    )
    write_unit(
        systemd, "stays.service", ONESHOT.replace("[Service]", "[Service]\nRemainAfterExit=yes")
    )
    await adapter.daemon_reload()
    results = await adapter.run_jobs([("once.service", "start"), ("stays.service", "start")])
    assert all(r.ok for r in results.values()), results
    # The job is done only once the oneshot has run to its end.
    assert systemd.path(marker).read_text() == "ran\n"
    assert (await adapter.restart_unit("once.service")).ok
    assert systemd.path(marker).read_text() == "ran\nran\n"
    states = await adapter.unit_states(["once.service", "stays.service"])
    # A finished oneshot is garbage-collected: its state reads as never run.
    assert states["once.service"].active_state == "inactive"
    assert states["once.service"].result == "success"
    assert (states["stays.service"].active_state, states["stays.service"].sub_state) == (
        "active",
        "exited",
    )
    assert states["stays.service"].invocation_id


LIMITED = """\
[Unit]
StartLimitIntervalSec=600
StartLimitBurst=2

[Service]
ExecStart=/bin/sleep infinity
"""
LIMITED_FAILING = """\
[Unit]
StartLimitIntervalSec=600
StartLimitBurst=2

[Service]
Type=oneshot
ExecStart=/bin/false
"""


async def test_a_restart_past_the_start_limit_resets_it_once(
    systemd: IsolatedSystemd, adapter: Systemd
) -> None:
    """Several OSC updates in a row restart a unit more often than its start limit allows
    (containerd: systemd's default of 5 in 10 s). That is not the unit failing: the limit is
    reset once and the restart goes through."""
    write_unit(systemd, "limited.service", LIMITED)
    write_unit(systemd, "limited-broken.service", LIMITED_FAILING)
    await adapter.daemon_reload()
    invocations = []
    for _ in range(4):
        result = await adapter.restart_unit("limited.service")
        assert result.ok, result
        states = await adapter.unit_states(["limited.service"])
        invocations.append(states["limited.service"].invocation_id)
    assert len(set(invocations)) == 4
    # A unit failing by itself keeps its own result (systemd records start-limit-hit only over
    # a clean result), so its restarts past the limit fail as they are: not run again.
    results = [await adapter.restart_unit("limited-broken.service") for _ in range(4)]
    assert [r.result for r in results] == ["failed"] * 4
    assert all("result exit-code" in r.message for r in results), results


async def test_failing_unit_is_reported(systemd: IsolatedSystemd, adapter: Systemd) -> None:
    write_unit(systemd, "broken.service", FAILING)
    write_unit(systemd, "fine.service", ONESHOT)
    await adapter.daemon_reload()
    results = await adapter.run_jobs(
        [
            ("broken.service", "restart"),
            ("fine.service", "start"),
            ("missing.service", "start"),
            ("missing-too.service", "stop"),
        ]
    )
    broken = results["broken.service"]
    assert broken.result == "failed"
    assert not broken.ok
    assert broken.finished
    assert "failed" in broken.message
    assert "exit-code" in broken.message
    print(broken.describe())
    assert results["fine.service"].ok
    missing = results["missing.service"]
    assert missing.result == "error"
    assert missing.job is None
    assert "missing.service" in missing.message
    assert results["missing-too.service"].ok, "stopping a unit that does not exist is done"
    assert "broken.service" in await adapter.failed_units()


async def test_job_timeout_leaves_the_loop_responsive(
    systemd: IsolatedSystemd, adapter: Systemd
) -> None:
    write_unit(systemd, "slow.service", SLOW)
    write_unit(systemd, "quick.service", ONESHOT)
    await adapter.daemon_reload()
    with Ticker() as ticker:
        batch = asyncio.create_task(
            adapter.run_jobs(
                [("slow.service", "start"), ("quick.service", "start")], job_timeout=1.5
            )
        )
        await asyncio.sleep(0.3)
        # The worker keeps serving other calls while it waits for the batch's jobs.
        during = (await adapter.unit_states(["slow.service"]))["slow.service"]
        results = await batch
    assert during.active_state == "activating"
    slow = results["slow.service"]
    assert slow.result == "timeout"
    assert not slow.finished
    assert not slow.ok
    assert "still running" in slow.message
    assert "activating" in slow.message
    assert results["quick.service"].ok
    assert len(ticker.lags) > 100, "the loop kept ticking while the job was pending"
    print("lag while waiting on a slow job:", ticker.summary())
    assert (await adapter.stop_unit("slow.service")).ok


async def test_killed_worker_is_respawned(systemd: IsolatedSystemd, adapter: Systemd) -> None:
    write_unit(systemd, "slow.service", SLOW)
    write_unit(systemd, "after.service", SLEEPER)
    await adapter.daemon_reload()
    first_pid = adapter.worker_pid
    assert first_pid is not None

    # Killed while a job batch is in flight: the caller learns it at once.
    batch = asyncio.create_task(adapter.run_jobs([("slow.service", "start")], job_timeout=20))
    await asyncio.sleep(0.3)
    os.kill(first_pid, signal.SIGKILL)
    with pytest.raises(SystemdWorkerDied, match="exited"):
        await asyncio.wait_for(batch, 5)

    # Killed while idle: the next call spawns a new worker and succeeds.
    second = adapter.worker_pid
    if second is not None:
        os.kill(second, signal.SIGKILL)
        await asyncio.sleep(0.1)
    result = await adapter.start_unit("after.service")
    assert result.ok, result.describe()
    assert adapter.worker_pid not in (None, first_pid)
    assert adapter.spawn_count >= 2
    assert (await adapter.unit_states(["after.service"]))["after.service"].active_state == "active"
    await adapter.run_jobs([("slow.service", "stop"), ("after.service", "stop")])


async def test_hung_worker_times_out_and_is_replaced(
    systemd: IsolatedSystemd, adapter: Systemd
) -> None:
    write_unit(systemd, "later.service", ONESHOT)
    adapter.call_timeout = 1.0
    frozen = adapter.worker_pid
    assert frozen is not None
    os.kill(frozen, signal.SIGSTOP)  # a worker stuck in a D-Bus call looks like this
    try:
        with Ticker() as ticker:
            started = time.monotonic()
            with pytest.raises(SystemdTimeout) as info:
                await adapter.daemon_reload()
            elapsed = time.monotonic() - started
        assert info.value.op == "daemon_reload"
        assert "killed worker" in str(info.value)
        print(f"hung call gave up after {elapsed:.2f}s;", ticker.summary())
        assert not Path(f"/proc/{frozen}").exists() or _is_zombie(frozen)
    finally:
        if Path(f"/proc/{frozen}").exists():
            os.kill(frozen, signal.SIGCONT)
    adapter.call_timeout = 15.0
    await adapter.daemon_reload()
    assert (await adapter.start_unit("later.service")).ok
    assert adapter.worker_pid != frozen


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except OSError:
        return True


async def test_concurrent_calls_are_matched(systemd: IsolatedSystemd, adapter: Systemd) -> None:
    names = [f"conc-{i}.service" for i in range(8)]
    for name in names:
        write_unit(systemd, name, SLEEPER)
    await adapter.daemon_reload()
    jobs, states = await asyncio.gather(
        asyncio.gather(*(adapter.start_unit(name) for name in names)),
        asyncio.gather(*(adapter.unit_states([name]) for name in names)),
    )
    for name, job in zip(names, jobs, strict=True):
        assert job.unit == name
        assert job.ok
    for name, state in zip(names, states, strict=True):
        assert list(state) == [name]
    results = await adapter.run_jobs([(name, "stop") for name in names])
    assert all(r.ok for r in results.values())


async def test_unreachable_bus_is_unavailable(workdir: Path) -> None:
    sd = Systemd(f"unix:path={workdir}/no-such-bus-socket", start_timeout=10)
    with pytest.raises(SystemdUnavailable, match="could not reach systemd"):
        await sd.start()
    await sd.close()


def slow_python(workdir: Path, delay: float) -> str:
    """A Python that takes ``delay`` seconds to start (a loaded machine's worker)."""
    path = workdir / f"slow-python-{delay:g}"
    path.write_text(f'#!/bin/sh\nsleep {delay}\nexec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return str(path)


async def test_a_worker_slow_to_start_gets_more_time_then_a_clear_error(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bus = f"unix:path={workdir}/no-such-bus-socket"
    # past start_timeout, within the patience: the worker's own answer comes through
    sd = Systemd(bus, start_timeout=1.0, python=slow_python(workdir, 2.0))
    with pytest.raises(SystemdUnavailable, match="could not reach systemd"):
        await sd.start()
    await sd.close()
    assert "systemd worker slow to connect" in capsys.readouterr().out
    # past the patience too: given up, saying how long it waited
    sd = Systemd(bus, start_timeout=0.5, python=slow_python(workdir, 5.0))
    with pytest.raises(SystemdUnavailable, match=r"did not connect within 2s"):
        await sd.start()
    await sd.close()


def test_worker_dies_with_its_parent(systemd: IsolatedSystemd) -> None:
    program = (
        "import asyncio, sys\n"
        "from node_agent.systemd import Systemd\n"
        "async def main():\n"
        f"    sd = Systemd({systemd.bus_address!r})\n"
        "    await sd.start()\n"
        "    print('WORKER', sd.worker_pid, flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", program],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    try:
        assert parent.stdout is not None
        line = ""
        while not line.startswith("WORKER "):  # skip log lines
            line = parent.stdout.readline()
            assert line, "the parent exited early"
        worker_pid = int(line.split()[1])
        assert Path(f"/proc/{worker_pid}").exists()
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{worker_pid}").exists() and not _is_zombie(worker_pid):
            assert time.monotonic() < deadline, "the worker outlived its parent"
            time.sleep(0.02)
    finally:
        parent.kill()
        parent.wait(10)


async def test_loop_lag_during_50_unit_restart(systemd: IsolatedSystemd, adapter: Systemd) -> None:
    names = [f"bulk-{i:02d}.service" for i in range(50)]
    for name in names:
        write_unit(systemd, name, SLEEPER)
    await adapter.daemon_reload()
    await adapter.enable(names)
    started = await adapter.run_jobs([(name, "start") for name in names])
    assert all(r.ok for r in started.values())
    before = await adapter.unit_states(names)

    with Ticker() as ticker:
        t0 = time.monotonic()
        results = await adapter.run_jobs([(name, "restart") for name in names], job_timeout=30)
        wall = time.monotonic() - t0
        await asyncio.sleep(0.02)  # a few ticks after the reply
    after = await adapter.unit_states(names)
    assert len(results) == 50
    assert all(r.result == "done" for r in results.values())
    for name in names:
        assert after[name].active_state == "active"
        assert after[name].invocation_id != before[name].invocation_id
    print(f"50-unit restart batch took {wall * 1000:.1f} ms; {ticker.summary()}")
    await adapter.run_jobs([(name, "stop") for name in names])


async def test_hung_systemd_is_bounded_by_the_bus_timeout(systemd: IsolatedSystemd) -> None:
    """SYSTEMD_BUS_TIMEOUT bounds each D-Bus call: the worker reports and survives."""
    sd = Systemd(systemd.bus_address, bus_timeout=1.0, call_timeout=10.0)
    await sd.start()
    try:
        pid = sd.worker_pid
        os.kill(systemd.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(SystemdCallError) as info:
                await sd.daemon_reload()
            elapsed = time.monotonic() - started
        finally:
            os.kill(systemd.pid, signal.SIGCONT)
        print(f"frozen systemd: call failed after {elapsed:.2f}s: {info.value}")
        assert info.value.op == "daemon_reload"
        assert sd.worker_pid == pid, "a D-Bus timeout does not cost the worker"
        await sd.daemon_reload()
        assert sd.spawn_count == 1
    finally:
        await sd.close()
