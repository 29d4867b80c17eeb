"""The monitoring mixin queries what a live agent really exports.

A whole agent runs on a throwaway node against the real kube-apiserver with everything the
rules and the dashboard look at switched on: a client certificate in its kubeconfig (the
certificate's expiry), the health gate, the kubelet health check (an OSC ``kubelet.service``
and a ``/healthz`` served by the test), an applied OSC (apply, units and rollout sections).
Every ``node_agent_*`` name used by ``monitoring/rules.yaml`` and the Grafana dashboard must be
in its ``/metrics``; a name that is renamed or dropped in the agent fails here.
"""

from __future__ import annotations

import asyncio
import base64
import urllib.request

import pytest
import yaml
from aiohttp import web
from kubernetes_asyncio.client import ApiClient

from node_agent.base.layout import KUBECONFIG_FILE
from node_agent.commands import status
from node_agent.observe import status_document
from tests.conftest import PreparedAgentFactory
from tests.testbed.agent_harness import (
    host,
    loopback_servers,
    osc_document,
    publish_osc,
    running_agent,
    service,
    wait_applied,
    wait_for,
)
from tests.testbed.controlplane import ControlPlane
from tests.testbed.systemd_ns import IsolatedSystemd
from tests.unit.test_monitoring import used_metric_names

pytestmark = pytest.mark.integration


def exported_names(text: str) -> set[str]:
    """Every series name of a scrape that has at least one sample."""
    return {
        line.split("{", 1)[0].split(" ", 1)[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def _get(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


async def test_every_metric_of_the_rules_and_the_dashboard_is_exported(
    admin_api: ApiClient,
    control_plane: ControlPlane,
    make_prepared_agent: PreparedAgentFactory,
    node: IsolatedSystemd,
) -> None:
    used = used_metric_names()
    assert len(used) >= 15  # the extraction works

    async def ok(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    healthz = web.Application()  # kubelet's /healthz, as the health check asks it
    healthz.router.add_get("/healthz", ok)
    runner = web.AppRunner(healthz)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    prepared = await make_prepared_agent(node.root, node_agent={})  # defaults: gate, checks on
    # The agent's identity as a client certificate (CN = its ServiceAccount's user name, so the
    # same RBAC applies): the certificate controller then reports its expiry.
    pair = control_plane.ca.issue(
        f"agent-{prepared.name}",
        common_name=f"system:serviceaccount:kube-system:{prepared.creds.service_account}",
        client=True,
    )
    kubeconfig = host(node.root, KUBECONFIG_FILE)
    doc = yaml.safe_load(kubeconfig.read_text())
    doc["users"][0]["user"] = {
        "client-certificate-data": base64.b64encode(pair.cert.read_bytes()).decode(),
        "client-key-data": base64.b64encode(pair.key.read_bytes()).decode(),
    }
    kubeconfig.write_text(yaml.safe_dump(doc))
    config = yaml.safe_load(prepared.setup.config_file.read_text())
    config["server"] = loopback_servers()
    config["nodeAgent"] = {"healthCheck": {"kubeletHealthz": f"http://127.0.0.1:{port}/healthz"}}
    setup = prepared.setup.with_config(config)
    osc = osc_document([], [service("kubelet.service", command="start", enable=True)])
    checksum = await publish_osc(admin_api, prepared.osc_secret, osc)
    sock = status_document.socket_path(setup.root)

    try:
        async with running_agent(setup, host_name=prepared.name, systemd=node):
            await wait_applied(admin_api, prepared.name, checksum, 60)
            address: dict[str, str] = {}

            async def everything_exported() -> bool:
                if not sock.exists():
                    return False
                answer = await asyncio.to_thread(status.query, sock)
                address.update(answer["endpoints"])
                if not address.get("metrics"):  # not listening yet (after the first reconcile)
                    return False
                text = await asyncio.to_thread(_get, address["metrics"])
                return used <= exported_names(text)

            try:
                await wait_for(everything_exported, 90, "every used metric exported", poll=1.0)
            finally:
                if address.get("metrics"):
                    text = await asyncio.to_thread(_get, address["metrics"])
                    missing = sorted(used - exported_names(text))
                    print(f"used {len(used)} names; missing from the live agent: {missing}")
                    assert not missing
            lines = [ln for ln in text.splitlines() if not ln.startswith("#")]
            expiry = next(  # a client certificate valid for 2 days (the test CA's validity)
                ln for ln in lines if ln.startswith("node_agent_certificate_expiry_timestamp")
            )
            healthy = next(ln for ln in lines if ln.startswith("node_agent_component_healthy"))
            print(expiry, healthy, sep="\n")
            assert healthy.endswith(" 1.0")
            assert 'component="kubelet"' in healthy
    finally:
        await runner.cleanup()
