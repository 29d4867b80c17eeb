"""Health checks of the whole agent on the real bed: the stand-in kubelet as ``kubelet.service``
of an OSC on a throwaway node (its ``/healthz`` made to fail with ``--healthz-fail-file``), real
containerd for its check, the real API server for the Events and the Node's Ready condition.

The kubelet is the stand-in on purpose: each test makes it misbehave (a ``/healthz`` failing on
the test's word, a kubelet broken from its start) or writes the Node's Ready condition itself,
which a real kubelet would overwrite. The health check passing on the real kubelet is
test_gardener_provision.py's and the twin's.

A restart is observed as a new InvocationID of the unit (sampled all along, so "exactly once"
is seen, not inferred). The node shares the host's network namespace: each test's kubelet
answers on a free port, found by the agent in the kubelet unit's flags.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from node_agent.containerd.ping import PingError, containerd_version
from node_agent.controllers.healthcheck import KubeletProbe
from tests.conftest import PreparedAgentFactory
from tests.testbed import standin
from tests.testbed.agent_harness import (
    AgentSetup,
    inline_file,
    node_events,
    osc_document,
    publish_osc,
    running_agent,
    service,
    start_unit,
    unit_props,
    wait_applied,
    wait_for,
)
from tests.testbed.containerd import ContainerdNode
from tests.testbed.controlplane import free_port
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

KUBELET = "kubelet.service"
CONTAINERD = "containerd.service"
BINARY = "/opt/bin/kubelet"
CONFIG = "/var/lib/kubelet/config/kubelet"
FAIL_FILE = "/run/kubelet-unhealthy"


def kubelet_unit_text(port: int) -> str:
    return (
        "[Unit]\nStartLimitIntervalSec=0\n[Service]\n"
        f"ExecStart={BINARY} --config={CONFIG} --healthz-port={port} "
        f"--healthz-fail-file={FAIL_FILE}\n"
        "\n[Install]\nWantedBy=multi-user.target\n"
    )


def kubelet_osc(port: int) -> dict[str, Any]:
    config = yaml.safe_dump(
        {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": port,
        }
    )
    unit = {"name": KUBELET, "content": kubelet_unit_text(port), "enable": True}
    return osc_document(
        [inline_file(CONFIG, config, 0o644)], [{**unit, "command": "start", "filePaths": [CONFIG]}]
    )


def with_health(setup: AgentSetup, **health: str) -> AgentSetup:
    """``setup`` with these health check settings, its other ``nodeAgent`` settings kept (the
    bed's health gate off: an update is not watched for a settle window, during which the
    checks would defer their restarts)."""
    doc = yaml.safe_load(setup.config_file.read_text())
    doc.setdefault("nodeAgent", {})["healthCheck"] = health
    return setup.with_config(doc)


def install_kubelet(node: IsolatedSystemd) -> None:
    target = node.path(BINARY)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(standin.kubelet_binary())
    target.chmod(0o755)


async def kubelet_agent(
    admin_api: ApiClient,
    make_prepared_agent: PreparedAgentFactory,
    node: IsolatedSystemd,
    **health: str,
) -> tuple[int, str, AgentSetup, str]:
    """The stand-in kubelet installed, an agent of its own with these ``health`` settings and
    the kubelet's OSC published: ``(port, node name, setup, checksum)``."""
    port = free_port()
    install_kubelet(node)
    prepared = await make_prepared_agent(node.root)
    name = prepared.name
    setup = with_health(prepared.setup, **health)
    checksum = await publish_osc(admin_api, prepared.osc_secret, kubelet_osc(port))
    return port, name, setup, checksum


