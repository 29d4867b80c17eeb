"""Turn the bytes of a Secret's ``osc.yaml`` into a validated OperatingSystemConfig.

Upstream trusts both the checksum annotation and the content, and finds bad input only halfway
through applying it, leaving a half-written node. Here everything is checked before anything is
planned: the checksum, the size, the shape of the YAML, the type, and every path, unit name, drop-in
name, encoding and mode. Each failure is a typed error (see ``node_agent.base.errors``) naming the
offending item, in one line.

The YAML is read the way upstream's decoder reads it (``sigs.k8s.io/yaml.YAMLToJSON`` on go-yaml
v2, without a target, then a typed JSON decode): every plain scalar is resolved by go-yaml v2's
rules, by the one reader of them (``node_agent.base.goyaml.resolve_plain``, on both ways of
``load_yaml``): ``y``/``n`` are booleans, ``0o644`` is an octal integer, ``1e3`` and ``08`` are
floats, base-60 numbers and bare timestamps are plain strings, and a field of the wrong type is an
error, never coerced (a number in a string field is refused, as upstream refuses it).
Stricter than upstream, on purpose: a mapping key given twice is refused (upstream keeps one of
them silently), and so is an integral float such as ``420.0`` for ``permissions``.

Limits that keep hostile or broken input from crashing or exhausting the agent, all far above
any real OSC (a Gardener OSC with registry mirrors nests 9 levels deep; its paths have at most
5 components):

- ``MAX_NESTING_DEPTH`` levels of collections. libyaml parses iteratively, but the composer that
  builds the document recurses in C without a limit: a 60 KB ``[[[[...]]]]`` overflows the stack
  (SIGSEGV). The document is therefore built from the event stream, iteratively, with the limits
  checked as it goes (see ``load_yaml``). Aliases count with the depth of what they point to.
- ``MAX_NODES`` values after expanding aliases (no "billion laughs"); a cyclic alias is refused.
- ``MAX_NAME_BYTES`` per path component, ``MAX_PATH_BYTES`` per path and
  ``MAX_PATH_COMPONENTS`` components: what Linux can hold, and a walk the host layer can afford.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import functools
import hmac
import posixpath
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import yaml
from pydantic import ValidationError
from yaml.events import (
    AliasEvent,
    DocumentEndEvent,
    DocumentStartEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceEndEvent,
    SequenceStartEvent,
    StreamEndEvent,
)
from yaml.nodes import MappingNode, Node, ScalarNode

from node_agent.base import layout
from node_agent.base.by_change import common_prefix, common_suffix
from node_agent.base.digest import sha256_hex
from node_agent.base.errors import OSCChecksumError, OSCDecodeError, OSCValidationError
from node_agent.base.goyaml import resolve_plain
from node_agent.base.log import get_logger
from node_agent.osc.memo import ITEM_MEMO_BYTES, Memo, item_weight
from node_agent.osc.models import (
    API_VERSION,
    KIND,
    File,
    InlineContent,
    OperatingSystemConfig,
    Unit,
)

_log = get_logger("node-agent.osc")

MAX_OSC_BYTES = 1024 * 1024
MAX_PERMISSIONS = 0o7777
MAX_NESTING_DEPTH = 64
MAX_NODES = MAX_OSC_BYTES
MAX_NAME_BYTES = 255  # NAME_MAX
MAX_PATH_BYTES = 4095  # PATH_MAX less the terminating NUL
MAX_PATH_COMPONENTS = 64
UNIT_SUFFIXES = layout.UNIT_TYPES  # what a unit name may end in
# systemd accepts letters, digits and ":-_.\" in a unit name, plus one "@" for templates.
_UNIT_CHARS = r"[A-Za-z0-9:_.\\-]"
_UNIT_NAME = re.compile(rf"{_UNIT_CHARS}+(@{_UNIT_CHARS}*)?\.({'|'.join(UNIT_SUFFIXES)})")
_UNIT_NAME_MAX = 255
_ENCODINGS = ("", "b64")
_UNIT_DIR_SLASH = f"{layout.UNIT_DIR}/"

_TAG = "tag:yaml.org,2002:"
_MERGE_TAG = f"{_TAG}merge"
#: every plain scalar but a merge key: resolved by go-yaml v2's rules (``resolve_plain``)
_GO_PLAIN_TAG = "tag:node-agent,2026:go-plain"


def _loader_class(base: type[Any]) -> type[Any]:
    """``base`` (a safe loader) with upstream's scalar types and no duplicate mapping keys."""

    class Loader(base):  # type: ignore[misc]
        #: an explicit ``!!bool`` takes go-yaml's words too
        bool_values: ClassVar[dict[str, bool]] = {
            **yaml.constructor.SafeConstructor.bool_values,
            "y": True,
            "n": False,
        }

        def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
            if kind is ScalarNode and implicit[0] and value != "<<":
                return _GO_PLAIN_TAG
            return super().resolve(kind, value, implicit)

        def construct_mapping(self, node: Node, deep: bool = False) -> dict[Any, Any]:
            if isinstance(node, MappingNode):
                _refuse_duplicate_keys(self, node)
            mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
            return mapping

    Loader.add_constructor(_GO_PLAIN_TAG, lambda _, node: resolve_plain(str(node.value)))
    return Loader


