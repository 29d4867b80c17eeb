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
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

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
#: The daemon's exit code after a typed error it cannot go on from (systemd starts it again).
EXIT_FAILED = 1
#: From SIGTERM to exit: controllers unwind, clients close; past this the process exits anyway.
SHUTDOWN_TIMEOUT = 9.0
#: While waiting for its first certificate, each sign of life extends systemd's start timeout by
#: this much (microseconds): the wait may take minutes, and it is progress, not a hang.
CERTIFICATE_WAIT_EXTENSION_US = 60_000_000
#: At most this long (seconds) the parts that can wait give the OSC controller's first reconcile.
FIRST_RECONCILE_HEAD_START = 2.0

_C = TypeVar("_C")


class _Shutdown(Exception):
    """Raised by the signal task to cancel every controller in the TaskGroup."""


@dataclass(frozen=True)
class Running:
    """A controller as the agent runs it: its task's name, its loop, and whether the loop waits
    for the OSC controller's first reconcile (:func:`after_first_reconcile`)."""

    name: str
    run: Callable[[], Coroutine[Any, Any, None]]
    waits: bool = False


@dataclass
class Parts:
    """What controllers are built from, and the controllers built so far (by type): an entry of
    ``CONTROLLERS`` takes what it needs with ``need`` and registers what it offers the read
    side on ``sources``."""

    ctx: AgentContext
    applier: Applier
    guard: RestartGuard  # the restart-storm guard, shared by the applier and the checks
    sources: Sources
    #: the client certificate's controller (the daemon builds it before the others: it gets the
    #: agent its credentials); None where nobody renews one (tests)
    certificate: CertificateController | None = None
    built: dict[type, object] = field(default_factory=dict)

    def need(self, kind: type[_C]) -> _C:
        """The controller of type ``kind``, built by an entry before the one asking."""
        found = self.built.get(kind)
        if not isinstance(found, kind):
            raise LookupError(f"no {kind.__name__} built before the controller that needs it")
        return found


#: One controller: build it from ``Parts`` (or None where it does not run) and say how it runs.
AddController = Callable[[Parts], "tuple[object, Running] | None"]


def add_osc(p: Parts) -> tuple[object, Running]:
    osc = OSCController(p.ctx, p.applier)
    p.sources.osc, p.sources.gate, p.sources.guard = osc, osc.gate, p.guard
    p.sources.rollout, p.sources.in_place = osc.rollout, osc.inplace
    return osc, Running("osc", osc.run)


def add_lease(p: Parts) -> tuple[object, Running]:
    lease = LeaseController(p.ctx)  # its own client and connection pool (see the module)
    p.sources.lease = lease
    return lease, Running("lease", lease.run, waits=True)


def add_node(p: Parts) -> tuple[object, Running]:
    osc = p.need(OSCController)
    node = NodeController(p.ctx, on_recreated=osc.node_recreated)
    node.observers.append(osc.inplace.node_seen)  # the drain gate of an in-place update
    node.observers.append(osc.node_seen)  # its reconciliation delay, without a GET per update
    p.sources.node = node
    return node, Running("node", node.run)


def add_token(p: Parts) -> tuple[object, Running]:
    token = TokenController(p.ctx)
    p.need(OSCController).inplace.resync_tokens.extend(sync.sync for sync in token.syncs)
    return token, Running("token", token.run)


def add_health(p: Parts) -> tuple[object, Running]:
    osc = p.need(OSCController)
    health = HealthCheckController(p.ctx, p.applier, applying=lambda: osc.applying, guard=p.guard)
    p.need(NodeController).observers.append(health.node_seen)  # the Node's Ready condition
    osc.inplace.kubelet_health = health.kubelet_health  # the same probe as the checks
    p.sources.healthcheck = health
    return health, Running("health-check", health.run, waits=True)


def add_unitcheck(p: Parts) -> tuple[object, Running]:
    osc = p.need(OSCController)
    unitcheck = UnitCheckController(p.ctx, p.applier, guard=p.guard, on_release=osc.retry_now)
    osc.on_applied.append(unitcheck.poke)  # units a new OSC (re)started are judged at once
    p.sources.unitcheck = unitcheck
    return unitcheck, Running("unitcheck", unitcheck.run, waits=True)


def add_certificate(p: Parts) -> tuple[object, Running] | None:
    certs, ctx = p.certificate, p.ctx
    if certs is None:
        return None
    p.need(OSCController).inplace.renew_certificate = lambda: certs.renew(ctx.kube)  # CA rotation
    return certs, Running("certificate", lambda: certs.run(ctx.kube), waits=True)


#: Every controller of the agent, in the order they are built (one may ``need`` those before
#: it), as Gardener's ``controller/add.go`` adds them: adding a controller is one entry here.
CONTROLLERS: tuple[AddController, ...] = (
    add_osc,
    add_lease,
    add_node,
    add_token,
    add_health,
    add_unitcheck,
    add_certificate,
)


