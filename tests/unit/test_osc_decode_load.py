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
    "1.0e3",
    "-.5",
    "08",
    "0X1F",
    "1e400",
    "18446744073709551616",
    "0x10000000000000000",
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


# --- an update that changes one item is read by that item alone ----------------------------------

HEAD = "apiVersion: extensions.gardener.cloud/v1alpha1\nkind: OperatingSystemConfig\n"


def pool_osc(files: int, units: int, width: int = 80) -> bytes:
    doc = {
        "apiVersion": "extensions.gardener.cloud/v1alpha1",
        "kind": "OperatingSystemConfig",
        "metadata": {"name": "pool", "namespace": "kube-system"},
        "spec": {
            "type": "debian",
            "files": [
                {
                    "path": f"/etc/pool/{i}.conf",
                    "permissions": 0o644,
                    "content": {"inline": {"data": f"line {i}\n" * 3}},
                }
                for i in range(files)
            ],
            "units": [
                {
                    "name": f"pool-{i}.service",
                    "enable": True,
                    "content": f"[Service]\nExecStart=/bin/pool {i}\n",
                    "dropIns": [{"name": "10-a.conf", "content": "[Service]\n"}],
                    "filePaths": [f"/etc/pool/{i}.conf"],
                }
                for i in range(units)
            ],
        },
    }
    return yaml.safe_dump(doc, width=width).encode()


def parsed(raw: bytes) -> tuple[str, ...]:
    try:
        return ("osc", repr(decode.parse_osc(raw)))
    except Exception as exc:  # what each way raises is the point of the comparison
        return ("error", type(exc).__name__, str(exc))


def fresh(raw: bytes) -> tuple[str, ...]:
    """``raw`` read whole, with no document remembered."""
    kept = decode._SNAPSHOTS
    decode._SNAPSHOTS = ()
    try:
        return parsed(raw)
    finally:
        decode._SNAPSHOTS = kept


EDITS = [
    "",
    "a",
    "0",
    " ",
    "  ",
    "\n",
    "\n  ",
    "\n    ",
    "\n  - ",
    "\n- ",
    "- ",
    ": ",
    ":",
    "'",
    '"',
    "[",
    "]",
    "{",
    "}",
    ", ",
    "# c",
    " #",
    "&x ",
    "*x",
    "!!str ",
    "|\n",
    ">-\n",
    "\t",
    "? ",
    "---\n",
    "...\n",
    "path: /x\n",
    "permissions: 0o600",
    "é",
]


@settings(max_examples=400, deadline=None)
@given(
    width=st.sampled_from([40, 80, 1000]),
    where=st.floats(0.25, 0.95),
    cut=st.integers(0, 12),
    edits=st.lists(st.sampled_from(EDITS), max_size=3),
    second=st.booleans(),
)
def test_an_edited_document_reads_as_when_read_whole(
    width: int, where: float, cut: int, edits: list[str], second: bool
) -> None:
    """Whatever one edit does to the text (inside an item, across items, outside them), the
    document reads as it does with nothing remembered: the same OSC or the same error."""
    decode._SNAPSHOTS = ()
    raw = pool_osc(6, 3, width)
    decode.parse_osc(raw)
    at = int(len(raw) * where)
    edited = raw[:at] + "".join(edits).encode() + raw[at + cut :]
    assert parsed(edited) == fresh(edited), edited
    if second:  # and again from the edited one, when that was read
        again = edited[:at] + raw[at : at + cut] + edited[at + len("".join(edits).encode()) + cut :]
        assert parsed(again) == fresh(again)
    decode._SNAPSHOTS = ()


def test_a_one_file_change_reads_only_that_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """A changed file's content, mode, or path; a changed unit: the rest is not read again
    (the item objects are those of the OSC before)."""
    monkeypatch.setattr(decode, "_SNAPSHOTS", ())
    raw = pool_osc(50, 10)
    before = decode.parse_osc(raw)
    changes = [
        (b"line 7\n", b"line 7 changed\n"),
        (b"/etc/pool/8.conf", b"/etc/pool/eight.conf"),
        (b"ExecStart=/bin/pool 3", b"ExecStart=/bin/pool three"),
    ]

    chain = [raw]
    for old, new in changes:
        chain.append(chain[-1].replace(old, new, 1))
        assert chain[-1] != chain[-2]
    expected = [fresh(edited) for edited in chain[1:]]

    def whole(raw: bytes, items: Any) -> Any:
        raise AssertionError("the whole document was read")

    monkeypatch.setattr(decode, "_load", whole)
    for edited, want in zip(chain[1:], expected, strict=True):
        osc = decode.parse_osc(edited)
        assert ("osc", repr(osc)) == want
        files = [a is b for a, b in zip(before.spec.files, osc.spec.files, strict=True)]
        units = [a is b for a, b in zip(before.spec.units, osc.spec.units, strict=True)]
        assert sorted([files.count(False), units.count(False)]) == [0, 1]
        before = osc


def _pool_doc(files: int, units: int) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(pool_osc(files, units))
    return loaded


_VALUES = st.one_of(
    st.text(st.characters(codec="ascii"), max_size=30),
    st.integers(-5, 0o10000),
    st.booleans(),
    st.none(),
    st.lists(st.text("ab/\n", max_size=5), max_size=2),
)


@settings(max_examples=200, deadline=None)
@given(
    edits=st.lists(
        st.tuples(
            st.sampled_from(["files", "units"]),
            st.integers(0, 7),
            st.sampled_from(["path", "permissions", "name", "content", "enable", "filePaths"]),
            _VALUES,
        ),
        min_size=1,
        max_size=6,
    ),
    flow=st.booleans(),
)
def test_a_sequence_of_item_edits_reads_as_when_read_whole(
    edits: list[tuple[str, int, str, Any]], flow: bool
) -> None:
    """Updates as Gardener makes them (one field of one item changed, the document dumped
    again), one after the other: each reads as it does with nothing remembered, the same OSC
    (equal, and equal when dumped) or the same error; and most take the short way."""
    decode._SNAPSHOTS = ()
    doc = _pool_doc(8, 4)
    decode.parse_osc(yaml.safe_dump(doc).encode())
    for section, index, key, value in edits:
        items = doc["spec"][section]
        items[index % len(items)][key] = value
        raw = yaml.safe_dump(doc, default_flow_style=None if flow else False).encode()
        assert parsed(raw) == fresh(raw), raw
        try:
            osc = decode.parse_osc(raw)
        except Exception:
            continue
        kept = decode._SNAPSHOTS
        decode._SNAPSHOTS = ()
        try:
            whole = decode.parse_osc(raw)
        finally:
            decode._SNAPSHOTS = kept
        assert osc == whole
        assert osc.to_dict() == whole.to_dict()
    decode._SNAPSHOTS = ()


def test_a_one_field_edit_of_an_inner_item_takes_the_short_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The differential tests above would pass if the short way were never taken: here it must
    be, for the edit the bench and Gardener make (one file's content)."""
    monkeypatch.setattr(decode, "_SNAPSHOTS", ())
    doc = _pool_doc(20, 5)
    decode.parse_osc(yaml.safe_dump(doc).encode())
    short: list[bool] = []
    real = decode._reparse

    def counted(snapshot: Any, raw: bytes) -> Any:
        osc = real(snapshot, raw)
        short.append(osc is not None)
        return osc

    monkeypatch.setattr(decode, "_reparse", counted)
    for i in range(0, 19, 3):
        doc["spec"]["files"][i]["content"]["inline"]["data"] = f"changed {i}\n"
        decode.parse_osc(yaml.safe_dump(doc).encode())
        assert short == [True], i
        short.clear()
