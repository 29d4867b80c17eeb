"""Gardener's NodeAgentConfiguration is accepted unchanged; bad config fails with a clear error."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from node_agent.base.durations import format_duration, parse_duration
from node_agent.base.errors import ConfigError
from node_agent.config import config_version_key, decode_config, find_config, parse_config

KUBECONFIG = "/var/lib/gardener-node-agent/credentials/kubeconfig"

GARDENER_CONFIG = """\
apiVersion: nodeagent.config.gardener.cloud/v1alpha1
kind: NodeAgentConfiguration
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/gardener-node-agent/credentials/kubeconfig
  qps: 0
logLevel: info
logFormat: json
server: {}
featureGates:
  AllBeta: true
apiServer:
  server: https://api.shoot.example:443
  caFile: /var/lib/gardener-node-agent/cluster-ca.crt
bootstrap:
  kubeletDataVolumeSize: 68719476736
controllers:
  operatingSystemConfig:
    secretName: gardener-node-agent-worker-a-77ac3
    kubernetesVersion: 1.33.4
    syncPeriod: 1m30s
  token:
    syncConfigs:
    - secretName: gardener-node-agent
      path: /var/lib/gardener-node-agent/credentials/token
    - secretName: valitail
      path: /var/lib/valitail/auth-token
  systemdUnitCheck: {}
