"""The watchdog interval read from systemd's environment: ASCII digits only, never a crash."""

from __future__ import annotations

import os

import pytest

from node_agent.base.sdnotify import Notifier


@pytest.mark.parametrize(
    ("usec", "interval"),
    [("60000000", 30.0), ("\u00b2", None), ("\u0661\u0660", None), ("-5", None), ("", None)],
)
def test_the_watchdog_interval_is_half_of_watchdog_usec(
    monkeypatch: pytest.MonkeyPatch, usec: str, interval: float | None
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", usec)
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert Notifier(address="").watchdog_interval == interval
