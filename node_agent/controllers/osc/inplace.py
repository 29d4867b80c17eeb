"""In-place updates: the steps around the apply that an in-place pool's OSC change asks for.

The OSC controller calls, for an update of a pool with ``spec.inPlaceUpdates``:

1. :meth:`InPlaceUpdater.begin` — what the change asks in place (``node_agent.osc.inplace``),
   computed once per checksum against the last applied OSC and persisted (``in-place-update.json``
   beside the journal) before anything is touched, each part cleared as its step is done. A
   restart (the OS update's reboot, a kill -9) resumes from that record, never from a new
   comparison (after the apply, last-applied already equals the new OSC).
2. :meth:`InPlaceUpdater.admitted` — the drain gate: nothing is applied until
   machine-controller-manager put the condition ``InPlaceUpdate``/``ReadyForUpdate`` on the Node
   (or an earlier try failed: the update is retried). The Node's watch wakes the controller when
   it appears (:meth:`node_seen`); upstream waits for its resync then.
3. :meth:`InPlaceUpdater.before_apply` — a CPU manager policy change removes the kubelet's
   ``cpu_manager_state`` before the apply restarts the kubelet on the new policy.
4. the ordinary journaled apply (files, units, restarts).
5. :meth:`InPlaceUpdater.finish` — the kubelet's health awaited after a minor/config update;
   the OS update (Node annotation, the OS extension's command with upstream's retry rules, then
   the reboot); credentials rotations; and the outcome on the Node as machine-controller-manager
   reads it (label ``node.machine.sapcloud.io/update-result``, annotation
   ``node.machine.sapcloud.io/update-failed-reason``).

A step that cannot succeed (a non-retriable OS update error, the kubelet unhealthy for 5
minutes, an OS that came back on its old version) marks the Node failed and raises a terminal
:class:`InPlaceUpdateError`: the OSC is left until the Secret changes, as upstream does. So does
an update whose in-place changes cannot be computed (a version or kubelet config of the OSC that
cannot be read): it is still applied after the drain, and then marked failed with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from node_agent.apply.executor import crash_hook
from node_agent.base import layout
from node_agent.base.errors import InPlaceUpdateError, KubeError, KubeInvalid, NodeAgentError
from node_agent.base.log import get_logger
from node_agent.base.versions import shown
from node_agent.context import AgentContext
from node_agent.host.documents import Document
from node_agent.host.fs import HostFS
from node_agent.host.history import HistoryEntry
from node_agent.kube import report
from node_agent.osc import inplace as ip
from node_agent.osc.decode import parse_osc
from node_agent.osc.models import OperatingSystemConfig

log = get_logger("node-agent.inplace")

JSON = dict[str, Any]
Finish = Literal["done", "rebooting"]
#: Where an in-place update stands (``status``, metrics): detected and waiting for the drain,
#: the kubelet's update, the OS update command, the reboot after it, the credentials rotation,
#: and the outcome (``done``/``failed``, kept until the next in-place update).
Phase = Literal[
    "waiting-for-drain", "kubelet", "updating-os", "rebooting", "credentials", "done", "failed"
]
PHASES: tuple[Phase, ...] = (
    "waiting-for-drain",
    "kubelet",
    "updating-os",
    "rebooting",
    "credentials",
    "done",
    "failed",
)

REASON_WAITING = "InPlaceUpdateWaitingForDrain"
REASON_STARTED = "InPlaceUpdateStarted"
REASON_OS_UPDATE = "InPlaceOSUpdate"
REASON_REBOOTING = "InPlaceUpdateRebooting"
REASON_SUCCEEDED = "InPlaceUpdateSuccessful"
REASON_FAILED = "InPlaceUpdateFailed"

#: seconds to read what an OS update command killed at its time limit had written
KILL_GRACE = 5.0


class InPlaceRecord(Document):
    """The in-place part of the change set being applied (persisted, 0600)."""

    checksum: str
    detected: ip.InPlaceChanges
    remaining: ip.InPlaceChanges
    target_os: str = ""
    cpu_state_removed: bool = False
    #: the OS update command succeeded, on the boot named here (boot id + PID 1's start)
    os_command_boot: str | None = None
    began_at: datetime
    #: a terminal failure (the reason on the Node): kept until the OSC changes, so that a
    #: restarted agent neither tries the update again nor records its outcome twice
    failed: str | None = None
    #: why the in-place changes could not be computed: the update is applied after the drain
    #: and then fails with this reason (``detected`` is empty)
    unreadable: str | None = None


@dataclass(frozen=True)
class InPlaceView:
    """The in-place update as ``node-agent status`` and the metrics show it."""

    phase: Phase | None = None
    #: what the phase waits for or does, in words
    detail: str = ""
    checksum: str | None = None
    #: the parts detected, and those still to do
    parts: tuple[str, ...] = ()
    remaining: tuple[str, ...] = ()
    #: why it failed (the Node's ``update-failed-reason``)
    reason: str | None = None
    #: ``time.time()`` when the phase began
    since: float | None = None
    succeeded: int = 0
    failed: int = 0
    #: runs of the OS update command by this process (retries included)
    command_runs: int = 0
    #: Pods deleted from the Node before it was marked successful
    pods_deleted: int = 0


#: runs the OS update command: its exit status and its output (bounded, see ``CommandOutput``)
RunCommand = Callable[[Sequence[str], float], Awaitable[tuple[int, ip.CommandOutput]]]


class InPlaceUpdater:
    def __init__(
        self,
        ctx: AgentContext,
        *,
        run: RunCommand | None = None,
        retry_interval: float = ip.OS_UPDATE_RETRY_INTERVAL,
        retry_timeout: float = ip.OS_UPDATE_RETRY_TIMEOUT,
        health_interval: float = ip.KUBELET_HEALTH_RETRY_INTERVAL,
        health_timeout: float = ip.KUBELET_HEALTH_RETRY_TIMEOUT,
    ) -> None:
        self.ctx = ctx
        self._run = run or self._run_on_host
        self.retry_interval, self.retry_timeout = retry_interval, retry_timeout
        self.health_interval, self.health_timeout = health_interval, health_timeout
        #: called when the Node turns ready for the update (wakes the OSC controller)
        self.on_ready: list[Callable[[], None]] = []
        #: token Secrets to sync again at once (service account key rotation)
        self.resync_tokens: list[Callable[[], Awaitable[object]]] = []
        #: the agent's own client certificate, renewed now (CA rotation)
        self.renew_certificate: Callable[[], Awaitable[object]] | None = None
        #: the kubelet's /healthz (the health checks' own probe; None: healthy)
        self.kubelet_health: Callable[[], Awaitable[str | None]] | None = None
        self._was_ready: bool | None = None
        #: the kubelet's bootstrap kubeconfig was written for a re-bootstrap under a rotated CA
        #: (kept until the kubelet has used it; in memory: a restarted agent drops it at its
        #: next report, as upstream's next reconcile after its own restart does)
        self.kubelet_rebootstrapping = False
        self._waiting_said: str | None = None
        #: what ``status`` and the metrics show (``view``)
        self._view = InPlaceView()
        self._current: InPlaceRecord | None = None  # the record being worked on

    @property
    def phase(self) -> Phase | None:
        return self._view.phase

    @property
    def command_runs(self) -> int:
        return self._view.command_runs

    def view(self) -> InPlaceView:
        return self._view

    def _enter(
        self, phase: Phase, detail: str, record: InPlaceRecord | None = None, **more: Any
    ) -> None:
        """Move to ``phase`` (its start time kept while it stays the same)."""
        view = self._view
        since = view.since if view.phase == phase and view.since else time.time()
        if record is not None:
            more.setdefault("checksum", record.checksum)
            more.setdefault("parts", record.detected.names())
            more.setdefault("remaining", record.remaining.names())
        self._view = replace(view, phase=phase, detail=detail, since=since, **more)

    # -- the record -------------------------------------------------------------------------
    async def record(self) -> InPlaceRecord | None:
        return await self.ctx.state.load_doc_async(layout.IN_PLACE, InPlaceRecord)

    async def _save(self, record: InPlaceRecord) -> InPlaceRecord:
        await self.ctx.state.save_doc_async(layout.IN_PLACE, record)
        self._current = record
        return record

    async def _clear_parts(self, record: InPlaceRecord, **parts: bool) -> InPlaceRecord:
        remaining = record.remaining.model_copy(update={k: False for k in parts})
        record = await self._save(record.model_copy(update={"remaining": remaining}))
        self._view = replace(self._view, remaining=remaining.names())
        return record

    async def clear(self) -> None:
        await self.ctx.state.remove_doc_async(layout.IN_PLACE)

    def current_os(self) -> str | None:
        """The host's OS version (``PRETTY_NAME``); ``/usr/lib/os-release`` when ``/etc``'s is
        missing or a link (the os-release specification's fallback)."""
        for path in (ip.OS_RELEASE, "/usr/lib/os-release"):
            try:
                raw = self.ctx.fs.read(path, limit=1 << 16)
            except NodeAgentError:
                continue
            if raw is not None:
                try:
                    return ip.os_version(raw.decode(errors="replace"))
                except ip.InPlaceError as exc:
                    raise InPlaceUpdateError(str(exc)) from exc
        raise InPlaceUpdateError(f"{ip.OS_RELEASE} not found")

    async def begin(self, osc: OperatingSystemConfig, checksum: str) -> InPlaceRecord | None:
        """The in-place parts of the update to ``checksum`` (persisted), or None when it has
        none. An OS update already on the host (after its reboot) is cleared here."""
        record = await self.record()
        if record is not None and record.checksum != checksum:
            log.info("a newer OSC replaces the unfinished in-place update", was=record.checksum)
            await self.clear()
            record = None
        self._current = record
        if record is not None and record.failed is not None:
            # failed for good before a restart: the outcome stands until the OSC changes
            self._enter("failed", record.failed, record, reason=record.failed)
            node = await self._node()
            if node is not None and ip.update_result(node) != ip.RESULT_FAILED:
                await self._mark_failed(record.failed)
            raise InPlaceUpdateError(record.failed, terminal=True)
        if osc.spec.in_place_updates is None:
            return None
        current = await asyncio.to_thread(self.current_os)
        if record is None:
            last = await self.ctx.state.load_last_applied_async()
            if last is None:
                return None
            old = await asyncio.to_thread(parse_osc, last.raw)
            unreadable = None
            try:
                changes = ip.detect(old, osc, current)
            except ip.InPlaceError as exc:
                # this update's failure, not the agent's: it goes on to its drain and apply
                changes = ip.InPlaceChanges()
                unreadable = ip.bounded_reason(f"in-place changes not computed: {exc}")
            if not changes.any() and unreadable is None:
                return None
            record = await self._save(
                InPlaceRecord(
                    checksum=checksum,
                    detected=changes,
                    remaining=changes,
                    target_os=osc.spec.in_place_updates.operating_system_version,
                    began_at=report.now(),
                    unreadable=unreadable,
                )
            )
            if unreadable is not None:
                log.error("in-place update fails after its apply", reason=unreadable)
            else:
                log.info("in-place update detected", checksum=checksum, parts=changes.names())
            crash_hook("in-place:detected")
        if record.remaining.operating_system and self._up_to_date(current, osc):
            log.info("the OS is on its new version", version=current)
            record = await self._clear_parts(record, operating_system=True)
        self._view = replace(
            self._view,
            checksum=record.checksum,
            parts=record.detected.names(),
            remaining=record.remaining.names(),
            reason=None,
        )
        return record

    # -- the drain gate -------------------------------------------------------------------------
    async def admitted(self, record: InPlaceRecord) -> bool:
        """Whether machine-controller-manager lets the node update now."""
        node = await self._node()
        if node is not None and ip.may_update(node):
            if self._waiting_said is not None:
                await self.ctx.event(REASON_STARTED, f"in-place update {_parts(record)} started")
            self._waiting_said = None
            return True
        self._enter(
            "waiting-for-drain",
            f"condition {ip.CONDITION_IN_PLACE_UPDATE} with reason {ip.REASON_READY_FOR_UPDATE}",
            record,
        )
        if self._waiting_said != record.checksum:
            self._waiting_said = record.checksum
            log.info("in-place update waits for the drain", parts=record.remaining.names())
            await self.ctx.event(
                REASON_WAITING,
                f"in-place update {_parts(record)} waits for condition "
                f"{ip.CONDITION_IN_PLACE_UPDATE} with reason {ip.REASON_READY_FOR_UPDATE}",
            )
        return False

    def node_seen(self, node: Mapping[str, Any]) -> None:
        """The Node's watch: wake the OSC controller when the node turns ready for the update."""
        ready = ip.may_update(node)
        if ready and self._was_ready is not True:
            for wake in self.on_ready:
                wake()
        self._was_ready = ready

    # -- before the apply -----------------------------------------------------------------------
    async def before_apply(self, record: InPlaceRecord) -> InPlaceRecord:
        """A new CPU manager policy: the kubelet refuses to start on the old policy's state, so
        it goes before the apply restarts the kubelet (upstream removes it with the unit)."""
        if record.remaining.cpu_manager_policy and not record.cpu_state_removed:
            if await self.ctx.fs.remove_async(ip.CPU_MANAGER_STATE):
                log.info("kubelet CPU manager state removed", path=ip.CPU_MANAGER_STATE)
            record = await self._save(record.model_copy(update={"cpu_state_removed": True}))
        return record

    # -- after the apply ------------------------------------------------------------------------
    async def finish(self, osc: OperatingSystemConfig, record: InPlaceRecord | None) -> Finish:
        """The in-place steps after the apply, then the outcome on the Node. "rebooting": the
        OS update ran and the node is to come back on the new OS (the checksum is not reported
        until then)."""
        if osc.spec.in_place_updates is None:
            return "done"
        node = await self._node()
        if node is None:
            return "done"
        if record is not None:
            if record.unreadable is not None:
                await self._failed(record.unreadable)
            if record.remaining.kubelet():
                await self._kubelet_healthy("after its minor version/config update")
                record = await self._clear_parts(
                    record, kubelet_minor_version=True, kubelet_config=True, cpu_manager_policy=True
                )
            if record.remaining.operating_system:
                record = await self._update_os(osc, record, node)
                if record.remaining.operating_system:
                    self._enter("rebooting", f"into OS version {record.target_os}", record)
                    return "rebooting"
            record = await self._rotate_credentials(record)
        if ip.owes_outcome(node):
            deleted = await self._delete_remaining_pods()
            await self.ctx.kube.patch_node(str(self.ctx.node_name), ip.successful_patch())
            parts = _parts(record) if record is not None else "(no in-place parts)"
            await self.ctx.event(REASON_SUCCEEDED, f"in-place update {parts} successful")
            log.info("in-place update successful", parts=record.detected.names() if record else ())
            if record is not None:
                await self._history(record, None)
            view = self._view
            self._enter(
                "done",
                f"in-place update {parts} successful",
                record,
                succeeded=view.succeeded + 1,
                pods_deleted=view.pods_deleted + deleted,
            )
        await self.clear()
        return "done"

    async def _delete_remaining_pods(self) -> int:
        """Upstream's last step before the success label: every Pod still bound to the Node
        goes (DaemonSet Pods and Pods with local storage came back during the update; deleting
        them has them recreated on the updated node). How many were deleted."""
        node = str(self.ctx.node_name)
        pods = await self.ctx.kube.list_pods_on_node(node)
        for pod in pods:
            meta = pod.get("metadata") or {}
            await self.ctx.kube.delete_pod(str(meta.get("namespace")), str(meta.get("name")))
        if pods:
            log.info("pods on the node deleted after the in-place update", count=len(pods))
        return len(pods)

    async def _history(self, record: InPlaceRecord, error: str | None) -> None:
        """One entry of the apply history per in-place outcome (``status --history``)."""
        finished = report.now()
        await self.ctx.state.append_history_async(
            HistoryEntry(
                started_at=record.began_at,
                finished_at=finished,
                duration_seconds=max(0.0, (finished - record.began_at).total_seconds()),
                trigger="in-place",
                checksum_to=record.checksum,
                result="failed" if error is not None else "succeeded",
                items_changed=record.detected.names(),
                error=error,
            )
        )

    async def _update_os(
        self, osc: OperatingSystemConfig, record: InPlaceRecord, node: Mapping[str, Any]
    ) -> InPlaceRecord:
        spec = osc.spec.in_place_updates
        assert spec is not None
        desired = spec.operating_system_version
        boot = await asyncio.to_thread(self._boot)
        if record.os_command_boot is not None:
            if record.os_command_boot == boot:
                return record  # the command ran on this boot; the reboot is still to come
            # Rebooted after the command, and not on the new version: it rolled back.
            reason = (
                "OS update might have failed and rolled back to the previous version. Desired "
                f'version: "{desired}", Current version: "{self.current_os()}"'
            )
            await self._failed(reason)
        status = osc.status.in_place_updates
        update = (status.os_update if status is not None else None) or {}
        command = str(update.get("command") or "")
        if not command:
            await self._failed("update command is not provided in OSC, cannot proceed")
        if not desired:
            await self._failed("operating system version is not provided in OSC")
        args = [str(a) for a in update.get("args") or ()]
        try:
            await self.ctx.kube.patch_node(str(self.ctx.node_name), ip.updating_os_patch(desired))
        except KubeInvalid as exc:  # sent again, it would be refused again
            await self._failed(
                f"the Node refused the annotation {ip.ANNOTATION_UPDATING_OS_VERSION} for "
                f"version {shown(desired)}: {exc}"
            )
        self._enter("updating-os", f"{command} (to {desired})", record)
        await self.ctx.event(REASON_OS_UPDATE, f"updating the OS to {desired}: {command}")
        await self._run_os_command([command, *args])
        record = await self._save(record.model_copy(update={"os_command_boot": boot}))
        if self._up_to_date(self.current_os(), osc):
            return await self._clear_parts(record, operating_system=True)
        await self.ctx.event(
            REASON_REBOOTING, f"OS update to {desired} ran; waiting for the node to reboot"
        )
        log.info("OS update ran; the node reboots into the new version", version=desired)
        return record

    async def _run_os_command(self, argv: list[str]) -> None:
        """Upstream's rules: a failure whose output says "network problems" is retried every
        30 s for up to 5 min; any other failure ends the update. The reason carries the end of
        the output (and its size, when that is not all of it)."""
        deadline = time.monotonic() + self.retry_timeout
        while True:
            self._view = replace(self._view, command_runs=self._view.command_runs + 1)
            code, output = await self._run(argv, self.retry_timeout)
            if code == 0:
                log.info("OS update command succeeded", command=argv[0])
                return
            kind = output.kind
            log.warning(
                "OS update command failed",
                code=code,
                kind=kind,
                output_bytes=output.total,
                output_tail=output.text()[-500:],
            )
            if kind != "retriable":
                what = (
                    "non-retriable error detected"
                    if kind == "non-retriable"
                    else ("no specific error detected")
                )
                await self._failed(
                    f"failed to execute OS update command: {what}: exit status {code}, "
                    f"{output.reported()}"
                )
            if time.monotonic() + self.retry_interval > deadline:
                reason = (
                    f"failed to execute OS update command: retriable error: {output.reported()}"
                )
                # retried by the controller, as upstream (the failed label lets it through the
                # drain gate again)
                await self._failed(reason, terminal=False)
            await asyncio.sleep(self.retry_interval)

    async def _run_on_host(self, argv: Sequence[str], limit: float) -> tuple[int, ip.CommandOutput]:
        """The command on the host; with a ``--root`` prefix, inside that root. Its output
        (stdout and stderr) is read as it comes and kept in bounded memory: a command that
        prints hundreds of MB costs the agent no more than one that prints a line."""
        root = self.ctx.settings.root
        full = list(argv) if root == Path("/") else ["chroot", str(root), *argv]
        output = ip.CommandOutput()
        try:
            proc = await asyncio.create_subprocess_exec(
                *full,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # its own process group: a timeout ends all of it
            )
        except (OSError, ValueError) as exc:  # ValueError: a NUL byte, which exec cannot pass
            output.feed(f"cannot run {shown(argv[0])}: {exc}".encode())
            return 127, output
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit):
                return await _finished(proc, output), output
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        # What it wrote before it died is read too: the process counts as ended only once its
        # pipe is closed. Something outside its group may hold the pipe: not waited for long.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(KILL_GRACE):
                await _finished(proc, output)
        output.feed(f" [timed out after {limit:g}s]".encode())
        return -1, output

    def _boot(self) -> str:
        """This boot's identity: the kernel's boot id and the start of PID 1 (a node whose init
        restarts, as on the test bed, is a new boot too)."""
        root = self.ctx.settings.root
        parts = []
        for path in ("proc/sys/kernel/random/boot_id", "proc/1/stat"):
            try:
                text = (root / path).read_text().strip()
            except OSError:
                text = ""
            if path.endswith("stat") and ")" in text:
                text = text.rsplit(")", 1)[1].split()[19]  # starttime
            parts.append(text)
        return "/".join(parts)

    async def _kubelet_healthy(self, why: str) -> None:
        """Wait for the kubelet's ``/healthz`` (5 s apart, 5 min); unhealthy: failed."""
        probe = self.kubelet_health
        if probe is None:
            log.warning("no kubelet health probe wired; not awaited", after=why)
            return
        deadline = time.monotonic() + self.health_timeout
        self._enter("kubelet", f"waiting for the kubelet to be healthy {why}")
        while True:
            error = await probe()
            if error is None:
                log.info("kubelet healthy", after=why)
                return
            if time.monotonic() + self.health_interval > deadline:
                await self._failed(f"kubelet is not healthy {why}: {error}")
            await asyncio.sleep(self.health_interval)

    async def _rotate_credentials(self, record: InPlaceRecord) -> InPlaceRecord:
        if record.remaining.sa_key_rotation or record.remaining.ca_rotation_node_agent:
            self._enter("credentials", "rotating the credentials", record)
        if record.remaining.sa_key_rotation:
            for resync in self.resync_tokens:
                await resync()
            log.info("token Secrets synced again after a service account key rotation")
            record = await self._clear_parts(record, sa_key_rotation=True)
        if record.remaining.ca_rotation_node_agent:
            if self.renew_certificate is not None:
                await self.renew_certificate()
                log.info("the agent's client certificate renewed after a CA rotation")
            record = await self._clear_parts(record, ca_rotation_node_agent=True)
        if record.remaining.ca_rotation_kubelet:
            await self._rebootstrap_kubelet()
            await self._kubelet_healthy("after the CA rotation")
            record = await self._clear_parts(record, ca_rotation_kubelet=True)
        return record

    async def _rebootstrap_kubelet(self) -> None:
        """The kubelet asks for a new client certificate under the new CA: its current
        certificate becomes the bootstrap credential (a kubeconfig on the new CA bundle), its
        kubeconfig and certificates go, and it restarts."""
        fs = self.ctx.fs
        server = self.ctx.config.api_server.server
        ca_file = self.ctx.config.api_server.ca_file
        # the kubelet keeps it as a link to its dated certificate file beside it
        cert = await asyncio.to_thread(
            fs.read_through_sibling_link, ip.KUBELET_CLIENT_CERT, limit=ip.MAX_KUBELET_CERT_BYTES
        )
        if await fs.read_async(ip.KUBELET_KUBECONFIG) is not None and cert is not None:
            await asyncio.to_thread(
                fs.write_atomic,
                ip.KUBELET_BOOTSTRAP_KUBECONFIG,
                _kubelet_bootstrap_kubeconfig(
                    server, ca_file, cert, self.ctx.config.api_server.ca_bundle
                ),
                0o600,
            )
            self.kubelet_rebootstrapping = True
        if await fs.read_async(ip.KUBELET_BOOTSTRAP_KUBECONFIG) is None:
            await self._failed(
                f"kubeconfig file {ip.KUBELET_BOOTSTRAP_KUBECONFIG!r} does not exist, "
                "cannot proceed with rebootstrap"
            )
        await fs.remove_async(ip.KUBELET_KUBECONFIG)
        for name in await asyncio.to_thread(fs.list_dir, ip.KUBELET_PKI_DIR) or []:
            await fs.remove_async(f"{ip.KUBELET_PKI_DIR}/{name}")
        await asyncio.to_thread(fs.remove_dir_if_empty, ip.KUBELET_PKI_DIR)
        result = await self.ctx.systemd.restart_unit(ip.KUBELET_UNIT)
        await self.ctx.event(
            report.REASON_UNIT_COMMAND["restart"],
            f"{ip.KUBELET_UNIT} restarted to bootstrap under the rotated CA: {result}",
        )

    async def _failed(self, reason: str, *, terminal: bool = True) -> None:
        """Mark the Node failed (machine-controller-manager's label and reason), record the
        outcome (history, ``status``) and end the update: until the Secret changes
        (``terminal``), else until the controller's retry. The reason is bounded
        (``ip.bounded_reason``) everywhere it goes."""
        reason = ip.bounded_reason(reason)
        log.error("in-place update failed", reason=reason, terminal=terminal)
        record = self._current
        if record is not None and terminal:
            # persisted first: a restart keeps the outcome (and marks the Node if this did not)
            record = await self._save(record.model_copy(update={"failed": reason}))
        self._enter("failed", reason, record, reason=reason, failed=self._view.failed + 1)
        if self.ctx.node_name is not None:
            try:
                marked = await self._mark_failed(reason)
            except KubeError as exc:
                raise InPlaceUpdateError(f"{reason} (Node not marked: {exc})") from exc
            terminal = terminal or not marked  # a retry would send the refused patches again
        await self.ctx.event(REASON_FAILED, reason, warning=True)
        if record is not None:
            await self._history(record, reason)
        raise InPlaceUpdateError(reason, terminal=terminal)

    async def _mark_failed(self, reason: str) -> bool:
        """The failed label and ``reason`` on the Node; whether the label is on it. A patch
        the API server refuses as invalid (422: e.g. the Node's annotations would pass
        Kubernetes' 256 KiB) is never sent again: the label goes with a short note instead,
        then alone. Other API errors are raised (retried)."""
        name = str(self.ctx.node_name)
        attempts: list[str | None] = [reason]
        while attempts:
            attempt = attempts.pop(0)
            try:
                await self.ctx.kube.patch_node(name, ip.failed_patch(attempt))
                return True
            except KubeInvalid as exc:
                log.error("the Node refused the in-place outcome", reason=attempt, error=str(exc))
                if attempt == reason:
                    attempts = [ip.REASON_REFUSED.format(error=shown(str(exc), 200)), None]
        return False

    @staticmethod
    def _up_to_date(current: str | None, osc: OperatingSystemConfig) -> bool:
        """Whether the host's OS version is the OSC's; a host version that cannot be compared
        is retried (the OSC's was read when the update was detected)."""
        try:
            return ip.os_up_to_date(current, osc)
        except ip.InPlaceError as exc:
            raise InPlaceUpdateError(str(exc)) from exc

    async def _node(self) -> JSON | None:
        if self.ctx.node_name is None and not await self.ctx.look_up_node():
            return None
        return await self.ctx.kube.get_node(str(self.ctx.node_name))


