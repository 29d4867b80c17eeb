"""Upstream gardener-node-agent of each Gardener release itself decides which
NodeAgentConfiguration files are valid: each file of tests/testbed/config_cases.py, as that
release renders it, is given to the release's binary, and the verdict it reaches at start must
be the table's for the release (tests/unit/test_config_upstream.py holds node-agent to the same
table); node-agent, reading the file under the release's name, reaches the same verdict. The
table's base is each release's own rendering, checked against its generator. The releases are
``TESTED_RELEASES`` (the oldest and the newest; ``make compat``: every one).

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
    for_release,
)
from tests.testbed.gardener_gen import TESTED_RELEASES, gardener_node_agent, generate

pytestmark = pytest.mark.integration

#: what upstream says once the config passed (its first step after validation)
PAST_VALIDATION = "failed getting REST config"


def upstream_verdict(
    text: str, config_dir: Path, release: str, env: dict[str, str] | None = None
) -> str:
    """Upstream ``release``'s output for a config file holding ``text``."""
    config_dir.mkdir(exist_ok=True)
    # upstream reads config-<its version>.yaml
    (config_dir / f"config-{release}.yaml").write_text(text)
    result = subprocess.run(
        [str(gardener_node_agent(release)), f"--config-dir={config_dir}"],
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


def node_agent_accepts(text: str, release: str) -> bool:
    try:
        parse_config(text, source=f"/var/lib/gardener-node-agent/config-{release}.yaml")
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("release", TESTED_RELEASES)
def test_the_table_starts_from_gardeners_own_rendering(release: str) -> None:
    generated = generate("k8s-1.33", release=release)
    assert generated.config_path == f"/var/lib/gardener-node-agent/config-{release}.yaml"
    assert generated.config == for_release(GARDENER_RENDERED, release)


@pytest.mark.parametrize("release", TESTED_RELEASES)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_upstream_gives_the_tables_verdict(case: ConfigCase, release: str, tmp_path: Path) -> None:
    text = for_release(case.text, release)
    output = upstream_verdict(text, tmp_path / "config", release)
    accepted = PAST_VALIDATION in output
    assert accepted == case.accepted_in(release), (
        f"upstream {'accepted' if accepted else 'refused'}:\n{output[-2000:]}"
    )
    assert node_agent_accepts(text, release) == accepted
    if case.field in GO_YAML_REASONS:  # a limit of go-yaml or Go's JSON: the same words
        assert case.field in output, output[-2000:]


@pytest.mark.parametrize("release", TESTED_RELEASES)
def test_upstreams_version_escape_hatch_is_honoured_by_both(
    release: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = for_release(_with({VERSION: "1.30.9"}), release)
    source = f"/var/lib/gardener-node-agent/config-{release}.yaml"
    assert PAST_VALIDATION not in upstream_verdict(text, tmp_path / "a", release)
    assert PAST_VALIDATION in upstream_verdict(
        text, tmp_path / "b", release, env={DISABLE_VERSION_CHECK_ENV: "true"}
    )
    with pytest.raises(ConfigError, match=VERSION):
        parse_config(text, source=source)
    monkeypatch.setenv(DISABLE_VERSION_CHECK_ENV, "true")
    parse_config(text, source=source)
