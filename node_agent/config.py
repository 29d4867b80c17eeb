"""Settings: Gardener's ``NodeAgentConfiguration`` as shipped in user-data, plus our own knobs.

The component config is read unchanged from what Gardener writes (camelCase, Go durations), as
the Gardener release that wrote it reads it (``config-<release>.yaml``: up to v1.146 the cluster
CA is ``apiServer.caBundle``, from v1.147 on the file ``apiServer.caFile``; see
:data:`RELEASE_RULES`). An unknown field is ignored, as upstream's lenient decoder ignores it,
and logged as a warning naming it. Defaults follow upstream's defaulting. Settings that Gardener
has no field for (paths, the agent's own unit name, timeouts) live in ``AgentSettings``, each
with its default documented next to it.
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticUseDefault

from node_agent.base import versions
from node_agent.base.configfile import config_release, read_config_file
from node_agent.base.configfile import config_version_key as config_version_key
from node_agent.base.configfile import find_config as find_config
from node_agent.base.durations import format_duration, parse_duration, parse_go_duration_ns
from node_agent.base.errors import ConfigError
from node_agent.base.goyaml import describe_yaml_error, load_go_yaml
from node_agent.base.layout import AGENT_UNIT
from node_agent.base.layout import BASE_DIR as BASE_DIR
from node_agent.base.layout import BOOTSTRAP_TOKEN_FILE as BOOTSTRAP_TOKEN_FILE
from node_agent.base.layout import CONFIG_FILE as CONFIG_FILE
from node_agent.base.layout import CREDENTIALS_DIR as CREDENTIALS_DIR
from node_agent.base.layout import KUBECONFIG_FILE as KUBECONFIG_FILE
from node_agent.base.layout import TOKEN_FILE as TOKEN_FILE
from node_agent.base.log import get_logger

log = get_logger("node-agent.config")

API_VERSION = "nodeagent.config.gardener.cloud/v1alpha1"
KIND = "NodeAgentConfiguration"

# Upstream's on-disk layout; every path is relative to the --root prefix. The agent's own
# directory and credentials are defined in node_agent.base.layout (re-exported above).
CLUSTER_CA_FILE = f"{BASE_DIR}/cluster-ca.crt"
MACHINE_NAME_FILE = f"{BASE_DIR}/machine-name"
ZONE_FILE = f"{BASE_DIR}/zone"

#: a duration of this agent's own settings (``nodeAgent``): Go spelling or a number of seconds
Duration = Annotated[timedelta, BeforeValidator(parse_duration)]


def _zero_is_unset(value: object) -> object:
    """Gardener's encoder writes Go zero values for fields it does not set (``kubeconfig: ""``,
    ``qps: 0``, ``logLevel: ""``); upstream's defaulting treats them as unset, so do we."""
    if value == "" or (value == 0 and not isinstance(value, bool)):
        raise PydanticUseDefault()
    return value


#: a field whose zero value ("" or 0) takes the default, as upstream's SetDefaults_* do
ZeroIsUnset = BeforeValidator(_zero_is_unset)


# --- Gardener's fields are decoded as Go's encoding/json decodes them -------------------------
# Upstream turns the YAML into JSON and unmarshals it into typed Go fields: a string is never a
# number, a number never a string, a bool only true/false, an int32 stays in range. pydantic
# alone would coerce "5" into 5 and "true" into True, accepting files upstream refuses.


def _go_string(value: object) -> object:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value


def _go_bool(value: object) -> object:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {type(value).__name__}")
    return value


def _go_int(bits: int) -> BeforeValidator:
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1

    def check(value: object) -> object:
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # YAML 1.0 reaches Go's decoder as the JSON number 1
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {type(value).__name__}")
        if not low <= value <= high:
            raise ValueError(f"{value} does not fit a {bits}-bit integer")
        return value

    return BeforeValidator(check)


_FLOAT32_MAX = 3.4028234663852886e38


def _go_float32(value: object) -> object:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected a number, got {type(value).__name__}")
    if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
        raise ValueError(f"{value} does not fit a 32-bit float")
    return value


