"""``node-agent fleet``'s pure parts: one node's state, the pool report, the text and JSON, the
ledger and policy read the way the agents read them, and the command's import cost."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.cli import _plugin_argv
from node_agent.commands import fleet
from node_agent.commands.fleet import (
    ConditionFact,
    EventFact,
    LedgerFacts,
    NodeFacts,
    SlotFact,
    classify,
    read_ledger,
    read_policy,
    summarize,
)
from node_agent.controllers.osc import pacing
from node_agent.kube import report

NOW = 1_800_000_000.0
NEW = "a" * 64
OLD = "b" * 64


def node(**changes: Any) -> NodeFacts:
    base = NodeFacts(name="n1", pool="p", applied=OLD, lease_renewed=NOW - 5)
    return NodeFacts(**{**base.__dict__, **changes})


def test_wire_names_are_the_agents() -> None:
    """The view reads the agents' own constants; the reason sets it judges by are theirs."""
    assert {report.REASON_OSC_FAILED, report.REASON_OSC_INVALID} < fleet.FAILURE_EVENTS
    assert set(report.REASON_UNIT_COMMAND.values()) < fleet.FAILURE_EVENTS
    reasons = {pacing.REASON_SERIAL, pacing.REASON_SLOT, pacing.REASON_CANARIES}
    assert reasons | {pacing.REASON_BREAKER} == fleet.WAITING_REASONS
    # the heartbeat Lease as the Lease controller names and writes it
    from node_agent.controllers import lease

    assert fleet.LEASE_PREFIX == lease.LEASE_PREFIX
    assert NodeFacts("n", "p", None).lease_duration == lease.LEASE_DURATION_SECONDS


def test_the_units_fleet_names_are_those_the_condition_was_written_with() -> None:
    written = report.units_condition(
        ["kubelet.service: failed", "x@a:b.service: node-agent stopped restarting it after 5"], []
    )
    units = ConditionFact(written.status, written.reason, written.message, NOW)
    assert fleet.unit_problems(units) == (
        ("kubelet.service", "failed"),
        ("x@a:b.service", "node-agent stopped restarting it after 5"),
    )


def test_the_held_mark_is_what_the_restart_guard_writes() -> None:
    from node_agent.apply.restart_guard import HeldUnit

    held = HeldUnit("x.service", 5, 600.0, NOW, "exit 1")
    assert fleet.HELD_MARK in held.reason()


@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["h1", "h2", "h3", "h4"]),
            st.sampled_from(["decide", "ok", "fail"]),
            st.floats(0, 400),
        ),
        max_size=25,
    ),
    k=st.integers(1, 3),
    canaries=st.integers(0, 2),
    look=st.floats(0, 2000),
)
@settings(max_examples=200, deadline=None)
def test_ledger_reads_as_the_agents_read_it(
    steps: list[tuple[str, str, float]], k: int, canaries: int, look: float
) -> None:
    """Whatever a pool wrote, fleet sees the holders, canaries, healthy and failed nodes that
    pacing's ``current`` sees at the same moment (expired slots freed, lost holders failed)."""
    policy = pacing.Pacing(k, canaries, 60.0, 2, 300.0)
    ledger, now = pacing.Ledger(), NOW
    for host, action, dt in steps:
        now += dt
        if action == "decide":
            ledger = pacing.decide(policy, ledger, host, NEW, now).ledger
        else:
            ledger = pacing.finish(ledger, host, NEW, now, ok=action == "ok", why="boom")
    text = ledger.dump()
    at = now + look
    theirs = pacing.current(pacing.Ledger.load(text), ledger.checksum, at)
    ours = read_ledger(text, at)
    assert ours.checksum == theirs.checksum
    assert ours.holders() == theirs.holders()
    assert ours.canaries == theirs.canaries
    assert dict(ours.healthy) == dict(theirs.healthy)
    assert dict(ours.failed) == dict(theirs.failed)
    for slot in theirs.slots:
        mine = next(s for s in ours.slots if s.host == slot.host)
        assert mine.canary == slot.canary
        assert mine.expires_in == pytest.approx(slot.renewed + slot.ttl - at)


@pytest.mark.parametrize("text", [None, "", "{", "[]", '{"slots": [{"host": 1}]}', '"x"'])
def test_an_unreadable_ledger_is_empty_for_both(text: str | None) -> None:
    assert pacing.Ledger.load(text) == pacing.Ledger()
    assert read_ledger(text, NOW) == LedgerFacts()


