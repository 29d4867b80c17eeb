"""``Base64ByChange`` against ``base64.b64decode(text, validate=True)``: on random sequences of
values that change a little (bytes replaced, inserted or removed anywhere, the text itself
spoilt with padding, foreign characters, a cut or a second value after it), the same bytes or
the same kind of error."""

from __future__ import annotations

import base64

from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.base.by_change import Base64ByChange, common_prefix, common_suffix

ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

edits = st.tuples(
    st.sampled_from(["replace", "insert", "delete", "spoil", "cut", "append", "same"]),
    st.integers(0, 10_000),
    st.binary(min_size=1, max_size=5),
    st.sampled_from(["=", "==", "A=", "\n", " ", "é", "-", ALPHABET[7]]),
)


def reference(text: str) -> bytes | str:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as exc:  # binascii.Error and a non-ASCII text's error
        return type(exc).__name__


def by_change(decoder: Base64ByChange, text: str) -> bytes | str:
    try:
        return decoder.decode(text)
    except ValueError as exc:
        return type(exc).__name__


@settings(max_examples=600, deadline=None)
@given(first=st.binary(max_size=300), steps=st.lists(edits, max_size=10))
def test_decoding_by_change_is_decoding_whole(
    first: bytes, steps: list[tuple[str, int, bytes, str]]
) -> None:
    decoder = Base64ByChange()
    raw = first
    for how, at, data, junk in [("same", 0, b"", ""), *steps]:
        at %= len(raw) + 1
        if how == "replace":
            raw = raw[:at] + data + raw[at + len(data) :]
        elif how == "insert":
            raw = raw[:at] + data + raw[at:]
        elif how == "delete":
            raw = raw[:at] + raw[at + len(data) :]
        text = base64.b64encode(raw).decode()
        if how == "spoil":  # a foreign character, or padding, somewhere in a valid text
            where = at % (len(text) + 1)
            text = text[:where] + junk + text[where + len(junk) :]
        elif how == "cut":
            text = text[: at % (len(text) + 1)]
        elif how == "append":  # a second value after the first, padding and all
            text += base64.b64encode(data).decode()
        assert by_change(decoder, text) == reference(text), (how, at, text)


def test_a_one_byte_change_decodes_only_the_groups_around_it() -> None:
    """A 900 KB value with one byte changed in the middle: the shared groups come from the
    value before (the decoder's bytes are the reference's, and it is not decoded whole)."""
    decoder = Base64ByChange()
    raw = bytes(range(256)) * 3500 + b"x"
    decoder.decode(base64.b64encode(raw).decode())
    changed = raw[:450_000] + b"!" + raw[450_001:]
    text = base64.b64encode(changed).decode()
    assert decoder._by_change(text) == changed
    assert decoder.decode(text) == changed


def test_common_prefix_and_suffix() -> None:
    assert common_prefix(b"abcdef", b"abcxef") == 3
    assert common_suffix(b"abcdef", b"abcxef", 6) == 2
    assert common_suffix("aaaa", "aaaa", 2) == 2
    assert common_prefix("", "a") == 0
