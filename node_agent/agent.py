"""The running agent: builds the seams, finds its Node, runs every controller in one TaskGroup.

A controller that crashes takes the agent down (systemd restarts it) rather than leaving a
half-working agent behind; transient errors are handled inside each controller. SIGTERM and
SIGINT cancel the group, so every controller unwinds through its ``finally`` blocks, and the
process exits 0 within a bounded time.

A start is for applying the pending OSC: what can wait (the Lease, the health checks, the unit
check, the certificate's check, the probe and metrics ports) starts once the OSC controller's
first reconcile ended, or after ``FIRST_RECONCILE_HEAD_START`` (:func:`after_first_reconcile`).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent import __version__
from node_agent.apply.applier import Applier
from node_agent.apply.restart_guard import RestartGuard
from node_agent.base.errors import NodeAgentError
from node_agent.base.log import get_logger
from node_agent.base.sdnotify import Notifier
from node_agent.base.selfexe import own_executable
from node_agent.config import AgentSettings, NodeAgentConfiguration
from node_agent.containerd.expand import ContainerdExpander
from node_agent.containerd.images import CtrImages, ImageStore
from node_agent.context import AgentContext
from node_agent.controllers.certificate import CertificateController
from node_agent.controllers.healthcheck import HealthCheckController
from node_agent.controllers.lease import LeaseController
from node_agent.controllers.lifecycle import HostnameChanged, watch_hostname, watchdog_pings
from node_agent.controllers.node import NodeController
from node_agent.controllers.osc.controller import OSCController
from node_agent.controllers.token import TokenController
from node_agent.controllers.unitcheck import UnitCheckController
from node_agent.host import selfupdate
from node_agent.host.fs import HostFS
from node_agent.host.state import StateStore
from node_agent.kube import report
from node_agent.observe.observations import ApplyObservations, ObservedStateStore
from node_agent.observe.readside import Observability
from node_agent.observe.view import Sources
from node_agent.systemd import SystemdSeam
from node_agent.systemd.client import EarlySystemd, start_early

log = get_logger("node-agent")
#: From SIGTERM to exit: controllers unwind, clients close; past this the process exits anyway.
SHUTDOWN_TIMEOUT = 9.0
#: While waiting for its first certificate, each sign of life extends systemd's start timeout by
#: this much (microseconds): the wait may take minutes, and it is progress, not a hang.
CERTIFICATE_WAIT_EXTENSION_US = 60_000_000
#: At most this long (seconds) the parts that can wait give the OSC controller's first reconcile.
FIRST_RECONCILE_HEAD_START = 2.0

# Extra controllers register here (name, factory); each factory returns the coroutine to run.
ControllerFactory = Callable[[AgentContext], Coroutine[Any, Any, None]]
EXTRA_CONTROLLERS: list[tuple[str, ControllerFactory]] = []


class _Shutdown(Exception):
    """Raised by the signal task to cancel every controller in the TaskGroup."""


@dataclass(frozen=True)
class Agent:
    """The agent's parts, wired once: what ``run_agent`` runs and what tests drive."""

    ctx: AgentContext
    applier: Applier
    osc: OSCController
    lease: LeaseController
    node: NodeController
    token: TokenController
    health: HealthCheckController  # kubelet's and containerd's health checks
    unitcheck: UnitCheckController  # the SystemdUnitsReady condition
    sources: Sources  # what status, health and metrics read of them


