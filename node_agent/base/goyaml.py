"""YAML read the way Gardener's Go programs read it (sigs.k8s.io/yaml over go-yaml v2).

PyYAML follows YAML 1.1 too, but resolves plain scalars differently: ``1e38`` and ``y`` stay
strings and ``1:30`` and ``2001-12-14`` become numbers and dates, where Go reads a float, a
bool and two strings. Upstream then converts the document to JSON, so mapping keys become
strings and a NaN or an infinity anywhere makes the file unreadable. :func:`load_go_yaml`
gives the JSON-shaped value upstream's typed decoder sees, so a field is accepted or refused
for the same reason.

Upstream's limits are kept too, and so is their reason, that a hostile file costs little:
go-yaml v2's scanner stops at 10,000 open flow collections or 10,000 indentation levels
("exceeded max depth of 10000"); its decoder stops a document whose values come mostly from
expanding aliases ("document contains excessive aliasing", the rule of ``allowedAliasRatio``:
no billion laughs); an alias inside the node it names is refused; and Go's JSON decoder refuses
more than 10,000 nested collections. PyYAML's composer and constructor recurse once per level
(a 1,000-level file ends in ``RecursionError``) and share an aliased node instead of expanding
it, so the document is built here instead, iteratively from PyYAML's event stream, in go-yaml's
order and with its counts: any depth costs no Python stack, and a document is refused exactly
when upstream refuses it.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Generator
from typing import Any

import yaml
from yaml.events import (
    AliasEvent,
    DocumentEndEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceEndEvent,
    SequenceStartEvent,
    StreamEndEvent,
)
from yaml.nodes import ScalarNode
from yaml.scanner import ScannerError

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


#: go-yaml v2's ``max_flow_level`` and ``max_indents``, and Go's JSON ``maxNestingDepth``
MAX_DEPTH = 10000
#: go-yaml v2's alias rule: ``alias_ratio_range_low`` and ``_high`` decodes
_ALIAS_RATIO_LOW = 400_000
_ALIAS_RATIO_HIGH = 4_000_000
_MERGE_TAG = "tag:yaml.org,2002:merge"


class GoYAMLError(yaml.YAMLError):
    """YAML that upstream's decoder refuses for a reason of go-yaml's own (its aliasing rule,
    an anchor inside itself, an unknown anchor, a merge of something not a mapping)."""

    def __init__(self, problem: str, line: int | None = None) -> None:
        super().__init__(problem if line is None else f"line {line}: {problem}")


def _resolve(loader: Any, kind: Any, value: Any, implicit: Any) -> Any:
    """A plain scalar gets the tag of go-yaml's rules (:func:`resolve_plain`)."""
    if kind is yaml.ScalarNode and implicit[0] and value != "<<":
        return _PLAIN
    return yaml.resolver.Resolver.resolve(loader, kind, value, implicit)  # type: ignore[no-untyped-call]


class GoYAMLLoader(yaml.SafeLoader):
    """PyYAML's own parser, with go-yaml's scalars, go-yaml's depth (:data:`MAX_DEPTH`) and a
    scanner in linear time. Only its events and scalar constructors are used (see
    :func:`load_go_yaml`)."""

    resolve = _resolve

    def __init__(self, stream: bytes | str) -> None:
        super().__init__(stream)
        # PyYAML looks at every pending simple key (one per open flow collection, up to 1,024
        # on a line) before each token: a 1 MiB line of brackets took minutes. They are saved
        # in the order of the text, so the stale ones are the oldest and the oldest has the
        # lowest token number: kept in order, both questions look at the first key only.
        self.possible_simple_keys: OrderedDict[int, Any] = OrderedDict()

    def stale_possible_simple_keys(self) -> None:
        keys = self.possible_simple_keys
        while keys:
            level, key = next(iter(keys.items()))
            if key.line == self.line and self.index - key.index <= 1024:
                return
            if key.required:
                raise ScannerError(
                    "while scanning a simple key",
                    key.mark,
                    "could not find expected ':'",
                    self.get_mark(),
                )
            del keys[level]

    def next_possible_simple_key(self) -> int | None:
        for key in self.possible_simple_keys.values():
            return int(key.token_number)
        return None

    def add_indent(self, column: int) -> bool:
        added: bool = super().add_indent(column)
        if added and len(self.indents) > MAX_DEPTH:
            raise _too_deep("while increasing indent level", self.get_mark())
        return added

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:  # PyYAML's name
        if self.flow_level >= MAX_DEPTH:
            raise _too_deep("while increasing flow level", self.get_mark())
        super().fetch_flow_collection_start(TokenClass)


