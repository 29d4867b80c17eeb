"""Upstream gardener-node-agent v1.150.0 itself decides which NodeAgentConfiguration files are
valid: each file of tests/testbed/config_cases.py is given to upstream's binary, and the verdict
it reaches at start must be the table's (tests/unit/test_config_upstream.py holds node-agent to
the same table). The table's base is Gardener's own rendering, checked against the generator.

Upstream decodes and validates its config before it does anything else; with ``KUBECONFIG``
naming a missing file, a config it accepts ends at once in "failed getting REST config" (it
never reaches the API server or the host), and one it refuses ends before that with the error.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from node_agent.base.errors import ConfigError
from node_agent.config import DISABLE_VERSION_CHECK_ENV, parse_config
from tests.testbed.config_cases import (
    CASES,
    GARDENER_RENDERED,
    GO_YAML_REASONS,
    VERSION,
    ConfigCase,
    _with,
)
from tests.testbed.gardener_gen import binaries_dir, gardener_node_agent, generate

pytestmark = pytest.mark.integration

#: what upstream says once the config passed (its first step after validation)
PAST_VALIDATION = "failed getting REST config"


def upstream_verdict(text: str, config_dir: Path, env: dict[str, str] | None = None) -> str:
    """Upstream's output for a config file holding ``text``."""
    version = binaries_dir().name.removeprefix("gardener-")  # upstream reads config-<version>.yaml
    config_dir.mkdir(exist_ok=True)
    (config_dir / f"config-{version}.yaml").write_text(text)
    result = subprocess.run(
        [str(gardener_node_agent()), f"--config-dir={config_dir}"],
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "KUBECONFIG": "/nonexistent/kubeconfig",
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0, "upstream ran on although it cannot have a kubeconfig"
    return result.stdout + result.stderr


def test_the_table_starts_from_gardeners_own_rendering() -> None:
    generated = generate("k8s-1.33")
    assert generated.config == GARDENER_RENDERED


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_upstream_gives_the_tables_verdict(case: ConfigCase, tmp_path: Path) -> None:
    output = upstream_verdict(case.text, tmp_path / "config")
    accepted = PAST_VALIDATION in output
    assert accepted == case.accepted, (
        f"upstream {'accepted' if accepted else 'refused'}:\n{output[-2000:]}"
    )
    if case.field in GO_YAML_REASONS:  # a limit of go-yaml or Go's JSON: the same words
        assert case.field in output, output[-2000:]


def test_upstreams_version_escape_hatch_is_honoured_by_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = _with({VERSION: "1.31.9"})
    assert PAST_VALIDATION not in upstream_verdict(text, tmp_path / "a")
    assert PAST_VALIDATION in upstream_verdict(
        text, tmp_path / "b", env={DISABLE_VERSION_CHECK_ENV: "true"}
    )
    with pytest.raises(ConfigError, match=VERSION):
        parse_config(text)
    monkeypatch.setenv(DISABLE_VERSION_CHECK_ENV, "true")
    parse_config(text)
