"""Token sync: ``controllers.token.syncConfigs[]`` Secrets' ``data.token`` → files on the host.

This is how the agent's own credentials (and e.g. the kubelet's bootstrap material) are rotated:
Gardener writes a new token into a Secret, the agent writes it to the file its kubeconfig names,
and every client re-reads the file on its next request. Each Secret is list+watched by name
(the RBAC allows get/list/watch on exactly those names), re-read every ``syncPeriod`` (a missed
event cannot leave a stale token for longer than that), and its file is put back from the last
known token, without an API call, as soon as something deletes it (an OSC apply removing an
orphaned path, an operator): the kernel reports the name leaving its directory
(:mod:`node_agent.host.inotify`), which wakes the file's check; a check every minute stays
behind the watch. Where no watch can be armed the file is checked every few seconds, as before:
a stat walk on the loop (a thread hop for it would cost more than it does).

Writes go through ``HostFS.write_atomic`` (temp file + rename, mode exactly 0640, parents 0755),
which writes nothing when the bytes and mode already match. A failed write (a full or read-only
disk) is retried from the last known token on the agent's one backoff policy
(``node_agent.base.retry.API``), not only at the next resync an hour later. Both periodic jobs
run on the agent's one controller loop (``node_agent.base.loop``). A Secret that is missing
or has no ``token`` key is logged; the file is left alone (a stale token beats none).

An entry whose ``path`` can never be written (relative, with ``..`` or a NUL) or names one of the
agent's own files (its kubeconfig, bootstrap token, config, state, CA, unit: see
:func:`refusal`) is refused when the controller starts: logged and reported once with the
entry's index, Secret and path, never synced, never retried, while the other entries and the
agent run on. Upstream's decode accepts such a config, so the agent starts with it too.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass

from node_agent.base import layout
from node_agent.base.configfile import config_version_key
from node_agent.base.errors import HostError, KubeError, KubeNotFound, UnsafePathError
from node_agent.base.log import get_logger
from node_agent.base.loop import DONE, SKIPPED, Next, Wake, run_loop
from node_agent.base.retry import API, Backoff
from node_agent.config import TokenSyncConfig
from node_agent.context import AgentContext
from node_agent.host.fs import WriteResult, host_parts
from node_agent.host.inotify import RemovalWatch
from node_agent.kube.report import NAMESPACE
from node_agent.kube.watch import list_watch

log = get_logger("node-agent.token")

DATA_KEY = "token"
FILE_MODE = 0o640
DIR_MODE = 0o755
#: how often a token file is checked when no inotify watch covers it
EXISTENCE_CHECK_PERIOD = 2.0
#: how often it is checked anyway when a watch does (a watch is a hint, not a proof)
WATCHED_CHECK_PERIOD = 60.0


def token_bytes(secret: dict[str, object] | None) -> bytes | None:
    """The decoded ``data.token`` of a Secret, or None if it is absent or not base64."""
    if not secret:
        return None
    data = secret.get("data")
    if not isinstance(data, dict) or not isinstance(data.get(DATA_KEY), str):
        return None
    try:
        return base64.b64decode(data[DATA_KEY], validate=True)
    except (binascii.Error, ValueError):
        return None


def refusal(ctx: AgentContext, path: str) -> str | None:
    """Why no token may ever be written at ``path`` (None: it may).

    Never a path the host layer cannot take (relative, ``..``, NUL, the root), and never one of
    the agent's own files or a directory holding them: a token over its kubeconfig, bootstrap
    token, config, state, cluster CA, machine name or unit would lock the agent out or lose what
    it knows. The one exception is ``credentials/token``: a token file, which a standalone
    install's kubeconfig names and this sync is meant to rotate."""
    try:
        parts = host_parts(path)
    except UnsafePathError as exc:
        return exc.args[0] if exc.args else str(exc)
    if not parts:
        return "is the root directory"
    normal = "/" + "/".join(parts)
    if normal == layout.TOKEN_FILE:
        return None
    if normal == layout.CREDENTIALS_DIR or normal.startswith(layout.CREDENTIALS_DIR + "/"):
        return "is in the agent's credentials directory"
    if normal.startswith(layout.drop_in_dir(ctx.settings.agent_unit) + "/"):
        return "is a drop-in of the agent's own unit"
    own = _agent_files(ctx)
    if normal in own:
        return "is one of the agent's own files (credentials, config, state, CA or unit)"
    directory, name = normal.rsplit("/", 1)
    if directory == layout.BASE_DIR and (name == "config.yaml" or config_version_key(name)):
        return "is a config file of the agent"
    if any(mine.startswith(normal + "/") for mine in own):
        return "is a directory holding the agent's own files"
    return None


