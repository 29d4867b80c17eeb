"""Health checks of kubelet and containerd, and a watch on the Node's readiness flapping.

Every ``nodeAgent.healthCheck.syncPeriod`` (20 s) both components are checked side by side, each
bounded by ``timeout`` (10 s):

- kubelet: ``GET`` its ``/healthz``; healthy is a 200. No proxy from the environment, a fresh
  connection per check. The URL is ``kubeletHealthz`` when set, else where this kubelet serves
  it: ``--healthz-bind-address``/``--healthz-port`` of the OSC's kubelet unit, else
  ``healthzBindAddress``/``healthzPort`` of its config file (``--config``, Gardener's
  ``/var/lib/kubelet/config/kubelet``), else kubelet's defaults, ``127.0.0.1:10248``. A
  ``healthzPort`` of 0 switches kubelet's endpoint off, and with it this check (upstream would
  restart such a kubelet every minute).
- containerd: one real gRPC call on its socket (``containerdSocket``), ``Version``, as
  upstream's check makes; see :mod:`node_agent.containerd.ping` for why not ``ctr`` or a bare
  ``connect()``.

A component is checked only while its unit (``kubelet.service``, ``containerd.service``) is a
unit of the last applied OSC: named in its ``units`` (with or without content: Gardener's
``containerd.service`` has no content, only ``filePaths`` and a drop-in) or derived from it
(``criConfig`` adds containerd's drop-in); one whose ``command`` is ``stop`` is meant to be down.
A unit systemd does not know is not checked either (nothing could restart it).

What happens, per component (Event reasons are upstream's: the component's name):

- first failed check: a Warning Event (``<Component> is unhealthy: <error>``);
- failing for ``restartAfter`` (1 min) since then: a Warning Event, the unit is restarted through
  :meth:`HealthCheckController.restart` (the only path, with its ``SystemDUnitRestart`` Event),
  and it gets ``restartAfter`` again before another restart;
- somebody else restarted the unit meanwhile (its InvocationID changed: an OSC apply, the restart
  annotation, systemd's ``Restart=``): it gets ``restartAfter`` again from then, so the check
  never restarts a unit that was just restarted;
- an apply in progress defers a due restart (the apply owns the units; see ``applying``);
- the first healthy check after failures: a Normal Event (``<Component> is healthy``).

The Node's ``Ready`` condition is followed through the Node controller's watch (its observer
hook, no watch of its own): ``READY_TOGGLES_MAX`` NotReady->Ready transitions within
``READY_TOGGLES_WINDOW_SECONDS`` give one Warning Event suggesting a reboot, and no other until
the count fell below the threshold again.

:meth:`HealthCheckController.view` is a frozen snapshot for ``status`` and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import Enum
from typing import Any, Protocol

from node_agent.apply.restart_guard import RestartGuard
from node_agent.base.durations import format_duration
from node_agent.base.errors import NodeAgentError
from node_agent.base.log import get_logger
from node_agent.base.loop import DONE, SKIPPED, Next, Wake, run_loop
from node_agent.config import HealthCheckConfig
from node_agent.containerd.ping import PingError, containerd_version
from node_agent.context import AgentContext
from node_agent.kube import report
from node_agent.osc.applied import Applied, AppliedUnit
from node_agent.osc.inplace import InPlaceError, read_kubelet_config
from node_agent.systemd import JobResult, UnitState

log = get_logger("node-agent.healthcheck")

KUBELET_UNIT = "kubelet.service"
KUBELET_CONFIG_FILE = "/var/lib/kubelet/config/kubelet"  # Gardener's, when the unit names none
KUBELET_HEALTHZ_ADDRESS, KUBELET_HEALTHZ_PORT = "127.0.0.1", 10248  # kubelet's defaults
_KUBELET_FLAG = re.compile(r"--(config|healthz-port|healthz-bind-address)(?:=|\s+)(\S+)")
CONTAINERD_UNIT = "containerd.service"
REASON_RESTART = report.REASON_UNIT_COMMAND["restart"]
REASON_RESTARTS_SUSPENDED = report.REASON_RESTARTS_SUSPENDED
#: An unfinished apply older than this no longer defers restarts: it is stuck retrying, and a
#: hung kubelet must not wait for it forever.
STUCK_APPLY_SECONDS = 600.0
_ERROR_LIMIT = 300  # characters of a probe's error kept and reported

#: A probe: None when healthy, else one line saying what failed. Never raises.
Probe = Callable[[], Awaitable[str | None]]


class AppliedSource(Protocol):
    """Where the last applied OSC's items come from (the Applier)."""

    def applied_checksum(self) -> str: ...

    def last_applied(self) -> Applied: ...