# libyaml's loader when PyYAML was built with it (about 10x faster), else the pure-Python one.
PYTHON_LOADER = _loader_class(yaml.SafeLoader)
LIBYAML_LOADER = _loader_class(yaml.CSafeLoader) if hasattr(yaml, "CSafeLoader") else None
OSCLoader = LIBYAML_LOADER or PYTHON_LOADER


def _refuse_duplicate_keys(loader: yaml.SafeLoader, node: MappingNode) -> None:
    """Upstream's lenient decoder keeps one of two equal keys silently; here that is an error."""
    seen: dict[tuple[type, Any], yaml.Mark] = {}
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:
            continue  # "<<" merges: explicit keys are meant to override merged ones
        key = loader.construct_object(key_node, deep=True)
        ident = (type(key), key)
        try:
            first = seen.get(ident)
        except TypeError:
            continue  # an unhashable key: the constructor itself reports it
        again = key_node.start_mark
        if first is None:
            seen[ident] = again
        else:
            if first.line == again.line:
                where = f"line {first.line + 1}, columns {first.column + 1} and {again.column + 1}"
            else:
                where = f"lines {first.line + 1} and {again.line + 1}"
            raise OSCDecodeError(f"osc.yaml has the mapping key {_quote(key)} twice ({where})")


class _Unusual(Exception):
    """The document uses YAML that ``_load_plain`` leaves to PyYAML's composer and constructor."""


_MISSING = object()
_NO_KEY = object()


def load_yaml(raw: bytes) -> Any:
    """The one document of ``raw`` as Python objects, exactly as ``OSCLoader`` builds it, with
    the nesting and size limits of ``check_structure`` applied on the way.

    An OSC is plain YAML: mappings, sequences and untagged scalars. Such a document is built in
    one pass over libyaml's events (``_load_plain``), which is a few times cheaper than checking
    the events and then composing and constructing the document with PyYAML (its constructor is
    Python, and composing parses everything a second time). Anything else — anchors, aliases,
    tags, merge keys, a key given twice or keys equal across types, several documents, a value
    its constructor refuses — goes the general way, which decides the result and the error
    message; so does every error the general way would report differently. Raises
    ``OSCDecodeError`` for the limits, ``yaml.YAMLError`` for malformed YAML.
    """
    return _load(raw, None)[0]


def _load(raw: bytes, items: _Items | None) -> tuple[Any, int | None]:
    """``load_yaml``, and the number of values when built in one pass (else None), the item
    starts recorded in ``items`` (see ``_load_plain``)."""
    loader = OSCLoader(raw)
    try:
        return _load_plain(loader, items=items)
    except _Unusual:
        pass
    except yaml.MarkedYAMLError as exc:
        _refuse_libyaml_nesting(exc)  # as ``check_structure`` reports libyaml's own limit
        raise
    finally:
        loader.dispose()
    return load_yaml_general(raw), None


def load_yaml_general(raw: bytes) -> Any:
    """``load_yaml`` the general way: the events checked (``check_structure``), then the
    document composed and constructed by PyYAML."""
    check_structure(raw)
    loader = OSCLoader(raw)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


#: where an item of ``spec.files`` (etc.) starts: (section, key) -> (offsets in the document,
#: values counted before each)
_Items = dict[tuple[str, str], tuple[list[int], list[int]]]


def _load_plain(loader: Any, *, depth: int = 0, items: _Items | None = None) -> tuple[Any, int]:
    """Build the document from ``loader``'s events; ``_Unusual`` for anything but plain YAML.
    Returns it and its number of values.

    The limits are those of ``check_structure`` on the same events, so an error raised here
    is the one it would raise first (without aliases, nothing else can fail before it).
    ``depth``: levels above the document (a part of a larger one, see ``_reparse``);
    ``items``: filled with the start of each item of a sequence two levels below the root
    (``spec.files``, ``status.extensionUnits``, ...)."""
    get_event = loader.get_event
    get_event()  # the stream's start
    if type(get_event()) is not DocumentStartEvent:
        raise _Unusual  # an empty stream
    open_: list[Any] = []  # the collections being built, innermost last
    keys: list[Any] = []  # per open collection: a mapping's key awaiting its value, or _NO_KEY
    scalars: dict[str, Any] = {}  # plain scalar -> its value
    nodes = 0
    value: Any
    root: Any = None
    while True:
        event = get_event()
        kind = type(event)
        if kind is ScalarEvent:
            nodes += 1
            if event.anchor is not None or event.tag is not None:
                raise _Unusual
            value = event.value
            if event.implicit[0]:
                known = scalars.get(value, _MISSING)
                value = _plain_scalar(value, scalars) if known is _MISSING else known
        elif kind is MappingStartEvent or kind is SequenceStartEvent:
            depth += 1
            nodes += 1
            if depth > MAX_NESTING_DEPTH:
                raise _too_deep(event)
            if event.anchor is not None or event.tag is not None:
                raise _Unusual
            if depth == 4 and items is not None and type(open_[-1]) is list:
                where = (keys[0], keys[1])
                if type(where[0]) is str and type(where[1]) is str:
                    starts, before = items.setdefault(where, ([], []))
                    starts.append(event.start_mark.index)
                    before.append(nodes - 1)
            open_.append({} if kind is MappingStartEvent else [])
            keys.append(_NO_KEY)
            if nodes > MAX_NODES:
                raise _too_many(event)
            continue
        elif kind is MappingEndEvent or kind is SequenceEndEvent:
            depth -= 1
            keys.pop()
            value = open_.pop()
        elif kind is DocumentEndEvent:
            if type(get_event()) is not StreamEndEvent:
                raise _Unusual  # several documents
            return root, nodes
        else:
            raise _Unusual  # an alias
        if nodes > MAX_NODES:
            raise _too_many(event)
        if not open_:
            root = value
            continue
        parent = open_[-1]
        if type(parent) is list:
            parent.append(value)
            continue
        key = keys[-1]
        if key is not _NO_KEY:
            parent[key] = value
            keys[-1] = _NO_KEY
        elif type(value) is dict or type(value) is list or value in parent:
            raise _Unusual  # a collection as a key, a key twice, or keys equal across types
        else:
            keys[-1] = value


