"""The operator's strictness file: typed, upstream's contract by default, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from node_agent.base.errors import ConfigError
from node_agent.base.strictness import UPSTREAM, parse_strictness
from node_agent.context import StrictnessFile
from node_agent.host.fs import HostFS

HEAD = "apiVersion: node-agent.gardener.cloud/v1alpha1\nkind: Strictness\n"


def test_empty_and_missing_mean_upstreams_contract(tmp_path: Path) -> None:
    assert parse_strictness(b"", source="f") == UPSTREAM
    assert UPSTREAM.names() == ()
    assert StrictnessFile(HostFS(tmp_path), "/strict.yaml").current() == UPSTREAM


def test_each_field_and_all() -> None:
    one = parse_strictness(f"{HEAD}restartLoops: true\n".encode(), source="f")
    assert one.names() == ("restartLoops",)
    every = parse_strictness(f"{HEAD}all: true\n".encode(), source="f")
    assert every.names() == ("restartLoops", "reportAfterSettle", "holdFailingUnits")


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ("restartLoops: 'yes'\n", "restartLoops: Input should be a valid boolean"),
        ("restartLoop: true\n", "restartLoop: Extra inputs are not permitted"),
        ("kind: Strict\n", "kind: Input should be 'Strictness'"),
        ("[1, 2]\n", "a mapping is expected, not list"),
        ("restartLoops: [\n", "not YAML"),
    ],
)
def test_a_bad_value_is_a_config_error_naming_file_and_field(body: str, named: str) -> None:
    raw = body if body.startswith(("[", "kind")) else HEAD + body
    with pytest.raises(ConfigError) as info:
        parse_strictness(raw.encode(), source="/x/node-agent-strict.yaml")
    assert str(info.value).startswith("/x/node-agent-strict.yaml: ")
    assert named in str(info.value)


def test_a_bad_file_is_upstreams_contract_and_one_error_line(tmp_path: Path) -> None:
    path = tmp_path / "node-agent-strict.yaml"
    path.write_text(f"{HEAD}restartLoops: maybe\n")
    source = StrictnessFile(HostFS(tmp_path), "/node-agent-strict.yaml")
    with capture_logs() as logs:
        assert source.current() == UPSTREAM
        assert source.current() == UPSTREAM
    errors = [e for e in logs if e["log_level"] == "error"]
    assert len(errors) == 1
    assert "restartLoops" in errors[0]["error"]
    path.write_text(f"{HEAD}restartLoops: true\n")
    assert source.current().strict_restart_loops
    assert source.error is None