def kubelet_bootstrapped(fs: HostFS) -> bool:
    """Whether the kubelet has used its bootstrap kubeconfig: its own kubeconfig was written
    after it (a kubelet writes it once its certificate is signed). Until then the bootstrap
    kubeconfig is still needed, e.g. by a kubelet re-bootstrapping after a CA rotation."""
    bootstrap = fs.lstat(ip.KUBELET_BOOTSTRAP_KUBECONFIG)
    if bootstrap is None:
        return True
    own = fs.lstat(ip.KUBELET_KUBECONFIG)
    return own is not None and own.st_mtime_ns > bootstrap.st_mtime_ns


async def _finished(proc: asyncio.subprocess.Process, output: ip.CommandOutput) -> int:
    """Read ``proc``'s output to its end, then its exit status."""
    assert proc.stdout is not None
    while chunk := await proc.stdout.read(1 << 16):
        output.feed(chunk)
    return await proc.wait()


def _parts(record: InPlaceRecord) -> str:
    if record.unreadable is not None:
        return "(changes not computed)"
    return "(" + ", ".join(record.detected.names()) + ")"


def _kubelet_bootstrap_kubeconfig(
    server: str, ca_file: str, cert: bytes, ca_data: bytes | None = None
) -> bytes:
    import base64

    import yaml

    from node_agent.kube.certificates import cluster_ca

    data = base64.b64encode(cert).decode()
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "default-cluster",
                "cluster": {"server": server, **cluster_ca(ca_file, ca_data)},
            }
        ],
        "users": [
            {
                "name": "default-auth",
                "user": {"client-certificate-data": data, "client-key-data": data},
            }
        ],
        "contexts": [
            {
                "name": "default-context",
                "context": {"cluster": "default-cluster", "user": "default-auth"},
            }
        ],
        "current-context": "default-context",
    }
    return yaml.safe_dump(doc).encode()