def _shown(value: object) -> str:
    """A value of the file for an error message, in one short line: a collection by its kind
    only (its repr could be megabytes long, or 10,000 levels deep)."""
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _go_duration(value: object) -> object:
    """metav1.Duration: a string in Go's duration syntax (a number is refused)."""
    if isinstance(value, timedelta):
        return value  # set in code, not read from a file
    if not isinstance(value, str):
        raise ValueError(f"expected a Go duration string such as 1m30s, got {_shown(value)}")
    # whole microseconds, rounded down: a comparison with a whole-second minimum stays exact
    return timedelta(microseconds=parse_go_duration_ns(value) // 1000)


def _go_bytes(value: object) -> object:
    """A Go ``[]byte`` as encoding/json reads it: a base64 string (standard alphabet, padded;
    line breaks skipped), or a list of numbers 0-255."""
    if isinstance(value, bytes):
        return value  # set in code, not read from a file
    if isinstance(value, list):
        if all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= 255 for b in value):
            return bytes(value)
        raise ValueError("expected a list of bytes (0-255)")
    if not isinstance(value, str):
        raise ValueError(f"expected a base64 string, got {type(value).__name__}")
    try:
        return base64.b64decode(value.replace("\r", "").replace("\n", ""), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"illegal base64 data ({exc})") from exc


GoString = BeforeValidator(_go_string)
GoBytes = BeforeValidator(_go_bytes)
GoBool = BeforeValidator(_go_bool)
GoInt32 = _go_int(32)
GoInt64 = _go_int(64)
GoFloat32 = BeforeValidator(_go_float32)
#: a duration of Gardener's config (``metav1.Duration``)
GoDuration = Annotated[timedelta, BeforeValidator(_go_duration)]


def kubernetes_version(value: object) -> str:
    """The version read as upstream decodes it (Masterminds' ``NewVersion``, see
    :func:`node_agent.base.versions.semver`) and printed as upstream prints it (``v1.33`` is
    ``1.33.0``): what the Node's ``worker.gardener.cloud/kubernetes-version`` label carries."""
    if not isinstance(value, str):
        raise ValueError(f"expected a version string such as 1.33.4, got {_shown(value)}")
    return versions.semver(value).text()


KubernetesVersion = BeforeValidator(kubernetes_version)


