"""How the client reads answers, each against the plain way: ``WatchLines`` against splitting the
whole stream at once (however it is cut into chunks, the same non-blank lines in the same order,
and what is left after the last newline); ``json_loads`` against ``json.loads`` (the same value or
the same error, whatever the bytes and their encoding)."""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.kube.client import WatchLines, json_loads

pieces = st.lists(
    st.sampled_from([b"\n", b" ", b"\t", b"\r\n", b"{", b"}", b'"a"', b"x" * 70, b"\xc3\xa9"]),
    max_size=40,
)


def cut(stream: bytes, points: list[int]) -> list[bytes]:
    bounds = sorted({0, len(stream), *(p % (len(stream) + 1) for p in points)})
    return [stream[a:b] for a, b in itertools.pairwise(bounds)]


def lines_of(chunks: list[bytes]) -> tuple[list[bytes], int, bytes | None]:
    lines = WatchLines()
    seen: list[bytes] = []
    for chunk in chunks:
        seen.extend(bytes(line) for line in lines.feed(chunk))  # a line lives until the next
    pending = lines.pending
    rest = lines.rest()
    return seen, pending, None if rest is None else bytes(rest)


@settings(max_examples=400, deadline=None)
@given(parts=pieces, points=st.lists(st.integers(0, 4000), max_size=12))
def test_any_cut_gives_the_lines_of_the_whole_stream(parts: list[bytes], points: list[int]) -> None:
    stream = b"".join(parts)
    *complete, tail = stream.split(b"\n")
    seen, pending, rest = lines_of(cut(stream, points))
    assert seen == [line for line in complete if line.strip()]
    assert pending == len(tail)
    assert rest == (tail if tail.strip() else None)


def test_a_line_is_gathered_over_chunks_and_blank_lines_are_dropped() -> None:
    seen, pending, rest = lines_of([b'{"type": "A', b'DDED"}\n \n\n{"ty', b'pe": "X"}\n{"t'])
    assert seen == [b'{"type": "ADDED"}', b'{"type": "X"}']
    assert (pending, rest) == (3, b'{"t')


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=10,
)
encodings = st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-32-be"])


def outcome(loads: Any, data: bytes | bytearray) -> object:
    try:
        return ("value", loads(data))
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        return ("error", type(exc).__name__)


@settings(max_examples=400, deadline=None)
@given(value=values, encoding=encodings, ascii_only=st.booleans(), spoil=st.binary(max_size=3))
def test_json_loads_reads_what_json_loads_reads(
    value: object, encoding: str, ascii_only: bool, spoil: bytes
) -> None:
    data = json.dumps(value, ensure_ascii=ascii_only).encode(encoding, "surrogatepass")
    for sample in (data, bytearray(data), data + spoil, spoil + data, data[: len(data) // 2]):
        assert outcome(json_loads, sample) == outcome(json.loads, sample)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=40))
def test_json_loads_refuses_what_json_loads_refuses(data: bytes) -> None:
    assert outcome(json_loads, data) == outcome(json.loads, data)
