"""The config.toml node-agent writes, as the machine's real containerd reads it: ``containerd
config dump`` merges the file over containerd's defaults, so what it prints is what the CRI
plugin runs with. A distribution's short file (Debian's package ships one) must still leave
runc a shim, or no pod sandbox starts.
"""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest

from node_agent.containerd.config import RUNC_RUNTIME_TYPE, patch_config
from node_agent.containerd.spec import containerd_cri
from node_agent.osc.models import CRIConfig
from tests.unit.test_containerd_config import DEBIAN_CONFIG

pytestmark = pytest.mark.integration

SANDBOX = "registry.k8s.io/pause:3.10"


def containerd(*args: str) -> str:
    return subprocess.run(
        ["containerd", *args], capture_output=True, text=True, timeout=60, check=True
    ).stdout


@pytest.mark.parametrize("seed", ["debian-package", "containerd-default"])
def test_the_patched_config_gives_runc_its_shim_and_the_systemd_cgroup_driver(
    seed: str, tmp_path: Path
) -> None:
    text = DEBIAN_CONFIG if seed == "debian-package" else containerd("config", "default")
    cri = containerd_cri(
        CRIConfig.model_validate(
            {
                "name": "containerd",
                "cgroupDriver": "systemd",
                "containerd": {"sandboxImage": SANDBOX},
            }
        )
    )
    assert cri is not None
    path = tmp_path / "config.toml"
    path.write_text(patch_config(text, cri))
    dump: dict[str, Any] = tomllib.loads(containerd("--config", str(path), "config", "dump"))
    plugin = dump["plugins"]["io.containerd.grpc.v1.cri"]
    runc = plugin["containerd"]["runtimes"]["runc"]
    assert runc["runtime_type"] == RUNC_RUNTIME_TYPE
    assert runc["options"]["SystemdCgroup"] is True
    assert plugin["containerd"]["default_runtime_name"] == "runc"
    assert plugin["sandbox_image"] == SANDBOX
