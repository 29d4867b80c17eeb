"""The Node controller: acts on what operators and Gardener ask of this node through its Node.

- annotation ``worker.gardener.cloud/restart-systemd-services`` (comma list; ``.service`` is
  added to names without a unit suffix): restart each unit, one ``SystemDUnitRestart`` Event per
  unit (Warning when it failed), then remove the annotation (merge patch). If the agent's own
  unit is listed, the annotation is removed *first* and the agent restarts itself *last*, so a
  restarted agent never finds the annotation again and never loops.
- label ``worker.gardener.cloud/gardener-node-agent-secret-name``: when it names another OSC
  Secret than the configured one, the config file is rewritten (atomically, every other field
  kept) and the agent restarts itself to pick it up.

The own Node is list+watched by name; events only wake the worker, which always acts on the
latest Node, one request at a time. A restart list that was acted on but whose annotation could
not be removed yet is remembered, so a retry only removes it and never restarts units twice.
A failed request is retried after the agent's one backoff policy (``node_agent.base.retry.API``),
on the agent's one controller loop (``node_agent.base.loop``).

A deleted Node (a ``DELETED`` event, a re-list without it, or a 404 on a request) is an error
that shows: it is logged and recorded once, and :attr:`NodeController.missing` makes ``/readyz``
fail (and ``node-agent status`` say why) until the Node exists again; a re-created Node's new uid
is taken over, so Events and the Lease's owner reference name the new object.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from node_agent.base import layout
from node_agent.base.configfile import MAX_CONFIG_BYTES
from node_agent.base.errors import ConfigError, HostError, KubeNotFound, NodeAgentError
from node_agent.base.log import get_logger
from node_agent.base.loop import DONE, RETRY, SKIPPED, Next, Wake, run_loop
from node_agent.base.retry import API, Backoff
from node_agent.config import parse_config
from node_agent.context import AgentContext
from node_agent.controllers.lifecycle import restart_own_unit
from node_agent.host.data_volume import Commands, HostCommands, check_kubelet_data_volume
from node_agent.host.documents import ItemFailure
from node_agent.host.fs import HostFS
from node_agent.host.history import history_entry
from node_agent.kube import report
from node_agent.kube.watch import list_watch

log = get_logger("node-agent.node")

JSON = dict[str, Any]
UNIT_SUFFIXES = tuple(f".{kind}" for kind in layout.UNIT_TYPES)
REASON_RESTART = report.REASON_UNIT_COMMAND["restart"]
CONFIG_FILE_MODE = 0o600


def restart_units(value: str) -> list[str]:
    """The units named by the restart annotation, in order, without duplicates."""
    units: list[str] = []
    for item in value.split(","):
        name = item.strip()
        if not name:
            continue
        if not name.endswith(UNIT_SUFFIXES):
            name += ".service"
        if name not in units:
            units.append(name)
    return units


def _meta(node: Mapping[str, Any], key: str) -> dict[str, str]:
    meta = node.get("metadata") or {}
    value = meta.get(key) or {}
    return dict(value) if isinstance(value, Mapping) else {}


@dataclass
class NodeStats:
    restarts: list[str] = field(default_factory=list)
    self_restarts: int = 0
    config_rewrites: int = 0
    handled: int = 0
    deletions: int = 0  # times the Node was seen gone


class NodeController:
    def __init__(
        self,
        ctx: AgentContext,
        *,
        backoff: Backoff | None = None,
        on_recreated: Callable[[], None] | None = None,
    ) -> None:
        self.ctx = ctx
        #: called when the Node was deleted and created again (it lost its annotations/labels)
        self.on_recreated = on_recreated
        self.stats = NodeStats()
        self._latest: JSON | None = None
        self._wake = Wake()
        self._backoff = backoff or Backoff.of(API)
        #: Why the agent's Node is missing (one line naming it), or None while it exists.
        self.missing: str | None = None
        #: Restart list already acted on, its annotation still to be removed.
        self._restarted_value: str | None = None
        #: Secret name the config was rewritten to (the agent restart is requested once).
        self._secret_name_requested: str | None = None
        #: Called with every version of the Node the watch sees (e.g. the health checks follow
        #: its Ready condition); synchronous and quick, an observer's error is only logged.
        self.observers: list[Callable[[JSON], None]] = []

    async def run(self) -> None:
        await self.ctx.node_known.wait()
        await self.report_data_volume()
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._watch(), name="node-watch")
            tasks.create_task(self._worker(), name="node-worker")

    async def report_data_volume(self, commands: Commands | None = None) -> None:
        """Once the Node exists: a Warning when the kubelet data volume that bootstrap was asked
        for is not mounted (its error was only in the init unit's journal until then)."""
        bootstrap = self.ctx.config.bootstrap
        size = bootstrap.kubelet_data_volume_size if bootstrap else None
        if not size:
            return
        fs = HostFS(self.ctx.settings.root)
        problem = await check_kubelet_data_volume(size, fs, commands or HostCommands(timeout=30))
        if problem is not None:
            log.warning("kubelet data volume not mounted", problem=problem)
            await self.ctx.event(report.REASON_KUBELET_DATA_VOLUME, problem, warning=True)

    async def _watch(self) -> None:
        assert self.ctx.node_name is not None
        events = list_watch(
            self.ctx.kube.nodes(),
            field_selector=f"metadata.name={self.ctx.node_name}",
            registry=self.ctx.watches,
        )
        async with events:
            async for event in events:
                self.ctx.health.progress("node-watch")
                self.observe(event.type, event.object)

    def observe(self, kind: str, node: JSON | None) -> None:
        """One watch event: ``SYNC`` without an object or ``DELETED`` means the Node is gone."""
        if kind == "DELETED" or (kind == "SYNC" and node is None):
            self._latest = None
            self.node_gone("deleted from the API server")
        elif kind in ("SYNC", "ADDED", "MODIFIED") and node is not None:
            self.node_present(node)
            self._latest = node
            self._wake.set()
            for observer in self.observers:
                try:
                    observer(node)
                except Exception as exc:  # another controller's bug must not end the watch
                    log.error("node observer failed", observer=repr(observer), error=repr(exc))

    def node_gone(self, how: str) -> None:
        """Record that the agent's Node does not exist; logged and recorded once per deletion."""
        if self.missing is not None:
            return
        name = self.ctx.node_name
        self.missing = f"node {name} not found ({how}); waiting for it to be registered again"
        self.stats.deletions += 1
        log.error("own node is gone", node=name, reason=how)
        self.ctx.health.error("node", self.missing)

    def node_present(self, node: JSON) -> None:
        """The Node exists: clear a recorded deletion, adopt the uid of a re-created Node."""
        uid = (node.get("metadata") or {}).get("uid")
        if uid and uid != self.ctx.node_uid:
            recreated = self.ctx.node_uid is not None
            self.ctx.node_uid = str(uid)
            if recreated:
                log.info("own node was re-created", node=self.ctx.node_name, uid=uid)
                if self.on_recreated is not None:
                    self.on_recreated()
        if self.missing is not None:
            self.missing = None
            log.info("own node exists again", node=self.ctx.node_name)

    async def _worker(self) -> None:
        await run_loop(self._step, self._wake, period=None, backoff=self._backoff)

    async def _step(self, woken: bool) -> Next:
        """Act on the latest Node; a failed request is retried on the backoff, a 404 waits for
        the watch to see the Node again."""
        node = self._latest
        if node is None:
            return SKIPPED
        try:
            await self.reconcile(node)
        except KubeNotFound:
            if self._latest is node:  # no newer event (a re-created Node) came meanwhile
                self._latest = None  # the watch tells when it is back
                self.node_gone("404 from the API server")
            return SKIPPED
        except NodeAgentError as exc:
            log.warning("node request not handled; retrying", error=str(exc))
            self.ctx.health.error("node", str(exc))
            return RETRY
        return DONE

    def _wants_action(self, node: Mapping[str, Any]) -> bool:
        if report.ANNOTATION_RESTART_SERVICES in _meta(node, "annotations"):
            return True
        wanted = _meta(node, "labels").get(report.LABEL_SECRET_NAME)
        return bool(wanted) and wanted not in (self.ctx.secret_name, self._secret_name_requested)

    async def reconcile(self, node: Mapping[str, Any]) -> None:
        """Act on ``node``. An event may be older than our own last patch (watch lag), so
        before acting the Node is read again: a removed annotation is never acted on twice."""
        if not self._wants_action(node):
            self._restarted_value = None
            return
        assert self.ctx.node_name is not None
        node = await self.ctx.kube.get_node(self.ctx.node_name)
        self.stats.handled += 1
        await self._secret_name_label(node)
        await self._restart_annotation(node)

    # -- restart-systemd-services -----------------------------------------------------------

    async def _remove_annotation(self) -> None:
        assert self.ctx.node_name is not None
        await self.ctx.kube.patch_node(
            self.ctx.node_name, report.remove_annotation_patch(report.ANNOTATION_RESTART_SERVICES)
        )

    async def _restart_annotation(self, node: Mapping[str, Any]) -> None:
        value = _meta(node, "annotations").get(report.ANNOTATION_RESTART_SERVICES)
        if value is None:
            self._restarted_value = None
            return
        if value == self._restarted_value:
            # Acted on already; only the removal failed before.
            await self._remove_annotation()
            self._restarted_value = None
            return
        units = restart_units(value)
        own = self.ctx.settings.agent_unit
        restart_self = own in units
        others = [u for u in units if u != own]
        log.info("restart requested through the node annotation", units=units)
        if restart_self:
            # First, so that the restarted agent does not find the annotation and loop.
            await self._remove_annotation()
        self._restarted_value = value
        timeout = self.ctx.settings.systemd_job_timeout
        started = report.now()
        failures: list[ItemFailure] = []
        for unit in others:
            try:
                result = await self.ctx.systemd.restart_unit(unit, job_timeout=timeout)
            except NodeAgentError as exc:
                ok, text = False, f"restart {unit}: {exc}"
            else:
                ok, text = result.ok, result.describe()
            self.stats.restarts.append(unit)
            if ok:
                log.info("unit restarted", unit=unit)
            else:
                log.warning("unit restart failed", unit=unit, detail=text)
                failures.append(ItemFailure(kind="command", item=unit, error=text))
            await self.ctx.event(REASON_RESTART, text, warning=not ok)
        await self._record_restarts(started, units, failures)
        if not restart_self:
            await self._remove_annotation()
            self._restarted_value = None
            return
        self._restarted_value = None
        await self._restart_self("requested through the node annotation")

    async def _record_restarts(
        self, started: datetime, units: list[str], failures: list[ItemFailure]
    ) -> None:
        """One apply-history entry for the restarts the annotation asked for (the agent's own
        unit included: it restarts next). Never fails the annotation's handling."""
        try:
            applied = await self.ctx.state.applied_checksum_async() or None
            failed = {f.item for f in failures}
            entry = history_entry(
                trigger="annotation",
                result="failed" if failures else "succeeded",
                started_at=started,
                checksum_from=applied,
                checksum_to=applied,
                restarted_units=[u for u in units if u not in failed],
                failures=failures,
                error=f"{len(failures)} of {len(units)} restarts failed" if failures else None,
            )
            await self.ctx.state.append_history_async(entry)
        except Exception as exc:  # the history is a record; it must not stop the restarts
            log.warning("restarts not recorded in the apply history", error=str(exc))

    async def _restart_self(self, why: str) -> None:
        own = self.ctx.settings.agent_unit
        log.info("restarting the agent's own unit", unit=own, reason=why)
        self.stats.self_restarts += 1
        await self.ctx.event(REASON_RESTART, f"restart {own}: {why}")
        # Under systemd this stops this very process; the job completes after it exited.
        result = await restart_own_unit(self.ctx, job_timeout=self.ctx.settings.systemd_job_timeout)
        if not result.ok:
            log.warning("own unit restart failed", unit=own, detail=result.describe())
            await self.ctx.event(REASON_RESTART, result.describe(), warning=True)

    # -- gardener-node-agent-secret-name ----------------------------------------------------

    async def _secret_name_label(self, node: Mapping[str, Any]) -> None:
        wanted = _meta(node, "labels").get(report.LABEL_SECRET_NAME)
        if not wanted or wanted == self.ctx.secret_name:
            return
        if wanted == self._secret_name_requested:
            return  # config rewritten, restart requested; this process is on its way out
        await self.rewrite_config_secret_name(wanted)
        self._secret_name_requested = wanted
        await self._restart_self(f"OSC secret name changed to {wanted}")

    async def rewrite_config_secret_name(self, secret_name: str) -> None:
        """Set ``controllers.operatingSystemConfig.secretName`` in the config file on disk."""
        path = self.ctx.settings.config_file
        fs = self.ctx.fs
        try:
            raw = await fs.read_async(path, limit=MAX_CONFIG_BYTES)
            st = await asyncio.to_thread(fs.lstat, path)
        except HostError as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
        config = parse_config(raw, source=path) if raw is not None else self.ctx.config
        osc = config.controllers.operating_system_config.model_copy(
            update={"secret_name": secret_name}
        )
        controllers = config.controllers.model_copy(update={"operating_system_config": osc})
        updated = config.model_copy(update={"controllers": controllers})
        mode = (st.st_mode & 0o7777) if st is not None else CONFIG_FILE_MODE
        try:
            await fs.write_atomic_async(path, updated.to_yaml().encode(), mode)
        except HostError as exc:
            raise ConfigError(f"cannot write config {path}: {exc}") from exc
        self.stats.config_rewrites += 1
        log.info(
            "config rewritten with the new OSC secret name",
            path=path,
            old=config.controllers.operating_system_config.secret_name,
            new=secret_name,
        )
