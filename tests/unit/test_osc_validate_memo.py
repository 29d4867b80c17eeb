"""``decode.validate_osc`` with its memos (per item by the item object, the checks between
items by what they read, an update by the items it changed) against a validation with nothing
remembered: on random sequences of OSCs that share item objects, as an update read by its one
changed item does, the same outcome (valid, or the same error naming the same item)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.base.errors import OSCValidationError
from node_agent.osc import decode
from node_agent.osc.memo import Memo, item_weight
from node_agent.osc.models import (
    DropIn,
    File,
    FileContent,
    InlineContent,
    OperatingSystemConfig,
    OSCSpec,
    OSCStatus,
    Unit,
)

T = TypeVar("T")

#: mostly valid values (an invalid file hides the checks between files), some that clash
PATHS = [
    "/etc/a",
    "/etc/a",
    "/etc/c",
    "/etc/d/e",
    "/etc/a/b",
    "/etc/b",
    "/etc/systemd/system",
    "/etc/systemd/system/x.service",
    "/etc/systemd/system/x.service.d",
    "/etc/systemd/system/x.service.d/10.conf",
    *["/etc/f", "/etc/g", "/etc/a/h"] * 3,
]
INVALID_PATHS = ["etc/relative", "/etc/../up", "/var/lib/gardener-node-agent/credentials/token"]
#: a 254-character name is valid, but leaves no room for its drop-ins' directory
LONG = "a" * 246 + ".service"
UNIT_NAMES = ["x.service", "x.service", "y.service", "bad name", "z@.service", LONG]
DROP_INS = ["10.conf", "10.conf", "20.conf", "bad"]


def mostly(valid: Sequence[T], invalid: Sequence[T]) -> st.SearchStrategy[T]:
    """A valid value, an invalid one now and then (an invalid item hides the checks between
    items, and they are what is remembered by what they read)."""
    return st.sampled_from([*valid] * 8 + [*invalid])


files = st.builds(
    lambda path, mode, data, b64, host: File(
        path=path,
        permissions=mode,
        content=FileContent(inline=InlineContent(encoding="b64" if b64 else "", data=data)),
        host_name=host,
    ),
    mostly(PATHS, INVALID_PATHS),
    mostly([None, 0o644], [0o10000]),
    mostly(["", "aGk="], ["not base64!"]),
    st.sampled_from([False, False, True]),
    st.sampled_from([None, "n", "other"]),
)
units = st.builds(
    lambda name, content, drop_ins: Unit(
        name=name,
        content=content,
        drop_ins=tuple(DropIn(name=d, content="[Service]\n") for d in drop_ins),
    ),
    st.sampled_from(UNIT_NAMES),
    st.sampled_from([None, "[Unit]\n"]),
    st.lists(st.sampled_from(DROP_INS), max_size=2, unique=True),
)


def outcome(osc: OperatingSystemConfig, host: str | None) -> tuple[str, ...]:
    try:
        decode.validate_osc(osc, host)
    except OSCValidationError as exc:
        return ("error", str(exc), str(exc.field), str(exc.item))
    return ("ok",)


@contextmanager
def nothing_remembered() -> Iterator[None]:
    names = ["_VALID_FILES", "_VALID_UNIT_NAMES", "_VALID_DROP_INS"]
    kept = {name: getattr(decode, name) for name in names}
    passed, last = decode._BETWEEN_PASSED[0], decode._LAST_VALID[0]
    for name in names:
        setattr(decode, name, Memo(1 << 20, item_weight))
    decode._BETWEEN_PASSED[0] = decode._LAST_VALID[0] = None
    try:
        yield
    finally:
        for name, memo in kept.items():
            setattr(decode, name, memo)
        decode._BETWEEN_PASSED[0], decode._LAST_VALID[0] = passed, last


@settings(max_examples=1000, deadline=None)
@given(
    first_files=st.lists(files, min_size=1, max_size=5),
    first_units=st.lists(units, max_size=3),
    steps=st.lists(
        st.tuples(st.booleans(), st.integers(0, 7), st.one_of(files, units), st.booleans()),
        max_size=8,
    ),
    host=st.sampled_from([None, "n"]),
)
def test_validation_with_memos_is_validation_without(
    first_files: list[File],
    first_units: list[Unit],
    steps: list[tuple[bool, int, File | Unit, bool]],
    host: str | None,
) -> None:
    spec_files, spec_units = list(first_files), list(first_units)
    status_units: list[Unit] = []

    def current() -> OperatingSystemConfig:
        return OperatingSystemConfig(
            spec=OSCSpec(files=tuple(spec_files), units=tuple(spec_units)),
            status=OSCStatus(extension_units=tuple(status_units)),
        )

    for replace, index, item, to_status in [(False, 0, None, False), *steps]:
        if isinstance(item, File):
            if replace and spec_files:
                spec_files[index % len(spec_files)] = item
            else:
                spec_files.append(item)
        elif isinstance(item, Unit):
            target = status_units if to_status else spec_units
            if replace and target:
                target[index % len(target)] = item
            else:
                target.append(item)
        osc = current()  # the unchanged items are the same objects as before
        with nothing_remembered():
            expected = outcome(osc, host)
        assert outcome(osc, host) == expected


def unit(name: str, content: str | None = None, drop_ins: tuple[str, ...] = ()) -> Unit:
    return Unit(
        name=name, content=content, drop_ins=tuple(DropIn(name=d, content="") for d in drop_ins)
    )


def inline(path: str, host: str | None = None) -> File:
    return File(path=path, content=FileContent(inline=InlineContent(data="x")), host_name=host)


UNIT_FILE = "/etc/systemd/system/x.service"
#: (files, units) before and after: each pair differs in one thing the checks between items
#: read, and only the second fails them
CHANGES = [
    (([inline("/etc/a", "n"), inline("/etc/a", "other")], []), "host_name"),
    (([inline(UNIT_FILE)], [unit("x.service")]), "content"),
    (([inline(UNIT_FILE + ".d/10.conf")], [unit("x.service", drop_ins=("20.conf",))]), "dropIn"),
    (([inline("/etc/a"), inline("/etc/b/c")], []), "path"),
]


def test_each_thing_the_checks_between_items_read_is_remembered() -> None:
    """An OSC that passed the checks between items, then one that changes only one thing they
    read (a host name, a unit's content, a drop-in's name, a path) of the same item objects
    otherwise: it must be checked again, and fail."""
    with nothing_remembered():
        for (files, units), what in CHANGES:
            host = None
            osc = OperatingSystemConfig(spec=OSCSpec(files=tuple(files), units=tuple(units)))
            assert outcome(osc, host) == ("ok",), what
            if what == "host_name":
                files[1] = inline("/etc/a", "n")
            elif what == "content":
                units[0] = unit("x.service", content="[Unit]\n")
            elif what == "dropIn":
                units[0] = unit("x.service", drop_ins=("10.conf",))
            else:
                files[1] = inline("/etc/a/c")
            osc = OperatingSystemConfig(spec=OSCSpec(files=tuple(files), units=tuple(units)))
            assert outcome(osc, host)[0] == "error", what


def test_an_update_is_checked_by_the_items_it_changed() -> None:
    """The OSC before passed whole; the update replaces one file by one of the same path, with
    permissions out of range: the error names that item in its place (spec or status), and
    the OSC after a rejected one is checked again in full (its files clash)."""
    with nothing_remembered():
        spec = [inline("/etc/a"), inline("/etc/b")]
        status = (inline("/etc/c"),)
        osc = OperatingSystemConfig(
            spec=OSCSpec(files=tuple(spec)), status=OSCStatus(extension_files=status)
        )
        assert outcome(osc, "n") == ("ok",)
        bad = File(path="/etc/b", permissions=0o10000, content=spec[1].content)
        osc = OperatingSystemConfig(
            spec=OSCSpec(files=(spec[0], bad)), status=OSCStatus(extension_files=status)
        )
        assert outcome(osc, "n")[2] == "spec.files[1].permissions"
        osc = OperatingSystemConfig(
            spec=OSCSpec(files=tuple(spec)), status=OSCStatus(extension_files=(bad,))
        )
        assert outcome(osc, "n")[2] == "status.extensionFiles[0].permissions"
        clash = inline("/etc/a")
        osc = OperatingSystemConfig(
            spec=OSCSpec(files=(spec[0], clash)), status=OSCStatus(extension_files=status)
        )
        assert outcome(osc, "n")[0] == "error"