#: libyaml's parser (go-yaml v2 is a port of it), about 20 times faster than PyYAML's, when
#: PyYAML was built with it; it stops at 1,000 levels, where the loader above takes over
_LIBYAML_LOADER: type[Any] | None = None
if hasattr(yaml, "CSafeLoader"):

    class _LibYAMLLoader(yaml.CSafeLoader):
        resolve = _resolve

    _LIBYAML_LOADER = _LibYAMLLoader


def _too_deep(context: str, mark: yaml.Mark) -> ScannerError:
    return ScannerError(context, mark, f"exceeded max depth of {MAX_DEPTH}", mark)


def _construct_plain(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    return resolve_plain(str(node.value))


for _loader in (GoYAMLLoader, _LIBYAML_LOADER):
    if _loader is not None:
        _loader.add_constructor(_PLAIN, _construct_plain)


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


def _json_leaf(value: Any) -> Any:
    """A scalar as JSON carries it (collections are built JSON-shaped already)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value} has no JSON spelling")
    if value is None or isinstance(value, str | int | float | bool | dict | list):
        return value
    # !!binary, !!timestamp and the like, named explicitly: go-yaml keeps them as strings
    return str(value)


# --- the document, as go-yaml v2's parser and decoder build it ------------------------------
# Nodes keep a line number, not PyYAML's marks: a 1 MiB file has half a million of them.


class _Scalar:
    __slots__ = ("line", "style", "tag", "value")

    def __init__(self, tag: str, value: str, style: str | None, line: int) -> None:
        self.tag, self.value, self.style, self.line = tag, value, style, line


class _Mapping:
    __slots__ = ("items", "line")

    def __init__(self, line: int) -> None:
        self.items: list[tuple[_Node, _Node]] = []
        self.line = line


class _Sequence:
    __slots__ = ("items", "line")

    def __init__(self, line: int) -> None:
        self.items: list[_Node] = []
        self.line = line


class _Alias:
    __slots__ = ("line", "name", "target")

    def __init__(self, name: str, target: _Node, line: int) -> None:
        self.name, self.target, self.line = name, target, line


_Node = _Scalar | _Mapping | _Sequence | _Alias
_NO_KEY: Any = object()


def _shown(text: str) -> str:
    """A name or value from the file, short enough for a one-line message."""
    return repr(text) if len(text) <= 40 else repr(text[:37]) + "..."


def _compose(loader: Any) -> _Node | None:
    """The first document's node graph, from the event stream without recursion.

    As go-yaml v2's parser: an anchor names its node from the node's start (so an alias inside
    it points at it, which the decoder refuses), a later anchor of the same name replaces the
    earlier one, and tags of mappings and sequences play no part."""
    loader.get_event()  # the stream's start
    if loader.check_event(StreamEndEvent):
        return None  # an empty file: upstream decodes null
    loader.get_event()  # the document's start
    anchors: dict[str, _Node] = {}
    open_: list[_Mapping | _Sequence] = []
    keys: list[Any] = []  # per open collection: a mapping's key awaiting its value
    root: _Node | None = None
    while True:
        event = loader.get_event()
        kind = type(event)
        node: _Node
        if kind is ScalarEvent:
            tag = event.tag
            if tag is None or tag == "!":
                tag = loader.resolve(ScalarNode, event.value, event.implicit)
            node = _Scalar(tag, event.value, event.style, event.start_mark.line + 1)
            if event.anchor is not None:
                anchors[event.anchor] = node
        elif kind is MappingStartEvent or kind is SequenceStartEvent:
            line = event.start_mark.line + 1
            opened = _Mapping(line) if kind is MappingStartEvent else _Sequence(line)
            if event.anchor is not None:
                anchors[event.anchor] = opened
            open_.append(opened)
            keys.append(_NO_KEY)
            continue
        elif kind is MappingEndEvent or kind is SequenceEndEvent:
            node = open_.pop()
            keys.pop()
        elif kind is AliasEvent:
            name = event.anchor or ""
            target = anchors.get(name)
            if target is None:
                raise GoYAMLError(
                    f"unknown anchor {_shown(name)} referenced", event.start_mark.line + 1
                )
            node = _Alias(name, target, event.start_mark.line + 1)
        elif kind is DocumentEndEvent:
            return root
        else:  # pragma: no cover - the parser emits nothing else inside a document
            raise GoYAMLError(f"unexpected {kind.__name__}")
        if not open_:
            root = node
            continue
        parent = open_[-1]
        if isinstance(parent, _Sequence):
            parent.items.append(node)
        elif keys[-1] is _NO_KEY:
            keys[-1] = node
        else:
            parent.items.append((keys[-1], node))
            keys[-1] = _NO_KEY


def _allowed_alias_ratio(decodes: int) -> float:
    """go-yaml v2's ``allowedAliasRatio``: 99 % of a small document may come from aliases,
    falling to 10 % from 400,000 to 4,000,000 decoded values."""
    if decodes <= _ALIAS_RATIO_LOW:
        return 0.99
    if decodes >= _ALIAS_RATIO_HIGH:
        return 0.10
    span = float(_ALIAS_RATIO_HIGH - _ALIAS_RATIO_LOW)
    return 0.99 - 0.89 * (float(decodes - _ALIAS_RATIO_LOW) / span)


#: what the decoder asks its driver for: decode this node (into this mapping, for a merge)
_Request = tuple[_Node, dict[str, Any] | None]
_Decoding = Generator[_Request, Any, Any]


class _Decoder:
    """go-yaml v2's ``decoder.unmarshal`` into ``interface{}``, then the JSON conversion: the
    same nodes visited in the same order, counted the same way, aliases expanded.

    Written as generators driven from one explicit stack (:meth:`run`), so nesting costs no
    Python stack; a scalar is decoded in place, without a generator of its own. Scalars get
    the rules above (:func:`resolve_plain`) or, explicitly tagged, PyYAML's constructors."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.decodes = 0  # go-yaml's decodeCount
        self.alias_decodes = 0  # its aliasCount
        self.alias_depth = 0
        self.expanding: set[int] = set()  # alias nodes being expanded (by id)
        self.depth = 0  # open collections of the JSON value

    def run(self, root: _Node) -> Any:
        self._count()  # the document node
        stack: list[_Decoding] = [self._unmarshal(root, None)]
        sent: Any = None
        while stack:
            try:
                request = stack[-1].send(sent)
            except StopIteration as done:
                stack.pop()
                sent = done.value
                continue
            stack.append(self._unmarshal(*request))
            sent = None
        return _json_leaf(sent)

    def _count(self) -> None:
        self.decodes += 1
        if self.alias_depth:
            self.alias_decodes += 1
        if (
            self.alias_decodes > 100
            and self.decodes > 1000
            and self.alias_decodes / self.decodes > _allowed_alias_ratio(self.decodes)
        ):
            raise GoYAMLError("document contains excessive aliasing")

    def _unmarshal(self, node: _Node, into: dict[str, Any] | None) -> _Decoding:
        self._count()
        if type(node) is _Scalar:
            return self._scalar(node)
        if type(node) is _Alias:
            if id(node) in self.expanding:
                raise GoYAMLError(f"anchor {_shown(node.name)} value contains itself", node.line)
            self.expanding.add(id(node))
            self.alias_depth += 1
            value = yield node.target, into
            self.alias_depth -= 1
            self.expanding.discard(id(node))
            return value
        if into is None:
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise ValueError(
                    f"line {node.line}: exceeded max depth of {MAX_DEPTH} "
                    "(nested collections of the JSON upstream decodes)"
                )
        if type(node) is _Sequence:
            items: list[Any] = []
            for item in node.items:
                if type(item) is _Scalar:
                    self._count()
                    items.append(_json_leaf(self._scalar(item)))
                else:
                    items.append(_json_leaf((yield item, None)))
            value = items
        else:
            assert type(node) is _Mapping
            mapping: dict[str, Any] = {} if into is None else into
            for key_node, value_node in node.items:
                if type(key_node) is _Scalar and _is_merge(key_node):
                    yield from self._merge(value_node, mapping)
                    continue
                if type(key_node) is _Scalar:
                    self._count()
                    key = self._scalar(key_node)
                else:
                    key = yield key_node, None
                    if isinstance(key, dict | list):
                        raise ValueError(f"line {key_node.line}: invalid map key (a collection)")
                if type(value_node) is _Scalar:
                    self._count()
                    mapping[_key(key)] = _json_leaf(self._scalar(value_node))
                else:
                    mapping[_key(key)] = _json_leaf((yield value_node, None))
            value = mapping
        if into is None:
            self.depth -= 1
        return value

    def _merge(self, node: _Node, into: dict[str, Any]) -> _Decoding:
        """A merge key's value into ``into``: a mapping, or a sequence of them (the first one
        wins), each maybe an alias; keys of the mapping that come later win over merged ones."""
        for item in reversed(node.items) if type(node) is _Sequence else (node,):
            target = item.target if type(item) is _Alias else item
            if type(target) is not _Mapping:
                raise GoYAMLError(
                    "map merge requires map or sequence of maps as the value", item.line
                )
            yield item, into

    def _scalar(self, node: _Scalar) -> Any:
        """The scalar's value. An explicit tag the value does not fit (``!!bool maybe``,
        ``!!timestamp x``) is a YAML error, as in go-yaml, never the constructor's own
        ``KeyError`` or ``AttributeError``."""
        if node.tag == _PLAIN:
            return resolve_plain(node.value)
        try:
            return self.loader.construct_object(
                ScalarNode(node.tag, node.value, style=node.style), deep=True
            )
        except yaml.YAMLError as exc:
            raise GoYAMLError(describe_yaml_error(exc), node.line) from exc
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError) as exc:
            raise GoYAMLError(
                f"cannot decode {_shown(node.value)} as {node.tag}", node.line
            ) from exc


