"""The OperatingSystemConfig controller: the node's desired files and units, applied.

One Secret is watched (list+watch with a name field selector). Events only wake the reconciler;
it always works on the latest Secret, so a burst of updates collapses into one apply. A bad
OSC is reported (log + Warning Event on the Node) and left alone until the Secret changes,
while transient failures (API, systemd, missing secretRef) are retried with jittered backoff.
The Node is annotated with the applied checksum only after everything succeeded.

Nothing a reconcile raises ends the controller: an error of a kind no layer expected becomes
an ``UnexpectedError`` naming the Secret, reported and retried like any failed reconcile; a
write the API server refused as invalid (422) is not retried on the backoff (the same body
would be refused again), only when the loop is woken or at the periodic check.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import traceback
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import yaml

from node_agent.apply.applier import Applier, Outcome, Planned
from node_agent.apply.executor import ApplyReport
from node_agent.base import retry
from node_agent.base.by_change import Base64ByChange
from node_agent.base.configfile import config_version_key, find_config, read_config_file
from node_agent.base.digest import sha256_hex
from node_agent.base.durations import parse_duration
from node_agent.base.errors import (
    ApplyError,
    ConfigError,
    InPlaceUpdateError,
    KubeError,
    KubeInvalid,
    KubeNotFound,
    NodeAgentError,
    OSCDecodeError,
    OSCError,
    SecretRefError,
    UnexpectedError,
)
from node_agent.base.layout import BOOTSTRAP_TOKEN_FILE, KUBELET_BOOTSTRAP_KUBECONFIG
from node_agent.base.log import get_logger
from node_agent.base.loop import DONE, RETRY, SKIPPED, Next, Wake, run_loop
from node_agent.base.retry import Backoff
from node_agent.config import ZONE_FILE
from node_agent.context import AgentContext
from node_agent.controllers.lifecycle import restart_own_unit
from node_agent.controllers.osc.breakage import Evidence
from node_agent.controllers.osc.health_gate import GateRecord, HealthGate
from node_agent.controllers.osc.inplace import InPlaceRecord, InPlaceUpdater, kubelet_bootstrapped
from node_agent.controllers.osc.rollout import Permit, Rollout
from node_agent.host.history import HistoryEntry, HistoryRollback, Result, Trigger
from node_agent.kube import report
from node_agent.kube.report import NAMESPACE
from node_agent.kube.watch import list_watch
from node_agent.osc.decode import decode_osc, parse_osc
from node_agent.osc.merge import osc_files, secret_refs
from node_agent.osc.models import OperatingSystemConfig
from node_agent.osc.plan import ChangeSet

if TYPE_CHECKING:
    from node_agent.kube.seam import KubeSeam

DATA_KEY = "osc.yaml"
#: at most this long (seconds) an apply waits for the token controller's first round
TOKENS_WAIT = 10.0
log = get_logger("node-agent.osc")

JSON = dict[str, Any]


def secret_bytes(
    secret: Mapping[str, Any], key: str, what: str, decoder: Base64ByChange | None = None
) -> bytes:
    """The bytes of the Secret's ``key``; ``decoder`` decodes it by what changed since the
    value it decoded last (an update of a large OSC changes a few of its bytes)."""
    data = secret.get("data") or {}
    if key not in data:
        raise OSCDecodeError(f"{what} has no data key {key!r}")
    try:
        if decoder is not None:
            return decoder.decode(data[key])
        return base64.b64decode(data[key], validate=True)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise OSCDecodeError(f"{what} data key {key!r} is not valid base64") from exc


async def resolve_secret_refs(
    kube: KubeSeam, osc: OperatingSystemConfig, host_name: str
) -> dict[str, bytes]:
    """Fetch every secretRef file's bytes; a missing Secret or key names itself."""
    resolved: dict[str, bytes] = {}
    cache: dict[str, JSON] = {}
    for path, ref in sorted(secret_refs(osc, host_name).items()):
        if ref.name not in cache:
            try:
                cache[ref.name] = await kube.get_secret(NAMESPACE, ref.name)
            except KubeNotFound as exc:
                raise SecretRefError(
                    ref.name, ref.data_key, path=path, reason="Secret not found"
                ) from exc
        data = cache[ref.name].get("data") or {}
        if ref.data_key not in data:
            raise SecretRefError(ref.name, ref.data_key, path=path, reason="key not in Secret")
        try:
            resolved[path] = base64.b64decode(data[ref.data_key], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise SecretRefError(
                ref.name, ref.data_key, path=path, reason="value is not valid base64"
            ) from exc
    return resolved


@dataclass(frozen=True)
class Desired:
    """What the Secret asks for: its OSC bytes, the checksum it is annotated with, and the
    sha256 of the bytes (the checksum that is applied and reported)."""

    secret: JSON
    raw: bytes
    annotated: str | None
    checksum: str


class PlanOnce:
    """The update's plan, made at most once: the rollout's admission asks for it only when it
    must judge what the update disrupts, and the apply runs that same plan instead of making
    another (None: not asked for; the apply plans itself)."""

    def __init__(
        self, applier: Applier, osc: OperatingSystemConfig, resolved: dict[str, bytes]
    ) -> None:
        self._applier, self._osc, self._resolved = applier, osc, resolved
        self.planned: Planned | None = None

    async def change_set(self) -> ChangeSet:
        if self.planned is None:
            self.planned = await self._applier.plan(self._osc, self._resolved)
        return self.planned.change_set


@dataclass(frozen=True)
class Update:
    """The update being reconciled: the desired OSC decoded and its secretRefs resolved,
    against the checksum the host has (``applied``; "" before the first apply)."""

    desired: Desired
    applied: str
    osc: OperatingSystemConfig
    resolved: dict[str, bytes]
    #: a retry of this checksum's unfinished apply (its pending journal names it)
    retrying: bool
    plan: PlanOnce

    @property
    def checksum(self) -> str:
        return self.desired.checksum

    @property
    def raw(self) -> bytes:
        return self.desired.raw

    @property
    def first_apply(self) -> bool:
        return self.applied == ""

    @property
    def trigger(self) -> Trigger:
        return "resume" if self.retrying else "secret"


@dataclass(frozen=True)
class Admission:
    """The rollout let the update go; ``permit``: what the node holds over the apply."""

    permit: Permit | None


@dataclass(frozen=True)
class Attempt:
    """An apply that went through: what it did, the gate it ran under, when it started."""

    outcome: Outcome
    gate: GateRecord | None
    started: datetime
    #: the in-place parts of the update (None: none)
    in_place: InPlaceRecord | None = None


class OSCController:
    def __init__(self, ctx: AgentContext, applier: Applier) -> None:
        self.ctx = ctx
        self.applier = applier
        self._latest: JSON | None = None
        self._seen = False
        self._wake = Wake()
        self._backoff = Backoff.of(retry.APPLY)  # a failed reconcile
        self._recheck = Backoff.of(retry.HELD_BACK)  # derived items held back
        self._rejected: str | None = None  # resourceVersion of a Secret found invalid
        self._osc_yaml = Base64ByChange()  # the Secret's osc.yaml, decoded by what changed
        self._digest: tuple[bytes, str] | None = None  # the last osc.yaml bytes and their sha256
        self._reported: str | None = None  # checksum last written to the Node
        # (checksum, message) of the OSCApplied Event of an apply made before the Node existed:
        # sent with the first report of that checksum, as upstream sends it once it can
        self._unannounced: tuple[str, str] | None = None
        # checksum whose reconciliation delay was waited out: a node the rollout holds back is
        # woken many times for the same update, and each look would read the Node again
        self._delayed: str | None = None
        self._resync = False
        self.applies = 0
        self.failures = 0
        self.reconciles = 0
        self.last_outcome: Outcome | None = None
        self.desired_checksum: str | None = None
        self._failures_for: str | None = None  # checksum whose item failures were reported
        self._failures_seen: set[tuple[str, str, str]] = set()
        self._last_failure: str | None = None  # message of the last failure Event
        #: the health gate of updates (watch what an update restarted; roll back what broke)
        self.gate = HealthGate(
            ctx.systemd,
            ctx.state,
            ctx.config.node_agent.health_gate,
            agent_unit=ctx.settings.agent_unit,
            strict=lambda: ctx.strictness().names(),
        )
        self._quarantine_logged: str | None = None
        #: the settle window of a reported update, watched beside the reconcile loop
        self._settling: asyncio.Task[None] | None = None
        self._settling_for: str | None = None
        #: serial mode and the paced rollout of the pool (the Lease <secretName>)
        self.rollout = Rollout(ctx, self._wake.set)
        #: the in-place parts of an update (OS, kubelet, credentials) and the drain gate
        self.inplace = InPlaceUpdater(ctx)
        self.inplace.on_ready.append(self._wake.set)
        self._applying = 0  # applies (and rollbacks, drift repairs) running now
        #: called after an OSC was applied and reported (the unit check looks at once)
        self.on_applied: list[Callable[[], None]] = []
        #: the Node's annotations as its watch last showed them (None: not seen yet, then the
        #: reconciliation delay is read with a GET)
        self._node_annotations: Mapping[str, str] | None = None

    @property
    def applying(self) -> bool:
        """Whether the controller is changing the host now (an apply, a rollback, a drift
        repair, or the settle window after an update): the health checks hold their restarts."""
        settling = self._settling is not None and not self._settling.done()
        return self._applying > 0 or settling

    @property
    def latest_secret(self) -> JSON | None:
        """The Secret as the watch last saw it (None: not seen yet, or deleted); for status."""
        return self._latest

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._watch(), name="osc-watch")
                tasks.create_task(self._reconcile_loop(), name="osc-reconcile")
        finally:
            await self._stop_settling()

    async def settled(self) -> None:
        """Until the settle window of the last reported update is over (and its rollback,
        if it broke a unit, done)."""
        task = self._settling
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    async def _stop_settling(self, checksum: str | None = None) -> bool:
        """The settle window watched after a report, for another OSC than ``checksum``:
        stopped (a newer update goes on at once, as upstream's would; it is gated on its own).
        True when a window for ``checksum`` itself is still running."""
        task = self._settling
        if task is None or task.done():
            self._settling = None
            return False
        if checksum is not None and self._settling_for == checksum:
            return True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        self._settling = None
        if checksum is not None:
            log.info("settle window ended early: a newer OSC", checksum=self._settling_for)
        return False

    async def _watch(self) -> None:
        name = self.ctx.secret_name
        events = list_watch(
            self.ctx.kube.secrets(NAMESPACE),
            field_selector=f"metadata.name={name}",
            registry=self.ctx.watches,
        )
        async with events:
            async for event in events:
                self.ctx.health.progress("osc-watch")
                self.observe(event.type, event.object)

    def observe(self, kind: str, secret: JSON | None) -> None:
        """One watch event: keep the latest Secret (None: deleted) and wake the reconciler."""
        if kind in ("SYNC", "ADDED", "MODIFIED"):
            self._latest = secret
        elif kind == "DELETED":
            self._latest = None
        self._seen = True
        self._wake.set()

    @property
    def _period(self) -> float:
        """The periodic full check (``syncPeriod``)."""
        return self.ctx.config.controllers.operating_system_config.sync_period.total_seconds()

    async def _reconcile_loop(self) -> None:
        await run_loop(
            self._step,
            self._wake,
            period=self._period,
            backoff=self._backoff,
            on_retry=lambda delay: log.info("retried the OSC apply", after_seconds=round(delay, 1)),
        )

    async def _step(self, woken: bool) -> Next:
        """One turn of the loop: reconcile the latest Secret. A bad OSC is skipped until the
        Secret changes; a transient failure is retried on the backoff; items held back (e.g.
        a registry mirror not up yet) are looked at again well before the period."""
        if not woken:
            self._resync = True  # the periodic full check: also looks for drift on disk
        if not self._seen:
            return SKIPPED
        secret = self._latest
        self.ctx.health.progress("osc-reconcile")
        if secret is None:
            log.warning("OSC secret not found", secret=self.ctx.secret_name)
            self.ctx.first_reconcile.set()  # nothing to apply: the others need not wait
            return SKIPPED
        resync, self._resync = self._resync, False
        try:
            await self.reconcile(secret, resync=resync)
        except SecretRefError as exc:
            await self._failed(exc, transient=True)
            return RETRY
        except OSCError as exc:
            self._rejected = str((secret.get("metadata") or {}).get("resourceVersion"))
            await self._failed(exc, transient=False)
            return SKIPPED
        except ApplyError as exc:
            await self._partly_applied(exc)
            return RETRY
        except InPlaceUpdateError as exc:
            if not exc.terminal:
                await self._failed(exc, transient=True)
                return RETRY
            # marked failed on the Node (its Event said why); left until the Secret changes
            self._rejected = str((secret.get("metadata") or {}).get("resourceVersion"))
            self.failures += 1
            self.ctx.health.error("osc", f"InPlaceUpdateError: {exc}")
            return SKIPPED
        except KubeInvalid as exc:
            # refused as invalid: the same body is refused again, so not on the backoff
            await self._failed(exc, transient=False)
            return SKIPPED
        except NodeAgentError as exc:
            await self._failed(exc, transient=True)
            return RETRY
        except Exception as exc:  # the boundary: no error ends the controller
            error = UnexpectedError(f"secret {NAMESPACE}/{self.ctx.secret_name}", exc)
            await self._failed(error, transient=True, item=error.item, at=_where(exc))
            return RETRY
        self._last_failure = None
        held = dict(self.applier.held_back())
        if not held:
            self._recheck.reset()
            return DONE
        # e.g. a registry mirror that is not up yet: check again well before the periodic
        # check, backing off, instead of pulling past it for hours
        wait = min(self._period, self._recheck.next())
        log.info("items held back; checking again", items=held, seconds=wait)
        return Next.after(wait)

    async def _failed(self, exc: NodeAgentError, *, transient: bool, **details: object) -> None:
        """Log (one event, with ``details``) and report a failed reconcile; the Warning Event
        only when the error is new, so a retry loop with backoff does not flood the Node with
        the same Event."""
        self.failures += 1
        kind = type(exc).__name__
        message = f"{kind}: {exc}"
        log.error("OSC not applied", error=message, retry=transient, **details)
        self.ctx.health.error("osc", message)
        if message == self._last_failure:
            return
        self._last_failure = message
        invalid = isinstance(exc, OSCError) and not transient
        reason = report.REASON_OSC_INVALID if invalid else report.REASON_OSC_FAILED
        await self.ctx.event(reason, message, warning=True)

    async def _partly_applied(self, exc: ApplyError) -> None:
        """Some items of the OSC failed, the rest is applied. Each failing item is logged and
        gets one Warning Event naming it and the cause — once per OSC, not on every retry."""
        self.failures += 1
        rep = exc.report if isinstance(exc.report, ApplyReport) else None
        failures = rep.failure_list() if rep is not None else ()
        log.error(
            "OSC partly applied; retrying what failed",
            error=str(exc),
            failures=[f.model_dump() for f in failures],
        )
        self.ctx.health.error("osc", f"ApplyError: {exc}")
        checksum = self.desired_checksum or ""
        if self._failures_for != checksum:
            self._failures_for, self._failures_seen = checksum, set()
        # One Warning per item: a command held back by the item's own failure (its enable, its
        # unit file) adds nothing to that failure's Event.
        failed_items = {f.item for f in failures if f.kind != "blocked"}
        for failure in failures:
            if failure.kind == "blocked" and failure.item in failed_items:
                continue
            key = (failure.kind, failure.item, failure.error)
            if key in self._failures_seen:
                continue
            self._failures_seen.add(key)
            result = rep.results.get(failure.item) if rep is not None else None
            reason = (
                report.REASON_UNIT_COMMAND.get(result.action, report.REASON_OSC_FAILED)
                if result is not None
                else report.REASON_OSC_FAILED
            )
            await self.ctx.event(reason, f"{failure.item}: {failure.error}", warning=True)
        for held in rep.held if rep is not None else ():
            await self.ctx.event(report.REASON_RESTARTS_SUSPENDED, held.describe(), warning=True)
        if rep is not None and rep.agent_restart_due:
            await self._restart_self()

    async def _restart_self(self) -> None:
        log.info("restarting the agent's own unit last", unit=self.ctx.settings.agent_unit)
        await restart_own_unit(self.ctx)

    def retry_now(self) -> None:
        """What held a retry back is gone (a unit the restart-storm guard held came up by
        itself): look again now instead of after the backoff."""
        self._wake.set()

    def node_recreated(self) -> None:
        """The Node appeared (registered for the first time, or deleted and registered again):
        report the applied checksum on it anew."""
        self._reported = None
        self._node_annotations = None
        self._wake.set()

    def node_seen(self, node: JSON) -> None:
        """A version of the Node from the Node controller's watch (an observer): its
        annotations, so that an update reads the reconciliation delay without a request."""
        self._node_annotations = dict((node.get("metadata") or {}).get("annotations") or {})
        self.rollout.node_seen(node)

    # -- one reconciliation -----------------------------------------------------------------
    def request_resync(self) -> None:
        """Run the periodic full check (drift on disk included) now."""
        self._resync = True
        self._wake.set()

    async def reconcile(self, secret: JSON, *, resync: bool = False) -> Outcome | None:
        self._applying += 1
        try:
            return await self._reconcile(secret, resync=resync)
        finally:
            self._applying -= 1
            self.ctx.first_reconcile.set()
            # A state file set aside (the history, status.json ...) is said once on the Node.
            for note in self.ctx.state.take_set_aside():
                await self.ctx.event(report.REASON_STATE_SET_ASIDE, note, warning=True)
            if self.ctx.state.take_journal_lost():
                # What the lost journal had changed is unknown: compare the host with what is
                # applied now rather than at the periodic check.
                self.request_resync()

    async def _reconcile(self, secret: JSON, *, resync: bool = False) -> Outcome | None:
        """One reconcile, in the order the data flows; each stage may end it (None)."""
        self.reconciles += 1
        desired = self._read(secret)
        if desired is None:
            return None  # already reported; wait for the Secret to change
        if await self._stop_settling(desired.checksum):
            # its settle window is still being watched; reported, unless the Node came after
            # the apply (the kubelet registered it meanwhile): then now, as upstream would
            if self._reported != desired.checksum and self.ctx.node_name is not None:
                await self._report_missing(desired)
            return None
        if await self._gate_decides(desired.checksum):
            return None  # quarantined, or rolled back just now
        applied = await self.ctx.state.applied_checksum_async()
        if await self._already_applied(desired, applied, resync=resync):
            return None
        update = await self._prepare(desired, applied)
        in_place = await self.inplace.begin(update.osc, update.checksum)
        if in_place is not None:
            # machine-controller-manager paces an in-place pool (it drains one node after
            # another): the drain gate replaces the rollout's admission and the health gate
            if not await self.inplace.admitted(in_place):
                return None  # the Node's watch wakes the loop when it is drained
            if update.applied == update.checksum and not update.retrying:
                await self._resume_in_place(update, in_place)
                return None
            in_place = await self.inplace.before_apply(in_place)
            admission: Admission | None = Admission(permit=None)
        else:
            admission = await self._admit(update)
        if admission is None:
            return None  # held by the pool's rollout; it wakes the loop to look again
        attempt = await self._apply(update, admission.permit, in_place)
        if attempt is None:
            return None  # the failed apply broke a unit: rolled back
        return await self._finish(update, attempt, admission.permit)

    async def _resume_in_place(self, update: Update, in_place: InPlaceRecord) -> None:
        """The OSC is applied (the journal is complete) but its in-place steps are not: after
        the OS update's reboot, or a kill. Only those steps are left; the files and units
        are not applied again and ``OSCApplied`` is not sent twice."""
        log.info("resuming the in-place update", parts=in_place.remaining.names())
        if await self.inplace.finish(update.osc, in_place) == "rebooting":
            return
        await self._report_applied(update.osc, update.checksum)
        for hook in self.on_applied:
            hook()

    def _read(self, secret: JSON) -> Desired | None:
        """The OSC bytes of the Secret and their checksum; None while it is the very version
        found invalid before (reported then; decoding it again would only repeat that)."""
        meta = secret.get("metadata") or {}
        if self._rejected is not None and str(meta.get("resourceVersion")) == self._rejected:
            return None
        self._rejected = None
        where = f"secret {NAMESPACE}/{meta.get('name')}"
        raw = secret_bytes(secret, DATA_KEY, where, self._osc_yaml)
        annotated = (meta.get("annotations") or {}).get(report.ANNOTATION_SECRET_CHECKSUM)
        digest = self._digest
        if digest is None or digest[0] is not raw:  # the very bytes when osc.yaml is unchanged
            digest = self._digest = (raw, sha256_hex(raw))
        return Desired(secret=secret, raw=raw, annotated=annotated, checksum=digest[1])

    async def _already_applied(self, desired: Desired, applied: str, *, resync: bool) -> bool:
        """True when the host has these very bytes (validated when they were applied) and no
        apply of them is unfinished: no host action then, except drift repair on the periodic
        resync; the Node is reported to only if it misses the checksum, and the pool's rollout
        learns that this node is up to date."""
        if applied != desired.checksum or await self.ctx.state.pending_async() is not None:
            return False
        unfinished = await self.inplace.record()
        if unfinished is not None and unfinished.checksum == desired.checksum:
            return False  # applied, but its in-place steps are not all done (e.g. a reboot)
        if resync:
            await self._repair_drift(desired.raw, desired.annotated)
        if self._reported != desired.checksum:
            await self._report_missing(desired)
        elif self.ctx.node_name is not None:
            await self._drop_bootstrap_credentials()  # e.g. the kubelet re-bootstrapped since
        await self.rollout.up_to_date(desired.checksum)
        return True

    async def _report_missing(self, desired: Desired) -> None:
        """The applied ``desired`` on the Node, if the Node misses it (a start, a Node that
        appeared or was made anew)."""
        osc = decode_osc(desired.raw, desired.annotated, self.ctx.host_name, desired.checksum)
        await self._report_applied(osc, desired.checksum, only_if_missing=True)

    async def _prepare(self, desired: Desired, applied: str) -> Update:
        """Everything the update needs before it may start: the OSC decoded (off the loop: a
        large one takes tens of ms of CPU, and heartbeats must keep ticking), the Node's
        reconciliation delay waited out (not before a first apply, a retry, or where the
        rollout paces the pool itself; once per checksum), secretRefs resolved, and one plan to
        be shared."""
        osc = await asyncio.to_thread(
            decode_osc, desired.raw, desired.annotated, self.ctx.host_name, desired.checksum
        )
        self.desired_checksum = desired.checksum
        pending = await self.ctx.state.pending_async()
        retrying = pending is not None and pending.osc_checksum == desired.checksum
        # an in-place update resumed (its reboot, a kill) waited out the delay before it began
        unfinished = await self.inplace.record()
        resuming = unfinished is not None and unfinished.checksum == desired.checksum
        if (
            applied != ""
            and not retrying
            and not resuming
            and self._delayed != desired.checksum
            and not self.rollout.skips_delay(desired.secret)
        ):
            await self._reconciliation_delay()
            self._delayed = desired.checksum
        resolved = await self.resolve(osc)
        return Update(
            desired=desired,
            applied=applied,
            osc=osc,
            resolved=resolved,
            retrying=retrying,
            plan=PlanOnce(self.applier, osc, resolved),
        )

    async def _admit(self, update: Update) -> Admission | None:
        """The pool's rollout admits the update (with the permit it holds over the apply), or
        holds it back (None). The first apply is not paced: nothing runs yet that an update
        could disrupt."""
        if update.first_apply:
            return Admission(permit=None)
        permit = await self.rollout.admit(
            update.desired.secret,
            update.checksum,
            retrying=update.retrying,
            plan=update.plan.change_set,
        )
        return Admission(permit=permit) if permit is not None else None

    async def _apply(
        self, update: Update, permit: Permit | None, in_place: InPlaceRecord | None = None
    ) -> Attempt | None:
        """Apply the update under the health gate (an update, not the first apply or a retry,
        records the running units first). A failed apply is recorded in the history; if it
        broke a unit it is rolled back (None), else the rollout is told and ApplyError raised
        (the loop retries with backoff)."""
        gate = await self._gate_begin(
            update.checksum,
            first_apply=update.first_apply,
            # an OS or kubelet update must never be rolled back by a settle window
            retrying=update.retrying or in_place is not None,
            plan=update.plan.change_set,
        )
        # The Node may have been registered since the last lookup (every 10 s): look once
        # more, so that this apply's Events are recorded on it.
        await self.ctx.look_up_node()
        await self._tokens_synced()
        log.info("applying OSC", checksum=update.checksum, first=update.first_apply)
        started = report.now()
        try:
            outcome = await self.applier.apply(
                update.raw, update.osc, update.checksum, update.resolved, update.plan.planned
            )
        except ApplyError as exc:
            partial = exc.report if isinstance(exc.report, ApplyReport) else None
            if self._report_after_settle():
                # A partly failed update may have broken a running unit too (its restart
                # failed): with the operator's strictness the gate decides at once.
                if await self._settle(update, gate, permit, started, partial, None, str(exc)):
                    return None
            else:
                # Upstream's contract: a failed restart is retried (with backoff) until it
                # works, and only then is the OSC reported. The gate's record stays, so the
                # retry that completes the update is watched under it.
                await self._history(
                    update.trigger,
                    update.applied,
                    update.checksum,
                    started,
                    partial,
                    None,
                    str(exc),
                )
            await self.rollout.failed(permit, str(exc))
            raise
        return Attempt(outcome=outcome, gate=gate, started=started, in_place=in_place)

    async def _finish(
        self, update: Update, attempt: Attempt, permit: Permit | None
    ) -> Outcome | None:
        """After a successful apply: one Event per unit command, the settle window and the
        history entry; then either the rollback of an update that broke a unit (None: the
        Node keeps the old checksum) or the success reported."""
        outcome = attempt.outcome
        self.applies += 1
        self.last_outcome = outcome
        for _unit, result in sorted(outcome.report.results.items()):
            reason = report.REASON_UNIT_COMMAND.get(result.action, "SystemDUnitRestart")
            await self.ctx.event(reason, result.describe(), warning=not result.ok)
        gate = attempt.gate
        if gate is not None and not self._report_after_settle():
            return await self._report_then_watch(update, attempt, permit, gate)
        rolled_back = await self._settle(
            update, gate, permit, attempt.started, outcome.report, outcome.change_set
        )
        if rolled_back:
            return None
        if await self.inplace.finish(update.osc, attempt.in_place) == "rebooting":
            return None  # completed when the agent is back on the new OS version
        await self._succeeded(update, outcome, permit)
        return outcome

    async def _tokens_synced(self) -> None:
        """The OSC's units may read the synced token files (a collector's access token): at a
        first boot the apply waits for the token controller's first round, at most
        ``TOKENS_WAIT`` seconds (a Secret that does not exist yet must not hold the node)."""
        synced = self.ctx.tokens_synced
        if synced.is_set():
            return
        try:
            async with asyncio.timeout(TOKENS_WAIT):
                await synced.wait()
        except TimeoutError:
            log.warning("applying before the token files were synced", seconds=TOKENS_WAIT)

    def _report_after_settle(self) -> bool:
        """The operator's ``reportAfterSettle`` strictness: the checksum of a gated update
        only after its settle window, and a failed restart rolled back at once."""
        return self.ctx.strictness().strict_report_after_settle

    async def _report_then_watch(
        self, update: Update, attempt: Attempt, permit: Permit | None, gate: GateRecord
    ) -> Outcome | None:
        """Upstream's contract for a gated update: the checksum on the Node as soon as the
        apply is done (Gardener reads it as "updated"), then the settle window. A unit the
        update broke in it still rolls the node back to the last-known-good OSC, and the
        checksum on the Node goes back with it (the annotation names what is applied, the
        Warning ``OSCRolledBack`` says why). The pool's rollout (node-agent's own Lease, not
        read by Gardener) hears the verdict after the window. An update that restarts the
        agent's own unit restarts it right after the report; the restarted agent watches what
        is left of the window (the gate's record is persisted)."""
        outcome = attempt.outcome
        if outcome.restarts_agent:
            await self._history(
                update.trigger,
                update.applied,
                update.checksum,
                attempt.started,
                outcome.report,
                outcome.change_set,
            )
            await self._succeeded(update, outcome, permit)
            return outcome
        await self._succeeded(update, outcome, permit, tell_rollout=False)
        self._settling_for = update.checksum
        self._settling = asyncio.create_task(
            self._settle_reported(update, attempt, permit, gate), name="osc-settle"
        )
        return outcome

    async def _settle_reported(
        self, update: Update, attempt: Attempt, permit: Permit | None, gate: GateRecord
    ) -> None:
        """The settle window of a reported update, beside the reconcile loop (a newer Secret
        is not held up by it). A rollback it begins runs as an apply; if that fails, the loop
        carries it on from the gate's record, with backoff."""
        outcome = attempt.outcome
        try:
            rolled_back = await self._settle(
                update, gate, permit, attempt.started, outcome.report, outcome.change_set
            )
        except NodeAgentError as exc:
            log.error("rollback not finished; the reconcile loop carries it on", error=str(exc))
            self._wake.set()
            return
        if not rolled_back:
            await self.rollout.succeeded(permit)

    async def _settle(
        self,
        update: Update,
        gate: GateRecord | None,
        permit: Permit | None,
        started: datetime,
        rep: ApplyReport | None,
        change_set: ChangeSet | None,
        error: str | None = None,
    ) -> bool:
        """After an apply, done or partly failed: watch what it restarted for the settle
        window, record it in the history, and roll the update back if it broke a unit (True)."""
        finished = report.now()  # the apply's duration, without the settle window
        broke = await self._gate_watch(gate, rep)
        await self._history(
            update.trigger,
            update.applied,
            update.checksum,
            started,
            rep,
            change_set,
            error,
            rollback=broke,
            finished=finished,
        )
        if gate is None or broke is None:
            return False
        await self._roll_back_update(gate, broke, permit)
        return True

    async def _succeeded(
        self, update: Update, outcome: Outcome, permit: Permit | None, *, tell_rollout: bool = True
    ) -> None:
        """The update is applied: the checksum goes on the Node, the listeners and (unless
        ``tell_rollout`` is False: the settle window's verdict is still to come) the pool's
        rollout are told, the Events and the log say what changed, and the agent's own unit,
        if the update restarts it, restarts last of all."""
        await self._report_applied(update.osc, update.checksum, next_config=outcome.restarts_agent)
        for hook in self.on_applied:
            hook()
        if tell_rollout:
            await self.rollout.succeeded(permit)
        if outcome.report.skipped:
            await self.ctx.event(
                report.REASON_OSC_SKIPPED, "; ".join(outcome.report.skipped), warning=True
            )
        summary = ", ".join(outcome.change_set.reasons()) or "no unit changes"
        message = f"OSC {update.checksum[:12]} applied: {summary}"
        if self.ctx.node_name is None:
            self._unannounced = (update.checksum, message)
        else:
            await self.ctx.event(report.REASON_OSC_APPLIED, message)
        log.info(
            "OSC applied",
            checksum=update.checksum,
            seconds=round(outcome.report.duration, 3),
            restarted=outcome.report.restarted,
            files=len(outcome.report.files_written),
            orphans=outcome.orphans_removed,
        )
        if outcome.restarts_agent:
            await self._restart_self()

    # -- the health gate ----------------------------------------------------------------------
    async def _gate_decides(self, checksum: str) -> bool:
        """Act on the gate's record first. True when it decided this reconcile: ``checksum`` is
        quarantined, or its rollback (begun before a crash or a failed try) was carried on."""
        record = await self.gate.record()
        if record is None:
            return False
        if record.checksum != checksum:
            # The Secret changed: a quarantine ends, and an unfinished gate is moot (the new
            # OSC is planned from what is applied, whatever that is).
            if record.phase == "quarantined":
                log.info("quarantine lifted: the OSC changed", checksum=record.checksum)
            await self.gate.clear()
            return False
        if record.phase == "quarantined":
            if self._quarantine_logged != checksum:
                self._quarantine_logged = checksum
                log.warning(
                    "OSC quarantined after a rollback; waiting for the Secret to change",
                    checksum=checksum,
                    unit=record.unit,
                    evidence=record.evidence,
                )
            return True
        if record.phase == "rolling-back":
            await self._roll_back(record)
            return True
        # Watching, and the agent restarted meanwhile. Killed during the apply: the apply is
        # resumed with this record (``_gate_begin``). Killed during the settle window: watch
        # what is left of it now.
        applied = await self.ctx.state.applied_checksum_async()
        if applied != checksum or await self.ctx.state.pending_async() is not None:
            return False
        evidence = await self.gate.watch(record, None, window=self.gate.remaining(record))
        if evidence is not None:
            await self._roll_back(await self.gate.rolling_back(record, evidence))
            return True
        await self.gate.clear()
        return False

    async def _gate_begin(
        self,
        checksum: str,
        *,
        first_apply: bool,
        retrying: bool,
        plan: Callable[[], Awaitable[ChangeSet]],
    ) -> GateRecord | None:
        """Before an update: the gate's record (the running units), or None when not gated:
        the gate is off, this is the first apply (nothing to go back to), or a retry of a
        partly failed update (its first try was gated).

        Only units the update's plan has a command for can be watched afterwards, so only they
        are asked about (one small systemd call, not one for every unit of the OSC); the plan
        is the one the apply then runs (``PlanOnce``)."""
        if not self.gate.enabled or first_apply:
            return None
        record = await self.gate.record()
        if record is not None and record.checksum == checksum and record.phase == "watching":
            return record  # the apply was interrupted by a crash: resume under the same gate
        if retrying:
            return None
        previous = await self.ctx.state.load_last_applied_async()
        if previous is None:
            return None
        change_set = await plan()
        units = [c.unit for c in change_set.unit_commands]
        return await self.gate.begin(checksum, previous, units)

    async def _gate_watch(
        self, record: GateRecord | None, rep: ApplyReport | None
    ) -> Evidence | None:
        """Watch the units the update restarted for the settle window: what broke one, or
        None (the gate is then cleared)."""
        if record is None or rep is None:
            return None
        evidence = await self.gate.watch(record, rep)
        if evidence is None:
            await self.gate.clear()
        return evidence

    async def _roll_back_update(
        self, record: GateRecord, evidence: Evidence, permit: Permit | None
    ) -> None:
        """The update broke a unit: roll it back, and tell the pool's rollout it failed."""
        try:
            await self._roll_back(await self.gate.rolling_back(record, evidence))
        finally:
            await self.rollout.failed(permit, f"rolled back: {evidence.describe()}")

    async def _roll_back(self, record: GateRecord) -> None:
        """Apply the last-known-good OSC again (restoring what the update changed and
        restarting those units once), then quarantine the update's checksum. A rollback that
        fails part-way raises ApplyError: the retry loop comes back here, with backoff."""
        raw = await self.gate.previous_raw(record)
        if raw is None:
            # Only a hand in the state directory gets here: the update stays, reported as it
            # is (its broken unit by the unit check), rather than retrying forever.
            message = (
                f"OSC {record.checksum[:12]} broke {record.unit}, but cannot be rolled back: "
                f"the copy of OSC {record.previous_checksum[:12]} kept for it is gone or changed"
            )
            log.error("rollback impossible", checksum=record.checksum, unit=record.unit)
            await self.ctx.event(report.REASON_OSC_ROLLED_BACK, message, warning=True)
            await self.gate.clear()
            return
        osc = await asyncio.to_thread(parse_osc, raw)
        resolved = record.previous_resolved
        if resolved is None:
            resolved = await self.resolve(osc)
        started = report.now()
        why = HistoryRollback(
            unit=record.unit,
            evidence=record.evidence or "",
            from_checksum=record.checksum,
            to_checksum=record.previous_checksum,
        )
        try:
            outcome = await self.applier.apply(raw, osc, record.previous_checksum, resolved)
        except ApplyError as exc:
            partial = exc.report if isinstance(exc.report, ApplyReport) else None
            await self._history(
                "rollback",
                record.checksum,
                record.previous_checksum,
                started,
                partial,
                None,
                str(exc),
                rollback=why,
            )
            raise
        rollback = await self.gate.quarantine(record)
        await self._history(
            "rollback",
            record.checksum,
            record.previous_checksum,
            started,
            outcome.report,
            outcome.change_set,
            rollback=why,
        )
        evidence = Evidence(rollback.unit, rollback.evidence)
        message = (
            f"OSC {rollback.checksum[:12]} rolled back to {rollback.to_checksum[:12]}: "
            f"{evidence.describe()}; restarted {', '.join(outcome.report.restarted) or 'none'}; "
            f"OSC {rollback.checksum[:12]} is not applied again until the Secret changes"
        )
        log.error(
            "OSC rolled back",
            checksum=rollback.checksum,
            to=rollback.to_checksum,
            unit=rollback.unit,
            evidence=rollback.evidence,
            restarted=outcome.report.restarted,
        )
        self.ctx.health.error("osc", message)
        # The checksum on the Node back to the OSC that is applied (upstream's vocabulary has
        # no other word for "rolled back"; the update's may have been reported before the
        # settle window), then the Warning that says why.
        await self._report_applied(osc, record.previous_checksum, only_if_missing=True)
        await self.ctx.event(report.REASON_OSC_ROLLED_BACK, message, warning=True)
        if outcome.restarts_agent:
            await self._restart_self()

    async def _history(
        self,
        trigger: Trigger,
        checksum_from: str | None,
        checksum_to: str,
        started: datetime,
        rep: ApplyReport | None,
        change_set: ChangeSet | None,
        error: str | None = None,
        *,
        rollback: Evidence | HistoryRollback | None = None,
        finished: datetime | None = None,
    ) -> None:
        """One entry of the apply history (``node-agent status --history``). ``rollback``: the
        evidence that got this update rolled back, or (the rollback's own apply) what it
        reverted."""
        result: Result = "failed" if error is not None else "succeeded"
        if isinstance(rollback, Evidence):
            result = "rolled-back"
            rollback = HistoryRollback(
                unit=rollback.unit,
                evidence=rollback.what,
                from_checksum=checksum_to,
                to_checksum=checksum_from or None,
            )
        finished = finished or report.now()
        entry = HistoryEntry(
            started_at=started,
            finished_at=finished,
            duration_seconds=max(0.0, (finished - started).total_seconds()),
            trigger=trigger,
            checksum_from=checksum_from or None,
            checksum_to=checksum_to,
            result=result,
            items_changed=changed_items(change_set, rep),
            restarted_units=tuple(rep.restarted) if rep is not None else (),
            failures=rep.failure_list() if rep is not None else (),
            rollback=rollback,
            error=error,
        )
        await self.ctx.state.append_history_async(entry)

    async def _repair_drift(self, raw: bytes, annotated: str | None) -> None:
        osc = await asyncio.to_thread(decode_osc, raw, annotated, self.ctx.host_name)
        started = report.now()
        checksum = await self.ctx.state.applied_checksum_async()
        try:
            outcome = await self.applier.repair_drift(osc, None)
        except ApplyError as exc:
            partial = exc.report if isinstance(exc.report, ApplyReport) else None
            await self._history("drift", checksum, checksum, started, partial, None, str(exc))
            raise
        if outcome is None:
            return
        await self._history(
            "drift", checksum, checksum, started, outcome.report, outcome.change_set
        )
        paths = sorted(
            [f.path for f in outcome.change_set.files_to_write]
            + [u.name for u in outcome.change_set.units_to_write]
            + [f"{d.unit}/{d.name}" for d in outcome.change_set.dropins_to_write]
        )
        restarted = ", ".join(outcome.report.restarted) or "none"
        message = f"rewrote {', '.join(paths)}; restarted {restarted}"
        await self.ctx.event(report.REASON_DRIFT_REPAIRED, message, warning=True)

    async def resolve(self, osc: OperatingSystemConfig) -> dict[str, bytes]:
        return await resolve_secret_refs(self.ctx.kube, osc, self.ctx.host_name)

    async def _reconciliation_delay(self) -> None:
        """Wait out the delay the Node's annotation asks for: from the Node's watch when it
        runs (no request on the update's critical path), else read once."""
        if self.ctx.node_name is None:
            return
        annotations = self._node_annotations
        if annotations is None:
            try:
                node = await self.ctx.kube.get_node(self.ctx.node_name)
            except KubeError:
                return
            annotations = (node.get("metadata") or {}).get("annotations") or {}
        value = annotations.get(report.ANNOTATION_RECONCILIATION_DELAY)
        if not value:
            return
        try:
            delay = parse_duration(value).total_seconds()
        except ValueError:
            log.warning("ignoring an invalid reconciliation delay", value=value)
            return
        if delay > 0:
            log.info("waiting before applying the updated OSC", seconds=delay)
            await asyncio.sleep(delay)

    def _next_kubernetes_version(self) -> str | None:
        """The ``kubernetesVersion`` of the config the agent's next start reads: the update
        just applied wrote it (a Kubernetes update changes the agent's config file and restarts
        the agent). Upstream's agent restarts before it reports such an update, and its new
        process writes the checksum and the new version in one patch; ours reports before its
        restart, so the label comes from that file, never the old one with the new checksum.
        The running config's version when the file cannot be read."""
        running = self.ctx.config.controllers.operating_system_config.kubernetes_version
        settings = self.ctx.settings
        path = settings.root / settings.config_file.lstrip("/")
        try:
            if config_version_key(path.name) is not None:
                path = find_config(path.parent)  # a newer config-<version>.yaml wins
            doc = yaml.safe_load(read_config_file(path))
            version = doc["controllers"]["operatingSystemConfig"]["kubernetesVersion"]
        except (ConfigError, yaml.YAMLError, KeyError, TypeError):
            return running
        return version if isinstance(version, str) and version else running

    async def _report_applied(
        self,
        osc: OperatingSystemConfig,
        checksum: str,
        *,
        only_if_missing: bool = False,
        next_config: bool = False,
    ) -> None:
        """The applied checksum (and version, role, zone labels) on the Node: one merge patch
        after an apply, no read. ``only_if_missing`` (a start or a resume finding the OSC
        applied) reads the Node first and writes only what it lacks. ``next_config``: the
        apply restarts the agent on a config it wrote; the version label is that config's.
        The first report of an apply made before the Node existed sends its ``OSCApplied``
        Event, as upstream does once the kubelet registered the Node."""
        if self.ctx.node_name is None:
            return
        version = self.ctx.config.controllers.operating_system_config.kubernetes_version
        if next_config:
            version = await asyncio.to_thread(self._next_kubernetes_version)
        if only_if_missing:
            node_meta = (await self.ctx.kube.get_node(self.ctx.node_name)).get("metadata") or {}
            annotations = node_meta.get("annotations") or {}
            if annotations.get(report.ANNOTATION_APPLIED_CHECKSUM) == checksum:
                # Reported before, maybe by this agent's previous process, from its config: a
                # Kubernetes update restarts the agent on a new config with a new version.
                relabel = report.version_label_patch(version, node_meta.get("labels") or {})
                if relabel is not None:
                    await self.ctx.kube.patch_node(self.ctx.node_name, relabel)
                    log.info("kubernetes version label updated", version=version)
                await self._drop_bootstrap_credentials()
                self._reported = checksum
                return
        zone_raw = self.ctx.fs.read(ZONE_FILE)
        zone = zone_raw.decode(errors="replace").strip() if zone_raw else None
        control_plane = any(
            f.path == report.CONTROL_PLANE_MARKER for f in osc_files(osc, self.ctx.host_name)
        )
        patch = report.applied_patch(
            checksum=checksum,
            kubernetes_version=version,
            control_plane=control_plane,
            zone=zone or None,
        )
        # Retired before the report, as upstream does: whoever sees the checksum on the Node
        # may rely on the token being gone.
        await self._drop_bootstrap_credentials()
        await self.ctx.kube.patch_node(self.ctx.node_name, patch)
        self._reported = checksum
        if self._unannounced is not None and self._unannounced[0] == checksum:
            await self.ctx.event(report.REASON_OSC_APPLIED, self._unannounced[1])
        self._unannounced = None

    async def _drop_bootstrap_credentials(self) -> None:
        """An OSC is applied and the Node registered: the bootstrap token (the agent's and the
        kubelet's copy of it, the kubelet's bootstrap kubeconfig) is not needed any more, and a
        leaked token must not outlive its use. Upstream's rule: both go once an apply is done
        and the Node exists (a registered Node means the kubelet used its bootstrap kubeconfig);
        plus the guard that the agent has a kubeconfig of its own.
        """
        fs = self.ctx.fs
        if await fs.read_async(self.ctx.config.client_connection.kubeconfig) is None:
            return
        paths = [BOOTSTRAP_TOKEN_FILE]
        # The one exception: a bootstrap kubeconfig written for the kubelet's re-bootstrap
        # under a rotated CA (upstream restarts before it reports such an update, so its next
        # reconcile deletes it) is kept until the kubelet has used it.
        inplace = self.inplace
        if not inplace.kubelet_rebootstrapping or await asyncio.to_thread(kubelet_bootstrapped, fs):
            inplace.kubelet_rebootstrapping = False
            paths.insert(0, KUBELET_BOOTSTRAP_KUBECONFIG)
        for path in paths:
            if await fs.remove_async(path):
                log.info("bootstrap credentials removed", path=path)


def _where(exc: BaseException, frames: int = 3) -> list[str]:
    """Where ``exc`` was raised: its innermost frames, as ``module path:line in function``."""
    where = []
    for frame in traceback.extract_tb(exc.__traceback__)[-frames:]:
        start = frame.filename.rfind("node_agent/")
        path = frame.filename[start:] if start >= 0 else frame.filename.rsplit("/", 1)[-1]
        where.append(f"{path}:{frame.lineno} in {frame.name}")
    return where


def changed_items(cs: ChangeSet | None, rep: ApplyReport | None) -> tuple[str, ...]:
    """The host paths and unit names an apply changed: from its change set when it finished,
    else what the attempt wrote."""
    if cs is not None:
        items = [f.path for f in cs.files_to_write] + [f.path for f in cs.files_to_delete]
        items += [u.name for u in cs.units_to_write] + [u.name for u in cs.units_to_delete]
        items += [f"{d.unit}/{d.name}" for d in cs.dropins_to_write]
        items += [f"{d.unit}/{d.name}" for d in cs.dropins_to_delete]
        return tuple(sorted(set(items)))
    if rep is None:
        return ()
    return tuple(sorted({*rep.files_written, *rep.files_deleted, *rep.units_written}))
