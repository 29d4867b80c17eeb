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

from node_agent.errors import (
    OSCChecksumError,
    OSCDecodeError,
    OSCError,
    OSCValidationError,
)
from node_agent.osc import decode_osc, osc_files, osc_units, parse_osc, plan, secret_refs
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
