"""A list+watch that never gives up, for every controller of the agent.

Why not ``kubernetes_asyncio.watch.Watch``: on a 410 Gone it retries once with the same stale
resourceVersion and then raises, it has no read timeout, and it does not re-list. This is the
reflector loop of client-go, reduced to what a node agent needs:

1. **list** (consistent read) → one synthetic ``SYNC`` event carrying the current objects (for a
   ``metadata.name=`` selector: the object, or ``None`` if it does not exist);
2. **watch** from the list's resourceVersion with bookmarks and a server-side timeout jittered in
   240-300 s, and a socket read timeout a bit longer than that (a hung connection is noticed);
3. ``BOOKMARK`` → remember its resourceVersion, yield nothing;
4. 410 Gone — as HTTP status or as an ``ERROR`` event — → **re-list** (never re-watch a stale RV);
5. anything else (dropped connection, timeout, 5xx, 401/403 after the client's own retry) →
   re-watch from the last resourceVersion after the agent's one backoff policy
   (``node_agent.base.retry.WATCH``: jittered, exponential, cap 30 s), reset once a watch makes
   progress;
6. but once the server could not be watched for :data:`RESUME_WINDOW` (an API server outage)
   → **re-list** instead of resuming: kube-apiserver resumes a watch only from a version its
   watch cache still holds, and a restarted server holds nothing older than its start, so the
   resume would only be answered 410 and followed by the list anyway (measured by
   ``bench.fleet --scenarios outage``: after 60 s away, every resume was).

Events carry plain JSON dicts (the wire shape): cheaper than kubernetes-asyncio models and the same
as what :class:`node_agent.kube.client.KubeClient` returns. After a re-list a consumer gets a new
``SYNC`` and must treat it as the whole truth (objects missing from it were deleted meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, MutableSet
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from node_agent.base.errors import KubeError, KubeGone
from node_agent.base.retry import WATCH, Backoff
from node_agent.kube.api_errors import ObjectRef, status_from_object

log = logging.getLogger(__name__)

#: Seconds a watch may fail in a row (no event, bookmark, list or normal end) before it lists
#: instead of resuming from its resourceVersion. Below it (a dropped connection, a server
#: restarting for a few seconds, a partition) a resume is tried first, as client-go's reflector
#: does. Above it the server has almost certainly restarted or moved past the version (its watch
#: cache keeps about 75 s of history by default): a resume would cost a watch answered 410, then
#: the list and the watch; listing at once saves that request for every watch of every agent on
#: the outage's return. The backoff (cap 30 s) still spreads the returns.
RESUME_WINDOW = 60.0

JSON = dict[str, Any]
EventType = Literal["SYNC", "ADDED", "MODIFIED", "DELETED"]


#: Every live ListWatch, so metrics can read their counters without each controller exposing them.
class Watchable(Protocol):
    """A collection that can be listed and watched (``node_agent.kube.client.Resource``)."""

    def ref(self, verb: str, name: str | None = None) -> ObjectRef: ...

    async def list(
        self, *, field_selector: str | None = None, label_selector: str | None = None
    ) -> JSON: ...

    def watch(
        self,
        *,
        resource_version: str,
        field_selector: str | None = None,
        label_selector: str | None = None,
        timeout_seconds: int,
        read_timeout: float,
    ) -> AsyncGenerator[JSON, None]: ...


@dataclass(frozen=True)
class WatchEvent:
    """``SYNC`` (after each list): ``objects`` is the full listed state, ``object`` its first item
    or ``None``. ``ADDED``/``MODIFIED``/``DELETED``: ``object`` is the object (last state)."""

    type: EventType
    object: JSON | None
    objects: tuple[JSON, ...]
    resource_version: str


@dataclass
class WatchStats:
    """Counters for metrics: lists done, re-lists after 410, reconnects after errors."""

    lists: int = 0
    relists: int = 0
    reconnects: int = 0
    #: lists instead of a resume after failing for longer than the resume window
    outage_lists: int = 0
    watches: int = 0
    events: int = 0
    bookmarks: int = 0
    last_error: str | None = None


def _resource_version(obj: object) -> str | None:
    if isinstance(obj, dict):
        meta = obj.get("metadata")
        if isinstance(meta, dict) and meta.get("resourceVersion"):
            return str(meta["resourceVersion"])
    return None


class ListWatch:
    """``async with list_watch(...) as events: async for event in events: ...``

    Iterate once. Cancelling the consuming task closes the watch connection; a consumer that
    ``break``s out of the loop must leave the ``async with`` (or call :meth:`aclose`), because
    Python does not close an abandoned async generator until it is garbage-collected.

    ``resource_version`` starts the watch from a known RV without an initial list (a 410 then
    leads to a list + ``SYNC``). ``stats`` and ``resource_version`` may be read at any time.
    """

    def __init__(
        self,
        resource: Watchable,
        *,
        field_selector: str | None = None,
        label_selector: str | None = None,
        resource_version: str | None = None,
        timeout_range: tuple[int, int] = (240, 300),
        read_grace: float = 30.0,
        backoff: Backoff | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
        registry: MutableSet[ListWatch] | None = None,
        resume_window: float = RESUME_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``registry``: where the agent keeps its live watches for the read side (a WeakSet
        on the agent's context: a watch that is gone drops out of it). ``resume_window``: see
        :data:`RESUME_WINDOW`; ``clock`` measures it (tests pass one that their sleeps move)."""
        self._resource = resource
        self._field_selector = field_selector
        self._label_selector = label_selector
        self.resource_version = resource_version
        self._timeout_range = timeout_range
        self._read_grace = read_grace
        self._backoff = backoff or Backoff.of(WATCH)
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._resume_window = resume_window
        self._clock = clock
        self._failing_since: float | None = None  # the first failure of the present run
        self.stats = WatchStats()
        self._events: AsyncGenerator[WatchEvent, None] | None = None
        name = None
        if field_selector and field_selector.startswith("metadata.name="):
            name = field_selector.removeprefix("metadata.name=")
        self._ref = resource.ref("watch", name)
        if registry is not None:
            registry.add(self)

    @property
    def kind(self) -> str:
        """The watched kind (``Secret``, ``Node``), e.g. as a metrics label."""
        return self._ref.kind

    def __aiter__(self) -> AsyncIterator[WatchEvent]:
        if self._events is None:
            self._events = self._run()
        return self._events

    async def aclose(self) -> None:
        """Stop: closes the open watch connection (also done by ``async with``)."""
        if self._events is not None:
            await self._events.aclose()

    async def __aenter__(self) -> ListWatch:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _pause(self, exc: KubeError, what: str) -> None:
        if self._failing_since is None:
            self._failing_since = self._clock()
        delay = self._backoff.next()
        self.stats.last_error = str(exc)
        log.warning("%s failed (%s); retrying in %.1fs", what, exc, delay)
        await self._sleep(delay)

    def _contact(self) -> None:
        """The server answered as a watch expects (a list, an event, a normal end)."""
        self._failing_since = None

    def _away_too_long(self) -> bool:
        """Failing for longer than the resume window: list rather than resume."""
        since = self._failing_since
        return since is not None and self._clock() - since >= self._resume_window

    async def _run(self) -> AsyncGenerator[WatchEvent, None]:
        need_list = self.resource_version is None
        consecutive_gone = 0
        while True:
            if need_list:
                try:
                    listed = await self._resource.list(
                        field_selector=self._field_selector, label_selector=self._label_selector
                    )
                except KubeError as exc:
                    await self._pause(exc, f"list for {self._ref}")
                    continue
                rv = str((listed.get("metadata") or {}).get("resourceVersion") or "")
                if not rv:
                    log.warning("list for %s returned no resourceVersion; re-listing", self._ref)
                    await self._sleep(self._backoff.next())
                    continue
                self.stats.lists += 1
                self._contact()
                need_list = False
                self.resource_version = rv
                items = tuple(i for i in listed.get("items") or () if isinstance(i, dict))
                yield WatchEvent("SYNC", items[0] if items else None, items, rv)

            assert self.resource_version is not None
            timeout_seconds = self._rng.randint(*self._timeout_range)
            started = time.monotonic()
            progress = False
            self.stats.watches += 1
            try:
                stream = self._resource.watch(
                    resource_version=self.resource_version,
                    field_selector=self._field_selector,
                    label_selector=self._label_selector,
                    timeout_seconds=timeout_seconds,
                    read_timeout=timeout_seconds + self._read_grace,
                )
                async with contextlib.aclosing(stream):
                    async for raw in stream:
                        kind, obj = raw.get("type"), raw.get("object")
                        if kind == "ERROR":
                            raise status_from_object(obj, self._ref)
                        event_rv = _resource_version(obj)
                        if kind == "BOOKMARK":
                            if event_rv:
                                self.resource_version = event_rv
                            self.stats.bookmarks += 1
                        elif kind in ("ADDED", "MODIFIED", "DELETED") and isinstance(obj, dict):
                            if event_rv:
                                self.resource_version = event_rv
                            self.stats.events += 1
                            yield WatchEvent(kind, obj, (obj,), self.resource_version)
                        else:
                            log.warning("ignoring watch event of type %r on %s", kind, self._ref)
                            continue
                        if not progress:
                            progress = True
                            consecutive_gone = 0
                            self._backoff.reset()
                            self._contact()
                # The server ended the watch (timeoutSeconds): re-watch at once, unless it ended
                # suspiciously fast without any progress (then do not spin).
                self._contact()
                if not progress and time.monotonic() - started < 1.0:
                    await self._sleep(self._backoff.next())
            except KubeGone as exc:
                self.stats.relists += 1
                consecutive_gone += 1
                need_list = True
                log.info("%s: resourceVersion expired (%s); re-listing", self._ref, exc)
                if consecutive_gone > 1:
                    await self._pause(exc, f"watch for {self._ref}")
            except KubeError as exc:
                self.stats.reconnects += 1
                await self._pause(exc, f"watch for {self._ref}")
                if self._away_too_long():
                    self.stats.outage_lists += 1
                    need_list = True
                    log.info(
                        "%s: no watch for %.0fs; listing instead of resuming",
                        self._ref,
                        self._clock() - (self._failing_since or 0.0),
                    )


def list_watch(
    resource: Watchable,
    *,
    field_selector: str | None = None,
    label_selector: str | None = None,
    **options: Any,
) -> ListWatch:
    """Shorthand for :class:`ListWatch` (same keyword options)."""
    return ListWatch(
        resource, field_selector=field_selector, label_selector=label_selector, **options
    )