def _plain_scalar(text: str, known: dict[str, Any]) -> Any:
    """The value of a plain scalar as the loader resolves it (go-yaml v2's reading); a merge
    key is left to the general way."""
    if text == "<<":
        raise _Unusual
    value = known[text] = resolve_plain(text)
    return value


def _too_deep(event: yaml.Event) -> OSCDecodeError:
    return OSCDecodeError(
        f"osc.yaml nests collections deeper than {MAX_NESTING_DEPTH} levels (line {_line(event)})"
    )


def _too_many(event: yaml.Event) -> OSCDecodeError:
    return OSCDecodeError(
        f"osc.yaml holds more than {MAX_NODES} values once its aliases are expanded "
        f"(line {_line(event)})"
    )


def check_structure(raw: bytes) -> None:
    """Refuse YAML that would crash or exhaust the loader, before it builds anything.

    Walks libyaml's event stream (iterative, constant stack) and counts open collections and
    values; aliases count with the height and size of the node they repeat. Raises
    ``OSCDecodeError`` naming the line; malformed YAML raises ``yaml.YAMLError``.
    """
    loader = OSCLoader(raw)
    depth = nodes = 0
    anchors: dict[str, tuple[int, int]] = {}  # name -> (height, values) of the anchored node
    # Anchored collections still open: [name, depth, values before it, deepest level inside].
    open_anchors: list[list[Any]] = []
    try:
        while True:
            try:
                event = loader.get_event()
            except yaml.MarkedYAMLError as exc:
                _refuse_libyaml_nesting(exc)
                raise
            kind = type(event)
            if kind is ScalarEvent:
                nodes += 1
                if event.anchor is not None:
                    anchors[event.anchor] = (0, 1)
            elif kind is MappingStartEvent or kind is SequenceStartEvent:
                depth += 1
                nodes += 1
                if depth > MAX_NESTING_DEPTH:
                    raise _too_deep(event)
                if event.anchor is not None:
                    open_anchors.append([event.anchor, depth, nodes - 1, depth])
                elif open_anchors and depth > open_anchors[-1][3]:
                    open_anchors[-1][3] = depth
            elif kind is MappingEndEvent or kind is SequenceEndEvent:
                if open_anchors and open_anchors[-1][1] == depth:
                    name, start, before, deepest = open_anchors.pop()
                    anchors[name] = (deepest - start + 1, nodes - before)
                    if open_anchors and deepest > open_anchors[-1][3]:
                        open_anchors[-1][3] = deepest
                depth -= 1
            elif kind is AliasEvent:
                nodes += _expand_alias(event, depth, anchors, open_anchors)
            elif kind is StreamEndEvent:
                return
            if nodes > MAX_NODES:
                raise _too_many(event)
    finally:
        loader.dispose()


def _refuse_libyaml_nesting(exc: yaml.MarkedYAMLError) -> None:
    """libyaml 0.2.6 (PyYAML 6.0.4 wheels) stops at 1000 open flow collections while it scans
    ahead, before this walk sees the 65th; report that as the same nesting error, not as
    malformed YAML."""
    if "maximum nesting depth" in (exc.problem or ""):
        line = exc.problem_mark.line + 1 if exc.problem_mark is not None else 0
        raise OSCDecodeError(
            f"osc.yaml nests collections deeper than {MAX_NESTING_DEPTH} levels (line {line})"
        ) from exc


def _expand_alias(
    event: AliasEvent,
    depth: int,
    anchors: Mapping[str, tuple[int, int]],
    open_anchors: list[list[Any]],
) -> int:
    """Check an alias at ``depth`` like the node it repeats; return how many values it adds."""
    name, line = event.anchor or "", _line(event)
    if name not in anchors:
        if any(frame[0] == name for frame in open_anchors):
            raise OSCDecodeError(
                f"osc.yaml alias *{name} (line {line}) repeats a node inside itself"
            )
        raise OSCDecodeError(
            f"osc.yaml alias *{name} (line {line}) has no anchor &{name} before it"
        )
    height, size = anchors[name]
    if depth + height > MAX_NESTING_DEPTH:
        raise OSCDecodeError(
            f"osc.yaml alias *{name} (line {line}) nests collections deeper than "
            f"{MAX_NESTING_DEPTH} levels"
        )
    if open_anchors and depth + height > open_anchors[-1][3]:
        open_anchors[-1][3] = depth + height
    return size


