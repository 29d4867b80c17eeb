"""In-place updates: the pure detection (``node_agent.osc.inplace``) and the OSC controller's
in-place steps on fakes (drain gate, OS update with its retry rules and reboot, kubelet, the
outcome on the Node)."""

from __future__ import annotations

import base64
import copy
import hashlib
import os
import sys
import time
import tracemalloc
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from node_agent.agent import build_applier
from node_agent.base import layout
from node_agent.base.errors import InPlaceUpdateError, KubeInvalid
from node_agent.base.loop import DONE, RETRY, SKIPPED
from node_agent.context import AgentContext
from node_agent.controllers.osc.controller import OSCController
from node_agent.controllers.osc.inplace import (
    KILL_GRACE,
    InPlaceRecord,
    InPlaceUpdater,
    kubelet_bootstrapped,
)
from node_agent.kube.report import ANNOTATION_APPLIED_CHECKSUM, ANNOTATION_SECRET_CHECKSUM
from node_agent.osc import inplace as ip
from node_agent.osc.decode import parse_osc
from node_agent.osc.models import OperatingSystemConfig
from tests.unit.fakes import FakeKube, FakeSystemd, make_ctx, merge_patch, until

SECRET = "gardener-node-agent-pool"


def kubelet_config(**settings: Any) -> str:
    return yaml.safe_dump({"kind": "KubeletConfiguration", **settings})


def osc_doc(
    *,
    os_version: str = "1877.4",
    kubelet: str | dict[str, Any] = "1.33.0",
    config: dict[str, Any] | None = None,
    rotation: dict[str, Any] | None = None,
    command: str = "/opt/update.sh",
    args: list[str] | None = None,
    text: str = "one",
    config_text: str | None = None,
) -> dict[str, Any]:
    """An in-place OSC; ``config_text`` is the kubelet config file's text as it is (else
    ``config`` dumped), ``args`` the update command's arguments (else ``--v <os_version>``)."""
    kubelet_text = config_text if config_text is not None else kubelet_config(**(config or {}))
    files = [
        {"path": ip.KUBELET_CONFIG, "permissions": 0o644,
         "content": {"inline": {"encoding": "b64", "data": base64.b64encode(
             kubelet_text.encode()).decode()}}},
        {"path": "/etc/test/a.conf", "permissions": 0o644, "content": {"inline": {"data": text}}},
    ]  # fmt: skip
    spec: dict[str, Any] = {"operatingSystemVersion": os_version, "kubelet": kubelet}
    if rotation is not None:
        spec["credentialsRotation"] = rotation
    return {
        "apiVersion": "extensions.gardener.cloud/v1alpha1",
        "kind": "OperatingSystemConfig",
        "spec": {"type": "gardenlinux", "purpose": "reconcile", "files": files,
                 "units": [], "inPlaceUpdates": spec},
        "status": {"inPlaceUpdates": {"osUpdate": {
            "command": command, "args": ["--v", os_version] if args is None else args}}},
    }  # fmt: skip


def osc(**kw: Any) -> OperatingSystemConfig:
    return parse_osc(yaml.safe_dump(osc_doc(**kw)).encode())


# -- pure detection -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("release", "version"),
    [
        ('PRETTY_NAME="Garden Linux 1877.4"\n', "1877.4"),
        ('NAME=x\nPRETTY_NAME="Ubuntu 24.04.1 LTS"\nVERSION_ID="24.04"\n', "24.04.1"),
        ("PRETTY_NAME=SuSE-15.6\n", "15.6"),
    ],
)
def test_os_version_is_read_from_pretty_name(release: str, version: str) -> None:
    assert ip.os_version(release) == version


def test_os_version_without_a_number_is_an_error() -> None:
    with pytest.raises(ip.InPlaceError):
        ip.os_version('PRETTY_NAME="Debian GNU/Linux trixie/sid"\n')


def test_versions_compare_as_upstream_normalizes_them() -> None:
    assert ip.same_version("1877.4", "v1877.4.0")
    assert ip.same_version("1.2.3-rc1", "1.2.3")
    assert not ip.same_version("1877.4", "1877.5")
    assert ip.minor_changed("1.33.4", "1.34.0")
    assert not ip.minor_changed("1.33.0", "1.33.9")


def test_nothing_in_place_without_in_place_updates_on_both_sides() -> None:
    plain = parse_osc(yaml.safe_dump({**osc_doc(), "spec": {"files": []}}).encode())
    assert not ip.detect(plain, osc(os_version="2"), "1").any()
    assert not ip.detect(osc(), osc(), "1877.4").any()


