"""The OperatingSystemConfig controller: the node's desired files and units, applied.

One Secret is watched (list+watch with a name field selector). Events only wake the reconciler;
it always works on the latest Secret, so a burst of updates collapses into one apply. A bad
OSC is reported (log + Warning Event on the Node) and left alone until the Secret changes,
while transient failures (API, systemd, missing secretRef) are retried with jittered backoff.
The Node is annotated with the applied checksum only after everything succeeded.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from node_agent.apply.applier import Applier, Outcome, Planned
from node_agent.apply.executor import ApplyReport
from node_agent.base import retry
from node_agent.base.durations import parse_duration
from node_agent.base.errors import (
    ApplyError,
    KubeError,
    KubeNotFound,
    NodeAgentError,
    OSCDecodeError,
    OSCError,
    SecretRefError,
)
from node_agent.base.layout import BOOTSTRAP_TOKEN_FILE, KUBELET_BOOTSTRAP_KUBECONFIG
from node_agent.base.log import get_logger
from node_agent.base.retry import Backoff
from node_agent.config import ZONE_FILE
from node_agent.context import AgentContext
from node_agent.controllers.osc.breakage import Evidence
from node_agent.controllers.osc.health_gate import GateRecord, HealthGate
from node_agent.controllers.osc.rollout import Permit, Rollout
from node_agent.host.history import HistoryEntry, HistoryRollback, Result, Trigger
from node_agent.kube import report
from node_agent.kube.report import NAMESPACE
from node_agent.kube.watch import list_watch
from node_agent.osc.decode import decode_osc, parse_osc, sha256_hex
from node_agent.osc.merge import osc_files, secret_refs
from node_agent.osc.models import OperatingSystemConfig
from node_agent.osc.plan import ChangeSet

if TYPE_CHECKING:
    from node_agent.kube.seam import KubeSeam

DATA_KEY = "osc.yaml"
log = get_logger("node-agent.osc")

JSON = dict[str, Any]


def secret_bytes(secret: Mapping[str, Any], key: str, what: str) -> bytes:
    data = secret.get("data") or {}
    if key not in data:
        raise OSCDecodeError(f"{what} has no data key {key!r}")
    try:
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


class OSCController:
    def __init__(self, ctx: AgentContext, applier: Applier) -> None:
        self.ctx = ctx
        self.applier = applier
        self._latest: JSON | None = None
        self._seen = False
        self._wake = asyncio.Event()
        self._rejected: str | None = None  # resourceVersion of a Secret found invalid
        self._reported: str | None = None  # checksum last written to the Node
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
        )
        self._quarantine_logged: str | None = None
        #: serial mode and the paced rollout of the pool (the Lease <secretName>)
        self.rollout = Rollout(ctx, self._wake.set)
        self._applying = 0  # applies (and rollbacks, drift repairs) running now
        #: called after an OSC was applied and reported (the unit check looks at once)
        self.on_applied: list[Callable[[], None]] = []

    @property
    def applying(self) -> bool:
        """Whether the controller is changing the host now (an apply, a rollback, a drift
        repair, or the settle window after an update): the health checks hold their restarts."""
        return self._applying > 0

    @property
    def latest_secret(self) -> JSON | None:
        """The Secret as the watch last saw it (None: not seen yet, or deleted); for status."""
        return self._latest

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._watch(), name="osc-watch")
            tasks.create_task(self._reconcile_loop(), name="osc-reconcile")

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
                if event.type in ("SYNC", "ADDED", "MODIFIED"):
                    self._latest = event.object
                elif event.type == "DELETED":
                    self._latest = None
                self._seen = True
                self._wake.set()

    async def _reconcile_loop(self) -> None:
        period = self.ctx.config.controllers.operating_system_config.sync_period.total_seconds()
        backoff = Backoff.of(retry.APPLY)
        recheck = Backoff.of(retry.HELD_BACK)
        timeout = period
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=timeout)
            except TimeoutError:
                self._resync = True  # the periodic full check: also looks for drift on disk
            timeout = period
            self._wake.clear()
            if not self._seen:
                continue
            secret = self._latest
            self.ctx.health.progress("osc-reconcile")
            if secret is None:
                log.warning("OSC secret not found", secret=self.ctx.secret_name)
                continue
            resync, self._resync = self._resync, False
            try:
                await self.reconcile(secret, resync=resync)
                backoff.reset()
                self._last_failure = None
            except SecretRefError as exc:
                await self._failed(exc, transient=True)
            except OSCError as exc:
                self._rejected = str((secret.get("metadata") or {}).get("resourceVersion"))
                await self._failed(exc, transient=False)
                continue
            except ApplyError as exc:
                await self._partly_applied(exc)
            except NodeAgentError as exc:
                await self._failed(exc, transient=True)
            else:
                held = dict(self.applier.held_back())
                if held:
                    # e.g. a registry mirror that is not up yet: check again well before the
                    # periodic check, backing off, instead of pulling past it for hours
                    timeout = min(period, recheck.next())
                    log.info("items held back; checking again", items=held, seconds=timeout)
                else:
                    recheck.reset()
                continue
            delay = await backoff.wait(self._wake)
            log.info("retried the OSC apply", after_seconds=round(delay, 1))
            self._wake.set()

    async def _failed(self, exc: NodeAgentError, *, transient: bool) -> None:
        """Log and report a failed reconcile; the Warning Event only when the error is new, so a
        retry loop with backoff does not flood the Node with the same Event."""
        self.failures += 1
        kind = type(exc).__name__
        message = f"{kind}: {exc}"
        log.error("OSC not applied", error=message, retry=transient)
        self.ctx.health.error("osc", message)
        if message == self._last_failure:
            return
        self._last_failure = message
        reason = report.REASON_OSC_FAILED if transient else report.REASON_OSC_INVALID
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
        await self.ctx.systemd.restart_unit(self.ctx.settings.agent_unit)

    def retry_now(self) -> None:
        """What held a retry back is gone (a unit the restart-storm guard held came up by
        itself): look again now instead of after the backoff."""
        self._wake.set()

    def node_recreated(self) -> None:
        """The Node appeared (registered for the first time, or deleted and registered again):
        report the applied checksum on it anew."""
        self._reported = None
        self._wake.set()

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
            # A state file set aside (the history, status.json ...) is said once on the Node.
            for note in self.ctx.state.take_set_aside():
                await self.ctx.event(report.REASON_STATE_SET_ASIDE, note, warning=True)

    async def _reconcile(self, secret: JSON, *, resync: bool = False) -> Outcome | None:
        self.reconciles += 1
        meta = secret.get("metadata") or {}
        if self._rejected is not None and str(meta.get("resourceVersion")) == self._rejected:
            return None  # already reported; wait for the Secret to change
        self._rejected = None
        name = f"secret {NAMESPACE}/{meta.get('name')}"
        raw = secret_bytes(secret, DATA_KEY, name)
        annotated = (meta.get("annotations") or {}).get(report.ANNOTATION_SECRET_CHECKSUM)
        checksum = sha256_hex(raw)
        if await self._gate_decides(checksum):
            return None  # quarantined, or rolled back just now
        applied = await self.ctx.state.applied_checksum_async()
        if applied == checksum and await self.ctx.state.pending_async() is None:
            # Byte-identical to what is applied (and was validated then): no host action,
            # except on the periodic resync, which repairs drift on disk.
            if resync:
                await self._repair_drift(raw, annotated)
            if self._reported != checksum:
                await self._report_applied(
                    decode_osc(raw, annotated, self.ctx.host_name), checksum, only_if_missing=True
                )
            await self.rollout.up_to_date(checksum)
            return None
        # Parsing a large OSC takes tens of ms of CPU: off the loop, so heartbeats keep ticking.
        osc = await asyncio.to_thread(decode_osc, raw, annotated, self.ctx.host_name)
        self.desired_checksum = checksum
        first_apply = applied == ""
        pending = await self.ctx.state.pending_async()
        retrying = pending is not None and pending.osc_checksum == checksum
        if not first_apply and not retrying and not self.rollout.skips_delay(secret):
            await self._reconciliation_delay()
        resolved = await self.resolve(osc)
        planned: Planned | None = None

        async def plan_once() -> ChangeSet:
            # Admission asks for the plan only when it must judge what the update disrupts;
            # the apply below runs that same plan instead of making another.
            nonlocal planned
            if planned is None:
                planned = await self.applier.plan(osc, resolved)
            return planned.change_set

        permit = None
        if not first_apply:
            permit = await self.rollout.admit(secret, checksum, retrying=retrying, plan=plan_once)
            if permit is None:
                return None  # held by the pool's rollout; it wakes the loop to look again
        gate = await self._gate_begin(checksum, first_apply=first_apply, retrying=retrying)
        log.info("applying OSC", checksum=checksum, first=first_apply)
        started = report.now()
        trigger: Trigger = "resume" if retrying else "secret"
        try:
            outcome = await self.applier.apply(raw, osc, checksum, resolved, planned)
        except ApplyError as exc:
            # A partly failed update may have broken a running unit too (its restart failed).
            partial = exc.report if isinstance(exc.report, ApplyReport) else None
            finished = report.now()
            broke = await self._gate_watch(gate, partial)
            await self._history(
                trigger,
                applied,
                checksum,
                started,
                partial,
                None,
                str(exc),
                rollback=broke,
                finished=finished,
            )
            if gate is not None and broke is not None:
                await self._roll_back_update(gate, broke, permit)
                return None
            await self.rollout.failed(permit, str(exc))
            raise
        self.applies += 1
        self.last_outcome = outcome
        for _unit, result in sorted(outcome.report.results.items()):
            reason = report.REASON_UNIT_COMMAND.get(result.action, "SystemDUnitRestart")
            await self.ctx.event(reason, result.describe(), warning=not result.ok)
        finished = report.now()  # the apply's duration, without the settle window
        broke = await self._gate_watch(gate, outcome.report)
        await self._history(
            trigger,
            applied,
            checksum,
            started,
            outcome.report,
            outcome.change_set,
            rollback=broke,
            finished=finished,
        )
        if gate is not None and broke is not None:
            await self._roll_back_update(gate, broke, permit)
            return None  # rolled back: the Node keeps the old checksum
        await self._report_applied(osc, checksum)
        for hook in self.on_applied:
            hook()
        await self.rollout.succeeded(permit)
        if outcome.report.skipped:
            await self.ctx.event(
                report.REASON_OSC_SKIPPED, "; ".join(outcome.report.skipped), warning=True
            )
        summary = ", ".join(outcome.change_set.reasons()) or "no unit changes"
        await self.ctx.event(report.REASON_OSC_APPLIED, f"OSC {checksum[:12]} applied: {summary}")
        log.info(
            "OSC applied",
            checksum=checksum,
            seconds=round(outcome.report.duration, 3),
            restarted=outcome.report.restarted,
            files=len(outcome.report.files_written),
            orphans=outcome.orphans_removed,
        )
        if outcome.restarts_agent:
            await self._restart_self()
        return outcome

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
        self, checksum: str, *, first_apply: bool, retrying: bool
    ) -> GateRecord | None:
        """Before an update: the gate's record (the running units), or None when not gated:
        the gate is off, this is the first apply (nothing to go back to), or a retry of a
        partly failed update (its first try was gated)."""
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
        units = (await asyncio.to_thread(self.applier.last_applied)).units
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
        raw = record.previous_raw
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
        await self.ctx.event(report.REASON_OSC_ROLLED_BACK, message, warning=True)
        await self._report_applied(osc, record.previous_checksum, only_if_missing=True)
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
        if self.ctx.node_name is None:
            return
        try:
            node = await self.ctx.kube.get_node(self.ctx.node_name)
        except KubeError:
            return
        value = ((node.get("metadata") or {}).get("annotations") or {}).get(
            report.ANNOTATION_RECONCILIATION_DELAY
        )
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

    async def _report_applied(
        self, osc: OperatingSystemConfig, checksum: str, *, only_if_missing: bool = False
    ) -> None:
        if self.ctx.node_name is None:
            return
        node = await self.ctx.kube.get_node(self.ctx.node_name)
        node_meta = node.get("metadata") or {}
        annotations = node_meta.get("annotations") or {}
        version = self.ctx.config.controllers.operating_system_config.kubernetes_version
        if only_if_missing and annotations.get(report.ANNOTATION_APPLIED_CHECKSUM) == checksum:
            # Reported before, maybe by this agent's previous process, from its config: a
            # Kubernetes update restarts the agent on a new config with a new version.
            relabel = report.version_label_patch(version, node_meta.get("labels") or {})
            if relabel is not None:
                await self.ctx.kube.patch_node(self.ctx.node_name, relabel)
                log.info("kubernetes version label updated", version=version)
            self._reported = checksum
            await self._drop_bootstrap_credentials()
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
            current_labels=node_meta.get("labels") or {},
        )
        await self.ctx.kube.patch_node(self.ctx.node_name, patch)
        self._reported = checksum
        await self._drop_bootstrap_credentials()

    async def _drop_bootstrap_credentials(self) -> None:
        """An OSC is applied and the Node registered: the bootstrap token (the agent's and the
        kubelet's copy of it) is not needed any more, and a leaked token must not outlive its
        use. Only once the agent has a kubeconfig of its own (upstream's rule, plus that guard).
        """
        fs = self.ctx.fs
        if await fs.read_async(self.ctx.config.client_connection.kubeconfig) is None:
            return
        for path in (KUBELET_BOOTSTRAP_KUBECONFIG, BOOTSTRAP_TOKEN_FILE):
            if await fs.remove_async(path):
                log.info("bootstrap credentials removed", path=path)


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