def _is_merge(node: _Scalar) -> bool:
    return node.value == "<<" and node.tag == _MERGE_TAG


def load_go_yaml(raw: bytes | str) -> Any:
    """The first document of ``raw`` as upstream's decoder sees it (JSON-shaped).

    Raises ``yaml.YAMLError`` for malformed YAML and for what go-yaml refuses (its depth,
    aliasing and anchor rules), and ``ValueError`` for what JSON cannot carry (a NaN or
    infinity, a null or collection as a key, more than :data:`MAX_DEPTH` nested collections).
    Neither the stack nor the work grows faster than the file allows upstream."""
    if _LIBYAML_LOADER is not None:
        try:
            return _load(_LIBYAML_LOADER, raw)
        except yaml.MarkedYAMLError as exc:
            if "maximum nesting depth" not in (exc.problem or ""):
                raise
    return _load(GoYAMLLoader, raw)


def _load(loader_class: type[Any], raw: bytes | str) -> Any:
    loader = loader_class(raw)
    try:
        root = _compose(loader)
        return None if root is None else _Decoder(loader).run(root)
    finally:
        loader.dispose()


def describe_yaml_error(exc: yaml.YAMLError) -> str:
    """A YAML error on one line: where and what, without PyYAML's snippet of the file."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = "; ".join(part for part in (exc.context, exc.problem) if part)
        return " ".join(f"{where}{what}".split())
    return " ".join(str(exc).split())
