"""The one controller loop (node_agent.base.loop): what every controller's loop relies on."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Literal

import pytest

from node_agent.base.loop import DONE, RETRY, SKIPPED, Next, Step, Wake, cancel_and_wait, run_loop
from node_agent.base.retry import Backoff
from tests.unit.fakes import VirtualClock, until

#: the loop waits on timers only: every test runs on its virtual clock
pytestmark = pytest.mark.usefixtures("virtual_clock")


class Recorded(Backoff):
    """A backoff that remembers its delays and can be told to wait less than it chose."""

    def __init__(self, base: float = 0.01, cap: float = 0.01, *, scale: float = 1.0) -> None:
        super().__init__(base=base, cap=cap, rng=random.Random(1))
        self.delays: list[float] = []
        self.scale = scale

    def next(self) -> float:
        delay = super().next()
        self.delays.append(delay)
        return delay * self.scale


class Script:
    """A step that answers from a list (then DONE) and records each call's ``woken``."""

    def __init__(self, *answers: Next, during: Callable[[int], None] | None = None) -> None:
        self.answers = list(answers)
        self.calls: list[bool] = []
        self.during = during

    async def __call__(self, woken: bool) -> Next:
        self.calls.append(woken)
        if self.during is not None:
            self.during(len(self.calls))
        return self.answers.pop(0) if self.answers else DONE


@contextlib.asynccontextmanager
async def running(coro: Coroutine[Any, Any, Any]) -> AsyncIterator[None]:
    task = asyncio.create_task(coro)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_wake_ups_before_the_loop_looks_are_one_step() -> None:
    wake, step = Wake(), Script()
    for _ in range(3):
        wake.set()
    async with running(run_loop(step, wake, period=None)):
        await until(lambda: step.calls)
        await asyncio.sleep(0.05)
    assert step.calls == [True]


async def test_a_wake_up_during_a_step_is_not_lost() -> None:
    wake = Wake()
    step = Script(during=lambda n: wake.set() if n == 1 else None)
    wake.set()
    async with running(run_loop(step, wake, period=None)):
        await until(lambda: len(step.calls) == 2)
        await asyncio.sleep(0.05)
    assert step.calls == [True, True]


async def test_the_period_runs_a_step_without_a_wake_up() -> None:
    wake, step = Wake(), Script()
    async with running(run_loop(step, wake, period=0.02)):
        await until(lambda: len(step.calls) >= 3)
    assert set(step.calls) == {False}


async def test_no_period_sleeps_until_woken(virtual_clock: VirtualClock) -> None:
    wake, step = Wake(), Script()
    async with running(run_loop(step, wake, period=None)):
        await asyncio.sleep(86400.0)  # a day on the loop's clock, none on the wall's
        # the jumps are sums of float differences: a day may add up to 86399.99999999999
        assert virtual_clock.jumped >= 86400.0 - 1e-6
        assert step.calls == []
        wake.set()
        await until(lambda: step.calls)
    assert step.calls == [True]


async def test_a_step_chooses_its_next_wait_once() -> None:
    wake = Wake()
    step = Script(Next.after(0.01))  # then DONE: the (long) period again
    async with running(run_loop(step, wake, period=3600.0, immediately=True)):
        await until(lambda: len(step.calls) == 2)
        await asyncio.sleep(3000.0)  # most of the period: no third step
    assert step.calls == [False, False]


async def test_immediately_steps_first_and_takes_an_earlier_wake_up_as_seen() -> None:
    wake, step = Wake(), Script()
    wake.set()
    async with running(run_loop(step, wake, period=3600.0, immediately=True)):
        await until(lambda: step.calls)
        await asyncio.sleep(0.05)
    assert step.calls == [False]


async def test_a_retry_backs_off_growing_and_success_resets_it() -> None:
    wake, backoff = Wake(), Recorded(base=0.01, cap=1.0)
    step = Script(RETRY, RETRY, DONE)
    retried: list[float] = []
    loop = run_loop(step, wake, period=None, backoff=backoff, on_retry=retried.append)
    wake.set()
    async with running(loop):
        await until(lambda: len(step.calls) == 3)
        await asyncio.sleep(0.05)
    assert step.calls == [True, True, True]  # after a backoff the loop steps again at once
    assert 0.005 <= backoff.delays[0] <= 0.01
    assert 0.01 <= backoff.delays[1] <= 0.02
    assert retried == backoff.delays
    assert backoff.attempt == 0


