"""Fuzz: two readers of one rule must agree (issue 33, finding 9).

A plain YAML scalar means one thing to Gardener's Go programs (go-yaml v2 under
sigs.k8s.io/yaml): ``base.goyaml.resolve_plain`` is that reading, proven against upstream by the
config oracle. The OSC decoder (``osc.decode``) reads the OSC's plain scalars, and must give
each the same value (or, where Go's value has no place in an OSC, refuse it typed).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import yaml
from hypothesis import given

from node_agent.base.errors import OSCDecodeError
from node_agent.base.goyaml import resolve_plain
from node_agent.osc import decode
from tests.fuzz import harness
from tests.fuzz.harness import bounded, budget, expect, only
from tests.fuzz.strategies import plain_scalars

#: a failure takes minutes to shrink; a pass takes seconds
pytestmark = pytest.mark.timeout(900)


def _is_plain(text: str) -> bool:
    """``v: <text>`` holds ``text`` as one plain scalar (else the comparison means nothing)."""
    try:
        events = list(yaml.parse(f"v: {text}\n", Loader=yaml.SafeLoader))
    except yaml.YAMLError:
        return False
    scalars = [e for e in events if isinstance(e, yaml.ScalarEvent)]
    return len(scalars) == 2 and scalars[1].value == text and scalars[1].style is None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("text", ["1e3", "08", "0X5", "0B0", "18446744073709551616"])
def test_a_scalar_known_to_be_read_two_ways_is_read_as_go_does(text: str) -> None:
    """Issue 33's ``1e3`` (finding 9) and this harness's: ``08`` (Go: the float 8), ``0X5``
    and ``0B0`` (Go: ints, its prefixes are case-blind), 2**64 (Go: a float)."""
    same_reading(text)


@budget(short=400)
@given(text=plain_scalars())
def test_the_osc_decoder_reads_a_plain_scalar_as_go_does(text: str) -> None:
    same_reading(text)


def same_reading(text: str) -> None:
    if not _is_plain(text):
        return
    harness.example(text)
    with bounded("plain scalars"):
        go = resolve_plain(text)
        ours: Any = None
        with only((OSCDecodeError, ValueError, yaml.YAMLError), "osc decode of a scalar") as out:
            ours = decode.load_yaml(f"v: {text}\n".encode())["v"]
        if out.refused is not None:
            return
        expect(
            _same(ours, go),
            "one reading of a plain scalar",
            lambda: (
                f"{text!r}: the OSC decoder reads {ours!r}, Go reads {go!r} (issue 33, finding 9)"
            ),
            key=f"decoder {type(ours).__name__}, Go {type(go).__name__}",
        )