def test_each_part_is_detected() -> None:
    base = osc()
    assert ip.detect(base, osc(os_version="1877.5"), "1877.4").names() == ("operating_system",)
    assert ip.detect(base, osc(kubelet="1.34.1"), "1877.4").names() == ("kubelet_minor_version",)
    assert not ip.detect(base, osc(kubelet="1.33.5"), "1877.4").any()  # a patch update
    policy = osc(config={"cpuManagerPolicy": "static"})
    assert ip.detect(base, policy, "1877.4").names() == ("cpu_manager_policy",)
    eviction = osc(config={"evictionHard": {"memory.available": "200Mi"}})
    assert ip.detect(base, eviction, "1877.4").names() == ("kubelet_config",)
    other = osc(config={"evictionHard": {"pid.available": "5%"}})  # not a trigger
    assert not ip.detect(base, other, "1877.4").any()
    reserved = osc(config={"kubeReserved": {"cpu": "100m"}})
    assert ip.detect(base, reserved, "1877.4").names() == ("kubelet_config",)
    ca = osc(rotation={"certificateAuthorities": {"lastInitiationTime": "2026-01-01T00:00:00Z"}})
    assert ip.detect(base, ca, "1877.4").names() == (
        "ca_rotation_kubelet",
        "ca_rotation_node_agent",
    )
    sa = osc(rotation={"serviceAccountKey": {"lastInitiationTime": "2026-01-01T00:00:00Z"}})
    assert ip.detect(base, sa, "1877.4").names() == ("sa_key_rotation",)
    again = osc(rotation={"serviceAccountKey": {"lastInitiationTime": "2026-02-01T00:00:00Z"}})
    assert ip.detect(sa, again, "1877.4").names() == ("sa_key_rotation",)
    assert not ip.detect(sa, sa, "1877.4").any()


def test_the_newer_object_shape_of_kubelet_counts_its_policy() -> None:
    old = osc(kubelet={"version": "1.33.0", "cpuManagerPolicy": "none"})
    new = osc(kubelet={"version": "1.33.0", "cpuManagerPolicy": "static"})
    assert ip.detect(old, new, "1877.4").names() == ("cpu_manager_policy",)


def test_an_unparsable_reserved_quantity_is_an_error() -> None:
    with pytest.raises(ip.InPlaceError, match="'lots' does not parse"):
        ip.kubelet_config_change({}, {"kubeReserved": {"cpu": "lots"}})
    with pytest.raises(ip.InPlaceError, match="does not parse"):  # ASCII digits only, as Go
        ip.kubelet_config_change({}, {"kubeReserved": {"cpu": "\u0661\u0660\u0660m"}})
    # in the applied config (an update that failed on it applied it): counted as changed
    assert ip.kubelet_config_change({"kubeReserved": {"cpu": "lots"}}, {}) == (True, False)


SIGNALS = st.dictionaries(
    st.sampled_from((*ip.EVICTION_SIGNALS, "pid.available")), st.text(max_size=4)
)


@given(SIGNALS, SIGNALS)
def test_eviction_changes_count_only_for_the_trigger_signals(
    old: dict[str, str], new: dict[str, str]
) -> None:
    changed, policy = ip.kubelet_config_change({"evictionHard": old}, {"evictionHard": new})
    relevant = {k: v for k, v in old.items() if k in ip.EVICTION_SIGNALS} != {
        k: v for k, v in new.items() if k in ip.EVICTION_SIGNALS
    }
    assert changed == relevant
    assert not policy


@given(st.lists(st.integers(0, 9999), min_size=1, max_size=3), st.sampled_from(["", "v"]))
def test_a_version_equals_itself_in_every_spelling(parts: list[int], prefix: str) -> None:
    text = ".".join(map(str, parts))
    padded = ".".join(map(str, parts + [0] * (3 - len(parts))))
    assert ip.same_version(prefix + text, padded + "-dev")


def test_drain_gate_and_outcome_rules() -> None:
    def node(reason: str | None, result: str | None = None) -> dict[str, Any]:
        conditions = [{"type": "InPlaceUpdate", "status": "True", "reason": reason}]
        labels = {ip.LABEL_UPDATE_RESULT: result} if result else {}
        return {"metadata": {"labels": labels}, "status": {"conditions": conditions}}

    assert ip.may_update(node("ReadyForUpdate"))
    assert not ip.may_update(node("SelectedForUpdate"))
    assert ip.may_update(node("SelectedForUpdate", "failed"))  # retried after a failure
    assert ip.owes_outcome(node("ReadyForUpdate"))
    assert not ip.owes_outcome(node("ReadyForUpdate", "successful"))
    assert ip.owes_outcome(node(None, "failed"))
    assert ip.CommandOutput.of("Network problems: retry").kind == "retriable"
    assert ip.CommandOutput.of("error: invalid ARGUMENTS").kind == "non-retriable"
    assert ip.CommandOutput.of("disk full").kind == "unknown"
    # Go's (?i): the Kelvin sign and the long s fold into k and s, the dotless i does not
    assert ip.CommandOutput.of("networ\u212a problems").kind == "retriable"
    assert ip.CommandOutput.of("\u017fystem failure").kind == "non-retriable"
    assert ip.CommandOutput.of("\u0131nvalid arguments").kind == "unknown"


# -- the controller on fakes ---------------------------------------------------------------------


