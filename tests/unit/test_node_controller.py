"""Node controller with fakes: restart order, the own unit last, no loops, config rewrite, a
deleted Node shown in readiness and status, retries on the one backoff policy."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from node_agent.base.configfile import MAX_CONFIG_BYTES
from node_agent.base.errors import ConfigError, KubeTransportError
from node_agent.base.retry import API, Backoff
from node_agent.config import parse_config
from node_agent.context import AgentContext
from node_agent.controllers.node import NodeController, restart_units
from node_agent.kube import report
from node_agent.observe.observations import ApplyObservations
from node_agent.observe.probes import Probes
from node_agent.observe.view import Sources
from tests.unit.fakes import FakeKube, FakeSystemd, make_ctx, until

OWN = "gardener-node-agent.service"


def _ctx(tmp_path: Path, node: dict[str, Any], failing: set[str] = frozenset()) -> AgentContext:  # type: ignore[assignment]
    kube = FakeKube()
    kube.nodes().put(node)
    return make_ctx(
        tmp_path,
        config={"controllers": {"operatingSystemConfig": {"secretName": "osc-a"}}},
        kube=kube,
        systemd=FakeSystemd(failing=failing, calls=kube.calls),
        state=None,
        agent_unit=OWN,
    )


def _kube(ctx: AgentContext) -> FakeKube:
    assert isinstance(ctx.kube, FakeKube)
    return ctx.kube


def _log(ctx: AgentContext) -> list[tuple[str, Any]]:
    """The restarts, Events and Node patches, in order (Kubernetes and systemd share the list)."""
    steps: list[tuple[str, Any]] = []
    for call in _kube(ctx).calls:
        if call[0] == "restart":
            steps.append(("restart", call[1]))
        elif call[0] == "create_event":
            body = call[1]
            steps.append(("event", (body["reason"], body["type"], body["message"])))
        elif call[0] == "patch_node":
            steps.append(("patch", call[2]))
        else:
            raise AssertionError(f"unexpected call {call}")
    return steps


def _node(annotations: dict[str, str] | None = None, labels: dict[str, str] | None = None) -> Any:
    return {"metadata": {"name": "n1", "annotations": annotations or {}, "labels": labels or {}}}


def test_restart_units_parsing() -> None:
    assert restart_units(" a, b.service ,,c.socket, a ") == ["a.service", "b.service", "c.socket"]
    assert restart_units("") == []


async def test_others_restarted_then_annotation_removed(tmp_path: Path) -> None:
    node = _node({report.ANNOTATION_RESTART_SERVICES: "x,y", "keep": "1"})
    ctx = _ctx(tmp_path, node, failing={"y.service"})
    await NodeController(ctx).reconcile(node)
    log = _log(ctx)
    assert [e[0] for e in log] == ["restart", "event", "restart", "event", "patch"]
    assert log[1][1][:2] == ("SystemDUnitRestart", "Normal")
    assert log[3][1][:2] == ("SystemDUnitRestart", "Warning")
    assert node["metadata"]["annotations"] == {"keep": "1"}


async def test_own_unit_annotation_removed_first_and_restart_last(tmp_path: Path) -> None:
    node = _node({report.ANNOTATION_RESTART_SERVICES: f"gardener-node-agent,x,{OWN},y"})
    ctx = _ctx(tmp_path, node)
    controller = NodeController(ctx)
    await controller.reconcile(node)
    steps = [(k, v if k != "event" else v[0]) for k, v in _log(ctx)]
    assert steps[0][0] == "patch"
    assert [v for k, v in steps if k == "restart"] == ["x.service", "y.service", OWN]
    assert steps[-1] == ("restart", OWN)
    # The restarted agent (or this one, on the next event) sees no annotation: nothing more.
    await controller.reconcile(node)
    assert len(_log(ctx)) == len(steps)


async def test_failed_removal_is_retried_without_restarting_again(tmp_path: Path) -> None:
    node = _node({report.ANNOTATION_RESTART_SERVICES: "x"})
    ctx = _ctx(tmp_path, node)
    _kube(ctx).fail("patch_node", KubeTransportError("down"))
    controller = NodeController(ctx)
    with pytest.raises(KubeTransportError):
        await controller.reconcile(node)
    await controller.reconcile(node)
    assert [k for k, _ in _log(ctx)].count("restart") == 1
    assert report.ANNOTATION_RESTART_SERVICES not in node["metadata"]["annotations"]


async def test_a_config_larger_than_any_config_is_not_rewritten(tmp_path: Path) -> None:
    """The config is read bounded, as at start: a huge file is refused, not read whole."""
    path = tmp_path / "var/lib/gardener-node-agent/config.yaml"
    path.parent.mkdir(parents=True)
    valid = (
        b"apiVersion: nodeagent.config.gardener.cloud/v1alpha1\nkind: NodeAgentConfiguration\n"
        b"controllers:\n  operatingSystemConfig:\n    secretName: osc-a\n"
        b"    kubernetesVersion: 1.33.4\n"
    )
    huge = valid + b"#" * MAX_CONFIG_BYTES + b"\n"
    path.write_bytes(huge)
    controller = NodeController(_ctx(tmp_path, _node()))
    with pytest.raises(ConfigError, match=rf"^cannot read config .*larger than {MAX_CONFIG_BYTES}"):
        await controller.rewrite_config_secret_name("osc-b")
    assert path.read_bytes() == huge


async def test_secret_name_label_rewrites_config_and_restarts_once(tmp_path: Path) -> None:
    original = (
        "apiVersion: nodeagent.config.gardener.cloud/v1alpha1\n"
        "kind: NodeAgentConfiguration\n"
        "logLevel: debug\n"
        "controllers:\n"
        "  operatingSystemConfig:\n"
        "    secretName: osc-a\n"
        "    kubernetesVersion: 1.33.4\n"
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
    assert config.controllers.operating_system_config.kubernetes_version == "1.33.4"
    assert config.log_level == "debug"
    assert config.controllers.token.sync_configs[0].path == "/var/lib/t"
    assert path.stat().st_mode & 0o777 == 0o640
    restarts = [v for k, v in _log(ctx) if k == "restart"]
    assert restarts == [OWN]


async def test_matching_secret_name_label_does_nothing(tmp_path: Path) -> None:
    node = _node(labels={report.LABEL_SECRET_NAME: "osc-a"})
    ctx = _ctx(tmp_path, node)
    await NodeController(ctx).reconcile(node)
    assert _log(ctx) == []


def _ready_ctx(tmp_path: Path) -> tuple[AgentContext, NodeController, Probes]:
    """A context whose readiness only depends on the Node (lease renewed, Secret listed)."""
    ctx = _ctx(tmp_path, _node())
    controller = NodeController(ctx)
    ctx.state = type("NoState", (), {"pending": lambda self: None})()
    ctx.node_known.set()
    ctx.health.progress("lease")
    ctx.health.progress("osc-watch")
    return ctx, controller, Probes(ctx, Sources(node=controller), ApplyObservations())


def _uid(uid: str, annotations: dict[str, str] | None = None) -> Any:
    node = _node(annotations)
    node["metadata"]["uid"] = uid
    return node


async def test_deleted_node_fails_readiness_once_and_clears_when_recreated(
    tmp_path: Path,
) -> None:
    ctx, controller, probes = _ready_ctx(tmp_path)
    controller.observe("SYNC", _uid("u1"))
    assert probes.ready().ok
    with capture_logs() as logs:
        controller.observe("DELETED", _uid("u1"))
        controller.observe("SYNC", None)  # a re-list after the deletion: the same news
        controller.observe("DELETED", _uid("u1"))
    verdict = probes.ready()
    assert not verdict.ok
    assert len(verdict.reasons) == 1
    assert verdict.reasons[0].startswith("node n1 not found (deleted from the API server)")
    gone = [e for e in logs if e["event"] == "own node is gone"]
    assert len(gone) == 1  # said once, not per event
    assert gone[0]["log_level"] == "error"
    assert gone[0]["node"] == "n1"
    errors = [e for e in ctx.health.errors if e["source"] == "node"]
    assert len(errors) == 1
    assert "node n1 not found" in errors[0]["error"]
    assert controller.stats.deletions == 1

    with capture_logs() as logs:
        controller.observe("ADDED", _uid("u2"))  # re-created: a new object, a new uid
    assert probes.ready().ok
    assert controller.missing is None
    assert ctx.node_uid == "u2"  # Events and the Lease owner name the new object
    assert [e["event"] for e in logs] == ["own node was re-created", "own node exists again"]

    controller.observe("DELETED", _uid("u2"))  # a second deletion is news again
    assert not probes.ready().ok
    assert controller.stats.deletions == 2


async def test_a_404_on_a_request_marks_the_node_gone(tmp_path: Path) -> None:
    ctx, controller, probes = _ready_ctx(tmp_path)
    kube = _kube(ctx)
    kube.nodes().delete("n1")
    worker = asyncio.create_task(controller._worker())
    try:
        # A restart request arrives while the Node is being deleted: the re-read gets 404.
        controller.observe("MODIFIED", _uid("u1", {report.ANNOTATION_RESTART_SERVICES: "x"}))
        await until(lambda: controller.missing is not None)
        assert "404" in probes.ready().reasons[0]
        assert _log(ctx) == []  # nothing restarted, no retry loop
        recreated = _uid("u2", {report.ANNOTATION_RESTART_SERVICES: "x"})
        kube.nodes().put(recreated)
        controller.observe("ADDED", recreated)
        await until(lambda: ("restart", "x.service") in _log(ctx))
        assert probes.ready().ok
    finally:
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)


async def test_failed_requests_are_retried_on_the_backoff_policy(tmp_path: Path) -> None:
    node = _uid("u1", {report.ANNOTATION_RESTART_SERVICES: "x"})
    ctx = _ctx(tmp_path, node)
    _kube(ctx).fail("patch_node", KubeTransportError("down"), times=2)
    delays: list[float] = []

    class Recorded(Backoff):
        def next(self) -> float:
            delays.append(super().next())
            return 0.0  # no real waiting in a unit test

    backoff = Recorded(base=API[0], cap=API[1], rng=random.Random(3))
    controller = NodeController(ctx, backoff=backoff)
    worker = asyncio.create_task(controller._worker())
    try:
        controller.observe("MODIFIED", node)
        await until(
            lambda: report.ANNOTATION_RESTART_SERVICES not in node["metadata"]["annotations"]
        )
    finally:
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
    assert len(delays) == 2  # one per failure, growing as the API policy says
    assert API[0] / 2 <= delays[0] <= API[0]
    assert API[0] <= delays[1] <= 2 * API[0]
    assert backoff.attempt == 0  # reset by the success
    restarts = [v for k, v in _log(ctx) if k == "restart"]
    assert restarts == ["x.service"]  # the retries only removed the annotation
    assert [e["source"] for e in ctx.health.errors] == ["node", "node"]
