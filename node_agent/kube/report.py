"""What the agent tells the cluster about its node: Node patches, conditions and Events.

Pure builders (no I/O) of the exact wire names Gardener uses, so that the controllers stay
short and the names are tested in one place.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from node_agent.base.text import head_and_tail

COMPONENT = "gardener-node-agent"
NAMESPACE = "kube-system"  # the OSC, token and Lease objects of node agents live here
EVENT_NAMESPACE = "default"  # Events about cluster-scoped objects (a Node) live here
EVENT_MESSAGE_LIMIT = 1024  # bytes of an Event's message: its head and its tail

ANNOTATION_APPLIED_CHECKSUM = "checksum/cloud-config-data"
ANNOTATION_SECRET_CHECKSUM = "checksum/data-script"
ANNOTATION_RESTART_SERVICES = "worker.gardener.cloud/restart-systemd-services"
ANNOTATION_RECONCILIATION_DELAY = "node-agent.gardener.cloud/reconciliation-delay"
ANNOTATION_SERIAL = "reconciliation.osc.node-agent.gardener.cloud/serial"
LABEL_KUBERNETES_VERSION = "worker.gardener.cloud/kubernetes-version"
LABEL_SECRET_NAME = "worker.gardener.cloud/gardener-node-agent-secret-name"
LABEL_HOSTNAME = "kubernetes.io/hostname"
LABEL_ROLE_WORKER = "node-role.kubernetes.io/worker"
LABEL_ROLE_CONTROL_PLANE = "node-role.kubernetes.io/control-plane"
LABEL_ZONE = "topology.kubernetes.io/zone"
CONTROL_PLANE_MARKER = "/etc/kubernetes/manifests/kube-apiserver.yaml"

CONDITION_UNITS_READY = "SystemdUnitsReady"
#: Our own: where this node stands in a serial or paced rollout of its pool (``rollout.py``)
CONDITION_ROLLOUT = "OSCRollout"
REASON_ROLLOUT_APPLYING = "RolloutApplying"
REASON_ROLLOUT_APPLIED = "RolloutApplied"
REASON_ROLLOUT_FAILED = "RolloutFailed"
#: the rollout ledger on that Lease could not be read as written (garbage, numbers out of range)
#: and was repaired: unreadable entries dropped, times and ttls bounded
REASON_ROLLOUT_LEDGER_REPAIRED = "RolloutLedgerRepaired"

REASON_OSC_APPLIED = "OSCApplied"
REASON_OSC_FAILED = "OSCApplyFailed"
REASON_OSC_INVALID = "OSCInvalid"
REASON_DRIFT_REPAIRED = "OSCDriftRepaired"
REASON_OSC_SKIPPED = "OSCItemsSkipped"
#: one of the agent's own state files was unusable (a directory, a FIFO, garbage) and set aside
REASON_STATE_SET_ASIDE = "StateFileSetAside"
# Our own (no upstream equivalent): the health gate rolled an update back; the restart-storm
# guard stopped restarting a unit.
REASON_OSC_ROLLED_BACK = "OSCRolledBack"
REASON_RESTARTS_SUSPENDED = "UnitRestartsSuspended"
# Our own: the unit check found a unit of the applied OSC unhealthy (SystemdUnitsReady says so).
REASON_UNIT_UNHEALTHY = "SystemdUnitUnhealthy"
#: Our own: a CertificateSigningRequest ended without a certificate the agent can use (denied,
#: not issued in time, or its certificate failed the checks); a new one follows after a backoff.
REASON_CERTIFICATE_REFUSED = "ClientCertificateRefused"
#: Our own: an updated agent binary was not ready after 3 starts in a row and the previous one
#: was put back (``host/selfupdate.py``).
REASON_SELF_UPDATE_FALLBACK = "SelfUpdateFellBack"
# bootstrap.kubeletDataVolumeSize is set but /var/lib/kubelet is not on that volume.
REASON_KUBELET_DATA_VOLUME = "KubeletDataVolumeNotMounted"
REASON_UNIT_COMMAND = {
    "start": "SystemDUnitStart",
    "stop": "SystemDUnitStop",
    "restart": "SystemDUnitRestart",
}

#: Health checks (``controllers/healthcheck.py``): upstream's Event reasons are the component's
#: name; a restart they trigger is reported with ``REASON_UNIT_COMMAND["restart"]`` as well.
REASON_HEALTH_KUBELET = "kubelet"
REASON_HEALTH_CONTAINERD = "containerd"
#: Node NotReady->Ready transitions that suggest a reboot, and the window they are counted in.
READY_TOGGLES_MAX = 5
READY_TOGGLES_WINDOW_SECONDS = 600.0

EventType = Literal["Normal", "Warning"]


def now() -> datetime:
    return datetime.now(UTC)


def rfc3339(moment: datetime) -> str:
    """RFC 3339 in UTC with an explicit offset, as the API server expects."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def applied_patch(
    *,
    checksum: str,
    kubernetes_version: str | None,
    control_plane: bool,
    zone: str | None,
) -> dict[str, Any]:
    """Merge patch written after a successful apply: checksum last-applied, version, roles.
    The other role's label is removed by a null whether or not the Node has it (a merge patch
    that removes a missing key changes nothing), so the patch needs no read of the Node."""
    labels: dict[str, str | None] = {}
    if kubernetes_version:
        labels[LABEL_KUBERNETES_VERSION] = kubernetes_version
    role, other = (
        (LABEL_ROLE_CONTROL_PLANE, LABEL_ROLE_WORKER)
        if control_plane
        else (LABEL_ROLE_WORKER, LABEL_ROLE_CONTROL_PLANE)
    )
    labels[role] = ""
    labels[other] = None
    if zone:
        labels[LABEL_ZONE] = zone
    return {
        "metadata": {
            "annotations": {ANNOTATION_APPLIED_CHECKSUM: checksum},
            "labels": labels,
        }
    }