def healthz(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError:
        return None


async def events_of(admin: ApiClient, node: str, reason: str) -> list[tuple[str, str]]:
    return [(e.type, e.message) for e in await node_events(admin, node) if e.reason == reason]


class Invocations:
    """The InvocationIDs a unit had, sampled every ``period`` seconds off the event loop."""

    def __init__(self, node: IsolatedSystemd, unit: str, period: float = 0.25) -> None:
        self.node, self.unit, self.period = node, unit, period
        self.seen: list[str] = []

    def distinct(self) -> list[str]:
        return [i for n, i in enumerate(self.seen) if i and i not in self.seen[:n]]

    async def sample(self) -> str:
        props = await asyncio.to_thread(unit_props, self.node, self.unit)
        invocation = props.get("InvocationID", "")
        if not self.seen or self.seen[-1] != invocation:
            self.seen.append(invocation)
        return invocation

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Invocations]:
        async def loop() -> None:
            while True:
                await self.sample()
                await asyncio.sleep(self.period)

        task = asyncio.create_task(loop())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


# --- the acceptance: failing for more than a minute, restarted once -------------------------------


async def test_kubelet_failing_over_a_minute_is_restarted_once_with_the_events(
    admin_api: ApiClient,
    make_prepared_agent: PreparedAgentFactory,
    node: IsolatedSystemd,
) -> None:
    """The default restartAfter (1 min); only the check period is short (1 s)."""
    port, name, setup, checksum = await kubelet_agent(
        admin_api, make_prepared_agent, node, syncPeriod="1s", timeout="2s"
    )
    url = f"http://127.0.0.1:{port}/healthz"

    async with running_agent(setup, host_name=name, systemd=node):
        await wait_applied(admin_api, name, checksum, 60)
        await wait_for(lambda: asyncio.to_thread(healthz, port), 30, "the kubelet answering")
        restart_events = await events_of(admin_api, name, "SystemDUnitRestart")  # the apply's
        async with Invocations(node, KUBELET).running() as invocations:
            await invocations.sample()
            assert len(invocations.distinct()) == 1

            node.path(FAIL_FILE).write_text("made to fail by the test\n")
            failed_at = time.monotonic()
            assert await asyncio.to_thread(healthz, port) == 500
            first = (
                "Warning",
                f"Kubelet is unhealthy: GET {url}: HTTP 500: unhealthy: made to fail by the test",
            )

            async def warned() -> bool:
                return first in await events_of(admin_api, name, "kubelet")

            await wait_for(warned, 20, "the Warning on the first failed check", poll=0.5)
            await wait_for(
                lambda: len(invocations.distinct()) > 1, 120, "kubelet restarted", poll=0.2
            )
            restarted_after = time.monotonic() - failed_at
            node.path(FAIL_FILE).unlink()  # the restart "cured" it
            print(f"kubelet restarted {restarted_after:.1f}s after /healthz began to fail")
            assert restarted_after >= 59.0  # 1 min after the first failed check, not earlier

            recovered = ("Normal", "Kubelet is healthy")

            async def healthy_again() -> bool:
                return recovered in await events_of(admin_api, name, "kubelet")

            await wait_for(healthy_again, 30, "the Normal Event on recovery", poll=0.5)
            await asyncio.sleep(3)  # a few more checks: healthy, nothing else happens
            assert len(invocations.distinct()) == 2

        kubelet_events = await events_of(admin_api, name, "kubelet")
        restarting = [e for e in kubelet_events if "restarting it" in e[1]]
        assert restarting == [
            (
                "Warning",
                f"Kubelet is unhealthy for more than 1m, restarting it: GET {url}: HTTP 500: "
                "unhealthy: made to fail by the test",
            )
        ]
        assert kubelet_events.count(first) == 1
        assert kubelet_events.count(recovered) == 1
        assert await events_of(admin_api, name, "SystemDUnitRestart") == [
            *restart_events,
            ("Normal", "restart kubelet.service: done"),
        ]
        assert unit_props(node, KUBELET)["ActiveState"] == "active"


# --- a kubelet the OSC does not manage is left alone ----------------------------------------------