async def test_a_skipped_step_keeps_the_backoff() -> None:
    wake, backoff = Wake(), Recorded()
    step = Script(RETRY, SKIPPED)
    wake.set()
    async with running(run_loop(step, wake, period=None, backoff=backoff)):
        await until(lambda: len(step.calls) == 2)
        await asyncio.sleep(0.05)
    assert backoff.attempt == 1  # neither reset nor grown


async def test_a_wake_up_cuts_a_backoff_short() -> None:
    wake, backoff = Wake(), Recorded(base=3600.0, cap=3600.0)
    step = Script(RETRY)
    wake.set()
    async with running(run_loop(step, wake, period=None, backoff=backoff)):
        await until(lambda: backoff.delays)
        await asyncio.sleep(0.05)
        assert len(step.calls) == 1  # backing off for about an hour
        wake.set()
        await until(lambda: len(step.calls) == 2)
    assert backoff.attempt == 0


async def test_a_retry_without_a_backoff_is_a_bug() -> None:
    wake = Wake()
    wake.set()
    step: Step = Script(RETRY)
    with pytest.raises(RuntimeError, match="no backoff"):
        await run_loop(step, wake, period=None)


async def test_a_step_that_raises_ends_the_loop() -> None:
    async def step(woken: bool) -> Next:
        raise ValueError("a bug")

    wake = Wake()
    with pytest.raises(ValueError, match="a bug"):
        await run_loop(step, wake, period=None, immediately=True)


async def test_wake_sleep_says_whether_it_was_woken_and_clears() -> None:
    wake = Wake()
    assert await wake.sleep(0.01) is False
    assert await wake.sleep(0) is False
    wake.set()
    assert await wake.sleep(0) is True
    assert not wake.is_set()
    asyncio.get_running_loop().call_later(0.01, wake.set)
    assert await wake.sleep(None) is True
    assert not wake.is_set()


class LateWake(Wake):
    """A wake-up that arrives while a sleep is timing out (its wait is being cancelled)."""

    async def wait(self) -> Literal[True]:
        try:
            return await super().wait()
        except asyncio.CancelledError:
            self.set()
            raise


async def test_a_wake_up_as_the_sleep_times_out_is_kept_for_the_next_sleep() -> None:
    wake = LateWake()
    assert await wake.sleep(0.01) is False  # timed out
    assert wake.is_set()
    assert await wake.sleep(3600.0) is True  # at once


async def assert_cancelled_as_woken(
    wake: asyncio.Event, waiting: Coroutine[Any, Any, object]
) -> None:
    """Cancel ``waiting`` in the same turn of the loop as ``wake`` is set: it must end in
    CancelledError (within 5 s: one that runs on fails the test by timing out)."""
    task = asyncio.create_task(waiting)
    await asyncio.sleep(0)
    wake.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(5):
            await task


async def test_a_sleep_cancelled_as_it_is_woken_is_cancelled() -> None:
    """Cancelled in the same turn of the event loop as the wake-up: the sleep must still end
    in CancelledError. Python 3.11's ``asyncio.wait_for`` returns the result then and drops
    the cancellation, so a controller loop ran on and the agent's shutdown waited for it
    until its hard stop (exit 1 instead of 0)."""
    wake = Wake()
    await assert_cancelled_as_woken(wake, wake.sleep(30))


async def test_a_backoff_cancelled_as_it_is_woken_is_cancelled() -> None:
    wake = asyncio.Event()
    await assert_cancelled_as_woken(wake, Backoff(base=30, cap=30).wait(wake))


async def test_a_loop_cancelled_as_it_is_woken_ends() -> None:
    wake = Wake()
    step = Script()
    await assert_cancelled_as_woken(wake, run_loop(step, wake, period=30))
    assert step.calls == []


async def test_cancel_and_wait_passes_on_a_cancellation_of_its_caller() -> None:
    """The caller, cancelled while its child winds down, must end cancelled."""

    async def slow_to_stop() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0.05)  # a child that takes a moment to wind down

    child = asyncio.create_task(slow_to_stop())
    await asyncio.sleep(0)
    closing = asyncio.create_task(cancel_and_wait(child, None))
    await asyncio.sleep(0.01)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    await asyncio.wait([child])
    assert child.cancelled()


async def test_cancel_and_wait_raises_what_a_child_raised_on_its_way_out() -> None:
    async def fails_on_cancel() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise OSError("cleanup failed") from None

    child = asyncio.create_task(fails_on_cancel())
    await asyncio.sleep(0)
    with pytest.raises(OSError, match="cleanup failed"):
        await cancel_and_wait(child)
