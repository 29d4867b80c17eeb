"""Process life cycle: exit when the hostname changes, and the systemd watchdog's health rule.

**Hostname.** The agent found its Node, Lease and (host-specific) OSC files through the hostname
it had at start. If the hostname changes (cloud-init, DHCP, an operator), everything it does
would target the wrong Node, so it logs and exits with ``EXIT_HOSTNAME_CHANGED``; systemd's
``Restart=always`` starts it again with the new name. Exiting (instead of restarting the own unit
over D-Bus) also works when systemd or D-Bus is unhealthy and needs no special case in tests.
The kernel's value is read from ``/proc/sys/kernel/hostname`` (the same as ``gethostname``)
every 30 s, which costs one small read.

**Watchdog.** ``WATCHDOG=1`` must mean "the agent is working", not just "the process exists".
:func:`watchdog_ok` holds when the event loop is responsive (the pinging task woke roughly on
time) and every required loop marked progress recently. The lease loop marks ``lease-tick`` on
every tick, whether or not the API server answered: an unreachable API server is not a reason
for systemd to kill the agent, a stuck loop is.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from node_agent.base.errors import SystemdWorkerDied
from node_agent.base.log import get_logger

if TYPE_CHECKING:
    from node_agent.context import AgentContext
    from node_agent.systemd.types import JobResult

log = get_logger("node-agent.lifecycle")

EXIT_HOSTNAME_CHANGED = 3
#: How long the agent waits for its own SIGTERM once its unit's restart took its systemd worker
#: down with it (the restart under way); past this the worker's death is an error after all.
SELF_RESTART_GRACE = 30.0
HOSTNAME_POLL = 30.0
HOSTNAME_FILE = "/proc/sys/kernel/hostname"


class HostnameChanged(Exception):
    """Raised to end the agent: it must restart under its new hostname."""

    exit_code = EXIT_HOSTNAME_CHANGED

    def __init__(self, old: str, new: str) -> None:
        super().__init__(f"hostname changed from {old!r} to {new!r}")
        self.old = old
        self.new = new


def current_hostname() -> str:
    try:
        with open(HOSTNAME_FILE, encoding="utf-8") as handle:
            name = handle.read().strip()
    except OSError:
        name = ""
    return name or socket.gethostname()


async def watch_hostname(
    *,
    poll: float = HOSTNAME_POLL,
    read: Callable[[], str] = current_hostname,
    initial: str | None = None,
) -> None:
    """Return never; raise :class:`HostnameChanged` once the hostname differs from ``initial``
    (default: the hostname when this starts)."""
    start = initial if initial is not None else read()
    while True:
        await asyncio.sleep(poll)
        now = read()
        if now != start:
            log.error(
                "hostname changed; exiting so that systemd restarts the agent", old=start, new=now
            )
            raise HostnameChanged(start, now)


#: Loops whose progress the watchdog requires, with how stale their last mark may be (seconds).
WATCHDOG_REQUIRED: dict[str, float] = {"lease-tick": 35.0}


def watchdog_ok(
    last_progress: Mapping[str, float],
    *,
    now: float,
    started: float,
    loop_lag: float,
    max_lag: float,
    required: Mapping[str, float] = WATCHDOG_REQUIRED,
) -> tuple[bool, str]:
    """Whether to send ``WATCHDOG=1`` now, and why not. Times are ``time.monotonic`` values.

    A loop that never marked progress is judged from ``started`` (it gets one grace period).
    """
    if loop_lag > max_lag:
        return False, f"event loop lagging {loop_lag:.1f}s"
    for name, stale in required.items():
        last = last_progress.get(name, started)
        if now - last > stale:
            return False, f"loop {name} made no progress for {now - last:.0f}s"
    return True, ""


async def watchdog_pings(
    interval: float,
    ping: Callable[[], object],
    last_progress: Mapping[str, float],
    *,
    required: Mapping[str, float] = WATCHDOG_REQUIRED,
) -> None:
    """Ping every ``interval`` seconds while :func:`watchdog_ok` holds."""
    started = time.monotonic()
    warned = False
    while True:
        before = time.monotonic()
        await asyncio.sleep(interval)
        now = time.monotonic()
        ok, why = watchdog_ok(
            last_progress,
            now=now,
            started=started,
            loop_lag=now - before - interval,
            max_lag=interval,
            required=required,
        )
        if ok:
            ping()
            warned = False
        elif not warned:
            log.error("withholding the systemd watchdog ping", reason=why)
            warned = True


async def restart_own_unit(ctx: AgentContext, **job: Any) -> JobResult:
    """Restart the agent's own unit through systemd.

    systemd stops the unit's whole control group at once, the agent's systemd worker with it,
    and the worker often dies before this process gets its own SIGTERM: that is the restart
    under way, not a failure to report. It is said at info level and this waits for the
    SIGTERM, which cancels the wait; a worker that died for another reason (no SIGTERM within
    ``SELF_RESTART_GRACE``) is raised then."""
    try:
        return await ctx.systemd.restart_unit(ctx.settings.agent_unit, **job)
    except SystemdWorkerDied as exc:
        log.info(
            "own restart under way: the systemd worker stopped with the unit",
            unit=ctx.settings.agent_unit,
            detail=str(exc),
        )
        await asyncio.sleep(SELF_RESTART_GRACE)
        raise