class Host:
    """A node on fakes whose OS update command stand-in stages the new os-release for the next
    boot (``reboot``), answering each run from ``answers`` first."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.kube = FakeKube()
        self.systemd = FakeSystemd()
        self.kube.nodes().put({"metadata": {"name": "n1", "uid": "u1", "resourceVersion": "1"}})
        self.boot = 1
        self.runs: list[list[str]] = []
        self.answers: list[tuple[int, str]] = []
        self.set_os("1877.4")

    def set_os(self, version: str) -> None:
        path = self.root / "etc/os-release"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'ID=gardenlinux\nPRETTY_NAME="Garden Linux {version}"\n')

    async def run(self, argv: Sequence[str], limit: float) -> tuple[int, ip.CommandOutput]:
        self.runs.append(list(argv))
        if self.answers:
            code, output = self.answers.pop(0)
            return code, ip.CommandOutput.of(output)
        (self.root / "next-os").write_text(argv[-1])
        return 0, ip.CommandOutput.of("update staged; reboot required")

    def reboot(self) -> None:
        self.boot += 1
        staged = self.root / "next-os"
        if staged.exists():
            self.set_os(staged.read_text())
            staged.unlink()

    async def ready(self) -> OSCController:
        """A controller that applied the first OSC on a node Gardener marked ReadyForUpdate."""
        ctl = self.controller()
        await ctl.reconcile(secret(osc_doc()))
        await self.set_condition("ReadyForUpdate")
        return ctl

    def controller(self) -> OSCController:
        ctx: AgentContext = make_ctx(
            self.root,
            config={
                "controllers": {"operatingSystemConfig": {"secretName": SECRET}},
                "nodeAgent": {"healthGate": {"enabled": True}},
            },
            kube=self.kube,
            systemd=self.systemd,
        )
        applier = build_applier(
            ctx.fs, ctx.state, self.systemd, ctx.settings, host_name="n1", images=None,
            expander=None,
        )  # fmt: skip
        ctl = OSCController(ctx, applier)
        ctl.inplace._run = self.run
        ctl.inplace._boot = lambda: f"boot-{self.boot}"  # type: ignore[method-assign]
        ctl.inplace.retry_interval = 0.01
        ctl.inplace.retry_timeout = 0.2
        ctl.inplace.health_interval = 0.01
        ctl.inplace.health_timeout = 0.05
        return ctl

    async def node(self) -> dict[str, Any]:
        return await self.kube.nodes().get("n1")

    async def set_condition(self, reason: str) -> None:
        node = await self.node()
        node.setdefault("status", {})["conditions"] = [
            {"type": "InPlaceUpdate", "status": "True", "reason": reason}
        ]
        self.kube.nodes().put(node)

    async def labels(self) -> dict[str, str]:
        return dict((await self.node())["metadata"].get("labels") or {})

    async def annotations(self) -> dict[str, str]:
        return dict((await self.node())["metadata"].get("annotations") or {})


def secret(doc: dict[str, Any]) -> dict[str, Any]:
    raw = yaml.safe_dump(doc).encode()
    checksum = hashlib.sha256(raw).hexdigest()
    return {
        "metadata": {"name": SECRET, "namespace": "kube-system", "resourceVersion": checksum[:8],
                     "annotations": {ANNOTATION_SECRET_CHECKSUM: checksum}},
        "data": {"osc.yaml": base64.b64encode(raw).decode()},
    }  # fmt: skip


def checksum(s: dict[str, Any]) -> str:
    return str(s["metadata"]["annotations"][ANNOTATION_SECRET_CHECKSUM])


async def test_os_update_gate_command_reboot_completion_and_outcome(tmp_path: Path) -> None:
    host = Host(tmp_path)
    ctl = host.controller()
    first = secret(osc_doc())
    await ctl.reconcile(first)
    assert (await host.annotations())[ANNOTATION_APPLIED_CHECKSUM] == checksum(first)

    update = secret(osc_doc(os_version="1877.5", text="two"))
    # not drained yet: nothing applied, nothing run, the record persisted
    assert await ctl.reconcile(update) is None
    assert host.runs == []
    assert (tmp_path / "etc/test/a.conf").read_text() == "one"
    record = await ctl.ctx.state.load_doc_async(layout.IN_PLACE, InPlaceRecord)
    assert record is not None
    assert record.remaining.names() == ("operating_system",)

    # machine-controller-manager drained the node: the Node's watch wakes the controller
    woken: list[bool] = []
    ctl.inplace.on_ready.append(lambda: woken.append(True))
    await host.set_condition("ReadyForUpdate")
    ctl.inplace.node_seen(await host.node())
    assert woken == [True]
    assert await ctl.reconcile(update) is None  # the command ran; the reboot is to come
    assert host.runs == [["/opt/update.sh", "--v", "1877.5"]]
    assert (tmp_path / "etc/test/a.conf").read_text() == "two"  # files applied before
    annotations = await host.annotations()
    assert annotations[ip.ANNOTATION_UPDATING_OS_VERSION] == "1877.5"
    assert annotations[ANNOTATION_APPLIED_CHECKSUM] == checksum(first)  # not yet reported

    # the same process looks again before the reboot: the command is not run twice
    await ctl.reconcile(update, resync=True)
    assert len(host.runs) == 1

    host.reboot()
    back = host.controller()  # the agent after the reboot
    await back.reconcile(update)
    assert len(host.runs) == 1
    assert (await host.labels())[ip.LABEL_UPDATE_RESULT] == "successful"
    annotations = await host.annotations()
    assert ip.ANNOTATION_UPDATING_OS_VERSION not in annotations
    assert annotations[ANNOTATION_APPLIED_CHECKSUM] == checksum(update)
    assert await back.ctx.state.load_doc_async(layout.IN_PLACE, InPlaceRecord) is None


async def test_an_os_that_comes_back_on_its_old_version_is_a_failed_update(
    tmp_path: Path,
) -> None:
    host = Host(tmp_path)
    ctl = await host.ready()
    update = secret(osc_doc(os_version="1877.5"))
    await ctl.reconcile(update)
    (tmp_path / "next-os").unlink()  # the new OS did not boot
    host.reboot()
    back = host.controller()
    with pytest.raises(InPlaceUpdateError) as raised:
        await back.reconcile(update)
    assert raised.value.terminal
    labels, annotations = await host.labels(), await host.annotations()
    assert labels[ip.LABEL_UPDATE_RESULT] == "failed"
    assert "rolled back" in annotations[ip.ANNOTATION_UPDATE_FAILED_REASON]


async def test_a_non_retriable_os_update_error_fails_once_and_keeps_the_rest(
    tmp_path: Path,
) -> None:
    host = Host(tmp_path)
    ctl = host.controller()
    first = secret(osc_doc())
    await ctl.reconcile(first)
    await host.set_condition("ReadyForUpdate")
    host.answers = [(1, "error: invalid arguments")]
    update = secret(osc_doc(os_version="1877.5", text="two"))
    back = ctl
    back._latest, back._seen = update, True
    assert await back._step(True) is SKIPPED
    assert len(host.runs) == 1
    labels, annotations = await host.labels(), await host.annotations()
    assert labels[ip.LABEL_UPDATE_RESULT] == "failed"
    assert "non-retriable error detected" in annotations[ip.ANNOTATION_UPDATE_FAILED_REASON]
    assert (tmp_path / "etc/test/a.conf").read_text() == "two"
    # the same Secret is not tried again; the node keeps running what it has
    await back._step(True)
    assert len(host.runs) == 1


async def test_a_retriable_os_update_error_is_retried(tmp_path: Path) -> None:
    host = Host(tmp_path)
    ctl = await host.ready()
    host.answers = [(1, "temporary network problems"), (1, "network problems again")]
    update = secret(osc_doc(os_version="1877.5"))
    assert await ctl.reconcile(update) is None
    assert len(host.runs) == 3  # two retriable failures, then the command went through
    host.reboot()
    await host.controller().reconcile(update)
    assert (await host.labels())[ip.LABEL_UPDATE_RESULT] == "successful"


async def test_cpu_manager_policy_change_removes_the_state_and_awaits_the_kubelet(
    tmp_path: Path,
) -> None:
    host = Host(tmp_path)
    ctl = host.controller()
    await ctl.reconcile(secret(osc_doc()))
    state = tmp_path / ip.CPU_MANAGER_STATE.lstrip("/")
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text('{"policyName":"none"}')
    await host.set_condition("ReadyForUpdate")
    probes: list[str | None] = ["connection refused", None]

    async def kubelet() -> str | None:
        return probes.pop(0)

    ctl.inplace.kubelet_health = kubelet
    update = secret(osc_doc(config={"cpuManagerPolicy": "static"}))
    assert await ctl.reconcile(update) is not None
    assert not state.exists()
    assert probes == []  # the kubelet's health was awaited until it answered
    assert host.runs == []  # no OS update
    assert (await host.labels())[ip.LABEL_UPDATE_RESULT] == "successful"
    assert (await host.annotations())[ANNOTATION_APPLIED_CHECKSUM] == checksum(update)


async def test_a_service_account_key_rotation_syncs_the_tokens_at_once(tmp_path: Path) -> None:
    host = Host(tmp_path)
    ctl = await host.ready()
    synced: list[str] = []

    async def sync() -> bool:
        synced.append("token")
        return True

    ctl.inplace.resync_tokens.append(sync)
    rotation = {"serviceAccountKey": {"lastInitiationTime": "2026-01-01T00:00:00Z"}}
    await ctl.reconcile(secret(osc_doc(rotation=rotation)))
    assert synced == ["token"]
    assert (await host.labels())[ip.LABEL_UPDATE_RESULT] == "successful"


async def test_after_the_reboot_pods_go_the_outcome_is_recorded_and_nothing_is_applied_again(
    tmp_path: Path,
) -> None:
    host = Host(tmp_path)
    ctl = await host.ready()
    update = secret(osc_doc(os_version="1877.5", text="two"))
    await ctl.reconcile(update)
    assert ctl.inplace.view().phase == "rebooting"
    mine = {"metadata": {"name": "ds-pod", "namespace": "kube-system"}, "spec": {"nodeName": "n1"}}
    other = {"metadata": {"name": "other", "namespace": "default"}, "spec": {"nodeName": "n2"}}
    host.kube.pods("kube-system").put(mine)
    host.kube.pods("default").put(other)

    host.reboot()
    back = host.controller()
    events_before = len(host.kube.writes("create_event"))
    await back.reconcile(update)
    assert host.kube.writes("delete_pod") == [("delete_pod", "kube-system", "ds-pod")]
    assert list(host.kube.pods("default").items) == ["other"]  # another node's Pod stays
    events = [c[1]["reason"] for c in host.kube.writes("create_event")[events_before:]]
    assert "OSCApplied" not in events  # the OSC was applied before the reboot, said once
    assert "InPlaceUpdateSuccessful" in events
    view = back.inplace.view()
    assert (view.phase, view.succeeded, view.pods_deleted) == ("done", 1, 1)
    history = await back.ctx.state.load_history_async()
    in_place = [e for e in history.entries if e.trigger == "in-place"]
    assert [(e.result, e.items_changed) for e in in_place] == [("succeeded", ("operating_system",))]


def test_the_kubelets_bootstrap_kubeconfig_counts_as_used_once_its_own_is_newer(
    tmp_path: Path,
) -> None:
    ctx: AgentContext = make_ctx(tmp_path)
    fs = ctx.fs
    assert kubelet_bootstrapped(fs)  # nothing to keep
    fs.write_atomic(ip.KUBELET_BOOTSTRAP_KUBECONFIG, b"kind: Config\n", 0o600)
    assert not kubelet_bootstrapped(fs)  # the kubelet has no kubeconfig yet
    fs.write_atomic(ip.KUBELET_KUBECONFIG, b"kind: Config\n", 0o600)
    bootstrap = tmp_path / ip.KUBELET_BOOTSTRAP_KUBECONFIG.lstrip("/")
    own = tmp_path / ip.KUBELET_KUBECONFIG.lstrip("/")
    os.utime(own, ns=(1_000, 1_000))
    os.utime(bootstrap, ns=(2_000, 2_000))
    assert not kubelet_bootstrapped(fs)  # a kubeconfig from before the re-bootstrap
    os.utime(own, ns=(3_000, 3_000))
    assert kubelet_bootstrapped(fs)


async def test_a_terminal_failure_survives_a_restart_until_the_osc_changes(
    tmp_path: Path,
) -> None:
    host = Host(tmp_path)
    ctl = await host.ready()
    host.answers = [(1, "error: invalid arguments")]
    update = secret(osc_doc(os_version="1877.5", text="two"))
    ctl._latest, ctl._seen = update, True
    assert await ctl._step(True) is SKIPPED
    assert len(host.runs) == 1

    back = host.controller()  # the agent restarted (a kill, a self-update)
    back._latest, back._seen = update, True
    assert await back._step(True) is SKIPPED
    assert len(host.runs) == 1  # not tried again
    view = back.inplace.view()
    assert view.phase == "failed"
    assert view.reason is not None
    assert "invalid arguments" in view.reason
    history = await back.ctx.state.load_history_async()
    in_place = [e for e in history.entries if e.trigger == "in-place"]
    assert [e.result for e in in_place] == ["failed"]  # one outcome, recorded once
    assert (await host.labels())[ip.LABEL_UPDATE_RESULT] == "failed"

    # a new OSC is a new update
    newer = secret(osc_doc(os_version="1877.6", text="two"))
    back._latest = newer
    assert await back._step(True) is not SKIPPED
    assert host.runs[-1] == ["/opt/update.sh", "--v", "1877.6"]


# -- node-agent plan ------------------------------------------------------------------------------

RELEASE = 'PRETTY_NAME="Garden Linux 1877.4"\n'


def test_plan_names_the_in_place_parts_of_a_change() -> None:
    found = ip.plan(osc(), osc(os_version="1877.5", kubelet="1.34.1"), RELEASE)
    assert found is not None
    assert found.parts == ("operating_system", "kubelet_minor_version")
    lines = ip.describe(found)
    assert lines[0] == "in-place update: operating_system, kubelet_minor_version"
    assert (
        "  operating_system: 1877.4 -> 1877.5 (runs /opt/update.sh --v 1877.5, then a reboot)"
        in (lines)
    )
    assert "  kubelet: 1.33.0 -> 1.34.1 (health awaited)" in lines
    assert "ReadyForUpdate" in lines[-1]


def test_plan_without_in_place_parts_or_without_a_comparison() -> None:
    assert ip.plan(osc(), parse_osc(yaml.safe_dump(plain_doc()).encode()), RELEASE) is None
    same = ip.plan(osc(), osc(), RELEASE)
    assert same is not None
    assert ip.describe(same) == ["in-place update: none"]
    first = ip.plan(None, osc(), RELEASE)
    assert first is not None
    assert ip.describe(first) == ["in-place update: none (no OSC applied yet)"]
    unknown = ip.plan(osc(), osc(os_version="1877.5"), None)
    assert unknown is not None
    assert ip.describe(unknown) == [
        "in-place update: not computed: the current OS version is unknown"
    ]


def plain_doc() -> dict[str, Any]:
    doc = osc_doc()
    del doc["spec"]["inPlaceUpdates"], doc["status"]
    return doc


# -- values nobody expected (issue 33) -----------------------------------------------------------


def test_versions_are_read_with_ascii_digits_only() -> None:
    # str.isdigit accepts "²" (int refuses it) and int reads "٣٤" as 34; Go reads neither
    for version in ("1.3²", "1877.²", "1.٣٤", "\u0661.\u0662.\u0663", "1" * 5000, str(1 << 64)):
        with pytest.raises(ip.InPlaceError, match="invalid version"):
            ip.parse_version(version)
    assert ip.parse_version(str((1 << 64) - 1)) == ((1 << 64) - 1, 0, 0)
    # Go's \b\d+ in PRETTY_NAME: ASCII digits only
    assert ip.os_version('PRETTY_NAME="Garden Linux 1877.٣٤"\n') == "1877"
    with pytest.raises(ip.InPlaceError):
        ip.os_version('PRETTY_NAME="Garden Linux ١٨٧٧"\n')


DEEP_KUBELET_CONFIG = "kind: KubeletConfiguration\nx: " + "[" * 3000 + "]" * 3000 + "\n"


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"kubelet": "1.3²"}, "1.3²"),
        ({"kubelet": "1.٣٤"}, "1.٣٤"),
        ({"os_version": "1877.²"}, "1877.²"),
        ({"config_text": DEEP_KUBELET_CONFIG}, ip.KUBELET_CONFIG),
        ({"os_version": "1877.5", "command": "/opt/up\x00date.sh"}, "embedded null byte"),
        ({"os_version": "1877.5", "args": ["--v\x00", "1877.5"]}, "embedded null byte"),
    ],
    ids=["kubelet-superscript", "kubelet-arabic", "os-superscript", "deep-config", "nul-command",
         "nul-argument"],
)  # fmt: skip
async def test_an_unreadable_in_place_value_fails_that_update_and_keeps_the_agent_up(
    tmp_path: Path, change: dict[str, Any], said: str
) -> None:
    host = Host(tmp_path)
    ctl = host.controller()
    ctl.inplace._run = ctl.inplace._run_on_host  # the real runner: exec refuses a NUL
    await ctl.reconcile(secret(osc_doc()))
    await host.set_condition("ReadyForUpdate")
    update = secret(osc_doc(text="two", **change))
    ctl._latest, ctl._seen = update, True
    assert await ctl._step(True) is SKIPPED  # the agent is up; the Secret is left as it is
    labels, annotations = await host.labels(), await host.annotations()
    assert labels[ip.LABEL_UPDATE_RESULT] == "failed"
    assert said in annotations[ip.ANNOTATION_UPDATE_FAILED_REASON]
    assert (tmp_path / "etc/test/a.conf").read_text() == "two"  # the rest of the OSC applied
    assert ctl.inplace.view().phase == "failed"
    assert await ctl._step(True) is DONE  # the same Secret: nothing tried again
    history = await ctl.ctx.state.load_history_async()
    assert [e.result for e in history.entries if e.trigger == "in-place"] == ["failed"]

    back = host.controller()  # restarted on the same Secret: up, the outcome kept
    back._latest, back._seen = update, True
    assert await back._step(True) is SKIPPED
    assert (await host.labels())[ip.LABEL_UPDATE_RESULT] == "failed"


async def test_an_update_after_one_that_failed_on_an_unreadable_value_goes_through(
    tmp_path: Path,
) -> None:
    host = Host(tmp_path)
    ctl = await host.ready()
    ctl._latest, ctl._seen = secret(osc_doc(kubelet="1.3²", text="two")), True
    assert await ctl._step(True) is SKIPPED
    assert (await host.labels())[ip.LABEL_UPDATE_RESULT] == "failed"
    # the applied OSC now holds the value that cannot be read: the next update counts that
    # part as changed instead of failing on it again
    fixed = secret(osc_doc(kubelet="1.34.0", text="three"))
    ctl._latest = fixed
    assert await ctl._step(True) is not SKIPPED
    assert (await host.labels())[ip.LABEL_UPDATE_RESULT] == "successful"
    assert (tmp_path / "etc/test/a.conf").read_text() == "three"
    assert (await host.annotations())[ANNOTATION_APPLIED_CHECKSUM] == checksum(fixed)


def big_output_command(size: int, head: str, tail: str, code: int) -> list[str]:
    """A command printing ``head``, ``size`` bytes of filler lines and ``tail``, then exiting
    with ``code``."""
    script = (
        "import sys\n"
        f"out = sys.stdout.buffer\nout.write({head.encode()!r})\n"
        f"block = (b'x' * 1023 + b'\\n') * 1024\nleft = {size}\n"
        "while left > 0:\n    out.write(block[:left])\n    left -= len(block)\n"
        f"out.write({tail.encode()!r})\nout.flush()\nsys.exit({code})\n"
    )
    return [sys.executable, "-c", script]


async def test_the_os_update_commands_output_is_bounded_in_memory_and_on_the_node(
    tmp_path: Path,
) -> None:
    host = Host(tmp_path)
    ctl = host.controller()
    ctl.inplace._run = ctl.inplace._run_on_host
    ctl.ctx.settings = ctl.ctx.settings.model_copy(update={"root": Path("/")})  # no chroot
    ctl.inplace.retry_timeout = 120.0  # also the command's time limit
    await ctl.reconcile(secret(osc_doc()))
    await host.set_condition("ReadyForUpdate")
    size = 32 << 20
    command, *args = big_output_command(size, "", "error: system failure\n", 3)
    update = secret(osc_doc(os_version="1877.5", text="two", command=command, args=args))
    ctl._latest, ctl._seen = update, True
    tracemalloc.start()
    try:
        assert await ctl._step(True) is SKIPPED
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak} bytes at the peak for {size} bytes of output"
    reason = (await host.annotations())[ip.ANNOTATION_UPDATE_FAILED_REASON]
    assert len(reason.encode()) <= ip.REASON_LIMIT
    assert "non-retriable error detected: exit status 3" in reason
    assert reason.endswith("error: system failure")  # the tail, where the cause is said
    assert f"of {size + len('error: system failure') + 1} bytes" in reason  # its size said
    assert (await host.labels())[ip.LABEL_UPDATE_RESULT] == "failed"


async def test_a_retry_pattern_anywhere_in_a_long_output_counts_as_upstream_counts_it(
    tmp_path: Path,
) -> None:
    """Upstream matches its patterns against all of the output: so does the agent, while it
    reads it, though it keeps only the tail."""
    host = Host(tmp_path)
    ctl = host.controller()
    ctl.inplace._run = ctl.inplace._run_on_host
    ctl.ctx.settings = ctl.ctx.settings.model_copy(update={"root": Path("/")})
    ctl.inplace.retry_interval, ctl.inplace.retry_timeout = 0.01, 0.5
    await ctl.reconcile(secret(osc_doc()))
    await host.set_condition("ReadyForUpdate")
    command, *args = big_output_command(1 << 20, "mirror: Network Problems\n", "giving up\n", 1)
    ctl._latest, ctl._seen = secret(osc_doc(os_version="1877.5", command=command, args=args)), True
    assert await ctl._step(True) is RETRY  # retriable: retried by the controller
    assert ctl.inplace.command_runs > 1  # and retried within the update first
    reason = (await host.annotations())[ip.ANNOTATION_UPDATE_FAILED_REASON]
    assert "retriable error" in reason
    assert "non-retriable" not in reason
    assert len(reason.encode()) <= ip.REASON_LIMIT
    assert reason.endswith("giving up")


def test_the_output_kept_is_its_tail_with_its_size_and_the_patterns_seen_anywhere() -> None:
    out = ip.CommandOutput(keep=16)
    for chunk in (b"network pro", b"blems here\n", "é".encode() * 40, b"\n  the  end \n"):
        out.feed(chunk)
    assert out.kind == "retriable"  # found across two chunks
    assert out.total == 11 + 11 + 80 + 13
    # the last 16 bytes begin inside a two-byte "é": that half is dropped
    assert out.reported() == f"output (its last 16 of {out.total} bytes): é the end"
    short = ip.CommandOutput.of("error:\n invalid arguments\n")
    assert (short.kind, short.reported()) == ("non-retriable", "output: error: invalid arguments")
    assert ip.CommandOutput.of("disk full").kind == "unknown"


def test_a_reason_is_bounded_keeping_its_head_and_tail() -> None:
    reason = "in-place changes not computed: invalid version '" + "9" * 100_000 + "x'"
    bounded = ip.bounded_reason(reason)
    assert len(bounded.encode()) <= ip.REASON_LIMIT
    assert bounded.startswith("in-place changes not computed: invalid version '999")
    assert bounded.endswith("999x'")
    assert "bytes cut" in bounded
    assert ip.bounded_reason("short") == "short"
    assert ip.failed_patch(reason)["metadata"]["annotations"][
        ip.ANNOTATION_UPDATE_FAILED_REASON
    ] == (bounded)


class StrictKube(FakeKube):
    """The API server's 256 KiB bound on all of a Node's annotations: a patch past it is
    refused as invalid (422), as the real server refuses it."""

    refused = 0

    async def patch_node(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        node = copy.deepcopy(self.nodes().items[name])
        merge_patch(node, patch)
        annotations = node["metadata"].get("annotations") or {}
        if sum(len(k) + len(v.encode()) for k, v in annotations.items()) > 256 << 10:
            self.refused += 1
            raise KubeInvalid(
                f'Node "{name}" is invalid: metadata.annotations: Too long: may not be more '
                "than 262144 bytes",
                status=422,
                reason="Invalid",
            )
        return await super().patch_node(name, patch)


def strict_host(root: Path) -> Host:
    host = Host(root)
    host.kube = StrictKube()
    host.kube.nodes().put({"metadata": {"name": "n1", "uid": "u1", "resourceVersion": "1"}})
    return host


async def test_a_node_that_refuses_the_reason_still_gets_the_failed_label(tmp_path: Path) -> None:
    host = strict_host(tmp_path)
    node = await host.node()
    node["metadata"]["annotations"] = {"example.com/big": "b" * (255 << 10)}  # 1 KiB left
    ctl = host.controller()
    await ctl.reconcile(secret(osc_doc()))
    await host.set_condition("ReadyForUpdate")
    host.answers = [(2, "error: invalid arguments " + "y" * 2000)]
    update = secret(osc_doc(os_version="1877.5", text="two"))
    ctl._latest, ctl._seen = update, True
    assert await ctl._step(True) is SKIPPED  # terminal: not the same refused patch again
    assert isinstance(host.kube, StrictKube)
    assert host.kube.refused == 1  # the full reason, once; then a short note went through
    labels, annotations = await host.labels(), await host.annotations()
    assert labels[ip.LABEL_UPDATE_RESULT] == "failed"
    assert "refused" in annotations[ip.ANNOTATION_UPDATE_FAILED_REASON]
    patches = len(host.kube.writes("patch_node"))
    back = host.controller()  # a restart does not send the refused patch again
    back._latest, back._seen = update, True
    assert await back._step(True) is SKIPPED
    assert (host.kube.refused, len(host.kube.writes("patch_node"))) == (1, patches)


async def test_a_refused_updating_os_annotation_fails_the_update_once(tmp_path: Path) -> None:
    host = strict_host(tmp_path)
    ctl = host.controller()
    await ctl.reconcile(secret(osc_doc()))
    await host.set_condition("ReadyForUpdate")
    version = "1877.5-" + "a" * (300 << 10)  # read as 1877.5; too long for an annotation
    ctl._latest, ctl._seen = secret(osc_doc(os_version=version, text="two")), True
    assert await ctl._step(True) is SKIPPED
    assert host.runs == []  # the command is not run without the Node's mark
    labels, annotations = await host.labels(), await host.annotations()
    assert labels[ip.LABEL_UPDATE_RESULT] == "failed"
    reason = annotations[ip.ANNOTATION_UPDATE_FAILED_REASON]
    assert ip.ANNOTATION_UPDATING_OS_VERSION in reason
    assert len(reason.encode()) <= ip.REASON_LIMIT
    assert await ctl._step(True) is DONE  # the same Secret: not sent again
    assert isinstance(host.kube, StrictKube)
    assert host.kube.refused == 1


async def test_a_command_past_its_time_limit_is_ended_with_what_it_started(tmp_path: Path) -> None:
    ctx: AgentContext = make_ctx(tmp_path)
    ctx.settings = ctx.settings.model_copy(update={"root": Path("/")})
    updater = InPlaceUpdater(ctx)
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen(['sleep', '600'])\n"  # holds the output pipe open too
        "sys.stdout.write('x' * (1 << 20) + f'\\nchild {child.pid}\\n')\nsys.stdout.flush()\n"
        "time.sleep(600)\n"
    )
    started = time.monotonic()
    code, output = await updater._run_on_host([sys.executable, "-c", script], 1.0)
    assert time.monotonic() - started < 1.0 + KILL_GRACE
    assert code == -1
    assert output.total > 1 << 20
    text = output.text()
    assert text.endswith("[timed out after 1s]")
    child = int(text.split("child ")[1].split()[0])
    stat = Path(f"/proc/{child}/stat")

    def ended() -> bool:
        try:
            return stat.read_text().split(") ")[1].startswith("Z")
        except FileNotFoundError:
            return True

    # killed: a process the kernel is still tearing down reads as running for a moment
    await until(ended, timeout=2.0)


def test_the_kept_tail_drops_only_a_cut_characters_continuation_bytes() -> None:
    binary = ip.CommandOutput(keep=8)
    binary.feed(b"head" + bytes([0x80]) * 20)  # not UTF-8 at all: shown, not dropped
    assert binary.text() == "\ufffd" * 5
    cut = ip.CommandOutput(keep=5)
    cut.feed("€ok€".encode())  # the last 5 bytes begin with two bytes of the first "€"
    assert cut.text() == "ok€"
    assert ip.bounded_reason("a\udc80b") == "a?b"  # a lone surrogate cannot be sent as JSON
