"""The list+watch state machine, driven by a scripted fake collection (pure logic, no server).

The real-server behaviour (410 as an ERROR event after compaction, restart, selectors) is covered
by tests/integration/test_kube_watch.py; here every branch is forced deterministically.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Any

import pytest

from node_agent.base.errors import (
    KubeForbidden,
    KubeGone,
    KubeServerError,
    KubeTimeout,
    KubeTransportError,
)
from node_agent.base.retry import Backoff
from node_agent.kube.api_errors import ObjectRef
from node_agent.kube.watch import ListWatch, Watchable, WatchEvent, list_watch

JSON = dict[str, Any]
Script = list[JSON | Exception] | Exception


def obj(rv: str, name: str = "osc", value: str = "") -> JSON:
    return {"metadata": {"name": name, "resourceVersion": rv}, "data": {"v": value or rv}}


def listed(rv: str, *items: JSON) -> JSON:
    return {"metadata": {"resourceVersion": rv}, "items": list(items)}


def event(kind: str, o: JSON) -> JSON:
    return {"type": kind, "object": o}


def gone(status: int = 410) -> KubeGone:
    return KubeGone("watch Secret kube-system/osc: 410 Expired", status=status, reason="Expired")


class FakeCollection:
    """Scripted list answers and watch streams; an exhausted script blocks like an idle watch."""

    def __init__(self, lists: list[JSON | Exception], watches: list[Script]) -> None:
        self.lists = deque(lists)
        self.watches = deque(watches)
        self.list_calls = 0
        self.watch_calls: list[dict[str, Any]] = []
        self.open_streams = 0

    def ref(self, verb: str, name: str | None = None) -> ObjectRef:
        return ObjectRef(verb, "Secret", "kube-system", name)

    async def list(
        self, *, field_selector: str | None = None, label_selector: str | None = None
    ) -> JSON:
        self.list_calls += 1
        if not self.lists:
            await asyncio.Event().wait()
        answer = self.lists.popleft()
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def watch(self, **options: Any) -> AsyncGenerator[JSON, None]:
        self.watch_calls.append(options)
        self.open_streams += 1
        try:
            script = self.watches.popleft() if self.watches else None
            if script is None:
                await asyncio.Event().wait()
                return
            if isinstance(script, Exception):
                raise script
            for item in script:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.open_streams -= 1


class Run:
    """Consume a ListWatch in a task; record events and the backoff sleeps (no real sleeping)."""

    def __init__(self, fake: FakeCollection, **options: Any) -> None:
        self.sleeps: list[float] = []
        self.events: list[WatchEvent] = []
        self.watch = ListWatch(
            fake,
            field_selector="metadata.name=osc",
            sleep=self._sleep,
            backoff=Backoff(rng=random.Random(7)),
            **options,
        )

    async def _sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        await asyncio.sleep(0)

    async def until(self, condition: Callable[[], bool]) -> None:
        async def consume() -> None:
            async for e in self.watch:
                self.events.append(e)

        task = asyncio.create_task(consume())
        try:
            async with asyncio.timeout(2):
                while not condition():  # noqa: ASYNC110 - polling the fake's counters
                    await asyncio.sleep(0.001)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def kinds(run: Run) -> list[tuple[str, str | None]]:
    return [(e.type, e.object["data"]["v"] if e.object else None) for e in run.events]


async def test_sync_then_events_and_bookmarks_move_the_rv_silently() -> None:
    fake = FakeCollection(
        [listed("10", obj("10"))],
        [
            [
                event("ADDED", obj("11")),
                event("BOOKMARK", {"metadata": {"resourceVersion": "20"}}),
                event("MODIFIED", obj("21")),
                event("BOOKMARK", {"metadata": {"resourceVersion": "30"}}),
            ]
        ],
    )
    run = Run(fake)
    await run.until(lambda: len(fake.watch_calls) == 2)
    assert kinds(run) == [("SYNC", "10"), ("ADDED", "11"), ("MODIFIED", "21")]
    assert run.events[0].objects == (obj("10"),)
    assert [c["resource_version"] for c in fake.watch_calls] == ["10", "30"]
    assert run.watch.stats.bookmarks == 2
    assert run.watch.resource_version == "30"
    assert run.sleeps == []  # a watch that made progress and ended is re-opened at once


async def test_absent_object_gives_sync_with_none() -> None:
    fake = FakeCollection([listed("5")], [])
    run = Run(fake)
    await run.until(lambda: len(run.events) == 1)
    assert run.events[0] == WatchEvent("SYNC", None, (), "5")


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(
            [event("ERROR", {"kind": "Status", "code": 410, "reason": "Expired"})], id="event"
        ),
        pytest.param(gone(), id="http-status"),
        pytest.param([event("ADDED", obj("11")), gone()], id="mid-stream"),
    ],
)
async def test_gone_relists_and_never_rewatches_the_stale_rv(script: Script) -> None:
    fake = FakeCollection([listed("10"), listed("50", obj("49"))], [script])
    run = Run(fake)
    await run.until(lambda: len(fake.watch_calls) == 2)
    assert [e.type for e in run.events if e.type == "SYNC"] == ["SYNC", "SYNC"]
    assert run.events[-1].object == obj("49")
    assert [c["resource_version"] for c in fake.watch_calls] == ["10", "50"]
    assert (run.watch.stats.relists, run.watch.stats.lists, run.watch.stats.reconnects) == (1, 2, 0)
    assert run.sleeps == []


async def test_repeated_gone_without_progress_backs_off() -> None:
    fake = FakeCollection([listed("10"), listed("11"), listed("12")], [gone(), gone()])
    run = Run(fake)
    await run.until(lambda: len(fake.watch_calls) == 3)
    assert run.watch.stats.relists == 2
    assert len(run.sleeps) == 1


async def test_transport_errors_rewatch_from_last_rv_with_growing_backoff() -> None:
    fake = FakeCollection(
        [listed("10")],
        [
            [event("ADDED", obj("11")), KubeTransportError("connection reset")],
            KubeTimeout("no answer"),
            KubeServerError("500", status=500),
            [event("ERROR", {"kind": "Status", "code": 500, "reason": "InternalError"})],
            [event("MODIFIED", obj("12"))],
            [KubeTransportError("dropped")],
        ],
    )
    run = Run(fake)
    await run.until(lambda: len(fake.watch_calls) == 7)
    assert kinds(run) == [("SYNC", None), ("ADDED", "11"), ("MODIFIED", "12")]
    assert [c["resource_version"] for c in fake.watch_calls] == [
        "10", "11", "11", "11", "11", "12", "12",
    ]  # fmt: skip
    assert (run.watch.stats.lists, run.watch.stats.relists, run.watch.stats.reconnects) == (1, 0, 5)
    # Four failures in a row: delays within [d/2, d] for d = 0.8, 1.6, 3.2, 6.4 ...
    for delay, ceiling in zip(run.sleeps[:4], (0.8, 1.6, 3.2, 6.4), strict=True):
        assert ceiling / 2 <= delay <= ceiling
    # ... then the MODIFIED event reset the backoff: the next failure waits at most 0.8 s.
    assert 0.4 <= run.sleeps[4] <= 0.8
    assert run.watch.stats.last_error == "dropped"


class Clock:
    """Time that only the watch's backoff sleeps move (a fake outage of any length)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_an_outage_longer_than_the_resume_window_lists_instead_of_resuming() -> None:
    """After 60 s of failed reconnects (an API server outage) the watch lists at once: a
    restarted server's watch cache holds nothing older than its start, so a resume from the old
    version would only be answered 410 before the same list."""
    script: list[Script] = [[event("ADDED", obj("11")), KubeTransportError("dropped")]]
    # with the seeded backoff, 8 pauses add up past 60 s (0.5, 0.9, ..., 22.6: 73 s)
    script += [KubeTransportError("connection refused")] * 7
    fake = FakeCollection([listed("10"), listed("20")], script)
    clock = Clock()
    run = Run(fake, clock=clock)
    recorded = run._sleep

    async def sleep(delay: float) -> None:
        clock.now += delay
        await recorded(delay)

    run.watch._sleep = sleep
    await run.until(lambda: any(c["resource_version"] == "20" for c in fake.watch_calls))
    versions = [c["resource_version"] for c in fake.watch_calls]
    # every re-watch began within 60 s of the first failure, then the list; the watch after it
    # starts from the list's version
    assert versions == ["10"] + ["11"] * 7 + ["20"]
    assert fake.list_calls == 2
    assert sum(run.sleeps[:7]) < 60 <= sum(run.sleeps[:8]), run.sleeps
    assert run.watch.stats.outage_lists == 1
    assert run.watch.stats.relists == 0  # no 410 was needed to get there
    assert [e.type for e in run.events] == ["SYNC", "ADDED", "SYNC"]


