"""Upstream's OSC decoder itself decides how a plain YAML scalar reads: every row of
tests/testbed/scalar_cases.py, and a few thousand scalars made of the characters numbers are
written with, are given to it (tests/testbed/standin/goyaml-oracle, built from the libraries and
versions Gardener v1.150.0's agent decodes the OSC with), and node-agent's one reader of plain
scalars (``node_agent.base.goyaml.resolve_plain``, behind the OSC and the config decode) must
give each the same type and value. tests/unit/test_osc_decode_scalars.py holds both ways of the
OSC decode to that reader.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
from typing import Any

import pytest
import yaml

from node_agent.base.goyaml import resolve_plain
from tests.testbed.scalar_cases import GO_TYPES, UPSTREAM
from tests.testbed.standin import build

pytestmark = pytest.mark.integration

#: what scalars that look like numbers are made of
ALPHABET = "0123456789_.eE+-xXoObB"


def upstream(texts: list[str]) -> dict[str, dict[str, Any]]:
    """Upstream's reading of ``v: <text>`` for each text."""
    result = subprocess.run(
        [str(build("goyaml-oracle"))],
        input="".join(json.dumps(text) + "\n" for text in texts),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    return {row["text"]: row for row in rows}


def plain(text: str) -> bool:
    """``v: <text>`` holds ``text`` as one plain scalar (as PyYAML and go-yaml both parse it)."""
    try:
        events = list(yaml.parse(f"v: {text}\n"))
    except yaml.YAMLError:
        return False
    scalars = [e for e in events if isinstance(e, yaml.ScalarEvent)]
    return len(scalars) == 2 and scalars[1].value == text and scalars[1].style is None


def agrees(text: str, row: dict[str, Any]) -> bool:
    ours = resolve_plain(text)
    if type(ours) is not GO_TYPES[row["go_type"]]:
        return False
    if "json" not in row:  # YAMLToJSON refused it: only a NaN or an infinity has no JSON
        return isinstance(ours, float) and not math.isfinite(ours)
    theirs = json.loads(row["json"])["v"]
    return float(theirs) == ours if isinstance(ours, float) else bool(theirs == ours)


def test_the_table_is_upstreams_reading() -> None:
    read = upstream([text for text, _, _ in UPSTREAM])
    for text, go_type, as_json in UPSTREAM:
        row = read[text]
        assert (row["go_type"], row.get("json")) == (
            go_type,
            None if as_json is None else f'{{"v":{as_json}}}',
        ), row
        if as_json is not None and go_type in ("int", "uint64", "float64"):
            # a number is refused by a string field: never kept as its literal text
            assert row["string_field"].startswith("error: json: cannot unmarshal number"), row


def test_node_agents_reader_agrees_with_upstream_on_number_like_scalars() -> None:
    rng = random.Random(33)
    texts = {text for text, _, _ in UPSTREAM}
    while len(texts) < 4000:
        candidate = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 8)))
        if plain(candidate):
            texts.add(candidate)
    read = upstream(sorted(texts))
    disagree = [text for text in sorted(texts) if not agrees(text, read[text])]
    assert disagree == []