@dataclass(frozen=True)
class Agent:
    """The agent's parts, wired once: what ``run_agent`` runs and what tests drive."""

    ctx: AgentContext
    applier: Applier
    parts: Parts
    running: tuple[Running, ...]  # in ``CONTROLLERS``' order

    @property
    def sources(self) -> Sources:  # what status, health and metrics read of the controllers
        return self.parts.sources

    def need(self, kind: type[_C]) -> _C:
        return self.parts.need(kind)

    @property
    def osc(self) -> OSCController:
        return self.need(OSCController)


def build_agent(
    ctx: AgentContext,
    *,
    images: ImageStore | None,
    expander: Callable[[HostFS], ContainerdExpander] | None = ContainerdExpander,
    sources: Sources | None = None,
    certificate: CertificateController | None = None,
    controllers: Sequence[AddController] = CONTROLLERS,
) -> Agent:
    """The applier and the controllers on ``ctx``'s seams. ``images``: where imageRef files come
    from (the daemon: the node's containerd through ``ctr``); ``expander``: what the agent
    derives from an OSC (containerd's config from ``criConfig``), None for the OSC as it is;
    ``sources``: the read side's registry, filled in with the controllers (a new one if None);
    ``certificate``: the client certificate's controller, when the agent renews one."""
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
    if sources is None:
        sources = Sources(watches=ctx.watches)
    parts = Parts(ctx, applier, guard, sources, certificate=certificate)
    running: list[Running] = []
    for add in controllers:
        added = add(parts)
        if added is not None:
            controller, how = added
            parts.built[type(controller)] = controller
            running.append(how)
    return Agent(ctx, applier, parts, tuple(running))


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


async def _open(
    settings: AgentSettings,
    config: NodeAgentConfiguration,
    systemd: SystemdSeam,
    host_name: str | None,
) -> tuple[AgentContext, CertificateController, bool, ApplyObservations]:
    """The host's seams and the API client the agent starts with: its kubeconfig, or without
    one (then ``True``: bootstrapping) its bootstrap token until it has a certificate
    (``CertificateController``)."""
    from node_agent.kube.client import KubeClient

    fs = HostFS(settings.root, follow_system_symlinks=True)
    observations = ApplyObservations()
    state: StateStore = ObservedStateStore(fs, observations.observe)  # apply durations
    observations.last = await state.load_status_async()
    removed = await asyncio.to_thread(state.cleanup_temp_files)
    if removed:
        log.info("removed temp files of an interrupted write", paths=removed)
    kubeconfig = host_path(settings.root, config.client_connection.kubeconfig)
    certs = CertificateController(settings, config, fs)
    bootstrapping = certs.needs_bootstrap()
    kube = certs.token_client() if bootstrapping else KubeClient.from_kubeconfig(kubeconfig)
    ctx = AgentContext(
        settings=settings,
        config=config,
        fs=fs,
        state=state,
        systemd=systemd,
        kube=kube,
        host_name=host_name or socket.gethostname(),
    )
    return ctx, certs, bootstrapping, observations


def _report_certificate_waits(
    ctx: AgentContext, certs: CertificateController, notifier: Notifier
) -> None:
    """While the first certificate is awaited the agent is not READY but alive: each sign of
    progress extends systemd's start timeout and pings its watchdog; a refusal is an Event
    once the Node is known (while bootstrapping there is none yet)."""

    def waiting(line: str) -> None:
        notifier.notify(f"STATUS={line}", f"EXTEND_TIMEOUT_USEC={CERTIFICATE_WAIT_EXTENSION_US}")
        notifier.watchdog()

    async def refused(message: str) -> None:
        await ctx.event(report.REASON_CERTIFICATE_REFUSED, message, warning=True)

    certs.on_wait, certs.on_refused = waiting, refused


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
        ctx, certs, bootstrapping, observations = await _open(settings, config, systemd, host_name)
    except BaseException:
        connecting.cancel()
        with contextlib.suppress(BaseException):
            await connecting
        await systemd.close()
        raise
    kubeconfig = host_path(settings.root, config.client_connection.kubeconfig)
    _report_certificate_waits(ctx, certs, notifier)
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
        agent = build_agent(ctx, images=images, sources=sources, certificate=certs)

        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(find_node_then(agent.osc.node_recreated), name="find-node")
            tasks.create_task(watchdog(), name="watchdog")
            for controller in agent.running:  # the waiting ones after the OSC's first go
                run = controller.run
                body = after_first_reconcile(ctx, run) if controller.waits else run()
                tasks.create_task(body, name=controller.name)
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
    except* NodeAgentError as group:
        # e.g. systemd out of reach at the start: one line naming it, and systemd's restart
        error = group.exceptions[0]
        exit_code = EXIT_FAILED
        log.error("node-agent failed", error=f"{type(error).__name__}: {error}", code=exit_code)
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
