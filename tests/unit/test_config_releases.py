"""Each Gardener release's NodeAgentConfiguration is read as that release's agent reads it.

Up to v1.146 the cluster CA is the bundle itself (``apiServer.caBundle``, a Go ``[]byte``:
base64), from v1.147 on a file (``apiServer.caFile``); the release is the one the file's name
carries (``config-<release>.yaml``). Upstream's decoder is lenient: a field it does not know
(the other releases' CA field included) is ignored, and node-agent logs each one as a warning.
tests/integration/test_config_oracle.py holds upstream's binaries of every release to the same.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import MutableMapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from structlog.testing import capture_logs

from node_agent.base import log
from node_agent.base.configfile import config_release
from node_agent.base.errors import ConfigError
from node_agent.commands.bootstrap import write_kubelet_bootstrap_kubeconfig
from node_agent.config import (
    CLUSTER_CA_FILE,
    RELEASE_RULES,
    decode_config,
    parse_config,
    release_rules,
)
from node_agent.host.fs import HostFS
from node_agent.kube import certificates
from node_agent.kube.certificates import CertificateInfo
from tests.testbed.config_cases import GARDENER_RENDERED, VERSION, _with

PEM = b"-----BEGIN CERTIFICATE-----\nTUlJQnRlc3RidW5kbGU=\n-----END CERTIFICATE-----\n"
#: the file as Gardener v1.145.0 renders it: the bundle inline, no file
BUNDLE_RENDERED = GARDENER_RENDERED.replace(
    f"  caFile: {CLUSTER_CA_FILE}\n", f"  caBundle: {base64.b64encode(PEM).decode()}\n"
)
OLD = "/var/lib/gardener-node-agent/config-v1.145.0.yaml"
NEW = "/var/lib/gardener-node-agent/config-v1.150.0.yaml"


def _warnings(logs: list[MutableMapping[str, Any]]) -> list[str]:
    return [e["field"] for e in logs if e["log_level"] == "warning"]


def test_the_release_is_the_one_the_file_name_carries() -> None:
    assert config_release("config-v1.145.0.yaml") == "v1.145.0"
    assert config_release("config-1.150.0.yaml") == "v1.150.0"
    assert config_release("config.yaml") is None
    assert config_release("config-latest.yaml") is None


@pytest.mark.parametrize(
    ("release", "since"),
    [
        ("v1.141.0", "v1.141.0"),
        ("v1.140.3", "v1.141.0"),  # older than any served release: the oldest's rules
        ("v1.144.0", "v1.141.0"),
        ("v1.145.0", "v1.145.0"),
        ("v1.146.2", "v1.145.0"),
        ("v1.147.0", "v1.147.0"),
        ("v1.150.0", "v1.147.0"),
        ("v1.160.0", "v1.147.0"),
        (None, "v1.147.0"),  # no release in the name: the newest's
    ],
)
def test_each_release_has_its_rules(release: str | None, since: str) -> None:
    assert release_rules(release).since == since


def test_a_v1_145_config_gives_the_ca_bundle_and_no_file() -> None:
    # the bug of issue 34: the bundle was dropped and the agent looked for cluster-ca.crt
    with capture_logs() as logs:
        config = parse_config(BUNDLE_RENDERED, source=OLD)
    assert config.release == "v1.145.0"
    assert config.rules.ca_field == "caBundle"
    assert config.api_server.ca_bundle == PEM
    assert _warnings(logs) == []


def test_a_v1_150_config_names_the_ca_file() -> None:
    with capture_logs() as logs:
        config = parse_config(GARDENER_RENDERED, source=NEW)
    assert config.api_server.ca_bundle is None
    assert config.api_server.ca_file == CLUSTER_CA_FILE
    assert _warnings(logs) == []


def test_the_other_releases_ca_field_is_ignored_with_a_warning() -> None:
    both = BUNDLE_RENDERED.replace("apiServer:\n", f"apiServer:\n  caFile: {CLUSTER_CA_FILE}\n")
    with capture_logs() as logs:
        old = parse_config(both, source=OLD)
        new = parse_config(both, source=NEW)
    assert old.api_server.ca_bundle == PEM
    assert new.api_server.ca_bundle is None
    assert _warnings(logs) == ["apiServer.caFile", "apiServer.caBundle"]
    # a v1.150 agent never reads the bundle, so a broken one does not stop it either
    parse_config(GARDENER_RENDERED.replace("apiServer:\n", "apiServer:\n  caBundle: '%%'\n"))


def test_an_old_config_without_a_bundle_trusts_the_systems_roots() -> None:
    text = GARDENER_RENDERED.replace(f"  caFile: {CLUSTER_CA_FILE}\n", "")
    config = parse_config(text, source=OLD)
    assert config.api_server.ca_bundle == b""
    assert certificates.cluster_ca(config.api_server.ca_file, config.api_server.ca_bundle) == {}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (base64.b64encode(PEM).decode(), PEM),
        # Go's base64 skips line breaks
        ("LS0t\nLS0t\r\n", b"------"),
        ("", b""),
        ([104, 105], b"hi"),  # a JSON array is a []byte too
    ],
)
def test_the_bundle_is_decoded_as_go_decodes_a_byte_slice(value: object, expected: bytes) -> None:
    doc = yaml.safe_load(BUNDLE_RENDERED)
    doc["apiServer"]["caBundle"] = value
    config = parse_config(yaml.safe_dump(doc), source=OLD)
    assert config.api_server.ca_bundle == expected


@pytest.mark.parametrize("value", ["not base64!", "TUlJQ", 42, True, [256], {"a": 1}])
def test_a_bundle_go_cannot_decode_is_refused_naming_it(value: object) -> None:
    doc = yaml.safe_load(BUNDLE_RENDERED)
    doc["apiServer"]["caBundle"] = value
    with pytest.raises(ConfigError, match=r"apiServer\.caBundle"):
        parse_config(yaml.safe_dump(doc), source=OLD)


@pytest.mark.parametrize(
    ("release", "accepted", "refused"),
    [("v1.141.0", "1.31.2", "1.36.0"), ("v1.145.0", "1.36.0", "1.31.2")],
)
def test_the_supported_kubernetes_minors_are_the_releases(
    release: str, accepted: str, refused: str
) -> None:
    source = f"/var/lib/gardener-node-agent/config-{release}.yaml"
    parse_config(_with({VERSION: accepted}), source=source)
    with pytest.raises(ConfigError, match=r"kubernetesVersion: 1\."):
        parse_config(_with({VERSION: refused}), source=source)


def test_unknown_fields_are_ignored_and_each_is_a_warning_naming_it() -> None:
    doc = yaml.safe_load(GARDENER_RENDERED)
    doc["someNewField"] = {"a": 1}
    doc["server"]["metrics"] = {"port": 2752, "tls": True}
    doc["controllers"]["token"]["syncConfigs"] = [
        {"secretName": "a", "path": "/var/lib/a", "mode": 384}
    ]
    doc["nodeAgent"] = {"healthGate": {"enabled": True, "window": "1m"}}
    with capture_logs() as logs:
        config = parse_config(yaml.safe_dump(doc), source=NEW)
    assert config.controllers.token.sync_configs[0].path == "/var/lib/a"
    assert sorted(_warnings(logs)) == [
        "controllers.token.syncConfigs[0].mode",
        "nodeAgent.healthGate.window",
        "server.metrics.tls",
        "someNewField",
    ]
    event = next(e for e in logs if e["field"] == "someNewField")
    assert event["event"] == "unknown config field ignored"
    assert event["config"] == NEW
    assert event["release"] == "v1.150.0"


def test_the_warning_is_one_json_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    stream = io.StringIO()
    log.configure("info", "json", stream=stream)
    try:
        decode_config(GARDENER_RENDERED + "someNewField: 1\n", source=NEW)
    finally:
        log.configure("info", "json")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    event = json.loads(lines[0])
    assert event["level"] == "warning"
    assert event["field"] == "someNewField"


def test_a_rewritten_old_config_keeps_the_bundle() -> None:
    config = parse_config(BUNDLE_RENDERED, source=OLD)
    dumped = config.dump()
    assert dumped["apiServer"] == {
        "server": "https://api.testshoot.testproj.example:443",
        "caBundle": base64.b64encode(PEM).decode(),
    }
    with capture_logs() as logs:
        again = parse_config(config.to_yaml(), source=OLD)
    assert again == config
    assert _warnings(logs) == []
    assert "caBundle" not in parse_config(GARDENER_RENDERED, source=NEW).dump()["apiServer"]


def test_the_release_survives_a_copy() -> None:
    config = parse_config(BUNDLE_RENDERED, source=OLD)
    osc = config.controllers.operating_system_config.model_copy(update={"secret_name": "x"})
    controllers = config.controllers.model_copy(update={"operating_system_config": osc})
    assert config.model_copy(update={"controllers": controllers}).release == "v1.145.0"


def test_kubeconfigs_carry_the_bundle_inline() -> None:
    now = datetime.now(UTC)
    info = CertificateInfo(subject="CN=x", not_before=now, not_after=now + timedelta(days=1))
    inline = yaml.safe_load(
        certificates.kubeconfig("https://a", "/ca", b"c", b"k", info, ca_data=PEM)
    )
    by_path = yaml.safe_load(certificates.kubeconfig("https://a", "/ca", b"c", b"k", info))
    assert inline["clusters"][0]["cluster"] == {
        "server": "https://a",
        "certificate-authority-data": base64.b64encode(PEM).decode(),
    }
    assert by_path["clusters"][0]["cluster"] == {
        "server": "https://a",
        "certificate-authority": "/ca",
    }


def test_the_kubelets_bootstrap_kubeconfig_of_an_old_release_has_the_bundle(
    tmp_path: Path,
) -> None:
    fs = HostFS(tmp_path)
    fs.write_atomic("/var/lib/gardener-node-agent/credentials/bootstrap-token", b"abc.def", 0o600)
    config = parse_config(BUNDLE_RENDERED, source=OLD)
    assert write_kubelet_bootstrap_kubeconfig(fs, config) == "written"
    doc = yaml.safe_load((tmp_path / "var/lib/kubelet/kubeconfig-bootstrap").read_text())
    assert doc["clusters"][0]["cluster"]["certificate-authority-data"] == (
        base64.b64encode(PEM).decode()
    )


def test_every_rule_set_is_ordered_and_names_a_ca_field() -> None:
    from node_agent.base import versions

    keys = [versions.precedence(versions.semver(r.since)) for r in RELEASE_RULES]
    assert keys == sorted(keys)
    assert {r.ca_field for r in RELEASE_RULES} == {"caBundle", "caFile"}
