"""The wire names and shapes the agent reports on its Node."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from node_agent.kube import report


def test_applied_patch_sets_checksum_version_role_and_zone() -> None:
    patch = report.applied_patch(
        checksum="abc",
        kubernetes_version="1.31.4",
        control_plane=False,
        zone="eu-1a",
    )
    assert patch == {
        "metadata": {
            "annotations": {"checksum/cloud-config-data": "abc"},
            "labels": {
                "worker.gardener.cloud/kubernetes-version": "1.31.4",
                "node-role.kubernetes.io/worker": "",
                "node-role.kubernetes.io/control-plane": None,
                "topology.kubernetes.io/zone": "eu-1a",
            },
        }
    }


def test_control_plane_role_without_version_or_zone() -> None:
    patch = report.applied_patch(
        checksum="x", kubernetes_version=None, control_plane=True, zone=None
    )
    assert patch["metadata"]["labels"] == {
        "node-role.kubernetes.io/control-plane": "",
        "node-role.kubernetes.io/worker": None,  # a no-op on a Node without it: no read needed
    }


def test_version_label_patch_only_when_the_label_differs() -> None:
    label = "worker.gardener.cloud/kubernetes-version"
    assert report.version_label_patch("1.31.4", {label: "1.31.3", "x": "y"}) == {
        "metadata": {"labels": {label: "1.31.4"}}
    }
    assert report.version_label_patch("1.31.4", {}) == {"metadata": {"labels": {label: "1.31.4"}}}
    assert report.version_label_patch("1.31.4", {label: "1.31.4"}) is None
    assert report.version_label_patch(None, {label: "1.31.3"}) is None  # no version configured


def test_units_condition_states() -> None:
    assert report.units_condition({"a.service": "failed"}, {}).status == "False"
    assert report.units_condition({"a.service": "failed"}, {}).reason == "UnhealthyUnits"
    progressing = report.units_condition({}, {"b.service": "activating"})
    assert (progressing.status, progressing.reason) == ("True", "ProgressingUnits")
    healthy = report.units_condition({}, {})
    assert (healthy.status, healthy.reason) == ("True", "AllUnitsHealthy")


def test_condition_keeps_transition_time_while_status_is_unchanged() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    healthy = report.units_condition({}, {})
    first = report.condition_entry(healthy, None, t0)
    assert first["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    later = report.condition_entry(healthy, first, t0 + timedelta(minutes=1))
    assert later["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert later["lastHeartbeatTime"] == "2026-01-01T00:01:00Z"
    failed = report.condition_entry(
        report.units_condition({"x.service": "failed"}, {}), later, t0 + timedelta(minutes=2)
    )
    assert failed["lastTransitionTime"] == "2026-01-01T00:02:00Z"


def test_node_event_shape() -> None:
    at = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    event = report.node_event(
        node_name="n1", node_uid="u1", reason="OSCApplied", message="m", host="h", at=at
    )
    assert event["metadata"]["namespace"] == "default"
    assert event["metadata"]["name"].startswith("n1.")
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Node",
        "name": "n1",
        "uid": "u1",
    }
    assert event["source"] == {"component": "gardener-node-agent", "host": "h"}
    assert event["firstTimestamp"] == event["lastTimestamp"] == "2026-01-01T12:00:00Z"
    assert (
        report.node_event(node_name="n1", node_uid=None, reason="r", message="x" * 5000)["message"]
        == "x" * 256 + " [... 4040 bytes cut ...] " + "x" * 704
    )


def test_every_reason_the_agent_writes_is_in_the_operators_guide() -> None:
    """An operator looks a reason up in docs/operations.md: each Event and condition reason of
    ``kube/report.py`` (and the rollout's waiting reasons) is named there, in backquotes."""
    from node_agent.controllers.osc import pacing

    guide = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    reasons: set[str] = set()
    for name, value in vars(report).items():
        if name.startswith("REASON_"):
            reasons |= set(value.values()) if isinstance(value, dict) else {value}
    reasons |= {pacing.REASON_SERIAL, pacing.REASON_SLOT, pacing.REASON_CANARIES}
    reasons.add(pacing.REASON_BREAKER)
    assert len(reasons) > 25
    assert sorted(r for r in reasons if f"`{r}`" not in guide) == []
