"""The file side of ``node-agent bootstrap``: config seeding, the kubelet bootstrap kubeconfig,
the shipped unit. (The systemd side runs for real in tests/integration/test_artifact_init.py.)"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import yaml

from node_agent.base.configfile import MAX_CONFIG_BYTES
from node_agent.base.errors import ConfigError
from node_agent.base.layout import KUBELET_BOOTSTRAP_KUBECONFIG
from node_agent.commands.bootstrap import (
    KUBELET_CLIENT_CERT,
    KUBELET_KUBECONFIG,
    kubelet_bootstrap_kubeconfig,
    load_user_data_config,
    seed_config,
    unit_template,
    write_kubelet_bootstrap_kubeconfig,
)
from node_agent.config import BOOTSTRAP_TOKEN_FILE, AgentSettings, parse_config
from node_agent.host.fs import HostFS

CONFIG = b"""apiVersion: nodeagent.config.gardener.cloud/v1alpha1
kind: NodeAgentConfiguration
apiServer:
  server: api.example.test
  caFile: /var/lib/gardener-node-agent/cluster-ca.crt
controllers:
  operatingSystemConfig:
    secretName: gardener-node-agent-pool-a-0123456789abcdef
    kubernetesVersion: 1.33.4
"""


@pytest.fixture
def fs(tmp_path: Path) -> HostFS:
    return HostFS(tmp_path)


def test_unit_has_the_service_contract() -> None:
    lines = set(unit_template().decode().splitlines())
    for expected in (
        "Type=notify",
        "NotifyAccess=main",
        "ExecStart=/opt/node-agent/current/bin/node-agent run",
        "Restart=always",
        "RestartSec=5",
        "StartLimitIntervalSec=0",
        "WatchdogSec=60",
        "KillMode=mixed",
        "TimeoutStopSec=30",
        "WantedBy=multi-user.target",
    ):
        assert expected in lines


def test_kubelet_bootstrap_kubeconfig_has_upstreams_shape() -> None:
    doc = yaml.safe_load(kubelet_bootstrap_kubeconfig("api.example.test", "/ca.crt", "tok.en\n"))
    assert doc["current-context"] == "kubelet-bootstrap"
    assert doc["clusters"] == [
        {
            "name": "kubelet-bootstrap",
            "cluster": {"server": "https://api.example.test", "certificate-authority": "/ca.crt"},
        }
    ]
    assert doc["users"] == [{"name": "kubelet-bootstrap", "user": {"token": "tok.en"}}]
    assert doc["contexts"][0]["context"] == {
        "cluster": "kubelet-bootstrap",
        "user": "kubelet-bootstrap",
    }
    again = kubelet_bootstrap_kubeconfig("https://api.example.test", "/ca.crt", "tok.en")
    assert yaml.safe_load(again)["clusters"][0]["cluster"]["server"] == "https://api.example.test"


def test_config_from_elsewhere_seeds_an_absent_config(fs: HostFS, tmp_path: Path) -> None:
    source = tmp_path / "user-data.yaml"
    source.write_bytes(CONFIG)
    raw, config = load_user_data_config(source)
    assert config.controllers.operating_system_config.secret_name.endswith("0123456789abcdef")
    settings = AgentSettings(root=tmp_path)
    assert seed_config(fs, settings, source, raw) == "written"
    target = tmp_path / settings.config_file.lstrip("/")
    assert target.read_bytes() == CONFIG
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def test_the_agents_config_wins_over_user_data(fs: HostFS, tmp_path: Path) -> None:
    settings = AgentSettings(root=tmp_path)
    target = tmp_path / settings.config_file.lstrip("/")
    target.parent.mkdir(parents=True)
    newer = CONFIG.replace(b"0123456789abcdef", b"fedcba9876543210")
    target.write_bytes(newer)
    mtime = target.stat().st_mtime_ns
    source = tmp_path / "user-data.yaml"
    source.write_bytes(CONFIG)
    assert seed_config(fs, settings, source, CONFIG).startswith("kept")
    assert target.read_bytes() == newer
    assert target.stat().st_mtime_ns == mtime


def test_an_unreadable_config_is_replaced_by_user_data(fs: HostFS, tmp_path: Path) -> None:
    settings = AgentSettings(root=tmp_path)
    target = tmp_path / settings.config_file.lstrip("/")
    target.parent.mkdir(parents=True)
    target.write_bytes(b"kind: [unclosed")
    assert seed_config(fs, settings, tmp_path / "user-data.yaml", CONFIG) == "written"
    assert parse_config(target.read_bytes()).api_server.server == "api.example.test"


def test_config_in_place_is_not_copied(fs: HostFS, tmp_path: Path) -> None:
    settings = AgentSettings(root=tmp_path)
    target = tmp_path / settings.config_file.lstrip("/")
    assert seed_config(fs, settings, target, CONFIG) == "in place"
    assert not target.exists()


def test_bad_user_data_config_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_user_data_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(CONFIG.replace(b"NodeAgentConfiguration", b"Something"))
    with pytest.raises(ConfigError, match="expected apiVersion"):
        load_user_data_config(bad)


@pytest.mark.timeout(10)
def test_user_data_config_is_read_as_every_config_is(tmp_path: Path) -> None:
    """A FIFO would block bootstrap for ever and a huge file is no config: refused in one line."""
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=rf"^config {fifo} is not a regular file \(a FIFO\)$"):
        load_user_data_config(fifo)
    big = tmp_path / "big.yaml"
    big.write_bytes(CONFIG + b"#" * MAX_CONFIG_BYTES + b"\n")
    with pytest.raises(ConfigError, match=rf"^config {big} is larger than 256 KiB"):
        load_user_data_config(big)


def test_a_config_larger_than_any_config_is_replaced_by_user_data(
    fs: HostFS, tmp_path: Path
) -> None:
    """``run`` refuses a config file above MAX_CONFIG_BYTES, so it is not kept, however valid."""
    settings = AgentSettings(root=tmp_path)
    target = tmp_path / settings.config_file.lstrip("/")
    target.parent.mkdir(parents=True)
    target.write_bytes(CONFIG + b"#" * MAX_CONFIG_BYTES + b"\n")
    assert seed_config(fs, settings, tmp_path / "user-data.yaml", CONFIG) == "written"
    assert target.read_bytes() == CONFIG


def test_kubelet_kubeconfig_follows_upstreams_rule(fs: HostFS, tmp_path: Path) -> None:
    config = parse_config(CONFIG)
    assert write_kubelet_bootstrap_kubeconfig(fs, config).startswith("not needed (no bootstrap")
    fs.write_atomic(BOOTSTRAP_TOKEN_FILE, b"abcdef.0123456789abcdef\n", 0o640)
    assert write_kubelet_bootstrap_kubeconfig(fs, config) == "written"
    path = tmp_path / KUBELET_BOOTSTRAP_KUBECONFIG.lstrip("/")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    mtime = path.stat().st_mtime_ns
    assert write_kubelet_bootstrap_kubeconfig(fs, config) == "unchanged"
    assert path.stat().st_mtime_ns == mtime
    for credential in (KUBELET_KUBECONFIG, KUBELET_CLIENT_CERT):
        fs.write_atomic(credential, b"x", 0o600)
        assert write_kubelet_bootstrap_kubeconfig(fs, config).startswith("not needed (kubelet")
        fs.remove(credential)


def test_kubelet_kubeconfig_needs_the_api_server(fs: HostFS) -> None:
    fs.write_atomic(BOOTSTRAP_TOKEN_FILE, b"abcdef.0123456789abcdef", 0o640)
    config = parse_config(CONFIG.replace(b"  server: api.example.test\n", b""))
    with pytest.raises(ConfigError, match=r"apiServer\.server is empty"):
        write_kubelet_bootstrap_kubeconfig(fs, config)