def build_agent(
    ctx: AgentContext,
    *,
    images: ImageStore | None,
    expander: Callable[[HostFS], ContainerdExpander] | None = ContainerdExpander,
    sources: Sources | None = None,
) -> Agent:
    """The applier and the controllers on ``ctx``'s seams. ``images``: where imageRef files come
    from (the daemon: the node's containerd through ``ctr``); ``expander``: what the agent
    derives from an OSC (containerd's config from ``criConfig``), None for the OSC as it is;
    ``sources``: the read side's registry, filled in with the controllers (a new one if None)."""
    limits = ctx.config.node_agent.restart_guard
    guard = RestartGuard(
        max_restarts=limits.max_restarts,
        window=limits.window.total_seconds(),
        hold=lambda: ctx.strictness().strict_hold_failing_units,
    )
    applier = build_applier(
        ctx.fs,
        ctx.state,
        ctx.systemd,
        ctx.settings,
        host_name=ctx.host_name,
        images=images,
        expander=expander,
        guard=guard,
    )
    osc = OSCController(ctx, applier)
    lease = LeaseController(ctx)  # its own client and connection pool (see the module)
    node = NodeController(ctx, on_recreated=osc.node_recreated)
    token = TokenController(ctx)
    health = HealthCheckController(ctx, applier, applying=lambda: osc.applying, guard=guard)
    node.observers.append(health.node_seen)  # the Node's Ready condition, from its watch
    node.observers.append(osc.inplace.node_seen)  # the drain gate of an in-place update
    osc.inplace.resync_tokens.extend(sync.sync for sync in token.syncs)
    osc.inplace.kubelet_health = health.kubelet_health  # the same probe as the checks
    node.observers.append(osc.node_seen)  # its reconciliation delay, without a GET per update
    if sources is None:
        sources = Sources(watches=ctx.watches)
    sources.osc, sources.lease, sources.node = osc, lease, node
    unitcheck = UnitCheckController(ctx, applier, guard=guard, on_release=osc.retry_now)
    osc.on_applied.append(unitcheck.poke)  # units a new OSC (re)started are judged at once
    sources.unitcheck, sources.healthcheck = unitcheck, health
    sources.gate, sources.guard, sources.rollout = osc.gate, guard, osc.rollout
    sources.in_place = osc.inplace
    return Agent(ctx, applier, osc, lease, node, token, health, unitcheck, sources)


def build_applier(
    fs: HostFS,
    state: StateStore,
    systemd: SystemdSeam | None,
    settings: AgentSettings,
    *,
    host_name: str,
    images: ImageStore | None,
    expander: Callable[[HostFS], ContainerdExpander] | None = ContainerdExpander,
    guard: RestartGuard | None = None,
) -> Applier:
    """The apply pipeline, the same for the daemon, the tests and ``node-agent apply``."""
    derive = expander(fs) if expander is not None else None
    return Applier(
        fs,
        state,
        systemd,
        host_name=host_name,
        agent_unit=settings.agent_unit,
        job_timeout=settings.systemd_job_timeout,
        images=images,
        expand=derive,  # containerd's config.toml, certs.d and drop-in from criConfig
        prepare=derive.prepare if derive is not None else None,
        # derived items held back (a mirror not up yet) are checked again sooner
        held_back=(lambda: derive.held_back) if derive is not None else None,
        # derived files that could not be made (config.toml not TOML): failed items, kept as is
        not_derived=(lambda: derive.failed) if derive is not None else None,
        keep_previous=own_binaries(settings.root),  # kept as <path>.previous on self-update
        guard=guard,  # the restart-storm guard, shared with the health checks
    )


def own_binaries(root: Path) -> tuple[str, ...]:
    """The single file this agent runs from, as a host path (only when the host is ``/``)."""
    own = own_executable()
    return (own,) if own and Path(root) == Path("/") else ()