@dataclass(frozen=True)
class Component:
    name: str  # also the Event reason, as upstream
    unit: str
    title: str  # how Event messages name it


KUBELET = Component(report.REASON_HEALTH_KUBELET, KUBELET_UNIT, "Kubelet")
CONTAINERD = Component(report.REASON_HEALTH_CONTAINERD, CONTAINERD_UNIT, "Containerd")


class Verdict(Enum):
    HEALTHY = "healthy"
    RECOVERED = "recovered"
    FIRST_FAILURE = "first-failure"
    FAILING = "failing"
    RESTART_DUE = "restart-due"


@dataclass
class Tracker:
    """One component's failure history (pure: times are passed in, monotonic seconds)."""

    restart_after: float
    managed: bool = False
    healthy: bool | None = None  # None: not checked (yet)
    failing_since: float | None = None  # first failed check of the current failure
    countdown_from: float | None = None  # when the wait for a restart (re)started
    last_error: str | None = None
    last_check: float | None = None
    restarts: int = 0
    last_restart: float | None = None
    invocation: str = ""  # the unit's InvocationID as last seen ("" unknown)

    def observe(self, now: float, error: str | None, invocation: str = "") -> Verdict:
        """One check's result; ``invocation`` is the unit's InvocationID at the check."""
        restarted_elsewhere = bool(invocation and self.invocation and invocation != self.invocation)
        if invocation:
            self.invocation = invocation
        self.last_check = now
        if error is None:
            was_failing = self.failing_since is not None
            self.healthy, self.last_error = True, None
            self.failing_since = self.countdown_from = None
            return Verdict.RECOVERED if was_failing else Verdict.HEALTHY
        self.healthy, self.last_error = False, error
        if self.failing_since is None or self.countdown_from is None:
            self.failing_since = self.countdown_from = now
            return Verdict.FIRST_FAILURE
        if restarted_elsewhere:
            self.countdown_from = now  # restarted by someone else: give it restart_after
            return Verdict.FAILING
        if now - self.countdown_from >= self.restart_after:
            return Verdict.RESTART_DUE
        return Verdict.FAILING

    def restarted(self, now: float) -> None:
        """A restart was attempted (done or not): wait restart_after before the next one. The
        new InvocationID it brings is adopted at the next check, not taken for someone else's
        restart."""
        self.restarts += 1
        self.last_restart = now
        self.countdown_from = now
        self.invocation = ""

    def forget(self) -> None:
        """Not checked any more (unit left the OSC, or is not loaded): no failure in progress."""
        self.healthy = None
        self.failing_since = self.countdown_from = None
        self.last_error = None
        self.invocation = ""


@dataclass
class ReadyToggles:
    """NotReady->Ready transitions of the Node in a sliding window (pure, monotonic seconds).

    Unlike upstream, the first Ready seen after the agent started is not a transition (the state
    before it is unknown), and the warning is given once per episode, not on every further
    transition."""

    window: float = report.READY_TOGGLES_WINDOW_SECONDS
    threshold: int = report.READY_TOGGLES_MAX
    ready: bool | None = None
    toggles: deque[float] = field(default_factory=deque)
    warned: bool = False

    def observe(self, now: float, ready: bool) -> bool:
        """The Node's readiness now; True when the warning is due (once per episode)."""
        previous, self.ready = self.ready, ready
        if previous is False and ready:
            self.toggles.append(now)
        return self.due(now)

    def due(self, now: float) -> bool:
        while self.toggles and now - self.toggles[0] > self.window:
            self.toggles.popleft()
        if len(self.toggles) < self.threshold:
            self.warned = False
            return False
        if self.warned:
            return False
        self.warned = True
        return True