@pytest.mark.parametrize(
    "annotations",
    [
        {},
        {pacing.ANNOTATION_MAX_PARALLEL: "3"},
        {
            pacing.ANNOTATION_MAX_PARALLEL: "3",
            pacing.ANNOTATION_CANARIES: "2",
            pacing.ANNOTATION_SOAK: "90s",
            pacing.ANNOTATION_MAX_FAILURES: "4",
        },
        {
            pacing.ANNOTATION_MAX_PARALLEL: "many",
            pacing.ANNOTATION_CANARIES: "-1",
            pacing.ANNOTATION_SOAK: "soon",
            pacing.ANNOTATION_MAX_FAILURES: "0",
        },
        {pacing.ANNOTATION_MAX_PARALLEL: " 2 ", pacing.ANNOTATION_SOAK: ""},
        {report.ANNOTATION_SERIAL: "true"},
        {report.ANNOTATION_SERIAL: "true", pacing.ANNOTATION_MAX_PARALLEL: "1"},
    ],
)
def test_policy_reads_as_the_agents_read_it(annotations: Mapping[str, str]) -> None:
    assert read_policy(annotations) == pacing.parse_policy(annotations)


# -- one node's state ------------------------------------------------------------------------------


def rollout(status: str, reason: str, message: str, since: float = NOW - 30) -> ConditionFact:
    return ConditionFact(status, reason, message, since)


def test_up_to_date() -> None:
    assert classify(node(applied=NEW), NEW, None, NOW).state == "up-to-date"


def test_not_reporting_wins_over_everything_it_last_said() -> None:
    gone = node(applied=NEW, lease_renewed=NOW - 41)
    verdict = classify(gone, NEW, None, NOW)
    assert verdict.state == "not-reporting"
    assert "41s ago" in verdict.detail
    assert classify(node(lease_renewed=None), NEW, None, NOW).detail == "no heartbeat Lease"
    assert classify(node(lease_renewed=NOW - 40), NEW, None, NOW).state == "applying"


def test_no_secret_is_unknown() -> None:
    assert classify(node(), None, None, NOW).state == "unknown"


def test_waiting_in_the_pools_queue() -> None:
    for reason in sorted(fleet.WAITING_REASONS):
        cond = rollout("False", reason, "all 2 rollout slot(s) are taken")
        verdict = classify(node(rollout=cond), NEW, None, NOW)
        assert verdict.state == "waiting"
        assert verdict.detail.startswith(reason)


def test_a_slot_in_the_ledger_is_fresher_than_a_waiting_condition() -> None:
    """A node writes the ledger the moment it takes its slot and its condition after: a
    waiting condition beside a slot of the node's own is already stale."""
    ledger = LedgerFacts(NEW, (SlotFact("n1", NEW, 300, False),))
    cond = rollout("False", "WaitingForSlot", "all 1 rollout slot(s) are taken")
    assert classify(node(rollout=cond), NEW, ledger, NOW) == fleet.Verdict(
        "applying", "holds a rollout slot"
    )


def test_applying_holds_a_slot_or_says_so() -> None:
    ledger = LedgerFacts(NEW, (SlotFact("n1", NEW, 300, False),))
    assert classify(node(), NEW, ledger, NOW).detail == "holds a rollout slot"
    cond = rollout("True", "RolloutApplying", f"applying OSC {NEW[:12]}")
    assert classify(node(rollout=cond), NEW, None, NOW) == fleet.Verdict(
        "applying", f"applying OSC {NEW[:12]}"
    )
    assert classify(node(applied=None), NEW, None, NOW).state == "applying"


def test_rolled_back_while_recent_then_quarantined() -> None:
    message = f"OSC {NEW[:12]} rolled back to {OLD[:12]}: kubelet.service failed"
    recent = EventFact("OSCRolledBack", "Warning", message, NOW - 60)
    assert classify(node(events=(recent,)), NEW, None, NOW).state == "rolled-back"
    older = EventFact("OSCRolledBack", "Warning", message, NOW - fleet.RECENT_ROLLBACK - 1)
    assert classify(node(events=(older,)), NEW, None, NOW).state == "quarantined"
    # a rollback of another checksum says nothing about this one
    other = EventFact("OSCRolledBack", "Warning", message.replace(NEW[:12], "c" * 12), NOW)
    assert classify(node(events=(other,)), NEW, None, NOW).state == "applying"


