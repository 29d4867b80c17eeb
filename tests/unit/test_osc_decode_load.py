"""The one-pass YAML build (``decode.load_yaml``) against PyYAML's composer and constructor.

``load_yaml`` builds plain documents itself and leaves everything else to the general way; both
must give the same value or the same error for any input, with either loader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.osc import decode

DATA = Path(__file__).parent / "data"

#: plain scalars each resolver reads differently (go-yaml v2's types), and scalars the one-pass
#: build leaves to the general way (tags, anchors, aliases, merge and value keys)
SCALARS = [
    "a",
    "path",
    "",
    "~",
    "null",
    "Null",
    "y",
    "n",
    "Yes",
    "off",
    "True",
    "tRue",
    "0",
    "-0",
    "420",
    "0644",
    "0o644",
    "0o8",
    "0x1F",
    "0x_",
    "0b101",
    "0b_",
    "1_000",
    "+12",
    "1:30",
    "2001-12-14",
    "1.5",
    "420.0",
    "1e3",
    "1.0e+3",
    ".5",
    ".inf",
    "-.Inf",
    ".nan",
    ".NaN",
    "'420'",
    '"y"',
    '"a\\tb"',
    "=",
    "<<",
    "!!int 3",
    "!!int x",
    "!!str 1",
    "!!float 2",
    "!!binary aGk=",
    "!!timestamp 2001-12-14",
    "!local x",
    "! 12",
    "&a 1",
    "&b y",
    "*a",
    "*b",
    "*c",
]

Tree = Any  # ("s", text) | ("seq", [Tree]) | ("map", [(Tree, Tree)])

scalars = st.sampled_from(SCALARS).map(lambda text: ("s", text))
trees: st.SearchStrategy[Tree] = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda items: ("seq", items)),
        st.lists(st.tuples(st.one_of(scalars, scalars, inner), inner), max_size=4).map(
            lambda pairs: ("map", pairs)
        ),
    ),
    max_leaves=12,
)


def flow(tree: Tree) -> str:
    kind, body = tree
    if kind == "s":
        return str(body)
    if kind == "seq":
        return "[" + ", ".join(flow(item) for item in body) + "]"
    return "{" + ", ".join(f"{flow(k)}: {flow(v)}" for k, v in body) + "}"


def block(tree: Tree, indent: int) -> str:
    """``tree`` after a ``-`` or a ``key:``: inline when a scalar or empty, else on new lines."""
    kind, body = tree
    if kind == "s" or not body:
        return " " + flow(tree) + "\n"
    pad = " " * indent
    if kind == "seq":
        return "\n" + "".join(f"{pad}-{block(item, indent + 2)}" for item in body)
    lines = []
    for key, value in body:
        head = flow(key) if key[0] == "s" else "? " + flow(key) + "\n" + pad
        lines.append(f"{pad}{head}:{block(value, indent + 2)}")
    return "\n" + "".join(lines)


def outcome(load: Any, raw: bytes) -> tuple[str, ...]:
    try:
        return ("value", repr(load(raw)))
    except Exception as exc:  # what each way raises is the point of the comparison
        return ("error", type(exc).__name__, str(exc))


def same(raw: bytes) -> None:
    assert outcome(decode.load_yaml, raw) == outcome(decode.load_yaml_general, raw), raw


@pytest.mark.parametrize(
    "text",
    [
        "",
        "a",
        "--- a\n--- b\n",
        "a: 1\n---\n",
        "{a: 1, a: 2}",
        "{1: a, '1': b, 1.0: c, true: d}",
        "{.nan: a, .nan: b}",
        "{[a]: b}",
        "{{a: b}: c}",
        "a: &x [1]\nb: *x\n",
        "a: {<<: {b: 1}, c: 2}\n",
        "a: !!int 0b_\nb: [[[[",
        "a: 0b_\nb: c: d\n",
        "a: [" * 70 + "]" * 70,
        "a: " + "[" * 1100 + "]" * 1100,  # libyaml 0.2.6 stops at 1000 open flow collections
        "a: b\n  c: d\n",
        "- a\n- b: c\n  d: [e, {f: g}]\n",
        "%YAML 1.1\n--- {a: 1}\n...\n",
        "a: 1\nb: 2\na: 3\n",
        "? a\n: b\n",
        "a: |\n  text\n  more\nb: >-\n  folded\n",
    ],
)
def test_corner_cases_load_as_pyyaml_loads_them(text: str, loader: str) -> None:
    same(text.encode())


@settings(max_examples=300, deadline=None)
@given(tree=trees, style=st.sampled_from(["flow", "block"]))
def test_any_document_loads_as_pyyaml_loads_it(tree: Tree, style: str) -> None:
    text = flow(tree) if style == "flow" or tree[0] == "s" else block(tree, 0).lstrip("\n")
    same(text.encode())


def test_a_real_osc_is_built_in_one_pass(monkeypatch: pytest.MonkeyPatch, loader: str) -> None:
    """The realistic Gardener OSC needs none of the general way (else nothing was gained)."""
    raw = (DATA / "osc-realistic.yaml").read_bytes()
    expected = decode.load_yaml_general(raw)

    def general(raw: bytes) -> Any:
        raise AssertionError("the general way was taken")

    monkeypatch.setattr(decode, "load_yaml_general", general)
    assert decode.load_yaml(raw) == expected
    assert decode.load_yaml(yaml.safe_dump(expected).encode()) == expected
