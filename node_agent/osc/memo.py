"""A small bounded memo for per-item work that does not change when the item does not.

An update usually changes one item of an OSC of hundreds. Decoding reuses the unchanged items'
objects of the OSC before (``decode.parse_osc``), so an item's digest, its ``Applied`` form and
its validation are found by the item object itself: an identity lookup, where hashing and
comparing pydantic models by value would cost about as much as the work saved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

#: the weight (``item_weight``: about the bytes) each per-item memo keeps per generation: two of
#: the largest OSCs (``decode.MAX_OSC_BYTES`` is 1 MiB), so what the memos hold beyond the OSCs
#: in use stays within a few MiB
ITEM_MEMO_BYTES = 2 * 1024 * 1024

K = TypeVar("K")
V = TypeVar("V")


class Memo(Generic[K, V]):
    """Values by key object (identity), in two generations of at most ``size`` weight each
    (``weigh``: a key's weight, 1 by default; an entry weighs 1 more): an entry used in the
    current or the previous generation is kept, one unused for a whole generation is dropped,
    so what is held is bounded by twice ``size`` whatever the keys are. Each entry holds its
    key, so an id is never reused while it is in here. Safe to share between threads (a race
    can only cost a recomputation)."""

    def __init__(self, size: int, weigh: Callable[[K], int] | None = None) -> None:
        self.size = size
        self._weigh = weigh
        self._weight = 0  # of the current generation
        self._new: dict[int, tuple[K, V]] = {}
        self._old: dict[int, tuple[K, V]] = {}

    def get(self, key: K, compute: Callable[[K], V]) -> V:
        """The value for ``key``, computed (and kept) if unknown; errors are not kept."""
        ident = id(key)
        new = self._new
        entry = new.get(ident)
        if entry is not None and entry[0] is key:
            return entry[1]
        entry = self._old.get(ident)
        value = entry[1] if entry is not None and entry[0] is key else compute(key)
        weight = 1 + (self._weigh(key) if self._weigh is not None else 0)
        if self._weight + weight > self.size:
            self._old, self._new, self._weight = new, {}, 0
            new = self._new
        new[ident] = (key, value)
        self._weight += weight
        return value


class Last(Generic[K, V]):
    """The value of the last key asked about, by identity (one entry): for work on a whole
    frozen object (an OSC, an ``Applied``) that one update asks for several times in a row.
    Holds its key, so an id is never reused while it is in here; a race between threads can
    only cost a recomputation."""

    def __init__(self) -> None:
        self._entry: tuple[K, V] | None = None

    def get(self, key: K, compute: Callable[[K], V]) -> V:
        entry = self._entry
        if entry is not None and entry[0] is key:
            return entry[1]
        value = compute(key)
        self._entry = (key, value)
        return value


def item_weight(item: object) -> int:
    """About the bytes an OSC item holds (its strings, 64 for the rest): what a memo entry
    keeps alive, so the memos are bounded in bytes, not only in entries (one large file per
    update would otherwise pile up thousands of large items)."""
    return 64 + sum(_text_size(value) for value in vars(item).values())


def _text_size(value: object) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, tuple):
        return sum(_text_size(v) for v in value)
    if hasattr(value, "__dict__"):
        return sum(_text_size(v) for v in vars(value).values())
    return 0
