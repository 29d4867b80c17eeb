"""The restart-storm guard: the agent spaces out restarts of a unit that its restarts do not heal.

The agent restarts units for several reasons: an apply (and each retry of a partly failed one),
a drift repair, the Node's restart annotation, a failing health check. When the unit fails again
every time, each of those would restart it again and again, on every node the OSC reached. The
guard counts the agent's failed restarts per unit; after ``max_restarts`` of them within
``window`` the unit is *spaced*: the agent does not start or restart it again before a cooldown
(``SPACING_BASE`` doubling with each further failure, at most ``SPACING_CAP``) has passed, and
then tries again. Upstream retries a failing restart for ever with controller-runtime's backoff
(5 ms doubling to 1000 s); the checksum Gardener reads comes once a retry worked, so the guard
never stops the retries for good by default (a unit that fails *most* of the time gets through).

With the operator's ``holdFailingUnits`` strictness (``node_agent.base.strictness``) the unit is
*held* instead: not restarted any more, reported degraded in the condition message, until the OSC
changes or the unit comes up by itself (the unit check sees it running). A restart that works
clears the unit's count. Kept in memory: an agent restart grants one more round of tries, which
bounds the storm without persisting anything.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from node_agent.base.durations import format_duration

#: the first cooldown of a spaced unit, doubled with each further failed restart
SPACING_BASE = 5.0
#: the longest cooldown (upstream's backoff goes to 1000 s)
SPACING_CAP = 300.0


@dataclass(frozen=True)
class HeldUnit:
    """A unit the guard does not let the agent restart now: held for good (the operator's
    ``holdFailingUnits``), or spaced out until ``until``."""

    unit: str
    failures: int  # failed restarts within the window when it was held
    window_seconds: float
    since: float  # wall clock (time.time) when it was held
    last_error: str
    #: monotonic time from which a restart is allowed again; None: held until the OSC changes
    #: or the unit comes up by itself
    until: float | None = None
    #: the cooldown that ends at ``until`` (seconds)
    cooldown: float = 0.0

    @property
    def spaced(self) -> bool:
        return self.until is not None

    def describe(self) -> str:
        window = format_duration(timedelta(seconds=self.window_seconds))
        if self.spaced:
            pause = format_duration(timedelta(seconds=round(self.cooldown)))
            return (
                f"{self.unit}: failed {self.failures} restarts by node-agent within {window}; "
                f"restarted again in {pause} at the earliest ({self.last_error})"
            )
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
    #: hold a unit for good (the operator's ``holdFailingUnits``) instead of spacing it out
    hold: Callable[[], bool] = lambda: False

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
        """May the agent start or restart ``unit`` now? Counts a refusal when not. A spaced
        unit whose cooldown is over may be tried again (it stays counted: one more failure
        spaces it out for twice as long)."""
        held = self._held.get(unit)
        if held is None:
            return True
        if held.until is not None and self.clock() >= held.until:
            return True
        self.refused += 1
        return False

    def wait(self, unit: str) -> float:
        """Seconds until a restart of ``unit`` is allowed again (0: now; inf: held)."""
        held = self._held.get(unit)
        if held is None:
            return 0.0
        if held.until is None:
            return float("inf")
        return max(0.0, held.until - self.clock())

    def held(self, unit: str) -> HeldUnit | None:
        return self._held.get(unit)

    def record(self, unit: str, *, ok: bool, error: str = "") -> HeldUnit | None:
        """The outcome of one restart (or start) the agent did. Returns the ``HeldUnit`` when
        this failure is the one that makes the guard hold the unit, else None."""
        if ok:
            self._failures.pop(unit, None)
            held = self._held.get(unit)
            if held is not None and held.spaced:
                del self._held[unit]  # a spaced unit's restart worked: its pauses end
            return None
        now = self.clock()
        times = self._failures.setdefault(unit, deque())
        times.append(now)
        while times and times[0] <= now - self.window:
            times.popleft()
        before = self._held.get(unit)
        if before is not None and before.until is None:
            return None  # held for good already
        if before is None and len(times) < self.max_restarts:
            return None
        hold = self.hold()
        cooldown = 0.0
        if not hold:
            # a spaced unit stays spaced until a restart works: each failure doubles the pause
            last = before.cooldown if before is not None else 0.0
            cooldown = min(SPACING_CAP, max(SPACING_BASE, 2 * last))
        held = HeldUnit(
            unit=unit,
            failures=max(len(times), before.failures + 1 if before is not None else 0),
            window_seconds=self.window,
            since=before.since if before is not None else self.wall(),
            last_error=error or "it kept failing",
            until=None if hold else now + cooldown,
            cooldown=cooldown,
        )
        self._held[unit] = held
        return held if before is None else None

    def view(self) -> tuple[HeldUnit, ...]:
        """The held and spaced units, by name (for status, metrics and the unit check)."""
        return tuple(self._held[u] for u in sorted(self._held))
