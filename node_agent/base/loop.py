"""The one controller loop: sleep until woken or a period ran out, run one step, back off after a
failure.

The controllers that act on the latest version of something (the OSC Secret, the Node, the
unit states, the health of kubelet and containerd, a token file) all need the same loop: events
only set a :class:`Wake`, so a burst of them collapses into one step that works on the latest
object; a period bounds how long the loop sleeps (the periodic full check); and a failed step is
retried on the agent's one backoff (:mod:`node_agent.base.retry`), which a new wake-up cuts
short. It is written once because its details are easy to get subtly different in hand-rolled
copies: the wake-up is cleared *before* the step, so one that arrives during the step is kept
for the next turn; the backoff starts over only after a step that worked; after a backoff the
loop steps again at once. What differs between controllers is said by the step's answer
(:class:`Next`: how it went and how long to sleep next), never by another loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from node_agent.base.retry import Backoff

Outcome = Literal["done", "skipped", "retry"]


class Wake(asyncio.Event):
    """What wakes a loop. Set any number of times before the loop looks, it is one wake-up."""

    async def sleep(self, seconds: float | None) -> bool:
        """Sleep until set or until ``seconds`` passed (None: no limit); True when woken, and
        then cleared, so a wake-up during the following step is not lost. A wake-up that comes
        just as the sleep times out stays set: the next sleep returns at once."""
        if not self.is_set():
            if seconds is not None and seconds <= 0:
                return False
            try:
                async with asyncio.timeout(seconds):
                    await self.wait()
            except TimeoutError:
                return False
        self.clear()
        return True


@dataclass(frozen=True, slots=True)
class Next:
    """A step's answer: how it went, and how long the loop sleeps before the next step unless
    woken earlier (``wait``; None: the loop's period).

    ``done``: the step did its work; the backoff starts over. ``skipped``: nothing was done
    and nothing is to be retried (no object yet, or input that stays wrong until it changes);
    the backoff is left as it is. ``retry``: the step failed for now; the loop backs off (a
    wake-up cuts that short) and steps again."""

    outcome: Outcome = "done"
    wait: float | None = None

    @classmethod
    def after(cls, seconds: float) -> Next:
        """Done; the next step in ``seconds`` instead of the period (unless woken earlier)."""
        return cls("done", seconds)


DONE = Next("done")
SKIPPED = Next("skipped")
RETRY = Next("retry")

#: One step of a loop; its argument says whether the wake was set (False: the period or the
#: step's own ``wait`` ran out, or the first step of a loop that starts ``immediately``).
Step = Callable[[bool], Awaitable[Next]]


async def run_loop(
    step: Step,
    wake: Wake,
    *,
    period: float | None,
    backoff: Backoff | None = None,
    immediately: bool = False,
    on_retry: Callable[[float], None] | None = None,
) -> NoReturn:
    """Run ``step`` for ever: after a wake-up, or when ``period`` seconds (None: never) passed
    without one. ``immediately``: the first step runs at once (a wake-up set before it is
    taken as seen by it). ``on_retry`` is told each backoff's delay, after the backoff.
    A step's exception ends the loop: steps decide which failures are retried."""
    wait = period
    woken = False
    if immediately:
        wake.clear()
    else:
        woken = await wake.sleep(wait)
    while True:
        answer = await step(woken)
        wait = period if answer.wait is None else answer.wait
        if answer.outcome == "retry":
            if backoff is None:
                raise RuntimeError("a step asked for a retry, but its loop has no backoff")
            delay = await backoff.wait(wake)
            if on_retry is not None:
                on_retry(delay)
            wake.set()
        elif answer.outcome == "done" and backoff is not None:
            backoff.reset()
        woken = await wake.sleep(wait)


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel ``tasks`` (None: skipped) and wait until each has ended; an exception other than
    the cancellation is raised again. Awaiting each under ``suppress(CancelledError)`` would
    also swallow a cancellation of the caller itself that arrives meanwhile."""
    pending = [task for task in tasks if task is not None]
    for task in pending:
        task.cancel()
    if not pending:
        return
    await asyncio.wait(pending)
    for task in pending:
        if not task.cancelled() and (error := task.exception()) is not None:
            raise error
