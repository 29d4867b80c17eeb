"""The console script answers with its version; unknown input is a usage error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from node_agent import __version__
from node_agent.cli import main


def test_version_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == f"node-agent {__version__}"


def test_console_script_runs_as_module() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "node_agent", "--version"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"node-agent {__version__}"


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: node-agent" in capsys.readouterr().err
