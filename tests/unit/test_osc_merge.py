"""Merging units from spec and status, and selecting the files for one host."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from node_agent.osc import merge_units, osc_files, osc_units, secret_refs
from node_agent.osc.models import DropIn, File, OperatingSystemConfig, Unit


def unit(name: str = "a.service", **fields: Any) -> Unit:
    return Unit.model_validate({"name": name, **fields})


def drop_in(name: str, content: str) -> dict[str, str]:
    return {"name": name, "content": content}


def test_set_scalar_fields_override_and_unset_ones_do_not() -> None:
    base = unit(command="start", enable=True, content="base")
    merged = merge_units([base], [unit(enable=False)])
    assert merged == (unit(command="start", enable=False, content="base"),)
    merged = merge_units([base], [unit(command="stop", content="ext")])
    assert merged == (unit(command="stop", enable=True, content="ext"),)


def test_drop_ins_append_and_a_later_one_of_the_same_name_wins() -> None:
    spec = unit(dropIns=[drop_in("10-a.conf", "spec-a"), drop_in("20-b.conf", "spec-b")])
    ext = unit(dropIns=[drop_in("20-b.conf", "ext-b"), drop_in("30-c.conf", "ext-c")])
    (merged,) = merge_units([spec], [ext])
    assert merged.drop_ins == (
        DropIn(name="10-a.conf", content="spec-a"),
        DropIn(name="20-b.conf", content="ext-b"),
        DropIn(name="30-c.conf", content="ext-c"),
    )


def test_file_paths_append_without_repeats() -> None:
    spec = unit(filePaths=["/etc/a", "/etc/b"])
    ext = unit(filePaths=["/etc/b", "/etc/c"])
    (merged,) = merge_units([spec], [ext])
    assert merged.file_paths == ("/etc/a", "/etc/b", "/etc/c")


def test_units_repeated_within_one_list_merge_too() -> None:
    (merged,) = merge_units([unit(content="x"), unit(enable=False)])
    assert (merged.content, merged.enable) == ("x", False)


def test_order_of_first_appearance_is_kept() -> None:
    merged = merge_units(
        [unit("b.service"), unit("a.service")], [unit("c.service"), unit("b.service")]
    )
    assert [u.name for u in merged] == ["b.service", "a.service", "c.service"]


def osc(**parts: Any) -> OperatingSystemConfig:
    return OperatingSystemConfig.model_validate(
        {
            "apiVersion": "extensions.gardener.cloud/v1alpha1",
            "kind": "OperatingSystemConfig",
            **parts,
        }
    )


def test_osc_units_puts_status_units_over_spec_units() -> None:
    config = osc(
        spec={"units": [{"name": "kubelet.service", "content": "k", "enable": True}]},
        status={
            "extensionUnits": [{"name": "kubelet.service", "enable": False}, {"name": "x.timer"}]
        },
    )
    units = osc_units(config)
    assert [(u.name, u.content, u.enable) for u in units] == [
        ("kubelet.service", "k", False),
        ("x.timer", None, None),
    ]


def inline_file(path: str, host: str | None = None, data: str = "d") -> dict[str, Any]:
    file: dict[str, Any] = {"path": path, "content": {"inline": {"encoding": "", "data": data}}}
    if host is not None:
        file["hostName"] = host
    return file


def test_osc_files_joins_spec_and_status_and_filters_by_host() -> None:
    config = osc(
        spec={"files": [inline_file("/a"), inline_file("/b", host="node-a")]},
        status={"extensionFiles": [inline_file("/c", host="node-b"), inline_file("/d")]},
    )
    assert [f.path for f in osc_files(config, "node-a")] == ["/a", "/b", "/d"]
    assert [f.path for f in osc_files(config, "node-b")] == ["/a", "/c", "/d"]
    assert [f.path for f in osc_files(config, "NODE-A")] == ["/a", "/d"]  # exact match only


def test_secret_refs_lists_only_secret_backed_files_of_this_host() -> None:
    ref = {"secretRef": {"name": "s", "dataKey": "k"}}
    config = osc(
        spec={
            "files": [
                {"path": "/etc/token", "content": ref},
                {"path": "/etc/other", "content": ref, "hostName": "node-b"},
                inline_file("/etc/plain"),
            ]
        }
    )
    refs = secret_refs(config, "node-a")
    assert list(refs) == ["/etc/token"]
    assert (refs["/etc/token"].name, refs["/etc/token"].data_key) == ("s", "k")


names = st.sampled_from(["a.service", "b.service", "c.timer"])
units_st = st.builds(
    lambda name, enable, content, dins, paths: Unit(
        name=name,
        enable=enable,
        content=content,
        drop_ins=tuple(DropIn(name=n, content=c) for n, c in dins),
        file_paths=tuple(paths),
    ),
    names,
    st.none() | st.booleans(),
    st.none() | st.text("xy", max_size=2),
    st.lists(
        st.tuples(st.sampled_from(["1.conf", "2.conf"]), st.text("xy", max_size=2)), max_size=3
    ),
    st.lists(st.sampled_from(["/a", "/b", "/c"]), max_size=3),
)


@given(st.lists(units_st, max_size=5), st.lists(units_st, max_size=5))
def test_merge_properties(spec: list[Unit], status: list[Unit]) -> None:
    merged = {u.name: u for u in merge_units(spec, status)}
    everything = [*spec, *status]
    assert set(merged) == {u.name for u in everything}
    for name, result in merged.items():
        parts = [u for u in everything if u.name == name]
        # the last part that sets a field decides it
        for field in ("enable", "content", "command"):
            values = [getattr(u, field) for u in parts if getattr(u, field) is not None]
            assert getattr(result, field) == (values[-1] if values else None)
        last_drop_in = {d.name: d.content for u in parts for d in u.drop_ins}
        assert {d.name: d.content for d in result.drop_ins} == last_drop_in
        assert len({d.name for d in result.drop_ins}) == len(result.drop_ins)
        assert list(result.file_paths) == list(
            dict.fromkeys(p for u in parts for p in u.file_paths)
        )


def test_file_model_defaults() -> None:
    file = File.model_validate({"path": "/x", "content": {"inline": {"data": "y"}}})
    assert file.permissions is None
    assert file.host_name is None
    assert file.content.inline is not None
    assert file.content.inline.encoding == ""
