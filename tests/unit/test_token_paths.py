"""A token ``syncConfigs`` path that can never be right, or that names one of the agent's own
files, is refused when the token controller starts (named by its index, Secret and path), never
written and never retried; the other entries are synced as before. Upstream's decode accepts
such a config (tests/testbed/config_cases.py), so the agent starts with it too."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import pytest

from node_agent.base import layout
from node_agent.config import decode_config
from node_agent.context import AgentContext
from node_agent.controllers.token import TokenController, TokenSync, refusal
from tests.testbed.config_cases import GARDENER_RENDERED, _with
from tests.unit.fakes import FakeKube, make_ctx

pytestmark = pytest.mark.usefixtures("virtual_clock")

GOOD = "/var/lib/valitail/auth-token"
BASE = layout.BASE_DIR


def _secret(name: str, token: bytes) -> dict[str, Any]:
    return {"metadata": {"name": name}, "data": {"token": base64.b64encode(token).decode()}}


def _ctx(tmp_path: Path, kube: FakeKube, **config: Any) -> AgentContext:
    return make_ctx(tmp_path, kube=kube, config=config or None, node_name=None, node_uid=None)


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("var/lib/token", "is not absolute"),
        ("/var/lib/../lib/token", "contains '..'"),
        ("/var/lib/to\0ken", "contains a NUL byte"),
        ("/", "is the root directory"),
        (layout.KUBECONFIG_FILE, "credentials directory"),
        (f"{BASE}//credentials/./kubeconfig", "credentials directory"),
        (layout.BOOTSTRAP_TOKEN_FILE, "credentials directory"),
        (f"{BASE}/credentials/anything", "credentials directory"),
        (layout.CREDENTIALS_DIR, "credentials directory"),
        (f"{BASE}/{layout.LAST_APPLIED_OSC}", "agent's own files"),
        (f"{BASE}/{layout.INVENTORY}.corrupt", "agent's own files"),
        (f"{BASE}/cluster-ca.crt", "agent's own files"),
        (f"{BASE}/machine-name", "agent's own files"),
        (f"{BASE}/config-v1.150.0.yaml", "config file"),
        (f"{BASE}/config.yaml", "agent's own files"),  # the config in use
        (f"{BASE}/config-v1.151.0-rc.1.yaml", "config file"),
        (layout.unit_path(layout.AGENT_UNIT), "agent's own files"),
        (layout.drop_in_dir(layout.AGENT_UNIT), "agent's own files"),
        (layout.drop_in_path(layout.AGENT_UNIT, layout.SELF_UPDATE_DROP_IN), "drop-in"),
        (layout.KUBELET_BOOTSTRAP_KUBECONFIG, "agent's own files"),
        (BASE, "agent's own files"),
        ("/var/lib", "holding the agent's own files"),
    ],
)
def test_paths_that_are_never_a_token_file(tmp_path: Path, path: str, why: str) -> None:
    ctx = _ctx(tmp_path, FakeKube())
    reason = refusal(ctx, path)
    assert reason is not None
    assert why in reason


def test_the_configured_kubeconfig_and_ca_are_the_agents_own(tmp_path: Path) -> None:
    ctx = _ctx(
        tmp_path,
        FakeKube(),
        clientConnection={"kubeconfig": "/etc/agent/kubeconfig"},
        apiServer={"caFile": "/etc/agent/ca.crt"},
    )
    assert refusal(ctx, "/etc/agent/kubeconfig") is not None
    assert refusal(ctx, "/etc/agent/ca.crt") is not None
    assert refusal(ctx, "/etc/agent/token") is None


@pytest.mark.parametrize(
    "path", [GOOD, f"{BASE}/token", layout.TOKEN_FILE, f"{BASE}//credentials/token", "/etc/x"]
)
def test_paths_a_token_may_take(tmp_path: Path, path: str) -> None:
    # credentials/token is a token file: a standalone install's kubeconfig names it and this
    # sync rotates it
    assert refusal(_ctx(tmp_path, FakeKube()), path) is None


@pytest.mark.parametrize(
    "path", [layout.KUBECONFIG_FILE, "var/lib/token", "/var/lib/../token", "/var/lib/to\0ken"]
)
async def test_a_refused_entry_is_reported_once_and_the_others_are_synced(
    tmp_path: Path, path: str
) -> None:
    kube = FakeKube()
    kube.secrets("kube-system").put(_secret("evil", b"attacker-token"))
    kube.secrets("kube-system").put(_secret("valitail", b"good-token"))
    kubeconfig = tmp_path / layout.KUBECONFIG_FILE.lstrip("/")
    kubeconfig.parent.mkdir(parents=True)
    kubeconfig.write_bytes(b"apiVersion: v1\nkind: Config\n")
    config = decode_config(
        _with(
            {
                "controllers.token.syncConfigs": [
                    {"secretName": "evil", "path": path},
                    {"secretName": "valitail", "path": GOOD},
                ]
            }
        )
    )
    ctx: AgentContext = make_ctx(tmp_path, kube=kube, config=config, node_name=None, node_uid=None)
    controller = TokenController(ctx, check_period=0.02)
    task = asyncio.create_task(controller.run())
    try:
        for _ in range(500):
            if (tmp_path / GOOD.lstrip("/")).exists():
                break
            await asyncio.sleep(0.01)
        assert (tmp_path / GOOD.lstrip("/")).read_bytes() == b"good-token"
        await asyncio.sleep(0.2)  # time for retries, if there were any
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert kubeconfig.read_bytes() == b"apiVersion: v1\nkind: Config\n"
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [
        "auth-token",
        "kubeconfig",
    ]
    errors = [e["error"] for e in ctx.health.errors if e["source"] == "token"]
    assert len(errors) == 1, errors
    assert errors[0].startswith("controllers.token.syncConfigs[0] (Secret evil, path ")
    assert [s.secret_name for s in controller.syncs] == ["valitail"]


async def test_a_refused_entry_writes_nothing_even_when_called_directly(tmp_path: Path) -> None:
    kube = FakeKube()
    kube.secrets("kube-system").put(_secret("evil", b"attacker-token"))
    ctx = _ctx(tmp_path, kube)
    entry = decode_config(
        _with(
            {
                "controllers.token.syncConfigs": [
                    {"secretName": "evil", "path": layout.KUBECONFIG_FILE}
                ]
            }
        )
    ).controllers.token.sync_configs[0]
    sync = TokenSync(ctx, entry, sync_period=3600)
    assert not await sync.sync()
    assert not (tmp_path / layout.KUBECONFIG_FILE.lstrip("/")).exists()
    await asyncio.wait_for(sync.run(), 1)  # returns at once: no watch, no loops


def test_the_config_with_such_entries_is_accepted_as_upstream_does() -> None:
    text = GARDENER_RENDERED.replace(
        "  token:\n",
        "  token:\n    syncConfigs:\n    - {secretName: a, path: " + layout.KUBECONFIG_FILE + "}\n",
    )
    assert decode_config(text).controllers.token.sync_configs[0].path == layout.KUBECONFIG_FILE
