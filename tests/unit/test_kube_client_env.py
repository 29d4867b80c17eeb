"""The Kubernetes client reads the proxy environment once per client, not on every request
(kubernetes-asyncio's session would look up the proxy and ~/.netrc in two worker-thread hops
per request)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from node_agent.kube.client import KubeClient


def kubeconfig(tmp_path: Path, server: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "current-context": "c",
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                "clusters": [{"name": "k", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": "t0ken"}}],
            }
        )
    )
    return path


@pytest_asyncio.fixture
async def server() -> AsyncIterator[str]:
    async def lease(request: web.Request) -> web.Response:
        return web.json_response({"kind": "Lease", "metadata": {"name": "x"}})

    app = web.Application()
    app.router.add_get("/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/x", lease)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_a_request_makes_no_worker_thread_hop(
    server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    kube = KubeClient.from_kubeconfig(kubeconfig(tmp_path, server))
    loop = asyncio.get_running_loop()
    hops: list[Any] = []
    real = loop.run_in_executor

    def counted(executor: Any, func: Any, *args: Any) -> Any:
        hops.append(func)
        return real(executor, func, *args)

    monkeypatch.setattr(loop, "run_in_executor", counted)
    try:
        for _ in range(3):
            assert (await kube.get_lease("kube-system", "x"))["kind"] == "Lease"
    finally:
        await kube.close()
    assert hops == []


@pytest.mark.parametrize(
    ("env", "proxy", "header"),
    [
        ({"HTTPS_PROXY": "http://proxy.example:3128"}, "http://proxy.example:3128", None),
        (
            {"HTTPS_PROXY": "http://u:p@proxy.example:3128"},
            "http://proxy.example:3128",
            "Basic dTpw",
        ),
        ({"HTTPS_PROXY": "http://proxy.example:3128", "NO_PROXY": "api.example"}, None, None),
        ({}, None, None),
    ],
)
async def test_the_proxy_comes_from_the_environment_read_at_build(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    proxy: str | None,
    header: str | None,
) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    kube = KubeClient.from_kubeconfig(kubeconfig(tmp_path, "https://api.example:6443"))
    try:
        rest = kube._current().api.rest_client
        assert rest.proxy == proxy
        assert (rest.proxy_headers or {}).get("Proxy-Authorization") == header
        assert rest.pool_manager.trust_env is False
    finally:
        await kube.close()
