"""The planner: properties checked against a simulated host, and the rules one by one."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.base.errors import SecretRefError
from node_agent.base.layout import AGENT_UNIT
from node_agent.osc import osc_files, osc_units, plan
from node_agent.osc.models import OperatingSystemConfig, Unit
from node_agent.osc.plan import ChangeSet
from node_agent.osc.steps import step_ids

HOST = "node-a"

# --- a simulated host ----------------------------------------------------------------------------

FileBody = bytes | tuple[str, str, str]  # bytes, or ("image", image, path in image)


@dataclass
class Host:
    files: dict[str, tuple[int, FileBody]] = field(default_factory=dict)
    units: dict[str, str] = field(default_factory=dict)
    dropins: dict[tuple[str, str], str] = field(default_factory=dict)
    enabled: set[str] = field(default_factory=set)


def apply(host: Host, changes: ChangeSet) -> Host:
    out = Host(dict(host.files), dict(host.units), dict(host.dropins), set(host.enabled))
    for w in changes.files_to_write:
        if w.image_ref is not None:
            out.files[w.path] = (
                w.mode,
                ("image", w.image_ref.image, w.image_ref.file_path_in_image),
            )
        else:
            assert w.content is not None
            out.files[w.path] = (w.mode, w.content)
    for u in changes.units_to_write:
        out.units[u.name] = u.content
    for d in changes.dropins_to_write:
        out.dropins[(d.unit, d.name)] = d.content
    for gone in changes.dropins_to_delete:
        del out.dropins[(gone.unit, gone.name)]  # deleting something absent would be a planner bug
    out.enabled |= set(changes.units_to_enable)
    out.enabled -= set(changes.units_to_disable)
    for ud in changes.units_to_delete:
        del out.units[ud.name]
    for fd in changes.files_to_delete:
        del out.files[fd.path]
    return out


def host_state(osc: OperatingSystemConfig, resolved: dict[str, bytes]) -> Host:
    """What a node looks like with ``osc`` applied, computed without the planner."""
    host = Host()
    for f in osc_files(osc, HOST):
        mode = 0o600 if f.permissions is None else f.permissions
        c = f.content
        body: FileBody
        if c.inline is not None:
            raw = c.inline.data
            body = base64.b64decode(raw) if c.inline.encoding == "b64" else raw.encode()
        elif c.secret_ref is not None:
            body = resolved[f.path]
        else:
            assert c.image_ref is not None
            body = ("image", c.image_ref.image, c.image_ref.file_path_in_image)
        host.files[f.path] = (mode, body)
    for u in osc_units(osc):
        if u.content is not None:
            host.units[u.name] = u.content
        for d in u.drop_ins:
            host.dropins[(u.name, d.name)] = d.content
        if u.enable is not False:
            host.enabled.add(u.name)
    return host


# --- generated OSCs ------------------------------------------------------------------------------

PATHS = ["/etc/a", "/etc/b", "/var/lib/c", "/opt/bin/d"]
UNITS = ["a.service", "b.service", "c.timer", "d.socket"]
SECRETS = {("s1", "k"): "/etc/a", ("s2", "k"): "/var/lib/c"}


@st.composite
def file_dicts(draw: st.DrawFn, path: str) -> dict[str, Any]:
    kind = draw(st.sampled_from(["plain", "b64", "secret", "image"]))
    if kind == "plain":
        content: dict[str, Any] = {
            "inline": {"encoding": "", "data": draw(st.text("xy", max_size=2))}
        }
    elif kind == "b64":
        data = base64.b64encode(draw(st.binary(max_size=2))).decode()
        content = {"inline": {"encoding": "b64", "data": data}}
    elif kind == "secret":
        content = {"secretRef": {"name": "s-" + path.replace("/", ""), "dataKey": "k"}}
    else:
        image = draw(st.sampled_from(["img:1", "img:2"]))
        content = {"imageRef": {"image": image, "filePathInImage": "/bin"}}
    file: dict[str, Any] = {"path": path, "content": content}
    mode = draw(st.sampled_from([None, 0o644, 0o600, 0o755]))
    if mode is not None:
        file["permissions"] = mode
    host = draw(st.sampled_from([None, None, HOST, "other-node"]))
    if host is not None:
        file["hostName"] = host
    return file


unit_dicts = st.fixed_dictionaries(
    {"name": st.sampled_from(UNITS)},
    optional={
        "command": st.sampled_from(["start", "restart", "stop"]),
        "enable": st.booleans(),
        "content": st.sampled_from(["[Unit]\n", "[Service]\n"]),
        "dropIns": st.lists(
            st.fixed_dictionaries(
                {
                    "name": st.sampled_from(["10-a.conf", "20-b.conf"]),
                    "content": st.sampled_from(["x", "y"]),
                }
            ),
            max_size=2,
        ),
        "filePaths": st.lists(st.sampled_from(PATHS), max_size=2),
    },
)


@st.composite
def oscs(draw: st.DrawFn) -> tuple[OperatingSystemConfig, dict[str, bytes]]:
    chosen = draw(st.lists(st.sampled_from(PATHS), unique=True))
    files = [draw(file_dicts(p)) for p in chosen]
    in_status = draw(st.lists(st.booleans(), min_size=len(files), max_size=len(files)))
    doc = {
        "apiVersion": "extensions.gardener.cloud/v1alpha1",
        "kind": "OperatingSystemConfig",
        "spec": {
            "files": [f for f, s in zip(files, in_status, strict=True) if not s],
            "units": draw(st.lists(unit_dicts, max_size=4)),
        },
        "status": {
            "extensionFiles": [f for f, s in zip(files, in_status, strict=True) if s],
            "extensionUnits": draw(st.lists(unit_dicts, max_size=2)),
        },
    }
    resolved = {
        f["path"]: draw(st.sampled_from([b"secret-1", b"secret-2"]))
        for f in files
        if "secretRef" in f["content"]
    }
    return OperatingSystemConfig.model_validate(doc), resolved


def changed_paths(before: Host, after: Host) -> set[str]:
    return {
        p
        for p in before.files.keys() | after.files.keys()
        if before.files.get(p) != after.files.get(p)
    }


# --- properties ----------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(oscs(), oscs())
def test_applying_a_plan_turns_state_a_into_state_b(
    a: tuple[OperatingSystemConfig, dict[str, bytes]],
    b: tuple[OperatingSystemConfig, dict[str, bytes]],
) -> None:
    (osc_a, res_a), (osc_b, res_b) = a, b
    before, expected = host_state(osc_a, res_a), host_state(osc_b, res_b)

    after = apply(before, plan(osc_a, osc_b, HOST, res_b, previous_resolved=res_a))

    assert after.files == expected.files
    assert after.units == expected.units
    assert after.dropins == expected.dropins
    # Enablement is exact for desired units and for removed units the agent owned; a removed unit
    # it did not own (drop-ins only, e.g. containerd.service) keeps whatever state it had.
    owned_removed = {u.name for u in osc_units(osc_a) if u.content is not None}
    managed = {u.name for u in osc_units(osc_b)} | owned_removed
    assert after.enabled & managed == expected.enabled


@settings(max_examples=200, deadline=None)
@given(oscs())
def test_first_apply_builds_the_whole_state_from_nothing(
    b: tuple[OperatingSystemConfig, dict[str, bytes]],
) -> None:
    osc_b, res_b = b
    changes = plan(None, osc_b, HOST, res_b)
    assert apply(Host(), changes) == host_state(osc_b, res_b)
    assert not changes.files_to_delete
    assert not changes.units_to_delete
    assert {c.unit for c in changes.unit_commands} == {u.name for u in osc_units(osc_b)}


@settings(max_examples=200, deadline=None)
@given(oscs())
def test_planning_a_config_against_itself_is_empty(
    a: tuple[OperatingSystemConfig, dict[str, bytes]],
) -> None:
    osc_a, res_a = a
    changes = plan(osc_a, osc_a, HOST, res_a, previous_resolved=res_a)
    assert changes.is_empty(), changes.summary()
    assert changes.summary() == "no changes"


@settings(max_examples=300, deadline=None)
@given(oscs(), oscs())
def test_a_unit_gets_a_command_exactly_when_it_or_one_of_its_files_changed(
    a: tuple[OperatingSystemConfig, dict[str, bytes]],
    b: tuple[OperatingSystemConfig, dict[str, bytes]],
) -> None:
    (osc_a, res_a), (osc_b, res_b) = a, b
    files_changed = changed_paths(host_state(osc_a, res_a), host_state(osc_b, res_b))
    old = {u.name: u for u in osc_units(osc_a)}
    new = {u.name: u for u in osc_units(osc_b)}

    changes = plan(osc_a, osc_b, HOST, res_b, previous_resolved=res_a)
    commands = {c.unit: c for c in changes.unit_commands}

    def drop_ins(u: Unit) -> dict[str, str]:
        return {d.name: d.content for d in u.drop_ins}

    for name, n in new.items():
        o = old.get(name)
        expect = o is None or (
            (o.content, drop_ins(o), o.enable, o.command)
            != (n.content, drop_ins(n), n.enable, n.command)
            or bool(files_changed & {*o.file_paths, *n.file_paths})
        )
        assert (name in commands) == expect, name
        if expect:
            stop = n.enable is False or n.command == "stop"
            assert commands[name].action == ("stop" if stop else "restart")
            assert not commands[name].removed
    for name in old.keys() - new.keys():
        o = old[name]
        assert (name in commands) == (o.content is not None or bool(o.drop_ins))
        if o.content is not None:
            assert commands[name].action == "stop"
            assert commands[name].removed
            assert name in changes.units_to_disable


@settings(max_examples=100, deadline=None)
@given(oscs(), oscs())
def test_plans_are_sorted_and_survive_json_and_yaml(
    a: tuple[OperatingSystemConfig, dict[str, bytes]],
    b: tuple[OperatingSystemConfig, dict[str, bytes]],
) -> None:
    (osc_a, res_a), (osc_b, res_b) = a, b
    changes = plan(osc_a, osc_b, HOST, res_b, previous_resolved=res_a)
    assert [w.path for w in changes.files_to_write] == sorted(
        w.path for w in changes.files_to_write
    )
    assert [c.unit for c in changes.unit_commands] == sorted(c.unit for c in changes.unit_commands)
    assert list(changes.units_to_enable) == sorted(changes.units_to_enable)
    assert ChangeSet.from_json(changes.to_json()) == changes
    assert ChangeSet.from_yaml(changes.to_yaml()) == changes
    assert changes.to_json() == plan(osc_a, osc_b, HOST, res_b, previous_resolved=res_a).to_json()


# --- rules, one example each ---------------------------------------------------------------------


def make(
    files: list[dict[str, Any]] | None = None,
    units: list[dict[str, Any]] | None = None,
    **status: Any,
) -> OperatingSystemConfig:
    return OperatingSystemConfig.model_validate(
        {
            "apiVersion": "extensions.gardener.cloud/v1alpha1",
            "kind": "OperatingSystemConfig",
            "spec": {"files": files or [], "units": units or []},
            "status": status,
        }
    )


def text_file(path: str, data: str, mode: int | None = 0o644, **extra: Any) -> dict[str, Any]:
    file = {"path": path, "content": {"inline": {"encoding": "", "data": data}}, **extra}
    if mode is not None:
        file["permissions"] = mode
    return file


KUBELET_CONFIG = "/var/lib/kubelet/config/kubelet"


def kubelet(**extra: Any) -> dict[str, Any]:
    return {
        "name": "kubelet.service",
        "command": "start",
        "enable": True,
        "content": "[Service]\nExecStart=/opt/bin/kubelet\n",
        "filePaths": [KUBELET_CONFIG],
        **extra,
    }


def test_changed_file_restarts_the_unit_that_lists_it() -> None:
    a = make([text_file(KUBELET_CONFIG, "v1"), text_file("/etc/other", "x")], [kubelet()])
    b = make([text_file(KUBELET_CONFIG, "v2"), text_file("/etc/other", "x")], [kubelet()])
    changes = plan(a, b, HOST)
    assert [(w.path, w.content, w.reason) for w in changes.files_to_write] == [
        (KUBELET_CONFIG, b"v2", "content changed")
    ]
    assert changes.reasons() == [
        "kubelet.service restarts because /var/lib/kubelet/config/kubelet changed"
    ]
    assert changes.units_to_write == ()  # the unit file itself is unchanged


def test_changed_drop_in_restarts_its_unit_and_only_rewrites_that_drop_in() -> None:
    def containerd(content: str) -> dict[str, Any]:
        return {
            "name": "containerd.service",
            "dropIns": [
                {"name": "10-foo.conf", "content": content},
                {"name": "20-bar.conf", "content": "b"},
            ],
        }

    changes = plan(make(units=[containerd("a")]), make(units=[containerd("b")]), HOST)
    assert [(d.unit, d.name, d.content) for d in changes.dropins_to_write] == [
        ("containerd.service", "10-foo.conf", "b")
    ]
    assert changes.reasons() == [
        "containerd.service restarts because its drop-in 10-foo.conf changed"
    ]
    assert changes.units_to_write == ()
    assert changes.units_to_delete == ()


def test_unit_with_command_stop_is_stopped() -> None:
    y = {"name": "y.service", "content": "[Service]\n"}
    changes = plan(make(units=[y]), make(units=[y | {"command": "stop"}]), HOST)
    (cmd,) = changes.unit_commands
    assert (
        cmd.describe()
        == 'y.service stops because command is stop; command changed from unset to "stop"'
    )
    assert changes.units_to_enable == ("y.service",)  # upstream: only enable=false disables


def test_unit_with_enable_false_is_disabled_and_stopped() -> None:
    y = {"name": "y.service", "content": "[Service]\n", "enable": True}
    changes = plan(make(units=[y]), make(units=[y | {"enable": False}]), HOST)
    assert changes.units_to_disable == ("y.service",)
    assert changes.units_to_enable == ()
    assert changes.unit_commands[0].action == "stop"
    assert "enable changed from true to false" in changes.reasons()[0]


def test_new_unit_is_written_enabled_and_restarted() -> None:
    changes = plan(make(), make(units=[kubelet()]), HOST)
    assert [u.name for u in changes.units_to_write] == ["kubelet.service"]
    assert changes.units_to_enable == ("kubelet.service",)
    assert changes.reasons() == ["kubelet.service restarts because it is new"]


def test_removed_unit_is_disabled_stopped_and_deleted_with_its_drop_ins() -> None:
    x = {
        "name": "x.service",
        "content": "[Service]\n",
        "dropIns": [{"name": "10-a.conf", "content": "a"}],
    }
    changes = plan(make(units=[x, kubelet()]), make(units=[kubelet()]), HOST)
    assert [u.name for u in changes.units_to_delete] == ["x.service"]
    assert [(d.unit, d.name) for d in changes.dropins_to_delete] == [("x.service", "10-a.conf")]
    assert changes.units_to_disable == ("x.service",)
    (cmd,) = changes.unit_commands
    assert (cmd.unit, cmd.action, cmd.removed) == ("x.service", "stop", True)


def test_removed_drop_ins_on_a_distro_unit_only_delete_drop_ins_and_restart() -> None:
    containerd = {"name": "containerd.service", "dropIns": [{"name": "10-a.conf", "content": "a"}]}
    changes = plan(make(units=[containerd]), make(), HOST)
    assert changes.units_to_delete == ()
    assert changes.units_to_disable == ()
    assert [(d.unit, d.name) for d in changes.dropins_to_delete] == [
        ("containerd.service", "10-a.conf")
    ]
    (cmd,) = changes.unit_commands
    assert (cmd.action, cmd.removed) == ("restart", True)


def _template(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": "tpl@.service",
        "content": content,
        "dropIns": [{"name": "10-a.conf", "content": "a"}],
        **extra,
    }


def test_template_unit_is_only_files_never_a_job() -> None:
    # systemd refuses enable/start/stop of "tpl@.service" (no instance): only files change.
    added = plan(
        make(units=[kubelet()]), make(units=[kubelet(), _template("1", enable=True)]), HOST
    )
    assert [u.name for u in added.units_to_write] == ["tpl@.service"]
    assert [(d.unit, d.name) for d in added.dropins_to_write] == [("tpl@.service", "10-a.conf")]
    assert (added.units_to_enable, added.units_to_disable, added.unit_commands) == ((), (), ())
    assert "reload" in step_ids(added)

    before = make(units=[kubelet(), _template("1", command="start")])
    changed = plan(before, make(units=[kubelet(), _template("2", command="stop")]), HOST)
    assert [u.content for u in changed.units_to_write] == ["2"]
    assert (changed.units_to_enable, changed.units_to_disable, changed.unit_commands) == (
        (),
        (),
        (),
    )

    removed = plan(before, make(units=[kubelet()]), HOST)
    assert [u.name for u in removed.units_to_delete] == ["tpl@.service"]
    assert [(d.unit, d.name) for d in removed.dropins_to_delete] == [("tpl@.service", "10-a.conf")]
    assert (removed.units_to_disable, removed.unit_commands) == ((), ())
    assert step_ids(removed)[-2:] == ("delete-unit:tpl@.service", "reload-after-delete")


def test_removed_drop_ins_of_a_distro_template_restart_nothing() -> None:
    getty = {"name": "getty@.service", "dropIns": [{"name": "10-a.conf", "content": "a"}]}
    changes = plan(make(units=[getty]), make(), HOST)
    assert [(d.unit, d.name) for d in changes.dropins_to_delete] == [
        ("getty@.service", "10-a.conf")
    ]
    assert (changes.units_to_delete, changes.unit_commands) == ((), ())


def test_drop_in_only_unit_never_gets_a_unit_file() -> None:
    containerd = {"name": "containerd.service", "dropIns": [{"name": "10-a.conf", "content": "a"}]}
    changes = plan(None, make(units=[containerd]), HOST)
    assert changes.units_to_write == ()
    assert [d.name for d in changes.dropins_to_write] == ["10-a.conf"]


def test_unit_losing_its_content_has_its_unit_file_deleted() -> None:
    changes = plan(
        make(units=[{"name": "x.service", "content": "c"}]),
        make(units=[{"name": "x.service"}]),
        HOST,
    )
    assert [u.name for u in changes.units_to_delete] == ["x.service"]
    assert changes.reasons() == ["x.service restarts because its unit file was removed"]


def test_removed_drop_in_is_deleted_and_restarts_the_unit() -> None:
    with_drop_in = kubelet(dropIns=[{"name": "10-a.conf", "content": "a"}])
    changes = plan(make(units=[with_drop_in]), make(units=[kubelet()]), HOST)
    assert [(d.unit, d.name) for d in changes.dropins_to_delete] == [
        ("kubelet.service", "10-a.conf")
    ]
    assert changes.reasons() == [
        "kubelet.service restarts because its drop-in 10-a.conf was removed"
    ]


def test_removed_file_is_deleted_and_restarts_units_that_listed_it() -> None:
    a = make([text_file(KUBELET_CONFIG, "v1")], [kubelet()])
    b = make([], [kubelet(filePaths=[])])
    changes = plan(a, b, HOST)
    assert [(d.path, d.reason) for d in changes.files_to_delete] == [
        (KUBELET_CONFIG, "removed from the OSC")
    ]
    assert changes.reasons() == [
        "kubelet.service restarts because /var/lib/kubelet/config/kubelet was removed"
    ]


def test_reordered_or_extended_file_paths_alone_do_not_restart() -> None:
    files = [text_file("/etc/a", "a"), text_file("/etc/b", "b")]
    a = make(files, [kubelet(filePaths=["/etc/a"])])
    b = make(files, [kubelet(filePaths=["/etc/b", "/etc/a"])])
    assert plan(a, b, HOST).is_empty()


def test_mode_change_is_a_file_change() -> None:
    a = make([text_file("/etc/a", "a", 0o644)])
    b = make([text_file("/etc/a", "a", None)])
    (write,) = plan(a, b, HOST).files_to_write
    assert (write.mode, write.reason) == (0o600, "mode changed from 0644 to 0600")


def test_re_encoding_or_moving_a_file_to_status_is_not_a_change() -> None:
    a = make([text_file("/etc/a", "hello")])
    encoded = {
        "path": "/etc/a",
        "permissions": 0o644,
        "content": {"inline": {"encoding": "b64", "data": "aGVsbG8="}},
    }
    b = make([], extensionFiles=[encoded])
    assert plan(a, b, HOST).is_empty()


def test_files_for_other_hosts_are_ignored_and_moving_away_deletes() -> None:
    a = make([text_file("/etc/a", "a", hostName=HOST)])
    b = make([text_file("/etc/a", "a", hostName="node-b")])
    assert plan(None, b, HOST).is_empty()
    assert [d.path for d in plan(a, b, HOST).files_to_delete] == ["/etc/a"]


def secret_file(path: str, name: str = "s", key: str = "k") -> dict[str, Any]:
    return {"path": path, "content": {"secretRef": {"name": name, "dataKey": key}}}


def test_secret_ref_content_must_be_resolved_by_the_caller() -> None:
    with pytest.raises(SecretRefError) as info:
        plan(None, make([secret_file("/etc/token", "tok", "token")]), HOST)
    assert (info.value.secret_name, info.value.data_key, info.value.path) == (
        "tok",
        "token",
        "/etc/token",
    )
    assert "/etc/token" in str(info.value)
    assert "tok" in str(info.value)


def test_secret_ref_content_changes_are_seen_when_previous_bytes_are_known() -> None:
    osc = make([secret_file("/etc/token")], [kubelet(filePaths=["/etc/token"])])
    changes = plan(osc, osc, HOST, {"/etc/token": b"new"}, previous_resolved={"/etc/token": b"old"})
    assert [(w.path, w.content) for w in changes.files_to_write] == [("/etc/token", b"new")]
    assert changes.reasons() == ["kubelet.service restarts because /etc/token changed"]


def test_secret_ref_without_previous_bytes_compares_the_reference_like_upstream() -> None:
    a = make([secret_file("/etc/token", "s1")])
    assert plan(a, a, HOST, {"/etc/token": b"x"}).is_empty()
    b = make([secret_file("/etc/token", "s2")])
    (write,) = plan(a, b, HOST, {"/etc/token": b"x"}).files_to_write
    assert write.reason == "content source changed"


def test_inline_to_secret_with_same_bytes_is_not_a_change() -> None:
    a = make([text_file("/etc/token", "x", None)])
    b = make([secret_file("/etc/token")])
    assert plan(a, b, HOST, {"/etc/token": b"x"}).is_empty()


def test_image_ref_change_is_a_file_change_without_bytes() -> None:
    def binary(tag: str) -> dict[str, Any]:
        return {
            "path": "/opt/bin/kubelet",
            "permissions": 0o755,
            "content": {"imageRef": {"image": f"hyperkube:{tag}", "filePathInImage": "/kubelet"}},
        }

    (write,) = plan(make([binary("v1")]), make([binary("v2")]), HOST).files_to_write
    assert write.content is None
    assert write.sha256 is None
    assert write.image_ref is not None
    assert write.image_ref.image == "hyperkube:v2"
    assert write.reason == "image reference changed"


def test_written_files_carry_a_sha256_of_their_content() -> None:
    (write,) = plan(None, make([text_file("/etc/a", "hello")]), HOST).files_to_write
    assert write.sha256 == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"


def agent_unit(**extra: Any) -> dict[str, Any]:
    return {
        "name": AGENT_UNIT,
        "enable": True,
        "content": "[Service]\n",
        "filePaths": ["/opt/bin/gardener-node-agent"],
        **extra,
    }


def test_agent_unit_restarts_last_and_is_flagged() -> None:
    files = [text_file("/opt/bin/gardener-node-agent", "v1")]
    new_files = [text_file("/opt/bin/gardener-node-agent", "v2")]
    units = [agent_unit(), kubelet(), {"name": "zz.service", "content": "c"}]
    changes = plan(
        make(files, units),
        make(new_files, [*units[:2], {"name": "zz.service", "content": "d"}]),
        HOST,
    )
    assert [c.unit for c in changes.unit_commands] == ["zz.service", AGENT_UNIT]
    assert changes.unit_commands[-1].is_agent
    assert changes.restarts_agent


def test_agent_unit_is_never_stopped_or_disabled() -> None:
    changes = plan(
        make(units=[agent_unit()]), make(units=[agent_unit(enable=False, command="stop")]), HOST
    )
    (cmd,) = changes.unit_commands
    assert (cmd.action, cmd.is_agent) == ("restart", True)
    assert changes.units_to_enable == (AGENT_UNIT,)
    assert changes.units_to_disable == ()
    assert "never stopped" in cmd.describe()


def test_agent_unit_removed_from_the_osc_is_left_alone() -> None:
    assert plan(make(units=[agent_unit()]), make(), HOST).is_empty()


def test_custom_agent_unit_name() -> None:
    changes = plan(
        None,
        make(units=[{"name": "my-agent.service", "content": "c"}, kubelet()]),
        HOST,
        agent_unit="my-agent.service",
    )
    assert [c.unit for c in changes.unit_commands] == ["kubelet.service", "my-agent.service"]
    assert changes.agent_unit == "my-agent.service"


def test_summary_renders_one_row_per_action() -> None:
    a = make([text_file(KUBELET_CONFIG, "v1"), text_file("/etc/old", "o")], [kubelet()])
    b = make([text_file(KUBELET_CONFIG, "v2")], [kubelet()])
    lines = plan(a, b, HOST).summary().splitlines()
    assert lines[0].split() == ["ACTION", "TARGET", "REASON"]
    assert lines[1].split()[:2] == ["write", KUBELET_CONFIG]
    assert any(line.split()[:2] == ["restart", "kubelet.service"] for line in lines)
    assert lines[-1].split()[:2] == ["delete", "/etc/old"]


def test_json_encodes_file_bytes_as_base64() -> None:
    changes = plan(
        None,
        make([{"path": "/etc/bin", "content": {"inline": {"encoding": "b64", "data": "/wA="}}}]),
        HOST,
    )
    doc = json.loads(changes.to_json())
    assert doc["files_to_write"][0]["content"] == "/wA="
    assert ChangeSet.from_json(changes.to_json()).files_to_write[0].content == b"\xff\x00"