someFieldFromANewerGardener: 1
"""


def test_gardener_config_is_accepted_with_defaults() -> None:
    config = parse_config(GARDENER_CONFIG)
    osc = config.controllers.operating_system_config
    assert osc.secret_name == "gardener-node-agent-worker-a-77ac3"
    assert osc.kubernetes_version == "1.33.4"
    assert osc.sync_period == timedelta(seconds=90)
    assert [s.path for s in config.controllers.token.sync_configs] == [
        "/var/lib/gardener-node-agent/credentials/token",
        "/var/lib/valitail/auth-token",
    ]
    assert config.controllers.token.sync_period == timedelta(hours=1)
    assert config.controllers.systemd_unit_check.stuck_threshold == timedelta(minutes=5)
    assert config.server.health_probes.port == 2751
    assert config.server.metrics.port == 2752
    assert config.api_server.server == "https://api.shoot.example:443"
    assert config.feature_gates == {"AllBeta": True}
    assert config.bootstrap is not None
    assert config.bootstrap.kubelet_data_volume_size == 68719476736


def test_dump_round_trips_in_gardener_spelling() -> None:
    config = parse_config(GARDENER_CONFIG)
    dumped = yaml.safe_load(config.to_yaml())
    assert dumped["controllers"]["operatingSystemConfig"]["syncPeriod"] == "1m30s"
    assert dumped["apiServer"]["caFile"] == "/var/lib/gardener-node-agent/cluster-ca.crt"
    assert parse_config(config.to_yaml()) == config


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: [", "not valid YAML"),
        ("- 1", "expected a mapping"),
        ("apiVersion: v1\nkind: ConfigMap\n", "expected apiVersion"),
        (
            "controllers:\n  operatingSystemConfig:\n    syncPeriod: 5s\n",
            "controllers.operatingSystemConfig.syncPeriod: must be at least 15s",
        ),
        (
            "controllers:\n  operatingSystemConfig:\n    syncPeriod: soon\n",
            "controllers.operatingSystemConfig.syncPeriod",
        ),
        ("controllers:\n  token:\n    syncConfigs:\n    - path: /x\n", "secretName"),
    ],
)
def test_bad_config_is_a_clear_error(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(text, source="/etc/cfg.yaml")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("0", 0), ("10m", 600), ("1m30s", 90), ("1h", 3600), ("250ms", 0.25), ("1.5h", 5400)],
)
def test_parse_go_durations(text: str, seconds: float) -> None:
    assert parse_duration(text).total_seconds() == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text",
    ["", "10", "m", "1x", "1m 30s", "abc", "\u0661\u0660s", "1\uff10m", "\u00b2s"],
)  # Go reads ASCII digits only: Arabic-Indic 10s is no duration
def test_reject_non_durations(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@given(st.integers(min_value=0, max_value=10 * 24 * 3600))
def test_duration_format_round_trips(seconds: int) -> None:
    value = timedelta(seconds=seconds)
    assert parse_duration(format_duration(value)) == value


# --- config discovery in upstream's --config-dir ------------------------------------------------


def _dir_with(tmp_path: Path, *names: str) -> Path:
    for name in names:
        (tmp_path / name).write_text("kind: NodeAgentConfiguration\n")
    return tmp_path


@pytest.mark.parametrize(
    ("names", "chosen"),
    [
        (["config-v1.150.0.yaml"], "config-v1.150.0.yaml"),
        (["config-v1.99.0.yaml", "config-v1.150.0.yaml"], "config-v1.150.0.yaml"),
        (["config-v1.150.0.yaml", "config-v1.151.0.yaml"], "config-v1.151.0.yaml"),
        (["config-v1.151.0-dev.yaml", "config-v1.151.0.yaml"], "config-v1.151.0.yaml"),
        (["config-v1.151.0-rc.2.yaml", "config-v1.151.0-rc.10.yaml"], "config-v1.151.0-rc.10.yaml"),
        (["config-v1.151.0-rc.1.yaml", "config-v1.150.9.yaml"], "config-v1.151.0-rc.1.yaml"),
        (["config.yaml", "config-v1.150.0.yaml"], "config-v1.150.0.yaml"),
        (["config.yaml"], "config.yaml"),
        (["config-v1.150.0.yaml", "config-v1.160.0.yaml.corrupt"], "config-v1.150.0.yaml"),
        (["config-v1.150.0.yaml", "config-latest.yaml"], "config-v1.150.0.yaml"),
    ],
)
def test_find_config_picks_the_highest_semantic_version(
    tmp_path: Path, names: list[str], chosen: str
) -> None:
    assert find_config(_dir_with(tmp_path, *names)) == tmp_path / chosen


def test_find_config_ignores_a_directory_named_like_a_config(tmp_path: Path) -> None:
    (tmp_path / "config-v1.200.0.yaml").mkdir()
    _dir_with(tmp_path, "config-v1.150.0.yaml")
    assert find_config(tmp_path) == tmp_path / "config-v1.150.0.yaml"


def test_find_config_ignores_a_symlink_named_like_a_config(tmp_path: Path) -> None:
    # Only regular files count: a symlink planted there (to a file anywhere) is not a config.
    elsewhere = tmp_path / "elsewhere.yaml"
    elsewhere.write_text("x")
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "config-v1.200.0.yaml").symlink_to(elsewhere)
    _dir_with(configs, "config-v1.150.0.yaml")
    assert find_config(configs) == configs / "config-v1.150.0.yaml"


def test_find_config_without_a_config_is_one_clear_error(tmp_path: Path) -> None:
    _dir_with(tmp_path, "config-v1.150.0.yaml.corrupt", "kubelet.conf")
    with pytest.raises(ConfigError, match=r"^no config-<version>.yaml or config.yaml in "):
        find_config(tmp_path)
    with pytest.raises(ConfigError, match="cannot read config dir"):
        find_config(tmp_path / "missing")


def test_config_version_key_is_not_lexical() -> None:
    old, new = config_version_key("config-v1.99.0.yaml"), config_version_key("config-v1.150.0.yaml")
    assert old is not None
    assert new is not None
    assert old < new
    assert config_version_key("config.yaml") is None


@pytest.mark.parametrize(
    "name",
    [
        "config-v1.\u0661\u0665\u0660.0.yaml",  # Arabic-Indic 150
        "config-v\uff11.150.0.yaml",  # fullwidth 1
        "config-v1.150.\u00b2.yaml",  # superscript two
        "config-v1.150.yaml",  # all three numbers are required
        "config-v1.150.0-01.yaml",  # not a semantic version
        "config-v1.150.0-a..b.yaml",
    ],
)
def test_a_config_name_that_is_no_ascii_semantic_version_is_no_config(
    tmp_path: Path, name: str
) -> None:
    assert config_version_key(name) is None
    _dir_with(tmp_path, "config-v1.99.0.yaml", name)
    assert find_config(tmp_path).name == "config-v1.99.0.yaml"


def test_config_names_sort_by_semantic_version_precedence(tmp_path: Path) -> None:
    order = [
        "config-v1.150.0-alpha.yaml",
        "config-v1.150.0-alpha.1.yaml",
        "config-v1.150.0-alpha.beta.yaml",
        "config-v1.150.0-beta.2.yaml",
        "config-v1.150.0-beta.11.yaml",
        "config-v1.150.0-rc.1.yaml",
        "config-1.150.0.yaml",
        "config-v1.150.1+build.7.yaml",
    ]
    keys = [config_version_key(name) for name in order]
    assert None not in keys
    assert sorted(order, key=config_version_key) == order  # type: ignore[arg-type]
    _dir_with(tmp_path, *order)
    assert find_config(tmp_path).name == "config-v1.150.1+build.7.yaml"


# What Gardener's encoder writes for the agent's config (Go zero values of every field it does
# not set): upstream's defaulting reads "", 0 and null as "not set".
GARDENER_ZERO_VALUES = """\
apiServer:
  caFile: /var/lib/gardener-node-agent/cluster-ca.crt
  server: https://api.shoot.example:443
