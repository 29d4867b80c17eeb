"""Work on a large value by what changed since the last one.

An OSC update usually changes a few bytes of a Secret value of up to a MiB. Finding what two
versions share costs a few comparisons of memory; decoding or parsing the whole value again
costs in proportion to its size. The OSC decoder reparses only the changed item this way, and
the OSC controller decodes only the changed part of the Secret's base64.
"""

from __future__ import annotations

import base64
import binascii
from typing import AnyStr


def common_prefix(a: AnyStr, b: AnyStr) -> int:
    """How many leading bytes (characters) ``a`` and ``b`` share (memcmp on halving slices)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def common_suffix(a: AnyStr, b: AnyStr, limit: int) -> int:
    """How many trailing bytes (characters) ``a`` and ``b`` share, at most ``limit``."""
    low, high = 0, limit
    la, lb = len(a), len(b)
    while low < high:
        mid = (low + high + 1) // 2
        if a[la - mid : la - low] == b[lb - mid : lb - low]:
            low = mid
        else:
            high = mid - 1
    return low


class Base64ByChange:
    """Strict base64 decoding (``base64.b64decode(text, validate=True)``) of one value over
    and over, decoding only the 4-character groups that changed since the last value.

    Each group of 4 characters stands for 3 bytes by itself; only the last group of a value
    may carry padding. So when the last group is unchanged (it holds any padding) the bytes
    are those of the shared leading groups, the changed groups decoded, and those of the
    shared trailing groups. Everything else (no value before, a changed last group, padding
    or a length that is not a multiple of 4 in the changed part) is decoded whole, which also
    raises what whole decoding raises."""

    def __init__(self) -> None:
        self._text = ""
        self._raw: bytes | None = None  # the bytes of ``_text``; None: nothing decoded yet

    def decode(self, text: str) -> bytes:
        """The bytes of ``text``; raises what ``base64.b64decode`` raises for it."""
        raw = self._by_change(text) if isinstance(text, str) else None
        if raw is None:
            raw = base64.b64decode(text, validate=True)
        if isinstance(text, str):
            self._text, self._raw = text, raw
        return raw

    def _by_change(self, text: str) -> bytes | None:
        old, old_raw = self._text, self._raw
        if old_raw is None or len(text) % 4 or len(old) % 4 or not text.isascii():
            return None
        if text == old:
            return old_raw
        head = common_prefix(old, text) // 4 * 4
        limit = min(len(old), len(text)) - head
        tail = common_suffix(old, text, limit) // 4 * 4
        if tail < 4:
            return None  # the last group changed: it may hold padding
        middle = text[head : len(text) - tail]
        if "=" in middle:
            return None  # padding before the last group: invalid, let whole decoding say so
        padding = len(old) - len(old.rstrip("="))
        kept_tail = tail // 4 * 3 - padding
        return b"".join(
            (
                old_raw[: head // 4 * 3],
                binascii.a2b_base64(middle.encode("ascii"), strict_mode=True),
                old_raw[len(old_raw) - kept_tail :],
            )
        )