def _agent_files(ctx: AgentContext) -> set[str]:
    """The agent's own files, by normalized host path."""
    settings, config = ctx.settings, ctx.config
    named = {
        *layout.RESERVED_FILES,
        *layout.RESERVED_DIRS,
        layout.KUBELET_BOOTSTRAP_KUBECONFIG,
        layout.unit_path(settings.agent_unit),
        layout.drop_in_dir(settings.agent_unit),
        f"{layout.BASE_DIR}/cluster-ca.crt",
        f"{layout.BASE_DIR}/machine-name",
        settings.config_file,
        config.client_connection.kubeconfig,
        config.api_server.ca_file,
    }
    own: set[str] = set()
    for path in named:
        try:
            own.add("/" + "/".join(host_parts(path)))
        except UnsafePathError:
            continue  # a configured path the agent cannot use itself: nothing to protect there
    own.discard(layout.TOKEN_FILE)
    return own


@dataclass
class SyncStats:
    writes: int = 0
    rewrites_after_delete: int = 0
    syncs: int = 0
    last_error: str | None = None


class TokenSync:
    """One ``syncConfigs`` entry: a Secret kept in sync with one file."""

    def __init__(
        self,
        ctx: AgentContext,
        config: TokenSyncConfig,
        *,
        sync_period: float,
        check_period: float = EXISTENCE_CHECK_PERIOD,
        backoff: Backoff | None = None,
        removals: RemovalWatch | None = None,
    ) -> None:
        self.ctx = ctx
        self.secret_name = config.secret_name
        self.path = config.path
        #: why this entry is never synced (see :func:`refusal`); None for a usable path
        self.refused = refusal(ctx, config.path)
        self.sync_period = sync_period
        self.check_period = check_period
        self.token: bytes | None = None
        self.stats = SyncStats()
        self._lock = asyncio.Lock()
        self._backoff = backoff or Backoff.of(API)
        self._retry_at: float | None = None  # loop time of the next retry of a failed write
        self._removals = removals  # the kernel's word that the file left its directory
        self._checked = Wake()  # set by that word: look at the file now
        self._unwatched: str | None = None  # why the file is polled (logged once per reason)

    async def run(self) -> None:
        if self.refused is not None:
            return  # reported by the controller; nothing here ever writes it
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._watch(), name=f"token-watch-{self.secret_name}")
            tasks.create_task(self._resync_loop(), name=f"token-resync-{self.secret_name}")
            tasks.create_task(self._existence_loop(), name=f"token-check-{self.secret_name}")

    async def _watch(self) -> None:
        events = list_watch(
            self.ctx.kube.secrets(NAMESPACE),
            field_selector=f"metadata.name={self.secret_name}",
            registry=self.ctx.watches,
        )
        async with events:
            async for event in events:
                self.ctx.health.progress("token-watch")
                if event.type == "DELETED" or event.object is None:
                    log.warning("token secret not found", secret=self.secret_name, path=self.path)
                    continue
                await self.apply(event.object, why=event.type.lower())

    async def _resync_loop(self) -> None:
        await run_loop(self._resync_step, Wake(), period=self.sync_period)

    async def _resync_step(self, woken: bool) -> Next:
        """Every ``syncPeriod``: read the Secret again (a missed watch event) and write it."""
        return DONE if await self.sync() else SKIPPED

    async def sync(self) -> bool:
        """Read the Secret now and write the file; False if the Secret could not be read."""
        try:
            secret = await self.ctx.kube.get_secret(NAMESPACE, self.secret_name)
        except KubeNotFound:
            log.warning("token secret not found", secret=self.secret_name, path=self.path)
            return False
        except KubeError as exc:
            self.stats.last_error = str(exc)
            log.warning("token secret not read", secret=self.secret_name, error=str(exc))
            return False
        self.stats.syncs += 1
        return await self.apply(secret, why="resync")

    async def _existence_loop(self) -> None:
        await run_loop(self._existence_step, self._checked, period=self.check_period)

    async def _existence_step(self, woken: bool) -> Next:
        """When the file left its directory (the watch's wake-up), else every ``check_period``
        (every :data:`WATCHED_CHECK_PERIOD` while a watch covers it): a failed write whose
        backoff ran out is written again, else a deleted file is rewritten from the last
        token. The write's backoff is kept by :meth:`_write` (a write fails the same way from
        the watch, a resync or here), so this step only looks whether it is due."""
        if self.token is None:
            return SKIPPED
        if self._retry_at is not None:
            if asyncio.get_running_loop().time() < self._retry_at:
                return SKIPPED
            log.info("retrying the token file write", path=self.path)
            return DONE if await self._write(self.token, why="retry") else SKIPPED
        watched = self._watch_removal()  # armed before the look: a deletion after it is reported
        try:
            missing = not self.ctx.fs.exists(self.path)
        except HostError as exc:
            log.warning("token file not checked", path=self.path, error=str(exc))
            return SKIPPED
        if missing:
            log.info("token file deleted; rewriting it", path=self.path)
            await self._write(self.token, why="deleted")
            self.stats.rewrites_after_delete += 1  # counted once the write is done
            watched = self._watch_removal()  # its directory may be a new one
        return Next.after(max(WATCHED_CHECK_PERIOD, self.check_period)) if watched else DONE

    def _watch_removal(self) -> bool:
        """Whether the kernel will report the file leaving its directory; a reason it will
        not is logged once (the file is then polled every ``check_period``)."""
        if self._removals is None:
            return False
        why = self._removals.arm(self.ctx.fs, self.path, self._checked.set)
        if why is not None and why != self._unwatched:
            log.info("token file checked by polling", path=self.path, reason=why)
        self._unwatched = why
        return why is None

    async def apply(self, secret: dict[str, object], *, why: str) -> bool:
        token = token_bytes(secret)
        if token is None:
            log.warning("token secret has no valid data key", secret=self.secret_name, key=DATA_KEY)
            return False
        self.token = token
        written = await self._write(token, why=why)
        if written and self._removals is not None and not self._removals.watching(self.path):
            self._checked.set()  # the file is there: its check arms the watch now
        return written

    async def _write(self, token: bytes, *, why: str) -> bool:
        if self.refused is not None:
            return False  # not even on a direct call: the path is the agent's own or unusable
        async with self._lock:
            try:
                result = await self.ctx.fs.write_atomic_async(
                    self.path, token, FILE_MODE, dir_mode=DIR_MODE
                )
            except HostError as exc:
                self.stats.last_error = str(exc)
                delay = self._backoff.next()
                self._retry_at = asyncio.get_running_loop().time() + delay
                log.error(
                    "token file not written",
                    path=self.path,
                    error=str(exc),
                    retry_in_seconds=round(delay, 1),
                )
                self.ctx.health.error("token", str(exc))
                return False
        self._backoff.reset()
        self._retry_at = None
        if result != WriteResult.UNCHANGED:
            self.stats.writes += 1
            log.info(
                "token file written",
                path=self.path,
                secret=self.secret_name,
                trigger=why,
                result=result.name.lower(),
            )
        return True


