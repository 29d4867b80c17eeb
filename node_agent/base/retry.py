"""The one retry policy every controller uses after a failure.

A failed step (an API call, a watch, an apply) is retried after a delay that doubles from
``base`` up to ``cap``, with "equal jitter" (a delay drawn from [d/2, d]) so that a fleet of agents
that failed together does not retry together. A success resets it. Controllers differ only in
their ``base`` and ``cap``, never in how the delay is computed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random

#: Delays for the controllers: (base seconds, cap seconds).
WATCH = (0.8, 30.0)
APPLY = (1.0, 60.0)
API = (1.0, 30.0)
CERTIFICATE = (2.0, 300.0)  # a denied request may stay denied: ask again, but not every 30 s
HELD_BACK = (10.0, 300.0)  # re-checking derived items held back (a registry mirror not up yet)
#: a write that lost a compare-and-swap (the rollout's Lease): read and decide again soon, but
#: not in step with the nodes it raced; from ~50 ms up to 350 ms over a handful of tries
CONFLICT = (0.05, 0.35)


class Backoff:
    """Exponential backoff with equal jitter: a delay in [d/2, d], d = min(cap, base·factorⁿ)."""

    def __init__(
        self,
        base: float = WATCH[0],
        cap: float = WATCH[1],
        factor: float = 2.0,
        rng: random.Random | None = None,
    ) -> None:
        if base <= 0 or cap < base or factor < 1:
            raise ValueError(f"bad backoff: base={base} cap={cap} factor={factor}")
        self.base, self.cap, self.factor = base, cap, factor
        self.attempt = 0
        self._rng = rng or random.Random()

    @classmethod
    def of(cls, policy: tuple[float, float], rng: random.Random | None = None) -> Backoff:
        return cls(base=policy[0], cap=policy[1], rng=rng)

    def next(self) -> float:
        """The delay before the next attempt; each call counts one more failure."""
        ceiling = min(self.cap, self.base * self.factor ** min(self.attempt, 64))
        self.attempt += 1
        return self._rng.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self.attempt = 0

    async def wait(self, wake: asyncio.Event | None = None) -> float:
        """Sleep for ``next()`` seconds, or until ``wake`` is set (then return early, leaving it
        set for the caller). Returns the delay that was chosen."""
        delay = self.next()
        if wake is None:
            await asyncio.sleep(delay)
            return delay
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await wake.wait()
        return delay