class _Config(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """A null field is an absent one: Go decodes null into a struct, slice, map or pointer
        as its zero value, and upstream's defaulting then fills it in."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class ClientConnection(_Config):
    kubeconfig: Annotated[str, ZeroIsUnset, GoString] = Field(
        default=KUBECONFIG_FILE, description="kubeconfig of the agent"
    )
    #: read (and type-checked) as upstream does; this agent speaks JSON whatever they say
    accept_content_types: Annotated[str, GoString] = Field(default="", alias="acceptContentTypes")
    content_type: Annotated[str, GoString] = Field(default="", alias="contentType")
    qps: Annotated[float, ZeroIsUnset, GoFloat32] = 50.0
    burst: Annotated[int, ZeroIsUnset, GoInt32] = 100


class ServerEndpoint(_Config):
    bind_address: Annotated[str, GoString] = Field(
        default="", alias="bindAddress", description="'' = all addresses"
    )
    port: Annotated[int, GoInt64]


class HealthProbesEndpoint(ServerEndpoint):
    port: Annotated[int, ZeroIsUnset, GoInt64] = 2751


class MetricsEndpoint(ServerEndpoint):
    port: Annotated[int, ZeroIsUnset, GoInt64] = 2752


class ServerConfiguration(_Config):
    health_probes: HealthProbesEndpoint = Field(
        default=HealthProbesEndpoint(), alias="healthProbes", description="/healthz, /readyz"
    )
    metrics: MetricsEndpoint = Field(default=MetricsEndpoint(), description="Prometheus metrics")


class APIServer(_Config):
    server: Annotated[str, GoString] = ""
    #: releases from v1.147 on: upstream leaves an empty caFile empty; Gardener always writes the
    #: cluster CA's path, which is also what we take for "" (an empty host path would stop the
    #: agent)
    ca_file: Annotated[str, ZeroIsUnset, GoString] = Field(default=CLUSTER_CA_FILE, alias="caFile")
    #: releases up to v1.146: the cluster CA bundle itself (b"" when the file has none: upstream
    #: then trusts the system's roots); None for a release that names a file instead
    ca_bundle: Annotated[bytes, GoBytes] | None = Field(default=None, alias="caBundle")


class BootstrapConfiguration(_Config):
    kubelet_data_volume_size: Annotated[int, GoInt64] | None = Field(
        default=None, alias="kubeletDataVolumeSize"
    )


class DebuggingConfiguration(_Config):
    """Upstream's profiling switches: read and type-checked, not acted on (no pprof here)."""

    enable_profiling: Annotated[bool, GoBool] | None = Field(default=None, alias="enableProfiling")
    enable_contention_profiling: Annotated[bool, GoBool] | None = Field(
        default=None, alias="enableContentionProfiling"
    )


class OSCControllerConfig(_Config):
    sync_period: GoDuration = Field(
        default=timedelta(minutes=10),
        alias="syncPeriod",
        description="full re-check of the OSC and the disk even without events (min 15s)",
    )
    secret_name: Annotated[str, GoString] = Field(default="", alias="secretName")
    #: as upstream prints it (``v1.33`` reads as ``1.33.0``); required by validate_config
    kubernetes_version: Annotated[str, KubernetesVersion] | None = Field(
        default=None, alias="kubernetesVersion"
    )


class TokenSyncConfig(_Config):
    #: both required by validate_config (upstream's decoder leaves a missing one empty)
    secret_name: Annotated[str, GoString] = Field(default="", alias="secretName")
    path: Annotated[str, GoString] = ""


class TokenControllerConfig(_Config):
    sync_configs: tuple[TokenSyncConfig, ...] = Field(default=(), alias="syncConfigs")
    sync_period: GoDuration = Field(default=timedelta(hours=1), alias="syncPeriod")


class SystemdUnitCheckConfig(_Config):
    sync_period: GoDuration = Field(default=timedelta(minutes=1), alias="syncPeriod")
    stuck_threshold: GoDuration = Field(default=timedelta(minutes=5), alias="stuckThreshold")


class ControllerConfiguration(_Config):
    operating_system_config: OSCControllerConfig = Field(
        default=OSCControllerConfig(), alias="operatingSystemConfig"
    )
    token: TokenControllerConfig = TokenControllerConfig()
    systemd_unit_check: SystemdUnitCheckConfig = Field(
        default=SystemdUnitCheckConfig(), alias="systemdUnitCheck"
    )


class HealthGateConfig(_Config):
    """The health-gated apply (our extension): units an apply restarted are watched for
    ``settleWindow``; one that was healthy before and breaks rolls the node back."""

    enabled: bool = True
    settle_window: Duration = Field(default=timedelta(seconds=30), alias="settleWindow")


class RestartGuardConfig(_Config):
    """The restart-storm guard (our extension): a unit the agent restarted ``maxRestarts``
    times within ``window`` and that keeps failing is left alone until the OSC changes or it
    comes up by itself."""

    max_restarts: int = Field(default=3, alias="maxRestarts", ge=1)
    window: Duration = Field(default=timedelta(minutes=10))


class HealthCheckConfig(_Config):
    """Health checks of kubelet and containerd (our extension; upstream hard-codes them)."""

    enabled: bool = True
    #: kubelet's /healthz URL; empty: the address kubelet serves it on, from the flags of the
    #: OSC's kubelet unit and its config file (``--config``), else http://127.0.0.1:10248/healthz
    kubelet_healthz: str = Field(default="", alias="kubeletHealthz")
    containerd_socket: str = Field(
        default="/run/containerd/containerd.sock", alias="containerdSocket"
    )
    sync_period: Duration = Field(default=timedelta(seconds=20), alias="syncPeriod")
    timeout: Duration = Field(default=timedelta(seconds=10))
    restart_after: Duration = Field(default=timedelta(minutes=1), alias="restartAfter")


class ImagesConfig(_Config):
    """Files from container images (imageRef): ``pullTimeout`` bounds one image's pull, after
    which its files fail (naming the image) and the units that use them are not restarted;
    nothing else of an OSC waits for a pull."""

    pull_timeout: Duration = Field(
        default=timedelta(minutes=5), alias="pullTimeout", gt=timedelta(0)
    )


class RolloutConfig(_Config):
    """Rollout coordination of the pool (serial mode, paced rollout): what the Secret's
    annotations do not carry. ``serialLeaseDuration`` is Gardener's fixed 600 s; change it only
    in tests. A node that has to wait checks again after a random time between ``recheckMin``
    and ``recheckMax`` (and at once when the Secret changes)."""

    serial_lease_duration: Duration = Field(
        default=timedelta(seconds=600), alias="serialLeaseDuration"
    )
    recheck_min: Duration = Field(default=timedelta(seconds=5), alias="recheckMin")
    recheck_max: Duration = Field(default=timedelta(seconds=15), alias="recheckMax")


class NodeAgentExtensions(_Config):
    """Settings of this agent beyond Gardener's config, under the top-level key ``nodeAgent``
    of the same file (Gardener's agent ignores unknown keys, so the file stays valid for it).
    Every field has a safe default; the whole section may be absent."""

    health_gate: HealthGateConfig = Field(default=HealthGateConfig(), alias="healthGate")
    restart_guard: RestartGuardConfig = Field(default=RestartGuardConfig(), alias="restartGuard")
    health_check: HealthCheckConfig = Field(default=HealthCheckConfig(), alias="healthCheck")
    rollout: RolloutConfig = RolloutConfig()
    images: ImagesConfig = ImagesConfig()

    def dump(self) -> dict[str, Any]:
        """camelCase with Go durations, as the file carries it."""
        data: dict[str, Any] = _go_durations(self.model_dump(by_alias=True, mode="python"))
        return data


def _go_durations(value: Any) -> Any:
    if isinstance(value, timedelta):
        return format_duration(value)
    if isinstance(value, dict):
        return {k: _go_durations(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class ReleaseRules:
    """What a NodeAgentConfiguration of one Gardener release holds and upstream accepts."""

    #: the first release these rules hold for (until the next entry's)
    since: str
    #: how the cluster CA reaches the agent: the bundle inline or a file's path
    ca_field: typing.Literal["caBundle", "caFile"]
    #: the Kubernetes minors the release supports (any patch of them is accepted)
    kubernetes_minors: tuple[tuple[int, int], ...]


_MINORS_1_31 = ((1, 31), (1, 32), (1, 33), (1, 34), (1, 35))
_MINORS_1_32 = ((1, 32), (1, 33), (1, 34), (1, 35), (1, 36))

#: Gardener's releases as their agents read the config, oldest first (checked against upstream
#: binaries of v1.141.0 and v1.145.0 to v1.150.0). A release between two entries follows the
#: older one; one older than the first follows the first; a config whose file name carries no
#: release (``config.yaml``) follows the newest.
RELEASE_RULES: tuple[ReleaseRules, ...] = (
    ReleaseRules("v1.141.0", "caBundle", _MINORS_1_31),
    ReleaseRules("v1.145.0", "caBundle", _MINORS_1_32),
    ReleaseRules("v1.147.0", "caFile", _MINORS_1_32),
)
#: the field each rule set has no use for (the other release's CA field), by its path
_CA_FIELDS = {"caBundle": "apiServer.caBundle", "caFile": "apiServer.caFile"}


def release_rules(release: str | None) -> ReleaseRules:
    """The rules of the Gardener release ``release`` (``v1.145.0``); None: the newest."""
    if release is None:
        return RELEASE_RULES[-1]
    wanted = versions.precedence(versions.semver(release))
    chosen = RELEASE_RULES[0]
    for rules in RELEASE_RULES:
        if versions.precedence(versions.semver(rules.since)) <= wanted:
            chosen = rules
    return chosen


class NodeAgentConfiguration(_Config):
    """Gardener's component config, ``nodeagent.config.gardener.cloud/v1alpha1``."""

    #: the Gardener release whose agent reads this config (from ``config-<release>.yaml``)
    _release: str | None = PrivateAttr(default=None)

    api_version: Annotated[str, ZeroIsUnset, GoString] = Field(
        default=API_VERSION, alias="apiVersion"
    )
    kind: Annotated[str, ZeroIsUnset, GoString] = KIND
    client_connection: ClientConnection = Field(
        default=ClientConnection(), alias="clientConnection"
    )
    log_level: Annotated[str, ZeroIsUnset, GoString] = Field(default="info", alias="logLevel")
    log_format: Annotated[str, ZeroIsUnset, GoString] = Field(default="json", alias="logFormat")
    server: ServerConfiguration = ServerConfiguration()
    debugging: DebuggingConfiguration | None = None
    feature_gates: dict[str, Annotated[bool, GoBool]] = Field(
        default_factory=dict, alias="featureGates"
    )
    api_server: APIServer = Field(default=APIServer(), alias="apiServer")
    bootstrap: BootstrapConfiguration | None = None
    controllers: ControllerConfiguration = ControllerConfiguration()
    #: this agent's own settings (not Gardener's); see NodeAgentExtensions
    node_agent: NodeAgentExtensions = Field(default=NodeAgentExtensions(), alias="nodeAgent")

    def dump(self) -> dict[str, Any]:
        """The config as Gardener would write it (camelCase, Go durations)."""
        data: dict[str, Any] = self.model_dump(by_alias=True, mode="json", exclude_none=True)
        controllers = data["controllers"]
        osc = self.controllers.operating_system_config
        controllers["operatingSystemConfig"]["syncPeriod"] = format_duration(osc.sync_period)
        controllers["token"]["syncPeriod"] = format_duration(self.controllers.token.sync_period)
        check = self.controllers.systemd_unit_check
        controllers["systemdUnitCheck"] = {
            "syncPeriod": format_duration(check.sync_period),
            "stuckThreshold": format_duration(check.stuck_threshold),
        }
        api_server = data["apiServer"]
        if self.api_server.ca_bundle is None:
            api_server.pop("caBundle", None)
        else:  # a release up to v1.146: the bundle, as Go encodes a []byte, and no file
            api_server.pop("caFile", None)
            api_server["caBundle"] = base64.b64encode(self.api_server.ca_bundle).decode()
        if self.node_agent == NodeAgentExtensions():
            data.pop("nodeAgent", None)  # as Gardener writes it: without our section
        else:
            data["nodeAgent"] = self.node_agent.dump()
        return data

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.dump(), sort_keys=False)

    @property
    def release(self) -> str | None:
        """The Gardener release that wrote this config; None when its file name says none."""
        return self._release

    @property
    def rules(self) -> ReleaseRules:
        return release_rules(self._release)


# --- upstream's validation (ValidateNodeAgentConfiguration, the same v1.141.0 to v1.150.0) -----

MIN_SYNC_PERIOD = timedelta(seconds=15)
MIN_STUCK_THRESHOLD = timedelta(seconds=30)
LOG_LEVELS = ("debug", "info", "error")
LOG_FORMATS = ("json", "text")
#: the only feature gates upstream's agent knows: component-base's own (it registers none)
FEATURE_GATES = ("AllAlpha", "AllBeta")
#: the Kubernetes minor versions the newest release supports (each release's: RELEASE_RULES)
SUPPORTED_KUBERNETES_MINORS = RELEASE_RULES[-1].kubernetes_minors
#: upstream's escape hatch: "true" accepts any kubernetesVersion (at the operator's own risk)
DISABLE_VERSION_CHECK_ENV = "EXPERIMENTAL_DISABLE_KUBERNETES_VERSION_CHECK"


def _supported_kubernetes_version(version: str, minors: tuple[tuple[int, int], ...]) -> bool:
    read = versions.semver(version)
    return (read.major, read.minor) in minors


def validate_config(
    config: NodeAgentConfiguration, environ: Mapping[str, str] | None = None
) -> list[str]:
    """What upstream refuses to start with, one ``field: why`` per problem (empty: valid).

    Kept apart from decoding (``NodeAgentConfiguration.model_validate``), as upstream keeps
    its Validate apart from its decoder: code and tests may build a config that runs a
    controller faster than a node should."""
    env = os.environ if environ is None else environ
    problems: list[str] = []
    if config.client_connection.burst < 0:
        problems.append(
            f"clientConnection.burst: must not be negative, got {config.client_connection.burst}"
        )
    if config.log_level not in LOG_LEVELS:
        problems.append(f"logLevel: {_shown(config.log_level)} is none of {', '.join(LOG_LEVELS)}")
    if config.log_format not in LOG_FORMATS:
        problems.append(
            f"logFormat: {_shown(config.log_format)} is none of {', '.join(LOG_FORMATS)}"
        )
    for gate in config.feature_gates:
        if gate not in FEATURE_GATES:
            known = ", ".join(FEATURE_GATES)
            problems.append(f"featureGates: unknown feature gate {_shown(gate)} (known: {known})")

    def at_least(path: str, value: timedelta, minimum: timedelta) -> None:
        if value < minimum:
            problems.append(
                f"{path}: must be at least {format_duration(minimum)}, got {format_duration(value)}"
            )

    controllers = "controllers"
    osc = config.controllers.operating_system_config
    if not osc.secret_name:
        problems.append(
            f"{controllers}.operatingSystemConfig.secretName: required (the OSC Secret's name)"
        )
    at_least(f"{controllers}.operatingSystemConfig.syncPeriod", osc.sync_period, MIN_SYNC_PERIOD)
    version_path = f"{controllers}.operatingSystemConfig.kubernetesVersion"
    if osc.kubernetes_version is None:
        problems.append(f"{version_path}: required (the worker pool's Kubernetes version)")
    elif (
        not _supported_kubernetes_version(osc.kubernetes_version, config.rules.kubernetes_minors)
        and env.get(DISABLE_VERSION_CHECK_ENV) != "true"
    ):
        supported = ", ".join(f"{a}.{b}" for a, b in config.rules.kubernetes_minors)
        problems.append(
            f"{version_path}: {osc.kubernetes_version} is not a supported Kubernetes version "
            f"({supported}; {DISABLE_VERSION_CHECK_ENV}=true accepts it anyway)"
        )
    token = config.controllers.token
    paths: set[str] = set()
    for index, sync in enumerate(token.sync_configs):
        item = f"{controllers}.token.syncConfigs[{index}]"
        if not sync.secret_name:
            problems.append(f"{item}.secretName: required (the Secret holding the token)")
        if not sync.path:
            problems.append(f"{item}.path: required (where the token is written)")
        elif sync.path in paths:
            problems.append(f"{item}.path: {sync.path} is already the path of another token")
        paths.add(sync.path)
    at_least(f"{controllers}.token.syncPeriod", token.sync_period, MIN_SYNC_PERIOD)
    check = config.controllers.systemd_unit_check
    at_least(f"{controllers}.systemdUnitCheck.syncPeriod", check.sync_period, MIN_SYNC_PERIOD)
    at_least(
        f"{controllers}.systemdUnitCheck.stuckThreshold", check.stuck_threshold, MIN_STUCK_THRESHOLD
    )
    return problems


def _type_meta(data: dict[Any, Any], source: str) -> None:
    """Upstream's decoder fills an empty or missing apiVersion/kind with its own; any other
    group, version or kind is not a NodeAgentConfiguration."""
    for key, wanted in (("apiVersion", API_VERSION), ("kind", KIND)):
        value = data.get(key)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise ConfigError(f"{source}: {key}: expected a string, got {type(value).__name__}")
        if value != wanted:
            raise ConfigError(
                f"{source}: expected apiVersion {API_VERSION} kind {KIND}, "
                f"got {_shown(data.get('apiVersion'))} {_shown(data.get('kind'))}"
            )


def _field_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The config section a field holds, and whether it holds a list of them."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _model_of(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            model, many = _model_of(arg)
            if model is not None:
                return model, many
    if origin is tuple:
        model, _ = _model_of(typing.get_args(annotation)[0])
        return model, model is not None
    return None, False


def _unknown_fields(data: Mapping[Any, Any], model: type[BaseModel], prefix: str) -> list[str]:
    """Every key of ``data`` that ``model`` has no field for, by its path in the file."""
    fields = {(f.alias or name): f for name, f in model.model_fields.items()}
    unknown: list[str] = []
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        field = fields.get(str(key))
        if field is None:
            unknown.append(path)
            continue
        section, many = _model_of(field.annotation)
        if section is None:
            continue
        if many and isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, dict):
                    unknown += _unknown_fields(item, section, f"{path}[{index}]")
        elif not many and isinstance(value, dict):
            unknown += _unknown_fields(value, section, path)
    return unknown


def decode_config(
    raw: bytes | str, *, source: str = "config", release: str | None = None
) -> NodeAgentConfiguration:
    """The config as upstream's decoder and defaulting read it, not yet validated.

    ``release`` is the Gardener release whose agent reads the file (by default the one its
    name ``source`` carries, ``config-<release>.yaml``; none: the newest); its rules
    (:data:`RELEASE_RULES`) decide which CA field is read. Upstream's decoder is lenient: a
    field it does not know is ignored; here each such field is also a warning naming it.

    Whatever the bytes, the answer is the config or a ``ConfigError`` naming ``source``, in one
    line: the YAML reader keeps upstream's depth and alias limits and uses no Python stack per
    level, and no message shows more than a short piece of a value."""
    if release is None:
        release = config_release(os.path.basename(source))
    rules = release_rules(release)
    try:
        data = load_go_yaml(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {describe_yaml_error(exc)}") from exc
    except ValueError as exc:
        raise ConfigError(f"{source}: not valid as JSON, as upstream reads it: {exc}") from exc
    if not isinstance(data, dict):
        got = "an empty file" if data is None else type(data).__name__
        raise ConfigError(f"{source}: expected a mapping, got {got}")
    _type_meta(data, source)
    # the other releases' CA field is unknown to this release's agent
    unused = "caFile" if rules.ca_field == "caBundle" else "caBundle"
    api_server = data.get("apiServer")
    if isinstance(api_server, dict) and unused in api_server:
        data = {**data, "apiServer": {k: v for k, v in api_server.items() if k != unused}}
    unknown = _unknown_fields(data, NodeAgentConfiguration, "")
    if isinstance(api_server, dict) and unused in api_server:
        unknown.append(_CA_FIELDS[unused])
    for field in unknown:
        log.warning(
            "unknown config field ignored",
            field=field,
            config=source,
            release=release or "newest",
        )
    try:
        # only Gardener's spelling: upstream ignores a key such as secret_name
        config = NodeAgentConfiguration.model_validate(data, by_alias=True, by_name=False)
    except ValidationError as exc:
        problems = [
            f"{_field_path(e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        ]
        raise ConfigError(f"{source}: {'; '.join(problems)}") from exc
    if rules.ca_field == "caBundle" and config.api_server.ca_bundle is None:
        # no bundle: upstream's agent has no CA data and trusts the system's roots
        api = config.api_server.model_copy(update={"ca_bundle": b""})
        config = config.model_copy(update={"api_server": api})
    config._release = release
    return config


def parse_config(raw: bytes | str, *, source: str = "config") -> NodeAgentConfiguration:
    """Decode and validate a NodeAgentConfiguration as upstream does before it starts; the
    error names the file and every field that is wrong."""
    config = decode_config(raw, source=source)
    problems = validate_config(config)
    if problems:
        raise ConfigError(f"{source}: {'; '.join(problems)}")
    return config


def load_config(path: Path, *, validate: bool = True) -> NodeAgentConfiguration:
    """The config file at ``path``; ``validate=False`` for a reader that only reports (``status``
    must show what a config says even when the agent refuses to start with it). Only a regular
    file of a config's size is read (:func:`node_agent.base.configfile.read_config_file`)."""
    raw = read_config_file(path)
    if validate:
        return parse_config(raw, source=str(path))
    return decode_config(raw, source=str(path))


class AgentSettings(_Config):
    """Knobs of this agent that Gardener's config has no field for. Defaults suit a real node."""

    root: Path = Field(default=Path("/"), description="prefix for every host path (--root)")
    config_file: str = Field(default=CONFIG_FILE, description="NodeAgentConfiguration path")
    agent_unit: str = Field(
        default=AGENT_UNIT,
        description="the agent's own systemd unit: restarted last, never stopped or removed",
    )
    status_socket: str = Field(
        default="/run/gardener-node-agent/status.sock",
        description="unix socket (0600) that `node-agent status` talks to",
    )
    request_timeout: float = Field(default=15.0, description="seconds per API request")
    systemd_job_timeout: float = Field(
        default=60.0, description="seconds to wait for one start/stop/restart job"
    )
