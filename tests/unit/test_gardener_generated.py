"""The decoders and the planner on what Gardener's own code generates (gardener-gen, built from
the pinned Gardener release), not on fixtures shaped like it."""

from __future__ import annotations

import base64
import re
from datetime import timedelta

import pytest

from node_agent.base.layout import AGENT_UNIT
from node_agent.config import KUBECONFIG_FILE, parse_config
from node_agent.containerd.spec import containerd_cri
from node_agent.osc.decode import decode_osc
from node_agent.osc.merge import osc_units, secret_refs
from node_agent.osc.models import OperatingSystemConfig
from node_agent.osc.plan import plan
from tests.testbed.gardener_gen import SHAPES, Generated, generate

BASE = "/var/lib/gardener-node-agent"
KUBERNETES = dict.fromkeys(SHAPES, "1.33.0") | {
    "k8s-1.33-patch": "1.33.1",
    "k8s-1.34": "1.34.0",
    "k8s-1.34-patch": "1.34.2",
}


def decoded(gen: Generated) -> OperatingSystemConfig:
    raw = base64.b64decode(gen.secret["data"]["osc.yaml"])
    checksum = gen.secret["metadata"]["annotations"]["checksum/data-script"]
    return decode_osc(raw, checksum, gen.machine_name)


@pytest.mark.parametrize("shape", SHAPES)
def test_gardeners_config_file_is_read_with_upstreams_defaults(shape: str) -> None:
    gen = generate(shape)
    assert gen.config_path == f"{BASE}/config-{gen.gardener_version}.yaml"
    config = parse_config(gen.config, source=gen.config_path)
    assert config.client_connection.kubeconfig == KUBECONFIG_FILE
    assert (config.log_level, config.log_format) == ("info", "json")
    assert (config.server.health_probes.port, config.server.metrics.port) == (2751, 2752)
    osc = config.controllers.operating_system_config
    assert osc.secret_name == gen.secret_name
    assert osc.kubernetes_version == KUBERNETES[shape]
    assert osc.sync_period == timedelta(minutes=10)
    assert config.controllers.token.sync_period == timedelta(hours=12)
    assert config.api_server.ca_file == f"{BASE}/cluster-ca.crt"
    assert config.api_server.server.startswith("https://")


@pytest.mark.parametrize("shape", SHAPES)
def test_the_agents_own_config_in_the_osc_is_read_too(shape: str) -> None:
    """The reconcile OSC carries the agent's config as a file as well (no bootstrap section)."""
    gen = generate(shape)
    osc = decoded(gen)
    (file,) = [f for f in osc.spec.files if f.path == gen.config_path]
    assert file.content.inline is not None
    config = parse_config(base64.b64decode(file.content.inline.data), source=file.path)
    assert config.controllers.operating_system_config.secret_name == gen.secret_name
    assert config.client_connection.kubeconfig == KUBECONFIG_FILE


@pytest.mark.parametrize("shape", SHAPES)
def test_every_generated_secret_decodes_and_plans(shape: str) -> None:
    gen = generate(shape)
    meta = gen.secret["metadata"]
    assert meta["namespace"] == "kube-system"
    assert meta["labels"] == {
        "gardener.cloud/role": "operating-system-config",
        "worker.gardener.cloud/pool": "worker",
    }
    if shape == "inplace":
        assert gen.secret_name == "gardener-node-agent-worker"
    else:
        assert re.fullmatch(r"gardener-node-agent-worker-[0-9a-f]{16}", gen.secret_name)
    serial = meta["annotations"].get("reconciliation.osc.node-agent.gardener.cloud/serial")
    assert serial == ("true" if shape == "serial" else None)

    osc = decoded(gen)
    assert secret_refs(osc, gen.machine_name) == {}  # Gardener inlines them for shoots
    cri = containerd_cri(osc.spec.cri_config)
    assert cri is not None
    assert (cri.cgroup_driver, cri.containerd.sandbox_image) == (
        "systemd",
        "registry.k8s.io/pause:3.10",
    )
    changes = plan(None, osc, gen.machine_name)
    written = {w.path for w in changes.files_to_write}
    assert {f.path for f in osc.spec.files} <= written
    units = {u.name for u in osc_units(osc)}
    assert {"kubelet.service", "containerd.service", AGENT_UNIT} <= units
    assert {u.name for u in changes.units_to_write} | {
        d.unit for d in changes.dropins_to_write
    } >= {"kubelet.service", AGENT_UNIT}


def restarted(before: str, after: str) -> set[str]:
    a, b = generate(before), generate(after)
    changes = plan(decoded(a), decoded(b), b.machine_name)
    return {cmd.unit for cmd in changes.unit_commands}


def test_a_kubernetes_patch_update_keeps_the_secret_and_restarts_kubelet_and_the_agent() -> None:
    assert generate("k8s-1.33").secret_name == generate("k8s-1.33-patch").secret_name
    assert restarted("k8s-1.33", "k8s-1.33-patch") == {"kubelet.service", AGENT_UNIT}


def test_a_kubernetes_minor_update_is_a_new_secret() -> None:
    assert generate("k8s-1.33").secret_name != generate("k8s-1.34").secret_name
    assert restarted("k8s-1.33", "k8s-1.34") == {"kubelet.service", AGENT_UNIT}


def test_a_kubelet_config_change_keeps_the_secret_and_restarts_kubelet() -> None:
    """maxPods is not part of the Secret's name (Gardener hashes only reserved resources,
    eviction thresholds and the CPU manager policy into it)."""
    assert generate("k8s-1.33").secret_name == generate("kubelet-config").secret_name
    assert restarted("k8s-1.33", "kubelet-config") == {"kubelet.service"}


def test_registry_mirrors_arrive_in_the_cri_config() -> None:
    cri = containerd_cri(decoded(generate("mirrors")).spec.cri_config)
    assert cri is not None
    assert cri.containerd is not None
    (registry,) = cri.containerd.registries
    assert registry.upstream == "docker.io"
    assert [h.url for h in registry.hosts] == ["http://10.4.0.2:5000"]


def test_an_in_place_pool_carries_its_update_fields() -> None:
    osc = decoded(generate("inplace"))
    assert osc.spec.in_place_updates is not None
    assert osc.spec.in_place_updates.kubelet == "1.33.0"
    assert osc.spec.in_place_updates.operating_system_version == "1877.5.0"
    assert osc.status.in_place_updates is not None
    assert osc.status.in_place_updates.os_update is not None


def test_provision_files_are_what_user_data_writes() -> None:
    gen = generate("k8s-1.33")
    files = {f.path: f for f in gen.provision_files}
    modes = {p: f.permissions for p, f in files.items() if p.startswith(BASE)}
    assert modes == {
        f"{BASE}/cluster-ca.crt": 0o640,
        f"{BASE}/credentials/bootstrap-token": 0o640,
        f"{BASE}/machine-name": 0o640,
        f"{BASE}/init.sh": 0o755,
        gen.config_path: 0o600,
    }
    assert files[f"{BASE}/machine-name"].content == gen.machine_name
    # machine-controller-manager's names make the agent's CSR common name exceed 64 characters
    assert len("gardener.cloud:node-agent:machine:" + gen.machine_name) > 64
    assert f'exec "/opt/bin/gardener-node-agent" bootstrap --config-dir="{BASE}"' in gen.init_script
    init = gen.provision_units[0]
    assert init["name"] == "gardener-node-init.service"
    assert init["command"] == "start"
    assert init["filePaths"] == [f"{BASE}/init.sh"]