def node_ready(node: Mapping[str, Any]) -> bool | None:
    """The Node's Ready condition: True, False (False or Unknown), None when it has none."""
    for condition in (node.get("status") or {}).get("conditions") or ():
        if isinstance(condition, Mapping) and condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return None


def managed_units(applied: Applied) -> frozenset[str]:
    """The units of an applied OSC the health checks may act on: every unit it names (content,
    drop-ins only, or neither) except those it asks to be stopped."""
    return frozenset(name for name, unit in applied.units.items() if unit.command != "stop")


def kubelet_healthz_url(unit: AppliedUnit | None, config: bytes | None) -> str | None:
    """Where kubelet serves ``/healthz``: its flags in the unit (and drop-ins) win over its config
    file (``config``: its bytes), as in kubelet; None when the port is 0 (switched off)."""
    flags = kubelet_flags(unit)
    settings: Mapping[str, Any] = {}
    if config:
        # the in-place update's reader: bounded, and only InPlaceError for any file
        with contextlib.suppress(InPlaceError):
            settings = read_kubelet_config(config)
    # a list or mapping is not a setting: never turned into text (aliases make it huge)
    address = flags.get("healthz-bind-address", _plain(settings.get("healthzBindAddress")))
    port = flags.get("healthz-port", _plain(settings.get("healthzPort")))
    text = "" if port is None else str(port)
    try:  # kubelet's parser takes ASCII digits only (int() takes any script's)
        number = int(text) if text.isascii() and text else KUBELET_HEALTHZ_PORT
    except ValueError:
        number = KUBELET_HEALTHZ_PORT
    if number == 0:
        return None
    host = str(address or KUBELET_HEALTHZ_ADDRESS)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = ipaddress.ip_address(KUBELET_HEALTHZ_ADDRESS)
    if ip.is_unspecified:  # listening everywhere: ask on loopback
        ip = ipaddress.ip_address("::1" if ip.version == 6 else KUBELET_HEALTHZ_ADDRESS)
    shown = f"[{ip}]" if ip.version == 6 else str(ip)
    return f"http://{shown}:{number}/healthz"


def _plain(value: object) -> object:
    return None if isinstance(value, list | dict) else value


def kubelet_flags(unit: AppliedUnit | None) -> dict[str, str]:
    """``--config``, ``--healthz-port``, ``--healthz-bind-address`` from the unit's text (the
    last one wins, as drop-ins come after the unit)."""
    if unit is None:
        return {}
    flags: dict[str, str] = {}
    for text in (unit.content or "", *unit.drop_ins.values()):
        for match in _KUBELET_FLAG.finditer(text):
            flags[match[1]] = match[2].strip("\"'")
    return flags