def verify_checksum(raw: bytes, expected: str | None, digest: str | None = None) -> None:
    """Check ``raw`` against the ``checksum/data-script`` annotation value (``digest``: the
    sha256 of ``raw`` when the caller has it already)."""
    actual = digest or sha256_hex(raw)
    if not expected or not expected.strip():
        raise OSCChecksumError(
            "the OSC Secret has no checksum/data-script annotation; refusing unverified osc.yaml",
            expected=expected,
            actual=actual,
        )
    if not hmac.compare_digest(expected.strip().lower(), actual):
        raise OSCChecksumError(
            f"osc.yaml has sha256 {actual} but annotation checksum/data-script says {expected}",
            expected=expected,
            actual=actual,
        )


def decode_osc(
    raw: bytes, checksum: str | None, host_name: str | None = None, digest: str | None = None
) -> OperatingSystemConfig:
    """Verify, parse and validate the ``osc.yaml`` bytes of an OSC Secret.

    ``host_name`` selects host-specific files for the duplicate-path check; without it, files
    that could land on the same host at the same path are rejected. ``digest``: the sha256 of
    ``raw`` when the caller has it already.
    """
    _check_size(raw)
    verify_checksum(raw, checksum, digest)
    osc = parse_osc(raw)
    validate_osc(osc, host_name)
    return osc


