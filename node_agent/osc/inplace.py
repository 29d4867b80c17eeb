"""In-place updates of a node, the pure part: what an OSC change asks of the node beyond files and
units, and the wire names machine-controller-manager and gardenlet read the outcome by.

A pool with an in-place update strategy keeps its machines; Gardener puts the targets in the OSC
(``spec.inPlaceUpdates``: the OS version, the kubelet's version, the credentials rotations) and
the OS extension the command that updates the OS (``status.inPlaceUpdates.osUpdate``). Compared
with the OSC applied before, a change is one or more of (upstream's change file names them the
same way):

- ``operatingSystem``: the host's OS version (``PRETTY_NAME`` of ``/etc/os-release``, the way the
  kubelet reports it) is not the OSC's ``operatingSystemVersion``;
- ``kubelet.minorVersion``: the kubelet's minor version changed;
- ``kubelet.config``: eviction thresholds or reserved resources changed in the kubelet's config;
- ``kubelet.cpuManagerPolicy``: the CPU manager policy changed (its state file must go);
- ``certificateAuthoritiesRotation``: a CA rotation began (kubelet and agent re-bootstrap);
- ``serviceAccountKeyRotation``: a service account key rotation began (tokens synced again).

Everything here is a function of its arguments; the controller
(``node_agent.controllers.osc.inplace``) does the I/O.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import re
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict

from node_agent.base.errors import OSCDecodeError
from node_agent.base.text import head_and_tail
from node_agent.base.versions import VersionError, semver, shown
from node_agent.osc.decode import load_yaml
from node_agent.osc.models import KubeletUpdate, OperatingSystemConfig

# machine-controller-manager's names (pkg/apis/machine/v1alpha1)
CONDITION_IN_PLACE_UPDATE = "InPlaceUpdate"
REASON_READY_FOR_UPDATE = "ReadyForUpdate"
LABEL_UPDATE_RESULT = "node.machine.sapcloud.io/update-result"
RESULT_SUCCESSFUL = "successful"
RESULT_FAILED = "failed"
ANNOTATION_UPDATE_FAILED_REASON = "node.machine.sapcloud.io/update-failed-reason"
# gardener-node-agent's own mark of an OS update in flight
ANNOTATION_UPDATING_OS_VERSION = "node-agent.gardener.cloud/updating-operating-system-version"

OS_RELEASE = "/etc/os-release"
KUBELET_UNIT = "kubelet.service"
KUBELET_DIR = "/var/lib/kubelet"
KUBELET_CONFIG = f"{KUBELET_DIR}/config/kubelet"
CPU_MANAGER_STATE = f"{KUBELET_DIR}/cpu_manager_state"
KUBELET_PKI_DIR = f"{KUBELET_DIR}/pki"
KUBELET_CLIENT_CERT = f"{KUBELET_PKI_DIR}/kubelet-client-current.pem"
#: a client certificate and its key (PEM) are a few KiB; anything far larger is not one
MAX_KUBELET_CERT_BYTES = 64 * 1024
KUBELET_KUBECONFIG = f"{KUBELET_DIR}/kubeconfig-real"
KUBELET_BOOTSTRAP_KUBECONFIG = f"{KUBELET_DIR}/kubeconfig-bootstrap"

# upstream's retry rules for the OS update command: its combined output decides, by the
# regular expressions (?i)network problems and (?i)invalid arguments|system failure (matched as
# Go matches them, see CommandOutput.feed)
RETRIABLE = ("network problems",)
NON_RETRIABLE = ("invalid arguments", "system failure")
OS_UPDATE_RETRY_INTERVAL = 30.0
OS_UPDATE_RETRY_TIMEOUT = 300.0
KUBELET_HEALTH_RETRY_INTERVAL = 5.0
KUBELET_HEALTH_RETRY_TIMEOUT = 300.0

# the kubelet settings whose change makes an in-place update (Gardener's rolling-update
# triggers for in-place pools)
EVICTION_SIGNALS = (
    "memory.available",
    "imagefs.available",
    "imagefs.inodesFree",
    "nodefs.available",
    "nodefs.inodesFree",
)
RESERVED_RESOURCES = ("cpu", "memory", "ephemeral-storage", "pid")

# Go's \b and \d: ASCII only
_VERSION_IN_NAME = re.compile(r"\b\d+(?:\.\d+)*\b", re.ASCII)
_PRETTY_NAME = re.compile(r"(PRETTY_NAME)=(.*)")
_QUANTITY = re.compile(
    r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?$", re.ASCII
)

OutputKind = Literal["retriable", "non-retriable", "unknown"]

#: What is kept of the OS update command's output while it is read: its last 4 KiB (where a
#: command says why it failed); all of it is counted and searched for the retry patterns.
OUTPUT_KEPT = 4 << 10
#: The most ``update-failed-reason`` carries, in UTF-8 bytes. Kubernetes allows 256 KiB for all
#: of a Node's annotations together and refuses the patch past that (422); upstream puts the
#: whole output there, without a bound of its own. machine-controller-manager copies the reason
#: into the Node's ``InPlaceUpdate`` condition.
REASON_LIMIT = 8 << 10
#: The reason sent instead when the API server refused the Node patch with the real one
REASON_REFUSED = (
    "in-place update failed; its reason was refused by the API server ({error}): see the "
    "node's agent (node-agent status, its log)"
)


class InPlaceError(ValueError):
    """A version or kubelet config that cannot be compared (upstream fails the reconcile)."""


class InPlaceChanges(BaseModel):
    """What an OSC change asks of the node in place; persisted with the change set so a
    restart (the OS update's reboot, a kill) resumes it, each flag cleared when its step is
    done."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    operating_system: bool = False
    kubelet_minor_version: bool = False
    kubelet_config: bool = False
    cpu_manager_policy: bool = False
    ca_rotation_kubelet: bool = False
    ca_rotation_node_agent: bool = False
    sa_key_rotation: bool = False

    def any(self) -> bool:
        return any(self.model_dump().values())

    def kubelet(self) -> bool:
        """The kubelet restarts into a new minor version or config: its health is awaited."""
        return self.kubelet_minor_version or self.kubelet_config or self.cpu_manager_policy

    def names(self) -> tuple[str, ...]:
        """The pending parts, for logs, Events, ``plan`` and ``status``."""
        return tuple(name for name, on in self.model_dump().items() if on)


def normalize(version: str) -> str:
    """Upstream's normalisation: every ``v`` dropped, anything from ``-``, ``+`` or ``~`` cut."""
    plain = version.replace("v", "")
    cut = re.search(r"[-+~]", plain)
    return plain[: cut.start()] if cut else plain


def parse_version(version: str) -> tuple[int, int, int]:
    """A version of one to three dot-separated numbers of ASCII digits (missing parts are 0),
    as semver's lenient parser takes it after normalisation."""
    try:
        read = semver(normalize(version))
    except VersionError as exc:
        raise InPlaceError(f"invalid version {shown(version)}") from exc
    return read.major, read.minor, read.patch


def same_version(current: str, desired: str) -> bool:
    return parse_version(current) == parse_version(desired)


def minor_changed(old: str, new: str) -> bool:
    """Whether the minor version differs (upstream ignores the major here, as it does)."""
    return parse_version(old)[1] != parse_version(new)[1]


def os_version(os_release: str) -> str:
    """The OS version the way the kubelet and upstream read it: the first number-dot run in
    ``PRETTY_NAME`` (e.g. ``Garden Linux 1877.4`` -> ``1877.4``)."""
    match = _PRETTY_NAME.search(os_release)
    name = match.group(2).strip('"') if match else ""
    found = _VERSION_IN_NAME.search(name)
    if found is None:
        raise InPlaceError(f"no version in the OS name {name!r} of {OS_RELEASE}")
    return found.group(0)


def os_up_to_date(current: str | None, osc: OperatingSystemConfig) -> bool:
    spec = osc.spec.in_place_updates
    if spec is None:
        return True
    if current is None:
        raise InPlaceError("the current OS version is unknown")
    return same_version(current, spec.operating_system_version)


def read_kubelet_config(data: str | bytes) -> dict[str, Any]:
    """A kubelet config file's settings (empty when it is not a mapping), read as the OSC
    itself is (``load_yaml``: Go's reading of YAML, in time linear in its size, its nesting
    and aliases bounded). PyYAML's own loader is quadratic in the nesting of ``[[[...]]]``
    (a 6 KB file takes seconds) and ends a deeper one in ``RecursionError``. Whatever the file
    holds, only ``InPlaceError`` comes out."""
    raw = data.encode(errors="surrogateescape") if isinstance(data, str) else data
    try:
        doc = load_yaml(raw)
    except OSCDecodeError as exc:  # a limit; the loader names the OSC's document
        why = str(exc).replace("osc.yaml", "it", 1)
        raise InPlaceError(f"kubelet config {KUBELET_CONFIG} is refused: {why}") from exc
    except (ValueError, RecursionError, yaml.YAMLError) as exc:
        raise InPlaceError(f"kubelet config {KUBELET_CONFIG} is unreadable: {exc}") from exc
    return doc if isinstance(doc, dict) else {}


def kubelet_config(osc: OperatingSystemConfig) -> dict[str, Any]:
    """The kubelet's config from the OSC's file (``spec.files``, as upstream reads it)."""
    for file in osc.spec.files:
        if file.path != KUBELET_CONFIG or file.content.inline is None:
            continue
        inline = file.content.inline
        try:
            data = base64.b64decode(inline.data) if inline.encoding == "b64" else inline.data
        except (binascii.Error, ValueError) as exc:
            raise InPlaceError(f"kubelet config {KUBELET_CONFIG} is unreadable: {exc}") from exc
        return read_kubelet_config(data)
    raise InPlaceError(f"kubelet config file with path {KUBELET_CONFIG!r} not found in OSC")


def _scalar(value: object, field: str) -> str | None:
    """A setting's value as text; a list or mapping is refused (upstream's typed decode refuses
    it too), and never turned into text: YAML aliases make a small file hold billions of
    values."""
    if value is None:
        return None
    if isinstance(value, list | dict | set | tuple):
        raise InPlaceError(f"kubelet config {KUBELET_CONFIG}: {field} is not a string")
    return str(value)


def _picked(config: Mapping[str, Any], field: str, keys: tuple[str, ...]) -> dict[str, str | None]:
    values = config.get(field)
    if not isinstance(values, Mapping):
        return {}
    return {k: _scalar(v, f"{field}.{k}") for k, v in values.items() if k in keys}


def _policy(config: Mapping[str, Any]) -> str | None:
    return _scalar(config.get("cpuManagerPolicy"), "cpuManagerPolicy")


def _eviction(config: Mapping[str, Any]) -> dict[str, str | None]:
    return _picked(config, "evictionHard", EVICTION_SIGNALS)


def _reserved(config: Mapping[str, Any]) -> dict[str, str | None]:
    """The reserved resources that count; every quantity must parse (upstream parses them)."""
    reserved = config.get("kubeReserved")
    for name, quantity in reserved.items() if isinstance(reserved, Mapping) else ():
        text = _scalar(quantity, f"kubeReserved.{name}")
        if not _QUANTITY.match(str(text)):
            raise InPlaceError(f"kubeReserved quantity {shown(str(text))} does not parse")
    return _picked(config, "kubeReserved", RESERVED_RESOURCES)


_T = TypeVar("_T")


def _differs(read: Callable[[_T], object], old: _T | None, new: _T) -> bool:
    """Whether a setting differs between the applied OSC (``old``) and the new one. The new
    value must be readable (else this update fails). An applied value that cannot be read
    (None: its whole config) counts as changed: it was applied by an update that failed on it,
    and the update after it must not fail on it again."""
    wanted = read(new)
    if old is None:
        return True
    try:
        return read(old) != wanted
    except InPlaceError:
        return True


def kubelet_config_change(
    old: Mapping[str, Any] | None, new: Mapping[str, Any]
) -> tuple[bool, bool]:
    """(config changed, CPU manager policy changed), as upstream judges them: the eviction
    thresholds first, then the reserved resources (whose quantities must parse). ``old`` is
    None when the applied config cannot be read."""
    policy = _differs(_policy, old, new)
    changed = _differs(_eviction, old, new) or _differs(_reserved, old, new)
    return changed, policy


def _initiated(rotation: object, key: str) -> tuple[bool, datetime | None]:
    """(present, lastInitiationTime) of one rotation in ``credentialsRotation``."""
    if not isinstance(rotation, Mapping) or not isinstance(rotation.get(key), Mapping):
        return False, None
    raw = rotation[key].get("lastInitiationTime")
    if raw is None:
        return True, None
    if not isinstance(raw, str):
        raise InPlaceError(f"credentialsRotation.{key}.lastInitiationTime is not a string")
    try:
        return True, datetime.fromisoformat(raw)
    except ValueError as exc:
        raise InPlaceError(f"credentialsRotation.{key}.lastInitiationTime {shown(raw)}") from exc


def credentials_rotation(
    old: OperatingSystemConfig, new: OperatingSystemConfig
) -> tuple[bool, bool]:
    """(CA rotation, service account key rotation) begun between ``old`` and ``new``; a time
    of ``old`` that cannot be read counts as another time (see ``_differs``)."""
    old_spec, new_spec = old.spec.in_place_updates, new.spec.in_place_updates
    new_rot = new_spec.credentials_rotation if new_spec else None
    if new_rot is None:
        return False, False
    old_rot = old_spec.credentials_rotation if old_spec else None
    result = []
    for key in ("certificateAuthorities", "serviceAccountKey"):
        new_has, new_time = _initiated(new_rot, key)
        if old_rot is None:
            result.append(new_has and new_time is not None)
            continue
        try:
            old_has, old_time = _initiated(old_rot, key)
        except InPlaceError:
            result.append(new_has)
            continue
        result.append(old_has and new_has and old_time != new_time)
    return result[0], result[1]


def _cpu_policy_of(osc: OperatingSystemConfig) -> str | None:
    spec = osc.spec.in_place_updates
    if spec is not None and isinstance(spec.kubelet, KubeletUpdate):
        return spec.kubelet.cpu_manager_policy
    return None


def _kubelet_minor(osc: OperatingSystemConfig) -> int:
    spec = osc.spec.in_place_updates
    return parse_version(spec.kubelet_version if spec is not None else "")[1]


def detect(
    old: OperatingSystemConfig, new: OperatingSystemConfig, current_os: str | None
) -> InPlaceChanges:
    """What the change from ``old`` (applied) to ``new`` asks in place; nothing unless both
    carry ``spec.inPlaceUpdates`` (a first apply, or a pool that is not updated in place).
    Raises ``InPlaceError`` for a value of ``new`` that cannot be read; one of ``old`` counts
    as changed (``_differs``)."""
    old_spec, new_spec = old.spec.in_place_updates, new.spec.in_place_updates
    if old_spec is None or new_spec is None:
        return InPlaceChanges()
    minor = False
    if old_spec.kubelet_version != new_spec.kubelet_version:
        minor = _differs(_kubelet_minor, old, new)
    new_config = kubelet_config(new)
    try:
        old_config: dict[str, Any] | None = kubelet_config(old)
    except InPlaceError:
        old_config = None
    config, policy = kubelet_config_change(old_config, new_config)
    # newer Gardener also names the policy in spec.inPlaceUpdates.kubelet
    policy = policy or _cpu_policy_of(old) != _cpu_policy_of(new)
    ca, sa = credentials_rotation(old, new)
    return InPlaceChanges(
        operating_system=not os_up_to_date(current_os, new),
        kubelet_minor_version=minor,
        kubelet_config=config,
        cpu_manager_policy=policy,
        ca_rotation_kubelet=ca,
        ca_rotation_node_agent=ca,
        sa_key_rotation=sa,
    )


# -- the Node -----------------------------------------------------------------------------------


def _meta(node: Mapping[str, Any], key: str) -> Mapping[str, str]:
    return (node.get("metadata") or {}).get(key) or {}


def ready_for_update(node: Mapping[str, Any]) -> bool:
    """machine-controller-manager drained the node and lets it update: condition
    ``InPlaceUpdate`` with reason ``ReadyForUpdate`` (its status is not looked at, as upstream)."""
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(
        c.get("type") == CONDITION_IN_PLACE_UPDATE and c.get("reason") == REASON_READY_FOR_UPDATE
        for c in conditions
        if isinstance(c, Mapping)
    )


def update_result(node: Mapping[str, Any]) -> str | None:
    return _meta(node, "labels").get(LABEL_UPDATE_RESULT)


def may_update(node: Mapping[str, Any]) -> bool:
    """The drain gate: ready for the update, or an update that failed before and is retried."""
    return ready_for_update(node) or update_result(node) == RESULT_FAILED


def owes_outcome(node: Mapping[str, Any]) -> bool:
    """After a complete in-place update: whether the Node is still to be marked successful."""
    result = update_result(node)
    return (ready_for_update(node) and result != RESULT_SUCCESSFUL) or result == RESULT_FAILED


class CommandOutput:
    """The OS update command's output as it is read, in bounded memory: its size, its last
    ``keep`` bytes, and whether upstream's retry patterns occur anywhere in it. Upstream
    matches them against all of the output; so does this, a chunk at a time (with the end of
    the chunk before, so that a pattern split between two reads is found), so the decision is
    upstream's however long the output."""

    #: more than the longest pattern's match
    _OVERLAP = 64

    def __init__(self, keep: int = OUTPUT_KEPT) -> None:
        self.keep = keep
        self.total = 0
        self.tail = b""
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._carry = ""
        self._retriable = self._non_retriable = False

    @classmethod
    def of(cls, text: str) -> CommandOutput:
        out = cls()
        out.feed(text.encode())
        return out

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.tail = (self.tail + chunk)[-self.keep :]
        window = self._carry + self._decoder.decode(chunk)
        # Go's (?i) on these ASCII words, 30 times faster than a regular expression (a command
        # may print hundreds of MB): lower() maps the Kelvin sign to k, as Go's case folding
        # does, and the long s is the one other letter Go folds into them
        folded = window.lower().replace("\u017f", "s")
        self._retriable = self._retriable or any(w in folded for w in RETRIABLE)
        self._non_retriable = self._non_retriable or any(w in folded for w in NON_RETRIABLE)
        self._carry = window[-self._OVERLAP :]

    @property
    def kind(self) -> OutputKind:
        if self._retriable:
            return "retriable"
        return "non-retriable" if self._non_retriable else "unknown"

    def text(self) -> str:
        """The kept tail on one line (a character cut at its start dropped)."""
        tail = self.tail
        if self.total > len(tail):  # up to 3 continuation bytes of a character cut in two
            cut = next((i for i, b in enumerate(tail[:3]) if not 0x80 <= b < 0xC0), len(tail[:3]))
            tail = tail[cut:]
        return " ".join(tail.decode(errors="replace").split())

    def reported(self) -> str:
        """The output as the failure reason says it: all of it, or its tail and its size."""
        if self.total > len(self.tail):
            return f"output (its last {len(self.tail)} of {self.total} bytes): {self.text()}"
        return f"output: {self.text()}"


def bounded_reason(reason: str, limit: int = REASON_LIMIT) -> str:
    """``reason`` within ``limit`` UTF-8 bytes: its head (what failed) and its tail (a command's
    last words)."""
    return head_and_tail(reason, limit)


def updating_os_patch(version: str) -> dict[str, Any]:
    return {"metadata": {"annotations": {ANNOTATION_UPDATING_OS_VERSION: version}}}


def successful_patch() -> dict[str, Any]:
    """The update worked: the result label, and the failure reason and OS mark gone."""
    return {
        "metadata": {
            "labels": {LABEL_UPDATE_RESULT: RESULT_SUCCESSFUL},
            "annotations": {
                ANNOTATION_UPDATE_FAILED_REASON: None,
                ANNOTATION_UPDATING_OS_VERSION: None,
            },
        }
    }


def failed_patch(reason: str | None) -> dict[str, Any]:
    """The update failed: the result label and the reason (bounded; None: the label alone,
    any earlier reason removed)."""
    return {
        "metadata": {
            "labels": {LABEL_UPDATE_RESULT: RESULT_FAILED},
            "annotations": {
                ANNOTATION_UPDATE_FAILED_REASON: None if reason is None else bounded_reason(reason)
            },
        }
    }


def rolled_back_os(node: Mapping[str, Any], desired: str) -> bool:
    """The Node says an OS update to ``desired`` was tried before, and the host is still not on
    it: the OS went back to its previous version (upstream calls it failed, for good)."""
    tried = _meta(node, "annotations").get(ANNOTATION_UPDATING_OS_VERSION)
    if tried is None:
        return False
    try:
        return same_version(tried, desired)
    except InPlaceError:
        return False


# -- plan -------------------------------------------------------------------------------------


class InPlacePlan(BaseModel):
    """What ``node-agent plan`` shows of an OSC's in-place parts: what a change from the applied
    OSC would ask, before the agent detects (and persists) it."""

    model_config = ConfigDict(frozen=True)

    #: the parts detected (``InPlaceChanges.names``), empty when nothing happens in place
    parts: tuple[str, ...] = ()
    #: why nothing is compared (no applied OSC, or it has no ``inPlaceUpdates``)
    skipped: str | None = None
    #: why the change cannot be computed (the agent fails the update the same way)
    error: str | None = None
    current_os: str | None = None
    target_os: str = ""
    kubelet_from: str = ""
    kubelet_to: str = ""
    os_update_command: str = ""


def plan(
    old: OperatingSystemConfig | None, new: OperatingSystemConfig, os_release: str | None
) -> InPlacePlan | None:
    """The in-place parts of applying ``new`` over ``old`` (the applied OSC) on a host whose
    os-release text is ``os_release``; None for a pool that is not updated in place."""
    spec = new.spec.in_place_updates
    if spec is None:
        return None
    status = new.status.in_place_updates
    update = (status.os_update if status is not None else None) or {}
    args = " ".join(str(a) for a in update.get("args") or ())
    command = " ".join(filter(None, (str(update.get("command") or ""), args)))
    result = InPlacePlan(target_os=spec.operating_system_version, os_update_command=command)
    try:
        current = os_version(os_release) if os_release is not None else None
    except InPlaceError as exc:
        return result.model_copy(update={"error": str(exc)})
    result = result.model_copy(update={"current_os": current})
    old_spec = old.spec.in_place_updates if old is not None else None
    if old is None or old_spec is None:
        why = "no OSC applied yet" if old is None else "the applied OSC has no inPlaceUpdates"
        return result.model_copy(update={"skipped": why})
    try:
        changes = detect(old, new, current)
    except InPlaceError as exc:
        return result.model_copy(update={"error": str(exc)})
    return result.model_copy(
        update={
            "parts": changes.names(),
            "kubelet_from": old_spec.kubelet_version,
            "kubelet_to": spec.kubelet_version,
        }
    )


def describe(found: InPlacePlan) -> list[str]:
    """The plan's in-place lines, as ``node-agent plan`` prints them."""
    if found.error is not None:
        return [f"in-place update: not computed: {found.error}"]
    if found.skipped is not None:
        return [f"in-place update: none ({found.skipped})"]
    if not found.parts:
        return ["in-place update: none"]
    lines = [f"in-place update: {', '.join(found.parts)}"]
    if "operating_system" in found.parts:
        lines.append(
            f"  operating_system: {found.current_os} -> {found.target_os} "
            f"(runs {found.os_update_command or '(no command in the OSC)'}, then a reboot)"
        )
    if "kubelet_minor_version" in found.parts:
        lines.append(f"  kubelet: {found.kubelet_from} -> {found.kubelet_to} (health awaited)")
    if "cpu_manager_policy" in found.parts:
        lines.append(
            f"  cpu_manager_policy: {CPU_MANAGER_STATE} removed before the kubelet restarts"
        )
    lines.append(
        f"  waits for the Node's condition {CONDITION_IN_PLACE_UPDATE} with reason "
        f"{REASON_READY_FOR_UPDATE} before anything is applied"
    )
    return lines