def version_label_patch(
    kubernetes_version: str | None, current_labels: Mapping[str, str]
) -> dict[str, Any] | None:
    """Merge patch that brings the version label to the config's ``kubernetesVersion``, or
    None when the Node already carries it (or the config names no version)."""
    if not kubernetes_version or current_labels.get(LABEL_KUBERNETES_VERSION) == kubernetes_version:
        return None
    return {"metadata": {"labels": {LABEL_KUBERNETES_VERSION: kubernetes_version}}}


def remove_annotation_patch(key: str) -> dict[str, Any]:
    return {"metadata": {"annotations": {key: None}}}


@dataclass(frozen=True)
class Condition:
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str


REASON_UNITS_HEALTHY = "AllUnitsHealthy"
REASON_UNITS_UNHEALTHY = "UnhealthyUnits"
REASON_UNITS_PROGRESSING = "ProgressingUnits"
MESSAGE_UNITS_HEALTHY = (
    "All systemd units from the operating system config are running as expected."
)


def units_condition(unhealthy: Collection[str], progressing: Collection[str]) -> Condition:
    """SystemdUnitsReady as upstream words it: ``False``/UnhealthyUnits when any unit is
    unhealthy, else ``True``/ProgressingUnits while any is on its way, else
    ``True``/AllUnitsHealthy. Messages (``"<unit>: <what>"``) are joined with ``"; "``."""
    if unhealthy:
        return Condition("False", REASON_UNITS_UNHEALTHY, "; ".join(unhealthy))
    if progressing:
        return Condition("True", REASON_UNITS_PROGRESSING, "; ".join(progressing))
    return Condition("True", REASON_UNITS_HEALTHY, MESSAGE_UNITS_HEALTHY)


def condition_entry(
    condition: Condition, existing: Mapping[str, Any] | None, at: datetime
) -> dict[str, Any]:
    """The Node condition entry; ``lastTransitionTime`` is kept while the status is unchanged."""
    transition = rfc3339(at)
    if existing is not None and existing.get("status") == condition.status:
        kept = existing.get("lastTransitionTime")
        transition = kept if isinstance(kept, str) else transition
    return {
        "type": CONDITION_UNITS_READY,
        "status": condition.status,
        "reason": condition.reason,
        "message": condition.message,
        "lastHeartbeatTime": rfc3339(at),
        "lastTransitionTime": transition,
    }


def node_event(
    *,
    node_name: str,
    node_uid: str | None,
    reason: str,
    message: str,
    event_type: EventType = "Normal",
    host: str | None = None,
    at: datetime | None = None,
) -> dict[str, Any]:
    """A core/v1 Event about the Node, in the shape ``kubectl describe node`` shows."""
    moment = rfc3339(at or now())
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{node_name}.{secrets.token_hex(8)}",
            "namespace": EVENT_NAMESPACE,
        },
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Node",
            "name": node_name,
            **({"uid": node_uid} if node_uid else {}),
        },
        "reason": reason,
        "message": head_and_tail(message, EVENT_MESSAGE_LIMIT),
        "type": event_type,
        "source": {"component": COMPONENT, **({"host": host} if host else {})},
        "firstTimestamp": moment,
        "lastTimestamp": moment,
        "count": 1,
        "reportingComponent": COMPONENT,
        "reportingInstance": host or node_name,
    }
