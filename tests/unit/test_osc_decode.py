"""Decoding and validation of osc.yaml: the realistic happy path and every rejected input."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from node_agent.base import layout
from node_agent.base.errors import (
    OSCChecksumError,
    OSCDecodeError,
    OSCError,
    OSCValidationError,
)
from node_agent.config import BOOTSTRAP_TOKEN_FILE, KUBECONFIG_FILE, TOKEN_FILE
from node_agent.osc import decode, decode_osc, osc_files, osc_units, parse_osc, plan, secret_refs
from node_agent.osc.decode import MAX_OSC_BYTES, decode_inline, validate_osc
from node_agent.osc.models import InlineContent, OperatingSystemConfig

DATA = Path(__file__).parent / "data"


def sha(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def minimal() -> dict[str, Any]:
    return {
        "apiVersion": "extensions.gardener.cloud/v1alpha1",
        "kind": "OperatingSystemConfig",
        "metadata": {"name": "osc", "namespace": "kube-system"},
        "spec": {
            "type": "debian",
            "purpose": "reconcile",
            "files": [
                {
                    "path": "/etc/motd",
                    "permissions": 0o644,
                    "content": {"inline": {"encoding": "", "data": "hello\n"}},
                }
            ],
            "units": [
                {"name": "motd.service", "content": "[Service]\n", "filePaths": ["/etc/motd"]}
            ],
        },
    }


def decode_doc(doc: dict[str, Any], host_name: str | None = None) -> OperatingSystemConfig:
    raw = yaml.safe_dump(doc).encode()
    return decode_osc(raw, sha(raw), host_name)


# --- the realistic Gardener document ---------------------------------------------------------


@pytest.fixture
def realistic_raw() -> bytes:
    return (DATA / "osc-realistic.yaml").read_bytes()


def test_realistic_osc_decodes_with_merged_units_and_host_files(realistic_raw: bytes) -> None:
    osc = decode_osc(realistic_raw, sha(realistic_raw), "node-a")

    assert osc.metadata.name == "worker-pool-a-original"
    assert osc.spec.purpose == "reconcile"
    assert osc.spec.cri_config is not None
    assert osc.spec.cri_config.containerd is not None
    assert osc.spec.cri_config.containerd["sandboxImage"] == "registry.k8s.io/pause:3.10"
    assert osc.spec.in_place_updates is not None
    assert osc.spec.in_place_updates.kubelet == "1.31.4"
    assert osc.status.in_place_updates is not None
    assert osc.status.in_place_updates.os_update == {
        "command": "/opt/gardener/bin/os-update.sh",
        "args": ["--version", "1592.4.0"],
    }

    units = {u.name: u for u in osc_units(osc)}
    assert sorted(units) == [
        "containerd-logrotate.timer",
        "containerd.service",
        "gardener-node-agent.service",
        "kubelet.service",
        "update-ca-certificates.service",
    ]
    kubelet = units["kubelet.service"]
    assert kubelet.command == "start"
    assert kubelet.enable is True
    assert kubelet.content is not None
    assert "ExecStart=/opt/bin/kubelet" in kubelet.content
    assert [d.name for d in kubelet.drop_ins] == ["12-provider.conf"]
    assert kubelet.file_paths[-1] == "/opt/gardener/credential-provider.yaml"
    assert "/var/lib/kubelet/config/kubelet" in kubelet.file_paths
    containerd = units["containerd.service"]
    assert containerd.content is None
    assert [d.name for d in containerd.drop_ins] == ["11-exec_config.conf", "12-ulimits.conf"]

    files = {f.path: f for f in osc_files(osc, "node-a")}
    assert files["/var/lib/kubelet/config/kubelet"].permissions == 0o600
    assert files["/opt/bin/kubelet"].content.image_ref is not None
    assert "/opt/gardener/credential-provider.yaml" in files
    hint = files["/var/lib/gardener-node-agent/zone-hint"].content.inline
    assert hint is not None
    assert hint.data == "zone-a"
    assert secret_refs(osc, "node-a")["/etc/kubernetes/admin.kubeconfig"].data_key == "kubeconfig"

    inline = files["/var/lib/kubelet/config/kubelet"].content.inline
    assert inline is not None
    config = yaml.safe_load(decode_inline(inline, path="/var/lib/kubelet/config/kubelet"))
    assert config["kind"] == "KubeletConfiguration"


def test_realistic_osc_plans_a_first_apply(realistic_raw: bytes) -> None:
    osc = decode_osc(realistic_raw, sha(realistic_raw), "node-a")
    kubeconfig = b"apiVersion: v1\nkind: Config\n"

    changes = plan(None, osc, "node-a", {"/etc/kubernetes/admin.kubeconfig": kubeconfig})

    writes = {w.path: w for w in changes.files_to_write}
    assert writes["/etc/kubernetes/admin.kubeconfig"].content == kubeconfig
    assert writes["/etc/kubernetes/admin.kubeconfig"].mode == 0o600
    assert writes["/opt/bin/kubelet"].image_ref is not None
    assert writes["/opt/bin/kubelet"].content is None
    assert writes["/var/lib/gardener-node-agent/zone-hint"].content == b"zone-a"
    assert writes["/var/lib/gardener-node-agent/zone-hint"].mode == 0o600  # upstream default
    assert [d.name for d in changes.dropins_to_write if d.unit == "containerd.service"] == [
        "11-exec_config.conf",
        "12-ulimits.conf",
    ]
    assert "containerd.service" not in {u.name for u in changes.units_to_write}
    last = changes.unit_commands[-1]
    assert (last.unit, last.action, last.is_agent) == (
        "gardener-node-agent.service",
        "restart",
        True,
    )
    assert changes.restarts_agent
    assert not changes.files_to_delete
    assert not changes.units_to_delete


def test_realistic_osc_without_host_keeps_per_host_files_apart(realistic_raw: bytes) -> None:
    osc = decode_osc(realistic_raw, sha(realistic_raw))
    paths = [f.path for f in osc.spec.files]
    assert paths.count("/var/lib/gardener-node-agent/zone-hint") == 2


# --- accepted variations -------------------------------------------------------------------------


def test_json_is_accepted_and_unknown_fields_ignored() -> None:
    doc = minimal()
    doc["spec"]["futureField"] = {"x": 1}
    doc["spec"]["files"][0]["futureFileField"] = True
    raw = json.dumps(doc).encode()
    osc = decode_osc(raw, sha(raw))
    assert osc.spec.files[0].path == "/etc/motd"
    assert osc.spec.files[0].permissions == 0o644


def test_yaml_octal_permissions_are_read_as_octal() -> None:
    raw = yaml.safe_dump(minimal()).replace("permissions: 420", "permissions: 0644").encode()
    assert b"0644" in raw
    assert decode_osc(raw, sha(raw)).spec.files[0].permissions == 0o644


def test_checksum_comparison_ignores_case_and_whitespace() -> None:
    raw = yaml.safe_dump(minimal()).encode()
    assert decode_osc(raw, f" {sha(raw).upper()}\n").spec.units[0].name == "motd.service"


def test_base64_with_line_breaks_is_accepted() -> None:
    text = b"x" * 200
    wrapped = "\n".join(base64.b64encode(text).decode()[i : i + 76] for i in range(0, 272, 76))
    inline = InlineContent(encoding="b64", data=wrapped + "\n")
    assert decode_inline(inline, path="/etc/x") == text


def test_to_dict_round_trips_through_parse() -> None:
    osc = decode_doc(minimal())
    again = parse_osc(yaml.safe_dump(osc.to_dict()).encode())
    assert again == osc


# --- rejected inputs -----------------------------------------------------------------------------


def test_malformed_yaml_is_a_decode_error() -> None:
    raw = b"apiVersion: [unclosed\nkind: OperatingSystemConfig\n"
    with pytest.raises(OSCDecodeError, match="not valid YAML"):
        decode_osc(raw, sha(raw))


def test_non_mapping_document_is_a_decode_error() -> None:
    raw = b"- just\n- a list\n"
    with pytest.raises(OSCDecodeError, match="must hold a mapping, not list"):
        decode_osc(raw, sha(raw))


@pytest.mark.parametrize(
    ("field", "value"),
    [("apiVersion", "extensions.gardener.cloud/v1beta1"), ("kind", "Worker")],
)
def test_wrong_api_version_or_kind_is_a_decode_error(field: str, value: str) -> None:
    doc = minimal()
    doc[field] = value
    with pytest.raises(OSCDecodeError, match=value):
        decode_doc(doc)


def test_checksum_mismatch_is_rejected() -> None:
    raw = yaml.safe_dump(minimal()).encode()
    wrong = sha(raw + b" ")
    with pytest.raises(OSCChecksumError) as info:
        decode_osc(raw, wrong)
    assert info.value.expected == wrong
    assert info.value.actual == sha(raw)
    assert wrong in str(info.value)
    assert sha(raw) in str(info.value)


@pytest.mark.parametrize("checksum", [None, "", "  "])
def test_missing_checksum_is_rejected(checksum: str | None) -> None:
    raw = yaml.safe_dump(minimal()).encode()
    with pytest.raises(OSCChecksumError, match="no checksum/data-script annotation"):
        decode_osc(raw, checksum)


def test_osc_over_one_mebibyte_is_rejected_before_parsing() -> None:
    doc = minimal()
    doc["spec"]["files"][0]["content"]["inline"]["data"] = "x" * MAX_OSC_BYTES
    raw = yaml.safe_dump(doc).encode()
    with pytest.raises(OSCDecodeError, match=f"over the limit of {MAX_OSC_BYTES}"):
        decode_osc(raw, sha(raw))


def test_osc_of_exactly_one_mebibyte_is_accepted() -> None:
    base = yaml.safe_dump(minimal()).encode()
    raw = base + b"#" + b"x" * (MAX_OSC_BYTES - len(base) - 2) + b"\n"
    assert len(raw) == MAX_OSC_BYTES
    assert decode_osc(raw, sha(raw)).spec.files[0].path == "/etc/motd"


def with_file(**changes: Any) -> dict[str, Any]:
    doc = minimal()
    doc["spec"]["files"][0].update(changes)
    return doc


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("etc/motd", "is not absolute"),
        ("/etc/../root/.ssh/authorized_keys", "contains a '..' segment"),
        ("/..", "contains a '..' segment"),
        ("/etc/mo\x00td", "contains a NUL byte"),
        ("/etc//motd", "is not normalized"),
        ("/etc/./motd", "is not normalized"),
        ("//etc/motd", "is not normalized"),
        ("/etc/motd/", "names a directory"),
        ("/", "names a directory"),
        ("", "is not absolute"),
    ],
)
def test_bad_file_paths_are_rejected(path: str, why: str) -> None:
    with pytest.raises(OSCValidationError, match=why) as info:
        decode_doc(with_file(path=path))
    assert info.value.field == "spec.files[0].path"
    assert info.value.item == path
    assert repr(path) in str(info.value)


@pytest.mark.parametrize("name", ["etc/kubelet.service", "../x.service", "a/b.conf"])
def test_unit_names_with_slash_are_rejected(name: str) -> None:
    doc = minimal()
    doc["spec"]["units"][0]["name"] = name
    with pytest.raises(OSCValidationError, match="contains '/'") as info:
        decode_doc(doc)
    assert info.value.field == "spec.units[0].name"
    assert info.value.item == name


@pytest.mark.parametrize(
    "name",
    ["kubelet", "kubelet.conf", "kubelet.Service", ".service", "ku belet.service", "a@b@c.service"],
)
def test_unit_names_without_valid_suffix_or_chars_are_rejected(name: str) -> None:
    doc = minimal()
    doc["status"] = {"extensionUnits": [{"name": name, "content": "x"}]}
    with pytest.raises(OSCValidationError, match="not a valid systemd unit name") as info:
        decode_doc(doc)
    assert info.value.field == "status.extensionUnits[0].name"


@pytest.mark.parametrize(
    "name",
    [
        "kubelet.service",
        "getty@tty1.service",
        "getty@.service",
        "var-lib.mount",
        "x.device",
        "a.swap",
    ],
)
def test_valid_unit_names_are_accepted(name: str) -> None:
    doc = minimal()
    doc["spec"]["units"][0]["name"] = name
    assert decode_doc(doc).spec.units[0].name == name


def test_over_long_unit_name_is_rejected() -> None:
    doc = minimal()
    doc["spec"]["units"][0]["name"] = "a" * 250 + ".service"
    with pytest.raises(OSCValidationError, match="longer than 255"):
        decode_doc(doc)


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("sub/10-x.conf", "contains '/'"),
        ("10-x.txt", "ending in .conf"),
        (".conf", "ending in .conf"),
    ],
)
def test_bad_drop_in_names_are_rejected(name: str, why: str) -> None:
    doc = minimal()
    doc["spec"]["units"][0]["dropIns"] = [{"name": name, "content": "[Service]\n"}]
    with pytest.raises(OSCValidationError, match=why) as info:
        decode_doc(doc)
    assert info.value.field == "spec.units[0].dropIns[0].name"
    assert "motd.service" in str(info.value)


@pytest.mark.parametrize("encoding", ["base64", "gzip+b64", "B64"])
def test_unknown_encoding_is_rejected(encoding: str) -> None:
    doc = with_file(content={"inline": {"encoding": encoding, "data": "aGk="}})
    with pytest.raises(
        OSCValidationError, match=re.escape(f"unknown content encoding '{encoding}'")
    ) as info:
        decode_doc(doc)
    assert info.value.item == "/etc/motd"
    assert "/etc/motd" in str(info.value)


@pytest.mark.parametrize("data", ["not base64!", "aGk", "aG=k", "aGk=\t"])
def test_invalid_base64_is_rejected(data: str) -> None:
    doc = with_file(content={"inline": {"encoding": "b64", "data": data}})
    with pytest.raises(OSCValidationError, match="file /etc/motd: content is not valid base64"):
        decode_doc(doc)


@pytest.mark.parametrize("permissions", [-1, 0o10000, 2**31 - 1])
def test_permissions_outside_range_are_rejected(permissions: int) -> None:
    with pytest.raises(OSCValidationError, match=re.escape("outside 0..0o7777")) as info:
        decode_doc(with_file(permissions=permissions))
    assert info.value.field == "spec.files[0].permissions"


@pytest.mark.parametrize("permissions", [0, 0o7777, 0o4755])
def test_permissions_at_the_bounds_are_accepted(permissions: int) -> None:
    assert decode_doc(with_file(permissions=permissions)).spec.files[0].permissions == permissions


def test_same_path_twice_is_rejected_across_spec_and_status() -> None:
    doc = minimal()
    doc["status"] = {"extensionFiles": [copy.deepcopy(doc["spec"]["files"][0])]}
    with pytest.raises(OSCValidationError, match="file /etc/motd is defined more than once"):
        decode_doc(doc)


def test_same_path_for_this_host_and_all_hosts_is_rejected_only_on_this_host() -> None:
    doc = minimal()
    host_file = copy.deepcopy(doc["spec"]["files"][0]) | {"hostName": "node-a"}
    doc["spec"]["files"].append(host_file)
    with pytest.raises(OSCValidationError, match="more than once on host node-a"):
        decode_doc(doc, "node-a")
    with pytest.raises(OSCValidationError, match="more than once"):
        decode_doc(doc)  # without a host, any host could get both
    assert [f.path for f in osc_files(decode_doc(doc, "node-b"), "node-b")] == ["/etc/motd"]


def test_file_without_content_source_is_rejected() -> None:
    with pytest.raises(OSCValidationError, match="exactly one of inline, secretRef, imageRef"):
        decode_doc(with_file(content={}))


def test_file_with_two_content_sources_is_rejected() -> None:
    content = {"inline": {"encoding": "", "data": "x"}, "secretRef": {"name": "s", "dataKey": "k"}}
    with pytest.raises(OSCValidationError, match=r"\(found 2\)"):
        decode_doc(with_file(content=content))


def test_secret_ref_with_empty_key_is_rejected() -> None:
    with pytest.raises(OSCValidationError, match="secretRef needs both name and dataKey"):
        decode_doc(with_file(content={"secretRef": {"name": "s", "dataKey": ""}}))


def test_schema_errors_name_the_item() -> None:
    doc = minimal()
    doc["spec"]["units"][0]["command"] = "reload"
    with pytest.raises(OSCValidationError, match=r"spec\.units\[0\]\.command \(motd\.service\)"):
        decode_doc(doc)
    doc = with_file(permissions="rw-r--r--")
    with pytest.raises(OSCValidationError, match=r"spec\.files\[0\]\.permissions \(/etc/motd\)"):
        decode_doc(doc)


def test_file_missing_path_is_a_validation_error() -> None:
    doc = minimal()
    del doc["spec"]["files"][0]["path"]
    with pytest.raises(OSCValidationError, match=r"spec\.files\[0\]\.path"):
        decode_doc(doc)


def test_every_osc_input_error_is_an_osc_error() -> None:
    raw = b"{"
    with pytest.raises(OSCError):
        decode_osc(raw, sha(raw))


def test_validate_osc_checks_models_built_in_code() -> None:
    osc = OperatingSystemConfig.model_validate(with_file(path="relative"))
    with pytest.raises(OSCValidationError, match="is not absolute"):
        validate_osc(osc)


# --- limits on the shape of the YAML (nesting, aliases), with both loaders -----------------------

HEAD = "apiVersion: extensions.gardener.cloud/v1alpha1\nkind: OperatingSystemConfig\n"


def nested(kind: str, levels: int) -> bytes:
    """A valid OSC whose ``spec.x`` holds ``levels`` nested collections (the root and ``spec``
    are two more levels)."""
    if kind == "flow-seq":
        text = HEAD + "spec:\n  x: " + "[" * levels + "]" * levels + "\n"
    elif kind == "flow-map":
        text = HEAD + "spec:\n  x: " + "{a: " * levels + "b" + "}" * levels + "\n"
    elif kind == "json":
        text = (
            '{"apiVersion": "extensions.gardener.cloud/v1alpha1", "kind": "OperatingSystemConfig", '
            '"spec": {"x": ' + '{"a": ' * levels + "1" + "}" * levels + "}}"
        )
    elif kind == "block-seq":
        text = HEAD + "spec:\n  x:\n  " + "- " * levels + "a\n"
    elif kind == "block-key":
        text = HEAD + "spec:\n  x:\n    " + "? " * levels + "a\n"
    elif kind == "block-indent":
        text = HEAD + "spec:\n  x:\n" + "".join(" " * (i + 4) + "a:\n" for i in range(levels))
    else:
        raise AssertionError(kind)
    return text.encode()


SHAPES = ["flow-seq", "flow-map", "json", "block-seq", "block-key", "block-indent"]


# Mappings as keys cannot be built into a dict: only the refusal is tested for "block-key".
@pytest.mark.parametrize("kind", [kind for kind in SHAPES if kind != "block-key"])
def test_nesting_up_to_the_limit_is_accepted(kind: str, loader: str) -> None:
    raw = nested(kind, decode.MAX_NESTING_DEPTH - 2)
    assert decode_osc(raw, sha(raw)).spec.files == ()


@pytest.mark.parametrize("kind", SHAPES)
@pytest.mark.parametrize("levels", [decode.MAX_NESTING_DEPTH - 1, 1000])
def test_nesting_over_the_limit_is_refused_before_composing(
    kind: str, levels: int, loader: str
) -> None:
    raw = nested(kind, levels)
    with pytest.raises(
        OSCDecodeError, match=r"nests collections deeper than 64 levels \(line \d+\)"
    ):
        decode_osc(raw, sha(raw))


def test_nesting_limit_is_far_above_a_real_osc(realistic_raw: bytes) -> None:
    assert decode.MAX_NESTING_DEPTH >= 64
    decode.check_structure(realistic_raw)  # the realistic OSC nests 9 levels


def test_aliases_count_with_the_depth_of_what_they_repeat(loader: str) -> None:
    # The root mapping, 33 or 34 sequences, then *a0 standing for 30 more: 64 and 65 levels,
    # although no line of the document itself nests deeper than 35.
    anchor = HEAD + "a0: &a0 " + "[" * 30 + "]" * 30 + "\n"
    ok = (anchor + "x: " + "[" * 33 + "*a0" + "]" * 33 + "\n").encode()
    assert decode_osc(ok, sha(ok)).spec.files == ()
    raw = (anchor + "x: " + "[" * 34 + "*a0" + "]" * 34 + "\n").encode()
    with pytest.raises(OSCDecodeError, match=r"alias \*a0 \(line 4\) nests collections deeper"):
        decode_osc(raw, sha(raw))


def test_alias_expansion_is_bounded(loader: str) -> None:
    text = HEAD + "l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n"
    for i in range(1, 9):  # 10**9 values once expanded, from 1 KB of YAML
        text += f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]\n"
    raw = text.encode()
    with pytest.raises(OSCDecodeError, match="more than 1048576 values once its aliases"):
        decode_osc(raw, sha(raw))


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("metadata: &m {x: [*m]}\n", r"alias \*m \(line 3\) repeats a node inside itself"),
        ("metadata: *m\n", r"alias \*m \(line 3\) has no anchor &m before it"),
    ],
)
def test_cyclic_and_dangling_aliases_are_refused(body: str, why: str, loader: str) -> None:
    raw = (HEAD + body).encode()
    with pytest.raises(OSCDecodeError, match=why):
        decode_osc(raw, sha(raw))


def test_anchors_and_merge_keys_within_limits_are_accepted(loader: str) -> None:
    raw = (
        HEAD
        + "spec:\n"
        + "  files:\n"
        + "  - &motd {path: /etc/motd, permissions: 0644, content: {inline: {data: hi}}}\n"
        + "  - <<: *motd\n"
        + "    path: /etc/issue\n"
    ).encode()
    files = decode_osc(raw, sha(raw)).spec.files
    assert [(f.path, f.permissions) for f in files] == [("/etc/motd", 0o644), ("/etc/issue", 0o644)]


# --- duplicate keys ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (
            (HEAD + "spec:\n  files: []\n  type: a\n  files: []\n").encode(),
            "the mapping key 'files' twice (lines 4 and 6)",
        ),
        (
            (
                HEAD + "spec:\n  units:\n  - {name: a.service, enable: true, name: b.service}\n"
            ).encode(),
            "the mapping key 'name' twice (line 5, columns 6 and 37)",
        ),
        (
            b'{"apiVersion": "extensions.gardener.cloud/v1alpha1", "kind": "OperatingSystemConfig",'
            b'\n "spec": {"type": "a",\n  "type": "b"}}',
            "the mapping key 'type' twice (lines 2 and 3)",
        ),
        (
            (HEAD + "kind: OperatingSystemConfig\n").encode(),
            "the mapping key 'kind' twice (lines 2 and 3)",
        ),
    ],
)
def test_duplicate_mapping_keys_are_refused_with_key_and_lines(
    raw: bytes, why: str, loader: str
) -> None:
    with pytest.raises(OSCDecodeError, match=re.escape(why)):
        decode_osc(raw, sha(raw))


def test_duplicate_key_inside_a_file_entry_is_refused(loader: str) -> None:
    raw = osc_with().replace(b"  - path: /etc/motd\n", b"  - path: /etc/motd\n    path: /etc/x\n")
    assert raw.count(b"path:") == 2
    with pytest.raises(
        OSCDecodeError, match=re.escape("the mapping key 'path' twice (lines 5 and 6)")
    ):
        decode_osc(raw, sha(raw))


def test_keys_of_different_types_are_not_duplicates(loader: str) -> None:
    raw = (HEAD + "metadata:\n  labels: {1: a, '1': b}\n").encode()
    assert decode_osc(raw, sha(raw)).metadata.model_dump()["labels"] == {1: "a", "1": "b"}


# --- scalar types as upstream reads them ---------------------------------------------------------


def osc_with(file_line: str = "", unit_line: str = "") -> bytes:
    return (
        HEAD
        + "spec:\n  files:\n  - path: /etc/motd\n"
        + (f"    {file_line}\n" if file_line else "")
        + "    content: {inline: {data: hi}}\n"
        + "  units:\n  - name: motd.service\n"
        + (f"    {unit_line}\n" if unit_line else "")
    ).encode()


@pytest.mark.parametrize(
    ("value", "got"),
    [
        ('"0644"', "the string '0644'"),
        ("'420'", "the string '420'"),
        ("true", "the boolean true"),
        ("false", "the boolean false"),
        ("y", "the boolean true"),
        ("420.0", "the float 420.0"),
        ("420.5", "the float 420.5"),
        ("0644.0", "the float 644.0"),
        ("1:30", "the string '1:30'"),  # base 60 in YAML 1.1, a string to upstream
        ("rw-r--r--", "the string 'rw-r--r--'"),
        ("[420]", "a list"),
        ("{mode: 420}", "a mapping"),
    ],
)
def test_permissions_that_are_not_integers_are_refused(value: str, got: str) -> None:
    raw = osc_with(f"permissions: {value}")
    with pytest.raises(OSCValidationError) as info:
        decode_osc(raw, sha(raw))
    assert str(info.value) == (
        "spec.files[0].permissions (/etc/motd): permissions must be an integer "
        f"(octal in YAML such as 0644, or 420), got {got}"
    )
    assert info.value.field == "spec.files[0].permissions (/etc/motd)"
    assert info.value.item == "/etc/motd"


@pytest.mark.parametrize("value", ["0644", "0o644", "0x1a4", "420", "+420", "0b110100100", "4_20"])
def test_integer_permissions_in_every_spelling_upstream_reads(value: str) -> None:
    raw = osc_with(f"permissions: {value}")
    assert decode_osc(raw, sha(raw)).spec.files[0].permissions == 0o644


@pytest.mark.parametrize("permissions", [-0o644, 0o10000, 2**32])
def test_permissions_out_of_range_name_the_file_in_octal(permissions: int) -> None:
    raw = osc_with(f"permissions: {permissions}")
    with pytest.raises(OSCValidationError) as info:
        decode_osc(raw, sha(raw))
    assert str(info.value) == (
        f"file /etc/motd: permissions {permissions} ({decode._octal(permissions)}) "
        "are outside 0..0o7777"
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", True), ("y", True), ("Yes", True), ("on", True), ("false", False), ("n", False)],
)
def test_enable_takes_the_booleans_upstream_reads(value: str, expected: bool) -> None:
    raw = osc_with(unit_line=f"enable: {value}")
    assert decode_osc(raw, sha(raw)).spec.units[0].enable is expected


@pytest.mark.parametrize(
    ("value", "got"),
    [
        ('"true"', "the string 'true'"),
        ("1", "the integer 1"),
        ("0", "the integer 0"),
        ("yess", "the string 'yess'"),
    ],
)
def test_enable_that_is_not_a_boolean_is_refused(value: str, got: str) -> None:
    raw = osc_with(unit_line=f"enable: {value}")
    with pytest.raises(OSCValidationError) as info:
        decode_osc(raw, sha(raw))
    assert str(info.value) == (
        f"spec.units[0].enable (motd.service): Input should be a valid boolean, got {got}"
    )


def test_transmit_unencoded_must_be_a_boolean() -> None:
    raw = osc_with().replace(b"content: {inline", b"content: {transmitUnencoded: 'yes', inline")
    with pytest.raises(OSCValidationError, match=r"transmitUnencoded \(/etc/motd\): .*boolean"):
        decode_osc(raw, sha(raw))


@pytest.mark.parametrize(
    ("value", "got"), [("reload", "the string 'reload'"), ("1", "the integer 1")]
)
def test_command_outside_start_restart_stop_is_refused(value: str, got: str) -> None:
    raw = osc_with(unit_line=f"command: {value}")
    with pytest.raises(OSCValidationError) as info:
        decode_osc(raw, sha(raw))
    assert str(info.value) == (
        "spec.units[0].command (motd.service): Input should be 'start', 'restart' or 'stop', "
        f"got {got}"
    )


def test_plain_dates_and_base60_numbers_stay_strings_as_upstream_reads_them() -> None:
    raw = (HEAD + "metadata:\n  creationTimestamp: 2026-13-45\n  clock: 1:30\n").encode()
    meta = decode_osc(raw, sha(raw)).metadata.model_dump()
    assert (meta["creationTimestamp"], meta["clock"]) == ("2026-13-45", "1:30")


def test_an_unreadable_tagged_value_is_a_decode_error() -> None:
    raw = (HEAD + "metadata: {x: !!int abc}\n").encode()
    with pytest.raises(OSCDecodeError, match="has a value that cannot be read: invalid literal"):
        decode_osc(raw, sha(raw))


# --- what the file system can hold ---------------------------------------------------------------


def path_error(path: str) -> OSCValidationError:
    with pytest.raises(OSCValidationError) as info:
        decode_doc(with_file(path=path))
    assert info.value.field == "spec.files[0].path"
    assert info.value.item == path
    return info.value


def test_path_component_over_255_bytes_is_refused() -> None:
    err = path_error("/etc/" + "é" * 128)  # 128 characters, 256 bytes
    assert "has a component of 256 bytes" in str(err)
    assert "over the file system's limit of 255" in str(err)
    assert decode_doc(with_file(path="/etc/" + "x" * 255)).spec.files[0].path.endswith("x")


def test_path_over_4095_bytes_is_refused() -> None:
    path = "/" + "/".join(["d" * 200] * 20) + "/" + "f" * 74
    assert len(path) == 4095
    assert decode_doc(with_file(path=path)).spec.files[0].path == path
    err = path_error(path + "f")
    assert "is 4096 bytes long, over the limit of 4095" in str(err)
    assert len(str(err)) < 300  # the path is shortened in the message


def test_path_with_too_many_components_is_refused() -> None:
    assert decode_doc(with_file(path="/d" * 64)).spec.files[0].path == "/d" * 64
    err = path_error("/d" * 65)
    assert "has 65 components, over the limit of 64" in str(err)


def test_ten_thousand_component_path_is_refused() -> None:
    err = path_error("/d" * 10_000)
    assert "over the limit of 4095" in str(err)


def test_path_that_is_not_utf8_is_refused() -> None:
    osc = OperatingSystemConfig.model_validate(with_file(path="/etc/\udc80"))
    with pytest.raises(OSCValidationError, match="is not valid UTF-8 text"):
        validate_osc(osc)


def with_unit(**changes: Any) -> dict[str, Any]:
    doc = minimal()
    doc["spec"]["units"][0].update(changes)
    return doc


def test_unit_name_whose_drop_in_directory_is_over_255_bytes_is_refused() -> None:
    fits, too_long = "a" * 245 + ".service", "a" * 246 + ".service"
    drop_ins = [{"name": "10-a.conf", "content": "[Service]\n"}]
    assert decode_doc(with_unit(name=fits, dropIns=drop_ins)).spec.units[0].name == fits
    assert decode_doc(with_unit(name=too_long)).spec.units[0].name == too_long  # no drop-ins
    with pytest.raises(OSCValidationError) as info:
        decode_doc(with_unit(name=too_long, dropIns=drop_ins))
    assert str(info.value) == (
        f"unit name '{'a' * 75}'... (254 characters) is too long for drop-ins: its directory "
        "(the name and '.d') would be 256 bytes, over the file system's limit of 255"
    )
    assert info.value.field == "spec.units[0].name"
    assert info.value.item == too_long


def test_drop_in_of_an_extension_unit_counts_for_the_spec_unit_of_that_name() -> None:
    name = "a" * 246 + ".service"
    doc = with_unit(name=name)
    drop_in = {"name": "10-a.conf", "content": "[Service]\n"}
    doc["status"] = {"extensionUnits": [{"name": name, "dropIns": [drop_in]}]}
    with pytest.raises(OSCValidationError, match="is too long for drop-ins"):
        decode_doc(doc)


def test_drop_in_name_over_255_bytes_is_refused() -> None:
    fits, too_long = "d" * 250 + ".conf", "d" * 251 + ".conf"
    drop_in = {"content": "[Service]\n"}
    assert decode_doc(with_unit(dropIns=[{**drop_in, "name": fits}])).spec.units[0].drop_ins
    with pytest.raises(OSCValidationError) as info:
        decode_doc(with_unit(dropIns=[{**drop_in, "name": too_long}]))
    assert str(info.value).endswith(
        "of unit motd.service is 256 bytes long, over the file system's limit of 255"
    )
    assert info.value.field == "spec.units[0].dropIns[0].name"


# --- the agent's own files -----------------------------------------------------------------------

STATE = "/var/lib/gardener-node-agent"


@pytest.mark.parametrize(
    "path",
    [
        *(f"{STATE}/{name}" for name in layout.STATE_FILES),
        *(f"{STATE}/{name}.corrupt" for name in layout.STATE_FILES),
    ],
)
def test_file_over_the_agents_state_is_refused(path: str) -> None:
    err = path_error(path)
    assert str(err) == (
        f"file path '{path}' is reserved for the agent's own state ({path}); "
        "an OSC may not write it"
    )


@pytest.mark.parametrize("path", [KUBECONFIG_FILE, TOKEN_FILE, BOOTSTRAP_TOKEN_FILE])
def test_file_over_the_agents_credentials_is_refused(path: str) -> None:
    assert "is reserved for the agent's own credentials" in str(path_error(path))


def test_state_and_credential_names_are_the_ones_the_agent_uses() -> None:
    names = {p.rsplit("/", 1)[1] for p in layout.RESERVED_FILES if "/credentials/" not in p}
    assert names >= {
        "last-applied-osc.yaml",
        "last-applied-osc.meta.json",
        "last-computed-osc-changes.yaml",
        "last-computed-osc-changes.done.json",
        "inventory.json",
        "status.json",
        "inventory.json.corrupt",
    }
    assert {KUBECONFIG_FILE, TOKEN_FILE, BOOTSTRAP_TOKEN_FILE} <= layout.RESERVED_FILES
    assert all(p.startswith(f"{STATE}/") for p in layout.RESERVED_FILES)  # decode relies on it


@pytest.mark.parametrize("path", [STATE, f"{STATE}/credentials"])
def test_file_over_the_agents_directories_is_refused(path: str) -> None:
    assert "is the directory of the agent's own state and credentials" in str(path_error(path))


def test_file_below_a_reserved_file_is_refused() -> None:
    assert "reserved for the agent's own state" in str(path_error(f"{STATE}/inventory.json/x"))


@pytest.mark.parametrize(
    "path",
    [
        f"{STATE}/config-v1.150.0.yaml",
        f"{STATE}/cluster-ca.crt",
        f"{STATE}/machine-name",
        f"{STATE}/zone",
        f"{STATE}/init.sh",
        f"{STATE}/status.json.bak",
    ],
)
def test_other_files_in_the_agents_directory_stay_allowed(path: str) -> None:
    assert decode_doc(with_file(path=path)).spec.files[0].path == path


def test_reserved_path_in_extension_files_is_refused() -> None:
    doc = minimal()
    doc["status"] = {"extensionFiles": [copy.deepcopy(doc["spec"]["files"][0])]}
    doc["status"]["extensionFiles"][0]["path"] = TOKEN_FILE
    with pytest.raises(OSCValidationError, match="reserved") as info:
        decode_doc(doc)
    assert info.value.field == "status.extensionFiles[0].path"


# --- files in the way of the OSC's own units and files -----------------------------------------


def test_file_at_the_unit_file_of_an_osc_unit_is_refused() -> None:
    doc = with_file(path="/etc/systemd/system/motd.service")
    with pytest.raises(OSCValidationError) as info:
        decode_doc(doc)
    assert str(info.value) == (
        "file /etc/systemd/system/motd.service is also the unit file of motd.service in this OSC"
    )
    assert info.value.field == "spec.files[0].path"
    assert info.value.item == "/etc/systemd/system/motd.service"


def test_file_at_a_drop_in_of_an_osc_unit_is_refused() -> None:
    doc = with_file(path="/etc/systemd/system/containerd.service.d/10-a.conf")
    doc["status"] = {
        "extensionUnits": [
            {"name": "containerd.service", "dropIns": [{"name": "10-a.conf", "content": "x"}]}
        ]
    }
    with pytest.raises(OSCValidationError) as info:
        decode_doc(doc)
    assert str(info.value) == (
        "file /etc/systemd/system/containerd.service.d/10-a.conf is also drop-in 10-a.conf of "
        "unit containerd.service in this OSC"
    )


@pytest.mark.parametrize(
    ("path", "why"),
    [
        (
            "/etc/systemd/system/motd.service.d",
            "must stay a directory for drop-in 10-a.conf of unit motd.service in this OSC "
            "(/etc/systemd/system/motd.service.d/10-a.conf)",
        ),
        (
            "/etc/systemd/system",
            "must stay a directory for the unit file of motd.service in this OSC "
            "(/etc/systemd/system/motd.service)",
        ),
        (
            "/etc/systemd/system/motd.service/x",
            "needs /etc/systemd/system/motd.service to be a directory, but it is the unit file "
            "of motd.service in this OSC",
        ),
    ],
)
def test_file_where_a_unit_needs_a_directory_is_refused(path: str, why: str) -> None:
    doc = with_file(path=path)
    doc["spec"]["units"][0]["dropIns"] = [{"name": "10-a.conf", "content": "x"}]
    with pytest.raises(OSCValidationError) as info:
        decode_doc(doc)
    assert str(info.value) == f"file {path} {why}"


def test_file_at_the_unit_path_of_a_unit_without_content_is_allowed() -> None:
    doc = with_file(path="/etc/systemd/system/containerd.service")
    doc["spec"]["units"].append({"name": "containerd.service", "filePaths": ["/etc/motd"]})
    assert decode_doc(doc).spec.files[0].path == "/etc/systemd/system/containerd.service"


def test_file_at_a_unit_path_for_another_host_is_checked_only_for_that_host() -> None:
    doc = with_file(path="/etc/systemd/system/motd.service", hostName="node-b")
    assert decode_doc(doc, "node-a").spec.files[0].host_name == "node-b"
    with pytest.raises(OSCValidationError, match=r"is also the unit file of motd\.service"):
        decode_doc(doc, "node-b")


def test_file_where_another_file_needs_a_directory_is_refused() -> None:
    doc = minimal()
    doc["spec"]["files"].append(copy.deepcopy(doc["spec"]["files"][0]))
    doc["spec"]["files"][1]["path"] = "/etc/motd/extra"
    with pytest.raises(OSCValidationError) as info:
        decode_doc(doc)
    assert str(info.value) == (
        "file /etc/motd/extra needs /etc/motd to be a directory, but /etc/motd is also a file "
        "of this OSC"
    )
    assert info.value.field == "spec.files[1].path"
    doc["spec"]["files"][0]["hostName"] = "node-a"
    doc["spec"]["files"][1]["hostName"] = "node-b"
    assert len(decode_doc(doc).spec.files) == 2  # never on the same host


# --- every refusal is one line -------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"apiVersion: [unclosed\nkind: OperatingSystemConfig\n",
        b"{\n\n",
        nested("block-seq", 30_000),
        osc_with("permissions: '0644'"),
        (HEAD + "spec:\n  a: 1\n  a: 2\n").encode(),
        (HEAD + "metadata: *x\n").encode(),
    ],
)
def test_every_refusal_is_one_line(raw: bytes) -> None:
    with pytest.raises(OSCError) as info:
        decode_osc(raw, sha(raw))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("kubelet", "version"),
    [
        ("1.33.2", "1.33.2"),  # Gardener v1.150: the version as a string
        (  # newer Gardener: an object with the settings an in-place update acts on
            {"version": "1.34.1", "cpuManagerPolicy": "static", "evictionHard": {"a": "1"}},
            "1.34.1",
        ),
    ],
)
def test_in_place_updates_kubelet_in_either_shape(kubelet: object, version: str) -> None:
    doc = {
        "apiVersion": "extensions.gardener.cloud/v1alpha1",
        "kind": "OperatingSystemConfig",
        "spec": {
            "type": "gardenlinux",
            "purpose": "reconcile",
            "inPlaceUpdates": {"operatingSystemVersion": "1592.4", "kubelet": kubelet},
        },
    }
    raw = yaml.safe_dump(doc).encode()
    osc = decode_osc(raw, sha(raw), "node-a")
    assert osc.spec.in_place_updates is not None
    assert osc.spec.in_place_updates.kubelet_version == version
    # nothing is lost when the object is written back (the newer shape's extra settings too)
    assert osc.to_dict()["spec"]["inPlaceUpdates"]["kubelet"] == kubelet