async def test_the_resume_window_counts_from_the_first_failure_after_contact() -> None:
    """Contact (an event) between failures starts the window again: failures spread over a long
    time, each run of them short, keep resuming."""
    script: list[Script] = []
    for rv in range(11, 16):  # five runs: an event, then 2 failures (50 s, inside the window)
        script.append([event("MODIFIED", obj(str(rv))), KubeTransportError("dropped")])
        script.append(KubeTransportError("refused"))
    fake = FakeCollection([listed("10")], script)
    clock = Clock()
    run = Run(fake, clock=clock)
    recorded = run._sleep

    async def sleep(delay: float) -> None:
        clock.now += 25.0  # every pause counted long: 2 in a row 50 s, 3 would be 75 s
        await recorded(delay)

    run.watch._sleep = sleep
    await run.until(lambda: len(fake.watch_calls) == 1 + len(script))
    assert fake.list_calls == 1
    assert run.watch.stats.outage_lists == 0


async def test_list_failures_never_give_up() -> None:
    failures: list[JSON | Exception] = [
        KubeTransportError("refused"),
        KubeForbidden("403", status=403),
        KubeServerError("503", status=503),
        KubeTimeout("slow"),
    ]
    fake = FakeCollection([*failures, listed("7", obj("7"))], [])
    run = Run(fake)
    await run.until(lambda: len(run.events) == 1)
    assert fake.list_calls == 5
    assert len(run.sleeps) == 4
    assert run.sleeps == sorted(run.sleeps) or max(run.sleeps) <= 6.4
    assert run.events[0].object == obj("7")


