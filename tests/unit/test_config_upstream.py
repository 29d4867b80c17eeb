"""NodeAgentConfiguration is accepted and refused as upstream gardener-node-agent of each release
does.

The table (tests/testbed/config_cases.py) is checked against upstream's own binary by
tests/integration/test_config_oracle.py; here node-agent must give every file the same verdict,
and name the field when it refuses one.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node_agent.base.durations import parse_go_duration_ns
from node_agent.base.errors import ConfigError
from node_agent.base.goyaml import load_go_yaml, resolve_plain
from node_agent.config import (
    DISABLE_VERSION_CHECK_ENV,
    NodeAgentConfiguration,
    decode_config,
    kubernetes_version,
    parse_config,
    validate_config,
)
from tests.testbed.config_cases import (
    CASES,
    GARDENER_RENDERED,
    VERSION,
    ConfigCase,
    _with,
    for_release,
)

#: one release per rule set of node-agent (caBundle with Kubernetes 1.31-1.35, caBundle, caFile)
RULE_RELEASES = ("v1.141.0", "v1.146.0", "v1.150.0")


@pytest.mark.parametrize("release", RULE_RELEASES)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_verdict_is_upstreams(case: ConfigCase, release: str) -> None:
    source = f"/var/lib/gardener-node-agent/config-{release}.yaml"
    text = for_release(case.text, release)
    if case.accepted_in(release):
        parse_config(text, source=source)
        return
    with pytest.raises(ConfigError) as refused:
        parse_config(text, source=source)
    message = str(refused.value)
    assert message.startswith(f"{source}: "), message
    assert case.field in message, message


def test_every_problem_is_named_at_once() -> None:
    # upstream reports its whole error list; so does node-agent
    text = _with(
        {
            "logLevel": "warn",
            "controllers.operatingSystemConfig.secretName": "",
            "controllers.systemdUnitCheck.stuckThreshold": "1s",
        }
    )
    with pytest.raises(ConfigError) as refused:
        parse_config(text)
    message = str(refused.value)
    for field in ("logLevel", "secretName", "stuckThreshold"):
        assert field in message, message


def test_the_version_check_can_be_turned_off_as_upstream_allows() -> None:
    config = decode_config(_with({VERSION: "1.31.9"}))
    assert validate_config(config, environ={})
    assert validate_config(config, environ={DISABLE_VERSION_CHECK_ENV: "1"})
    assert validate_config(config, environ={DISABLE_VERSION_CHECK_ENV: "true"}) == []


@pytest.mark.parametrize(
    ("text", "label"),
    [
        ("1.33.0", "1.33.0"),
        ("v1.34.2", "1.34.2"),
        ("1.35", "1.35.0"),
        ("01.033.00", "1.33.0"),
        ("1.33.0-rc.1+build.7", "1.33.0-rc.1+build.7"),
    ],
)
def test_the_version_label_is_spelled_as_upstream_prints_it(text: str, label: str) -> None:
    assert kubernetes_version(text) == label
    config = parse_config(_with({VERSION: text}))
    assert config.controllers.operating_system_config.kubernetes_version == label


def test_gardener_rendering_takes_upstream_defaults() -> None:
    config = parse_config(GARDENER_RENDERED)
    assert (
        config.client_connection.kubeconfig == "/var/lib/gardener-node-agent/credentials/kubeconfig"
    )
    assert (config.client_connection.qps, config.client_connection.burst) == (50.0, 100)
    assert (config.log_level, config.log_format) == ("info", "json")
    assert config.controllers.token.sync_period == timedelta(hours=12)
    assert config.controllers.systemd_unit_check.stuck_threshold == timedelta(minutes=5)


def test_code_may_build_a_faster_config_than_a_file_may_hold() -> None:
    # decoding alone (what tests use to run a controller quickly) does not validate
    config = NodeAgentConfiguration.model_validate(
        {"controllers": {"systemdUnitCheck": {"syncPeriod": "1s"}}}
    )
    assert config.controllers.systemd_unit_check.sync_period == timedelta(seconds=1)
    assert any("systemdUnitCheck.syncPeriod" in p for p in validate_config(config))


# --- Go's time.ParseDuration --------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ns"),
    [
        ("0", 0),
        ("-0", 0),
        ("1h2m3.5s", 3_723_500_000_000),
        (".5s", 500_000_000),
        ("1.s", 1_000_000_000),
        ("1\u00b5s", 1_000),
        ("1\u03bcs", 1_000),
        ("-9223372036854775808ns", -(1 << 63)),
        ("9223372036854775807ns", (1 << 63) - 1),
        ("0.0000000001s", 0),
        ("15.00000000000000000000000000001s", 15_000_000_000),
    ],
)
def test_go_durations(text: str, ns: int) -> None:
    assert parse_go_duration_ns(text) == ns


@pytest.mark.parametrize(
    "text",
    ["", "+", "00", "1", ".s", "1 s", " 1s", "1s ", "1d", "--1s", "1e3s", "9223372036854775808ns"],
)
def test_not_go_durations(text: str) -> None:
    with pytest.raises(ValueError, match="Go duration"):
        parse_go_duration_ns(text)


@given(st.integers(min_value=0, max_value=(1 << 63) - 1))
def test_go_duration_nanoseconds_round_trip(ns: int) -> None:
    assert parse_go_duration_ns(f"{ns}ns") == ns


# --- go-yaml v2's reading of plain scalars --------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("y", True),
        ("Off", False),
        ("~", None),
        ("1e3", 1000.0),
        ("0x1F", 31),
        ("0o17", 15),
        ("017", 15),
        ("1_000", 1000),
        ("18446744073709551615", (1 << 64) - 1),
        ("-9223372036854775809", -9.223372036854775809e18),
        ("1:30", "1:30"),
        ("2001-12-14", "2001-12-14"),
        ("08", 8.0),
        (".5", 0.5),
        (".Nan", ".Nan"),
        ("yes please", "yes please"),
    ],
)
def test_plain_scalars_resolve_as_go_yaml_does(text: str, value: object) -> None:
    assert resolve_plain(text) == value
    assert type(resolve_plain(text)) is type(value)


def test_go_yaml_keys_are_json_strings_and_quoted_scalars_stay_strings() -> None:
    assert load_go_yaml('{1: "1e3", true: y, x: "y"}') == {"1": "1e3", "true": True, "x": "y"}
