"""list_watch against the real kube-apiserver, with a node agent's least-privilege credentials.

The named Secret's whole life (absent → created → updated → deleted) arrives and nothing else
does; an apiserver crash and restart is survived without help; a stale resourceVersion is
answered with 410 by the real server and leads to a re-list.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from node_agent.kube.client import KubeClient
from node_agent.kube.watch import ListWatch, WatchEvent, list_watch
from tests.conftest import CredentialsFactory, api_client_from
from tests.testbed.controlplane import ControlPlane
from tests.testbed.credentials import NAMESPACE, node_agent_credentials

pytestmark = pytest.mark.integration
NS = NAMESPACE


def _uid() -> str:
    return uuid.uuid4().hex[:8]


def _secret(name: str, value: bytes) -> client.V1Secret:
    return client.V1Secret(
        metadata=client.V1ObjectMeta(name=name), data={"v": base64.b64encode(value).decode()}
    )


def _value(obj: dict[str, object] | None) -> bytes | None:
    if obj is None:
        return None
    data = obj.get("data")
    assert isinstance(data, dict)
    return base64.b64decode(data["v"])


class Collector:
    """Runs a ListWatch in a task and lets the test wait for a matching event."""

    def __init__(self, watch: ListWatch) -> None:
        self.watch = watch
        self.events: list[WatchEvent] = []
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for event in self.watch:
            self.events.append(event)
            self._changed.set()

    async def wait_for(self, match: Callable[[WatchEvent], bool], within: float) -> WatchEvent:
        async with asyncio.timeout(within):
            seen = 0
            while True:
                for event in self.events[seen:]:
                    if match(event):
                        return event
                seen = len(self.events)
                self._changed.clear()
                await self._changed.wait()

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


@contextlib.asynccontextmanager
async def collecting(watch: ListWatch) -> AsyncIterator[Collector]:
    collector = Collector(watch)
    try:
        yield collector
    finally:
        await collector.stop()


async def test_named_secret_lifecycle_and_nothing_else(
    admin_api: ApiClient, make_node_agent_credentials: CredentialsFactory
) -> None:
    core = client.CoreV1Api(admin_api)
    name, other = f"osc-{_uid()}", f"other-{_uid()}"
    creds = await make_node_agent_credentials(f"node-{_uid()}", [name])
    async with KubeClient.from_kubeconfig(creds.kubeconfig) as kube:
        watch = list_watch(kube.secrets(NS), field_selector=f"metadata.name={name}")
        async with collecting(watch) as seen:
            sync = await seen.wait_for(lambda e: e.type == "SYNC", 10)
            assert sync.object is None
            assert sync.objects == ()

            await core.create_namespaced_secret(NS, _secret(other, b"noise"))
            await core.create_namespaced_secret(NS, _secret(name, b"one"))
            await core.patch_namespaced_secret(other, NS, _secret(other, b"more noise"))
            await core.patch_namespaced_secret(name, NS, _secret(name, b"two"))
            await core.delete_namespaced_secret(other, NS)
            await core.delete_namespaced_secret(name, NS)
            await seen.wait_for(lambda e: e.type == "DELETED", 10)

            assert [(e.type, _value(e.object)) for e in seen.events] == [
                ("SYNC", None),
                ("ADDED", b"one"),
                ("MODIFIED", b"two"),
                ("DELETED", b"two"),
            ]
            assert all(
                e.object is None or e.object["metadata"]["name"] == name for e in seen.events
            )
            assert watch.stats.lists == 1
            assert watch.stats.relists == watch.stats.reconnects == 0
            assert watch.resource_version == seen.events[-1].resource_version


async def test_existing_secret_arrives_in_sync_event(
    admin_api: ApiClient, make_node_agent_credentials: CredentialsFactory
) -> None:
    name = f"osc-{_uid()}"
    await client.CoreV1Api(admin_api).create_namespaced_secret(NS, _secret(name, b"present"))
    creds = await make_node_agent_credentials(f"node-{_uid()}", [name])
    async with KubeClient.from_kubeconfig(creds.kubeconfig) as kube:
        watch = list_watch(kube.secrets(NS), field_selector=f"metadata.name={name}")
        async with collecting(watch) as seen:
            sync = await seen.wait_for(lambda e: e.type == "SYNC", 10)
            assert _value(sync.object) == b"present"
            assert sync.object is not None
            assert int(sync.resource_version) >= int(sync.object["metadata"]["resourceVersion"])


def _compact_etcd(cp: ControlPlane) -> int:
    """Compact etcd up to its current revision through its HTTP gateway; return the revision."""

    def post(path: str, body: dict[str, object]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{cp.etcd_port}{path}", data=json.dumps(body).encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=5) as answer:
            return cast(dict[str, Any], json.load(answer))

    revision = int(
        post("/v3/kv/range", {"key": base64.b64encode(b"/").decode()})["header"]["revision"]
    )
    post("/v3/kv/compaction", {"revision": revision, "physical": True})
    return revision


async def test_compacted_resource_version_gets_410_from_the_real_server_and_relists(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    # The shared apiserver's watch cache serves even resourceVersion "1" from its store while it
    # has evicted nothing, so a real 410 needs the etcd path: a private apiserver without watch
    # cache, and a real etcd compaction.
    cp = ControlPlane(tmp_path / "no-watch-cache", bin_dir=control_plane.bin_dir)
    cp.apiserver.argv.append("--watch-cache=false")
    await asyncio.to_thread(cp.start)
    try:
        async with await api_client_from(cp.admin_kubeconfig) as admin:
            core = client.CoreV1Api(admin)
            name = f"osc-{_uid()}"
            created = await core.create_namespaced_secret(NS, _secret(name, b"v0"))
            stale_rv = created.metadata.resource_version
            for i in range(1, 10):
                await core.patch_namespaced_secret(name, NS, _secret(name, f"v{i}".encode()))
            creds = await node_agent_credentials(
                admin,
                tmp_path / "creds",
                server=cp.server,
                ca_file=cp.ca_file,
                node_name=f"node-{_uid()}",
                secret_names=[name],
            )
            revision = await asyncio.to_thread(_compact_etcd, cp)
            assert revision > int(stale_rv)
            async with KubeClient.from_kubeconfig(creds.kubeconfig) as kube:
                secrets = kube.secrets(NS)
                selector = f"metadata.name={name}"

                # What the real server answers: HTTP 200, then one ERROR event with Status 410.
                raw = [
                    event
                    async for event in secrets.watch(
                        resource_version=stale_rv,
                        field_selector=selector,
                        timeout_seconds=5,
                        read_timeout=10,
                    )
                ]
                assert [(e["type"], e["object"]["code"]) for e in raw] == [("ERROR", 410)]
                print(f"real apiserver on a compacted RV: {raw[0]['object']}")

                watch = list_watch(secrets, field_selector=selector, resource_version=stale_rv)
                async with collecting(watch) as seen:
                    sync = await seen.wait_for(lambda e: e.type == "SYNC", 10)
                    assert _value(sync.object) == b"v9"
                    assert (watch.stats.relists, watch.stats.lists) == (1, 1)
                    await core.patch_namespaced_secret(name, NS, _secret(name, b"after"))
                    event = await seen.wait_for(lambda e: e.type == "MODIFIED", 10)
                    assert _value(event.object) == b"after"
                    assert watch.stats.relists == 1
                    assert watch.stats.reconnects == 0
    finally:
        await asyncio.to_thread(cp.stop)


async def test_watch_survives_apiserver_crash_and_restart(
    admin_api: ApiClient,
    make_node_agent_credentials: CredentialsFactory,
    control_plane: ControlPlane,
) -> None:
    name = f"osc-{_uid()}"
    await client.CoreV1Api(admin_api).create_namespaced_secret(NS, _secret(name, b"before"))
    creds = await make_node_agent_credentials(f"node-{_uid()}", [name])
    async with KubeClient.from_kubeconfig(creds.kubeconfig) as kube:
        watch = list_watch(kube.secrets(NS), field_selector=f"metadata.name={name}")
        async with collecting(watch) as seen:
            await seen.wait_for(lambda e: e.type == "SYNC", 10)
            control_plane.kill_apiserver()
            try:
                await asyncio.sleep(1.0)  # the watch notices and retries against a dead port
            finally:
                await asyncio.to_thread(control_plane.start_apiserver)
            restarted = time.monotonic()
            # A fresh admin client: the session's pooled connections died with the server.
            async with await api_client_from(control_plane.admin_kubeconfig) as admin:
                await client.CoreV1Api(admin).patch_namespaced_secret(
                    name, NS, _secret(name, b"after restart")
                )
            event = await seen.wait_for(lambda e: _value(e.object) == b"after restart", 30)
            delay = time.monotonic() - restarted
            print(
                f"update after restart delivered as {event.type} in {delay:.2f}s; "
                f"reconnects={watch.stats.reconnects} relists={watch.stats.relists}"
            )
            assert watch.stats.reconnects >= 1