def _short(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _ERROR_LIMIT else line[: _ERROR_LIMIT - 3] + "..."


def _duration(seconds: float) -> str:
    return format_duration(timedelta(seconds=round(max(seconds, 0.0))))


class KubeletProbe:
    """``GET`` kubelet's ``/healthz``: healthy is a 200 within ``timeout``."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url, self.timeout = url, timeout  # url: set from the applied OSC unless configured
        self._session: Any = None

    async def __call__(self) -> str | None:
        import aiohttp

        if self._session is None:
            # A fresh connection per check (a restarted kubelet leaves no stale pooled one
            # behind) and no proxy from the environment: 127.0.0.1 is this node's kubelet.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True, limit=1),
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                trust_env=False,
            )
        try:
            async with self._session.get(self.url, allow_redirects=False) as response:
                if response.status == 200:
                    return None
                body = (await response.content.read(200)).decode(errors="replace").strip()
                return f"GET {self.url}: HTTP {response.status}" + (f": {body}" if body else "")
        except TimeoutError:
            return f"GET {self.url}: no answer within {self.timeout:g}s"
        except aiohttp.ClientError as exc:
            return f"GET {self.url}: {exc or type(exc).__name__}"

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


class ContainerdProbe:
    """containerd's ``Version`` over its socket within ``timeout``."""

    def __init__(self, socket_path: str, timeout: float) -> None:
        self.socket_path, self.timeout = socket_path, timeout

    async def __call__(self) -> str | None:
        try:
            await containerd_version(self.socket_path, self.timeout)
        except PingError as exc:
            return str(exc)
        return None


@dataclass(frozen=True)
class ComponentHealth:
    """One component as the last check saw it."""

    name: str
    unit: str
    managed: bool  # its unit is one of the last applied OSC (only then is it checked)
    healthy: bool | None  # None: not checked (not managed, not loaded, or not yet)
    failing_since: datetime | None
    last_error: str | None
    restarts: int  # restarts this agent made for it
    last_restart: datetime | None
    last_check: datetime | None


@dataclass(frozen=True)
class HealthCheckView:
    enabled: bool
    components: tuple[ComponentHealth, ...]
    ready_toggles: int  # NotReady->Ready transitions within the window
    reboot_suggested: bool  # the warning of the current episode was given


class HealthCheckController:
    def __init__(
        self,
        ctx: AgentContext,
        applied: AppliedSource,
        *,
        probes: Mapping[str, Probe] | None = None,
        applying: Callable[[], bool] | None = None,
        guard: RestartGuard | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """``probes``: per component name (tests); ``applying``: whether an OSC apply is running
        now (else an unfinished apply journal younger than ``STUCK_APPLY_SECONDS`` counts)."""
        self.ctx = ctx
        self.applied = applied
        self.config: HealthCheckConfig = ctx.config.node_agent.health_check
        timeout = self.config.timeout.total_seconds()
        socket_path = str(ctx.settings.root / self.config.containerd_socket.lstrip("/"))
        self.kubelet_probe = KubeletProbe(self.config.kubelet_healthz, timeout)
        self.probes: dict[str, Probe] = {
            KUBELET.name: self.kubelet_probe,
            CONTAINERD.name: ContainerdProbe(socket_path, timeout),
        }
        self.probes.update(probes or {})
        self.components = (KUBELET, CONTAINERD)
        restart_after = self.config.restart_after.total_seconds()
        self.trackers = {c.name: Tracker(restart_after) for c in self.components}
        self.toggles = ReadyToggles()
        self.checks = 0
        self._applying = applying
        #: the restart-storm guard shared with the applier: a restart that did not heal the
        #: component counts as failed, and a held unit is not restarted
        self.guard = guard
        #: units whose last due restart the guard refused (so no restart of ours failed since)
        self._refused: set[str] = set()
        self._clock, self._wall = clock, wall
        self._managed: frozenset[str] = frozenset()
        #: kubelet's /healthz: configured, or derived from the applied OSC (None: switched off)
        self.kubelet_url: str | None = self.config.kubelet_healthz or None
        self._managed_for: str | None = None  # applied checksum _managed was derived from
        self._reboot_due = False
        self._wake = Wake()
        self._next_round: float | None = None  # loop time of the next round of checks

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        if not self.config.enabled:
            log.info("health checks disabled")
            return
        period = self.config.sync_period.total_seconds()
        try:
            await run_loop(self._step, self._wake, period=period, immediately=True)
        finally:
            await self.kubelet_probe.close()

    async def _step(self, woken: bool) -> Next:
        """A round of checks each period. A wake-up in between (the Node's readiness is
        flapping) only gets the reboot suggestion out; the next round stays where it was."""
        loop = asyncio.get_running_loop()
        if self._next_round is not None:
            await self.report_toggles()
            left = self._next_round - loop.time()
            if left > 0:
                return Next.after(left)
        period = self.config.sync_period.total_seconds()
        try:
            await self.check_once()
        except NodeAgentError as exc:  # e.g. the applied OSC unreadable: next period
            log.warning("health checks not done", error=str(exc))
            self.ctx.health.error("health-check", str(exc))
            answer = SKIPPED
        else:
            self.ctx.health.progress("health-check")
            answer = DONE
        self._next_round = loop.time() + period
        return answer

    async def kubelet_health(self) -> str | None:
        """The kubelet's ``/healthz`` now, as these checks ask it (an in-place update awaits a
        healthy kubelet with it): its URL looked up again from the applied OSC first. None:
        healthy, or no endpoint to ask (healthzPort 0)."""
        await self.managed()
        if not self.kubelet_url:
            return None
        return await self.probes[KUBELET.name]()

    async def check_once(self) -> None:
        """One round: both components checked side by side, then acted on."""
        self.checks += 1
        managed = await self.managed()
        units = [c.unit for c in self.components if c.unit in managed]
        states = await self._unit_states(units)
        await asyncio.gather(*(self._check(c, managed, states) for c in self.components))
        await self.report_toggles()

    async def managed(self) -> frozenset[str]:
        """Units of the last applied OSC (read again only when its checksum changed)."""
        checksum = await asyncio.to_thread(self.applied.applied_checksum)
        if checksum != self._managed_for:
            applied = await asyncio.to_thread(self.applied.last_applied)
            self._managed, self._managed_for = managed_units(applied), checksum
            if not self.config.kubelet_healthz:
                self.kubelet_url = await asyncio.to_thread(self._kubelet_url, applied)
                if KUBELET_UNIT in self._managed:
                    url = self.kubelet_url or "off (healthzPort 0)"
                    log.info("kubelet health endpoint", url=url)
            self.kubelet_probe.url = self.kubelet_url or ""
        return self._managed

    def _kubelet_url(self, applied: Applied) -> str | None:
        unit = applied.units.get(KUBELET_UNIT)
        path = kubelet_flags(unit).get("config", KUBELET_CONFIG_FILE)
        try:
            config = self.ctx.fs.read(path)
        except (NodeAgentError, OSError) as exc:
            log.warning("kubelet config not read", path=path, error=str(exc))
            config = None
        return kubelet_healthz_url(unit, config)

    async def _unit_states(self, units: Sequence[str]) -> dict[str, UnitState]:
        if not units:
            return {}
        try:
            async with asyncio.timeout(self.config.timeout.total_seconds()):
                return await self.ctx.systemd.unit_states(units)
        except (NodeAgentError, TimeoutError) as exc:
            # Checked anyway, without the InvocationID (a restart is then judged by time only).
            log.warning("unit states not read", units=list(units), error=str(exc) or "timeout")
            return {}

    async def _check(
        self, component: Component, managed: frozenset[str], states: Mapping[str, UnitState]
    ) -> None:
        tracker = self.trackers[component.name]
        if component.unit not in managed:
            if tracker.managed:
                log.info("not checked any more: unit not in the applied OSC", unit=component.unit)
            tracker.managed = False
            tracker.forget()
            return
        tracker.managed = True
        state = states.get(component.unit)
        off = component is KUBELET and self.kubelet_url is None
        if off or (state is not None and not state.exists):
            tracker.forget()
            return
        error = await self._probe(component)
        verdict = tracker.observe(self._clock(), error, state.invocation_id if state else "")
        if verdict is Verdict.FIRST_FAILURE:
            log.warning("unhealthy", component=component.name, error=error)
            await self.ctx.event(
                component.name, f"{component.title} is unhealthy: {error}", warning=True
            )
        elif verdict is Verdict.RECOVERED:
            log.info("healthy again", component=component.name)
            if self.guard is not None:
                self.guard.record(component.unit, ok=True)
            await self.ctx.event(component.name, f"{component.title} is healthy")
        elif verdict is Verdict.RESTART_DUE:
            if await self.apply_in_progress():
                log.info("restart deferred: an OSC apply is in progress", unit=component.unit)
                return
            await self.restart(component, error or "")

    async def _probe(self, component: Component) -> str | None:
        try:
            error = await self.probes[component.name]()
        except Exception as exc:  # a probe must not stop the checks; it is reported instead
            error = f"check failed: {type(exc).__name__}: {exc}"
        return None if error is None else _short(error)

    async def apply_in_progress(self) -> bool:
        if self._applying is not None:
            return self._applying()
        pending = await self.ctx.state.pending_async()
        if pending is None:
            return False
        return self._wall() - pending.started_at.timestamp() < STUCK_APPLY_SECONDS

    async def restart(self, component: Component, error: str) -> JobResult | None:
        """The only way the health checks restart a unit: one of the last applied OSC, with a
        Warning Event before and the ``SystemDUnitRestart`` Event of the outcome after. Returns
        the job's result (None when refused or when systemd did not take the job)."""
        if component.unit not in self._managed:
            log.warning("restart refused: unit not in the applied OSC", unit=component.unit)
            return None
        tracker = self.trackers[component.name]
        if self.guard is not None:
            since, last = tracker.failing_since, tracker.last_restart
            refused_before = component.unit in self._refused
            if since is not None and last is not None and last >= since and not refused_before:
                # still failing since the last restart: that restart did not heal it
                held = self.guard.record(component.unit, ok=False, error=error)
                if held is not None:
                    await self.ctx.event(REASON_RESTARTS_SUSPENDED, held.describe(), warning=True)
            if not self.guard.allows(component.unit):
                log.warning("restart suspended by the restart-storm guard", unit=component.unit)
                tracker.restarted(self._clock())  # ask again only after restart_after
                self._refused.add(component.unit)  # no restart ran: none failed to heal it
                return None
            self._refused.discard(component.unit)
        after = _duration(tracker.restart_after)
        log.warning("restarting an unhealthy unit", unit=component.unit, error=error)
        await self.ctx.event(
            component.name,
            f"{component.title} is unhealthy for more than {after}, restarting it: {error}",
            warning=True,
        )
        result: JobResult | None = None
        try:
            result = await self.ctx.systemd.restart_unit(
                component.unit, job_timeout=self.ctx.settings.systemd_job_timeout
            )
        except NodeAgentError as exc:
            ok, text = False, f"restart {component.unit}: {exc}"
        else:
            ok, text = result.ok, result.describe()
        tracker.restarted(self._clock())
        if not ok:
            log.warning("restart failed", unit=component.unit, detail=text)
            if self.guard is not None:
                held = self.guard.record(component.unit, ok=False, error=text)
                if held is not None:
                    await self.ctx.event(REASON_RESTARTS_SUSPENDED, held.describe(), warning=True)
        await self.ctx.event(REASON_RESTART, text, warning=not ok)
        return result

    # -- the Node's readiness ---------------------------------------------------------------

    def node_seen(self, node: Mapping[str, Any]) -> None:
        """Observer of the Node controller's watch: every version of the Node it sees."""
        if not self.config.enabled:
            return
        ready = node_ready(node)
        if ready is not None and self.toggles.observe(self._clock(), ready):
            self._reboot_due = True
            self._wake.set()

    async def report_toggles(self) -> None:
        """The reboot suggestion, once per episode, when kubelet is a unit of the OSC."""
        if not self._reboot_due:
            return
        self._reboot_due = False
        if KUBELET_UNIT not in self._managed:
            log.info("node readiness flapping; kubelet not managed by the OSC, no Event")
            return
        window = _duration(self.toggles.window)
        log.warning("node readiness flapping", toggles=len(self.toggles.toggles), window=window)
        await self.ctx.event(
            KUBELET.name,
            f"Kubelet toggled between NotReady and Ready at least {self.toggles.threshold} "
            f"times in a {window} time window. Rebooting the node might help",
            warning=True,
        )

    # -- the read side ----------------------------------------------------------------------

    def view(self) -> HealthCheckView:
        now, wall = self._clock(), self._wall()

        def at(moment: float | None) -> datetime | None:
            if moment is None:
                return None
            return datetime.fromtimestamp(wall - (now - moment), tz=UTC)

        components = tuple(
            ComponentHealth(
                name=c.name,
                unit=c.unit,
                managed=t.managed,
                healthy=t.healthy,
                failing_since=at(t.failing_since),
                last_error=t.last_error,
                restarts=t.restarts,
                last_restart=at(t.last_restart),
                last_check=at(t.last_check),
            )
            for c in self.components
            for t in (self.trackers[c.name],)
        )
        recent = sum(1 for t in self.toggles.toggles if now - t <= self.toggles.window)
        return HealthCheckView(
            enabled=self.config.enabled,
            components=components,
            ready_toggles=recent,
            reboot_suggested=self.toggles.warned,
        )
