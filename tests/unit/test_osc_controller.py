"""The OSC controller's reconcile on the shared fakes: what it decides and in which order.

The real bed covers the same paths end to end; here each decision is pinned down alone: a first
apply, an unchanged Secret, a paced update that is planned once for its admission and its apply.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from node_agent.agent import build_applier
from node_agent.apply.applier import Applier, Planned
from node_agent.context import AgentContext
from node_agent.controllers.osc import pacing
from node_agent.controllers.osc.controller import OSCController
from node_agent.kube.report import ANNOTATION_APPLIED_CHECKSUM, ANNOTATION_SECRET_CHECKSUM
from node_agent.osc.models import OperatingSystemConfig
from tests.unit.fakes import FakeKube, FakeSystemd, make_ctx

SECRET = "gardener-node-agent-pool-a-0123456789abcdef"


def osc_bytes(text: str) -> bytes:
    doc = {
        "apiVersion": "extensions.gardener.cloud/v1alpha1",
        "kind": "OperatingSystemConfig",
        "spec": {
            "type": "debian",
            "purpose": "reconcile",
            "files": [
                {"path": "/etc/test/a.conf", "permissions": 0o644,
                 "content": {"inline": {"data": text}}}
            ],
            "units": [
                {"name": "a.service", "command": "restart", "enable": True,
                 "content": "[Service]\nExecStart=/bin/true\n", "filePaths": ["/etc/test/a.conf"]}
            ],
        },
    }  # fmt: skip
    return yaml.safe_dump(doc).encode()


def secret(raw: bytes, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    checksum = hashlib.sha256(raw).hexdigest()
    return {
        "metadata": {
            "name": SECRET,
            "namespace": "kube-system",
            "resourceVersion": checksum[:8],
            "annotations": {ANNOTATION_SECRET_CHECKSUM: checksum, **(annotations or {})},
        },
        "data": {"osc.yaml": base64.b64encode(raw).decode()},
    }


class CountingApplier:
    """Counts the plans the controller asks the real applier for."""

    def __init__(self, applier: Applier) -> None:
        self.applier = applier
        self.plans = 0
        original = applier.plan

        async def plan(osc: OperatingSystemConfig, resolved: Any) -> Planned:
            self.plans += 1
            return await original(osc, resolved)

        applier.plan = plan  # type: ignore[method-assign]


def controller(tmp_path: Path) -> tuple[OSCController, AgentContext, FakeKube, FakeSystemd]:
    kube, systemd = FakeKube(), FakeSystemd()
    kube.nodes().put({"metadata": {"name": "n1", "uid": "u1", "resourceVersion": "1"}})
    ctx: AgentContext = make_ctx(
        tmp_path,
        config={
            "controllers": {"operatingSystemConfig": {"secretName": SECRET}},
            "nodeAgent": {"healthGate": {"enabled": False}},
        },
        kube=kube,
        systemd=systemd,
    )
    applier = build_applier(
        ctx.fs, ctx.state, systemd, ctx.settings, host_name="n1", images=None, expander=None
    )
    return OSCController(ctx, applier), ctx, kube, systemd


async def applied_annotation(kube: FakeKube) -> str | None:
    node = await kube.nodes().get("n1")
    value = (node["metadata"].get("annotations") or {}).get(ANNOTATION_APPLIED_CHECKSUM)
    return str(value) if value is not None else None


async def test_first_apply_writes_restarts_and_reports(tmp_path: Path) -> None:
    ctl, _, kube, systemd = controller(tmp_path)
    raw = osc_bytes("one\n")
    outcome = await ctl.reconcile(secret(raw))
    assert outcome is not None
    assert (tmp_path / "etc/test/a.conf").read_text() == "one\n"
    assert ("restart", "a.service") in systemd.calls
    assert await applied_annotation(kube) == hashlib.sha256(raw).hexdigest()


async def test_an_unchanged_secret_does_nothing_on_the_host(tmp_path: Path) -> None:
    ctl, _, _, systemd = controller(tmp_path)
    raw = osc_bytes("one\n")
    await ctl.reconcile(secret(raw))
    before = list(systemd.calls)
    assert await ctl.reconcile(secret(raw)) is None
    assert systemd.calls == before


@pytest.mark.parametrize("paced", [False, True])
async def test_an_update_is_planned_once_for_admission_and_apply(
    tmp_path: Path, paced: bool
) -> None:
    ctl, _, _, _ = controller(tmp_path)
    counting = CountingApplier(ctl.applier)
    await ctl.reconcile(secret(osc_bytes("one\n")))
    first = counting.plans
    annotations = {pacing.ANNOTATION_MAX_PARALLEL: "1", pacing.ANNOTATION_CANARIES: "0"}
    outcome = await ctl.reconcile(secret(osc_bytes("two\n"), annotations if paced else None))
    assert outcome is not None
    assert (tmp_path / "etc/test/a.conf").read_text() == "two\n"
    assert counting.plans - first == 1  # admission (when paced) and apply share one plan
    assert outcome.change_set.unit_commands[0].unit == "a.service"
