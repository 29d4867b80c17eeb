"""Plain YAML scalars as upstream gardener-node-agent's OSC decoder reads them.

One table for two tests: tests/unit/test_osc_decode_scalars.py holds node-agent's one reader of
plain scalars (``node_agent.base.goyaml.resolve_plain``, used by the OSC and the config decode)
and both ways of the OSC decode to it, and tests/integration/test_goyaml_oracle.py checks each
row against upstream's decoder itself (tests/testbed/standin/goyaml-oracle: sigs.k8s.io/yaml
v1.6.0 on go.yaml.in/yaml/v2 v2.4.4, sigs.k8s.io/json, as Gardener v1.150.0 builds them).

Each row: the scalar (as ``v: <scalar>``), the Go type go-yaml v2 gives it, and the JSON
``YAMLToJSON`` makes of it (None: it refuses the document, "json: unsupported value").
"""

from __future__ import annotations

#: (scalar, Go type, JSON or None)
UPSTREAM: list[tuple[str, str, str | None]] = [
    ("a", "string", '"a"'),
    ("~", "<nil>", "null"),
    ("null", "<nil>", "null"),
    ("Null", "<nil>", "null"),
    ("y", "bool", "true"),
    ("n", "bool", "false"),
    ("Yes", "bool", "true"),
    ("off", "bool", "false"),
    ("True", "bool", "true"),
    ("tRue", "string", '"tRue"'),
    ("0", "int", "0"),
    ("-0", "int", "0"),
    ("420", "int", "420"),
    ("0644", "int", "420"),
    ("0o644", "int", "420"),
    ("0O17", "int", "15"),
    ("0o8", "string", '"0o8"'),
    ("08", "float64", "8"),
    ("09", "float64", "9"),
    ("0x1F", "int", "31"),
    ("0X1F", "int", "31"),
    ("0x_", "string", '"0x_"'),
    ("0b101", "int", "5"),
    ("0B101", "int", "5"),
    ("-0b101", "int", "-5"),
    ("0b_", "string", '"0b_"'),
    ("1_000", "int", "1000"),
    ("+12", "int", "12"),
    ("1:30", "string", '"1:30"'),
    ("2001-12-14", "string", '"2001-12-14"'),
    ("1.5", "float64", "1.5"),
    ("420.0", "float64", "420"),
    ("1.", "float64", "1"),
    ("-.5", "float64", "-0.5"),
    ("1e3", "float64", "1000"),
    ("1E3", "float64", "1000"),
    ("1.0e3", "float64", "1000"),
    ("1.0e+3", "float64", "1000"),
    ("1e-3", "float64", "0.001"),
    ("1e400", "string", '"1e400"'),
    (".5", "float64", "0.5"),
    (".5e3", "float64", "500"),
    ("._5", "string", '"._5"'),
    ("1e3_0", "float64", "1e+30"),
    ("9223372036854775807", "int", "9223372036854775807"),
    ("9223372036854775808", "uint64", "9223372036854775808"),
    ("18446744073709551615", "uint64", "18446744073709551615"),
    ("18446744073709551616", "float64", "18446744073709552000"),
    ("-9223372036854775809", "float64", "-9223372036854776000"),
    ("0x10000000000000000", "string", '"0x10000000000000000"'),
    (".inf", "float64", None),
    ("-.Inf", "float64", None),
    (".nan", "float64", None),
    ("=", "string", '"="'),
    ("yes please", "string", '"yes please"'),
]

#: go-yaml v2's Go types, as Python's
GO_TYPES: dict[str, type] = {
    "string": str,
    "<nil>": type(None),
    "bool": bool,
    "int": int,
    "uint64": int,
    "float64": float,
}