async def test_a_kubelet_outside_the_osc_is_not_restarted_until_the_osc_names_it(
    admin_api: ApiClient,
    make_prepared_agent: PreparedAgentFactory,
    node: IsolatedSystemd,
) -> None:
    port = free_port()
    install_kubelet(node)
    node.path(FAIL_FILE).write_text("broken from the start\n")
    start_unit(node, KUBELET, kubelet_unit_text(port))  # by hand, not by the OSC
    prepared = await make_prepared_agent(node.root)
    name = prepared.name
    setup = with_health(prepared.setup, syncPeriod="500ms", restartAfter="2s", timeout="2s")
    other = osc_document([], [service("other.service", command="start", enable=True)])
    checksum = await publish_osc(admin_api, prepared.osc_secret, other)

    async with running_agent(setup, host_name=name, systemd=node):
        await wait_applied(admin_api, name, checksum, 60)
        async with Invocations(node, KUBELET).running() as invocations:
            await asyncio.sleep(8)  # four times restartAfter, at 2 checks a second
            assert len(invocations.distinct()) == 1
            assert await events_of(admin_api, name, "kubelet") == []

            # The same kubelet, now a unit of the OSC: checked, and restarted.
            checksum = await publish_osc(admin_api, prepared.osc_secret, kubelet_osc(port))
            await wait_applied(admin_api, name, checksum, 60)

            async def restarted() -> bool:
                events = await events_of(admin_api, name, "kubelet")
                return any("restarting it" in message for _, message in events)

            await wait_for(restarted, 30, "the restart of the managed kubelet", poll=0.5)
            await wait_for(lambda: len(invocations.distinct()) > 1, 10, "a new InvocationID")


# --- containerd -----------------------------------------------------------------------------------


async def test_containerd_not_answering_is_restarted_and_reported_healthy_again(
    admin_api: ApiClient,
    make_prepared_agent: PreparedAgentFactory,
    containerd_node: ContainerdNode,
) -> None:
    node = containerd_node.node
    prepared = await make_prepared_agent(node.root)
    name = prepared.name
    # restartAfter well above the time containerd takes to start again on a busy machine
    setup = with_health(prepared.setup, syncPeriod="500ms", restartAfter="10s", timeout="1s")
    # As Gardener's OSC names it: no content, a drop-in of the OS extension.
    override = "[Service]\nEnvironment=NODE_AGENT_TEST=1\n"
    unit = {"name": CONTAINERD, "dropIns": [{"name": "t.conf", "content": override}]}
    doc = osc_document([], [unit])
    checksum = await publish_osc(admin_api, prepared.osc_secret, doc)
    socket_path = str(node.path("/run/containerd/containerd.sock"))

    async with running_agent(setup, host_name=name, systemd=node):
        await wait_applied(admin_api, name, checksum, 60)
        await asyncio.to_thread(containerd_node.wait_ready)
        assert (await containerd_version(socket_path, 5)).version
        restart_events = await events_of(admin_api, name, "SystemDUnitRestart")  # the apply's
        unhealthy = ("Warning", f"Containerd is unhealthy: no answer from {socket_path} within 1s")
        async with Invocations(node, CONTAINERD).running() as invocations:
            await invocations.sample()
            # A hung containerd: connections accepted (by the kernel), never answered.
            containerd_node.systemctl("kill", "--signal=SIGSTOP", "--kill-whom=main", CONTAINERD)

            async def unanswered() -> bool:  # the signal takes a moment to stop every thread
                try:
                    await containerd_version(socket_path, 1)
                except PingError as exc:
                    return "no answer" in str(exc)
                return False

            await wait_for(unanswered, 10, "containerd stopped answering")

            async def warned() -> bool:
                return unhealthy in await events_of(admin_api, name, "containerd")

            await wait_for(warned, 20, "the Warning on the first failed check", poll=0.5)
            await wait_for(
                lambda: len(invocations.distinct()) > 1, 60, "containerd restarted", poll=0.2
            )

            async def healthy_again() -> bool:
                return ("Normal", "Containerd is healthy") in await events_of(
                    admin_api, name, "containerd"
                )

            await wait_for(healthy_again, 60, "the Normal Event on recovery", poll=0.5)
            assert len(invocations.distinct()) == 2
        assert (await containerd_version(socket_path, 5)).version
        assert await events_of(admin_api, name, "SystemDUnitRestart") == [
            *restart_events,
            ("Normal", "restart containerd.service: done"),
        ]


# --- the Node's readiness flapping ----------------------------------------------------------------