async def test_watch_timeouts_are_jittered_and_read_timeout_is_longer() -> None:
    fake = FakeCollection([listed("10")], [[] for _ in range(30)])
    run = Run(fake)
    await run.until(lambda: len(fake.watch_calls) == 31)
    seconds = [c["timeout_seconds"] for c in fake.watch_calls]
    assert all(240 <= s <= 300 for s in seconds)
    assert len(set(seconds)) > 5
    assert all(c["read_timeout"] == c["timeout_seconds"] + 30 for c in fake.watch_calls)
    assert all(c["field_selector"] == "metadata.name=osc" for c in fake.watch_calls)


async def test_start_from_a_resource_version_skips_the_first_list() -> None:
    fake = FakeCollection([], [[event("MODIFIED", obj("101"))]])
    run = Run(fake, resource_version="100")
    await run.until(lambda: len(run.events) == 1)
    assert kinds(run) == [("MODIFIED", "101")]
    assert fake.list_calls == 0
    assert fake.watch_calls[0]["resource_version"] == "100"


async def test_leaving_the_context_closes_the_stream() -> None:
    script: Script = [event("ADDED", obj("11")), *[event("MODIFIED", obj("12"))] * 3]
    fake = FakeCollection([listed("10")], [script])
    async with list_watch(fake, field_selector="metadata.name=osc") as events:
        async for e in events:
            if e.type == "ADDED":
                assert fake.open_streams == 1
                break
    assert fake.open_streams == 0


async def test_cancelling_the_consumer_closes_the_stream() -> None:
    fake = FakeCollection([listed("10")], [])
    run = Run(fake)
    await run.until(lambda: fake.open_streams == 1)
    assert fake.open_streams == 0


def test_backoff_is_capped_jittered_and_resettable() -> None:
    backoff = Backoff(base=0.8, cap=30.0, rng=random.Random(1))
    delays = [backoff.next() for _ in range(12)]
    assert all(15.0 <= d <= 30.0 for d in delays[6:])
    assert max(delays) <= 30.0
    assert len(set(delays)) == len(delays)
    backoff.reset()
    assert 0.4 <= backoff.next() <= 0.8


def test_fake_matches_the_protocol() -> None:
    collection: Watchable = FakeCollection([], [])
    assert collection.ref("watch", "osc").name == "osc"
