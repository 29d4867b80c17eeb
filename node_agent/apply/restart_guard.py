"""The restart-storm guard: the agent stops restarting a unit that its restarts do not heal.

The agent restarts units for several reasons: an apply (and each retry of a partly failed one),
a drift repair, the Node's restart annotation, a failing health check. When the unit fails again
every time, each of those would restart it again and again, forever, on every node the OSC
reached. The guard counts the agent's failed restarts per unit; after ``max_restarts`` of them
within ``window`` the unit is *held*: the agent does not start or restart it any more, and
reports it degraded (condition message, Event, metric) until the OSC changes or the unit comes
up by itself (the unit check sees it running). A restart that works clears the unit's count.
Kept in memory: an agent restart grants one more round of tries, which bounds the storm without
persisting anything.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from node_agent.base.durations import format_duration


@dataclass(frozen=True)
class HeldUnit:
    """A unit the guard no longer lets the agent restart."""

    unit: str
    failures: int  # failed restarts within the window when it was held
    window_seconds: float
    since: float  # wall clock (time.time) when it was held
    last_error: str

    def describe(self) -> str:
        window = format_duration(timedelta(seconds=self.window_seconds))
        return (
            f"{self.unit}: failed after {self.failures} restarts by node-agent within "
            f"{window}; not restarted again until the OSC changes or it comes up by itself "
            f"({self.last_error})"
        )

    def reason(self) -> str:
        """Why the unit is degraded, short (for the SystemdUnitsReady message)."""
        window = format_duration(timedelta(seconds=self.window_seconds))
        return (
            f"node-agent stopped restarting it after {self.failures} failed restarts within "
            f"{window}, until the OSC changes or it comes up by itself"
        )


@dataclass
class RestartGuard:
    max_restarts: int = 3
    window: float = 600.0  # seconds
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    _failures: dict[str, deque[float]] = field(default_factory=dict)
    _held: dict[str, HeldUnit] = field(default_factory=dict)
    _checksum: str | None = None
    #: restarts the guard refused, for the metrics
    refused: int = 0

    def osc(self, checksum: str | None) -> list[str]:
        """The OSC the agent works on now; a different one releases every held unit (the
        change may be the fix). Returns the units released."""
        if checksum == self._checksum:
            return []
        self._checksum = checksum
        released = sorted(self._held)
        self._held.clear()
        self._failures.clear()
        return released

    def release(self, unit: str) -> bool:
        """``unit`` came up by itself (systemd's ``Restart=``, an operator): the agent may start
        it again and its count starts afresh. Returns whether it was held."""
        self._failures.pop(unit, None)
        return self._held.pop(unit, None) is not None

    def allows(self, unit: str) -> bool:
        """May the agent start or restart ``unit`` now? Counts a refusal when not."""
        if unit in self._held:
            self.refused += 1
            return False
        return True

    def held(self, unit: str) -> HeldUnit | None:
        return self._held.get(unit)

    def record(self, unit: str, *, ok: bool, error: str = "") -> HeldUnit | None:
        """The outcome of one restart (or start) the agent did. Returns the ``HeldUnit`` when
        this failure is the one that makes the guard hold the unit, else None."""
        if ok:
            self._failures.pop(unit, None)
            return None
        now = self.clock()
        times = self._failures.setdefault(unit, deque())
        times.append(now)
        while times and times[0] <= now - self.window:
            times.popleft()
        if len(times) < self.max_restarts or unit in self._held:
            return None
        held = HeldUnit(
            unit=unit,
            failures=len(times),
            window_seconds=self.window,
            since=self.wall(),
            last_error=error or "it kept failing",
        )
        self._held[unit] = held
        return held

    def view(self) -> tuple[HeldUnit, ...]:
        """The held units, by name (for status, metrics and the unit check)."""
        return tuple(self._held[u] for u in sorted(self._held))