def host_path(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


async def find_node(ctx: AgentContext, poll: float = 10.0) -> None:
    """The Node is this host's: named like the lowercased hostname (the kubelet's default).

    Until the kubelet registered it (it is installed by the first OSC apply), keep looking
    (the OSC controller also looks once before each apply, so that an apply done once the
    Node exists is reported with its Events).
    """
    while not await ctx.look_up_node():
        # until the next lookup, or at once when the OSC controller's found it
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(poll):
                await ctx.node_known.wait()


async def after_first_reconcile(
    ctx: AgentContext,
    start: Callable[[], Awaitable[None]],
    head_start: float = FIRST_RECONCILE_HEAD_START,
) -> None:
    """Run ``start`` once the OSC controller's first reconcile ended, or after ``head_start``
    seconds, whichever comes first.

    Why: every controller's first action competes with the first apply for the one event loop,
    the API connection and the one systemd worker, and none of them is urgent within seconds.
    The bound keeps a long first reconcile (image pulls, an in-place update, a reconciliation
    delay) from holding them back. Not for the Node's lookup and watch (the reconcile reads the
    reconciliation delay from them) nor the token files (the OSC's units may read them)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(head_start):
            await ctx.first_reconcile.wait()
    await start()


async def run_agent(
    settings: AgentSettings,
    config: NodeAgentConfiguration,
    *,
    host_name: str | None = None,
    systemd_address: str | None = None,
    early: EarlySystemd | None = None,
) -> int:
    """The daemon. ``early``: the systemd worker already being started (by ``run``, before
    the agent's modules were imported), else it is started here."""
    from node_agent.kube.client import KubeClient  # costly import, only for the daemon

    notifier = Notifier()
    # The systemd worker (a process of its own) starts while the rest is set up; the
    # controllers wait for it, so READY still means connected.
    if early is None:
        early = await start_early(systemd_address, settings.systemd_job_timeout + 10)
    systemd, connecting = early
    try:
        fs = HostFS(settings.root, follow_system_symlinks=True)
        observations = ApplyObservations()
        state: StateStore = ObservedStateStore(fs, observations.observe)  # apply durations
        observations.last = await state.load_status_async()
        removed = await asyncio.to_thread(state.cleanup_temp_files)
        if removed:
            log.info("removed temp files of an interrupted write", paths=removed)
        kubeconfig = host_path(settings.root, config.client_connection.kubeconfig)
        certs = CertificateController(settings, config, fs)
        # Without a kubeconfig, the agent runs on its bootstrap token until it has a certificate.
        bootstrapping = certs.needs_bootstrap()
        kube = certs.token_client() if bootstrapping else KubeClient.from_kubeconfig(kubeconfig)
    except BaseException:
        connecting.cancel()
        with contextlib.suppress(BaseException):
            await connecting
        await systemd.close()
        raise
    ctx = AgentContext(
        settings=settings,
        config=config,
        fs=fs,
        state=state,
        systemd=systemd,
        kube=kube,
        host_name=host_name or socket.gethostname(),
    )
    # What the read side reads: the certificate controller now, the others once built.
    sources = Sources(watches=ctx.watches, certificate=certs)

    stop = asyncio.Event()
    guards: list[threading.Timer] = []
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def until_stopped() -> None:
        await stop.wait()
        log.info("stopping")
        notifier.stopping()
        guards.append(_hard_stop_guard(SHUTDOWN_TIMEOUT))
        raise _Shutdown

    def waiting_for_certificate(line: str) -> None:
        # Not READY yet, but alive: keep systemd's start timeout and watchdog from firing.
        notifier.notify(f"STATUS={line}", f"EXTEND_TIMEOUT_USEC={CERTIFICATE_WAIT_EXTENSION_US}")
        notifier.watchdog()

    certs.on_wait = waiting_for_certificate

    async def certificate_refused(message: str) -> None:
        # an Event once the Node is known (while bootstrapping there is none yet)
        await ctx.event(report.REASON_CERTIFICATE_REFUSED, message, warning=True)

    certs.on_refused = certificate_refused

    async def controllers() -> None:
        await connecting
        if bootstrapping:
            await certs.bootstrap(ctx.kube)
            token_client, ctx.kube = ctx.kube, KubeClient.from_kubeconfig(kubeconfig)
            await token_client.close()
        else:
            certs.settle()
        pull_timeout = config.node_agent.images.pull_timeout.total_seconds()
        images = CtrImages(root=settings.root, pull_timeout=pull_timeout)
        agent = build_agent(ctx, images=images, sources=sources)
        osc, lease, node, token = agent.osc, agent.lease, agent.node, agent.token
        osc.inplace.renew_certificate = lambda: certs.renew(ctx.kube)  # a CA rotation

        def then(start: Callable[[], Awaitable[None]]) -> Coroutine[Any, Any, None]:
            return after_first_reconcile(ctx, start)  # after the OSC controller's first go

        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(find_node_then(osc.node_recreated), name="find-node")
            tasks.create_task(osc.run(), name="osc")
            tasks.create_task(watchdog(), name="watchdog")
            tasks.create_task(then(lease.run), name="lease")
            tasks.create_task(node.run(), name="node")
            tasks.create_task(token.run(), name="token")
            tasks.create_task(then(agent.health.run), name="health-check")
            tasks.create_task(then(agent.unitcheck.run), name="unitcheck")
            tasks.create_task(then(lambda: certs.run(ctx.kube)), name="certificate")
            for name, factory in EXTRA_CONTROLLERS:
                tasks.create_task(factory(ctx), name=name)
            notifier.ready(f"watching secret {ctx.secret_name}")
            log.info("node-agent ready", seconds=round(time.monotonic() - started, 3))
            tasks.create_task(self_update_guard(ctx), name="self-update-guard")

    async def find_node_then(report: Callable[[], None]) -> None:
        await find_node(ctx)
        # An OSC applied before the kubelet registered the Node (the first apply installs the
        # kubelet) is reported on the Node now, not at the next periodic check.
        report()

    async def watchdog() -> None:
        # Ping only while the event loop turns and the lease loop ticks (see lifecycle).
        if notifier.watchdog_interval:
            await watchdog_pings(
                notifier.watchdog_interval, notifier.watchdog, ctx.health.last_progress
            )

    started = time.monotonic()
    exit_code = 0
    log.info(  # after cli's "node-agent starting" line: what it found once configured
        "node-agent configured",
        version=__version__,
        executable=own_executable(),
        config=settings.config_file,
        host=ctx.host_name,
        secret=ctx.secret_name,
        root=str(settings.root),
        credentials="bootstrap token" if bootstrapping else "kubeconfig",
    )
    # The status socket now; /healthz, /readyz and /metrics once the first reconcile ended.
    observability = Observability(ctx, sources, observations)
    await observability.start_status()
    try:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(until_stopped(), name="signals")
            tasks.create_task(watch_hostname(), name="hostname")
            tasks.create_task(controllers(), name="controllers")
            tasks.create_task(after_first_reconcile(ctx, observability.start_ports), name="ports")
    except* _Shutdown:
        pass
    except* HostnameChanged as group:
        exit_code = HostnameChanged.exit_code
        log.error(
            "node-agent exiting for a restart", reason=str(group.exceptions[0]), code=exit_code
        )
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await observability.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(SHUTDOWN_TIMEOUT / 2):
                await _close(ctx.kube, systemd)
        for guard in guards:
            guard.cancel()
    log.info("node-agent stopped", code=exit_code)
    return exit_code


async def self_update_guard(ctx: AgentContext) -> None:
    """Once ready: tell the self-update guard that this binary got ready, keep the guard
    installed on the agent's unit, and report a fallback to the previous binary that brought
    this one back (log, Warning Event on the Node once it is known; ``status`` reads the record).
    Only for the single file on the real root (what a self-update replaces); a failure here is
    logged, never fatal: it must not take down an agent that runs."""
    binaries = own_binaries(ctx.settings.root)
    if not binaries:
        return
    binary, unit = binaries[0], ctx.settings.agent_unit
    try:
        record = await asyncio.to_thread(selfupdate.reached_ready, ctx.fs, binary)
        if await asyncio.to_thread(selfupdate.install, ctx.fs, unit, binary):
            await ctx.systemd.daemon_reload()
            log.info("self-update guard installed", unit=unit, binary=binary)
    except NodeAgentError as exc:
        log.warning("self-update guard not installed", error=str(exc))
        return
    if record is None or record.reported:
        return
    log.warning("fell back to the previous agent binary", detail=record.message())
    await ctx.node_known.wait()
    await ctx.event(report.REASON_SELF_UPDATE_FALLBACK, record.message(), warning=True)
    try:
        at = report.rfc3339(report.now())
        await asyncio.to_thread(selfupdate.mark_reported, ctx.fs, record, at)
    except NodeAgentError as exc:
        log.warning("self-update fallback not marked as reported", error=str(exc))


def _hard_stop_guard(seconds: float) -> threading.Timer:
    """Exit the process after ``seconds`` even if unwinding hangs (a blocked thread, a stuck
    call): systemd's stop must stay bounded. A daemon thread, so a blocked loop cannot stop it."""

    loop = asyncio.get_running_loop()

    def expire() -> None:
        log.error(
            "shutdown took too long; exiting now", seconds=seconds, waiting_on=_unfinished(loop)
        )
        faulthandler.dump_traceback(all_threads=True)  # where each thread is blocked, to stderr
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer


def _unfinished(loop: asyncio.AbstractEventLoop) -> list[str]:
    """The tasks a hung shutdown still waits for, each with the line it is suspended at. Read
    from the guard's thread while the loop may still run: a best effort for the log line."""
    found: list[str] = []
    try:
        for task in list(asyncio.all_tasks(loop)):
            found.append(f"{task.get_name()} at {' < '.join(_awaiting(task.get_coro()))}")
    except Exception as exc:  # the task set changed while it was read
        found.append(f"(tasks not readable: {exc})")
    return found


def _awaiting(coro: object) -> list[str]:
    """file:line of each coroutine down the chain a task is suspended in, innermost first."""
    chain: list[str] = []
    while coro is not None and len(chain) < 12:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            chain.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return chain[::-1]


async def _close(kube: object, systemd: SystemdSeam) -> None:
    close = getattr(kube, "close", None)
    if close is not None:
        await close()
    await systemd.close()