async def test_ready_flapping_node_gets_one_reboot_suggestion(
    admin_api: ApiClient,
    make_prepared_agent: PreparedAgentFactory,
    node: IsolatedSystemd,
) -> None:
    _, name, setup, checksum = await kubelet_agent(
        admin_api, make_prepared_agent, node, syncPeriod="1s"
    )
    core = client.CoreV1Api(admin_api)

    async def set_ready(status: str) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        condition = {
            "type": "Ready",
            "status": status,
            "reason": "KubeletReady" if status == "True" else "KubeletNotReady",
            "message": "set by the test",
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        await core.patch_node_status(name, {"status": {"conditions": [condition]}})
        await asyncio.sleep(0.3)

    async with running_agent(setup, host_name=name, systemd=node):
        await wait_applied(admin_api, name, checksum, 60)
        await set_ready("True")
        for _ in range(4):
            await set_ready("False")
            await set_ready("True")
        await asyncio.sleep(3)
        assert await events_of(admin_api, name, "kubelet") == []  # four: not yet
        suggestion = (
            "Warning",
            "Kubelet toggled between NotReady and Ready at least 5 times in a 10m time window. "
            "Rebooting the node might help",
        )
        for _ in range(3):  # the fifth, then two more: still one Event
            await set_ready("Unknown")
            await set_ready("True")

        async def suggested() -> bool:
            return suggestion in await events_of(admin_api, name, "kubelet")

        await wait_for(suggested, 20, "the reboot suggestion", poll=0.5)
        await asyncio.sleep(3)
        assert await events_of(admin_api, name, "kubelet") == [suggestion]


# --- the kubelet probe's HTTP ---------------------------------------------------------------------


async def test_kubelet_probe_ignores_proxies_and_bounds_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real HTTP server on loopback: 200 is healthy, anything else or silence is not, and a
    proxy in the environment is not used (a dead one would fail every check)."""
    hang = asyncio.Event()

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def fail(_: web.Request) -> web.Response:
        return web.Response(status=503, text="not yet\n")

    async def silent(_: web.Request) -> web.Response:
        await hang.wait()
        return web.Response(text="late")

    app = web.Application()
    app.router.add_get("/ok", ok)
    app.router.add_get("/fail", fail)
    app.router.add_get("/silent", silent)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    probes: list[KubeletProbe] = []
    try:
        base = f"http://127.0.0.1:{port}"
        for path, expected in (
            ("/ok", None),
            ("/fail", f"GET {base}/fail: HTTP 503: not yet"),
            ("/missing", f"GET {base}/missing: HTTP 404: 404: Not Found"),
        ):
            probe = KubeletProbe(f"{base}{path}", 5)
            probes.append(probe)
            assert await probe() == expected
            assert await probe() == expected  # a fresh connection each time
        probe = KubeletProbe(f"{base}/silent", 1)
        probes.append(probe)
        started = time.monotonic()
        assert await probe() == f"GET {base}/silent: no answer within 1s"
        assert time.monotonic() - started < 5
        refused = KubeletProbe(f"http://127.0.0.1:{free_port()}/healthz", 5)
        probes.append(refused)
        answer = await refused()
        assert answer is not None
        assert answer.startswith("GET http://127.0.0.1:")
    finally:
        hang.set()
        for probe in probes:
            await probe.close()
        await runner.cleanup()


async def test_containerd_call_on_a_silent_or_missing_socket(workdir: Path) -> None:
    """A socket that accepts but never answers (a hung daemon) and a missing one both fail, in
    bounded time; a bare connect() would have called the first one healthy. (The sockets live
    in the session's work directory: a test's own directory can be longer than a socket path
    may be.)"""
    path = workdir / "silent.sock"
    server = await asyncio.start_unix_server(lambda r, w: None, path=str(path))
    try:
        started = time.monotonic()
        with pytest.raises(PingError, match=r"no answer .* within 1s"):
            await containerd_version(str(path), 1)
        assert time.monotonic() - started < 5
    finally:
        server.close()
    with pytest.raises(PingError, match="cannot connect"):
        await containerd_version(str(workdir / "none.sock"), 1)
