"""The OSC controller's reconcile on the shared fakes: what it decides and in which order.

The real bed covers the same paths end to end; here each decision is pinned down alone: a first
apply, an unchanged Secret, a paced update that is planned once for its admission and its apply.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from node_agent.agent import after_first_reconcile, build_applier
from node_agent.apply.applier import Applier, Planned
from node_agent.base.errors import ApplyError, HostIOError, SystemdCallError
from node_agent.base.layout import (
    BOOTSTRAP_TOKEN_FILE,
    HEALTH_GATE_PREVIOUS,
    KUBELET_BOOTSTRAP_KUBECONFIG,
    unit_path,
)
from node_agent.base.loop import DONE, RETRY, SKIPPED
from node_agent.context import AgentContext
from node_agent.controllers.osc import controller as controller_module
from node_agent.controllers.osc import pacing
from node_agent.controllers.osc.controller import OSCController
from node_agent.host.fs import Removed
from node_agent.host.history import HistoryEntry
from node_agent.kube import report
from node_agent.kube.report import (
    ANNOTATION_APPLIED_CHECKSUM,
    ANNOTATION_SECRET_CHECKSUM,
    LABEL_KUBERNETES_VERSION,
)
from node_agent.osc.decode import decode_osc
from node_agent.osc.models import OperatingSystemConfig
from node_agent.systemd import UnitFileChange, UnitState
from tests.unit.fakes import Call, FakeKube, FakeSystemd, make_ctx, osc_document

pytestmark = pytest.mark.usefixtures("virtual_clock")

SECRET = "gardener-node-agent-pool-a-0123456789abcdef"


def osc_bytes(text: str, *, agent_unit: str | None = None) -> bytes:
    doc = osc_document(
        text,
        [
            {"name": "a.service", "command": "restart", "enable": True,
             "content": "[Service]\nExecStart=/bin/true\n", "filePaths": ["/etc/test/a.conf"]}
        ],
    )  # fmt: skip
    if agent_unit is not None:  # the agent's own unit, changing with ``text``
        doc["spec"]["units"].append(
            {"name": agent_unit, "command": "restart", "enable": True,
             "content": f"[Service]\nExecStart=/bin/true {text.strip()}\n"}
        )  # fmt: skip
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


def controller(
    tmp_path: Path, calls: list[Call] | None = None, *, gate: dict[str, Any] | None = None
) -> tuple[OSCController, AgentContext, FakeKube, FakeSystemd]:
    """``calls``: one list for the API writes and the systemd jobs, in the order they happened.
    ``gate``: the health gate's settings (default: off)."""
    kube, systemd = FakeKube(calls=calls), FakeSystemd(calls=calls)
    kube.nodes().put({"metadata": {"name": "n1", "uid": "u1", "resourceVersion": "1"}})
    ctx: AgentContext = make_ctx(
        tmp_path,
        config={
            "controllers": {"operatingSystemConfig": {"secretName": SECRET}},
            "nodeAgent": {"healthGate": gate or {"enabled": False}},
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


async def test_the_end_of_the_first_reconcile_is_marked_however_it_ended(tmp_path: Path) -> None:
    """The daemon starts what can wait once the first reconcile ended: refused, or with no
    Secret at all, counts as well as applied; a turn before the watch listed it does not."""
    ctl, ctx, _, _ = controller(tmp_path / "a")
    assert await ctl._step(True) is SKIPPED  # the Secret not listed yet
    assert not ctx.first_reconcile.is_set()
    ctl.observe("ADDED", secret(b"kind: [not an OSC"))
    assert await ctl._step(True) is SKIPPED
    assert ctx.first_reconcile.is_set()
    ctl, ctx, _, _ = controller(tmp_path / "b")
    ctl.observe("DELETED", None)
    assert await ctl._step(True) is SKIPPED
    assert ctx.first_reconcile.is_set()


async def test_what_can_wait_starts_after_the_first_reconcile_or_its_head_start(
    tmp_path: Path,
) -> None:
    ctx: AgentContext = make_ctx(tmp_path)
    started: list[str] = []

    async def start() -> None:
        started.append("started")

    waiting = asyncio.create_task(after_first_reconcile(ctx, start, head_start=30.0))
    await asyncio.sleep(0.05)
    assert started == []
    ctx.first_reconcile.set()
    await asyncio.wait_for(waiting, 5)
    assert started == ["started"]
    # a first reconcile that takes long (an image pull, a reconciliation delay) holds it no longer
    late: AgentContext = make_ctx(tmp_path)
    await asyncio.wait_for(after_first_reconcile(late, start, head_start=0.05), 5)
    assert started == ["started", "started"]


async def test_a_changed_file_restarts_its_unit_without_a_daemon_reload(tmp_path: Path) -> None:
    """systemd re-reads every unit file on a reload: a change of a unit's file only (its
    enablement already in place) restarts the unit, re-asserts its enablement after the restart
    and reloads nothing; a changed unit file is reloaded before the restart."""
    ctl, _, _, systemd = controller(tmp_path)
    await ctl.reconcile(secret(osc_bytes("one\n")))
    assert systemd.calls.index(("enable", "a.service")) < systemd.calls.index(("daemon_reload",))
    assert systemd.calls.index(("daemon_reload",)) < systemd.calls.index(("restart", "a.service"))
    systemd.calls.clear()
    await ctl.reconcile(secret(osc_bytes("two\n")))
    assert systemd.calls == [("restart", "a.service"), ("enable", "a.service")]
    systemd.calls.clear()
    await ctl.reconcile(secret(osc_bytes("two\n", agent_unit="gardener-node-agent.service")))
    assert ("daemon_reload",) in systemd.calls  # a new unit file


async def test_a_late_enable_that_makes_a_symlink_reloads_after_the_restart(
    tmp_path: Path,
) -> None:
    """The unit was disabled by hand since: re-asserting its enablement after the restart makes
    its symlink again, and systemd is reloaded once, after it."""
    ctl, _, _, systemd = controller(tmp_path)
    await ctl.reconcile(secret(osc_bytes("one\n")))
    systemd.enabled.discard("a.service")
    systemd.calls.clear()
    await ctl.reconcile(secret(osc_bytes("two\n")))
    assert systemd.calls == [("restart", "a.service"), ("enable", "a.service"), ("daemon_reload",)]
    assert "a.service" in systemd.enabled


async def test_a_failing_late_enable_is_reported_and_does_not_hold_the_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctl, _, _, systemd = controller(tmp_path)
    await ctl.reconcile(secret(osc_bytes("one\n")))
    systemd.calls.clear()

    async def refuse(units: Sequence[str]) -> list[UnitFileChange]:
        systemd.calls.append(("enable", *units))
        raise SystemdCallError(
            "refused",
            op="enable",
            name="org.freedesktop.DBus.Error.AccessDenied",
            units=tuple(units),
        )

    monkeypatch.setattr(systemd, "enable", refuse)
    with pytest.raises(ApplyError, match=r"enable a\.service: refused"):
        await ctl.reconcile(secret(osc_bytes("two\n")))
    assert systemd.calls[0] == ("restart", "a.service")
    assert systemd.calls[1:3] == [("enable", "a.service")] * 2  # all at once, then one by one


async def test_a_removed_unit_deleted_by_a_retry_is_reloaded_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A unit the OSC no longer has loses its file after the commands, and a reload follows.
    When the deletion fails (a read-only mount), that reload still runs for the rest; the retry
    that deletes the file reloads again, or systemd keeps the removed unit loaded from a file
    that is gone. Found by the apply state machine (``test_apply_machine.py``)."""
    ctl, ctx, _, systemd = controller(tmp_path)
    template = {"name": "t@.service", "content": "[Service]\nExecStart=/bin/sleep 1\n"}
    doc = yaml.safe_load(osc_bytes("one\n"))
    doc["spec"]["units"].append(template)
    await ctl.reconcile(secret(yaml.safe_dump(doc).encode()))
    assert (tmp_path / unit_path("t@.service").lstrip("/")).exists()
    without = osc_bytes("one\n")
    real = ctx.fs.remove_written  # how a deletion step removes what the agent wrote

    def read_only(path: str, sha256: str) -> Removed:
        if path == unit_path("t@.service"):
            raise HostIOError("remove", path, OSError(errno.EROFS, os.strerror(errno.EROFS)))
        return real(path, sha256)

    monkeypatch.setattr(ctx.fs, "remove_written", read_only)
    with pytest.raises(ApplyError):
        await ctl.reconcile(secret(without))
    monkeypatch.setattr(ctx.fs, "remove_written", real)
    systemd.calls.clear()
    await ctl.reconcile(secret(without))
    assert not (tmp_path / unit_path("t@.service").lstrip("/")).exists()
    assert systemd.calls[-1:] == [("daemon_reload",)]


async def test_the_health_gate_asks_only_about_the_units_the_update_restarts(
    tmp_path: Path,
) -> None:
    """The gate's baseline is on the critical path of every update: it reads the units the
    plan has a command for, not every unit of the OSC."""
    ctl, _, _, systemd = controller(tmp_path, gate={"enabled": True, "settleWindow": "50ms"})
    bystander = {"name": "b.service", "enable": True, "content": "[Service]\nExecStart=/b\n"}

    def with_bystander(text: str) -> bytes:
        doc = yaml.safe_load(osc_bytes(text))
        doc["spec"]["units"].append(bystander)
        return yaml.safe_dump(doc).encode()

    await ctl.reconcile(secret(with_bystander("one\n")))
    real = systemd.unit_states
    asked: list[str] = []

    async def recording(names: Any, *, brief: bool = False) -> dict[str, UnitState]:
        asked.extend(names)
        return await real(names, brief=brief)

    systemd.unit_states = recording  # type: ignore[method-assign]
    outcome = await ctl.reconcile(secret(with_bystander("two\n")))
    assert outcome is not None
    assert outcome.report.restarted == ["a.service"]
    assert asked
    assert set(asked) == {"a.service"}


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


# -- the stages of one reconcile, one by one ---------------------------------------------------


def checksum_of(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def reasons(kube: FakeKube) -> list[str]:
    """The reasons of the Events on the Node, in the order they were recorded."""
    return [c[1]["reason"] for c in kube.writes("create_event")]


async def test_a_rejected_secret_is_not_decoded_again_until_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctl, _, kube, _ = controller(tmp_path)
    decoded: list[bytes] = []
    real = decode_osc

    def counting(
        raw: bytes, annotated: str | None, host: str, digest: str | None = None
    ) -> OperatingSystemConfig:
        decoded.append(raw)
        return real(raw, annotated, host, digest)

    monkeypatch.setattr(controller_module, "decode_osc", counting)
    ctl.observe("ADDED", secret(b"kind: [not an OSC"))
    assert await ctl._step(True) is SKIPPED  # invalid: reported, not retried
    assert (len(decoded), ctl.failures) == (1, 1)
    assert reasons(kube) == [report.REASON_OSC_INVALID]
    assert await ctl._step(True) is DONE  # the same resourceVersion: nothing to do
    assert (len(decoded), ctl.failures) == (1, 1)
    assert reasons(kube) == [report.REASON_OSC_INVALID]
    good = osc_bytes("one\n")
    ctl.observe("MODIFIED", secret(good))  # a new resourceVersion
    assert await ctl._step(True) is DONE
    assert decoded[-1] == good
    assert await applied_annotation(kube) == checksum_of(good)


async def test_an_unchanged_secret_repairs_drift_on_the_periodic_check_only(
    tmp_path: Path,
) -> None:
    ctl, _, kube, _ = controller(tmp_path)
    ctl.observe("ADDED", secret(osc_bytes("one\n")))
    assert await ctl._step(True) is DONE
    conf = tmp_path / "etc/test/a.conf"
    conf.write_text("drifted\n")
    assert await ctl._step(True) is DONE  # woken by an event: no look at the disk
    assert conf.read_text() == "drifted\n"
    assert await ctl._step(False) is DONE  # the period ran out: the full check
    assert conf.read_text() == "one\n"
    assert reasons(kube)[-1] == report.REASON_DRIFT_REPAIRED


async def test_an_unchanged_secret_is_reported_only_when_the_node_misses_it(
    tmp_path: Path,
) -> None:
    ctl, _, kube, _ = controller(tmp_path)
    raw = osc_bytes("one\n")
    await ctl.reconcile(secret(raw))
    patches = len(kube.writes("patch_node"))
    assert await ctl.reconcile(secret(raw)) is None
    assert len(kube.writes("patch_node")) == patches
    ctl.node_recreated()  # look again: the Node still carries the checksum
    assert await ctl.reconcile(secret(raw)) is None
    assert len(kube.writes("patch_node")) == patches
    kube.nodes().put({"metadata": {"name": "n1", "uid": "u2", "resourceVersion": "9"}})
    ctl.node_recreated()  # a new Node, without the checksum
    assert await ctl.reconcile(secret(raw)) is None
    assert len(kube.writes("patch_node")) == patches + 1
    assert await applied_annotation(kube) == checksum_of(raw)


async def test_the_first_apply_is_not_paced_nor_delayed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctl, _, _, _ = controller(tmp_path)
    admitted: list[str] = []
    delayed: list[str] = []
    real_admit = ctl.rollout.admit

    async def admit(secret: Any, checksum: str, **kwargs: Any) -> Any:
        admitted.append(checksum)
        return await real_admit(secret, checksum, **kwargs)

    async def delay() -> None:
        delayed.append(str(ctl.desired_checksum))

    monkeypatch.setattr(ctl.rollout, "admit", admit)
    monkeypatch.setattr(ctl, "_reconciliation_delay", delay)
    annotations = {pacing.ANNOTATION_MAX_PARALLEL: "1", pacing.ANNOTATION_CANARIES: "0"}
    first, second = osc_bytes("one\n"), osc_bytes("two\n")
    assert await ctl.reconcile(secret(first, annotations)) is not None
    assert (admitted, delayed) == ([], [])
    assert await ctl.reconcile(secret(second, annotations)) is not None
    assert admitted == delayed == [checksum_of(second)]


async def test_a_node_held_by_the_rollout_waits_its_delay_once_per_checksum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiting node is woken again and again for one update (its turn, the fallback
    re-check); the delay spreads an update's start once, not again on every wake-up."""
    ctl, _, _, _ = controller(tmp_path)
    delayed: list[str] = []

    async def delay() -> None:
        delayed.append(str(ctl.desired_checksum))

    async def held(secret: Any, checksum: str, **kwargs: Any) -> Any:
        return None  # the pool's rollout holds the update back

    await ctl.reconcile(secret(osc_bytes("one\n")))
    monkeypatch.setattr(ctl, "_reconciliation_delay", delay)
    monkeypatch.setattr(ctl.rollout, "admit", held)
    annotations = {pacing.ANNOTATION_MAX_PARALLEL: "1"}
    for _ in range(3):
        assert await ctl.reconcile(secret(osc_bytes("two\n"), annotations)) is None
    assert delayed == [checksum_of(osc_bytes("two\n"))]
    assert await ctl.reconcile(secret(osc_bytes("three\n"), annotations)) is None
    assert delayed == [checksum_of(osc_bytes("two\n")), checksum_of(osc_bytes("three\n"))]


async def test_the_reconciliation_delay_is_read_from_the_nodes_watch(tmp_path: Path) -> None:
    """With the Node seen through its watch, an update reads no Node at all: not before its
    apply (the delay) and not after it (the checksum is one merge patch)."""
    ctl, _, kube, _ = controller(tmp_path)
    await ctl.reconcile(secret(osc_bytes("one\n")))
    node = await kube.nodes().get("n1")
    delay = {report.ANNOTATION_RECONCILIATION_DELAY: "1ms"}
    ctl.node_seen({**node, "metadata": {**node["metadata"], "annotations": delay}})
    kube.reads.clear()
    assert await ctl.reconcile(secret(osc_bytes("two\n"))) is not None
    assert [r for r in kube.reads if r[0] == "get_node"] == []
    patch = kube.writes("patch_node")[-1][2]
    assert patch["metadata"]["annotations"][report.ANNOTATION_APPLIED_CHECKSUM] == (
        ctl.desired_checksum
    )


async def test_serial_mode_skips_the_reconciliation_delay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctl, _, _, _ = controller(tmp_path)
    delayed: list[str] = []

    async def delay() -> None:
        delayed.append(str(ctl.desired_checksum))

    monkeypatch.setattr(ctl, "_reconciliation_delay", delay)
    await ctl.reconcile(secret(osc_bytes("one\n")))
    serial = {"reconciliation.osc.node-agent.gardener.cloud/serial": "true"}
    assert await ctl.reconcile(secret(osc_bytes("two\n"), serial)) is not None
    assert delayed == []  # the Lease spreads the nodes out instead


async def test_a_failed_apply_is_recorded_and_the_rollout_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctl, ctx, kube, systemd = controller(tmp_path)
    await ctl.reconcile(secret(osc_bytes("one\n")))
    failed: list[str] = []
    real_failed = ctl.rollout.failed

    async def told(permit: Any, why: str) -> None:
        failed.append(why)
        await real_failed(permit, why)

    monkeypatch.setattr(ctl.rollout, "failed", told)
    systemd.failing.add("a.service")
    raw = osc_bytes("two\n")
    ctl.observe("MODIFIED", secret(raw))
    assert await ctl._step(True) is RETRY  # the loop backs off and tries again
    history = (await ctx.state.load_history_async()).entries
    assert [e.result for e in history] == ["succeeded", "failed"]
    assert history[-1].checksum_to == checksum_of(raw)
    assert history[-1].error is not None
    assert "a.service" in history[-1].error
    assert failed == [history[-1].error]
    assert await applied_annotation(kube) == checksum_of(osc_bytes("one\n"))
    assert ctl.failures == 1


async def test_a_successful_apply_reports_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unit command Events, the history entry, the checksum on the Node, then OSCApplied."""
    calls: list[Call] = []
    ctl, ctx, kube, _ = controller(tmp_path, calls)
    real_append = ctx.state.append_history_async

    async def append(entry: HistoryEntry) -> Any:
        calls.append(("history", entry.result))
        return await real_append(entry)

    monkeypatch.setattr(ctx.state, "append_history_async", append)
    raw = osc_bytes("one\n")
    await ctl.reconcile(secret(raw))
    order = [
        c[1]["reason"] if c[0] == "create_event" else c[0]
        for c in calls
        if c[0] in ("restart", "create_event", "history", "patch_node")
    ]
    assert order == [
        "restart",
        report.REASON_UNIT_COMMAND["restart"],
        "history",
        "patch_node",
        report.REASON_OSC_APPLIED,
    ]
    applied_patch = kube.writes("patch_node")[0][2]
    assert applied_patch["metadata"]["annotations"][ANNOTATION_APPLIED_CHECKSUM] == (
        checksum_of(raw)
    )


async def test_an_apply_before_the_node_exists_gets_its_event_with_the_first_report(
    tmp_path: Path,
) -> None:
    """Upstream's order when the kubelet registers the Node after the first apply: the
    checksum and the ``OSCApplied`` Event both come once the Node exists, the Event once."""
    ctl, ctx, kube, _ = controller(tmp_path)
    kube.nodes().delete("n1")  # the kubelet has not registered the Node yet
    ctx.node_name = ctx.node_uid = None
    ctx.node_known.clear()
    raw = osc_bytes("one\n")
    assert await ctl.reconcile(secret(raw)) is not None
    assert kube.writes("patch_node") == []
    assert kube.writes("create_event") == []
    kube.nodes().put({"metadata": {"name": "n1", "uid": "u1", "resourceVersion": "2"}})
    assert await ctx.look_up_node()  # the node watch's lookup, which tells the controller
    ctl.node_recreated()
    assert await ctl.reconcile(secret(raw)) is None  # applied: only reported
    assert await applied_annotation(kube) == checksum_of(raw)
    reasons = [write[1]["reason"] for write in kube.writes("create_event")]
    assert reasons == [report.REASON_OSC_APPLIED]
    assert await ctl.reconcile(secret(raw)) is None
    ctl.node_recreated()  # a new look finds the checksum there: no Event again
    assert await ctl.reconcile(secret(raw)) is None
    assert [w[1]["reason"] for w in kube.writes("create_event")] == reasons


async def test_a_node_registered_in_the_settle_window_gets_the_checksum_at_once(
    tmp_path: Path,
) -> None:
    """The kubelet the update started registers the Node while the update's settle window is
    watched: the checksum goes on the Node then, not after the window (nothing else would
    wake the loop until the periodic check)."""
    ctl, ctx, kube, _ = controller(tmp_path, gate={"enabled": True, "settleWindow": "30s"})
    await ctl.reconcile(secret(osc_bytes("one\n")))
    kube.nodes().delete("n1")
    ctx.node_name = ctx.node_uid = None
    ctx.node_known.clear()
    two = osc_bytes("two\n")
    assert await ctl.reconcile(secret(two)) is not None
    assert ctl.gate.view().watching == checksum_of(two)  # the window runs
    kube.nodes().put({"metadata": {"name": "n1", "uid": "u2", "resourceVersion": "5"}})
    assert await ctx.look_up_node()
    ctl.node_recreated()
    async with asyncio.timeout(5):
        assert await ctl.reconcile(secret(two)) is None
    assert await applied_annotation(kube) == checksum_of(two)
    assert ctl.gate.view().watching == checksum_of(two)  # still watched
    assert [w[1]["reason"] for w in kube.writes("create_event")][-1] == report.REASON_OSC_APPLIED
    await ctl._stop_settling()


async def test_the_agents_own_unit_restarts_last(tmp_path: Path) -> None:
    calls: list[Call] = []
    ctl, ctx, kube, _ = controller(tmp_path, calls)
    own = ctx.settings.agent_unit
    await ctl.reconcile(secret(osc_bytes("one\n", agent_unit=own)))
    del calls[:]
    outcome = await ctl.reconcile(secret(osc_bytes("two\n", agent_unit=own)))
    assert outcome is not None
    assert outcome.restarts_agent
    assert calls[-1] == ("restart", own)
    assert ("restart", own) not in calls[:-1]
    assert [c[0] for c in calls[-3:-1]] == ["patch_node", "create_event"]
    assert reasons(kube)[-1] == report.REASON_OSC_APPLIED


async def test_a_lost_journal_makes_the_next_turn_look_for_drift(tmp_path: Path) -> None:
    """A journal set aside (here: garbage where it lives) hides what its change set had done:
    the next turn compares the host with what is applied, without waiting for the period."""
    ctl, ctx, kube, _ = controller(tmp_path)
    ctl.observe("ADDED", secret(osc_bytes("one\n")))
    assert await ctl._step(True) is DONE
    conf = tmp_path / "etc/test/a.conf"
    conf.write_text("changed by a change set whose journal was lost\n")
    (tmp_path / "var/lib/gardener-node-agent/last-computed-osc-changes.yaml").write_text("{")
    ctx.state._pending, ctx.state._no_journal = None, False  # as after a restart: read it again
    assert await ctl._step(True) is DONE  # reads the journal: set aside, reported
    assert reasons(kube)[-1] == report.REASON_STATE_SET_ASIDE
    assert await ctl._step(True) is DONE  # woken, yet the full check runs
    assert conf.read_text() == "one\n"
    assert reasons(kube)[-1] == report.REASON_DRIFT_REPAIRED


async def test_a_rollback_without_its_kept_osc_says_so_and_leaves_the_update(
    tmp_path: Path,
) -> None:
    """The last-known-good osc.yaml the gate kept is gone when the update must be rolled
    back (only a hand in the state directory does that): a Warning names both OSCs, the gate
    is cleared, the update stays applied, and nothing is retried forever."""
    ctl, ctx, kube, _ = controller(tmp_path, gate={"enabled": True, "settleWindow": "30s"})
    one, two = osc_bytes("one\n"), osc_bytes("two\n")
    await ctl.reconcile(secret(one))
    last = await ctx.state.load_last_applied_async()
    assert last is not None
    record = await ctl.gate.begin(checksum_of(two), last, ["a.service"])
    assert record is not None
    assert record.previous_raw is None  # kept by a link
    (tmp_path / "var/lib/gardener-node-agent" / HEALTH_GATE_PREVIOUS).unlink()
    rolling = record.model_copy(update={"phase": "rolling-back", "unit": "a.service"})
    await ctl._roll_back(rolling)
    assert reasons(kube)[-1] == report.REASON_OSC_ROLLED_BACK
    message = kube.writes("create_event")[-1][1]["message"]
    assert "cannot be rolled back" in message
    assert checksum_of(one)[:12] in message
    assert await ctl.gate.record() is None
    assert (tmp_path / "etc/test/a.conf").read_text() == "one\n"  # nothing applied


async def _reported_while_watching(tmp_path: Path, *, strict: bool) -> tuple[bool, str | None]:
    """Publish an update that restarts a running unit under a 1 s settle window: whether the
    Node carried its checksum while the gate still watched, and the checksum at the end."""
    ctl, _ctx, kube, _ = controller(tmp_path, gate={"enabled": True, "settleWindow": "1s"})
    if strict:
        path = tmp_path / "var/lib/gardener-node-agent/node-agent-strict.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "apiVersion: node-agent.gardener.cloud/v1alpha1\nkind: Strictness\n"
            "reportAfterSettle: true\n"
        )
    await ctl.reconcile(secret(osc_bytes("one\n")))
    two = osc_bytes("two\n")
    task = asyncio.create_task(ctl.reconcile(secret(two)))
    seen_while_watching = False
    while not task.done() or ctl.applying:
        if ctl.gate.view().watching is not None:
            seen_while_watching |= await applied_annotation(kube) == checksum_of(two)
        await asyncio.sleep(0.01)
    assert await task is not None
    await ctl.settled()
    return seen_while_watching, await applied_annotation(kube)


async def test_a_newer_update_is_not_held_up_by_the_settle_window(tmp_path: Path) -> None:
    """Upstream applies the next update at once: the settle window of a reported update is
    watched beside the reconcile loop, and a newer Secret ends it early."""
    ctl, _ctx, kube, _ = controller(tmp_path, gate={"enabled": True, "settleWindow": "30s"})
    await ctl.reconcile(secret(osc_bytes("one\n")))
    await ctl.reconcile(secret(osc_bytes("two\n")))
    assert ctl.gate.view().watching == checksum_of(osc_bytes("two\n"))
    three = osc_bytes("three\n")
    async with asyncio.timeout(5):
        await ctl.reconcile(secret(three))
    assert await applied_annotation(kube) == checksum_of(three)
    assert ctl.gate.view().watching == checksum_of(three)
    await ctl._stop_settling()


async def test_an_update_is_reported_before_its_settle_window_as_upstream_does(
    tmp_path: Path,
) -> None:
    """Upstream's contract: Gardener sees the checksum when the apply is done; the health
    gate watches after that (and would put the old checksum back with a rollback)."""
    seen, end = await _reported_while_watching(tmp_path, strict=False)
    assert seen
    assert end == checksum_of(osc_bytes("two\n"))


async def test_with_report_after_settle_the_checksum_waits_for_the_window(
    tmp_path: Path,
) -> None:
    seen, end = await _reported_while_watching(tmp_path, strict=True)
    assert not seen
    assert end == checksum_of(osc_bytes("two\n"))


def kubernetes_update(version: str) -> bytes:
    """An OSC that writes the agent's config (with ``version``) and restarts the agent's
    unit on it, as a Kubernetes update of Gardener's does."""
    config = (
        "apiVersion: nodeagent.config.gardener.cloud/v1alpha1\nkind: NodeAgentConfiguration\n"
        f"controllers:\n  operatingSystemConfig:\n    secretName: {SECRET}\n"
        f"    kubernetesVersion: {version}\n"
    )
    doc = yaml.safe_load(osc_bytes("one\n"))
    doc["spec"]["files"].append(
        {"path": "/var/lib/gardener-node-agent/config.yaml", "permissions": 0o600,
         "content": {"inline": {"data": config}}}
    )  # fmt: skip
    doc["spec"]["units"].append(
        {"name": "gardener-node-agent.service", "enable": True,
         "content": "[Service]\nExecStart=/opt/bin/gardener-node-agent\n",
         "filePaths": ["/var/lib/gardener-node-agent/config.yaml"]}
    )  # fmt: skip
    return yaml.safe_dump(doc).encode()


async def test_the_checksum_comes_with_the_version_of_the_config_the_update_wrote(
    tmp_path: Path,
) -> None:
    """Upstream restarts on the new config before it reports a Kubernetes update, so the
    Node never carries the new checksum with the old version label: ours reports before its
    own restart, in one patch with the version of the config it just wrote."""
    calls: list[Call] = []
    ctl, _, kube, _ = controller(tmp_path, calls)
    await ctl.reconcile(secret(kubernetes_update("1.33.4")))
    update = kubernetes_update("1.34.1")
    await ctl.reconcile(secret(update))
    patches = [p for _, name, p in kube.writes("patch_node") if name == "n1"]
    with_checksum = [
        p for p in patches
        if (p["metadata"].get("annotations") or {}).get(ANNOTATION_APPLIED_CHECKSUM)
        == checksum_of(update)
    ]  # fmt: skip
    assert len(with_checksum) == 1
    assert with_checksum[0]["metadata"]["labels"][LABEL_KUBERNETES_VERSION] == "1.34.1"
    restart = ("restart", "gardener-node-agent.service")
    assert restart in calls


async def test_the_kubelets_bootstrap_kubeconfig_goes_once_the_node_exists(
    tmp_path: Path,
) -> None:
    """Upstream's rule: the first apply reported on an existing Node deletes the bootstrap
    token and the kubelet's bootstrap kubeconfig, whether or not the kubelet wrote its own
    kubeconfig yet (a registered Node means it used the bootstrap one)."""
    ctl, ctx, _, _ = controller(tmp_path)
    fs = ctx.fs
    fs.write_atomic(ctx.config.client_connection.kubeconfig, b"kind: Config\n", 0o600)
    fs.write_atomic(BOOTSTRAP_TOKEN_FILE, b"abcdef.0123456789abcdef\n", 0o600)
    fs.write_atomic(KUBELET_BOOTSTRAP_KUBECONFIG, b"kind: Config\n", 0o600)
    await ctl.reconcile(secret(osc_bytes("one\n")))
    assert fs.lstat(BOOTSTRAP_TOKEN_FILE) is None
    assert fs.lstat(KUBELET_BOOTSTRAP_KUBECONFIG) is None


async def test_a_bootstrap_kubeconfig_for_a_ca_rotation_waits_for_the_kubelet(
    tmp_path: Path,
) -> None:
    ctl, ctx, _, _ = controller(tmp_path)
    fs = ctx.fs
    fs.write_atomic(ctx.config.client_connection.kubeconfig, b"kind: Config\n", 0o600)
    fs.write_atomic(KUBELET_BOOTSTRAP_KUBECONFIG, b"kind: Config\n", 0o600)
    ctl.inplace.kubelet_rebootstrapping = True  # written for a re-bootstrap, not yet used
    await ctl.reconcile(secret(osc_bytes("one\n")))
    assert fs.lstat(KUBELET_BOOTSTRAP_KUBECONFIG) is not None


async def test_the_apply_waits_for_the_token_files_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first boot: the token controller's first round comes before the OSC's units start
    (they may read the tokens), as upstream's order has it; a Secret that never comes holds
    the apply only ``TOKENS_WAIT`` seconds."""
    from node_agent.controllers.osc import controller as osc_controller

    ctl, ctx, _kube, _ = controller(tmp_path)
    ctx.tokens_synced.clear()
    task = asyncio.create_task(ctl.reconcile(secret(osc_bytes("one\n"))))
    await asyncio.sleep(0.3)
    assert not task.done()
    assert not (tmp_path / "etc/test/a.conf").exists()
    ctx.tokens_synced.set()
    async with asyncio.timeout(5):
        assert await task is not None
    monkeypatch.setattr(osc_controller, "TOKENS_WAIT", 0.2)
    ctx.tokens_synced.clear()
    async with asyncio.timeout(5):
        assert await ctl.reconcile(secret(osc_bytes("two\n"))) is not None
