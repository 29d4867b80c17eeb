"""``osc.memo.Memo``: values by the key object itself, never by an id a dead key once had."""

from __future__ import annotations

import gc

import pytest

from node_agent.osc.memo import Memo


class Key:
    """Hashable by identity only, as a frozen OSC item is looked up here."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_a_value_is_computed_once_per_key_object() -> None:
    calls: list[int] = []
    memo: Memo[Key, int] = Memo(8)

    def compute(key: Key) -> int:
        calls.append(key.value)
        return key.value * 10

    a, b = Key(1), Key(1)
    assert memo.get(a, compute) == 10
    assert memo.get(a, compute) == 10
    assert memo.get(b, compute) == 10  # an equal but other object is computed anew
    assert calls == [1, 1]


def test_an_id_reused_by_a_new_object_never_finds_the_old_value() -> None:
    """The memo holds its keys: while an entry exists its key is alive, so no other object can
    have its id; once dropped (two generations unused), the value is gone with it."""
    memo: Memo[Key, int] = Memo(2)
    ids: set[int] = set()
    for value in range(200):
        key = Key(value)
        ids.add(id(key))
        assert memo.get(key, lambda k: k.value) == value
        del key
        # the next Key gets this one's memory, and its id, once nothing holds it (a young
        # generation's collection is enough: a full one costs ~0.3 s in a whole suite's heap)
        gc.collect(0)
    assert len(ids) < 200  # ids were reused, so the test could have found an old value
    assert len(memo._new) + len(memo._old) <= 4


def test_an_entry_used_in_each_generation_survives_and_an_unused_one_is_dropped() -> None:
    memo: Memo[Key, int] = Memo(2)
    kept, dropped = Key(0), Key(1)
    calls: list[int] = []

    def compute(key: Key) -> int:
        calls.append(key.value)
        return key.value

    memo.get(kept, compute)
    memo.get(dropped, compute)
    for value in range(2, 8):
        memo.get(kept, compute)  # used again in every generation
        memo.get(Key(value), compute)
    calls.clear()
    memo.get(kept, compute)
    memo.get(dropped, compute)
    assert calls == [1]


def test_an_error_is_not_kept() -> None:
    memo: Memo[Key, int] = Memo(4)
    key = Key(1)
    tries: list[int] = []

    def failing(k: Key) -> int:
        tries.append(k.value)
        raise ValueError("no")

    for _ in range(2):
        with pytest.raises(ValueError, match="no"):
            memo.get(key, failing)
    assert tries == [1, 1]
    assert memo.get(key, lambda k: 5) == 5


def test_what_is_held_is_bounded_by_weight_not_only_by_entries() -> None:
    """One large item per update must not pile up: entries weigh about their bytes, and a
    generation ends once its weight would pass the size."""
    memo: Memo[Key, int] = Memo(1000, lambda key: key.value)
    keys = [Key(300) for _ in range(20)]  # kept alive: only the memo's bound drops entries
    for key in keys:
        memo.get(key, lambda k: k.value)
        held = [*memo._new.values(), *memo._old.values()]
        assert sum(1 + k.value for k, _ in held) <= 2 * 1000


def test_item_weight_counts_the_text_of_an_osc_item() -> None:
    from node_agent.osc.memo import item_weight
    from node_agent.osc.models import File

    small = File.model_validate({"path": "/a", "content": {"inline": {"data": "x"}}})
    large = File.model_validate({"path": "/a", "content": {"inline": {"data": "x" * 10_000}}})
    assert item_weight(large) - item_weight(small) == 9_999
