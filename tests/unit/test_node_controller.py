"""Node controller with fakes: restart order, the own unit last, no loops, config rewrite."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from node_agent import report
from node_agent.config import AgentSettings, NodeAgentConfiguration, parse_config
from node_agent.context import AgentContext
from node_agent.controllers.node import NodeController, restart_units
from node_agent.errors import KubeTransportError
from node_agent.host.fs import HostFS
from node_agent.systemd.types import JobResult

OWN = "gardener-node-agent.service"


class FakeKube:
    def __init__(self, node: dict[str, Any]) -> None:
        self.node = node
        self.log: list[tuple[str, Any]] = []
        self.fail_patches = 0

    async def get_node(self, name: str) -> dict[str, Any]:
        return self.node

    async def patch_node(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        if self.fail_patches:
            self.fail_patches -= 1
            raise KubeTransportError("down")
        self.log.append(("patch", patch))
        for key, value in patch["metadata"]["annotations"].items():
            if value is None:
                self.node["metadata"]["annotations"].pop(key, None)
        return self.node

    async def create_event(self, body: dict[str, Any]) -> dict[str, Any]:
        self.log.append(("event", (body["reason"], body["type"], body["message"])))
        return body


class FakeSystemd:
    def __init__(self, log: list[tuple[str, Any]], failing: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.log = log
        self.failing = failing

    async def restart_unit(self, unit: str, *, job_timeout: float = 10.0) -> JobResult:
        self.log.append(("restart", unit))
        return JobResult(unit, "restart", "failed" if unit in self.failing else "done")


def _ctx(tmp_path: Path, node: dict[str, Any], failing: set[str] = frozenset()) -> AgentContext:  # type: ignore[assignment]
    kube = FakeKube(node)
    config = NodeAgentConfiguration.model_validate(
        {"controllers": {"operatingSystemConfig": {"secretName": "osc-a"}}}
    )
    ctx = AgentContext(
        settings=AgentSettings(root=tmp_path, agent_unit=OWN),
        config=config,
        fs=HostFS(tmp_path),
        state=None,  # type: ignore[arg-type]
        systemd=FakeSystemd(kube.log, failing),  # type: ignore[arg-type]
        kube=kube,  # type: ignore[arg-type]
        host_name="n1",
        node_name="n1",
        node_uid="u1",
    )
    return ctx


def _node(annotations: dict[str, str] | None = None, labels: dict[str, str] | None = None) -> Any:
    return {"metadata": {"name": "n1", "annotations": annotations or {}, "labels": labels or {}}}


def test_restart_units_parsing() -> None:
    assert restart_units(" a, b.service ,,c.socket, a ") == ["a.service", "b.service", "c.socket"]
    assert restart_units("") == []


async def test_others_restarted_then_annotation_removed(tmp_path: Path) -> None:
    node = _node({report.ANNOTATION_RESTART_SERVICES: "x,y", "keep": "1"})
    ctx = _ctx(tmp_path, node, failing={"y.service"})
    await NodeController(ctx).reconcile(node)
    log = ctx.kube.log  # type: ignore[attr-defined]
    assert [e[0] for e in log] == ["restart", "event", "restart", "event", "patch"]
    assert log[1][1][:2] == ("SystemDUnitRestart", "Normal")
    assert log[3][1][:2] == ("SystemDUnitRestart", "Warning")
    assert node["metadata"]["annotations"] == {"keep": "1"}


async def test_own_unit_annotation_removed_first_and_restart_last(tmp_path: Path) -> None:
    node = _node({report.ANNOTATION_RESTART_SERVICES: f"gardener-node-agent,x,{OWN},y"})
    ctx = _ctx(tmp_path, node)
    controller = NodeController(ctx)
    await controller.reconcile(node)
    log = ctx.kube.log  # type: ignore[attr-defined]
    steps = [(k, v if k != "event" else v[0]) for k, v in log]
    assert steps[0][0] == "patch"
    assert [v for k, v in steps if k == "restart"] == ["x.service", "y.service", OWN]
    assert steps[-1] == ("restart", OWN)
    # The restarted agent (or this one, on the next event) sees no annotation: nothing more.
    await controller.reconcile(node)
    assert len(log) == len(steps)


async def test_failed_removal_is_retried_without_restarting_again(tmp_path: Path) -> None:
    node = _node({report.ANNOTATION_RESTART_SERVICES: "x"})
    ctx = _ctx(tmp_path, node)
    ctx.kube.fail_patches = 1  # type: ignore[attr-defined]
    controller = NodeController(ctx)
    with pytest.raises(KubeTransportError):
        await controller.reconcile(node)
    await controller.reconcile(node)
    log = ctx.kube.log  # type: ignore[attr-defined]
    assert [k for k, _ in log].count("restart") == 1
    assert report.ANNOTATION_RESTART_SERVICES not in node["metadata"]["annotations"]


async def test_secret_name_label_rewrites_config_and_restarts_once(tmp_path: Path) -> None:
    original = (
        "apiVersion: nodeagent.config.gardener.cloud/v1alpha1\n"
        "kind: NodeAgentConfiguration\n"
        "logLevel: debug\n"
        "controllers:\n"
        "  operatingSystemConfig:\n"
        "    secretName: osc-a\n"
        "    kubernetesVersion: 1.31.4\n"
        "  token:\n"
        "    syncConfigs:\n"
        "    - secretName: t\n"
        "      path: /var/lib/t\n"
    )
    path = tmp_path / "var/lib/gardener-node-agent/config.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(original)
    path.chmod(0o640)
    node = _node(labels={report.LABEL_SECRET_NAME: "osc-b"})
    ctx = _ctx(tmp_path, node)
    controller = NodeController(ctx)
    await controller.reconcile(node)
    await controller.reconcile(node)  # same label again: no second restart
    config = parse_config(path.read_bytes())
    assert config.controllers.operating_system_config.secret_name == "osc-b"
    assert config.controllers.operating_system_config.kubernetes_version == "1.31.4"
    assert config.log_level == "debug"
    assert config.controllers.token.sync_configs[0].path == "/var/lib/t"
    assert path.stat().st_mode & 0o777 == 0o640
    restarts = [v for k, v in ctx.kube.log if k == "restart"]  # type: ignore[attr-defined]
    assert restarts == [OWN]


async def test_matching_secret_name_label_does_nothing(tmp_path: Path) -> None:
    node = _node(labels={report.LABEL_SECRET_NAME: "osc-a"})
    ctx = _ctx(tmp_path, node)
    await NodeController(ctx).reconcile(node)
    assert ctx.kube.log == []  # type: ignore[attr-defined]
