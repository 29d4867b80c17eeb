"""The plain scalars of an osc.yaml read as upstream reads them, by one reader: go-yaml v2's
(``node_agent.base.goyaml.resolve_plain``), on both ways of ``decode.load_yaml``.

Upstream's agent decodes the OSC with apimachinery's JSON serializer in YAML mode, not strict:
``sigs.k8s.io/yaml.YAMLToJSON`` without a target, then a case-sensitive JSON decode into the
typed struct. A plain scalar's type is therefore go-yaml v2's, fixed before the struct is looked
at: ``1e3`` is the number 1000 everywhere, and in a string field it is refused ("cannot unmarshal
number into Go struct field ... of type string"). Only ``sigs.k8s.io/yaml.Unmarshal`` with a
target turns a number into its text for a string field; upstream does not decode the OSC that
way. The table (tests/testbed/scalar_cases.py) is upstream's reading, checked against upstream's
decoder by tests/integration/test_goyaml_oracle.py.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from node_agent.base.errors import OSCValidationError
from node_agent.base.goyaml import resolve_plain
from node_agent.osc import decode, decode_osc
from tests.testbed.scalar_cases import GO_TYPES, UPSTREAM
from tests.unit.test_osc_decode import sha

IDS = [text for text, _, _ in UPSTREAM]


def same_value(a: Any, b: Any) -> bool:
    """Equal in type and value (a NaN equals a NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


@pytest.mark.parametrize(("text", "go_type", "as_json"), UPSTREAM, ids=IDS)
def test_the_one_reader_is_go_yamls(text: str, go_type: str, as_json: str | None) -> None:
    value = resolve_plain(text)
    assert type(value) is GO_TYPES[go_type]
    if as_json is None:
        assert isinstance(value, float)
        assert not math.isfinite(value)  # no JSON for it: upstream refuses the document
    elif isinstance(value, float):
        assert value == float(json.loads(as_json))
    else:
        assert value == json.loads(as_json)


@pytest.mark.parametrize(("text", "go_type", "as_json"), UPSTREAM, ids=IDS)
def test_both_ways_of_the_osc_decode_read_a_scalar_as_go_yaml_does(
    text: str, go_type: str, as_json: str | None, loader: str
) -> None:
    """The one-pass build and the general way (an anchor elsewhere sends a document there)
    resolve a plain scalar, as a value and as a key, with that one reader."""
    expected = resolve_plain(text)
    one_pass = decode.load_yaml(f"v: {text}\nk: {{{text}: 1}}\n".encode())
    general = decode.load_yaml(f"v: {text}\nk: {{{text}: 1}}\na: &x 1\n".encode())
    for doc in (one_pass, general, decode.load_yaml_general(f"v: {text}\n".encode())):
        assert same_value(doc["v"], expected), (doc["v"], expected)
    for doc in (one_pass, general):
        (key,) = doc["k"]
        assert same_value(key, expected), (key, expected)


UNIT_HEAD = (
    "apiVersion: extensions.gardener.cloud/v1alpha1\nkind: OperatingSystemConfig\n"
    "metadata: {name: osc, namespace: kube-system}\n"
    "spec:\n  type: test\n  units:\n  - name: motd.service\n"
)


@pytest.mark.parametrize(
    ("text", "got"),
    [("1e3", "the float 1000.0"), ("-.5", "the float -0.5"), ("0X1F", "the integer 31")],
)
def test_a_number_in_a_string_field_is_refused_as_upstream_refuses_it(
    text: str, got: str, loader: str
) -> None:
    """Upstream: "json: cannot unmarshal number into Go struct field ... of type string"."""
    raw = f"{UNIT_HEAD}    content: {text}\n".encode()
    with pytest.raises(OSCValidationError) as refused:
        decode_osc(raw, sha(raw))
    assert str(refused.value) == (
        f"spec.units[0].content (motd.service): Input should be a valid string, got {got}"
    )


def test_a_string_field_keeps_what_upstream_reads_as_a_string(loader: str) -> None:
    for text in ("1e400", "0x_", "1:30", "=", "0o8"):
        raw = f"{UNIT_HEAD}    content: {text}\n".encode()
        assert decode_osc(raw, sha(raw)).spec.units[0].content == text
