"""The isolated systemd is the machine's real systemd, and nothing it does reaches the host."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
from pystemd.dbuslib import DBusAddress
from pystemd.systemd1 import Manager, Unit

from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

UNIT = "smoke.service"
UNIT_TEXT = """\
[Unit]
Description=node-agent test bed smoke unit
StartLimitIntervalSec=0

[Service]
ExecStart=/bin/sleep infinity
"""
CRASHING_TEXT = """\
[Unit]
StartLimitIntervalSec=0

[Service]
ExecStart=/bin/false
Restart=always
RestartSec=50ms
"""


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.02)


class UnitState(NamedTuple):
    active: str
    invocation: str
    main_pid: int
    n_restarts: int


def unit_state(bus: DBusAddress, name: str) -> UnitState:
    unit = Unit(name.encode(), bus=bus)
    unit.load()
    return UnitState(
        unit.Unit.ActiveState.decode(),
        bytes(unit.Unit.InvocationID).hex(),
        int(unit.Service.MainPID),
        int(unit.Service.NRestarts),
    )


def test_unit_lifecycle_with_pystemd(systemd: IsolatedSystemd) -> None:
    systemd.path(f"/etc/systemd/system/{UNIT}").write_text(UNIT_TEXT)
    systemd.path("/etc/systemd/system/crashing.service").write_text(CRASHING_TEXT)
    with DBusAddress(systemd.bus_address) as bus:
        manager = Manager(bus=bus)
        manager.load()
        manager.Manager.Reload()
        assert unit_state(bus, UNIT).active == "inactive"

        manager.Manager.StartUnit(UNIT.encode(), b"replace")
        wait_for(lambda: unit_state(bus, UNIT).active == "active", "start")
        first = unit_state(bus, UNIT)
        assert first.main_pid > 0

        manager.Manager.RestartUnit(UNIT.encode(), b"replace")
        wait_for(
            lambda: (
                unit_state(bus, UNIT).invocation != first.invocation
                and unit_state(bus, UNIT).active == "active"
            ),
            "restart",
        )
        second = unit_state(bus, UNIT)
        assert second.main_pid != first.main_pid
        assert second.n_restarts == 0, "a requested restart is not an automatic one"

        manager.Manager.StartUnit(b"crashing.service", b"replace")
        wait_for(
            lambda: unit_state(bus, "crashing.service").n_restarts >= 3,
            "systemd to restart the crashing unit three times",
        )

        manager.Manager.StopUnit(UNIT.encode(), b"replace")
        manager.Manager.StopUnit(b"crashing.service", b"replace")
        wait_for(lambda: unit_state(bus, UNIT).active == "inactive", "stop")

    # The unit process ran inside the namespace, never on the host.
    inside = systemd.run(["systemctl", "show", "-P", "ActiveState", UNIT]).stdout.strip()
    assert inside == "inactive"
    assert not Path(f"/etc/systemd/system/{UNIT}").exists()


def test_instances_run_side_by_side(workdir: Path) -> None:
    with (
        IsolatedSystemd(workdir / "side") as one,
        IsolatedSystemd(workdir / "side") as two,
    ):
        one.path("/etc/systemd/system/only-in-one.service").write_text(UNIT_TEXT)
        one.run(["systemctl", "daemon-reload"])
        one.run(["systemctl", "start", "only-in-one.service"])
        assert one.run(["systemctl", "is-active", "only-in-one.service"]).stdout.strip() == (
            "active"
        )
        result = two.run(["systemctl", "is-active", "only-in-one.service"], check=False)
        assert result.stdout.strip() == "inactive"
        assert one.pid != two.pid
        # Each is PID 1 of its own PID namespace.
        assert one.run(["cat", "/proc/1/comm"]).stdout.strip() == "systemd"
    assert not (workdir / "side" / one.name / "scratch").exists()


def test_throwaway_node_writes_anywhere_and_host_is_untouched(node: IsolatedSystemd) -> None:
    host_file = Path("/etc/hostname")
    before = hashlib.sha256(host_file.read_bytes()).hexdigest()
    marker = Path("/etc/node-agent-throwaway-marker")
    assert not marker.exists()

    node.run(["sh", "-c", "echo changed-inside > /etc/hostname && echo hi > " + str(marker)])
    node.path("/opt/node-agent/written-from-outside").parent.mkdir(parents=True)
    node.path("/opt/node-agent/written-from-outside").write_text("x")

    assert node.path("/etc/hostname").read_text() == "changed-inside\n"
    assert node.run(["cat", str(marker)]).stdout == "hi\n"
    assert node.run(["cat", "/opt/node-agent/written-from-outside"]).stdout == "x"
    assert hashlib.sha256(host_file.read_bytes()).hexdigest() == before
    assert not marker.exists()
    assert not Path("/opt/node-agent/written-from-outside").exists()
    # The node's systemd is up and manages units of its own.
    node.path("/etc/systemd/system/in-node.service").write_text(UNIT_TEXT)
    node.run(["systemctl", "daemon-reload"])
    node.run(["systemctl", "start", "in-node.service"])
    assert node.run(["systemctl", "is-active", "in-node.service"]).stdout.strip() == "active"