def parse_osc(raw: bytes) -> OperatingSystemConfig:
    """Parse YAML or JSON bytes into the model, checking size, shape, types, apiVersion and kind
    only (``validate_osc`` checks the values)."""
    _check_size(raw)
    for snapshot in _SNAPSHOTS:
        if raw == snapshot.raw:
            return snapshot.osc  # frozen: one object serves every caller
    for snapshot in _SNAPSHOTS:
        osc = _reparse(snapshot, raw)
        if osc is not None:
            return osc
    if _SNAPSHOTS:
        _log.debug("osc.yaml read whole", bytes=len(raw))
    items: _Items = {}
    try:
        obj, nodes = _load(raw, items)
    except yaml.YAMLError as exc:
        raise OSCDecodeError(f"osc.yaml is not valid YAML or JSON: {_one_line(str(exc))}") from exc
    except (ValueError, OverflowError) as exc:  # e.g. an explicit !!int tag on a non-number
        raise OSCDecodeError(f"osc.yaml has a value that cannot be read: {exc}") from exc
    if not isinstance(obj, dict):
        raise OSCDecodeError(f"osc.yaml must hold a mapping, not {type(obj).__name__}")
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    if api_version != API_VERSION or kind != KIND:
        raise OSCDecodeError(
            f"osc.yaml has apiVersion {_quote(api_version)} and kind {_quote(kind)}; "
            f"expected {API_VERSION!r} and {KIND!r}"
        )
    try:
        osc = OperatingSystemConfig.model_validate(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        where, item = _locate(obj, err["loc"])
        raise OSCValidationError(f"{where}: {_explain(err)}", field=where, item=item) from exc
    if nodes is not None and raw.isascii():
        _remember(_Snapshot(raw=raw, osc=osc, nodes=nodes, items=_usable(obj, osc, items)))
    return osc


# --- an update that changes one item: only that item is read ------------------------------------

#: the sequences whose items are read alone: (section, key in osc.yaml) -> (field, item model)
_ITEM_FIELDS: dict[tuple[str, str], tuple[str, type[File] | type[Unit]]] = {
    ("spec", "files"): ("files", File),
    ("spec", "units"): ("units", Unit),
    ("status", "extensionFiles"): ("extension_files", File),
    ("status", "extensionUnits"): ("extension_units", Unit),
}
_SNAPSHOT_COUNT = 2  # the OSC of the update before, and the last applied one


@dataclass(frozen=True)
class _Snapshot:
    """A document read in one pass: its bytes (ASCII: offsets are the parser's character
    positions), its OSC, its number of values and where the items of ``_ITEM_FIELDS`` start."""

    raw: bytes
    osc: OperatingSystemConfig
    nodes: int
    items: _Items


_SNAPSHOTS: tuple[_Snapshot, ...] = ()


def _remember(snapshot: _Snapshot) -> None:
    global _SNAPSHOTS
    _SNAPSHOTS = (snapshot, *_SNAPSHOTS[: _SNAPSHOT_COUNT - 1])


def _usable(obj: dict[str, Any], osc: OperatingSystemConfig, items: _Items) -> _Items:
    """The recorded sequences whose items are the model's, one for one (a field given by its
    Python name as well, or items that are not mappings, would break that)."""
    usable: _Items = {}
    for (section, key), (starts, before) in items.items():
        known = _ITEM_FIELDS.get((section, key))
        if known is None:
            continue
        field, _ = known
        mapping = obj.get(section)
        if not isinstance(mapping, dict) or (field != key and field in mapping):
            continue
        if len(getattr(getattr(osc, section), field)) == len(starts):
            usable[(section, key)] = (starts, before)
    return usable


def _reparse(snapshot: _Snapshot, raw: bytes) -> OperatingSystemConfig | None:
    """``raw`` as ``parse_osc`` reads it, from ``snapshot`` and the one item that differs, or
    None when that does not apply (then the whole document is read).

    It applies when the bytes that differ lie inside one block-sequence item of
    ``_ITEM_FIELDS`` that is not its sequence's last: its lines from its ``- `` line up to the
    next item's ``- `` line (same column), every line between them blank or indented deeper.
    Those lines are then read on their own, as a sequence of one item, with the same loader and
    limits; the parser's state where they end is what it was before (the next item's line and
    everything after it are unchanged), so the rest of the document reads as it did. Whatever
    does not read as one plain mapping that validates, or would exceed a limit, goes the whole
    way, which gives the exact error."""
    old = snapshot.raw
    if not raw.isascii():
        return None
    start = common_prefix(old, raw)
    end = len(old) - common_suffix(old, raw, min(len(old), len(raw)) - start)
    found = _changed_item(snapshot, start, end)
    if found is None:
        return None
    where, i, line, next_line = found
    starts, before = snapshot.items[where]
    column = _dash_column(old[line : starts[i]])
    if column is None or column != _dash_column(old[next_line : starts[i + 1]]):
        return None
    shift = len(raw) - len(old)
    part = raw[line : next_line + shift]
    if not part.endswith(b"\n"):
        return None  # the next item's line was joined to this one
    indent = b" " * (column + 1)
    if any(text.strip(b" ") and not text.startswith(indent) for text in part.split(b"\n")[1:]):
        return None
    loader = OSCLoader(part)
    try:
        value, nodes = _load_plain(loader, depth=2)
    except (_Unusual, OSCDecodeError, yaml.YAMLError):
        return None
    finally:
        loader.dispose()
    if type(value) is not list or len(value) != 1 or type(value[0]) is not dict:
        return None
    grown = nodes - 1 - (before[i + 1] - before[i])  # the item's values, without the sequence
    if snapshot.nodes + grown > MAX_NODES:
        return None
    section = where[0]
    field, model = _ITEM_FIELDS[where]
    try:
        item = model.model_validate(value[0])
    except ValidationError:
        return None
    holder = getattr(snapshot.osc, section)
    old_items = getattr(holder, field)
    new_items = (*old_items[:i], item, *old_items[i + 1 :])
    osc = snapshot.osc.model_copy(update={section: holder.model_copy(update={field: new_items})})
    at = starts[i]
    moved: _Items = {
        name: (
            [s if s <= at else s + shift for s in item_starts],
            [b if s <= at else b + grown for s, b in zip(item_starts, counts, strict=True)],
        )
        for name, (item_starts, counts) in snapshot.items.items()
    }
    _remember(_Snapshot(raw=raw, osc=osc, nodes=snapshot.nodes + grown, items=moved))
    _log.debug("osc.yaml read by its changed item", item=f"{section}.{where[1]}[{i}]")
    return osc


def _changed_item(
    snapshot: _Snapshot, start: int, end: int
) -> tuple[tuple[str, str], int, int, int] | None:
    """The item (sequence, index) whose lines hold the bytes ``start:end`` of the snapshot's
    document, with where its line and the next item's line begin; None if no such item."""
    old = snapshot.raw
    for where, (starts, _) in snapshot.items.items():
        i = bisect.bisect_right(starts, start) - 1
        # the item's first value (its start) must stay where it was: what differs begins
        # after it, so the start recorded for the edited document is exact as well
        if 0 <= i < len(starts) - 1 and starts[i] < start:
            line = old.rfind(b"\n", 0, starts[i]) + 1
            next_line = old.rfind(b"\n", 0, starts[i + 1]) + 1
            if end <= next_line:
                return where, i, line, next_line
    return None


def _dash_column(text: bytes) -> int | None:
    """The column of ``-`` when ``text`` (a line up to an item) is ``<spaces>-<spaces>``."""
    column = text.find(b"-")
    if column < 0 or text[:column].strip(b" ") or text[column + 1 :].strip(b" "):
        return None
    if column + 1 == len(text):
        return None  # "-" right before the item: not a block sequence entry
    return column


def validate_osc(osc: OperatingSystemConfig, host_name: str | None = None) -> None:
    """Reject values that cannot be applied safely; raise on the first one found.

    ``host_name`` limits the checks between files (same path, a file where another needs a
    directory, a file over a unit's file) to the files that host gets; without it, files that
    could land on the same host are checked against each other.
    """
    if _validated_by_change(osc, host_name):
        return
    files = [
        *_indexed("spec.files", osc.spec.files),
        *_indexed("status.extensionFiles", osc.status.extension_files),
    ]
    for where, file in files:
        _VALID_FILES.get(file, functools.partial(_validate_file, where))
    mine = [(where, file) for where, file in files if _for_host(file, host_name)]
    units = [
        *_indexed("spec.units", osc.spec.units),
        *_indexed("status.extensionUnits", osc.status.extension_units),
    ]
    between = _between_key(host_name, mine, units)
    known = between == _BETWEEN_PASSED[0]
    if not known:
        _check_duplicate_paths([file for _, file in mine], host_name)
        _check_file_parents(mine)
    with_drop_ins = {unit.name for _, unit in units if unit.drop_ins}
    for where, unit in units:
        _VALID_UNIT_NAMES.get(unit, functools.partial(_validate_unit_name, where))
        if unit.name in with_drop_ins:  # another entry of the same name may have them
            _check_drop_in_dir(unit.name, field=f"{where}.name")
        _VALID_DROP_INS.get(unit, functools.partial(_validate_drop_in_names, where))
    if not known:
        _check_unit_paths(mine, units)
        _BETWEEN_PASSED[0] = between
    _LAST_VALID[0] = _Validated.of(osc, host_name)


@dataclass(frozen=True)
class _Validated:
    """The items of the last OSC that passed ``validate_osc`` whole, in their places."""

    host_name: str | None
    spec_files: int
    spec_units: int
    files: tuple[File, ...]
    units: tuple[Unit, ...]

    @classmethod
    def of(cls, osc: OperatingSystemConfig, host_name: str | None) -> _Validated:
        spec, status = osc.spec, osc.status
        return cls(
            host_name,
            len(spec.files),
            len(spec.units),
            (*spec.files, *status.extension_files),
            (*spec.units, *status.extension_units),
        )


#: the last OSC that passed ``validate_osc`` (None: none yet)
_LAST_VALID: list[_Validated | None] = [None]


def _validated_by_change(osc: OperatingSystemConfig, host_name: str | None) -> bool:
    """Validate ``osc`` by what it changed from the last OSC that passed, when it has the same
    items in the same places and only some of them are other objects (decoding reuses the
    objects of unchanged items) with the same paths and names: those are checked by
    themselves, and the checks between items, which read only paths and names, pass as they
    did. False (nothing checked) when the OSC is not such a change: validate it whole."""
    last = _LAST_VALID[0]
    if last is None or last.host_name != host_name:
        return False
    now = _Validated.of(osc, host_name)
    if (now.spec_files, now.spec_units, len(now.files), len(now.units)) != (
        last.spec_files,
        last.spec_units,
        len(last.files),
        len(last.units),
    ):
        return False
    files = [i for i, (a, b) in enumerate(zip(now.files, last.files, strict=True)) if a is not b]
    units = [i for i, (a, b) in enumerate(zip(now.units, last.units, strict=True)) if a is not b]
    for i in files:
        new, old = now.files[i], last.files[i]
        if (new.path, new.host_name) != (old.path, old.host_name):
            return False
    for i in units:
        new_unit, old_unit = now.units[i], last.units[i]
        if _unit_shape(new_unit) != _unit_shape(old_unit):
            return False
    for i in files:
        where = _place("spec.files", "status.extensionFiles", i, now.spec_files)
        _VALID_FILES.get(now.files[i], functools.partial(_validate_file, where))
    for i in units:
        where = _place("spec.units", "status.extensionUnits", i, now.spec_units)
        _VALID_UNIT_NAMES.get(now.units[i], functools.partial(_validate_unit_name, where))
        _VALID_DROP_INS.get(now.units[i], functools.partial(_validate_drop_in_names, where))
    _LAST_VALID[0] = now
    return True


def _unit_shape(unit: Unit) -> tuple[object, ...]:
    """What the checks between items read of a unit (see ``_between_key``)."""
    return (unit.name, unit.content is not None, tuple(d.name for d in unit.drop_ins))


def _place(spec: str, status: str, index: int, in_spec: int) -> str:
    return f"{spec}[{index}]" if index < in_spec else f"{status}[{index - in_spec}]"


#: what the checks between items read, of the last OSC that passed them (see ``_between_key``)
_BETWEEN_PASSED: list[object] = [None]


def _between_key(
    host_name: str | None, files: Sequence[tuple[str, File]], units: Sequence[tuple[str, Unit]]
) -> tuple[object, ...]:
    """Everything the checks between items (duplicate paths, a file over another's directory
    or over a unit's file) read: an OSC with the same key passes them as the last one that
    did, so an update that changes a file's content, not its path, skips them. The places
    (``where``) only name an item in an error, which is never skipped."""
    return (
        host_name,
        tuple((file.path, file.host_name) for _, file in files),
        tuple(_unit_shape(unit) for _, unit in units),
    )


def _validate_unit_name(where: str, unit: Unit) -> bool:
    """Check ``unit``'s name by itself; True."""
    validate_unit_name(unit.name, field=f"{where}.name")
    return True


def _validate_drop_in_names(where: str, unit: Unit) -> bool:
    """Check the names of ``unit``'s drop-ins by themselves; True."""
    for j, drop_in in enumerate(unit.drop_ins):
        validate_drop_in_name(unit.name, drop_in.name, field=f"{where}.dropIns[{j}].name")
    return True


def decode_inline(inline: InlineContent, *, path: str, field: str | None = None) -> bytes:
    """Return the bytes an inline file content stands for (``""`` = plain, ``b64`` = base64)."""
    if inline.encoding not in _ENCODINGS:
        raise OSCValidationError(
            f"file {path}: unknown content encoding {inline.encoding!r} (allowed: '' or 'b64')",
            field=field,
            item=path,
        )
    if inline.encoding == "":
        return inline.data.encode()
    # Go's base64.StdEncoding skips CR and LF; anything else outside the alphabet is an error.
    compact = inline.data.replace("\r", "").replace("\n", "")
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise OSCValidationError(
            f"file {path}: content is not valid base64: {exc}", field=field, item=path
        ) from exc


def validate_path(path: str, *, field: str | None = None) -> None:
    """A file path must be absolute, normalized, free of ``..`` and NUL bytes, and fit Linux's
    limits (``MAX_NAME_BYTES`` per component, ``MAX_PATH_BYTES``, ``MAX_PATH_COMPONENTS``)."""

    def fail(why: str) -> OSCValidationError:
        return OSCValidationError(f"file path {_quote(path)} {why}", field=field, item=path)

    if "\x00" in path:
        raise fail("contains a NUL byte")
    if not path.startswith("/"):
        raise fail("is not absolute")
    if ".." in path.split("/"):
        raise fail("contains a '..' segment")
    if path == "/" or path.endswith("/"):
        raise fail("names a directory, not a file")
    if posixpath.normpath(path) != path or path.startswith("//"):
        raise fail(f"is not normalized (expected {_quote(posixpath.normpath(path))})")
    size = _utf8_size(path)
    if size is None:
        raise fail("is not valid UTF-8 text")
    if size > MAX_PATH_BYTES:
        raise fail(f"is {size} bytes long, over the limit of {MAX_PATH_BYTES}")
    parts = path[1:].split("/")
    if len(parts) > MAX_PATH_COMPONENTS:
        raise fail(f"has {len(parts)} components, over the limit of {MAX_PATH_COMPONENTS}")
    for part in parts if size > MAX_NAME_BYTES else ():
        if len(part.encode()) > MAX_NAME_BYTES:
            raise fail(
                f"has a component of {len(part.encode())} bytes ({_quote(part, 40)}), "
                f"over the file system's limit of {MAX_NAME_BYTES}"
            )
    _check_reserved(path, fail)


def validate_unit_name(name: str, *, field: str | None = None) -> None:
    def fail(why: str) -> OSCValidationError:
        return OSCValidationError(f"unit name {_quote(name)} {why}", field=field, item=name)

    if "/" in name:
        raise fail("contains '/'")
    if len(name) > _UNIT_NAME_MAX:
        raise fail(f"is longer than {_UNIT_NAME_MAX} characters")
    if not _UNIT_NAME.fullmatch(name):
        raise fail(
            "is not a valid systemd unit name (letters, digits, ':-_.\\', one '@', "
            f"and a suffix out of .{', .'.join(UNIT_SUFFIXES)})"
        )


def validate_drop_in_name(unit: str, name: str, *, field: str | None = None) -> None:
    def fail(why: str) -> OSCValidationError:
        return OSCValidationError(
            f"drop-in {_quote(name)} of unit {unit} {why}",
            field=field,
            item=f"{unit}/{name}",
        )

    if "/" in name or "\x00" in name:
        raise fail("contains '/' or a NUL byte")
    if not name.endswith(".conf") or name == ".conf":
        raise fail("must be a file name ending in .conf")
    size = _utf8_size(name)
    if size is None:
        raise fail("is not valid UTF-8 text")
    if size > MAX_NAME_BYTES:
        raise fail(f"is {size} bytes long, over the file system's limit of {MAX_NAME_BYTES}")


def _check_drop_in_dir(unit: str, *, field: str) -> None:
    directory = f"{unit}.d"
    if len(directory.encode()) > MAX_NAME_BYTES:
        raise OSCValidationError(
            f"unit name {_quote(unit)} is too long for drop-ins: its directory (the name "
            f"and '.d') would be {len(directory.encode())} bytes, over the file system's limit "
            f"of {MAX_NAME_BYTES}",
            field=field,
            item=unit,
        )


def _check_reserved(path: str, fail: Callable[[str], OSCValidationError]) -> None:
    """The agent's own state and credentials are not the OSC's to write."""
    if not path.startswith(layout.BASE_DIR):
        return  # every reserved path is in there
    if path in layout.RESERVED_DIRS:
        raise fail("is the directory of the agent's own state and credentials")
    for reserved in _self_and_parents(path):
        if reserved in layout.RESERVED_FILES:
            what = "credentials" if reserved in layout.CREDENTIAL_FILES else "state"
            raise fail(
                f"is reserved for the agent's own {what} ({reserved}); an OSC may not write it"
            )


def _check_size(raw: bytes) -> None:
    if len(raw) > MAX_OSC_BYTES:
        raise OSCDecodeError(f"osc.yaml is {len(raw)} bytes, over the limit of {MAX_OSC_BYTES}")


#: files found valid by themselves (``_validate_file``), by the file object: an update validates
#: only the files it changes (the others are the objects of the OSC before)
_VALID_FILES: Memo[File, bool] = Memo(ITEM_MEMO_BYTES, item_weight)
#: units whose name, and whose drop-ins' names, were found valid (by the unit object)
_VALID_UNIT_NAMES: Memo[Unit, bool] = Memo(ITEM_MEMO_BYTES, item_weight)
_VALID_DROP_INS: Memo[Unit, bool] = Memo(ITEM_MEMO_BYTES, item_weight)


def _validate_file(where: str, file: File) -> bool:
    """Check ``file`` by itself (``where``: its place in the OSC, for the error); True."""
    validate_path(file.path, field=f"{where}.path")
    if file.permissions is not None and not 0 <= file.permissions <= MAX_PERMISSIONS:
        raise OSCValidationError(
            f"file {file.path}: permissions {file.permissions} ({_octal(file.permissions)}) "
            "are outside 0..0o7777",
            field=f"{where}.permissions",
            item=file.path,
        )
    content = file.content
    sources = [s for s in (content.inline, content.secret_ref, content.image_ref) if s is not None]
    if len(sources) != 1:
        raise OSCValidationError(
            f"file {file.path}: content must set exactly one of inline, secretRef, imageRef "
            f"(found {len(sources)})",
            field=f"{where}.content",
            item=file.path,
        )
    if content.inline is not None:
        decode_inline(content.inline, path=file.path, field=f"{where}.content.inline")
    if content.secret_ref is not None and not (
        content.secret_ref.name and content.secret_ref.data_key
    ):
        raise OSCValidationError(
            f"file {file.path}: secretRef needs both name and dataKey",
            field=f"{where}.content.secretRef",
            item=file.path,
        )
    if content.image_ref is not None and not (
        content.image_ref.image and content.image_ref.file_path_in_image
    ):
        raise OSCValidationError(
            f"file {file.path}: imageRef needs both image and filePathInImage",
            field=f"{where}.content.imageRef",
            item=file.path,
        )
    return True


def _check_duplicate_paths(files: Sequence[File], host_name: str | None) -> None:
    seen: dict[str, list[str | None]] = {}
    for file in files:
        hosts = seen.setdefault(file.path, [])
        if any(_same_host(file.host_name, other) for other in hosts):
            target = f" on host {host_name}" if host_name else ""
            raise OSCValidationError(
                f"file {file.path} is defined more than once{target}", item=file.path
            )
        hosts.append(file.host_name)


def _check_file_parents(files: Sequence[tuple[str, File]]) -> None:
    """A file cannot be written where another file of the same OSC needs a directory."""
    hosts_by_path: dict[str, list[str | None]] = {}
    for _, file in files:
        hosts_by_path.setdefault(file.path, []).append(file.host_name)
    for where, file in files:
        for parent in _parents(file.path):
            if parent not in hosts_by_path:
                continue
            if any(_same_host(file.host_name, other) for other in hosts_by_path[parent]):
                raise OSCValidationError(
                    f"file {file.path} needs {parent} to be a directory, but {parent} is also a "
                    "file of this OSC",
                    field=f"{where}.path",
                    item=file.path,
                )


def _check_unit_paths(files: Sequence[tuple[str, File]], units: Sequence[tuple[str, Unit]]) -> None:
    """A file entry must not take the place of a unit file or drop-in the OSC itself writes:
    one of them would silently lose."""
    owned: dict[str, str] = {}  # path -> what the OSC writes there
    for _, unit in units:
        if unit.content is not None:
            owned[layout.unit_path(unit.name)] = f"the unit file of {unit.name}"
        for drop_in in unit.drop_ins:
            owned[layout.drop_in_path(unit.name, drop_in.name)] = (
                f"drop-in {drop_in.name} of unit {unit.name}"
            )
    parents: dict[str, str] = {}  # directory -> a unit path inside it
    for path in owned:
        for parent in _parents(path):
            parents.setdefault(parent, path)
    for where, file in files:
        path = file.path
        if path in owned:
            why = f"is also {owned[path]} in this OSC"
        elif path in parents:
            inner = parents[path]
            why = f"must stay a directory for {owned[inner]} in this OSC ({inner})"
        else:
            # every path the OSC's units own is in the unit directory (layout.unit_path)
            if not path.startswith(_UNIT_DIR_SLASH):
                continue
            clash = next((p for p in _parents(path) if p in owned), None)
            if clash is None:
                continue
            why = f"needs {clash} to be a directory, but it is {owned[clash]} in this OSC"
        raise OSCValidationError(f"file {path} {why}", field=f"{where}.path", item=path)


def _line(event: yaml.Event) -> int:
    return event.start_mark.line + 1 if event.start_mark is not None else 0


def _indexed(field: str, items: Sequence[Any]) -> Iterator[tuple[str, Any]]:
    return ((f"{field}[{i}]", item) for i, item in enumerate(items))


def _for_host(file: File, host_name: str | None) -> bool:
    return host_name is None or file.host_name in (None, host_name)


def _parents(path: str) -> Iterator[str]:
    """``/a/b/c`` -> ``/a/b``, ``/a``."""
    end = path.rfind("/")
    while end > 0:
        yield path[:end]
        end = path.rfind("/", 0, end)


def _self_and_parents(path: str) -> Iterator[str]:
    yield path
    yield from _parents(path)


def _same_host(a: str | None, b: str | None) -> bool:
    return a is None or b is None or a == b


def _utf8_size(text: str) -> int | None:
    try:
        return len(text.encode())
    except UnicodeEncodeError:
        return None


def _octal(mode: int) -> str:
    return f"-0o{-mode:o}" if mode < 0 else f"0o{mode:o}"


def _quote(value: object, limit: int = 100) -> str:
    """``repr(value)``, shortened so an echoed value cannot swamp a one-line message."""
    text = repr(value)
    if len(text) <= limit:
        return text
    if isinstance(value, str):
        return f"{value[: limit - 25]!r}... ({len(value)} characters)"
    return f"{text[:limit]}..."


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _describe(value: object) -> str:
    """What a wrong value is, in YAML's words, for a type error."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the float {value!r}"
    if isinstance(value, str):
        return f"the string {_quote(value, 60)}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"a value of type {type(value).__name__}"


def _explain(err: Mapping[str, Any]) -> str:
    """A pydantic error in one line, with what was found instead."""
    msg = str(err["ctx"]["error"]) if err["type"] == "value_error" else str(err["msg"])
    if err["type"] == "missing":
        return msg
    return f"{msg}, got {_describe(err.get('input'))}"


def _locate(obj: Mapping[str, Any], loc: Iterable[int | str]) -> tuple[str, str | None]:
    """Render a pydantic error location as ``spec.files[2].content (/etc/foo)``."""
    text, item = "", None
    node: Any = obj
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            node = None
        if isinstance(part, int) and isinstance(node, dict):
            label = node.get("path") or node.get("name")
            if isinstance(label, str):
                item = label
    return (f"{text} ({item})" if item else text), item
