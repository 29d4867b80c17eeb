"""An in-place OS update on the real bed: the drain gate, the OS extension's command (a stand-in
that stages the new os-release and asks for a reboot), the reboot (the agent started again on
the node whose os-release now names the new version), completion and the Node's outcome.

The test plays machine-controller-manager (it sets the Node's ``InPlaceUpdate`` condition to
``ReadyForUpdate`` after "draining") and the OS extension (``status.inPlaceUpdates.osUpdate``).

Where a test needs a kubelet, it is the stand-in, on purpose: a new kubelet that starts
unhealthy (``FAIL_FILE``), one that refuses the state file of another CPU manager policy, one
whose bootstrap the test holds back to look at the files in between. The same updates on the
real kubelet, going well, are test_gardener_provision.py's (a kubelet minor update and a CA
rotation in place) and the VM's (an OS update through a reboot).
"""

from __future__ import annotations

import base64
import copy
import functools
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from node_agent.apply.executor import CRASH_HOOK_ENV
from node_agent.base.layout import BASE_DIR, IN_PLACE, KUBECONFIG_FILE
from node_agent.osc import inplace as ip
from tests.conftest import PreparedAgentFactory
from tests.integration.test_certificate_flow import gardener_layout, kubeconfig_certificate
from tests.testbed import standin
from tests.testbed.agent_harness import (
    AgentProcess,
    OSCAgent,
    counted_service,
    create_node,
    host,
    inline_file,
    node_events,
    node_labels,
    publish_osc,
    put_secret,
    run_status,
    running_agent,
    service,
    starts,
    unique,
    unit_props,
    wait_applied,
    wait_for,
)
from tests.testbed.controlplane import ControlPlane, free_port
from tests.testbed.csr_approver import CSRApprover
from tests.testbed.gardener_gen import generate
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

UPDATE_SCRIPT = "/opt/gardener/bin/inplace-update.sh"
# The OS extension's command, standing in: a non-retriable failure when asked for version 0,
# else the new os-release staged for the next boot and a reboot asked for.
SCRIPT = """#!/bin/sh
set -eu
version="$2"
if [ "$version" = "0" ]; then echo "error: invalid arguments"; exit 2; fi
if [ "$version" = "9" ]; then  # 2 MiB of output, then the cause
  x=xxxxxxxxxxxxxxxx; for i in 1 2 3 4 5 6 7 8 9 10; do x="$x$x"; done
  i=0; while [ $i -lt 128 ]; do echo "$x"; i=$((i + 1)); done
  echo "error: system failure"; exit 3
fi
echo "PRETTY_NAME=\\"Test Linux $version\\"" > /etc/os-release.next
echo "runs" >> /var/lib/inplace-update.runs
echo "update to $version staged; reboot required"
"""


KUBELET = "kubelet.service"
KUBELET_BINARY = "/opt/bin/kubelet"
FAIL_FILE = "/run/kubelet-unhealthy"


@functools.cache
def gardener_in_place() -> dict[str, Any]:
    """The OSC Gardener v1.150.0 sends an in-place pool (gardener-gen's ``inplace`` shape)."""
    doc: dict[str, Any] = generate("inplace").osc
    return doc


def kubelet_unit(port: int, version: str, extra: str = "") -> dict[str, Any]:
    """The stand-in kubelet, its version in its unit (a new minor is a new binary and unit)."""
    text = (
        f"[Unit]\nStartLimitIntervalSec=0\n[Service]\nEnvironment=KUBELET_VERSION={version}\n"
        f"{extra}ExecStart={KUBELET_BINARY} --config={ip.KUBELET_CONFIG} --healthz-port={port} "
        f"--healthz-fail-file={FAIL_FILE}\n\n[Install]\nWantedBy=multi-user.target\n"
    )
    return {"name": KUBELET, "content": text, "enable": True, "command": "start",
            "filePaths": [ip.KUBELET_CONFIG]}  # fmt: skip