def test_rollback_from_the_condition_and_from_the_ledger() -> None:
    cond = rollout("False", "RolloutFailed", f"OSC {NEW[:12]} failed: rolled back: x", NOW - 5)
    assert classify(node(rollout=cond), NEW, None, NOW).state == "rolled-back"
    ledger = LedgerFacts(NEW, failed={"n1": "rolled back: kubelet.service exited"})
    verdict = classify(node(), NEW, ledger, NOW)
    assert verdict == fleet.Verdict("quarantined", "rolled back: kubelet.service exited")


def test_failed_from_the_condition_the_ledger_or_the_latest_event() -> None:
    cond = rollout("False", "RolloutFailed", f"OSC {NEW[:12]} failed: ApplyError: x")
    assert classify(node(rollout=cond), NEW, None, NOW).state == "failed"
    stale = rollout("False", "RolloutFailed", f"OSC {OLD[:12]} failed: ApplyError: x")
    assert classify(node(rollout=stale), NEW, None, NOW).state == "applying"
    lost = LedgerFacts(NEW, failed={"n1": pacing.LOST})
    assert classify(node(), NEW, lost, NOW) == fleet.Verdict("failed", pacing.LOST)
    failed = EventFact("OSCApplyFailed", "Warning", "KubeError: boom", NOW - 10)
    applied = EventFact("OSCApplied", "Normal", "OSC applied", NOW - 5)
    assert classify(node(events=(failed,)), NEW, None, NOW).state == "failed"
    assert classify(node(events=(failed, applied)), NEW, None, NOW).state == "applying"
    # a failure from before the Secret last changed is about an older OSC
    moot = classify(node(events=(failed,)), NEW, None, NOW, secret_changed=NOW - 1)
    assert moot.state == "applying"
    normal = EventFact("SystemDUnitRestart", "Normal", "kubelet.service restarted", NOW)
    assert classify(node(events=(normal,)), NEW, None, NOW).state == "applying"


def test_unit_problems_name_the_units() -> None:
    units = ConditionFact(
        "False",
        "UnhealthyUnits",
        "kubelet.service: failed (exit-code); x.service: node-agent stopped restarting it after",
        NOW,
    )
    assert [u for u, _ in fleet.unit_problems(units)] == ["kubelet.service", "x.service"]
    healthy = ConditionFact("True", "AllUnitsHealthy", "All systemd units ...: fine", NOW)
    assert fleet.unit_problems(healthy) == ()


# -- the pool report ------------------------------------------------------------------------------


