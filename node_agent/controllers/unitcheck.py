"""The systemd unit check: the ``SystemdUnitsReady`` condition on the agent's Node.

Every ``controllers.systemdUnitCheck.syncPeriod`` (and when :meth:`UnitCheckController.poke`
asks, e.g. right after an apply) the units of the last applied OSC are read from systemd and
judged by :func:`check_units`, a pure function; the condition goes to ``nodes/status`` only when
its status, reason or message differ from what the Node carries. What the Node carries is read
once (at start, and again after the Node was re-created or a write conflicted) and then known
from the answers to our own patches, so an idle node costs no API request at all.

The rules and messages are upstream gardener-node-agent's, with these differences (upstream's
verdicts were wrong in these cases; ``docs/design.md`` has the table):

- a unit the OSC stops (``command: stop``) or disables (``enable: false``) is expected inactive:
  inactive, failed or not loaded is healthy; active is not, unless a timer/path/socket of its
  own triggers it (then running now and then is what the OSC set up);
- a unit the OSC starts or restarts (``command: start|restart``) is expected running even
  without ``enable``/content/drop-ins (upstream called such a unit "active but should be
  disabled"); a unit the OSC asks nothing of (no content, drop-ins, enable or command, e.g.
  listed only for its ``filePaths``) is only checked for being stuck;
- the agent's own unit is always expected running (the agent never stops it);
- "not loaded" is systemd's ``LoadState`` (not-found, masked, bad-setting...): upstream's
  lookup lists units that do not exist as inactive, so upstream says "inactive but should be
  enabled" for them;
- spec units and ``status.extensionUnits`` are merged field by field, as applied (upstream takes
  only ``enable`` from an extension unit, so e.g. containerd with an extension drop-in is not
  watched); derived units (containerd's drop-in from ``criConfig``) count too;
- template units (``foo@.service``) cannot be loaded by name and are left out (upstream's whole
  check fails on one);
- ``lastHeartbeatTime`` moves only when the condition is written (upstream writes every period);
- a service waiting in ``auto-restart`` after failed runs that systemd already restarted is a
  crash loop (``"<unit>: failed (exit-code), restarting"``). Upstream calls every auto-restart
  normal operation, and Gardener's shoot care turns a False ``SystemdUnitsReady`` into a red
  ``EveryNodeReady``, so by default the condition stays upstream's (healthy) and the crash loop
  is node-agent's own diagnosis: a Warning Event, ``status`` and the metrics. The operator's
  ``restartLoops`` strictness (``node_agent.base.strictness``) puts it in the condition;
- a unit that turns unhealthy (or into a crash loop) gets one Warning Event (upstream: none).

The check also lets the restart-storm guard go of a held unit that came up by itself (running
for ``RELEASE_AFTER`` since after it was held, e.g. through systemd's ``Restart=``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from node_agent.apply.restart_guard import RestartGuard
from node_agent.base.errors import (
    KubeConflict,
    KubeNotFound,
    NodeAgentError,
    SystemdCallError,
    SystemdError,
)
from node_agent.base.log import get_logger
from node_agent.base.loop import Next, Wake, run_loop
from node_agent.kube import report
from node_agent.osc.applied import Applied, AppliedUnit
from node_agent.systemd import UnitState

if TYPE_CHECKING:
    from node_agent.apply.applier import Applier
    from node_agent.context import AgentContext

log = get_logger("node-agent.unitcheck")

JSON = dict[str, Any]
#: Never check more often than this, whatever the config says.
MIN_PERIOD = 1.0
#: Attempts of one write when the Node changed under it (409).
CONFLICT_ATTEMPTS = 3
#: How often the loop looks whether a new OSC was applied (a read of memory), so the first
#: condition and a new OSC's verdict do not wait for the next period.
APPLY_POLL = 5.0
#: How long a unit the restart-storm guard holds must have been running for the guard to let
#: it go (it came up by itself, e.g. through systemd's ``Restart=``).
RELEASE_AFTER = timedelta(seconds=10)

Want = Literal["running", "stopped", "observed"]


@dataclass(frozen=True, slots=True)
class ExpectedUnit:
    """What the last applied OSC expects of one unit.

    ``running``: upstream's "enabled" unit; ``stopped``: the OSC stops or disables it
    (``stopped_by`` says which, for the message); ``observed``: the OSC asks nothing of it, only
    a unit stuck activating/deactivating is reported."""

    name: str
    want: Want
    stopped_by: Literal["", "disabled", "stopped"] = ""


def is_template(name: str) -> bool:
    """``foo@.service``: a template, not a unit systemd can load by that name."""
    stem, dot, _suffix = name.rpartition(".")
    return bool(dot) and stem.endswith("@")


def expected_unit(unit: AppliedUnit, agent_unit: str) -> ExpectedUnit:
    name = unit.name
    if name != agent_unit:
        if unit.enable is False:
            return ExpectedUnit(name, "stopped", "disabled")
        if unit.command == "stop":
            return ExpectedUnit(name, "stopped", "stopped")
    carries = unit.content is not None or bool(unit.drop_ins)
    if (
        unit.enable is True
        or (unit.enable is None and carries)
        or unit.command in ("start", "restart")
        or name == agent_unit
    ):
        return ExpectedUnit(name, "running")
    return ExpectedUnit(name, "observed")


def expected_units(applied: Applied, agent_unit: str) -> tuple[ExpectedUnit, ...]:
    """The units to check, sorted by name (upstream's message order)."""
    return tuple(
        expected_unit(unit, agent_unit)
        for name, unit in sorted(applied.units.items())
        if not is_template(name)
    )


def go_seconds(duration: timedelta) -> str:
    """Go's ``Duration.Truncate(time.Second).String()`` of a non-negative duration: ``0s``,
    ``45s``, ``5m0s``, ``1h0m5s``."""
    total = max(0, int(duration.total_seconds()))
    hours, rest = divmod(total, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{seconds}s"
    if minutes:
        return f"{minutes}m{seconds}s"
    return f"{seconds}s"


@dataclass(frozen=True, slots=True)
class UnitCheck:
    """The verdict of one check: ``"<unit>: <what>"`` messages in unit-name order."""

    unhealthy: tuple[str, ...] = ()
    progressing: tuple[str, ...] = ()
    #: crash loops the condition leaves out (upstream's verdict): node-agent's own diagnosis
    looping: tuple[str, ...] = ()

    @property
    def condition(self) -> report.Condition:
        return report.units_condition(self.unhealthy, self.progressing)


_RUNNING_STATES = ("active", "activating", "deactivating", "reloading", "refreshing")


def check_units(
    expected: Iterable[ExpectedUnit],
    states: Mapping[str, UnitState],
    now: datetime,
    stuck_threshold: timedelta,
    held: Mapping[str, str] | None = None,
    *,
    restart_loops: bool = False,
) -> UnitCheck:
    """Judge each expected unit by its state (a unit without a state is skipped). ``held``:
    units the restart-storm guard stopped restarting, with why; their message says so.
    ``restart_loops``: a crash loop makes the condition False (the operator's strictness);
    else it is only in ``looping``, as upstream counts it healthy."""
    unhealthy: list[str] = []
    progressing: list[str] = []
    looping: list[str] = []
    for unit in expected:
        state = states.get(unit.name)
        if state is None:
            continue
        name, active, sub = unit.name, state.active_state, state.sub_state
        if state.load_state != "loaded" and active not in _RUNNING_STATES:
            if unit.want == "running":
                unhealthy.append(f"{name}: not loaded")
            continue
        if active in ("activating", "deactivating"):
            # Restart=always/on-failure services pass through "activating (auto-restart)"
            # between runs: normal operation, unless the runs keep failing.
            if sub == "auto-restart":
                if unit.want == "running" and crash_looping(state):
                    message = f"{name}: failed ({state.result}), restarting"
                    (unhealthy if restart_loops else looping).append(message)
                continue
            since = state.state_change
            took = now - since if since is not None else timedelta(0)
            if took >= stuck_threshold:
                unhealthy.append(f"{name}: stuck in {active} for {go_seconds(took)}")
            else:
                progressing.append(f"{name}: {active} for {go_seconds(took)}")
        elif active == "active":
            if unit.want == "stopped" and not state.triggered_by:
                unhealthy.append(f"{name}: active but should be {unit.stopped_by}")
        elif active == "failed":
            if unit.want == "running":
                unhealthy.append(f"{name}: failed")
        elif active == "inactive" and unit.want == "running":
            # A oneshot that ran, or a service its timer/path/socket starts, rests "dead".
            if sub == "dead" and (state.service_type == "oneshot" or state.triggered_by):
                continue
            unhealthy.append(f"{name}: inactive but should be enabled")
    if held:
        unhealthy = [_degraded(message, held) for message in unhealthy]
    return UnitCheck(tuple(unhealthy), tuple(progressing), tuple(looping))


def crash_looping(state: UnitState) -> bool:
    """Waiting in auto-restart after a failed run, and systemd restarted it before: a unit
    whose start job succeeded but which keeps failing after it (e.g. its binary is missing).
    A unit that failed once and waits for its first restart is given that restart."""
    return state.result not in (None, "", "success") and (state.n_restarts or 0) >= 1


def came_up(state: UnitState | None, now: datetime, up_for: timedelta, held: datetime) -> bool:
    """Came up after ``held`` and has been running (active) for at least ``up_for``: it came
    up by itself and stayed up, not a blink of a unit in a restart loop. A unit held while it
    ran (the health checks' restarts did not heal it) has not come up again."""
    if state is None or state.active_state != "active":
        return False
    since = state.state_change
    return since is not None and since >= held and now - since >= up_for


def _degraded(message: str, held: Mapping[str, str]) -> str:
    name = message.split(": ", 1)[0]
    return f"{message} (degraded: {held[name]})" if name in held else message


@dataclass(frozen=True)
class UnitCheckView:
    """What the last check found, for status and metrics (read-only snapshot)."""

    #: the condition of the last check; None before the first (or without an applied OSC)
    condition: report.Condition | None = None
    checked_at: datetime | None = None
    unhealthy: tuple[str, ...] = ()
    progressing: tuple[str, ...] = ()
    #: crash loops the condition leaves out (upstream's verdict; see ``check_units``)
    looping: tuple[str, ...] = ()
    units: int = 0
    #: the Node carries ``condition`` (False while a write is still to be retried)
    reported: bool = False
    #: why the last check or write failed (None when it worked)
    error: str | None = None
    checks: int = 0
    writes: int = 0


@dataclass
class _NodeSeen:
    """The Node's status as we last read or wrote it."""

    uid: str | None
    resource_version: str
    conditions: list[JSON] = field(default_factory=list)

    @classmethod
    def of(cls, node: Mapping[str, Any]) -> _NodeSeen:
        meta = node.get("metadata") or {}
        status = node.get("status") or {}
        conditions = [c for c in status.get("conditions") or [] if isinstance(c, dict)]
        return cls(meta.get("uid"), str(meta.get("resourceVersion") or ""), conditions)

    def entry(self) -> JSON | None:
        for condition in self.conditions:
            if condition.get("type") == report.CONDITION_UNITS_READY:
                return condition
        return None

    def carries(self, condition: report.Condition) -> bool:
        entry = self.entry()
        return entry is not None and (
            entry.get("status"),
            entry.get("reason"),
            entry.get("message"),
        ) == (condition.status, condition.reason, condition.message)

    def with_entry(self, entry: JSON) -> list[JSON]:
        """The conditions with ours replaced in place (or appended)."""
        out = [
            entry if c.get("type") == report.CONDITION_UNITS_READY else c for c in self.conditions
        ]
        if self.entry() is None:
            out.append(entry)
        return out


class UnitCheckController:
    def __init__(
        self,
        ctx: AgentContext,
        applier: Applier,
        *,
        clock: Callable[[], datetime] = report.now,
        apply_poll: float = APPLY_POLL,
        guard: RestartGuard | None = None,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.applier = applier
        #: the restart-storm guard: a unit it holds is reported degraded, and let go once it
        #: came up by itself; ``on_release`` is then called (the OSC controller retries now)
        self.guard = guard
        self.on_release = on_release
        self.clock = clock
        config = ctx.config.controllers.systemd_unit_check
        self.period = max(MIN_PERIOD, config.sync_period.total_seconds())
        self.stuck_threshold = config.stuck_threshold
        self.apply_poll = apply_poll
        self._poked = Wake()
        #: loop time of the next periodic check
        self._due: float | None = None
        #: the applied checksum the last check saw
        self._checked = ""
        #: (applied checksum, expected units) of the last applied OSC
        self._expected: tuple[str, tuple[ExpectedUnit, ...]] | None = None
        self._seen: _NodeSeen | None = None
        self._view = UnitCheckView()
        self._last_error: str | None = None
        #: units the last check found unhealthy (a Warning Event when one joins)
        self._unhealthy: frozenset[str] = frozenset()

    def poke(self) -> None:
        """Check again now (e.g. an apply finished: the units and their states changed)."""
        self._expected = None
        self._poked.set()

    def view(self) -> UnitCheckView:
        return self._view

    async def run(self) -> None:
        await self.ctx.node_known.wait()
        await run_loop(self._step, self._poked, period=self.period, immediately=True)

    async def _step(self, woken: bool) -> Next:
        """A check at once, on a poke, each period, and as soon as a new OSC was applied: in
        between the loop looks every ``apply_poll`` seconds whether the applied checksum
        changed (a read of memory) and checks only then."""
        loop = asyncio.get_running_loop()
        if not woken and self._due is not None:
            left = self._due - loop.time()
            if left > 0 and await self.ctx.state.applied_checksum_async() == self._checked:
                return Next.after(min(left, self.apply_poll))
        await self.check_once()
        self._due = loop.time() + self.period
        return Next.after(min(self.period, self.apply_poll))

    async def check_once(self) -> UnitCheckView:
        """One check and, if the condition changed, one write; errors are logged and left to
        the next period (never raised)."""
        try:
            expected = await self._expected_units()
            if expected is None:
                await self._release_held({})  # a held unit of a first apply that never finished
                return self._view  # nothing applied yet: no condition (like upstream)
            states = await self._checked_states(expected)
            await self._release_held(states)
            guard = self.guard
            # only a unit held for good (the operator's holdFailingUnits) says so in the
            # condition: a spaced one is retried, and its message stays upstream's
            held = {h.unit: h.reason() for h in guard.view() if not h.spaced} if guard else {}
            verdict = check_units(
                expected,
                states,
                self.clock(),
                self.stuck_threshold,
                held,
                restart_loops=self.ctx.strictness().strict_restart_loops,
            )
            await self._warn_newly_unhealthy((*verdict.unhealthy, *verdict.looping))
            condition = verdict.condition
            self._update(
                condition=condition,
                checked_at=self.clock(),
                unhealthy=verdict.unhealthy,
                progressing=verdict.progressing,
                looping=verdict.looping,
                units=len(expected),
                checks=self._view.checks + 1,
            )
            if self._view.reported and self._known_carries(condition):
                self._update(error=None)
                return self._view
            self._update(reported=False)
            await self._report(condition)
            self._update(reported=True, error=None)
            self._last_error = None
        except (NodeAgentError, OSError) as exc:
            self._failed(exc)
        return self._view

    async def _release_held(self, states: Mapping[str, UnitState]) -> None:
        """Let the restart-storm guard go of held units that came up by themselves. A held
        unit need not be one of the applied OSC's (its apply may not have finished): its state
        is read then too (a systemd call only while a unit is held)."""
        guard = self.guard
        if guard is None or not guard.view():
            return
        missing = [h.unit for h in guard.view() if h.unit not in states]
        if missing:
            states = {**states, **await self._states(missing)}
        now = self.clock()
        released = [
            h.unit
            for h in guard.view()
            if came_up(states.get(h.unit), now, RELEASE_AFTER, datetime.fromtimestamp(h.since, UTC))
            and guard.release(h.unit)
        ]
        if released:
            log.info("units came up by themselves; restarts allowed again", units=released)
            if self.on_release is not None:
                self.on_release()

    async def _warn_newly_unhealthy(self, unhealthy: Sequence[str]) -> None:
        """One Warning Event per unit when it turns unhealthy (not on every check)."""
        by_unit = {message.split(": ", 1)[0]: message for message in unhealthy}
        new = sorted(set(by_unit) - self._unhealthy)
        self._unhealthy = frozenset(by_unit)
        for name in new:
            await self.ctx.event(report.REASON_UNIT_UNHEALTHY, by_unit[name], warning=True)

    # -- reading ----------------------------------------------------------------------------

    async def _expected_units(self) -> tuple[ExpectedUnit, ...] | None:
        checksum = self._checked = await self.ctx.state.applied_checksum_async()
        if not checksum:
            return None
        cached = self._expected
        if cached is not None and cached[0] == checksum:
            return cached[1]
        applied = await asyncio.to_thread(self.applier.last_applied)
        expected = expected_units(applied, self.ctx.settings.agent_unit)
        self._expected = (checksum, expected)
        return expected

    async def _checked_states(self, expected: Sequence[ExpectedUnit]) -> dict[str, UnitState]:
        """The states the verdict needs: the load/active/sub state of every unit in one brief
        call, then everything only of the units the verdict looks closer at: not active, or
        active where the OSC wants them stopped (a trigger of their own may excuse that), and
        those the restart-storm guard holds (when they came up counts). The units that run as
        expected, nearly all of them, cost no per-unit call."""
        names = [u.name for u in expected]
        states = await self._states(names, brief=True)
        stopped = {u.name for u in expected if u.want == "stopped"}
        stopped |= {h.unit for h in self.guard.view()} if self.guard is not None else set()
        closer = [
            n for n in names if n in states and (states[n].active_state != "active" or n in stopped)
        ]
        if closer:
            states.update(await self._states(closer))
        return states

    async def _states(self, names: Sequence[str], *, brief: bool = False) -> dict[str, UnitState]:
        """All states in one call; if systemd refuses the batch (one odd name), unit by unit,
        leaving out those it refuses."""
        systemd = self.ctx.systemd
        try:
            return await systemd.unit_states(names, brief=brief)
        except SystemdError as exc:
            if len(names) < 2 or not isinstance(exc, SystemdCallError):
                raise
        states: dict[str, UnitState] = {}
        for name in names:
            try:
                states.update(await systemd.unit_states([name], brief=brief))
            except SystemdError as exc:
                if not isinstance(exc, SystemdCallError):
                    raise
                log.warning("unit state not readable; left out of the check", unit=name)
        return states

    # -- writing ----------------------------------------------------------------------------

    def _known_carries(self, condition: report.Condition) -> bool:
        seen = self._seen
        return seen is not None and seen.uid == self.ctx.node_uid and seen.carries(condition)

    async def _read_node(self, name: str) -> _NodeSeen:
        self._seen = _NodeSeen.of(await self.ctx.kube.get_node(name))
        return self._seen

    async def _report(self, condition: report.Condition) -> None:
        name = self.ctx.node_name
        assert name is not None
        seen = self._seen
        if seen is None or seen.uid != self.ctx.node_uid:
            seen = await self._read_node(name)  # at start, and after the Node was re-created
        for attempt in range(CONFLICT_ATTEMPTS):
            if seen.carries(condition):
                return
            entry = report.condition_entry(condition, seen.entry(), self.clock())
            patch = {
                # the resourceVersion makes the write a compare-and-swap: the whole list is
                # sent (a merge patch replaces lists), so it must be the list on the Node now
                "metadata": {"resourceVersion": seen.resource_version},
                "status": {"conditions": seen.with_entry(entry)},
            }
            try:
                node = await self.ctx.kube.patch_node_status(name, patch)
            except KubeConflict:
                if attempt + 1 == CONFLICT_ATTEMPTS:
                    raise
                seen = await self._read_node(name)
                continue
            except KubeNotFound:
                self._seen = None
                raise
            self._seen = _NodeSeen.of(node)
            self._update(writes=self._view.writes + 1)
            log.info(
                "systemd units condition reported",
                status=condition.status,
                reason=condition.reason,
                message=condition.message,
            )
            return

    # -- bookkeeping ------------------------------------------------------------------------

    def _update(self, **changes: Any) -> None:
        self._view = dataclasses.replace(self._view, **changes)

    def _failed(self, exc: Exception) -> None:
        text = f"{type(exc).__name__}: {exc}"
        self._update(error=text)
        if isinstance(exc, KubeNotFound):
            self._seen = None
        if text != self._last_error:  # once per distinct error, not every period
            self._last_error = text
            log.warning("systemd unit check not done; retrying next period", error=text)
            self.ctx.health.error("unitcheck", text)