class TokenController:
    """All ``syncConfigs`` entries, each in its own task."""

    def __init__(
        self,
        ctx: AgentContext,
        *,
        check_period: float = EXISTENCE_CHECK_PERIOD,
    ) -> None:
        token_config = ctx.config.controllers.token
        period = max(token_config.sync_period.total_seconds(), 1.0)
        # one inotify instance for all the files (the per-user instance limit is small)
        self.removals = RemovalWatch()
        self.ctx = ctx
        self.syncs: list[TokenSync] = []
        #: the entries refused for their path: (where in the config, the entry, why)
        self.refused: list[tuple[str, TokenSyncConfig, str]] = []
        for index, entry in enumerate(token_config.sync_configs):
            sync = TokenSync(
                ctx, entry, sync_period=period, check_period=check_period, removals=self.removals
            )
            if sync.refused is None:
                self.syncs.append(sync)
            else:
                self.refused.append(
                    (f"controllers.token.syncConfigs[{index}]", entry, sync.refused)
                )
        if self.syncs:
            ctx.tokens_synced.clear()  # until the first round (``run``)

    async def run(self) -> None:
        for where, entry, why in self.refused:
            log.error(
                "token sync entry refused",
                entry=where,
                secret=entry.secret_name,
                path=entry.path,
                reason=why,
            )
            self.ctx.health.error(
                "token",
                f"{where} (Secret {entry.secret_name}, path {entry.path!r}) {why}: not synced",
            )
        if not self.syncs:
            self.ctx.tokens_synced.set()
            return
        try:
            # One round first, all at once (a GET and a write each), so that the OSC's first
            # apply, which waits for it, starts units whose tokens are on disk; upstream's token
            # reconciles finish long before its first apply reaches the unit commands.
            await asyncio.gather(*(sync.sync() for sync in self.syncs), return_exceptions=True)
            self.ctx.tokens_synced.set()
            log.info("tokens synced", count=len(self.syncs))
            async with asyncio.TaskGroup() as tasks:
                for sync in self.syncs:
                    tasks.create_task(sync.run(), name=f"token-{sync.secret_name}")
        finally:
            self.removals.close()
