"""Bad OSC input is reported on the Node and in the log; what was applied stays intact."""

from __future__ import annotations

import base64
import copy
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from tests.testbed.agent_harness import NS, OSCAgent, inline_file, osc_document, service
from tests.testbed.controlplane import ControlPlane
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

REF_SECRET = "osc-file-contents"


def good_osc() -> dict[str, Any]:
    return osc_document(
        [inline_file("/etc/good/a.conf", "a\n"), inline_file("/etc/good/b.conf", "b\n", 0o600)],
        [service("good.service", filePaths=["/etc/good/a.conf"])],
    )


def with_file(osc: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    bad = copy.deepcopy(osc)
    bad["spec"]["files"].append(entry)
    return bad


def raw(osc: dict[str, Any]) -> bytes:
    return yaml.safe_dump(osc).encode()


@pytest_asyncio.fixture(loop_scope="session")
async def agent(
    admin_api: ApiClient, control_plane: ControlPlane, node: IsolatedSystemd, tmp_path: Path
) -> AsyncIterator[OSCAgent]:
    agent = OSCAgent(admin_api, control_plane, node, tmp_path, extra_secrets=[REF_SECRET])
    async with agent.running() as harness:
        yield harness


def snapshot(agent: OSCAgent) -> dict[str, tuple[bytes, int]]:
    out = {}
    for name in ("a.conf", "b.conf"):
        path = agent.node.path(f"/etc/good/{name}")
        out[name] = (path.read_bytes(), os.stat(path).st_mtime_ns)
    unit = agent.node.path("/etc/systemd/system/good.service")
    out["unit"] = (unit.read_bytes(), os.stat(unit).st_mtime_ns)
    last = agent.node.path("/var/lib/gardener-node-agent/last-applied-osc.yaml")
    out["last-applied"] = (last.read_bytes(), os.stat(last).st_mtime_ns)
    return out


# An OSC over 1 MiB cannot reach the agent through a Secret (the API server caps Secret data at
# 1 MiB); the agent's own limit is covered by tests/unit/test_osc_decode.py.
BAD_INPUTS: list[tuple[str, Any, str]] = [
    ("malformed YAML", b"spec: [unclosed", "OSCDecodeError"),
    ("wrong kind", {**good_osc(), "kind": "ConfigMap"}, "kind"),
    ("wrong apiVersion", {**good_osc(), "apiVersion": "v1"}, "apiVersion"),
    ("relative path", with_file(good_osc(), inline_file("etc/rel", "x")), "etc/rel"),
    ("dot-dot path", with_file(good_osc(), inline_file("/etc/../root/x", "x")), ".."),
    ("NUL in path", with_file(good_osc(), inline_file("/etc/nul\x00x", "x")), "NUL"),
    (
        "unit name with slash",
        {**good_osc(), "spec": {**good_osc()["spec"], "units": [service("a/b.service")]}},
        "a/b.service",
    ),
    (
        "unit name without suffix",
        {**good_osc(), "spec": {**good_osc()["spec"], "units": [service("kubelet")]}},
        "kubelet",
    ),
    (
        "unknown encoding",
        with_file(
            good_osc(),
            {"path": "/etc/enc", "content": {"inline": {"encoding": "gzip", "data": "x"}}},
        ),
        "gzip",
    ),
    (
        "invalid base64",
        with_file(
            good_osc(),
            {"path": "/etc/b64", "content": {"inline": {"encoding": "b64", "data": "!!"}}},
        ),
        "/etc/b64",
    ),
    (
        "permissions out of range",
        with_file(good_osc(), inline_file("/etc/p", "x", 0o10000)),
        "/etc/p",
    ),
    (
        "duplicate path",
        with_file(good_osc(), inline_file("/etc/good/a.conf", "again\n")),
        "/etc/good/a.conf",
    ),
]


async def test_each_bad_input_is_reported_and_nothing_applied_is_lost(agent: OSCAgent) -> None:
    good = good_osc()
    checksum = await agent.publish(good)
    await agent.wait_applied(checksum)
    before = snapshot(agent)

    for label, document, needle in BAD_INPUTS:
        body = document if isinstance(document, bytes) else raw(document)
        await agent.publish(body)
        message = await agent.wait_event("OSCInvalid", needle)
        assert needle in message, label
        assert snapshot(agent) == before, f"{label}: applied state changed"
        assert (await agent.node_annotations())["checksum/cloud-config-data"] == checksum

    # A checksum annotation that does not match the bytes.
    await agent.publish(raw(good) + b"\n# tampered\n", checksum="0" * 64)
    await agent.wait_event("OSCInvalid", "checksum")
    assert snapshot(agent) == before

    # After all that, a good update still applies.
    good["spec"]["files"][1]["content"]["inline"]["data"] = "b2\n"
    await agent.wait_applied(await agent.publish(good))
    assert agent.node.path("/etc/good/b.conf").read_text() == "b2\n"


async def test_missing_secret_ref_is_retried_and_named(agent: OSCAgent) -> None:
    osc = with_file(
        good_osc(),
        {
            "path": "/etc/good/from-secret",
            "permissions": 0o600,
            "content": {"secretRef": {"name": REF_SECRET, "dataKey": "cfg"}},
        },
    )
    checksum = await agent.publish(osc)
    message = await agent.wait_event("OSCApplyFailed", REF_SECRET)
    assert "'cfg'" in message
    assert "Secret not found" in message
    assert not agent.node.path("/etc/good/from-secret").exists()

    core = client.CoreV1Api(agent.admin)
    await core.create_namespaced_secret(
        NS,
        client.V1Secret(
            metadata=client.V1ObjectMeta(name=REF_SECRET),
            data={"other": base64.b64encode(b"x").decode()},
        ),
    )
    await agent.wait_event("OSCApplyFailed", "key not in Secret")
    await core.patch_namespaced_secret(
        REF_SECRET, NS, {"data": {"cfg": base64.b64encode(b"secret-bytes").decode()}}
    )
    await agent.wait_applied(checksum, timeout=90)
    path = agent.node.path("/etc/good/from-secret")
    assert path.read_bytes() == b"secret-bytes"
    assert oct(os.stat(path).st_mode & 0o7777) == "0o600"


async def test_symlink_planted_in_a_parent_is_refused_before_any_write(
    agent: OSCAgent, tmp_path: Path
) -> None:
    good = good_osc()
    checksum = await agent.publish(good)
    await agent.wait_applied(checksum)
    before = snapshot(agent)
    agent.node.run(["mkdir", "-p", "/srv/elsewhere"])
    agent.node.run(["ln", "-s", "/srv/elsewhere", "/etc/planted"])

    bad = with_file(good, inline_file("/etc/planted/evil.conf", "x"))
    bad["spec"]["files"][0]["content"]["inline"]["data"] = "a changed alongside\n"
    await agent.publish(bad)
    message = await agent.wait_event("OSCApplyFailed", "/etc/planted")
    assert "symlink" in message
    assert agent.node.run(["ls", "-A", "/srv/elsewhere"]).stdout == ""
    # Refused as a whole: the other change in the same OSC was not applied either.
    assert snapshot(agent) == before


async def test_image_ref_files_are_reported_as_skipped(agent: OSCAgent) -> None:
    osc = with_file(
        good_osc(),
        {
            "path": "/opt/bin/kubelet",
            "permissions": 0o755,
            "content": {
                "imageRef": {
                    "image": "registry.example/hyperkube:v1.31.4",
                    "filePathInImage": "/kubelet",
                }
            },
        },
    )
    await agent.wait_applied(await agent.publish(osc))
    message = await agent.wait_event("OSCItemsSkipped", "/opt/bin/kubelet")
    assert "imageRef content is not supported" in message
    assert not agent.node.path("/opt/bin/kubelet").exists()
    assert agent.node.path("/etc/good/a.conf").read_text() == "a\n"
