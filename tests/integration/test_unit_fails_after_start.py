"""A unit that fails after its start job succeeded never keeps the node from reporting.

The whole agent runs on a throwaway node (real systemd) against the real kube-apiserver. Gardener's
contract (its node agent's reconciler): the Node's ``checksum/cloud-config-data`` means "every
item of the OSC was written and every unit job ran" (job result ``done``); what a unit does after
its job is the ``SystemdUnitsReady`` condition's business. A ``Type=simple`` service whose binary
is missing is such a unit: systemd reports its restart job ``done`` at the fork, then the exec
fails (203/EXEC) and ``Restart=always`` brings it back again and again.

The restart-storm guard spaces out the restarts of a unit whose start *jobs* keep failing (here a
``Type=exec`` service, whose job fails when the exec does), or holds it with the operator's
``holdFailingUnits``; it lets go once systemd's own ``Restart=`` brought the unit up, and the
apply is then finished at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio.client import ApiClient

from node_agent.base.layout import BOOTSTRAP_TOKEN_FILE
from tests.conftest import PreparedAgentFactory
from tests.testbed.agent_harness import (
    counted_service,
    host,
    node_annotations,
    osc_document,
    publish_osc,
    running_agent,
    service,
    starts,
    status_json,
    unit_props,
    wait_applied,
    wait_for,
    warning_messages,
)
from tests.testbed.node_status import wait_condition
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

ANNOTATION = "checksum/cloud-config-data"
BINARY = "/opt/uf/bin/daemon"
HEALTHY = "All systemd units from the operating system config are running as expected."
DAEMON = "#!/bin/sh\nexec sleep infinity\n"
STRICT_HEAD = "apiVersion: node-agent.gardener.cloud/v1alpha1\nkind: Strictness\n"


def broken(name: str, kind: str) -> dict[str, Any]:
    """A service whose binary is not there yet; systemd restarts it every second."""
    return service(name, BINARY, extra=f"Type={kind}\nRestart=always\nRestartSec=1\n")


def config_doc(setup_file: Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(setup_file.read_text())
    doc["controllers"]["systemdUnitCheck"] = {"syncPeriod": "1s"}
    doc["nodeAgent"] = {
        # the gate stays on (a short window): the update below restarts a running unit
        "healthGate": {"settleWindow": "2s"},
        "healthCheck": {"enabled": False},
    }
    return doc


def install_binary(node: IsolatedSystemd) -> None:
    path = node.path(BINARY)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(DAEMON)
    path.chmod(0o755)


async def test_unit_failing_after_its_job_is_reported_by_the_condition_not_the_apply(
    admin_api: ApiClient, make_prepared_agent: PreparedAgentFactory, node: IsolatedSystemd
) -> None:
    prepared = await make_prepared_agent(node.root)
    name = prepared.name
    setup = prepared.setup.with_config(config_doc(prepared.setup.config_file))
    token = host(node.root, BOOTSTRAP_TOKEN_FILE)
    token.write_text("bootstrap-token\n")

    async with running_agent(setup, host_name=name, systemd=node):
        good = counted_service("good.service", "g-1")
        first = osc_document([], [good, broken("bad.service", "simple")])
        checksum = await publish_osc(admin_api, prepared.osc_secret, first)

        # Every item written, every job done: reported, like upstream.
        await wait_applied(admin_api, name, checksum, timeout=30)
        assert unit_props(node, "good.service")["ActiveState"] == "active"
        assert starts(node, "good.service") == ["g-1"]
        assert not token.exists()  # an applied OSC retires the bootstrap token
        doc = await status_json(node.root)
        assert doc["last_apply"]["result"] == "succeeded", doc["last_apply"]

        # What the unit does after its job, a Restart= crash loop: upstream's condition counts
        # it healthy (and Gardener reads the condition), node-agent says it in a Warning Event
        # and the status.
        await wait_for(
            lambda: warning_messages(admin_api, name, "bad.service"),
            20,
            "a Warning Event naming bad.service",
        )
        condition = await wait_condition(
            admin_api, name, lambda c: c["status"] == "True", "SystemdUnitsReady as upstream's"
        )
        assert condition["reason"] == "AllUnitsHealthy", condition
        doc = await status_json(node.root)
        looping = doc["units_check"]["looping"]
        assert any("bad.service: failed" in u for u in looping), doc["units_check"]
        assert doc["units_check"]["unhealthy"] == [], doc["units_check"]
        assert doc["health_gate"]["held_units"] == [], doc["health_gate"]

        # The operator's restartLoops strictness puts the crash loop in the condition.
        strict = host(node.root, "/var/lib/gardener-node-agent/node-agent-strict.yaml")
        strict.write_text(STRICT_HEAD + "restartLoops: true\n")
        condition = await wait_condition(
            admin_api,
            name,
            lambda c: c["status"] == "False" and "bad.service" in c["message"],
            "SystemdUnitsReady naming bad.service",
        )
        assert condition["reason"] == "UnhealthyUnits", condition
        assert "good.service" not in condition["message"], condition

        # The cause is fixed on the host: systemd's Restart= brings the unit up by itself.
        install_binary(node)
        await wait_for(
            lambda: unit_props(node, "bad.service")["SubState"] == "running",
            20,
            "bad.service running",
        )
        await wait_condition(
            admin_api, name, lambda c: c["message"] == HEALTHY, "SystemdUnitsReady healthy"
        )

        # The next OSC converges.
        second = osc_document(
            [], [counted_service("good.service", "g-2"), broken("bad.service", "simple")]
        )
        checksum_2 = await publish_osc(admin_api, prepared.osc_secret, second)
        await wait_applied(admin_api, name, checksum_2, timeout=30)
        assert starts(node, "good.service") == ["g-1", "g-2"]
        assert unit_props(node, "bad.service")["SubState"] == "running"


@pytest.mark.parametrize("hold", [False, True], ids=["spaced", "held"])
async def test_held_unit_is_released_when_it_comes_up_by_itself(
    admin_api: ApiClient,
    make_prepared_agent: PreparedAgentFactory,
    node: IsolatedSystemd,
    hold: bool,
) -> None:
    """By default the guard spaces the retries out (upstream retries for ever); with the
    operator's holdFailingUnits it holds the unit until it comes up by itself."""
    prepared = await make_prepared_agent(node.root)
    name = prepared.name
    setup = prepared.setup.with_config(config_doc(prepared.setup.config_file))
    if hold:
        strict = host(node.root, "/var/lib/gardener-node-agent/node-agent-strict.yaml")
        strict.write_text(STRICT_HEAD + "holdFailingUnits: true\n")
    said = "not restarted again" if hold else "restarted again in 5s at the earliest"

    async with running_agent(setup, host_name=name, systemd=node):
        good = counted_service("good.service", "g-1")
        checksum = await publish_osc(
            admin_api, prepared.osc_secret, osc_document([], [good, broken("exec.service", "exec")])
        )
        # Its start job fails (Type=exec): a failed item, retried until the guard spaces the
        # retries out (or holds it).
        await wait_for(
            lambda: warning_messages(admin_api, name, "exec.service", said),
            60,
            "the restart-storm guard on exec.service",
        )
        assert (await node_annotations(admin_api, name)).get(ANNOTATION) != checksum
        assert unit_props(node, "good.service")["ActiveState"] == "active"
        doc = await status_json(node.root)
        assert [h["unit"] for h in doc["health_gate"]["held_units"]] == ["exec.service"]

        # Fixed on the host: Restart= brings it up; the guard lets go and the apply finishes.
        install_binary(node)
        await wait_applied(admin_api, name, checksum, timeout=40)
        assert unit_props(node, "exec.service")["SubState"] == "running"
        doc = await status_json(node.root)
        assert doc["health_gate"]["held_units"] == [], doc["health_gate"]
        assert doc["last_apply"]["result"] == "succeeded", doc["last_apply"]
        await wait_condition(
            admin_api, name, lambda c: c["message"] == HEALTHY, "SystemdUnitsReady healthy"
        )
        assert starts(node, "good.service") == ["g-1"]
