"""``Applied.of_osc`` and ``plan`` by what an update changed, against the same work done from
scratch: on random sequences of OSCs that share item objects (as an update read by its changed
items does), the same ``Applied`` and the same change set as with nothing remembered and no
object shared."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.osc import applied as applied_mod
from node_agent.osc.applied import Applied
from node_agent.osc.models import (
    DropIn,
    File,
    FileContent,
    InlineContent,
    OperatingSystemConfig,
    OSCSpec,
    OSCStatus,
    SecretRefContent,
    Unit,
)
from node_agent.osc.plan import plan

T = TypeVar("T")
HOST = "n"
PATHS = ["/etc/a", "/etc/b", "/etc/c", "/etc/d", "/etc/a"]  # one path twice now and then

files = st.builds(
    lambda path, mode, data, secret, host: File(
        path=path,
        permissions=mode,
        content=(
            FileContent(secret_ref=SecretRefContent(name="s", data_key=path))
            if secret
            else FileContent(inline=InlineContent(data=data))
        ),
        host_name=host,
    ),
    st.sampled_from(PATHS),
    st.sampled_from([None, 0o644]),
    st.sampled_from(["one", "two"]),
    st.sampled_from([False, False, True]),
    st.sampled_from([None, None, HOST, "other"]),
)
units = st.builds(
    lambda name, content, drop_ins, paths, enable: Unit(
        name=name,
        content=content,
        drop_ins=tuple(DropIn(name=d, content="[Service]\n") for d in drop_ins),
        file_paths=tuple(paths),
        enable=enable,
    ),
    st.sampled_from(["x.service", "y.service", "z.service"]),
    st.sampled_from([None, "[Unit]\n", "[Unit]\nA=1\n"]),
    st.lists(st.sampled_from(["10.conf", "20.conf"]), max_size=2, unique=True),
    st.lists(st.sampled_from(PATHS[:4]), max_size=2, unique=True),
    st.sampled_from([None, True]),
)


@contextmanager
def nothing_remembered() -> Iterator[None]:
    kept = applied_mod._LAST_OF_OSC[0]
    applied_mod._LAST_OF_OSC[0] = None
    try:
        yield
    finally:
        applied_mod._LAST_OF_OSC[0] = kept


def fresh(osc: OperatingSystemConfig) -> OperatingSystemConfig:
    """The same OSC with no object shared with any other (as read from disk)."""
    return OperatingSystemConfig.model_validate(osc.model_dump(by_alias=True))


def edit(items: list[T], how: str, index: int, item: T) -> None:
    if how == "replace" and items:
        items[index % len(items)] = item
    elif how == "drop" and items:
        del items[index % len(items)]
    else:
        items.append(item)


@settings(max_examples=400, deadline=None)
@given(
    first_files=st.lists(files, max_size=4),
    first_units=st.lists(units, max_size=3),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["replace", "append", "drop"]),
            st.integers(0, 7),
            st.one_of(files, units),
            st.booleans(),
        ),
        max_size=8,
    ),
)
def test_the_items_by_change_are_the_items_from_scratch(
    first_files: list[File],
    first_units: list[Unit],
    steps: list[tuple[str, int, File | Unit, bool]],
) -> None:
    spec_files, spec_units = list(first_files), list(first_units)
    status_units: list[Unit] = []
    before = Applied()
    for n, (how, index, item, to_status) in enumerate([("none", 0, None, False), *steps]):
        if isinstance(item, File):
            edit(spec_files, how, index, item)
        elif isinstance(item, Unit):
            edit(status_units if to_status else spec_units, how, index, item)
        osc = OperatingSystemConfig(
            spec=OSCSpec(files=tuple(spec_files), units=tuple(spec_units)),
            status=OSCStatus(extension_units=tuple(status_units)),
        )
        # a secretRef's bytes change without its item: its state is made again every time
        resolved = {f.path: f"bytes of {f.path}, {n % 2}".encode() for f in spec_files}
        now = Applied.of_osc(osc, HOST, resolved, required=True)
        with nothing_remembered():
            expected = Applied.of_osc(fresh(osc), HOST, resolved, required=True)
        assert now == expected
        # the plan from the Applied before (sharing objects with now) is the plan from scratch
        changes = plan(before, osc, HOST, resolved, target=now)
        scratch = Applied.model_validate(before.model_dump())
        with nothing_remembered():
            assert changes == plan(scratch, fresh(osc), HOST, resolved)
        before = now
