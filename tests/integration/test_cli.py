"""``node-agent plan`` changes nothing and explains itself; ``node-agent apply`` works offline
and against a real systemd; both read the node's Secret and secretRefs through the API."""

from __future__ import annotations

import base64
import json
import os
import re
import stat
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from tests.testbed.agent_harness import NS, OSCAgent, cli, inline_file, osc_document, service
from tests.testbed.controlplane import ControlPlane
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration


def local_osc(tmp_path: Path) -> Path:
    osc = osc_document(
        [
            inline_file("/etc/cli/a.conf", "a\n", 0o640),
            inline_file("/opt/cli/bin/tool", "#!/bin/sh\n", 0o755),
        ],
        [service("cli-demo.service", filePaths=["/etc/cli/a.conf"])],
    )
    path = tmp_path / "osc.yaml"
    path.write_text(yaml.safe_dump(osc))
    return path


def rows(table: str) -> list[list[str]]:
    """The plan table's rows, split into its columns."""
    return [re.split(r"\s{2,}", line.strip()) for line in table.splitlines()[1:]]


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_plan_changes_nothing_and_apply_offline_writes_exactly(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    osc = local_osc(tmp_path)

    planned = cli("plan", "--root", str(root), "--osc", str(osc), "--hostname", "h")
    assert planned.returncode == 0, planned.stderr
    assert ["write", "/etc/cli/a.conf (0640)", "new file"] in rows(planned.stdout)
    assert ["restart", "cli-demo.service", "it is new"] in rows(planned.stdout)
    as_json = cli("plan", "--root", str(root), "--osc", str(osc), "--json", "--hostname", "h")
    document = json.loads(as_json.stdout)
    assert [f["path"] for f in document["files_to_write"]] == [
        "/etc/cli/a.conf",
        "/opt/cli/bin/tool",
    ]
    assert all("content" not in f for f in document["files_to_write"])  # never print contents
    assert tree(root) == []  # plan wrote nothing at all

    applied = cli("apply", "--offline", "--root", str(root), "--osc", str(osc), "--hostname", "h")
    assert applied.returncode == 0, applied.stderr
    assert (root / "etc/cli/a.conf").read_text() == "a\n"
    assert stat.S_IMODE(os.stat(root / "etc/cli/a.conf").st_mode) == 0o640
    assert stat.S_IMODE(os.stat(root / "opt/cli/bin/tool").st_mode) == 0o755
    assert (root / "etc/systemd/system/cli-demo.service").exists()
    again = cli("plan", "--root", str(root), "--osc", str(osc), "--hostname", "h")
    assert again.stdout.strip() == "no changes"


def test_cli_errors_are_one_clear_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: v1\nkind: ConfigMap\n")
    result = cli("plan", "--root", str(tmp_path), "--osc", str(bad))
    assert result.returncode == 1
    assert result.stderr.startswith("node-agent: OSCDecodeError: ")
    assert "Traceback" not in result.stderr
    missing = cli("plan", "--root", str(tmp_path), "--osc", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 1
    assert "cannot read" in missing.stderr


async def test_plan_from_the_secret_and_apply_against_systemd(
    admin_api: ApiClient, control_plane: ControlPlane, node: IsolatedSystemd, tmp_path: Path
) -> None:
    harness = OSCAgent(admin_api, control_plane, node, tmp_path, extra_secrets=["cli-refs"])
    await harness.setup()
    config = harness.prepare().config_file
    await client.CoreV1Api(admin_api).create_namespaced_secret(
        NS,
        client.V1Secret(
            metadata=client.V1ObjectMeta(name="cli-refs"),
            data={"kubeconfig": base64.b64encode(b"from-the-cluster").decode()},
        ),
    )
    osc = osc_document(
        [
            inline_file("/etc/cli/a.conf", "a\n"),
            {
                "path": "/var/lib/cli/kubeconfig",
                "permissions": 0o600,
                "content": {"secretRef": {"name": "cli-refs", "dataKey": "kubeconfig"}},
            },
        ],
        [service("cli-demo.service", filePaths=["/etc/cli/a.conf"])],
    )
    await harness.publish(osc)
    common = ["--root", str(node.root), "--config", str(config), "--hostname", harness.node_name]

    planned = cli("plan", *common)
    assert planned.returncode == 0, planned.stderr
    assert ["write", "/var/lib/cli/kubeconfig (0600)", "new file"] in rows(planned.stdout)
    assert not node.path("/var/lib/cli/kubeconfig").exists()

    osc_file = tmp_path / "osc.yaml"
    osc_file.write_text(yaml.safe_dump(osc))
    applied = cli(
        "apply", *common, "--osc", str(osc_file), "--systemd-bus", node.bus_address.decode()
    )
    assert applied.returncode == 0, applied.stderr
    assert "restarted: cli-demo.service" in applied.stdout
    assert node.path("/var/lib/cli/kubeconfig").read_bytes() == b"from-the-cluster"
    assert node.run(["systemctl", "is-active", "cli-demo.service"]).stdout.strip() == "active"


def in_place_osc(tmp_path: Path, name: str, os_version: str) -> Path:
    """An OSC of an in-place pool: the kubelet's config, the targets and the OS extension's
    update command."""
    doc = osc_document(
        [
            inline_file("/var/lib/kubelet/config/kubelet", "kind: KubeletConfiguration\n"),
            inline_file("/etc/cli/a.conf", f"{os_version}\n"),
        ],
        [],
    )
    doc["spec"]["inPlaceUpdates"] = {"operatingSystemVersion": os_version, "kubelet": "1.33.0"}
    doc["status"] = {"inPlaceUpdates": {"osUpdate": {"command": "/opt/update.sh"}}}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def test_plan_shows_the_in_place_parts_of_an_update(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/os-release").write_text('PRETTY_NAME="Garden Linux 1877.4"\n')
    common = ["--root", str(root), "--hostname", "h"]
    old = in_place_osc(tmp_path, "old.yaml", "1877.4")
    assert cli("apply", "--offline", *common, "--osc", str(old)).returncode == 0
    new = in_place_osc(tmp_path, "new.yaml", "1877.5")

    planned = cli("plan", *common, "--osc", str(new))
    assert planned.returncode == 0, planned.stderr
    assert ["write", "/etc/cli/a.conf (0644)", "content changed"] in rows(planned.stdout)
    lines = planned.stdout.splitlines()
    assert "in-place update: operating_system" in lines
    assert "  operating_system: 1877.4 -> 1877.5 (runs /opt/update.sh, then a reboot)" in lines
    as_json = json.loads(cli("plan", *common, "--osc", str(new), "--json").stdout)
    assert as_json["in_place"]["parts"] == ["operating_system"]
    assert as_json["in_place"]["current_os"] == "1877.4"
    assert [f["path"] for f in as_json["files_to_write"]] == ["/etc/cli/a.conf"]

    same = cli("plan", *common, "--osc", str(old))
    assert same.stdout.splitlines()[-1] == "in-place update: none"
