"""YAML read the way Gardener's Go programs read it (sigs.k8s.io/yaml over go-yaml v2).

PyYAML follows YAML 1.1 too, but resolves plain scalars differently: ``1e38`` and ``y`` stay
strings and ``1:30`` and ``2001-12-14`` become numbers and dates, where Go reads a float, a
bool and two strings. Upstream then converts the document to JSON, so mapping keys become
strings and a NaN or an infinity anywhere makes the file unreadable. :func:`load_go_yaml`
gives the JSON-shaped value upstream's typed decoder sees, so a field is accepted or refused
for the same reason.
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable
from typing import Any

import yaml

_PLAIN = "tag:yaml.org,2002:go-plain"
#: go-yaml v2's exact plain words
_WORDS: dict[str, Any] = {
    **dict.fromkeys(("y", "Y", "yes", "Yes", "YES", "true", "True", "TRUE"), True),
    **dict.fromkeys(("on", "On", "ON"), True),
    **dict.fromkeys(("n", "N", "no", "No", "NO", "false", "False", "FALSE"), False),
    **dict.fromkeys(("off", "Off", "OFF"), False),
    **dict.fromkeys(("", "~", "null", "Null", "NULL"), None),
    **dict.fromkeys((".nan", ".NaN", ".NAN"), math.nan),
    **dict.fromkeys((".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF"), math.inf),
    **dict.fromkeys(("-.inf", "-.Inf", "-.INF"), -math.inf),
}
#: what Go's ParseFloat reads after a dot (underscores only between digits, as in Go source)
_DOT_FLOAT = re.compile(r"\.[0-9]+(?:_[0-9]+)*(?:[eE][-+]?[0-9]+(?:_[0-9]+)*)?")
_YAML_STYLE_FLOAT = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?")
_GO_INT = re.compile(
    r"(?P<sign>[-+]?)(?:0[xX](?P<hex>[0-9a-fA-F]+)|0[bB](?P<bin>[01]+)|0[oO](?P<oct>[0-7]+)"
    r"|(?P<zero>0[0-7]*)|(?P<dec>[1-9][0-9]*))"
)
_INT64 = 1 << 63


def _go_int(plain: str) -> int | None:
    """strconv.ParseInt(plain, 0, 64), falling back to ParseUint as go-yaml does."""
    match = _GO_INT.fullmatch(plain)
    if match is None:
        return None
    groups = match.groupdict()
    if groups["hex"]:
        value = int(groups["hex"], 16)
    elif groups["bin"]:
        value = int(groups["bin"], 2)
    elif groups["oct"]:
        value = int(groups["oct"], 8)
    elif groups["zero"]:
        value = int(groups["zero"], 8)
    else:
        value = int(groups["dec"])
    if groups["sign"] == "-":
        return -value if value <= _INT64 else None
    if value < _INT64:
        return value
    # ParseUint takes no sign at all
    return value if not groups["sign"] and value < (1 << 64) else None


def _finite(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None  # Go's ParseFloat fails out of range


def resolve_plain(text: str) -> Any:
    """The value go-yaml v2 gives a plain (unquoted, untagged) scalar."""
    if text in _WORDS:
        return _WORDS[text]
    first = text[0]
    if first == ".":
        value = _finite(text.replace("_", "")) if _DOT_FLOAT.fullmatch(text) else None
        return text if value is None else value
    if first in "+-0123456789":
        plain = text.replace("_", "")
        number = _go_int(plain)
        if number is not None:
            return number
        if _YAML_STYLE_FLOAT.fullmatch(plain):
            value = _finite(plain)
            if value is not None:
                return value
    return text  # timestamps too: go-yaml v2 hands them on as the string they were


class GoYAMLLoader(yaml.SafeLoader):
    """SafeLoader whose plain scalars resolve as in go-yaml v2."""

    def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
        if kind is yaml.ScalarNode and implicit[0] and value != "<<":
            return _PLAIN
        return super().resolve(kind, value, implicit)  # type: ignore[no-untyped-call]

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        """Keys as JSON strings from the start: Go keeps ``1`` and ``true`` apart, a Python
        dict would merge them."""
        self.flatten_mapping(node)
        mapping: dict[Hashable, Any] = {}
        for key_node, value_node in node.value:
            key = _key(self.construct_object(key_node, deep=deep))
            mapping[key] = self.construct_object(value_node, deep=deep)
        return mapping


def _construct_plain(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    return resolve_plain(str(node.value))


GoYAMLLoader.add_constructor(_PLAIN, _construct_plain)


def _key(key: Any) -> str:
    """A mapping key as sigs.k8s.io/yaml spells it in JSON."""
    if isinstance(key, bool):
        return "true" if key else "false"
    if isinstance(key, str):
        return key
    if isinstance(key, int):
        return str(key)
    if isinstance(key, float):
        if math.isnan(key):
            return ".nan"
        if math.isinf(key):
            return ".inf" if key > 0 else "-.inf"
        return f"{key:g}"
    raise ValueError(f"a mapping key of type {type(key).__name__} has no JSON spelling")


def _json_shaped(value: Any) -> Any:
    if isinstance(value, dict):
        return {_key(k): _json_shaped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_shaped(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value} has no JSON spelling")
    if value is None or isinstance(value, str | int | float | bool):
        return value
    # !!binary, !!timestamp and the like, named explicitly: go-yaml keeps them as strings
    return str(value)


def load_go_yaml(raw: bytes | str) -> Any:
    """The first document of ``raw`` as upstream's decoder sees it (JSON-shaped).

    Raises ``yaml.YAMLError`` for malformed YAML and ``ValueError`` for what JSON cannot
    carry (a NaN or infinity, a null or collection as a key)."""
    loader = GoYAMLLoader(raw)
    try:
        document = loader.get_node() if loader.check_node() else None
        value = loader.construct_document(document) if document is not None else None
    finally:
        loader.dispose()
    return _json_shaped(value)