def t(at: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def node_obj(
    name: str,
    applied: str | None,
    *,
    pool: str = "p",
    conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    annotations = {report.ANNOTATION_APPLIED_CHECKSUM: applied} if applied else {}
    return {
        "metadata": {
            "name": name,
            "labels": {fleet.LABEL_POOL: pool, report.LABEL_KUBERNETES_VERSION: "1.33.1"},
            "annotations": annotations,
        },
        "status": {"conditions": conditions or [], "nodeInfo": {"kubeletVersion": "v1.33.1"}},
    }


def lease_obj(name: str, renewed: float, annotations: dict[str, str] | None = None) -> Any:
    return {
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": t(renewed)},
    }


def pool_objects() -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    ledger = pacing.Ledger(
        checksum=NEW,
        slots=(pacing.Slot("n2", NEW, NOW - 10, 600.0, canary=True),),
        canaries=("n2",),
        failed={"n4": "rolled back: kubelet.service exited"},
    )
    secret = {
        "metadata": {
            "name": "gardener-node-agent-p-0123456789abcdef",
            "labels": {fleet.LABEL_POOL: "p", fleet.LABEL_ROLE: fleet.ROLE_OSC},
            "annotations": {
                report.ANNOTATION_SECRET_CHECKSUM: NEW,
                pacing.ANNOTATION_MAX_PARALLEL: "1",
                pacing.ANNOTATION_CANARIES: "1",
                pacing.ANNOTATION_MAX_FAILURES: "1",
            },
        }
    }
    unhealthy = {
        "type": "SystemdUnitsReady",
        "status": "False",
        "reason": "UnhealthyUnits",
        "message": "foo.service: node-agent stopped restarting it after 5 failed restarts",
    }
    waiting = {
        "type": "OSCRollout",
        "status": "False",
        "reason": "CircuitBreakerOpen",
        "message": "circuit breaker open",
    }
    nodes = [
        node_obj("n1", NEW, conditions=[unhealthy]),
        node_obj("n2", OLD),
        node_obj("n3", OLD, conditions=[waiting]),
        node_obj("n4", OLD),
        node_obj("n5", OLD),
        {"metadata": {"name": "not-an-agent-node"}},
    ]
    leases = [
        lease_obj("gardener-node-agent-n1", NOW - 3),
        lease_obj("gardener-node-agent-n2", NOW - 3),
        lease_obj("gardener-node-agent-n3", NOW - 3),
        lease_obj("gardener-node-agent-n4", NOW - 3),
        lease_obj("gardener-node-agent-n5", NOW - 300),
        lease_obj(
            "gardener-node-agent-p-0123456789abcdef",
            NOW,
            {pacing.ANNOTATION_LEDGER: ledger.dump()},
        ),
    ]
    events = [
        {
            "involvedObject": {"kind": "Node", "name": "n1"},
            "reason": "OSCApplied",
            "type": "Normal",
            "message": "applied",
            "lastTimestamp": t(NOW - 100),
        }
    ]
    return nodes, [secret], leases, events


def test_summary_of_a_pool() -> None:
    nodes, secrets, leases, events = pool_objects()
    result = summarize(nodes, secrets, leases, events, NOW)
    (pool,) = result.pools
    assert pool.name == "p"
    assert {n.name: n.state for n in pool.nodes} == {
        "n1": "up-to-date",
        "n2": "applying",
        "n3": "waiting",
        "n4": "quarantined",
        "n5": "not-reporting",
    }
    assert pool.applied == {OLD: 4, NEW: 1}
    assert pool.breaker() == (True, "1/1 failures: n4: rolled back: kubelet.service exited")
    assert pool.held_units == {"foo.service": ("n1",)}
    assert pool.leases == {"fresh": 4, "stale": 1, "missing": 0, "oldestRenewalSeconds": 300.0}
    assert pool.kubernetes_versions == {"1.33.1": 5}
    assert not result.done

    doc = json.loads(fleet.dump(result, "json"))
    (pd,) = doc["pools"]
    assert pd["states"]["up-to-date"] == 1
    assert pd["rollout"]["ledger"]["slots"][0]["host"] == "n2"
    assert pd["rollout"]["ledger"]["slots"][0]["canary"] is True
    assert pd["rollout"]["breakerOpen"] is True
    assert pd["unitsNotReady"]["units"] == {"foo.service": 1}

    text = fleet.render(result)
    assert "pool p: OSC Secret gardener-node-agent-p-0123456789abcdef (aaaaaaaaaaaa)" in text
    assert "[########................................] 1/5 up to date (20%)" in text
    assert "breaker OPEN: 1/1 failures" in text
    assert "slots 1/1: n2 (canary) 9m50s left" in text
    assert "restart-storm guard holds foo.service on 1: n1" in text
    assert "Leases: 4 fresh, 1 lapsed, 0 missing; oldest renewal 5m00s ago" in text
    assert "    n4  quarantined         rolled back: kubelet.service exited" in text


def test_a_node_follows_the_secret_its_label_names() -> None:
    nodes, secrets, leases, events = pool_objects()
    older = json.loads(json.dumps(secrets[0]))
    older["metadata"]["name"] = "gardener-node-agent-p-old"
    older["metadata"]["annotations"][report.ANNOTATION_SECRET_CHECKSUM] = OLD
    older["metadata"]["creationTimestamp"] = t(NOW - 9999)
    secrets[0]["metadata"]["creationTimestamp"] = t(NOW - 10)
    nodes[1]["metadata"]["labels"][report.LABEL_SECRET_NAME] = "gardener-node-agent-p-old"
    (pool,) = summarize(nodes, [secrets[0], older], leases, events, NOW).pools
    assert pool.desired == NEW  # the newest Secret is the pool's
    assert next(n for n in pool.nodes if n.name == "n2").state == "up-to-date"


def test_pools_filter_and_empty() -> None:
    nodes, secrets, leases, events = pool_objects()
    (asked,) = summarize(nodes, secrets, leases, events, NOW, pools=["q"]).pools
    assert (asked.name, asked.nodes, asked.secrets) == ("q", (), ())  # named: shown empty
    assert "pool q: OSC Secret none found" in fleet.render(
        summarize(nodes, secrets, leases, events, NOW, pools=["q"])
    )
    assert "no node-agent pools found" in fleet.render(summarize([], [], [], [], NOW))


def test_progress_bar() -> None:
    assert fleet.progress_bar(0, 0, width=4) == "[....] 0/0 up to date (100%)"
    assert fleet.progress_bar(1, 4, width=4) == "[#...] 1/4 up to date (25%)"


def test_kubectl_plugin_by_name_runs_fleet(tmp_path: Path) -> None:
    """Installed (or symlinked, as in the artifact) as ``kubectl-node_agent``, the program is
    the fleet view: kubectl passes only the arguments after ``kubectl node-agent``."""
    plugin = tmp_path / "kubectl-node_agent"
    plugin.write_text(
        f"#!{sys.executable}\nimport sys\nfrom node_agent.cli import main\nsys.exit(main())\n"
    )
    plugin.chmod(0o755)
    out = subprocess.run([str(plugin), "--help"], capture_output=True, text=True, check=True)
    assert "usage: kubectl-node_agent fleet [-h] [--kubeconfig KUBECONFIG]" in out.stdout
    missing = subprocess.run(
        [str(plugin), "--kubeconfig", str(tmp_path / "none")], capture_output=True, text=True
    )
    assert missing.returncode == 1
    assert missing.stderr.startswith("kubectl-node_agent: kubeconfig ")
    assert "not found" in missing.stderr


def test_kubectl_plugin_means_fleet() -> None:
    assert _plugin_argv([]) == ["fleet"]
    assert _plugin_argv(["--pool", "a", "-o", "json"]) == ["fleet", "--pool", "a", "-o", "json"]
    assert _plugin_argv(["fleet", "-w"]) == ["fleet", "-w"]
    assert _plugin_argv(["--help"]) == ["fleet", "--help"]
    assert _plugin_argv(["--version"]) == ["--version"]


def test_kubeconfig_lookup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KUBECONFIG", f":{tmp_path}/a:{tmp_path}/b")
    assert fleet.kubeconfig_path(None) == tmp_path / "a"
    assert fleet.kubeconfig_path("x") == Path("x")
    monkeypatch.delenv("KUBECONFIG")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert fleet.kubeconfig_path(None) == tmp_path / ".kube" / "config"


def test_the_fleet_command_imports_no_daemon_part() -> None:
    """``node-agent fleet`` loads the lean kube client and the fleet module, nothing the
    daemon needs (pydantic config, structlog, systemd, controllers, the agent)."""
    probe = (
        "import sys, node_agent.cli, node_agent.commands.fleet, node_agent.kube.client\n"
        "print(' '.join(sorted(m for m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded = set(out.stdout.split())
    heavy = {"pydantic", "structlog", "pystemd", "prometheus_client", "cryptography"}
    assert not {m.split(".")[0] for m in loaded} & heavy
    ours = {m for m in loaded if m.startswith("node_agent.")}
    # the rollout's pure ledger rules are shared with the agents (read the same way); nothing
    # else of the controllers or the read side is loaded
    shared = {
        "node_agent.controllers",
        "node_agent.controllers.osc",
        "node_agent.controllers.osc.pacing",
        "node_agent.observe",
        "node_agent.commands.fleet",
    }
    assert not {
        m
        for m in ours - shared
        if m.startswith(("node_agent.controllers", "node_agent.systemd", "node_agent.observe"))
        or m in ("node_agent.agent", "node_agent.config", "node_agent.context")
    }
    assert "kubernetes_asyncio.client.api.core_v1_api" not in loaded  # the lean client


def test_serial_holder_only_in_serial_mode_and_while_held() -> None:
    nodes, secrets, leases, events = pool_objects()
    pool_lease = leases[-1]
    pool_lease["spec"]["holderIdentity"] = "n2"
    (paced,) = summarize(nodes, secrets, leases, events, NOW).pools
    assert paced.serial_holder is None  # a paced pool's Lease spec means nothing
    secrets[0]["metadata"]["annotations"][report.ANNOTATION_SERIAL] = "true"
    (serial,) = summarize(nodes, secrets, leases, events, NOW).pools
    assert serial.serial_holder == "n2"
    assert "serial Lease held by n2" in fleet.render(summarize(nodes, secrets, leases, events, NOW))
    (lapsed,) = summarize(nodes, secrets, leases, events, NOW + 41).pools
    assert lapsed.serial_holder is None


# -- what the cluster wrote, shown safely ---------------------------------------------------------

#: terminal controls any agent (or anyone who can write a Node, Lease or Event) may put in a
#: string: CSI (7- and 8-bit), OSC (title, hyperlink; ended by BEL and by ST), C1 controls,
#: carriage return, backspace, a bidi override and NUL
CONTROLS = "\x1b[31m\x9b2J\x1b]0;owned\x07\x1b]8;;http://e\x1b\\\x85\x9d\r\x08\u202e\x00"


def hostile(tag: str) -> str:
    return f"{tag}{CONTROLS}end"


#: checksums are shown by their first 12 characters: controls there
HOSTILE_DESIRED = "\x1b[2J\x1b]0;t\x07\x9b\x85" + "d" * 52
HOSTILE_APPLIED = "\x9b31m\x1b]8;;\x1b\\\x85\x00" + "e" * 52


def hostile_pool() -> tuple[list[Any], list[Any], list[Any], list[Any], dict[str, str]]:
    """A pool whose every printed string carries controls; returns the objects and the raw
    value of each printed field by name."""
    fields = {
        name: hostile(name)
        for name in (
            "pool",
            "secret",
            "node",
            "kubernetes",
            "kubelet",
            "rollout_message",
            "unit",
            "unit_message",
            "event_message",
            "holder",
            "slot_host",
            "canary",
            "failed_host",
            "failed_why",
            "ledger_checksum",
        )
    }
    fields["desired"] = HOSTILE_DESIRED
    fields["applied"] = HOSTILE_APPLIED
    pool = fields["pool"]
    ledger = pacing.Ledger(
        checksum=fields["ledger_checksum"],
        slots=(pacing.Slot(fields["slot_host"], NEW, NOW - 10, 600.0, canary=True),),
        canaries=(fields["slot_host"], fields["canary"]),
        healthy={fields["canary"]: NOW - 5},
        failed={fields["failed_host"]: fields["failed_why"]},
    )
    secret = {
        "metadata": {
            "name": fields["secret"],
            "labels": {fleet.LABEL_POOL: pool, fleet.LABEL_ROLE: fleet.ROLE_OSC},
            "annotations": {
                report.ANNOTATION_SECRET_CHECKSUM: HOSTILE_DESIRED,
                report.ANNOTATION_SERIAL: "true",
                pacing.ANNOTATION_MAX_PARALLEL: "1",
            },
        }
    }
    units = {
        "type": "SystemdUnitsReady",
        "status": "False",
        "reason": "UnhealthyUnits",
        "message": f"{fields['unit']}: {fields['unit_message']}",
    }
    waiting = {
        "type": "OSCRollout",
        "status": "False",
        "reason": "WaitingForSlot",
        "message": fields["rollout_message"],
    }
    first = node_obj(fields["node"], HOSTILE_APPLIED, pool=pool, conditions=[units, waiting])
    first["metadata"]["labels"][report.LABEL_KUBERNETES_VERSION] = fields["kubernetes"]
    first["status"]["nodeInfo"]["kubeletVersion"] = fields["kubelet"]
    failing = node_obj("n2", HOSTILE_APPLIED, pool=pool)
    pool_lease = lease_obj(fields["secret"], NOW, {pacing.ANNOTATION_LEDGER: ledger.dump()})
    pool_lease["spec"]["holderIdentity"] = fields["holder"]
    leases = [
        lease_obj(f"gardener-node-agent-{fields['node']}", NOW - 3),
        lease_obj("gardener-node-agent-n2", NOW - 3),
        pool_lease,
    ]
    events = [
        {
            "involvedObject": {"kind": "Node", "name": "n2"},
            "reason": report.REASON_OSC_FAILED,
            "type": "Warning",
            "message": fields["event_message"],
            "lastTimestamp": t(NOW - 1),
        }
    ]
    return [first, failing], [secret], leases, events, fields


def raw_controls(text: str) -> list[str]:
    import unicodedata

    return sorted({ch for ch in text if ch != "\n" and unicodedata.category(ch) in ("Cc", "Cf")})


def test_the_text_view_shows_every_string_of_the_cluster_escaped() -> None:
    """Nodes, Leases and Events are written by every node's agent: no control character of
    theirs reaches the terminal; each field is shown, escaped as ``status`` escapes."""
    from node_agent.base.text import escape_controls

    nodes, secrets, leases, events, fields = hostile_pool()
    text = fleet.render(summarize(nodes, secrets, leases, events, NOW))
    assert raw_controls(text) == []
    shown = {
        name: value[:12] if name in ("desired", "applied", "ledger_checksum") else value
        for name, value in fields.items()
    }
    missing = [name for name, value in shown.items() if escape_controls(value) not in text]
    assert missing == []


def test_json_and_yaml_carry_the_clusters_strings_exactly() -> None:
    import yaml

    nodes, secrets, leases, events, fields = hostile_pool()
    result = summarize(nodes, secrets, leases, events, NOW)
    text = fleet.dump(result, "json")
    assert text == json.dumps(fleet.to_document(result), indent=2) + "\n"
    for doc in (json.loads(text), yaml.safe_load(fleet.dump(result, "yaml"))):
        (pool,) = doc["pools"]
        rollout = pool["rollout"]
        assert pool["name"] == fields["pool"]
        assert pool["secrets"] == [{"name": fields["secret"], "checksum": HOSTILE_DESIRED}]
        assert pool["applied"] == {HOSTILE_APPLIED: 2}
        assert rollout["serialHolder"] == fields["holder"]
        assert rollout["ledger"]["slots"][0]["host"] == fields["slot_host"]
        assert rollout["ledger"]["canaries"] == [fields["slot_host"], fields["canary"]]
        assert rollout["ledger"]["failed"] == {fields["failed_host"]: fields["failed_why"]}
        assert pool["unitsNotReady"]["nodes"] == [
            {
                "name": fields["node"],
                "units": [{"unit": fields["unit"], "message": fields["unit_message"]}],
            }
        ]
        assert pool["versions"] == {
            "kubernetes": {fields["kubernetes"]: 1, "1.33.1": 1},
            "kubelet": {fields["kubelet"]: 1, "v1.33.1": 1},
        }
        details = {n["name"]: n["detail"] for n in pool["nodeStates"]}
        assert details == {
            fields["node"]: f"WaitingForSlot: {fields['rollout_message']}",
            "n2": f"{report.REASON_OSC_FAILED}: {fields['event_message']}",
        }


# -- one reader of the rollout's wire rules, the agents' -----------------------------------------

ROLLOUT_KEYS = (
    pacing.ANNOTATION_MAX_PARALLEL,
    pacing.ANNOTATION_CANARIES,
    pacing.ANNOTATION_SOAK,
    pacing.ANNOTATION_MAX_FAILURES,
    pacing.ANNOTATION_SLOT_TTL,
)
annotation_values = st.one_of(
    st.integers(-3, 10**6).map(str),
    st.builds(
        lambda n, unit: f"{n}{unit}",
        st.integers(-5, 10**7),
        st.sampled_from(["s", "m", "h", "ms", "ns", "us", "d", ""]),
    ),
    st.sampled_from(["1000h", "24h0m1s", "0s", "-1s", " 2 ", "", "1e3", "١٢", "soon", "1h30m"]),
    st.text(max_size=12),
)


def policy_pool(annotations: Mapping[str, str], lease_spec: Mapping[str, Any] | None = None) -> Any:
    nodes, secrets, leases, events = pool_objects()
    secrets[0]["metadata"]["annotations"] = {report.ANNOTATION_SECRET_CHECKSUM: NEW, **annotations}
    if lease_spec is not None:
        leases[-1]["spec"] = dict(lease_spec)
    return summarize(nodes, secrets, leases, events, NOW)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.sampled_from(ROLLOUT_KEYS), annotation_values, max_size=5),
    st.sampled_from([None, "true", "false", "True"]),
)
def test_the_rollout_policy_shown_is_the_one_the_agents_follow(
    annotations: dict[str, str], serial: str | None
) -> None:
    """The agents cap, refuse and default the Secret's rollout annotations; the fleet view
    shows exactly what they follow (``rollout-canary-soak: 1000h`` is 86,400 s to them)."""
    if serial is not None:
        annotations[report.ANNOTATION_SERIAL] = serial
    theirs = pacing.parse_policy(annotations)
    result = policy_pool(annotations)
    (rollout,) = [p["rollout"] for p in fleet.to_document(result)["pools"]]
    text = fleet.render(result)
    if theirs.pacing is None:
        assert rollout["maxParallel"] is None
    else:
        assert rollout["maxParallel"] == theirs.pacing.max_parallel
        assert rollout["canaries"] == theirs.pacing.canaries
        assert rollout["maxFailures"] == theirs.pacing.max_failures
        assert theirs.pacing.describe() in rollout["policy"]
        assert theirs.pacing.describe() in text
    assert ("serial" in rollout["mode"]) == theirs.serial


def test_a_soak_above_the_agents_cap_is_shown_capped() -> None:
    annotations = {pacing.ANNOTATION_MAX_PARALLEL: "2", pacing.ANNOTATION_SOAK: "1000h"}
    text = fleet.render(policy_pool(annotations))
    assert f"(soak {pacing.MAX_SOAK:g}s)" in text
    assert "3.6e+06" not in text


def test_a_slot_without_a_readable_ttl_lives_as_long_as_the_agents_let_it() -> None:
    """A slot whose ttl cannot be read lives the pool's ``rollout-slot-ttl`` (the agents'
    ``current``), not a default of the view's own."""
    nodes, secrets, leases, events = pool_objects()
    secrets[0]["metadata"]["annotations"][pacing.ANNOTATION_SLOT_TTL] = "120s"
    doc = json.loads(pacing.Ledger(checksum=NEW).dump())
    doc["slots"] = [{"host": "n2", "checksum": NEW, "renewed": NOW - 10, "ttl": "x"}]
    leases[-1]["metadata"]["annotations"][pacing.ANNOTATION_LEDGER] = json.dumps(doc)
    (pool,) = summarize(nodes, secrets, leases, events, NOW).pools
    assert pool.ledger is not None
    (slot,) = pool.ledger.slots
    assert slot.expires_in == pytest.approx(110.0)


@pytest.mark.parametrize(
    "spec",
    [
        # renewed 700 s ago for a billion seconds: the agents bound a holder by the pool's 600 s
        {"holderIdentity": "n2", "leaseDurationSeconds": 10**9, "renewTime": t(NOW - 700)},
        # a boolean is no duration to the agents
        {"holderIdentity": "n2", "leaseDurationSeconds": True, "renewTime": t(NOW)},
    ],
)
def test_the_serial_holder_is_the_one_the_agents_wait_for(spec: dict[str, Any]) -> None:
    annotations = {report.ANNOTATION_SERIAL: "true"}
    step = pacing.serial_step(spec, "another-node", NOW, pacing.SERIAL_LEASE_SECONDS)
    assert step.action == "acquire"  # the agents take the Lease: nobody holds it
    (pool,) = policy_pool(annotations, spec).pools
    assert pool.serial_holder is None


# -- whatever the lists hold ----------------------------------------------------------------------

FIELDS = [
    "metadata",
    "name",
    "labels",
    "annotations",
    "spec",
    "status",
    "conditions",
    "type",
    "reason",
    "message",
    "lastTransitionTime",
    "holderIdentity",
    "renewTime",
    "acquireTime",
    "leaseDurationSeconds",
    "nodeInfo",
    "kubeletVersion",
    "involvedObject",
    "kind",
    "lastTimestamp",
    "managedFields",
    "time",
    "creationTimestamp",
    fleet.LABEL_POOL,
    report.ANNOTATION_APPLIED_CHECKSUM,
    report.ANNOTATION_SECRET_CHECKSUM,
    report.ANNOTATION_SERIAL,
    pacing.ANNOTATION_LEDGER,
    pacing.ANNOTATION_MAX_PARALLEL,
    pacing.ANNOTATION_SOAK,
]
json_values: st.SearchStrategy[Any] = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(),
        st.text(max_size=12),
        st.sampled_from(["true", "p", "Node", "9999-12-31T23:59:59Z", "2026-01-01T00:00:00Z"]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(FIELDS), inner, max_size=4)
    ),
    max_leaves=20,
)
api_objects = st.lists(
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=4), max_size=3
)


@settings(max_examples=300, deadline=None)
@given(api_objects, api_objects, api_objects, api_objects)
def test_any_listed_objects_make_a_report(
    nodes: list[dict[str, Any]],
    secrets: list[dict[str, Any]],
    leases: list[dict[str, Any]],
    events: list[dict[str, Any]],
) -> None:
    """Objects of any shape (a field of another type, a label that is not a string) read as
    unset where they are not what the API writes: the view is made, never a crash."""
    result = summarize(nodes, secrets, leases, events, NOW)
    assert raw_controls(fleet.render(result)) == []
    json.loads(fleet.dump(result, "json"))