def in_place_osc(
    os_version: str,
    text: str,
    *,
    kubelet: str = "1.33.0",
    port: int | None = None,
    cpu_policy: str | None = None,
    rotation: dict[str, Any] | None = None,
    kubelet_extra: str = "",
    units: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """Gardener's in-place OSC on the bed: its kubelet config (with the stand-in's healthz
    port), ``spec.inPlaceUpdates`` and the OS extension's ``status.inPlaceUpdates`` as generated,
    with the targets of the test; the files and units that need Gardener's images are replaced
    by a file of the test and the stand-in kubelet."""
    base = gardener_in_place()
    (config_file,) = [f for f in base["spec"]["files"] if f["path"] == ip.KUBELET_CONFIG]
    config = yaml.safe_load(base64.b64decode(config_file["content"]["inline"]["data"]))
    assert config["cpuManagerPolicy"] == "none"  # Gardener's default
    config.update(healthzBindAddress="127.0.0.1", healthzPort=port or 0)
    if cpu_policy is not None:
        config["cpuManagerPolicy"] = cpu_policy
    encoded = base64.b64encode(yaml.safe_dump(config).encode()).decode()
    files = [
        {**config_file, "content": {"inline": {"encoding": "b64", "data": encoded}}},
        inline_file("/etc/demo/inplace.conf", text),
    ]
    spec = copy.deepcopy(base["spec"]["inPlaceUpdates"])
    spec.update(operatingSystemVersion=os_version, kubelet=kubelet)
    if rotation is not None:
        spec["credentialsRotation"] = rotation
    status = copy.deepcopy(base["status"]["inPlaceUpdates"])
    assert status["osUpdate"]["command"] == UPDATE_SCRIPT
    status["osUpdate"]["args"] = ["--version", os_version]
    all_units = [*units, *([kubelet_unit(port, kubelet, kubelet_extra)] if port else [])]
    return {
        "apiVersion": base["apiVersion"],
        "kind": base["kind"],
        "spec": {"type": base["spec"]["type"], "purpose": base["spec"]["purpose"],
                 "files": files, "units": all_units, "inPlaceUpdates": spec},
        "status": {"inPlaceUpdates": status},
    }  # fmt: skip


def install_kubelet(node: IsolatedSystemd) -> None:
    target = node.path(KUBELET_BINARY)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(standin.kubelet_binary())
    target.chmod(0o755)


def invocation(node: IsolatedSystemd, unit: str) -> str:
    return unit_props(node, unit).get("InvocationID", "")


def rotation(ca: str | None = None, sa: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if ca is not None:
        out["certificateAuthorities"] = {"lastInitiationTime": ca}
    if sa is not None:
        out["serviceAccountKey"] = {"lastInitiationTime": sa}
    return out


async def in_place_history(root: Path) -> list[dict[str, Any]]:
    doc = await status_json_history(root)
    return [e for e in doc if e.get("trigger") == "in-place"]


async def status_json_history(root: Path) -> list[dict[str, Any]]:
    code, out, err = await run_status(root, "--history", "--json")
    assert code in (0, 3), err.decode()
    doc = json.loads(out)
    entries = doc if isinstance(doc, list) else doc.get("history") or doc.get("entries") or []
    return list(entries)


def set_os(node: IsolatedSystemd, version: str) -> None:
    path = node.path("/etc/os-release")
    if path.is_symlink() or path.exists():
        path.unlink()
    path.write_text(f'ID=test\nPRETTY_NAME="Test Linux {version}"\n')


def reboot(node: IsolatedSystemd) -> None:
    """What the reboot does to the disk here: the staged os-release becomes the OS's."""
    staged = node.path("/etc/os-release.next")
    set_os(node, "")
    node.path("/etc/os-release").write_text(staged.read_text())
    staged.unlink()


@pytest_asyncio.fixture(loop_scope="session")
async def agent(
    admin_api: ApiClient, control_plane: ControlPlane, node: IsolatedSystemd, tmp_path: Path
) -> AsyncIterator[OSCAgent]:
    set_os(node, "1877.4")
    script = node.path(UPDATE_SCRIPT)
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(SCRIPT)
    script.chmod(0o755)
    async with OSCAgent(admin_api, control_plane, node, tmp_path).running() as harness:
        yield harness


#: machine-controller-manager's condition, after draining the node
READY = {"type": "InPlaceUpdate", "status": "True", "reason": "ReadyForUpdate",
         "message": "node drained"}  # fmt: skip


async def set_ready_for_update(agent: OSCAgent) -> None:
    """machine-controller-manager, after draining the node."""
    await client.CoreV1Api(agent.admin).patch_node_status(
        agent.node_name, {"status": {"conditions": [READY]}}
    )


def runs(node: IsolatedSystemd) -> int:
    path = node.path("/var/lib/inplace-update.runs")
    return len(path.read_text().splitlines()) if path.exists() else 0


async def test_os_update_end_to_end(agent: OSCAgent, node: IsolatedSystemd) -> None:
    first = await agent.publish(in_place_osc("1877.4", "one\n"))
    await agent.wait_applied(first)

    update = await agent.publish(in_place_osc("1877.5", "two\n"))
    await agent.wait_event("InPlaceUpdateWaitingForDrain", "operating_system")
    assert runs(node) == 0
    assert node.path("/etc/demo/inplace.conf").read_text() == "one\n"  # nothing applied yet

    await set_ready_for_update(agent)
    assert agent.controller is not None
    agent.controller.retry_now()  # the Node's watch does this in the agent (not run here)
    await agent.wait_event("InPlaceUpdateRebooting", "1877.5", timeout=60)
    assert runs(node) == 1
    assert node.path("/etc/demo/inplace.conf").read_text() == "two\n"
    annotations = await agent.node_annotations()
    assert annotations[ip.ANNOTATION_UPDATING_OS_VERSION] == "1877.5"
    assert annotations["checksum/cloud-config-data"] == first  # not before the reboot

    await agent.stop()
    reboot(node)
    await agent.start()
    await agent.wait_applied(update, timeout=60)
    labels, annotations = await agent.node_labels(), await agent.node_annotations()
    assert labels[ip.LABEL_UPDATE_RESULT] == "successful"
    assert ip.ANNOTATION_UPDATING_OS_VERSION not in annotations
    assert runs(node) == 1  # the command ran once
    await agent.wait_event("InPlaceUpdateSuccessful", "operating_system")


async def test_a_non_retriable_os_update_failure(agent: OSCAgent, node: IsolatedSystemd) -> None:
    first = await agent.publish(in_place_osc("1877.4", "one\n"))
    await agent.wait_applied(first)
    await set_ready_for_update(agent)
    await agent.publish(in_place_osc("0", "two\n"))

    async def failed() -> bool:
        return (await agent.node_labels()).get(ip.LABEL_UPDATE_RESULT) == "failed"

    await wait_for(failed, 60, "the Node marked failed")
    reason = (await agent.node_annotations())[ip.ANNOTATION_UPDATE_FAILED_REASON]
    assert "non-retriable error detected" in reason
    assert "invalid arguments" in reason
    await agent.wait_event("InPlaceUpdateFailed", "invalid arguments")
    # the rest of the OSC is applied; the node keeps its OS and the old checksum
    assert node.path("/etc/demo/inplace.conf").read_text() == "two\n"
    assert (await agent.node_annotations())["checksum/cloud-config-data"] == first


async def test_megabytes_of_update_output_fail_the_update_with_their_tail(
    agent: OSCAgent, node: IsolatedSystemd
) -> None:
    """Upstream puts all of the output in the Node's annotation: past 256 KiB the API server
    refuses that patch, and the failure never reaches machine-controller-manager."""
    first = await agent.publish(in_place_osc("1877.4", "one\n"))
    await agent.wait_applied(first)
    await set_ready_for_update(agent)
    await agent.publish(in_place_osc("9", "two\n"))

    async def failed() -> bool:
        return (await agent.node_labels()).get(ip.LABEL_UPDATE_RESULT) == "failed"

    await wait_for(failed, 60, "the Node marked failed")
    reason = (await agent.node_annotations())[ip.ANNOTATION_UPDATE_FAILED_REASON]
    assert "non-retriable error detected: exit status 3, output (its last 4096 of " in reason
    assert reason.endswith("xxxx error: system failure")
    assert len(reason.encode()) <= ip.REASON_LIMIT
    assert node.path("/etc/demo/inplace.conf").read_text() == "two\n"
    assert (await agent.node_annotations())["checksum/cloud-config-data"] == first


async def test_a_version_nobody_expected_fails_that_update_and_the_agent_stays_up(
    harness: OSCAgent, node: IsolatedSystemd, tmp_path: Path
) -> None:
    """``str.isdigit`` takes "²", ``int`` does not: the agent exited 1, on every restart."""
    set_os(node, "1877.4")
    agent = AgentProcess(harness, tmp_path / "agent.log")
    try:
        first = await harness.publish(process_osc("1877.4", "v1"))
        await agent.start()
        await harness.wait_applied(first)
        await set_condition(harness, READY)
        await harness.publish(process_osc("1877.4", "v2", kubelet="1.3²"))

        async def failed() -> bool:
            return (await harness.node_labels()).get(ip.LABEL_UPDATE_RESULT) == "failed"

        await wait_for(failed, 60, "the Node marked failed")
        reason = (await harness.node_annotations())[ip.ANNOTATION_UPDATE_FAILED_REASON]
        assert reason == "in-place changes not computed: invalid version '1.3²'"
        assert node.path("/etc/demo/inplace.conf").read_text() == "v2\n"  # the rest applied
        assert agent.proc is not None
        assert agent.proc.returncode is None, agent.log_tail()  # up
        assert await agent.terminate() == 0, agent.log_tail()
        await agent.start()  # restarted on the same Secret: up, the outcome kept
        await wait_for(lambda: phase_is(node.root, "failed"), 30, "the failure after a restart")
        assert agent.proc.returncode is None, agent.log_tail()
        assert await agent.terminate() == 0, agent.log_tail()
    finally:
        await agent.kill()


# --- the kubelet: a minor update and a CPU manager policy change ----------------------------------


async def test_a_kubelet_minor_update_restarts_it_and_awaits_its_health(
    agent: OSCAgent, node: IsolatedSystemd
) -> None:
    install_kubelet(node)
    port = free_port()
    first = await agent.publish(in_place_osc("1877.4", "one\n", kubelet="1.33.0", port=port))
    await agent.wait_applied(first)
    before = invocation(node, KUBELET)
    assert agent.controller is not None
    inplace = agent.controller.inplace
    inplace.health_interval = 0.5
    probe, answers = inplace.kubelet_health, []
    assert probe is not None

    async def counted() -> str | None:
        answers.append(await probe())
        return answers[-1]

    inplace.kubelet_health = counted
    node.path(FAIL_FILE).write_text("unhealthy\n")  # the new kubelet starts unhealthy
    await set_ready_for_update(agent)

    update = await agent.publish(in_place_osc("1877.4", "two\n", kubelet="1.34.0", port=port))
    # the restarted kubelet may not listen yet on the first question: unhealthy all the same
    await wait_for(
        lambda: sum("500" in (answer or "") for answer in answers) >= 3,
        60,
        "the kubelet's health asked three times and answered 500",
    )
    assert all(answer is not None for answer in answers), answers
    assert inplace.phase == "kubelet"
    after = invocation(node, KUBELET)
    assert after
    assert after != before  # restarted on its new version
    assert (await agent.node_annotations())["checksum/cloud-config-data"] == first
    assert ip.LABEL_UPDATE_RESULT not in await agent.node_labels()

    node.path(FAIL_FILE).unlink()
    await agent.wait_applied(update, timeout=30)
    assert invocation(node, KUBELET) == after  # restarted once
    assert (await agent.node_labels())[ip.LABEL_UPDATE_RESULT] == "successful"
    await agent.wait_event("InPlaceUpdateSuccessful", "kubelet_minor_version")
    assert inplace.view().phase == "done"
    (entry,) = await in_place_history(node.root)
    assert entry["result"] == "succeeded"
    assert entry["items_changed"] == ["kubelet_minor_version"]


CPU_STATE = '{"policyName":"none","defaultCpuSet":"","checksum":1353318690}'
# the kubelet refuses to start on the state file of another CPU manager policy
REFUSE_OLD_STATE = f"ExecStartPre=/bin/sh -c 'test ! -e {ip.CPU_MANAGER_STATE}'\n"


async def test_a_cpu_manager_policy_change_removes_the_state_and_restarts_the_kubelet(
    agent: OSCAgent, node: IsolatedSystemd
) -> None:
    install_kubelet(node)
    port = free_port()
    first = await agent.publish(in_place_osc("1877.4", "one\n", port=port))
    await agent.wait_applied(first)
    node.path(ip.CPU_MANAGER_STATE).write_text(CPU_STATE)  # what the kubelet keeps
    before = invocation(node, KUBELET)
    await set_ready_for_update(agent)

    update = await agent.publish(
        in_place_osc(
            "1877.4", "one\n", port=port, cpu_policy="static", kubelet_extra=REFUSE_OLD_STATE
        )
    )
    await agent.wait_applied(update, timeout=60)
    assert not node.path(ip.CPU_MANAGER_STATE).exists()
    after = invocation(node, KUBELET)
    assert after
    assert after != before
    assert unit_props(node, KUBELET)["ActiveState"] == "active"
    assert (await agent.node_labels())[ip.LABEL_UPDATE_RESULT] == "successful"
    message = await agent.wait_event("InPlaceUpdateSuccessful", "cpu_manager_policy")
    assert "kubelet_config" not in message  # the policy alone changed


# --- credentials: service account key and CA rotation (the whole agent) ---------------------------

SA_TOKEN_PATH = "/var/lib/sa-demo/token"
T1, T2 = "2026-01-01T10:00:00Z", "2026-02-01T10:00:00Z"


async def test_a_service_account_key_rotation_syncs_the_token_secrets_at_once(
    admin_api: ApiClient, make_prepared_agent: PreparedAgentFactory, node: IsolatedSystemd
) -> None:
    token_secret = unique("sa-token")
    await put_secret(admin_api, token_secret, {"token": b"token-after-rotation"})
    prepared = await make_prepared_agent(node.root, extra_secrets=[token_secret])
    doc = yaml.safe_load(prepared.setup.config_file.read_text())
    doc["controllers"]["token"]["syncConfigs"] = [
        {"secretName": token_secret, "path": SA_TOKEN_PATH}
    ]
    setup = prepared.setup.with_config(doc)
    set_os(node, "1877.4")
    name = prepared.name
    bystander = [service("bystander.service", command="start", enable=True)]
    async with running_agent(setup, host_name=name, systemd=node):
        token = node.path(SA_TOKEN_PATH)
        await wait_for(lambda: token.exists(), 30, "the token synced")
        first = await publish_osc(
            admin_api,
            prepared.osc_secret,
            in_place_osc("1877.4", "a\n", rotation=rotation(sa=T1), units=bystander),
        )
        await wait_applied(admin_api, name, first)
        before = invocation(node, "bystander.service")
        token.write_text("stale")  # a change the watch never delivered; the resync is hours away
        await client.CoreV1Api(admin_api).patch_node_status(
            name, {"status": {"conditions": [READY]}}
        )

        update = await publish_osc(
            admin_api,
            prepared.osc_secret,
            in_place_osc("1877.4", "a\n", rotation=rotation(sa=T2), units=bystander),
        )
        await wait_applied(admin_api, name, update)
        assert token.read_text() == "token-after-rotation"
        assert invocation(node, "bystander.service") == before  # nothing restarted
        assert (await node_labels(admin_api, name))[ip.LABEL_UPDATE_RESULT] == "successful"
        messages = [
            e.message
            for e in await node_events(admin_api, name)
            if e.reason == "InPlaceUpdateSuccessful"
        ]
        assert messages == ["in-place update (sa_key_rotation) successful"]


BOOTSTRAP_SEEN = "/run/kubelet-bootstrap-seen"
BOOTSTRAP_GO = "/run/kubelet-bootstrap-go"
# A kubelet that bootstraps late: in the background of its start it waits until the test lets
# it go, then reads its bootstrap kubeconfig and writes its client certificate and kubeconfig
# (what a kubelet does once its CSR is signed).
READ_BOOTSTRAP = (
    f"ExecStartPost=/bin/sh -c '( while [ ! -e {BOOTSTRAP_GO} ]; do sleep 0.2; done; "
    f"if [ -e {ip.KUBELET_BOOTSTRAP_KUBECONFIG} ]; then "
    f"cat {ip.KUBELET_BOOTSTRAP_KUBECONFIG} > {BOOTSTRAP_SEEN}; mkdir -p {ip.KUBELET_PKI_DIR}; "
    f"echo signed > {ip.KUBELET_CLIENT_CERT}; echo kind: Config > {ip.KUBELET_KUBECONFIG}; "
    "fi ) >/dev/null 2>&1 &'\n"
)


def ca_osc(port: int, initiated: str) -> dict[str, Any]:
    return in_place_osc(
        "1877.4", "a\n", port=port, rotation=rotation(ca=initiated), kubelet_extra=READ_BOOTSTRAP
    )


async def test_a_ca_rotation_renews_the_agents_certificate_and_rebootstraps_the_kubelet(
    gardener_controlplane: ControlPlane,
    admin_api: ApiClient,
    csr_approver: CSRApprover,
    node: IsolatedSystemd,
) -> None:
    machine = unique("machine")
    root = node.root
    secret = f"osc-{machine}"
    setup = await gardener_layout(root, gardener_controlplane, admin_api, machine, secret)
    set_os(node, "1877.4")
    install_kubelet(node)
    port = free_port()
    # what the kubelet has after its own bootstrap: its kubeconfig and client certificate
    kubelet_cert = b"-----BEGIN CERTIFICATE-----\nc3RhbmQtaW4=\n-----END CERTIFICATE-----\n"
    for path, data in (
        (ip.KUBELET_KUBECONFIG, b"kind: Config\n"),
        (ip.KUBELET_CLIENT_CERT, kubelet_cert),
    ):
        node.path(path).parent.mkdir(parents=True, exist_ok=True)
        node.path(path).write_bytes(data)
    async with running_agent(setup, host_name=machine, systemd=node):
        await wait_for(lambda: host(root, KUBECONFIG_FILE).exists(), 30, "the agent's certificate")
        await create_node(admin_api, machine)
        first = await publish_osc(admin_api, secret, ca_osc(port, T1))
        await wait_applied(admin_api, machine, first)
        serial = kubeconfig_certificate(root).serial_number
        before = invocation(node, KUBELET)
        await client.CoreV1Api(admin_api).patch_node_status(
            machine, {"status": {"conditions": [READY]}}
        )

        update = await publish_osc(admin_api, secret, ca_osc(port, T2))
        await wait_applied(admin_api, machine, update, timeout=90)
        # the agent: a new certificate from kube-controller-manager, asked with its own identity
        assert kubeconfig_certificate(root).serial_number != serial
        approved = [d for d in csr_approver.decisions if d.outcome == "approved"]
        assert approved[-1].username == f"gardener.cloud:node-agent:machine:{machine}"
        # the kubelet: restarted with its kubeconfig and certificates gone, and its current
        # certificate as its bootstrap credential, which stays until the kubelet used it
        assert not node.path(ip.KUBELET_KUBECONFIG).exists()
        assert not node.path(ip.KUBELET_PKI_DIR).exists()
        assert node.path(ip.KUBELET_BOOTSTRAP_KUBECONFIG).exists()
        node.path(BOOTSTRAP_GO).write_text("")  # the kubelet bootstraps now, late
        await wait_for(
            lambda: node.path(ip.KUBELET_KUBECONFIG).exists(), 30, "the kubelet's kubeconfig"
        )
        # the next reconcile (any Secret event; upstream: its next one too) drops the file
        await client.CoreV1Api(admin_api).patch_namespaced_secret(
            secret, "kube-system", {"metadata": {"annotations": {"test/nudge": "1"}}}
        )
        await wait_for(
            lambda: not node.path(ip.KUBELET_BOOTSTRAP_KUBECONFIG).exists(),
            30,
            "the used bootstrap kubeconfig removed",
        )
        bootstrap = yaml.safe_load(node.path(BOOTSTRAP_SEEN).read_text())
        user = bootstrap["users"][0]["user"]
        assert base64.b64decode(user["client-certificate-data"]) == kubelet_cert
        assert bootstrap["clusters"][0]["cluster"]["server"] == gardener_controlplane.server
        after = invocation(node, KUBELET)
        assert after
        assert after != before
        assert (await node_labels(admin_api, machine))[ip.LABEL_UPDATE_RESULT] == "successful"
        messages = [
            e.message
            for e in await node_events(admin_api, machine)
            if e.reason == "InPlaceUpdateSuccessful"
        ]
        assert messages == [
            "in-place update (ca_rotation_kubelet, ca_rotation_node_agent) successful"
        ]
    assert csr_approver.errors == []


# --- kill -9 at each step of an OS update: the restarted agent resumes ----------------------------

HOLD = "/run/inplace-hold"
GO = "/run/inplace-go"
# the command stand-in, held (while HOLD exists, until GO does) after it logged its run
HELD_SCRIPT = SCRIPT.replace(
    'echo "runs" >> /var/lib/inplace-update.runs\n',
    'echo "runs" >> /var/lib/inplace-update.runs\n'
    f"if [ -e {HOLD} ]; then while [ ! -e {GO} ]; do sleep 0.2; done; fi\n",
)
#: held by machine-controller-manager: selected, not drained (the condition without the reason
#: the agent waits for)
NOT_READY = {"type": "InPlaceUpdate", "status": "False", "reason": "SelectedForUpdate",
             "message": "waiting for the drain"}  # fmt: skip
KILL_POINTS = ["detected", "drain-gate", "os-command", "before-reboot", "after-reboot"]


def process_osc(os_version: str, tag: str, kubelet: str = "1.33.0") -> dict[str, Any]:
    """The in-place OSC with a unit that changes with the update and one that does not."""
    units = [
        counted_service("inplace-changed.service", tag, extra=f"Environment=TAG={tag}\n"),
        counted_service("inplace-bystander.service", "same"),
    ]
    return in_place_osc(os_version, f"{tag}\n", kubelet=kubelet, units=units)


async def in_place_phase(root: Path) -> str | None:
    code, out, _ = await run_status(root, "--json")
    if code not in (0, 3):
        return None
    doc = json.loads(out)
    in_place = doc.get("in_place_update") or {}
    phase = in_place.get("phase")
    return str(phase) if phase is not None else None


async def set_condition(harness: OSCAgent, condition: dict[str, Any]) -> None:
    await client.CoreV1Api(harness.admin).patch_node_status(
        harness.node_name, {"status": {"conditions": [condition]}}
    )


@pytest.mark.parametrize("point", KILL_POINTS)
async def test_kill_9_at_each_step_of_an_os_update_resumes_it(
    harness: OSCAgent, node: IsolatedSystemd, tmp_path: Path, point: str
) -> None:
    set_os(node, "1877.4")
    script = node.path(UPDATE_SCRIPT)
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(HELD_SCRIPT)
    script.chmod(0o755)
    record = node.path(f"{BASE_DIR}/{IN_PLACE}")
    agent = AgentProcess(harness, tmp_path / "agent.log")
    try:
        first = await harness.publish(process_osc("1877.4", "v1"))
        await agent.start()
        await harness.wait_applied(first)
        assert await agent.terminate() == 0, agent.log_tail()
        if point != "drain-gate":
            await set_condition(harness, READY)
        if point == "os-command":
            node.path(HOLD).write_text("")

        env = {CRASH_HOOK_ENV: "in-place:detected"} if point == "detected" else {}
        await agent.start(**env)
        update = await harness.publish(process_osc("1877.5", "v2"))
        if point == "detected":
            assert await agent.wait() == -9, agent.log_tail()
            assert record.exists()
            assert node.path("/etc/demo/inplace.conf").read_text() == "v1\n"  # nothing applied
            await agent.start()
        elif point == "drain-gate":
            await wait_for(
                lambda: event_seen(harness, "InPlaceUpdateWaitingForDrain"), 30, "waiting"
            )
            await agent.kill()
            assert record.exists()
            await agent.start()
            await wait_for(lambda: phase_is(node.root, "waiting-for-drain"), 30, "the gate")
            await set_condition(harness, READY)
        elif point == "os-command":
            await wait_for(lambda: runs(node) == 1, 30, "the command running")
            await agent.kill()  # the command goes on running as an orphan, held
            await agent.start()
            await wait_for(lambda: runs(node) == 2, 30, "the command run again")
            node.path(GO).write_text("")
        await wait_for(lambda: event_seen(harness, "InPlaceUpdateRebooting"), 60, "rebooting")
        if point == "before-reboot":
            await agent.kill()
            await agent.start()
            await wait_for(lambda: phase_is(node.root, "rebooting"), 30, "the reboot awaited")
        if point == "after-reboot":
            await set_condition(harness, NOT_READY)  # held at the gate after the reboot
        assert await agent.terminate() == 0, agent.log_tail()

        reboot(node)
        await agent.start()
        if point == "after-reboot":
            await wait_for(lambda: phase_is(node.root, "waiting-for-drain"), 30, "the gate")
            await agent.kill()
            await agent.start()
            await wait_for(lambda: phase_is(node.root, "waiting-for-drain"), 30, "the gate")
            await set_condition(harness, READY)
        await harness.wait_applied(update, timeout=60)

        labels, annotations = await harness.node_labels(), await harness.node_annotations()
        assert labels[ip.LABEL_UPDATE_RESULT] == "successful"
        assert ip.ANNOTATION_UPDATING_OS_VERSION not in annotations
        assert ip.ANNOTATION_UPDATE_FAILED_REASON not in annotations
        successes = [e for e in await harness.events() if e.reason == "InPlaceUpdateSuccessful"]
        assert [e.count or 1 for e in successes] == [1]
        assert [(e["result"], e["items_changed"]) for e in await in_place_history(node.root)] == [
            ("succeeded", ["operating_system"])
        ]
        # the command ran once (a kill while it ran: once more, as designed)
        assert runs(node) == (2 if point == "os-command" else 1)
        assert node.path("/etc/demo/inplace.conf").read_text() == "v2\n"
        assert starts(node, "inplace-changed.service") == ["v1", "v2"]  # restarted once
        assert starts(node, "inplace-bystander.service") == ["same"]  # never
        assert not record.exists()
        assert await agent.terminate() == 0, agent.log_tail()
    finally:
        await agent.kill()


async def event_seen(harness: OSCAgent, reason: str) -> bool:
    return any(e.reason == reason for e in await harness.events())


async def phase_is(root: Path, phase: str) -> bool:
    return await in_place_phase(root) == phase


ATTEMPTS = "/var/lib/inplace-update.attempts"


async def test_kill_9_after_a_terminal_failure_keeps_the_outcome(
    harness: OSCAgent, node: IsolatedSystemd, tmp_path: Path
) -> None:
    set_os(node, "1877.4")
    script = node.path(UPDATE_SCRIPT)
    script.parent.mkdir(parents=True, exist_ok=True)
    # every attempt logged, the failing ones too
    script.write_text(SCRIPT.replace("set -eu\n", f"set -eu\necho attempt >> {ATTEMPTS}\n"))
    script.chmod(0o755)
    agent = AgentProcess(harness, tmp_path / "agent.log")
    try:
        first = await harness.publish(process_osc("1877.4", "v1"))
        await agent.start()
        await harness.wait_applied(first)
        await set_condition(harness, READY)
        await harness.publish(process_osc("0", "v2"))  # the command refuses version 0
        await wait_for(lambda: event_seen(harness, "InPlaceUpdateFailed"), 60, "the failure")
        await wait_for(lambda: phase_is(node.root, "failed"), 30, "the failure in status")
        await agent.kill()

        await agent.start()
        await wait_for(lambda: phase_is(node.root, "failed"), 30, "the failure after a restart")
        assert node.path(ATTEMPTS).read_text().split() == ["attempt"]  # not tried again
        history = await in_place_history(node.root)
        assert [e["result"] for e in history] == ["failed"]
        assert "invalid arguments" in history[0]["error"]
        assert (await harness.node_labels())[ip.LABEL_UPDATE_RESULT] == "failed"
        failures = [e for e in await harness.events() if e.reason == "InPlaceUpdateFailed"]
        assert [e.count or 1 for e in failures] == [1]
        assert (await harness.node_annotations())["checksum/cloud-config-data"] == first
        assert await agent.terminate() == 0, agent.log_tail()
    finally:
        await agent.kill()