apiVersion: nodeagent.config.gardener.cloud/v1alpha1
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: ""
  qps: 0
controllers:
  operatingSystemConfig:
    kubernetesVersion: 1.33.0
    secretName: gardener-node-agent-worker-1a2b3c4d5e6f7a8b
  systemdUnitCheck: {}
  token:
    syncPeriod: 12h0m0s
kind: NodeAgentConfiguration
logFormat: ""
logLevel: ""
server: {}
"""


def test_gardener_zero_values_mean_upstream_defaults() -> None:
    config = parse_config(GARDENER_ZERO_VALUES)
    assert config.client_connection.kubeconfig == KUBECONFIG
    assert (config.client_connection.qps, config.client_connection.burst) == (50.0, 100)
    assert (config.log_level, config.log_format) == ("info", "json")
    assert (config.server.health_probes.port, config.server.metrics.port) == (2751, 2752)
    assert config.controllers.operating_system_config.sync_period == timedelta(minutes=10)
    assert config.controllers.token.sync_period == timedelta(hours=12)


@pytest.mark.parametrize(
    ("text", "field", "expected"),
    [
        ("clientConnection: null", "client_connection.kubeconfig", KUBECONFIG),
        ("clientConnection: {kubeconfig: null}", "client_connection.kubeconfig", KUBECONFIG),
        ("logLevel: null", "log_level", "info"),
        ("logFormat: ''", "log_format", "json"),
        ("server: null", "server.metrics.port", 2752),
        ("server: {healthProbes: {bindAddress: '', port: 0}}", "server.health_probes.port", 2751),
        ("server: {metrics: {port: 0}}", "server.metrics.port", 2752),
        ("server: {metrics: null}", "server.metrics.port", 2752),
        ("server: {healthProbes: {port: 8080}}", "server.health_probes.port", 8080),
        ("featureGates: null", "feature_gates", {}),
        ("apiServer: null", "api_server.ca_file", "/var/lib/gardener-node-agent/cluster-ca.crt"),
        (
            "apiServer: {caFile: ''}",
            "api_server.ca_file",
            "/var/lib/gardener-node-agent/cluster-ca.crt",
        ),
        ("bootstrap: null", "bootstrap", None),
        ("bootstrap: {kubeletDataVolumeSize: null}", "bootstrap.kubelet_data_volume_size", None),
        ("controllers: null", "controllers.token.sync_configs", ()),
        (
            "controllers: {operatingSystemConfig: null}",
            "controllers.operating_system_config.secret_name",
            "",
        ),
        (
            "controllers: {operatingSystemConfig: {syncPeriod: null, kubernetesVersion: null}}",
            "controllers.operating_system_config.sync_period",
            timedelta(minutes=10),
        ),
        ("controllers: {token: {syncConfigs: null}}", "controllers.token.sync_configs", ()),
        (
            "controllers: {token: {syncPeriod: null}}",
            "controllers.token.sync_period",
            timedelta(hours=1),
        ),
        (
            "controllers: {systemdUnitCheck: {syncPeriod: null, stuckThreshold: null}}",
            "controllers.systemd_unit_check.stuck_threshold",
            timedelta(minutes=5),
        ),
    ],
)
def test_null_and_zero_fields_take_upstream_defaults(
    text: str, field: str, expected: object
) -> None:
    value: object = decode_config(text)  # the defaults alone (no secretName, no version here)
    for name in field.split("."):
        value = getattr(value, name)
    assert value == expected
