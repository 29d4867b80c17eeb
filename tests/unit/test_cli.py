"""The console script answers with its version; unknown input is a usage error; upstream's
command line (``gardener-node-agent --config-dir DIR``, ``bootstrap``, ``reset``) parses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from node_agent import __version__
from node_agent.cli import _build_parser, _config_path, _upstream_argv, main


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


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--config-dir", "/d"], ["run", "--config-dir", "/d"]),
        (["--config-dir=/d"], ["run", "--config-dir=/d"]),
        (["--root", "/r", "--config-dir", "/d"], ["run", "--root", "/r", "--config-dir", "/d"]),
        (["bootstrap", "--config-dir", "/d"], ["bootstrap", "--config-dir", "/d"]),
        (["reset"], ["reset"]),
        ([], []),
        (["--version"], ["--version"]),
    ],
)
def test_upstream_root_command_with_config_dir_runs_the_agent(
    argv: list[str], expected: list[str]
) -> None:
    assert _upstream_argv(argv) == expected


def test_upstream_subcommands_parse() -> None:
    parser = _build_parser()
    for argv in (["bootstrap", "--config-dir", "/d"], ["reset", "--config-dir=/d"], ["reset"]):
        args = parser.parse_args(argv)
        assert args.command == argv[0]
    assert parser.parse_args(["reset", "--config-dir=/d"]).config_dir == "/d"


def _config_dir(root: Path, *names: str) -> None:
    base = root / "var/lib/gardener-node-agent"
    base.mkdir(parents=True)
    for name in names:
        (base / name).write_text("apiVersion: nodeagent.config.gardener.cloud/v1alpha1\n")


def test_config_dir_is_a_host_path_under_the_root(tmp_path: Path) -> None:
    _config_dir(tmp_path, "config-v1.150.0.yaml", "config-v1.151.0.yaml")
    args = _build_parser().parse_args(
        ["bootstrap", "--root", str(tmp_path), "--config-dir", "/var/lib/gardener-node-agent"]
    )
    assert _config_path(args) == tmp_path / "var/lib/gardener-node-agent/config-v1.151.0.yaml"


def test_config_dir_alone_runs_and_names_a_missing_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _config_dir(tmp_path)
    assert main(["--root", str(tmp_path), "--config-dir=/var/lib/gardener-node-agent"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("node-agent: ConfigError: no config-<version>.yaml or config.yaml in ")
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["--kubeconfig", "/k"],
        ["run", "--config", "/c", "--config-dir", "/d"],
        ["bootstrap", "--config-dir"],
        ["reset", "--force"],
    ],
)
def test_unknown_or_conflicting_flags_fail_clearly(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_invoked_as_gardener_node_agent(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["/opt/bin/gardener-node-agent"])
    assert main() == 2
    assert "usage: gardener-node-agent" in capsys.readouterr().err
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == f"node-agent {__version__}"


# ``run``'s first log line, with what it had imported by then: run in a process of its own (the
# test process has long imported everything).
FIRST_LINE_PROBE = """
import sys
from node_agent import cli


def stop(*args, **kwargs):
    print("IMPORTED:" + ",".join(m for m in ("pydantic", "aiohttp", "yaml") if m in sys.modules))
    raise SystemExit(0)


cli._load_settings = stop  # the config is read right after the first line
raise SystemExit(cli.main(sys.argv[1:]))
"""


def test_run_logs_its_first_line_before_the_costly_imports(tmp_path: Path) -> None:
    """The journal's first line of a start is when the process came up, not ~0.5 s of imports
    later: it names the version, the binary and the config file the agent found."""
    _config_dir(tmp_path)
    config = tmp_path / "var/lib/gardener-node-agent/config-v1.150.0.yaml"
    config.write_text("apiVersion: x\n")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            FIRST_LINE_PROBE,
            "--root",
            str(tmp_path),
            "--config-dir=/var/lib/gardener-node-agent",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    first, imported = result.stdout.splitlines()
    line = json.loads(first)
    assert line["event"] == "node-agent starting"
    assert line["version"] == __version__
    assert line["config"] == str(config)
    assert imported == "IMPORTED:"  # none of pydantic, aiohttp, yaml yet


def test_an_error_never_drives_the_terminal(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """What a command says on failure may carry words from the API server, a unit or the OSC:
    their control characters are shown escaped, not sent to the terminal."""
    hostile = tmp_path / "config\x1b]0;owned\x07\r\x1b[2J"
    assert main(["fleet", "--kubeconfig", str(hostile)]) != 0
    err = capsys.readouterr().err
    for control in ("\x1b", "\x07", "\r"):
        assert control not in err
    assert "config\\x1b]0;owned\\x07\\r\\x1b[2J not found" in err
