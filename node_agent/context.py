"""What every controller shares: settings, the three seams, the node's identity, and reporting.

One object passed to each controller keeps constructors short and makes the wiring in
``agent.py`` the only place that knows how the parts are built.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import deque
from collections.abc import MutableSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from node_agent.base.errors import ConfigError, KubeError, KubeNotFound, NodeAgentError
from node_agent.base.log import get_logger
from node_agent.base.strictness import STRICTNESS_FILE_NAME, UPSTREAM, Strictness, parse_strictness
from node_agent.config import AgentSettings, NodeAgentConfiguration
from node_agent.host.fs import HostFS
from node_agent.host.state import StateStore
from node_agent.kube import report
from node_agent.systemd import SystemdSeam

if TYPE_CHECKING:
    from node_agent.kube.seam import KubeSeam

log = get_logger("node-agent")


@dataclass
class Health:
    """Progress marks the health endpoints, the watchdog and ``node-agent status`` read."""

    started: float = field(default_factory=time.time)
    last_progress: dict[str, float] = field(default_factory=dict)
    errors: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=20))

    def progress(self, loop_name: str) -> None:
        self.last_progress[loop_name] = time.monotonic()

    def error(self, source: str, message: str) -> None:
        self.errors.append({"at": report.rfc3339(report.now()), "source": source, "error": message})


def _set(event: asyncio.Event) -> asyncio.Event:
    event.set()
    return event


class StrictnessFile:
    """The operator's ``node-agent-strict.yaml`` beside the agent's config file, read when asked
    (one small read; an OSC may add, change or remove it at any time). Missing: upstream's
    contract. Unusable: upstream's contract too, with one error line naming the file and the
    field (again only when the error changes), so a bad value never stops the agent."""

    def __init__(self, fs: HostFS, path: str) -> None:
        self.fs = fs
        self.path = path
        self._raw: bytes | None = None
        self._value: Strictness = UPSTREAM
        self._error: str | None = None

    @classmethod
    def beside(cls, fs: HostFS, config_file: str) -> StrictnessFile:
        directory = config_file.rsplit("/", 1)[0] or "/"
        return cls(fs, f"{directory.rstrip('/')}/{STRICTNESS_FILE_NAME}")

    @property
    def error(self) -> str | None:
        return self._error

    def current(self) -> Strictness:
        try:
            raw = self.fs.read(self.path, limit=64 * 1024)
        except (NodeAgentError, OSError) as exc:
            self._failed(f"{self.path}: {exc}")
            return UPSTREAM
        if raw is None:
            self._raw, self._value, self._error = None, UPSTREAM, None
            return UPSTREAM
        if raw == self._raw:
            return self._value
        self._raw = raw
        try:
            self._value = parse_strictness(raw, source=self.path)
        except ConfigError as exc:
            self._value = UPSTREAM
            self._failed(str(exc))
            return UPSTREAM
        self._error = None
        log.info("strictness read", path=self.path, strict=list(self._value.names()))
        return self._value

    def _failed(self, error: str) -> None:
        if error != self._error:
            self._error = error
            log.error("strictness file not usable; upstream's contract applies", error=error)


@dataclass
class AgentContext:
    settings: AgentSettings
    config: NodeAgentConfiguration
    fs: HostFS
    state: StateStore
    systemd: SystemdSeam
    kube: KubeSeam
    host_name: str
    node_name: str | None = None
    node_uid: str | None = None
    health: Health = field(default_factory=Health)
    node_known: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set once the OSC controller's first reconcile ended, however it ended (applied, failed,
    #: nothing to do): the daemon starts the controllers that can wait after it (``agent.py``).
    first_reconcile: asyncio.Event = field(default_factory=asyncio.Event)
    #: The agent's live list+watches, for the read side to count (weak: a watch that is gone
    #: drops out); the controllers hand it to ``list_watch(registry=...)``.
    watches: MutableSet[Any] = field(default_factory=weakref.WeakSet, repr=False)
    _strictness: StrictnessFile | None = field(default=None, repr=False)
    #: Set once the token controller's first round of syncs is done (set from the start when
    #: there is none): the OSC controller applies after it, bounded (``TOKENS_WAIT``).
    tokens_synced: asyncio.Event = field(default_factory=lambda: _set(asyncio.Event()))

    def strictness(self) -> Strictness:
        """Which stricter verdicts the operator asked for (``node-agent-strict.yaml`` beside the
        config file); none by default: upstream's contract."""
        if self._strictness is None:
            self._strictness = StrictnessFile.beside(self.fs, self.settings.config_file)
        return self._strictness.current()

    @property
    def secret_name(self) -> str:
        return self.config.controllers.operating_system_config.secret_name

    async def look_up_node(self) -> bool:
        """One lookup of this host's Node (named like the lowercased host name, the kubelet's
        default); True once it is known. A missing Node is no error (the kubelet registers it
        later); other API errors are logged and count as not found."""
        if self.node_known.is_set():
            return True
        name = self.host_name.lower()
        try:
            node = await self.kube.get_node(name)
        except KubeNotFound:
            log.info("node not registered yet", node=name)
            return False
        except KubeError as exc:
            log.warning("cannot read own node", node=name, error=str(exc))
            return False
        meta = node.get("metadata") or {}
        self.node_name = str(meta.get("name"))
        self.node_uid = meta.get("uid")
        self.node_known.set()
        log.info("found own node", node=self.node_name)
        return True

    async def event(self, reason: str, message: str, *, warning: bool = False) -> None:
        """Record an Event on the Node; never fails the caller (it is only a report)."""
        if self.node_name is None:
            return
        body = report.node_event(
            node_name=self.node_name,
            node_uid=self.node_uid,
            reason=reason,
            message=message,
            event_type="Warning" if warning else "Normal",
            host=self.host_name,
        )
        try:
            await self.kube.create_event(body)
        except KubeError as exc:
            log.warning("event not recorded", reason=reason, error=str(exc))
